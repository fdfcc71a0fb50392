//! The lane gate ([`in_lane`]) and the per-scenario result line ([`Scenario`]).

use std::fs;
use std::path::Path;
use std::time::Instant;

use crate::harness::NVMET;

/// Whether this process may run a scenario (see the module docs).
pub(crate) fn in_lane() -> bool {
    if std::env::var("PILLAR_KERNEL_LANE").as_deref() != Ok("1") {
        println!(
            "SKIP: PILLAR_KERNEL_LANE is not set: this scenario tears down all nvmet state and \
             runs only inside the kernel-lane VM (tests/kernel-lane/run.sh)"
        );
        return false;
    }
    assert!(
        Path::new(NVMET).is_dir() && Path::new("/dev/nvme-fabrics").exists(),
        "PILLAR_KERNEL_LANE=1 but this kernel has no nvmet ({NVMET}) or NVMe fabrics host"
    );
    true
}

pub(crate) fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "?".into(), |s| s.trim().to_owned())
}

/// Prints one result line when the scenario ends (after the lab's cleanup, which is declared
/// later and so dropped first). `run.sh` collects these lines.
pub(crate) struct Scenario {
    name: &'static str,
    t0: Instant,
}

impl Scenario {
    pub(crate) fn start(name: &'static str) -> Self {
        println!("=== scenario {name} on kernel {}", kernel_release());
        Self {
            name,
            t0: Instant::now(),
        }
    }

    pub(crate) fn step(&self, what: &str) {
        println!(
            "--- [{:>6.1}s] {}: {what}",
            self.t0.elapsed().as_secs_f64(),
            self.name
        );
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        let result = if std::thread::panicking() {
            "FAIL"
        } else {
            "PASS"
        };
        println!(
            "KERNEL-LANE-RESULT scenario={} result={result} seconds={:.1} kernel={}",
            self.name,
            self.t0.elapsed().as_secs_f64(),
            kernel_release()
        );
    }
}
