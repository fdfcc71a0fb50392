//! The file backend against the real kernel: sparse files on loop devices bound with the loop
//! ioctls. Needs root and `/dev/loop-control`.
//!
//! Every test owns a temporary pool directory and a [`Pool`] whose drop unbinds every loop
//! device backed by a file in that directory (and no other), even when the test fails.

#![allow(clippy::unwrap_used)]

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use pillar_agent::backend::loopdev;
use pillar_agent::backend::{
    Backend, BackendError, FileBackend, MAX_VOLUME_BYTES, MIB, ScriptedRunner, VolumeInfo,
};
use pillar_agent::{PoolConfig, PoolKind};
use pillar_nvmet::VolumeId;

/// A pool in a temporary directory. Field order matters: the loop devices are unbound before
/// the directory is removed.
struct Pool {
    guard: LoopGuard,
    backend: Backend,
    _dir: tempfile::TempDir,
}

/// Unbinds, on drop, every loop device whose backing file is under `dir`.
struct LoopGuard {
    dir: PathBuf,
}

impl Drop for LoopGuard {
    fn drop(&mut self) {
        let Ok(bindings) = loopdev::bindings() else {
            return;
        };
        for b in bindings
            .iter()
            .filter(|b| b.backing_file.starts_with(&self.dir))
        {
            if let Err(e) = loopdev::detach(b.index, Duration::from_secs(2)) {
                eprintln!("cleanup: could not detach loop{}: {e}", b.index);
            }
        }
    }
}

impl Pool {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = PoolConfig {
            name: "files".into(),
            kind: PoolKind::File {
                dir: dir.path().to_owned(),
            },
        };
        let backend = Backend::new(&config, Arc::new(ScriptedRunner::new())).unwrap();
        let canonical = match &backend {
            Backend::File(f) => f.dir().to_owned(),
            _ => unreachable!(),
        };
        Self {
            guard: LoopGuard { dir: canonical },
            backend,
            _dir: dir,
        }
    }

    fn dir(&self) -> &Path {
        &self.guard.dir
    }

    fn file_backend(&self) -> &FileBackend {
        match &self.backend {
            Backend::File(f) => f,
            _ => unreachable!(),
        }
    }

    fn backing_file(&self, volume: &VolumeId) -> PathBuf {
        self.file_backend().backing_file(volume)
    }

    /// Loop devices bound to files of this pool, as (index, path, deleted).
    fn bindings(&self) -> Vec<loopdev::Binding> {
        loopdev::bindings()
            .unwrap()
            .into_iter()
            .filter(|b| b.backing_file.starts_with(self.dir()))
            .collect()
    }
}

fn vol(id: &str) -> VolumeId {
    VolumeId::parse(id).unwrap()
}

fn loop_index(info: &VolumeInfo) -> u32 {
    info.device_path
        .to_str()
        .and_then(|p| p.strip_prefix("/dev/loop"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a loop device: {}", info.device_path.display()))
}

/// The block device's size as the kernel reports it (/sys/block/loopN/size, 512-byte units).
fn kernel_size(info: &VolumeInfo) -> u64 {
    let text = fs::read_to_string(format!("/sys/block/loop{}/size", loop_index(info))).unwrap();
    text.trim().parse::<u64>().unwrap() * 512
}

fn sysfs_attr(info: &VolumeInfo, attr: &str) -> String {
    fs::read_to_string(format!("/sys/block/loop{}/loop/{attr}", loop_index(info)))
        .unwrap()
        .trim()
        .to_owned()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| u8::try_from(i % 251).unwrap() ^ seed)
        .collect()
}

fn write_device(info: &VolumeInfo, offset: u64, data: &[u8]) {
    let mut dev = OpenOptions::new()
        .write(true)
        .open(&info.device_path)
        .unwrap();
    dev.seek(SeekFrom::Start(offset)).unwrap();
    dev.write_all(data).unwrap();
    dev.sync_all().unwrap();
}

fn read_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut f = File::open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut buf = vec![0; len];
    f.read_exact(&mut buf).unwrap();
    buf
}

