//! NodeStageVolume on real loop devices, for what a stage must tell apart (issue 22): two
//! copies of one XFS (a clone or a restore next to its source) stage side by side, and a
//! read-only stage never accepts a read-write mount found at its staging path; a read-only stage
//! of a filesystem whose log needs recovery is refused (issue 21).
//!
//! Needs root and loop devices; see `node_support`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod node_support;

use std::fs;
use std::path::Path;
use std::process::Command;

use node_support::{Harness, LoopDevice, SIZE, local_ctx, mount_at, mount_cap};
use pillar_csi::context;

fn sync_all() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

// Issue 22, defect 16: a clone or restore of an XFS volume is a byte copy, so it carries its
// source's XFS UUID, and XFS refuses to mount a second filesystem with a UUID already mounted
// unless told `nouuid`. Staged on the node where its source is staged (read-write, and another
// copy read-only), each mounts and keeps its own content. On the old code the copy's stage
// failed: the mount was refused (INTERNAL).
#[tokio::test(flavor = "multi_thread")]
async fn copies_of_one_xfs_stage_next_to_their_source() {
    let source = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let (staging, _g) = h.path("staging-source");
    h.stage(
        "pvc-src",
        &staging,
        mount_cap("xfs"),
        local_ctx("pvc-src", &source.dev),
    )
    .await
    .unwrap();
    fs::write(staging.join("marker"), b"source").unwrap();
    h.unstage("pvc-src", &staging).await.unwrap();
    sync_all();
    let clone = source.copy();
    let restore = source.copy();

    h.stage(
        "pvc-src",
        &staging,
        mount_cap("xfs"),
        local_ctx("pvc-src", &source.dev),
    )
    .await
    .unwrap();
    let (clone_staging, _gc) = h.path("staging-clone");
    h.stage(
        "pvc-clone",
        &clone_staging,
        mount_cap("xfs"),
        local_ctx("pvc-clone", &clone.dev),
    )
    .await
    .expect("a copy of a staged XFS stages too");
    let (restore_staging, _gr) = h.path("staging-restore");
    let mut ro = local_ctx("pvc-restore", &restore.dev);
    ro.insert(context::READ_ONLY.into(), "true".into());
    h.stage("pvc-restore", &restore_staging, mount_cap("xfs"), ro)
        .await
        .expect("a read-only copy of a staged XFS stages too");
    for path in [&staging, &clone_staging, &restore_staging] {
        let (fs_type, options) = mount_at(path).unwrap();
        assert_eq!(fs_type, "xfs", "{}", path.display());
        assert!(
            options.split(',').any(|o| o == "nouuid"),
            "{}: {options}",
            path.display()
        );
        assert_eq!(fs::read(path.join("marker")).unwrap(), b"source");
    }
    // Each is its own filesystem.
    fs::write(clone_staging.join("marker"), b"clone").unwrap();
    assert_eq!(fs::read(staging.join("marker")).unwrap(), b"source");
    assert_eq!(fs::read(restore_staging.join("marker")).unwrap(), b"source");

    h.unstage("pvc-restore", &restore_staging).await.unwrap();
    h.unstage("pvc-clone", &clone_staging).await.unwrap();
    h.unstage("pvc-src", &staging).await.unwrap();
}

// Issue 22 (also noticed): a read-only stage that finds the device already mounted at its
// staging path (a stage that crashed after its mount, before its record said so) accepts the
// mount only if it is read-only; a read-write mount of the device is refused (ALREADY_EXISTS),
// never reported as a read-only stage (N5). On the old code any mount of the device was
// accepted and the read-only stage answered OK over a read-write mount.
#[tokio::test(flavor = "multi_thread")]
async fn a_read_only_stage_never_accepts_a_read_write_mount() {
    let lo = LoopDevice::new(SIZE);
    let st = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&lo.dev)
        .status()
        .unwrap();
    assert!(st.success());
    let h = Harness::local().await;
    let vol = "pvc-ro-over-rw";
    let (staging, _g) = h.path("staging");
    fs::create_dir_all(&staging).unwrap();
    let st = std::process::Command::new("mount")
        .arg(&lo.dev)
        .arg(&staging)
        .status()
        .unwrap();
    assert!(st.success());
    let (_, options) = mount_at(&staging).unwrap();
    assert!(options.split(',').any(|o| o == "rw"), "{options}");
    let mut ro = local_ctx(vol, &lo.dev);
    ro.insert(context::READ_ONLY.into(), "true".into());
    node_support::assert_code(
        h.stage(vol, &staging, mount_cap("ext4"), ro).await,
        tonic::Code::AlreadyExists,
    );
    // A read-write stage of the same takes the mount it finds.
    h.stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    h.unstage(vol, &staging).await.unwrap();
    assert!(mount_at(&staging).is_none());
}

