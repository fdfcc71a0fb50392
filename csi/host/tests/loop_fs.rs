//! Filesystem operations on real loop devices.
//!
//! Needs root, /dev/loop-control, util-linux (losetup, blkid), e2fsprogs and xfsprogs. Each test
//! attaches its own loop device to a sparse file in its own temporary directory and detaches it
//! in a Drop guard; no other loop device is touched.

// Test helpers panic on setup failures, as the tests themselves do.
#![allow(clippy::unwrap_used)]

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use pillar_host::find_mount;
use pillar_host::{
    Formatted, FsType, HostError, Probe, bind_mount, block_device_size, format_if_blank,
    grow_filesystem, is_mountpoint, log_needs_recovery, mkfs, mount, probe, probe_blank, unmount,
    volume_stats,
};
use tempfile::TempDir;

const MIB: u64 = 1 << 20;
/// mkfs.xfs refuses filesystems under 300 MiB.
const SIZE: u64 = 512 * MIB;

fn require_loop_devices() {
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let root = status
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"));
    assert!(
        root && Path::new("/dev/loop-control").exists(),
        "these tests need root and loop devices (/dev/loop-control); run them where both exist"
    );
}

/// A loop device over a sparse file, detached on drop.
struct LoopDevice {
    dev: PathBuf,
    backing: PathBuf,
    dir: TempDir,
}

impl LoopDevice {
    fn new(size: u64) -> Self {
        require_loop_devices();
        let dir = tempfile::tempdir().unwrap();
        let backing = dir.path().join("backing.img");
        fs::File::create(&backing).unwrap().set_len(size).unwrap();
        Self::over(backing, dir)
    }

    /// A loop device over `backing`, a file inside `dir`.
    fn over(backing: PathBuf, dir: TempDir) -> Self {
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(&backing)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        // The guard exists before any check can panic, so the device is always detached.
        let lo = Self { dev, backing, dir };
        assert!(
            lo.dev.to_string_lossy().starts_with("/dev/loop"),
            "{:?}",
            lo.dev
        );
        lo
    }

