//! Machine state: configfs/sysfs helpers, reset, storage-node teardown (nvmet, loop devices),
//! host side (controllers, mounts).

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::harness::NVMET;

pub(crate) fn lane_root() -> PathBuf {
    std::env::var_os("PILLAR_LANE_DIR")
        .map_or_else(|| PathBuf::from("/tmp/pillar-lane"), PathBuf::from)
}

pub(crate) fn read_attr(path: &Path) -> String {
    fs::read_to_string(path).map_or_else(|e| format!("<{e}>"), |s| s.trim().to_owned())
}

pub(crate) fn write_attr(path: &Path, value: &str) -> std::io::Result<()> {
    OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(value.as_bytes())
}

pub(crate) fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = match fs::read_dir(dir) {
        Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(_) => Vec::new(),
    };
    out.sort();
    out
}

pub(crate) fn names(dir: &Path) -> Vec<String> {
    entries(dir)
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect()
}

/// Unmounts everything mounted under `root`, deepest first (lazily: a dead device must not
/// keep the next scenario from starting).
pub(crate) fn unmount_under(root: &Path) {
    let Ok(mounts) = pillar_host::mountinfo::read(Path::new("/proc/self/mountinfo")) else {
        return;
    };
    let mut points: Vec<PathBuf> = mounts
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(root) && p != root)
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let status = Command::new("umount").arg("-l").arg(&p).status();
        println!("  cleanup: umount -l {}: {status:?}", p.display());
    }
}

/// The host side: deletes every NVMe over Fabrics controller.
pub(crate) fn disconnect_all_controllers() {
    let class = Path::new("/sys/class/nvme");
    for c in entries(class) {
        if fs::read_to_string(c.join("transport")).is_ok_and(|t| t.trim() == "tcp") {
            let r = write_attr(&c.join("delete_controller"), "1");
            println!("  cleanup: delete controller {}: {r:?}", c.display());
        }
    }
    let start = Instant::now();
    while entries(class).iter().any(|c| c.join("transport").exists())
        && start.elapsed() < Duration::from_secs(20)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Unlinks every subsystem from every port and removes the ports: the kernel deletes the
/// target controllers and their TCP connections drop ("take the port away").
pub(crate) fn take_ports_away() -> Result<(), String> {
    let root = Path::new(NVMET);
    for port in entries(&root.join("ports")) {
        for link in entries(&port.join("subsystems")) {
            fs::remove_file(&link).map_err(|e| format!("unlink {}: {e}", link.display()))?;
        }
        fs::remove_dir(&port).map_err(|e| format!("rmdir {}: {e}", port.display()))?;
    }
    Ok(())
}

/// Tears down all nvmet state, as a reboot of the storage node does: ports, namespaces,
/// host links, subsystems, hosts.
pub(crate) fn nvmet_teardown_all() -> Result<(), String> {
    take_ports_away()?;
    let root = Path::new(NVMET);
    for sub in entries(&root.join("subsystems")) {
        for ns in entries(&sub.join("namespaces")) {
            write_attr(&ns.join("enable"), "0")
                .map_err(|e| format!("disable {}: {e}", ns.display()))?;
            fs::remove_dir(&ns).map_err(|e| format!("rmdir {}: {e}", ns.display()))?;
        }
        for h in entries(&sub.join("allowed_hosts")) {
            fs::remove_file(&h).map_err(|e| format!("unlink {}: {e}", h.display()))?;
        }
        fs::remove_dir(&sub).map_err(|e| format!("rmdir {}: {e}", sub.display()))?;
    }
    for h in entries(&root.join("hosts")) {
        fs::remove_dir(&h).map_err(|e| format!("rmdir {}: {e}", h.display()))?;
    }
    Ok(())
}

/// Whether the running kernel has NVMe in-band authentication on the target, seen as the agent
/// sees it: a host entry made and removed again has `dhchap_key` or not (never decided from a
/// kernel version).
pub(crate) fn kernel_has_auth() -> bool {
    let probe = Path::new(NVMET).join("hosts/nqn.2014-08.io.pillar-csi:lane-auth-probe");
    fs::create_dir(&probe).expect("make a probe host entry");
    let has = probe.join("dhchap_key").exists();
    fs::remove_dir(&probe).expect("remove the probe host entry");
    has
}

pub(crate) fn nvmet_is_empty() -> bool {
    ["subsystems", "ports", "hosts"]
        .iter()
        .all(|d| entries(&Path::new(NVMET).join(d)).is_empty())
}

/// Detaches every loop device whose backing file is under `root`, as a reboot does.
pub(crate) fn detach_loops_under(root: &Path) -> usize {
    let mut n = 0;
    for dev in entries(Path::new("/sys/block")) {
        let backing = dev.join("loop/backing_file");
        let Ok(file) = fs::read_to_string(&backing) else {
            continue;
        };
        if Path::new(file.trim()).starts_with(root) {
            let name = dev.file_name().unwrap().to_string_lossy().into_owned();
            let status = Command::new("losetup")
                .arg("-d")
                .arg(format!("/dev/{name}"))
                .status();
            println!("  losetup -d /dev/{name} ({}): {status:?}", file.trim());
            n += 1;
        }
    }
    n
}

/// Brings the machine back to nothing: no mounts under the lane root, no NVMe/TCP controller,
/// no nvmet state, no loop device of the lane.
pub(crate) fn reset_machine() {
    let root = lane_root();
    unmount_under(&root);
    disconnect_all_controllers();
    if let Err(e) = nvmet_teardown_all() {
        println!("  cleanup: nvmet teardown: {e}");
    }
    let start = Instant::now();
    while detach_loops_under(&root) > 0 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub(crate) fn drop_caches() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    write_attr(Path::new("/proc/sys/vm/drop_caches"), "3").expect("drop caches");
}