/// Whether two files hold the same bytes.
fn same_bytes(a: &Path, b: &Path) -> bool {
    Command::new("cmp")
        .arg("-s")
        .arg(a)
        .arg(b)
        .status()
        .unwrap()
        .success()
}

// Issue 21, defect 1 (proves N5 and fails closed, C): a restore of a snapshot of a mounted
// filesystem has a log holding the last fsynced changes. A read-only stage never replays a log
// (N5), so it mounted the filesystem as of its last checkpoint: the fsynced file was missing,
// silently. Now the read-only stage is refused (FAILED_PRECONDITION naming the volume and the
// remedy) without writing to the device; once the restore is staged read-write on one node (the
// log replayed) and unstaged, the read-only stage shows the file. On the old code the read-only
// stage answered OK and the file was absent (ext4 and xfs alike).
#[tokio::test(flavor = "multi_thread")]
async fn a_read_only_stage_of_a_log_that_needs_recovery_is_refused() {
    const DATA: usize = 4 << 20;
    for fs_type in ["ext4", "xfs"] {
        let source = LoopDevice::new(SIZE);
        let h = Harness::local().await;
        let (staging, _g) = h.path("staging-source");
        h.stage(
            "pvc-src",
            &staging,
            mount_cap(fs_type),
            local_ctx("pvc-src", &source.dev),
        )
        .await
        .unwrap();
        let mut f = fs::File::create(staging.join("fsynced")).unwrap();
        std::io::Write::write_all(&mut f, &vec![0xa5u8; DATA]).unwrap();
        f.sync_all().unwrap();
        drop(f);
        // The snapshot: the device's bytes while the filesystem is mounted.
        let restore = source.copy();
        h.unstage("pvc-src", &staging).await.unwrap();

        let vol = "pvc-restore";
        let (ro_staging, _gr) = h.path("staging-restore");
        let mut ro = local_ctx(vol, &restore.dev);
        ro.insert(context::READ_ONLY.into(), "true".into());
        let untouched = restore.copy();
        let err = h
            .stage(vol, &ro_staging, mount_cap(fs_type), ro.clone())
            .await
            .expect_err("a read-only stage of a log that needs recovery must be refused");
        assert_eq!(
            err.code(),
            tonic::Code::FailedPrecondition,
            "{fs_type}: {err:?}"
        );
        let msg = err.message();
        assert!(
            msg.contains(vol) && msg.contains("read-write") && msg.contains("recovery"),
            "{fs_type}: {msg}"
        );
        assert!(mount_at(&ro_staging).is_none(), "{fs_type}");
        assert!(
            same_bytes(&restore.backing, &untouched.backing),
            "{fs_type}: the refused read-only stage wrote to the device"
        );
        drop(untouched);

        // The remedy: one read-write stage replays the log.
        let (rw_staging, _gw) = h.path("staging-restore-rw");
        h.unstage(vol, &ro_staging).await.unwrap();
        h.stage(
            vol,
            &rw_staging,
            mount_cap(fs_type),
            local_ctx(vol, &restore.dev),
        )
        .await
        .unwrap();
        assert_eq!(
            fs::metadata(rw_staging.join("fsynced")).unwrap().len(),
            DATA as u64
        );
        h.unstage(vol, &rw_staging).await.unwrap();
        h.stage(vol, &ro_staging, mount_cap(fs_type), ro)
            .await
            .unwrap_or_else(|e| panic!("{fs_type}: {e:?}"));
        let (_, options) = mount_at(&ro_staging).unwrap();
        assert!(options.split(',').any(|o| o == "ro"), "{options}");
        assert_eq!(
            fs::read(ro_staging.join("fsynced")).unwrap(),
            vec![0xa5u8; DATA],
            "{fs_type}"
        );
        h.unstage(vol, &ro_staging).await.unwrap();
    }
}
