//! The node service over a real unix socket in the single-machine mode
//! (`AttachMode::LocalDevice`) on real loop devices: stage, publish, unpublish, unstage, stats,
//! expand, stage records.
//!
//! Needs root and loop devices; see `node_support`.

#![allow(clippy::unwrap_used)]

mod node_support;

use std::fs::{self, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;

use node_support::*;
use pillar_csi::context;
use pillar_csi::csi::volume_capability::AccessType;
use pillar_csi::csi::volume_capability::access_mode::Mode;
use pillar_csi::csi::volume_capability::{BlockVolume, MountVolume};
use pillar_csi::csi::volume_usage::Unit;
use tonic::Code;

// proves N3: a blank device is formatted and mounted; a device that holds a filesystem is never
// formatted again: a marker written before unstage survives the next stage. Each call is
// idempotent.
#[tokio::test(flavor = "multi_thread")]
async fn stage_formats_only_blank_devices_and_restage_keeps_data() {
    for fs_type in ["ext4", "xfs"] {
        let lo = LoopDevice::new(SIZE);
        let h = Harness::local().await;
        let vol = format!("pvc-n3-{fs_type}");
        let (staging, _g) = h.path("staging");
        assert_eq!(lo.fs_type(), None);

        // The filesystem comes from the context here; the capability names none.
        let mut ctx = local_ctx(&vol, &lo.dev);
        ctx.insert(context::FS_TYPE.into(), fs_type.into());
        h.stage(&vol, &staging, mount_cap(""), ctx.clone())
            .await
            .unwrap();
        assert_eq!(lo.fs_type().as_deref(), Some(fs_type));
        assert_eq!(mount_at(&staging).unwrap().0, fs_type);
        assert_eq!(h.record(&vol).unwrap()["phase"], "mounted");
        fs::write(staging.join("marker"), b"kept").unwrap();

        // Idempotent: same request, same state, still one mount.
        h.stage(&vol, &staging, mount_cap(""), ctx.clone())
            .await
            .unwrap();
        let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let needle = format!(" {} ", staging.display());
        assert_eq!(mounts.matches(&needle).count(), 1, "{mounts}");

        h.unstage(&vol, &staging).await.unwrap();
        assert!(mount_at(&staging).is_none());
        assert!(h.record(&vol).is_none());
        h.unstage(&vol, &staging).await.unwrap();

        h.stage(&vol, &staging, mount_cap(""), ctx).await.unwrap();
        assert_eq!(
            fs::read(staging.join("marker")).unwrap(),
            b"kept",
            "{fs_type}"
        );
        h.unstage(&vol, &staging).await.unwrap();
    }
}

// proves N3: a device holding another filesystem is refused, not reformatted.
#[tokio::test(flavor = "multi_thread")]
async fn stage_refuses_a_device_with_another_filesystem() {
    let lo = LoopDevice::new(SIZE);
    let st = std::process::Command::new("mkfs.xfs")
        .arg("-q")
        .arg(&lo.dev)
        .status()
        .unwrap();
    assert!(st.success());
    let h = Harness::local().await;
    let (staging, _g) = h.path("staging");
    let err = h
        .stage(
            "pvc-other-fs",
            &staging,
            mount_cap("ext4"),
            local_ctx("pvc-other-fs", &lo.dev),
        )
        .await;
    assert_code(err, Code::FailedPrecondition);
    assert_eq!(lo.fs_type().as_deref(), Some("xfs"));
    assert!(mount_at(&staging).is_none());
}

// A read-write publication writes through to the staged filesystem; a read-only one really
// refuses writes (EROFS); publishing again is idempotent; the same target with the other access
// is ALREADY_EXISTS; unpublish removes the target and is idempotent.
#[tokio::test(flavor = "multi_thread")]
async fn publish_read_write_and_read_only() {
    let lo = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-publish";
    let (staging, _gs) = h.path("staging");
    let (rw, _g1) = h.path("pods/a/volume");
    let (ro, _g2) = h.path("pods/b/volume");
    h.stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();

    h.publish(vol, &staging, &rw, mount_cap("ext4"), false)
        .await
        .unwrap();
    h.publish(vol, &staging, &rw, mount_cap("ext4"), false)
        .await
        .unwrap();
    fs::write(rw.join("data"), b"through the target").unwrap();
    assert_eq!(
        fs::read(staging.join("data")).unwrap(),
        b"through the target"
    );

    h.publish(vol, &staging, &ro, mount_cap("ext4"), true)
        .await
        .unwrap();
    h.publish(vol, &staging, &ro, mount_cap("ext4"), true)
        .await
        .unwrap();
    assert_eq!(fs::read(ro.join("data")).unwrap(), b"through the target");
    let err = fs::write(ro.join("other"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    assert!(mount_at(&ro).unwrap().1.split(',').any(|o| o == "ro"));
    // The read-only access mode alone makes the publication read-only too.
    let (ro_mode, _g3) = h.path("pods/c/volume");
    let reader = cap(
        Mode::SingleNodeReaderOnly,
        AccessType::Mount(MountVolume::default()),
    );
    h.publish(vol, &staging, &ro_mode, reader, false)
        .await
        .unwrap();
    let err = fs::write(ro_mode.join("other"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");

    assert_code(
        h.publish(vol, &staging, &ro, mount_cap("ext4"), false)
            .await,
        Code::AlreadyExists,
    );

    for t in [&rw, &ro, &ro_mode] {
        h.unpublish(vol, t).await.unwrap();
        assert!(mount_at(t).is_none());
        assert!(!t.exists());
        h.unpublish(vol, t).await.unwrap();
    }
    // The staged filesystem is untouched by unpublish.
    assert_eq!(
        fs::read(staging.join("data")).unwrap(),
        b"through the target"
    );
    h.unstage(vol, &staging).await.unwrap();
}

// A block volume: nothing is mounted at the staging path; publish binds the device node onto a
// file at the target: what is written through the target is read back through the loop device.
#[tokio::test(flavor = "multi_thread")]
async fn block_publish_binds_the_device() {
    let lo = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-block";
    let (staging, _gs) = h.path("staging");
    let (target, _gt) = h.path("pods/a/dev/volume");
    h.stage(vol, &staging, block_cap(), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    h.stage(vol, &staging, block_cap(), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    assert!(mount_at(&staging).is_none());
    assert_eq!(h.record(vol).unwrap()["mode"]["kind"], "block");
    // The device was not formatted.
    assert_eq!(lo.fs_type(), None);

    h.publish(vol, &staging, &target, block_cap(), false)
        .await
        .unwrap();
    h.publish(vol, &staging, &target, block_cap(), false)
        .await
        .unwrap();
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    let f = OpenOptions::new().write(true).open(&target).unwrap();
    f.write_all_at(&pattern, 3 * MIB).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let mut back = vec![0u8; 4096];
    // O_DIRECT is not needed: both paths share the loop device's page cache.
    fs::File::open(&lo.dev)
        .unwrap()
        .read_exact_at(&mut back, 3 * MIB)
        .unwrap();
    assert_eq!(back, pattern);

    // A filesystem publication of a block stage is refused.
    let (wrong, _gw) = h.path("pods/b/volume");
    assert_code(
        h.publish(vol, &staging, &wrong, mount_cap("ext4"), false)
            .await,
        Code::FailedPrecondition,
    );
    // A read-only bind of a device node does not stop writes, so read-only block is refused.
    let (ro, _gr) = h.path("pods/c/dev/volume");
    assert_code(
        h.publish(vol, &staging, &ro, block_cap(), true).await,
        Code::InvalidArgument,
    );
    assert!(!ro.exists());

    h.unpublish(vol, &target).await.unwrap();
    assert!(!target.exists());
    h.unpublish(vol, &target).await.unwrap();
    h.unstage(vol, &staging).await.unwrap();
    assert!(h.record(vol).is_none());
}

// SINGLE_NODE_SINGLE_WRITER (RWOP) means one workload: a second target on the same node is
// FAILED_PRECONDITION, for filesystem and block volumes, until the first is unpublished; the
// same target again is idempotent. SINGLE_NODE_WRITER allows several targets (shown above).
#[tokio::test(flavor = "multi_thread")]
async fn a_single_writer_volume_is_published_at_one_target_at_a_time() {
    let rwop_fs = || {
        cap(
            Mode::SingleNodeSingleWriter,
            AccessType::Mount(MountVolume {
                fs_type: "ext4".into(),
                ..Default::default()
            }),
        )
    };
    let rwop_block = || {
        cap(
            Mode::SingleNodeSingleWriter,
            AccessType::Block(BlockVolume {}),
        )
    };
    for (vol, block) in [("pvc-rwop-fs", false), ("pvc-rwop-block", true)] {
        let lo = LoopDevice::new(SIZE);
        let h = Harness::local().await;
        let c = if block { rwop_block } else { rwop_fs };
        let (staging, _gs) = h.path("staging");
        let (first, _g1) = h.path(if block {
            "pods/a/dev/volume"
        } else {
            "pods/a/volume"
        });
        let (second, _g2) = h.path(if block {
            "pods/b/dev/volume"
        } else {
            "pods/b/volume"
        });
        h.stage(vol, &staging, c(), local_ctx(vol, &lo.dev))
            .await
            .unwrap();
        h.publish(vol, &staging, &first, c(), false).await.unwrap();
        h.publish(vol, &staging, &first, c(), false).await.unwrap();
        assert_code(
            h.publish(vol, &staging, &second, c(), false).await,
            Code::FailedPrecondition,
        );
        assert!(mount_at(&second).is_none());
        h.unpublish(vol, &first).await.unwrap();
        h.publish(vol, &staging, &second, c(), false).await.unwrap();
        h.unpublish(vol, &second).await.unwrap();
        h.unstage(vol, &staging).await.unwrap();
    }
}

// Unstage never pulls a device from under a publication: it is FAILED_PRECONDITION while the
// staged filesystem is still mounted at a target, and succeeds after unpublish.
#[tokio::test(flavor = "multi_thread")]
async fn unstage_waits_for_unpublish() {
    let lo = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-busy";
    let (staging, _gs) = h.path("staging");
    let (target, _gt) = h.path("pods/a/volume");
    h.stage(vol, &staging, mount_cap("xfs"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    h.publish(vol, &staging, &target, mount_cap("xfs"), false)
        .await
        .unwrap();
    assert_code(h.unstage(vol, &staging).await, Code::FailedPrecondition);
    assert!(mount_at(&staging).is_some());
    assert!(h.record(vol).is_some());
    h.unpublish(vol, &target).await.unwrap();
    h.unstage(vol, &staging).await.unwrap();
    assert!(mount_at(&staging).is_none());
}

// Publish before stage, or at another staging path, is FAILED_PRECONDITION; a stage at a second
// path while the first is in use is FAILED_PRECONDITION; the same path with another capability is
// ALREADY_EXISTS.
#[tokio::test(flavor = "multi_thread")]
async fn publish_needs_the_stage_and_stage_is_exclusive() {
    let lo = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-order";
    let (staging, _gs) = h.path("staging");
    let (other, _go) = h.path("staging-2");
    let (target, _gt) = h.path("pods/a/volume");
    assert_code(
        h.publish(vol, &staging, &target, mount_cap("ext4"), false)
            .await,
        Code::FailedPrecondition,
    );
    assert!(!target.exists());
    h.stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    assert_code(
        h.publish(vol, &other, &target, mount_cap("ext4"), false)
            .await,
        Code::FailedPrecondition,
    );
    assert_code(
        h.stage(vol, &other, mount_cap("ext4"), local_ctx(vol, &lo.dev))
            .await,
        Code::FailedPrecondition,
    );
    assert!(mount_at(&other).is_none());
    assert_code(
        h.stage(vol, &staging, block_cap(), local_ctx(vol, &lo.dev))
            .await,
        Code::AlreadyExists,
    );
    assert_code(
        h.stage(vol, &staging, mount_cap("xfs"), local_ctx(vol, &lo.dev))
            .await,
        Code::AlreadyExists,
    );
    // The refused stages left the first one as it was. (An unstage naming another path cleans up
    // the recorded stage: `unstage_of_another_path_cleans_up_the_recorded_stage`.)
    assert!(mount_at(&staging).is_some());
    assert!(h.record(vol).is_some());
    h.unstage(vol, &staging).await.unwrap();
    assert!(mount_at(&staging).is_none());
}

// NodeGetVolumeStats: bytes and inodes of a mounted filesystem (following real usage), the
// size of a block volume, the volume condition, NOT_FOUND for a missing path or a volume that is
// not staged here.
#[tokio::test(flavor = "multi_thread")]
async fn stats_of_filesystem_and_block_volumes() {
    let lo = LoopDevice::new(SIZE);
    let lo2 = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-stats";
    let (staging, _gs) = h.path("staging");
    let (target, _gt) = h.path("pods/a/volume");
    h.stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    h.publish(vol, &staging, &target, mount_cap("ext4"), false)
        .await
        .unwrap();

    let before = h.stats(vol, &target).await.unwrap();
    let bytes = |r: &pillar_csi::csi::NodeGetVolumeStatsResponse, unit: Unit| {
        r.usage
            .iter()
            .find(|u| u.unit == unit as i32)
            .cloned()
            .unwrap()
    };
    let b = bytes(&before, Unit::Bytes);
    let i = bytes(&before, Unit::Inodes);
    assert!(
        b.total > i64_of(400 * MIB) && b.total <= i64_of(SIZE),
        "{b:?}"
    );
    assert!(
        b.available > 0 && b.available <= b.total && b.used >= 0,
        "{b:?}"
    );
    assert!(
        i.total > 1000 && i.used > 0 && i.available + i.used == i.total,
        "{i:?}"
    );
    let cond = before.volume_condition.clone().unwrap();
    assert!(!cond.abnormal, "{cond:?}");

    let big = vec![0xa5u8; usize::try_from(16 * MIB).unwrap()];
    fs::write(target.join("big"), &big).unwrap();
    for _ in 0..100 {
        fs::write(target.join(format!("f{}", rand_name())), b"x").unwrap();
    }
    nix_sync();
    let after = h.stats(vol, &target).await.unwrap();
    let b2 = bytes(&after, Unit::Bytes);
    let i2 = bytes(&after, Unit::Inodes);
    assert!(b2.used >= b.used + i64_of(15 * MIB), "{b:?} -> {b2:?}");
    assert!(i2.used >= i.used + 100, "{i:?} -> {i2:?}");

    // A block volume: total bytes only.
    let bvol = "pvc-stats-block";
    let (bstaging, _gbs) = h.path("bstaging");
    let (btarget, _gbt) = h.path("pods/b/dev/volume");
    h.stage(bvol, &bstaging, block_cap(), local_ctx(bvol, &lo2.dev))
        .await
        .unwrap();
    h.publish(bvol, &bstaging, &btarget, block_cap(), false)
        .await
        .unwrap();
    let s = h.stats(bvol, &btarget).await.unwrap();
    assert_eq!(s.usage.len(), 1);
    assert_eq!(s.usage[0].total, i64_of(SIZE));
    assert_eq!(s.usage[0].unit, Unit::Bytes as i32);
    assert!(!s.volume_condition.unwrap().abnormal);

    assert_code(h.stats(vol, &h.work.join("missing")).await, Code::NotFound);
    assert_code(h.stats("pvc-never-staged", &target).await, Code::NotFound);
    // A directory with nothing mounted: NOT_FOUND, not the host filesystem's numbers.
    assert_code(h.stats(vol, &h.work).await, Code::NotFound);

    for (v, t, s) in [(vol, &target, &staging), (bvol, &btarget, &bstaging)] {
        h.unpublish(v, t).await.unwrap();
        h.unstage(v, s).await.unwrap();
    }
}

fn rand_name() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

fn nix_sync() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

// NodeExpandVolume grows an xfs filesystem online after the device grew (`losetup -c` stands in
// for the target's resize and the controller rescan), and returns the new size.
#[tokio::test(flavor = "multi_thread")]
async fn expand_grows_xfs_online() {
    let lo = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-grow-xfs";
    let (staging, _gs) = h.path("staging");
    let (target, _gt) = h.path("pods/a/volume");
    h.stage(vol, &staging, mount_cap("xfs"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    h.publish(vol, &staging, &target, mount_cap("xfs"), false)
        .await
        .unwrap();
    let total = |r: pillar_csi::csi::NodeGetVolumeStatsResponse| r.usage[0].total;
    let before = total(h.stats(vol, &target).await.unwrap());

    lo.grow(2 * SIZE);
    let size = h.expand(vol, &target, i64_of(2 * SIZE)).await.unwrap();
    assert_eq!(size, i64_of(2 * SIZE));
    let after = total(h.stats(vol, &target).await.unwrap());
    assert!(
        after > before + i64_of(SIZE) * 9 / 10,
        "{before} -> {after}"
    );
    // Idempotent.
    assert_eq!(
        h.expand(vol, &target, i64_of(2 * SIZE)).await.unwrap(),
        size
    );
    // A size the device never reaches: UNAVAILABLE after the wait, not a silent success.
    assert_code(
        h.expand(vol, &target, i64_of(3 * SIZE)).await,
        Code::Unavailable,
    );

    h.unpublish(vol, &target).await.unwrap();
    h.unstage(vol, &staging).await.unwrap();
    assert_code(h.expand(vol, &target, 0).await, Code::NotFound);
}

// ext4 online growth needs CAP_SYS_RESOURCE (resize2fs). Where this process has it, the volume
// grows; where it does not (this machine's sandbox), the failure is reported with resize2fs's
// own words, and the filesystem keeps its size.
#[tokio::test(flavor = "multi_thread")]
async fn expand_ext4_grows_or_reports_resize2fs() {
    let lo = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-grow-ext4";
    let (staging, _gs) = h.path("staging");
    h.stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    let total = |r: pillar_csi::csi::NodeGetVolumeStatsResponse| r.usage[0].total;
    let before = total(h.stats(vol, &staging).await.unwrap());
    lo.grow(2 * SIZE);
    let result = h.expand(vol, &staging, 0).await;
    let after = total(h.stats(vol, &staging).await.unwrap());
    if has_cap_sys_resource() {
        assert_eq!(result.unwrap(), i64_of(2 * SIZE));
        assert!(
            after > before + i64_of(SIZE) * 9 / 10,
            "{before} -> {after}"
        );
    } else {
        let status = result.unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{}", status.message());
        assert!(
            status.message().contains("resize2fs"),
            "{}",
            status.message()
        );
        assert_eq!(after, before);
    }
    h.unstage(vol, &staging).await.unwrap();
}

// A restore or clone made larger than its source holds the source's filesystem: NodeStage grows
// it to the device (no NodeExpandVolume follows a restore; found by Kubernetes' storage e2e
// suite, "should provision correct filesystem size when restoring snapshot to larger size pvc").
// Stand-in here: a filesystem made at SIZE, its device then grown to twice that. ext4 grows
// online only with CAP_SYS_RESOURCE: without it the stage fails with resize2fs's words.
// proves N6
#[tokio::test(flavor = "multi_thread")]
async fn stage_grows_a_filesystem_smaller_than_its_device() {
    let total = |r: pillar_csi::csi::NodeGetVolumeStatsResponse| r.usage[0].total;
    for fs_type in ["xfs", "ext4"] {
        let lo = LoopDevice::new(SIZE);
        let h = Harness::local().await;
        let vol = format!("pvc-larger-restore-{fs_type}");
        let (staging, _gs) = h.path("staging");
        let stage = || h.stage(&vol, &staging, mount_cap(fs_type), local_ctx(&vol, &lo.dev));
        stage().await.unwrap();
        let before = total(h.stats(&vol, &staging).await.unwrap());
        fs::write(staging.join("marker"), b"kept").unwrap();
        h.unstage(&vol, &staging).await.unwrap();

        lo.grow(2 * SIZE);
        let result = stage().await;
        if fs_type == "xfs" || has_cap_sys_resource() {
            result.unwrap();
            let after = total(h.stats(&vol, &staging).await.unwrap());
            assert!(
                after > before + i64_of(SIZE) * 9 / 10,
                "{fs_type}: {before} -> {after}"
            );
            assert_eq!(fs::read(staging.join("marker")).unwrap(), b"kept");
            // Staged again: nothing left to grow, the same size.
            stage().await.unwrap();
            assert_eq!(total(h.stats(&vol, &staging).await.unwrap()), after);
        } else {
            let status = result.unwrap_err();
            assert_eq!(status.code(), Code::Internal, "{}", status.message());
            assert!(
                status.message().contains("resize2fs"),
                "{}",
                status.message()
            );
        }
        h.unstage(&vol, &staging).await.unwrap();
        assert!(mount_at(&staging).is_none(), "{fs_type}");
    }
}

// A block volume expands without any filesystem step.
#[tokio::test(flavor = "multi_thread")]
async fn expand_block_reports_the_new_size() {
    let lo = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-grow-block";
    let (staging, _gs) = h.path("staging");
    let (target, _gt) = h.path("pods/a/dev/volume");
    h.stage(vol, &staging, block_cap(), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    h.publish(vol, &staging, &target, block_cap(), false)
        .await
        .unwrap();
    lo.grow(SIZE + 64 * MIB);
    assert_eq!(
        h.expand(vol, &target, 0).await.unwrap(),
        i64_of(SIZE + 64 * MIB)
    );
    assert_eq!(lo.fs_type(), None);
    h.unpublish(vol, &target).await.unwrap();
    h.unstage(vol, &staging).await.unwrap();
}

// proves C4: a corrupt stage record makes stage and unstage fail with an error; the record is
// left as it was for the operator, and nothing is mounted.
#[tokio::test(flavor = "multi_thread")]
async fn corrupt_record_is_an_error() {
    let lo = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-corrupt";
    let (staging, _gs) = h.path("staging");
    let record = h.record_path(vol);
    for garbage in [
        &b""[..],
        b"{\"version\": 1, \"volume\": ",
        b"not json at all\n",
    ] {
        fs::write(&record, garbage).unwrap();
        let err = h
            .stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &lo.dev))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Internal, "{}", err.message());
        assert!(err.message().contains("corrupt"), "{}", err.message());
        let err = h.unstage(vol, &staging).await.unwrap_err();
        assert_eq!(err.code(), Code::Internal, "{}", err.message());
        assert_eq!(fs::read(&record).unwrap(), garbage);
        assert!(mount_at(&staging).is_none());
        assert_eq!(lo.fs_type(), None);
    }
    // A record naming another volume is corrupt too.
    h.stage(
        "pvc-good",
        &staging,
        block_cap(),
        local_ctx("pvc-good", &lo.dev),
    )
    .await
    .unwrap();
    fs::copy(h.record_path("pvc-good"), &record).unwrap();
    assert_code(h.unstage(vol, &staging).await, Code::Internal);
    h.unstage("pvc-good", &staging).await.unwrap();
}

// proves N2: the record is written before the attach: a stage whose attach fails leaves a
// record at phase `connecting`, and unstage cleans it up.
#[tokio::test(flavor = "multi_thread")]
async fn record_written_before_attach_lets_unstage_clean_up() {
    require_root_and_loop();
    let h = Harness::local().await;
    let vol = "pvc-crash";
    let (staging, _gs) = h.path("staging");
    let missing = h.work.join("no-such-device");
    let err = h
        .stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &missing))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{}", err.message());
    let rec = h.record(vol).unwrap();
    assert_eq!(rec["phase"], "connecting");
    assert_eq!(rec["staging_path"], path_str(&staging));
    // A regular file is not a block device either.
    fs::write(&missing, b"").unwrap();
    assert_code(
        h.stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &missing))
            .await,
        Code::FailedPrecondition,
    );
    h.unstage(vol, &staging).await.unwrap();
    assert!(h.record(vol).is_none());
}

// proves N2 (the other crash window): the mount exists but the record is gone (or was never
// updated); unstage still unmounts.
#[tokio::test(flavor = "multi_thread")]
async fn unstage_without_record_unmounts_the_staging_path() {
    let lo = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-lost-record";
    let (staging, _gs) = h.path("staging");
    h.stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    fs::remove_file(h.record_path(vol)).unwrap();
    h.unstage(vol, &staging).await.unwrap();
    assert!(mount_at(&staging).is_none());
    // And a crash after the mount but before the record said `mounted`: stage again accepts
    // its own mount.
    h.stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    let mut rec = h.record(vol).unwrap();
    rec["phase"] = "formatted".into();
    fs::write(h.record_path(vol), serde_json::to_vec(&rec).unwrap()).unwrap();
    h.stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    assert_eq!(h.record(vol).unwrap()["phase"], "mounted");
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert_eq!(
        mounts.matches(&format!(" {} ", staging.display())).count(),
        1
    );
    h.unstage(vol, &staging).await.unwrap();
    assert_eq!(
        fs::symlink_metadata(h.record_path(vol))
            .map(|_| ())
            .unwrap_err()
            .kind(),
        ErrorKind::NotFound
    );
}

// proves N2: the record follows the stage step by step: a mount that fails after the format
// leaves the record at `formatted` (the device holds the filesystem, nothing is mounted), and
// unstage cleans up; the next stage reuses the filesystem (N3).
#[tokio::test(flavor = "multi_thread")]
async fn record_advances_through_the_phases() {
    let lo = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-phases";
    let (staging, _gs) = h.path("staging");
    let bad_flags = cap(
        Mode::SingleNodeWriter,
        AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec!["no_such_ext4_option".into()],
            ..Default::default()
        }),
    );
    let err = h
        .stage(vol, &staging, bad_flags, local_ctx(vol, &lo.dev))
        .await
        .unwrap_err();
    assert_ne!(err.code(), Code::Ok, "{}", err.message());
    assert!(err.message().contains("mounting"), "{}", err.message());
    let rec = h.record(vol).unwrap();
    assert_eq!(rec["phase"], "formatted");
    assert_eq!(rec["device"], path_str(&lo.dev));
    assert_eq!(lo.fs_type().as_deref(), Some("ext4"));
    assert!(mount_at(&staging).is_none());
    h.unstage(vol, &staging).await.unwrap();
    assert!(h.record(vol).is_none());
    h.stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    assert_eq!(h.record(vol).unwrap()["phase"], "mounted");
    h.unstage(vol, &staging).await.unwrap();
}

// proves N2: an unstage that names another staging path than the recorded one (a CO whose
// staging path changed) undoes what the record holds instead of answering OK with the volume
// still mounted; while a publication uses the staged filesystem it is refused like any unstage.
#[tokio::test(flavor = "multi_thread")]
async fn unstage_of_another_path_cleans_up_the_recorded_stage() {
    let lo = LoopDevice::new(SIZE);
    let h = Harness::local().await;
    let vol = "pvc-moved-staging";
    let (staging, _gs) = h.path("staging");
    let (other, _go) = h.path("staging-new");
    let (target, _gt) = h.path("pods/a/volume");
    h.stage(vol, &staging, mount_cap("ext4"), local_ctx(vol, &lo.dev))
        .await
        .unwrap();
    h.publish(vol, &staging, &target, mount_cap("ext4"), false)
        .await
        .unwrap();
    assert_code(h.unstage(vol, &other).await, Code::FailedPrecondition);
    assert!(mount_at(&staging).is_some());
    assert!(h.record(vol).is_some());

    h.unpublish(vol, &target).await.unwrap();
    h.unstage(vol, &other).await.unwrap();
    assert!(
        mount_at(&staging).is_none(),
        "the recorded stage is still mounted"
    );
    assert!(h.record(vol).is_none());
    h.unstage(vol, &other).await.unwrap();
}

/// A digest of every byte of `dev`: proves a stage wrote nothing to it.
fn device_digest(dev: &std::path::Path) -> u64 {
    use std::hash::{DefaultHasher, Hasher};
    use std::io::Read;
    let mut file = fs::File::open(dev).unwrap();
    let mut hasher = DefaultHasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).unwrap();
        if n == 0 {
            return hasher.finish();
        }
        hasher.write(&buf[..n]);
    }
}

// proves N5: a read-only publication (READ_ONLY in the publish context, on a multi-node
// single-writer volume) stages read-only on every node: an ext4 whose journal asks for recovery
// is refused on both (FAILED_PRECONDITION, failing closed: a stage without the replay would show
// stale data, issue 21) without a byte written; once clean, two node plugins stage it, neither
// writes to it (the device's bytes do not change), writes fail with EROFS, and a blank device is
// refused rather than formatted.
#[tokio::test(flavor = "multi_thread")]
async fn a_read_only_publication_stages_read_only_and_never_writes_the_device() {
    let lo = LoopDevice::new(SIZE);
    let st = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&lo.dev)
        .status()
        .unwrap();
    assert!(st.success());
    // A journal that needs recovery: a mount that replays it writes the device.
    let st = std::process::Command::new("debugfs")
        .args(["-w", "-R", "feature needs_recovery"])
        .arg(&lo.dev)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    nix_sync();
    let before = device_digest(&lo.dev);

    // Each node sees the namespace through its own device, as two NVMe hosts do.
    let other = lo.second_device();
    let vol = "pvc-n5";
    let writer = cap(
        Mode::MultiNodeSingleWriter,
        AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        }),
    );
    let nodes = [Harness::local().await, Harness::local().await];
    let mut stagings = Vec::new();
    for (h, dev) in nodes.iter().zip([&lo.dev, &other.dev]) {
        let mut ctx = local_ctx(vol, dev);
        ctx.insert(context::READ_ONLY.into(), "true".into());
        let (staging, guard) = h.path("staging");
        assert_code(
            h.stage(vol, &staging, writer.clone(), ctx.clone()).await,
            Code::FailedPrecondition,
        );
        assert!(mount_at(&staging).is_none());
        stagings.push((staging, guard));
    }
    nix_sync();
    assert_eq!(
        device_digest(&lo.dev),
        before,
        "a refused read-only stage wrote"
    );
    // The journal is empty: clearing the flag makes the filesystem clean as it stands.
    let st = std::process::Command::new("debugfs")
        .args(["-w", "-R", "feature -needs_recovery"])
        .arg(&lo.dev)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    nix_sync();
    let before = device_digest(&lo.dev);

    for (h, (dev, (staging, _))) in nodes
        .iter()
        .zip([&lo.dev, &other.dev].iter().zip(&stagings))
    {
        let mut ctx = local_ctx(vol, dev);
        ctx.insert(context::READ_ONLY.into(), "true".into());
        let staging = staging.clone();
        h.stage(vol, &staging, writer.clone(), ctx.clone())
            .await
            .unwrap();
        let (fs_type, options) = mount_at(&staging).unwrap();
        assert_eq!(fs_type, "ext4");
        assert!(options.split(',').any(|o| o == "ro"), "{options}");
        let err = fs::write(staging.join("x"), b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
        // The same stage again is idempotent; a read-write one on the same path is refused.
        h.stage(vol, &staging, writer.clone(), ctx.clone())
            .await
            .unwrap();
        assert_code(
            h.stage(vol, &staging, writer.clone(), local_ctx(vol, dev))
                .await,
            Code::AlreadyExists,
        );
    }
    for (h, (staging, _)) in nodes.iter().zip(&stagings) {
        h.unstage(vol, staging).await.unwrap();
        assert!(mount_at(staging).is_none());
    }
    nix_sync();
    assert_eq!(device_digest(&lo.dev), before, "a read-only stage wrote");

    // A blank device is not formatted by a read-only stage.
    let blank = LoopDevice::new(SIZE);
    let h = &nodes[0];
    let (staging, _g) = h.path("staging-blank");
    let mut ctx = local_ctx("pvc-n5-blank", &blank.dev);
    ctx.insert(context::READ_ONLY.into(), "true".into());
    assert_code(
        h.stage("pvc-n5-blank", &staging, writer.clone(), ctx.clone())
            .await,
        Code::FailedPrecondition,
    );
    assert_eq!(blank.fs_type(), None);
    assert!(mount_at(&staging).is_none());
    // A malformed flag is bad input, not a guess.
    ctx.insert(context::READ_ONLY.into(), "yes".into());
    assert_code(
        h.stage("pvc-n5-blank", &staging, writer, ctx).await,
        Code::InvalidArgument,
    );
}