// Requirement (issue 3 item 6): sizes are rounded as the backend requires (1 MiB for files).
// Also: the device exists, has the rounded size, the file is sparse, and the binding is not
// auto-clear (exports must survive agent restarts) and uses direct I/O.
#[tokio::test]
async fn create_binds_a_sparse_file_of_the_rounded_size() {
    let pool = Pool::new();
    let v = vol("pvc-create");
    assert_eq!(pool.backend.round_size(10 * MIB + 1), 11 * MIB);
    let info = pool.backend.create(&v, 10 * MIB + 1).await.unwrap();
    assert_eq!(info.volume, v);
    assert_eq!(info.size_bytes, 11 * MIB);
    assert!(info.device_path.exists(), "{}", info.device_path.display());
    assert_eq!(kernel_size(&info), 11 * MIB);
    let meta = fs::metadata(pool.backing_file(&v)).unwrap();
    assert_eq!(meta.len(), 11 * MIB);
    assert!(
        meta.blocks() * 512 < MIB,
        "backing file is not sparse: {} blocks",
        meta.blocks()
    );
    assert_eq!(sysfs_attr(&info, "autoclear"), "0");
    assert_eq!(
        sysfs_attr(&info, "dio"),
        "1",
        "direct I/O not in use on ext4"
    );
    assert_eq!(
        PathBuf::from(sysfs_attr(&info, "backing_file")),
        pool.backing_file(&v)
    );
}

// create is idempotent: the same rounded size returns the same device, and no second loop
// device is bound to the file.
#[tokio::test]
async fn create_twice_returns_the_same_device() {
    let pool = Pool::new();
    let v = vol("pvc-twice");
    let first = pool.backend.create(&v, 4 * MIB).await.unwrap();
    let second = pool.backend.create(&v, 4 * MIB - 100).await.unwrap();
    assert_eq!(first, second);
    assert_eq!(pool.bindings().len(), 1);
}

#[tokio::test]
async fn create_with_another_size_is_a_mismatch() {
    let pool = Pool::new();
    let v = vol("pvc-mismatch");
    pool.backend.create(&v, 4 * MIB).await.unwrap();
    let err = pool.backend.create(&v, 8 * MIB).await.unwrap_err();
    assert!(
        matches!(
            err,
            BackendError::SizeMismatch {
                existing,
                requested,
                ..
            } if existing == 4 * MIB && requested == 8 * MIB
        ),
        "{err:?}"
    );
    assert_eq!(fs::metadata(pool.backing_file(&v)).unwrap().len(), 4 * MIB);
}

// Requirement (issue 3 item 6): absurd sizes are refused before anything is created.
#[tokio::test]
async fn invalid_sizes_are_refused_and_leave_nothing() {
    let pool = Pool::new();
    let v = vol("pvc-invalid");
    for size in [0, MAX_VOLUME_BYTES + 1, u64::MAX] {
        let err = pool.backend.create(&v, size).await.unwrap_err();
        assert!(
            matches!(err, BackendError::InvalidSize { requested } if requested == size),
            "{size}: {err:?}"
        );
    }
    assert!(!pool.backing_file(&v).exists());
    assert!(pool.bindings().is_empty());
}

// A size within pillar's limit but beyond what the pool's file system can hold in one file
// (ext4 with 4 KiB blocks: 16 TiB) is an input error, and the half-made file is removed.
#[tokio::test]
async fn a_size_the_file_system_cannot_hold_is_refused_and_cleaned_up() {
    let pool = Pool::new();
    let v = vol("pvc-huge");
    let err = pool.backend.create(&v, MAX_VOLUME_BYTES).await.unwrap_err();
    assert!(
        matches!(err, BackendError::SizeUnsupported { requested, .. } if requested == MAX_VOLUME_BYTES),
        "{err:?}"
    );
    assert!(!pool.backing_file(&v).exists());
    assert!(pool.bindings().is_empty());
}

// A zero-length file is a create interrupted between making the file and sizing it.
#[tokio::test]
async fn create_finishes_an_interrupted_create() {
    let pool = Pool::new();
    let v = vol("pvc-interrupted");
    File::create(pool.backing_file(&v)).unwrap();
    let info = pool.backend.create(&v, 2 * MIB).await.unwrap();
    assert_eq!(info.size_bytes, 2 * MIB);
    assert_eq!(kernel_size(&info), 2 * MIB);
}

// The backing path is never followed through a symlink.
#[tokio::test]
async fn a_symlink_in_place_of_a_backing_file_is_not_followed() {
    let pool = Pool::new();
    let v = vol("pvc-link");
    let target = pool.dir().join("elsewhere");
    fs::write(&target, b"not a volume").unwrap();
    std::os::unix::fs::symlink(&target, pool.backing_file(&v)).unwrap();
    let err = pool.backend.create(&v, MIB).await.unwrap_err();
    assert!(matches!(err, BackendError::Io { .. }), "{err:?}");
    assert!(pool.backend.lookup(&v).await.is_err());
    assert_eq!(fs::read(&target).unwrap(), b"not a volume");
    assert!(pool.bindings().is_empty());
}

