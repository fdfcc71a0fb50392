//! Benchmark helpers: the synchronous durable replace the designs compare against, latency recording and percentiles, CPU time, an in-process agent.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

pub mod agent;

/// A fencing mark of the agent's size and shape (its content does not matter here).
pub const MARK: &[u8] = br#"{"format":1,"mark":{"volume":"pvc-00000000-0000-0000-0000-000000000000","owner_uid":"6f1c0b1e-93c5-4c43-9d1a-0d1c6b7f2a10","generation":12345,"ended":false,"retired_uids":[]},"sha256":"0000000000000000000000000000000000000000000000000000000000000000"}"#;

/// One durable replace the way the synchronous designs do it, on an open directory descriptor:
/// openat temp, write, fsync, close, renameat, fsync directory (6 syscalls; the io_uring engine
/// counts its own).
pub fn sync_update(dir: &Path, dirfd: &std::fs::File, name: &str) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(MARK)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, dir.join(name))?;
    dirfd.sync_all()
}

/// CPU time (user + system) this process used so far, in seconds.
pub fn cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `struct rusage` through the pointer, which points to memory
    // sized and aligned for it; it reads nothing from it.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return f64::NAN;
    }
    // SAFETY: getrusage succeeded, so it initialised the whole struct (and zeroed is valid).
    let usage = unsafe { usage.assume_init() };
    #[allow(clippy::cast_precision_loss)]
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// Latencies of one run.
#[derive(Debug, Default, Clone)]
pub struct Latencies(Vec<Duration>);

impl Latencies {
    /// Records one sample.
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    /// Merges another run's samples.
    pub fn extend(&mut self, other: Latencies) {
        self.0.extend(other.0);
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The `q` quantile (0.0..=1.0) in microseconds, nearest-rank.
    pub fn quantile_us(&mut self, q: f64) -> f64 {
        if self.0.is_empty() {
            return 0.0;
        }
        self.0.sort_unstable();
        let n = self.0.len();
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
        self.0[rank - 1].as_secs_f64() * 1e6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let mut l = Latencies::default();
        for us in 1..=100 {
            l.push(Duration::from_micros(us));
        }
        assert!((l.quantile_us(0.5) - 50.0).abs() < 1e-9);
        assert!((l.quantile_us(0.99) - 99.0).abs() < 1e-9);
        assert!((l.quantile_us(1.0) - 100.0).abs() < 1e-9);
    }
}
