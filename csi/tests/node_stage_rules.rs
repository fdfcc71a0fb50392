//! NodeStageVolume on real loop devices, for what a stage must tell apart (issue 22): two
//! copies of one XFS (a clone or a restore next to its source) stage side by side, and a
//! read-only stage never accepts a read-write mount found at its staging path.
//!
//! Needs root and loop devices; see `node_support`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod node_support;

use std::fs;

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