// What is written to the device is in the file at the same offset, and the other way round.
#[tokio::test]
async fn data_goes_through_the_loop_device_to_the_file() {
    let pool = Pool::new();
    let v = vol("pvc-data");
    let info = pool.backend.create(&v, 4 * MIB).await.unwrap();
    let data = pattern(64 * 1024, 0x5a);
    write_device(&info, MIB + 4096, &data);
    assert_eq!(
        read_at(&pool.backing_file(&v), MIB + 4096, data.len()),
        data
    );
    assert_eq!(read_at(&info.device_path, MIB + 4096, data.len()), data);
}

// Requirement (issue 3 item 6): shrink is refused. Growing makes the kernel see the new
// size at once; an equal size is a no-op; a missing volume is NotFound.
#[tokio::test]
async fn expand_grows_the_device_and_refuses_to_shrink() {
    let pool = Pool::new();
    let v = vol("pvc-expand");
    let created = pool.backend.create(&v, 8 * MIB).await.unwrap();
    let data = pattern(4096, 0x11);
    write_device(&created, 0, &data);

    let grown = pool.backend.expand(&v, 20 * MIB - 5).await.unwrap();
    assert_eq!(grown.size_bytes, 20 * MIB);
    assert_eq!(grown.device_path, created.device_path);
    assert_eq!(kernel_size(&grown), 20 * MIB);
    assert_eq!(fs::metadata(pool.backing_file(&v)).unwrap().len(), 20 * MIB);
    assert_eq!(read_at(&grown.device_path, 0, data.len()), data);

    let same = pool.backend.expand(&v, 20 * MIB).await.unwrap();
    assert_eq!(same, grown);

    let err = pool.backend.expand(&v, 8 * MIB).await.unwrap_err();
    assert!(
        matches!(err, BackendError::ShrinkRefused { current, requested, .. }
            if current == 20 * MIB && requested == 8 * MIB),
        "{err:?}"
    );
    assert_eq!(kernel_size(&grown), 20 * MIB);

    let err = pool
        .backend
        .expand(&vol("pvc-absent"), MIB)
        .await
        .unwrap_err();
    assert!(matches!(err, BackendError::NotFound { .. }), "{err:?}");
    let err = pool.backend.expand(&v, 0).await.unwrap_err();
    assert!(matches!(err, BackendError::InvalidSize { .. }), "{err:?}");
}

// An expand interrupted after growing the file but before the kernel was told: the next
// expand (or lookup) brings the device to the file's size.
#[tokio::test]
async fn an_interrupted_expand_is_finished() {
    let pool = Pool::new();
    let v = vol("pvc-half-expanded");
    let info = pool.backend.create(&v, 4 * MIB).await.unwrap();
    fs::OpenOptions::new()
        .write(true)
        .open(pool.backing_file(&v))
        .unwrap()
        .set_len(6 * MIB)
        .unwrap();
    assert_eq!(kernel_size(&info), 4 * MIB);
    let same = pool.backend.expand(&v, 6 * MIB).await.unwrap();
    assert_eq!(same.device_path, info.device_path);
    assert_eq!(kernel_size(&same), 6 * MIB);
}

// After a reboot no loop device exists: lookup binds one again, with the data intact.
#[tokio::test]
async fn lookup_rebinds_after_the_loop_device_is_gone() {
    let pool = Pool::new();
    let v = vol("pvc-reboot");
    let info = pool.backend.create(&v, 4 * MIB).await.unwrap();
    let data = pattern(8192, 0x77);
    write_device(&info, 2 * MIB, &data);

    let detached = loopdev::detach(loop_index(&info), Duration::from_secs(2)).unwrap();
    assert_eq!(detached, loopdev::Detach::Done);
    assert!(pool.bindings().is_empty());

    let found = pool
        .backend
        .lookup(&v)
        .await
        .unwrap()
        .expect("volume exists");
    assert_eq!(found.size_bytes, 4 * MIB);
    assert!(found.device_path.exists());
    assert_eq!(kernel_size(&found), 4 * MIB);
    assert_eq!(pool.bindings().len(), 1);
    assert_eq!(read_at(&found.device_path, 2 * MIB, data.len()), data);

    // A second lookup finds the same binding instead of making another.
    let again = pool.backend.lookup(&v).await.unwrap().unwrap();
    assert_eq!(again, found);
    assert_eq!(pool.bindings().len(), 1);

    assert_eq!(pool.backend.lookup(&vol("pvc-never")).await.unwrap(), None);
}

