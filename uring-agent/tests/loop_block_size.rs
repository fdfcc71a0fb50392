//! A file pool's loop devices keep one logical block size (512 bytes) whatever the backing
//! file is: fresh, a reflink copy (restore, clone), or the source of one, on the first bind
//! and every re-bind. Needs root, `/dev/loop-control` and `mkfs.xfs`; skips with a SKIPPED
//! message where one is missing.
//!
//! Why xfs: with direct I/O and no explicit block size, Linux 6.18 gives a loop device the
//! backing file's direct-I/O alignment as its logical block size, and xfs reports the file
//! system block size (4096) for a file with shared extents (a reflink copy, and its source
//! from the first copy on) but the device's sector size (512) for any other file.

#![allow(clippy::unwrap_used)]

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use pillar_agent::backend::loopdev::{self, Detach};
use pillar_agent::backend::{ContentSource, CopyPolicy, FileBackend, MIB, VolumeInfo};
use pillar_nvmet::VolumeId;

/// An xfs (reflink=1) mounted on a loop device over a sparse file. On drop: every loop device
/// bound to a file in it is unbound, then it is unmounted (`mount -o loop` sets autoclear, so
/// its own loop device goes with it).
struct Xfs {
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl Xfs {
    /// `None` (after saying why) where the test cannot run.
    fn new() -> Option<Self> {
        if let Err(e) = loopdev::check_control() {
            eprintln!("SKIPPED: no usable /dev/loop-control (needs root and loop devices): {e}");
            return None;
        }
        if Command::new("mkfs.xfs").arg("-V").output().is_err() {
            eprintln!("SKIPPED: mkfs.xfs not found (xfsprogs)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        let image = dir.path().join("xfs.img");
        File::create(&image).unwrap().set_len(512 << 20).unwrap();
        run("mkfs.xfs", &["-q", "-m", "reflink=1", path_str(&image)]);
        run("mount", &["-o", "loop", path_str(&image), path_str(&mnt)]);
        Some(Self { mnt, _dir: dir })
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        if let Ok(bindings) = loopdev::bindings() {
            for b in bindings
                .iter()
                .filter(|b| b.backing_file.starts_with(&self.mnt))
            {
                let _ = loopdev::detach(b.index, Duration::from_secs(2));
            }
        }
        let _ = Command::new("umount").arg(&self.mnt).status();
    }
}

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn vol(id: &str) -> VolumeId {
    VolumeId::parse(id).unwrap()
}

fn index(info: &VolumeInfo) -> u32 {
    path_str(&info.device_path)
        .strip_prefix("/dev/loop")
        .and_then(|n| n.parse().ok())
        .unwrap()
}

fn queue_attr(info: &VolumeInfo, attr: &str) -> String {
    fs::read_to_string(format!("/sys/block/loop{}/{attr}", index(info)))
        .unwrap()
        .trim()
        .to_owned()
}

fn logical_block_size(info: &VolumeInfo) -> String {
    queue_attr(info, "queue/logical_block_size")
}

fn read_device(info: &VolumeInfo, len: usize) -> Vec<u8> {
    let mut buf = vec![0; len];
    File::open(&info.device_path)
        .unwrap()
        .read_exact_at(&mut buf, 0)
        .unwrap();
    buf
}

// proves I1 for the LBA size (defect: loop devices were bound with `block_size: 0`, and the
// kernel's default with direct I/O follows the backing file's direct-I/O alignment, which xfs
// raises to 4096 for a reflinked file: a volume made with 512-byte sectors came back after a
// restore, a clone or a re-bind of a snapshotted source with 4096-byte sectors, and its xfs no
// longer mounted). The namespace exports the loop device's logical block size as its LBA
// size, so it must be the same on every bind.
#[tokio::test]
async fn a_file_pool_loop_device_keeps_512_byte_sectors_through_reflink_copies_and_rebinds() {
    let Some(xfs) = Xfs::new() else { return };
    let pool = xfs.mnt.join("pool");
    fs::create_dir(&pool).unwrap();
    let backend = FileBackend::new("files", &pool).unwrap();

    let v = vol("pvc-lbs-source");
    let source = backend.create(&v, 16 * MIB).await.unwrap();
    assert_eq!(logical_block_size(&source), "512", "fresh volume");
    // Direct I/O stays on where the kernel accepts it at 512 bytes.
    assert_eq!(
        queue_attr(&source, "loop/dio"),
        "1",
        "fresh volume's direct I/O"
    );
    let data = vec![0x5a; 4096];
    let file = OpenOptions::new()
        .write(true)
        .open(backend.backing_file(&v))
        .unwrap();
    file.write_all_at(&data, 0).unwrap();
    file.sync_all().unwrap();

    // A snapshot, a restore and a clone: reflinks, which give the source shared extents too.
    let snap = vol("snap-lbs");
    backend
        .create_snapshot(&v, &snap, CopyPolicy::AtOnce)
        .await
        .unwrap();
    let restored = backend
        .create_from(
            &vol("pvc-lbs-restored"),
            16 * MIB,
            &ContentSource::Snapshot(snap),
            CopyPolicy::AtOnce,
        )
        .await
        .unwrap();
    assert_eq!(logical_block_size(&restored), "512", "restored volume");
    assert_eq!(read_device(&restored, data.len()), data);
    let clone = backend
        .create_from(
            &vol("pvc-lbs-clone"),
            32 * MIB,
            &ContentSource::Volume(v.clone()),
            CopyPolicy::AtOnce,
        )
        .await
        .unwrap();
    assert_eq!(logical_block_size(&clone), "512", "cloned volume");
    assert_eq!(read_device(&clone, data.len()), data);

    // Unbound (as by a storage reboot) and bound again, by this backend and by a new one (an
    // agent restart).
    assert_eq!(
        loopdev::detach(index(&source), Duration::from_secs(2)).unwrap(),
        Detach::Done
    );
    let rebound = backend.lookup(&v).await.unwrap().unwrap();
    assert_eq!(logical_block_size(&rebound), "512", "source bound again");
    assert_eq!(read_device(&rebound, data.len()), data);
    for info in [&rebound, &restored, &clone] {
        assert_eq!(
            loopdev::detach(index(info), Duration::from_secs(2)).unwrap(),
            Detach::Done
        );
    }
    let restarted = FileBackend::new("files", &pool).unwrap();
    let listed = restarted.list().await.unwrap();
    assert_eq!(listed.len(), 3);
    for info in &listed {
        assert_eq!(
            logical_block_size(info),
            "512",
            "{} after restart",
            info.volume
        );
        assert_eq!(read_device(info, data.len()), data);
    }
}