    /// A new loop device over a byte copy of this one's backing file, taken while the
    /// filesystem may be mounted: what a snapshot of a volume in use is.
    fn snapshot(&self) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let backing = dir.path().join("backing.img");
        let st = Command::new("cp")
            .arg("--sparse=always")
            .arg(&self.backing)
            .arg(&backing)
            .status()
            .unwrap();
        assert!(st.success());
        Self::over(backing, dir)
    }

    /// Enlarges the backing file and tells the loop driver (`losetup -c`).
    fn grow(&self, size: u64) {
        OpenOptions::new()
            .write(true)
            .open(&self.backing)
            .unwrap()
            .set_len(size)
            .unwrap();
        let st = Command::new("losetup")
            .arg("-c")
            .arg(&self.dev)
            .status()
            .unwrap();
        assert!(st.success());
    }

    /// A fresh directory inside this device's temporary directory.
    fn dir(&self, name: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        fs::create_dir_all(&p).unwrap();
        p
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

/// Unmounts (lazily, with the system tool, independent of the code under test) on drop, so a
/// failing test does not leave a mount that keeps its loop device busy.
struct MountGuard(PathBuf);

impl Drop for MountGuard {
    fn drop(&mut self) {
        for _ in 0..4 {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

fn mounted(dev: &Path, target: &Path, fs: FsType, readonly: bool) -> MountGuard {
    mount(dev, target, fs, readonly, &[]).unwrap();
    MountGuard(target.to_path_buf())
}

const BOTH: [FsType; 2] = [FsType::Ext4, FsType::Xfs];

// proves N3: a fresh device is blank, and no longer blank once it holds a filesystem.
#[test]
fn fresh_device_is_blank_until_formatted() {
    for fs in BOTH {
        let lo = LoopDevice::new(SIZE);
        assert!(probe_blank(&lo.dev).unwrap(), "{fs}");
        assert_eq!(block_device_size(&lo.dev).unwrap(), SIZE);
        mkfs(&lo.dev, fs, &[]).unwrap();
        assert!(!probe_blank(&lo.dev).unwrap(), "{fs}");
        match probe(&lo.dev).unwrap() {
            Probe::Found(sig) => assert_eq!(sig.as_fs(), Some(fs)),
            Probe::Blank => panic!("{fs} not seen"),
        }
    }
}

// proves N3: format_if_blank never reformats: data written after the first call survives the
// second.
#[test]
fn format_if_blank_never_reformats() {
    for fs in BOTH {
        let lo = LoopDevice::new(SIZE);
        let mnt = lo.dir("mnt");
        assert_eq!(
            format_if_blank(&lo.dev, fs, &[]).unwrap(),
            Formatted::Formatted
        );
        {
            let _m = mounted(&lo.dev, &mnt, fs, false);
            fs::write(mnt.join("marker"), "keep me").unwrap();
            unmount(&mnt).unwrap();
        }
        assert_eq!(
            format_if_blank(&lo.dev, fs, &[]).unwrap(),
            Formatted::AlreadyHad(fs)
        );
        let _m = mounted(&lo.dev, &mnt, fs, false);
        assert_eq!(fs::read_to_string(mnt.join("marker")).unwrap(), "keep me");
        unmount(&mnt).unwrap();
    }
}

// proves N3: a device holding another filesystem is refused, by format_if_blank and by mkfs,
// and left as it was.
#[test]
fn another_filesystem_is_refused() {
    let lo = LoopDevice::new(SIZE);
    mkfs(&lo.dev, FsType::Xfs, &[]).unwrap();
    for err in [
        format_if_blank(&lo.dev, FsType::Ext4, &[]).unwrap_err(),
        mkfs(&lo.dev, FsType::Ext4, &[]).unwrap_err(),
        mkfs(&lo.dev, FsType::Xfs, &[]).unwrap_err(),
    ] {
        assert!(
            matches!(err, HostError::ExistingSignature { .. }),
            "{err:?}"
        );
    }
    match probe(&lo.dev).unwrap() {
        Probe::Found(sig) => assert_eq!(sig.as_fs(), Some(FsType::Xfs)),
        Probe::Blank => panic!("xfs lost"),
    }
}

// proves N3: a partition table (and nothing else) makes a device non-blank.
#[test]
fn partition_table_is_not_blank() {
    let lo = LoopDevice::new(64 * MIB);
    {
        let mut f = OpenOptions::new().write(true).open(&lo.dev).unwrap();
        let mut mbr = [0u8; 512];
        // One Linux partition from sector 2048, 4096 sectors long, and the 0x55AA signature.
        mbr[446..462].copy_from_slice(&[
            0, 0, 2, 0, 0x83, 0, 0, 0, 0x00, 0x08, 0, 0, 0x00, 0x10, 0, 0,
        ]);
        mbr[510] = 0x55;
        mbr[511] = 0xAA;
        f.write_all(&mbr).unwrap();
        f.sync_all().unwrap();
    }
    match probe(&lo.dev).unwrap() {
        Probe::Found(sig) => {
            assert_eq!(sig.pt_type.as_deref(), Some("dos"));
            assert_eq!(sig.as_fs(), None);
        }
        Probe::Blank => panic!("partition table not seen"),
    }
    let err = format_if_blank(&lo.dev, FsType::Ext4, &[]).unwrap_err();
    assert!(
        matches!(err, HostError::ExistingSignature { .. }),
        "{err:?}"
    );
}

#[test]
fn mount_and_unmount_both_filesystems() {
    for fs in BOTH {
        let lo = LoopDevice::new(SIZE);
        // A space in the path exercises mountinfo's escaping.
        let mnt = lo.dir("mount point");
        format_if_blank(&lo.dev, fs, &[]).unwrap();
        assert!(!is_mountpoint(&mnt).unwrap());
        let _m = MountGuard(mnt.clone());
        mount(&lo.dev, &mnt, fs, false, &["noatime".into()]).unwrap();
        assert!(is_mountpoint(&mnt).unwrap(), "{fs}");
        let entry = find_mount(&mnt).unwrap().unwrap();
        assert_eq!(entry.fs_type, fs.as_str());
        assert_eq!(Path::new(&entry.source), lo.dev);
        assert!(entry.mount_options.split(',').any(|o| o == "noatime"));
        fs::write(mnt.join("f"), "x").unwrap();
        unmount(&mnt).unwrap();
        assert!(!is_mountpoint(&mnt).unwrap());
        assert!(!mnt.join("f").exists());
        // Idempotent: unmounting what is not mounted succeeds.
        unmount(&mnt).unwrap();
        unmount(&mnt.join("missing")).unwrap();
    }
}

#[test]
fn stacked_mounts_are_all_unmounted() {
    let lo = LoopDevice::new(SIZE);
    let mnt = lo.dir("mnt");
    let other = lo.dir("other");
    fs::write(other.join("top"), "").unwrap();
    format_if_blank(&lo.dev, FsType::Ext4, &[]).unwrap();
    let _m = MountGuard(mnt.clone());
    mount(&lo.dev, &mnt, FsType::Ext4, false, &[]).unwrap();
    bind_mount(&other, &mnt, false).unwrap();
    assert!(mnt.join("top").exists());
    unmount(&mnt).unwrap();
    assert!(!is_mountpoint(&mnt).unwrap());
    assert!(!mnt.join("top").exists());
}

// A mount point held for a moment (here a file kept open 300 ms; in the test suite, a child
// forked by another thread that still held a descriptor of a file under it) is unmounted once the
// holder is gone, not refused with EBUSY; one held for good still fails, and stays mounted.
#[test]
fn a_briefly_busy_mount_point_is_unmounted() {
    let lo = LoopDevice::new(SIZE);
    let mnt = lo.dir("mnt");
    format_if_blank(&lo.dev, FsType::Ext4, &[]).unwrap();
    let _m = mounted(&lo.dev, &mnt, FsType::Ext4, false);
    let held = fs::File::create(mnt.join("held")).unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(held);
    });
    unmount(&mnt).expect("unmounted once the holder closed its file");
    release.join().unwrap();
    assert!(!is_mountpoint(&mnt).unwrap());

    let _m = mounted(&lo.dev, &mnt, FsType::Ext4, false);
    let _held = fs::File::create(mnt.join("held")).unwrap();
    let err = unmount(&mnt).expect_err("a mount point held for good cannot be unmounted");
    assert!(
        matches!(&err, pillar_host::HostError::Unmount { source, .. } if source.raw_os_error() == Some(libc::EBUSY)),
        "{err:?}"
    );
    assert!(is_mountpoint(&mnt).unwrap());
    drop(_held);
    unmount(&mnt).unwrap();
}

#[test]
fn bad_mount_options_fail_and_leave_nothing_mounted() {
    let lo = LoopDevice::new(SIZE);
    let mnt = lo.dir("mnt");
    format_if_blank(&lo.dev, FsType::Ext4, &[]).unwrap();
    let _m = MountGuard(mnt.clone());
    let err = mount(
        &lo.dev,
        &mnt,
        FsType::Ext4,
        false,
        &["no_such_option".into()],
    )
    .unwrap_err();
    assert!(matches!(err, HostError::Mount { .. }), "{err:?}");
    assert_eq!(err.errno(), Some(libc::EINVAL));
    assert!(!is_mountpoint(&mnt).unwrap());
    // Mounting as the wrong filesystem fails too.
    assert!(mount(&lo.dev, &mnt, FsType::Xfs, false, &[]).is_err());
    assert!(!is_mountpoint(&mnt).unwrap());
}

fn assert_erofs(r: io::Result<impl Sized>) {
    match r {
        Ok(_) => panic!("write succeeded on a read-only mount"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}"),
    }
}

#[test]
fn readonly_mount_refuses_writes() {
    for fs in BOTH {
        let lo = LoopDevice::new(SIZE);
        let mnt = lo.dir("mnt");
        format_if_blank(&lo.dev, fs, &[]).unwrap();
        let _m = mounted(&lo.dev, &mnt, fs, true);
        assert!(find_mount(&mnt).unwrap().unwrap().is_readonly());
        assert_erofs(fs::write(mnt.join("f"), "x"));
        unmount(&mnt).unwrap();
    }
}

#[test]
fn readonly_bind_mount_refuses_writes() {
    let lo = LoopDevice::new(SIZE);
    let staging = lo.dir("staging");
    let publish = lo.dir("publish");
    format_if_blank(&lo.dev, FsType::Ext4, &[]).unwrap();
    let _s = mounted(&lo.dev, &staging, FsType::Ext4, false);
    let _p = MountGuard(publish.clone());
    bind_mount(&staging, &publish, true).unwrap();
    assert!(find_mount(&publish).unwrap().unwrap().is_readonly());
    assert_erofs(fs::write(publish.join("f"), "x"));
    // The staging mount stays writable and the bind shows its files.
    fs::write(staging.join("g"), "y").unwrap();
    assert_eq!(fs::read_to_string(publish.join("g")).unwrap(), "y");
    unmount(&publish).unwrap();
    unmount(&staging).unwrap();

    // A writable bind is writable.
    let _s = mounted(&lo.dev, &staging, FsType::Ext4, false);
    bind_mount(&staging, &publish, false).unwrap();
    fs::write(publish.join("h"), "z").unwrap();
    assert!(staging.join("h").exists());
    unmount(&publish).unwrap();
    unmount(&staging).unwrap();
}

// A fact for the node service, not a guarantee of this crate: a read-only bind of a device
// node marks the mount read-only, but the kernel does not apply that to writes through a device
// node (may_open only checks nodev). A read-only raw block volume needs another guard.
#[test]
fn readonly_bind_of_a_block_device_does_not_stop_writes_through_the_node() {
    let lo = LoopDevice::new(64 * MIB);
    let target = lo.dir("pub").join("block");
    fs::write(&target, "").unwrap();
    let _p = MountGuard(target.clone());
    bind_mount(&lo.dev, &target, true).unwrap();
    let entry = find_mount(&target).unwrap().unwrap();
    assert!(entry.is_readonly(), "{entry:?}");
    assert_eq!(block_device_size(&target).unwrap(), 64 * MIB);
    assert!(OpenOptions::new().write(true).open(&target).is_ok());
    unmount(&target).unwrap();
    assert!(!is_mountpoint(&target).unwrap());
}

/// Whether this process may resize ext4 online (the kernel's EXT4_IOC_RESIZE_FS needs
/// CAP_SYS_RESOURCE; some sandboxes drop it, a privileged CSI pod has it).
fn has_cap_sys_resource() -> bool {
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    eff & (1 << 24) != 0
}

fn grow_and_check(fs: FsType) -> Result<(), HostError> {
    let lo = LoopDevice::new(SIZE);
    let mnt = lo.dir("mnt");
    format_if_blank(&lo.dev, fs, &[]).unwrap();
    let _m = mounted(&lo.dev, &mnt, fs, false);
    let before = volume_stats(&mnt).unwrap();
    lo.grow(2 * SIZE);
    assert_eq!(block_device_size(&lo.dev).unwrap(), 2 * SIZE);
    let grown = grow_filesystem(&lo.dev, &mnt, fs);
    let after = volume_stats(&mnt).unwrap();
    if grown.is_ok() {
        assert!(
            after.bytes_total > before.bytes_total + SIZE * 9 / 10,
            "{fs}: {before:?} -> {after:?}"
        );
    } else {
        assert_eq!(after.bytes_total, before.bytes_total);
    }
    unmount(&mnt).unwrap();
    grown
}

#[test]
fn grow_fills_the_larger_device_xfs() {
    grow_and_check(FsType::Xfs).unwrap();
}

#[test]
fn grow_fills_the_larger_device_ext4() {
    let result = grow_and_check(FsType::Ext4);
    if has_cap_sys_resource() {
        result.unwrap();
    } else {
        // Without the capability the failure must be reported with the tool's own words.
        match result {
            Err(HostError::CommandFailed {
                program, stderr, ..
            }) => {
                assert_eq!(program, "resize2fs");
                assert!(stderr.contains("Permission denied"), "{stderr}");
            }
            other => panic!("expected resize2fs to be refused here, got {other:?}"),
        }
    }
}

#[test]
fn volume_stats_track_usage() {
    let lo = LoopDevice::new(SIZE);
    let mnt = lo.dir("mnt");
    format_if_blank(&lo.dev, FsType::Ext4, &[]).unwrap();
    let _m = mounted(&lo.dev, &mnt, FsType::Ext4, false);
    let before = volume_stats(&mnt).unwrap();
    assert!(before.bytes_total > SIZE * 8 / 10 && before.bytes_total <= SIZE);
    assert!(before.bytes_available <= before.bytes_total - before.bytes_used);
    assert!(before.inodes_total > 0);
    assert_eq!(before.inodes_used + before.inodes_free, before.inodes_total);
    let data = vec![0xabu8; usize::try_from(16 * MIB).unwrap()];
    for i in 0..4 {
        let mut f = fs::File::create(mnt.join(format!("f{i}"))).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
    }
    let after = volume_stats(&mnt).unwrap();
    assert!(
        after.bytes_used >= before.bytes_used + 60 * MIB,
        "{before:?} -> {after:?}"
    );
    assert!(after.inodes_used >= before.inodes_used + 4);
    unmount(&mnt).unwrap();
}

/// Whether two files hold the same bytes (`cmp`, quick on sparse files where a digest in a
/// debug build is not).
fn same_bytes(a: &Path, b: &Path) -> bool {
    Command::new("cmp")
        .arg("-s")
        .arg(a)
        .arg(b)
        .status()
        .unwrap()
        .success()
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("-V")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok()
}

// proves N5 (and C: failing closed): a byte copy of a mounted filesystem whose last change was
// fsynced (a snapshot of a volume in use) has a log that needs recovery, and the check finds it
// without writing a byte; the same filesystem cleanly unmounted, and a fresh one, need none.
// Before this check a read-only stage mounted such a copy with noload/norecovery and showed it
// as of its last checkpoint, without the fsynced file.
#[test]
fn a_snapshot_of_a_mounted_filesystem_needs_log_recovery() {
    if !have("xfs_logprint") {
        eprintln!("SKIPPED: xfs_logprint not found (xfsprogs)");
        return;
    }
    for fs in BOTH {
        let lo = LoopDevice::new(SIZE);
        format_if_blank(&lo.dev, fs, &[]).unwrap();
        assert!(!log_needs_recovery(&lo.dev, fs).unwrap(), "{fs}: fresh");
        let mnt = lo.dir("mnt");
        let m = mounted(&lo.dev, &mnt, fs, false);
        let mut f = fs::File::create(mnt.join("fsynced")).unwrap();
        f.write_all(&vec![0x5au8; usize::try_from(4 * MIB).unwrap()])
            .unwrap();
        f.sync_all().unwrap();
        drop(f);
        let snap = lo.snapshot();
        unmount(&mnt).unwrap();
        drop(m);
        assert!(!log_needs_recovery(&lo.dev, fs).unwrap(), "{fs}: unmounted");

        let before = lo.dir("before").join("copy.img");
        let st = Command::new("cp")
            .arg("--sparse=always")
            .arg(&snap.backing)
            .arg(&before)
            .status()
            .unwrap();
        assert!(st.success());
        assert!(log_needs_recovery(&snap.dev, fs).unwrap(), "{fs}: snapshot");
        assert!(
            same_bytes(&snap.backing, &before),
            "{fs}: the check wrote to the device"
        );
    }
}

#[test]
fn a_log_check_of_something_else_is_an_error_not_clean() {
    if !have("xfs_logprint") {
        eprintln!("SKIPPED: xfs_logprint not found (xfsprogs)");
        return;
    }
    let blank = LoopDevice::new(SIZE);
    for fs in BOTH {
        let err = log_needs_recovery(&blank.dev, fs).unwrap_err();
        assert!(
            matches!(
                err,
                HostError::LogState { .. } | HostError::CommandFailed { .. }
            ),
            "{fs}: {err:?}"
        );
    }
    let file = blank.dir("x").join("file");
    fs::write(&file, vec![0u8; 4096]).unwrap();
    assert!(matches!(
        log_needs_recovery(&file, FsType::Xfs),
        Err(HostError::NotBlockDevice { .. })
    ));
}

// Issue 21, defect 2: mkfs.xfs on a device under its minimum prints one error line and then its
// whole usage text; the error carries the first, not the usage (it reaches the CO as the gRPC
// message of NodeStage). On the old code the message held the 28-line usage.
#[test]
fn a_failed_mkfs_reports_its_error_line_not_its_usage() {
    let lo = LoopDevice::new(64 * MIB);
    match format_if_blank(&lo.dev, FsType::Xfs, &[]) {
        Err(HostError::CommandFailed {
            program, stderr, ..
        }) => {
            assert_eq!(program, "mkfs.xfs");
            assert!(stderr.contains("must be larger than 300MB"), "{stderr}");
            assert!(
                !stderr.contains("Usage") && !stderr.contains('\n'),
                "{stderr}"
            );
        }
        other => panic!("expected mkfs.xfs to refuse a 64 MiB device, got {other:?}"),
    }
    assert!(probe_blank(&lo.dev).unwrap());
}