// A volume's loop device is found without reading every /sys/block/loopN (issue 11: the cost of
// an operation must not grow with the node's loop devices), and a remembered device is trusted
// only while it is still bound to the volume's file: detached and its index handed to another
// file, it is passed over and the volume gets its own device again.
#[tokio::test]
async fn lookup_finds_the_device_without_a_scan_and_never_trusts_a_reused_index() {
    let pool = Pool::new();
    let files = pool.file_backend();
    let volumes = [vol("pvc-hint-a"), vol("pvc-hint-b"), vol("pvc-hint-c")];
    let mut created = Vec::new();
    for v in &volumes {
        created.push(pool.backend.create(v, 4 * MIB).await.unwrap());
    }
    for _ in 0..3 {
        for (v, info) in volumes.iter().zip(&created) {
            assert_eq!(pool.backend.lookup(v).await.unwrap().as_ref(), Some(info));
        }
    }
    assert_eq!(files.loop_scans(), 0, "creates and lookups scanned sysfs");

    // A restarted agent scans once, then finds every device from what it learnt.
    let restarted = FileBackend::new("files", pool.dir()).unwrap();
    for (v, info) in volumes.iter().zip(&created) {
        assert_eq!(restarted.lookup(v).await.unwrap().as_ref(), Some(info));
    }
    assert_eq!(
        restarted.loop_scans(),
        1,
        "a restarted backend scanned more than once"
    );

    // Detach a's device and bind another file at once: the kernel hands out the freed index
    // again (unless a parallel test took it; the check below holds either way).
    let a = &created[0];
    loopdev::detach(loop_index(a), Duration::from_secs(2)).unwrap();
    let foreign_path = pool.dir().join("not-a-volume");
    let foreign = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&foreign_path)
        .unwrap();
    foreign.set_len(MIB).unwrap();
    loopdev::attach(&foreign, &foreign_path, false).unwrap();
    let found = pool.backend.lookup(&volumes[0]).await.unwrap().unwrap();
    let meta = fs::metadata(pool.backing_file(&volumes[0])).unwrap();
    assert_eq!(
        loopdev::backing_identity(loop_index(&found)).unwrap(),
        (meta.dev(), meta.ino()),
        "the volume was handed a device bound to another file"
    );
    assert_eq!(files.loop_scans(), 1);
}

// delete unbinds the loop device and removes the file; deleting again is fine.
#[tokio::test]
async fn delete_detaches_and_removes_and_is_idempotent() {
    let pool = Pool::new();
    let v = vol("pvc-delete");
    let info = pool.backend.create(&v, 4 * MIB).await.unwrap();
    let before: Vec<u32> = pool.bindings().iter().map(|b| b.index).collect();
    assert_eq!(before, [loop_index(&info)]);
    pool.backend.delete(&v).await.unwrap();
    // (The freed index may be bound again at once by a parallel test: check by file.)
    assert!(pool.bindings().is_empty());
    assert!(!pool.backing_file(&v).exists());
    pool.backend.delete(&v).await.unwrap();
    assert_eq!(pool.backend.lookup(&v).await.unwrap(), None);
}

// A device held exclusively (as by a mounted file system) is not unbound, and the file is
// kept: deleting a volume in use is refused rather than left half done.
#[tokio::test]
async fn delete_refuses_a_device_in_use() {
    let pool = Pool::new();
    let v = vol("pvc-busy");
    let info = pool.backend.create(&v, 4 * MIB).await.unwrap();
    let holder = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(&info.device_path)
        .unwrap();
    let err = pool.backend.delete(&v).await.unwrap_err();
    assert!(matches!(err, BackendError::Busy { .. }), "{err:?}");
    assert!(loopdev::is_bound(loop_index(&info)));
    assert!(pool.backing_file(&v).exists());
    drop(holder);
    pool.backend.delete(&v).await.unwrap();
    assert!(!pool.backing_file(&v).exists());
}

