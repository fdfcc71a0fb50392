//! The file pools' snapshot copy on a file system that reflinks: a real xfs (reflink=1, the
//! mkfs.xfs default) on a loop device. The copy is a `FICLONE`: its extents are shared with the
//! source (filefrag reports them `shared`), it holds the source's bytes at the cut, and a later
//! write to the source leaves it alone (copy on write). Needs root, `mkfs.xfs` and `filefrag`
//! (`scripts/setup.sh` installs xfsprogs; e2fsprogs ships filefrag).

#![allow(clippy::unwrap_used)]

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use pillar_agent::backend::copy::{CopyMethod, durable_copy, reflink_supported};

/// An xfs file system mounted on a loop device over a sparse file; unmounted on drop (the
/// loop device goes with it: `mount -o loop` sets autoclear).
struct Xfs {
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl Xfs {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("xfs.img");
        File::create(&image).unwrap().set_len(512 << 20).unwrap();
        run(
            "mkfs.xfs",
            &["-q", "-m", "reflink=1", image.to_str().unwrap()],
        );
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        run(
            "mount",
            &["-o", "loop", image.to_str().unwrap(), mnt.to_str().unwrap()],
        );
        Self { mnt, _dir: dir }
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
    }
}

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn write(path: &Path, offset: u64, byte: u8, len: usize) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&vec![byte; len], offset).unwrap();
    f.sync_all().unwrap();
}

fn read(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0; len];
    File::open(path)
        .unwrap()
        .read_exact_at(&mut buf, offset)
        .unwrap();
    buf
}

#[test]
fn a_copy_on_xfs_is_a_reflink_sharing_extents_and_keeps_its_moment() {
    let xfs = Xfs::new();
    assert!(
        reflink_supported(&xfs.mnt).unwrap(),
        "xfs with reflink=1 must reflink"
    );
    let source = xfs.mnt.join("v.img");
    File::create(&source).unwrap().set_len(16 << 20).unwrap();
    write(&source, 0, 0xa1, 1 << 20);
    write(&source, 8 << 20, 0xa2, 1 << 20);

    let snapshot = xfs.mnt.join("snap.img");
    assert_eq!(
        durable_copy(&source, &snapshot, 0).unwrap(),
        CopyMethod::Reflink
    );
    let extents = run("filefrag", &["-v", snapshot.to_str().unwrap()]);
    assert!(extents.contains("shared"), "no shared extent:\n{extents}");

    // The source moves on; the snapshot keeps the bytes of its moment.
    write(&source, 0, 0xb1, 1 << 20);
    assert_eq!(read(&snapshot, 0, 1 << 20), vec![0xa1; 1 << 20]);
    assert_eq!(read(&snapshot, 8 << 20, 1 << 20), vec![0xa2; 1 << 20]);
    assert_eq!(read(&snapshot, 4 << 20, 4096), vec![0; 4096]);
    assert_eq!(read(&source, 0, 4096), vec![0xb1; 4096]);

    // A restore into a larger volume: a reflink, then grown.
    let restored = xfs.mnt.join("r.img");
    assert_eq!(
        durable_copy(&snapshot, &restored, 32 << 20).unwrap(),
        CopyMethod::Reflink
    );
    assert_eq!(fs::metadata(&restored).unwrap().len(), 32 << 20);
    assert_eq!(read(&restored, 0, 4096), vec![0xa1; 4096]);
}