// A device merely held open (as nvmet holds an exported namespace) cannot be unbound at once:
// the kernel arms auto-clear for the last close. delete reports Busy and keeps the file; once
// the holder lets go the kernel unbinds the device, and the next delete finishes.
#[tokio::test]
async fn delete_of_a_device_held_open_is_busy_until_released() {
    let pool = Pool::new();
    let v = vol("pvc-held");
    let info = pool.backend.create(&v, 4 * MIB).await.unwrap();
    let holder = File::open(&info.device_path).unwrap();
    let err = pool.backend.delete(&v).await.unwrap_err();
    assert!(matches!(err, BackendError::Busy { .. }), "{err:?}");
    assert!(pool.backing_file(&v).exists());
    assert!(loopdev::is_bound(loop_index(&info)));
    assert_eq!(sysfs_attr(&info, "autoclear"), "1");
    drop(holder);
    // The kernel unbinds at the holder's last close.
    assert!(pool.bindings().is_empty());
    pool.backend.delete(&v).await.unwrap();
    assert!(!pool.backing_file(&v).exists());
    assert!(pool.bindings().is_empty());
}

// A loop device still bound to an unlinked earlier file of the same name is not mistaken for
// the new file's device (device and inode numbers decide), and delete unbinds both.
#[tokio::test]
async fn a_stale_binding_to_an_unlinked_file_is_not_reused() {
    let pool = Pool::new();
    let v = vol("pvc-stale");
    let old = pool.backend.create(&v, 4 * MIB).await.unwrap();
    fs::remove_file(pool.backing_file(&v)).unwrap();
    let stale = pool.bindings();
    assert_eq!(stale.len(), 1);
    assert!(stale[0].deleted);

    let new = pool.backend.create(&v, 4 * MIB).await.unwrap();
    assert_ne!(new.device_path, old.device_path);
    let data = pattern(4096, 0x42);
    write_device(&new, 0, &data);
    assert_eq!(read_at(&pool.backing_file(&v), 0, data.len()), data);

    pool.backend.delete(&v).await.unwrap();
    assert!(pool.bindings().is_empty());
}

/// Unmounts, on drop, a file system mounted over `0`, after unbinding loop devices on it.
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        drop(LoopGuard {
            dir: self.0.clone(),
        });
        let status = std::process::Command::new("umount").arg(&self.0).status();
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!(
                "cleanup: could not unmount {}: {status:?}",
                self.0.display()
            );
        }
    }
}

// A loop device whose backing path matches but which is bound to another file (here: the
// pool directory got another file system mounted over it) is not taken for the volume's:
// device and inode numbers decide, not the path.
#[tokio::test]
async fn a_binding_with_the_same_path_on_another_file_system_is_not_reused() {
    let pool = Pool::new();
    let v = vol("pvc-overmounted");
    let hidden = pool.backend.create(&v, 4 * MIB).await.unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "tmpfs"])
        .arg(pool.dir())
        .status()
        .unwrap();
    assert!(status.success(), "mount failed");
    let _unmount = Unmount(pool.dir().to_owned());
    // The old binding still shows the same path, not marked deleted.
    let before = pool.bindings();
    assert_eq!(before.len(), 1);
    assert!(!before[0].deleted);

    let fresh = pool.backend.create(&v, 4 * MIB).await.unwrap();
    assert_ne!(fresh.device_path, hidden.device_path);
    let data = pattern(4096, 0x3c);
    write_device(&fresh, 0, &data);
    assert_eq!(read_at(&pool.backing_file(&v), 0, data.len()), data);
    assert_eq!(pool.backend.lookup(&v).await.unwrap().unwrap(), fresh);
}

// list returns exactly the pool's volumes (sorted), each bound, and ignores other entries.
#[tokio::test]
async fn list_returns_only_volumes_and_binds_them() {
    let pool = Pool::new();
    let b = pool.backend.create(&vol("vol-b"), 2 * MIB).await.unwrap();
    let a = pool.backend.create(&vol("vol-a"), 3 * MIB).await.unwrap();
    fs::write(pool.dir().join("notes.txt"), b"x").unwrap();
    fs::write(pool.dir().join("bad name.img"), b"x").unwrap();
    fs::write(pool.dir().join(".hidden.img"), b"x").unwrap();
    fs::create_dir(pool.dir().join("dir.img")).unwrap();

    // Simulated reboot for one of them.
    loopdev::detach(loop_index(&b), Duration::from_secs(2)).unwrap();

    let listed = pool.backend.list().await.unwrap();
    let ids: Vec<&str> = listed.iter().map(|i| i.volume.as_str()).collect();
    assert_eq!(ids, ["vol-a", "vol-b"]);
    assert_eq!(listed[0], a);
    assert_eq!(listed[1].size_bytes, 2 * MIB);
    for info in &listed {
        assert_eq!(kernel_size(info), info.size_bytes);
    }
    assert_eq!(pool.bindings().len(), 2);
}

// capacity is the pool file system's statvfs, the same numbers `stat -f` reports.
#[tokio::test]
async fn capacity_is_the_file_systems() {
    let pool = Pool::new();
    let cap = pool.backend.capacity().await.unwrap();
    let probed = pool.backend.probe().await.unwrap();
    assert_eq!(probed.total_bytes, cap.total_bytes);
    let out = std::process::Command::new("stat")
        .args(["-f", "-c", "%S %b %a"])
        .arg(pool.dir())
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let nums: Vec<u64> = text
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    let (block, total, avail) = (nums[0], nums[1], nums[2]);
    assert_eq!(cap.total_bytes, block * total);
    assert!(cap.available_bytes <= cap.total_bytes);
    // Other tests write meanwhile; the two readings are close, not equal.
    assert!(
        cap.available_bytes.abs_diff(block * avail) < 512 * MIB,
        "{} vs {}",
        cap.available_bytes,
        block * avail
    );
}

// Several creates at once each get their own loop device (LOOP_CTL_GET_FREE hands the same
// free index to racing callers; the losers get EBUSY and retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_get_distinct_devices() {
    let pool = Arc::new(Pool::new());
    let mut tasks = Vec::new();
    for i in 0..6 {
        let pool = Arc::clone(&pool);
        tasks.push(tokio::spawn(async move {
            pool.backend
                .create(&vol(&format!("pvc-par-{i}")), MIB)
                .await
                .unwrap()
        }));
    }
    let mut devices = Vec::new();
    for t in tasks {
        devices.push(t.await.unwrap().device_path);
    }
    devices.sort();
    devices.dedup();
    assert_eq!(devices.len(), 6);
    assert_eq!(pool.bindings().len(), 6);
}

#[test]
fn pool_directory_must_exist_and_be_absolute() {
    let runner = Arc::new(ScriptedRunner::new());
    let missing = PoolConfig {
        name: "p".into(),
        kind: PoolKind::File {
            dir: "/nonexistent/pillar-pool".into(),
        },
    };
    assert!(matches!(
        Backend::new(&missing, runner.clone()),
        Err(BackendError::Io { .. })
    ));
    let relative = PoolConfig {
        name: "p".into(),
        kind: PoolKind::File {
            dir: "relative/dir".into(),
        },
    };
    assert!(matches!(
        Backend::new(&relative, runner),
        Err(BackendError::InvalidConfig { .. })
    ));
}

/// The names `held` gives (the start-up scan's listing: one directory read, no `stat`, open or
/// loop-device lookup per volume) are exactly those `list` gives, for both file pools: a stray
/// file, a subdirectory named like a volume (file pool) and a hidden temporary file are no
/// volumes for either.
#[tokio::test]
async fn the_names_held_are_the_volumes_listed() {
    let pool = Pool::new();
    for id in ["pvc-a", "pvc-b", "pvc-c"] {
        pool.backend.create(&vol(id), MIB).await.unwrap();
    }
    fs::write(pool.dir().join("notes.txt"), b"not a volume").unwrap();
    fs::write(pool.dir().join(".pvc-d.img.tmp"), b"").unwrap();
    fs::create_dir(pool.dir().join("pvc-e.img")).unwrap();
    let plain_dir = tempfile::tempdir().unwrap();
    let plain = Backend::new(
        &PoolConfig {
            name: "plain".into(),
            kind: PoolKind::PlainFile {
                dir: plain_dir.path().to_owned(),
            },
        },
        Arc::new(ScriptedRunner::new()),
    )
    .unwrap();
    for id in ["pvc-x", "pvc-y"] {
        plain.create(&vol(id), MIB).await.unwrap();
    }
    fs::write(plain_dir.path().join("notes.txt"), b"not a volume").unwrap();
    for (backend, expected) in [
        (&pool.backend, vec!["pvc-a", "pvc-b", "pvc-c"]),
        (&plain, vec!["pvc-x", "pvc-y"]),
    ] {
        let mut held = backend.held().await.unwrap();
        held.sort();
        let listed: Vec<VolumeId> = backend
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|v| v.volume)
            .collect();
        assert_eq!(held, listed);
        assert_eq!(held, expected.into_iter().map(vol).collect::<Vec<_>>());
    }
}
