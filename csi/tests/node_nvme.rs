//! The NVMe/TCP path of the node service (`AttachMode::NvmeTcp`) against pillar-host's fake
//! sysfs tree, served over a real unix socket. Where a test needs a real device, the fake
//! namespace's device node is a real loop device (see `node_support::add_volume_on_loop`), so
//! the same code that runs on an NVMe host finds, verifies, formats and mounts it here.
//!
//! What the fake cannot do: create a controller on connect (there is no /dev/nvme-fabrics), or
//! remove a controller on delete (the write is recorded instead). The real connect is tested in
//! the VM lane.

#![allow(clippy::unwrap_used)]

mod node_support;

use std::fs;
use std::time::{Duration, Instant};

use node_support::*;
use pillar_host::fake::{FakeNamespace, FakeSysfs};
use pillar_host::{StageMode, StagePhase, StageRecord, StageStore};
use pillar_nvmet::VolumeId;
use tonic::Code;

const TIMEOUT: Duration = Duration::from_secs(2);

// proves W9 (fail closed): with reservations on, a stage whose reservation step fails (here: a
// stand-in device that answers no NVMe ioctl) fails with INTERNAL naming the step, after the
// identity check and before anything is written: the device stays blank and nothing is mounted.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_reservation_step_fails_the_stage_before_the_device_is_written() {
    let lo = LoopDevice::new(SIZE);
    let root = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(root.path()).unwrap();
    let vol = "pvc-resv";
    add_volume_on_loop(&mut f, 0, 0, vol, identity(vol), &lo);
    let paths = f.paths().clone();
    let h = Harness::start(move |dir| {
        let mut c = config(dir, pillar_csi::node::AttachMode::NvmeTcp, paths);
        c.connect_timeout = TIMEOUT;
        c.reservations = true;
        c
    })
    .await;
    let (staging, _g) = h.path("staging");
    let err = h
        .stage(vol, &staging, mount_cap("ext4"), nvme_ctx(vol))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Internal, "{}", err.message());
    assert!(
        err.message().contains("NVMe Write Exclusive reservation")
            && err.message().contains("namespace ID"),
        "{}",
        err.message()
    );
    assert_eq!(lo.fs_type(), None);
    assert!(mount_at(&staging).is_none());
    assert_eq!(h.record(vol).unwrap()["phase"], "connected");
    assert_eq!(h.record(vol).unwrap()["reservation"], true);
}

// proves N1: a namespace whose UUID/NGUID are not the volume's is refused with
// FAILED_PRECONDITION before anything reads or writes the device: the blank device stays blank,
// nothing is mounted, the record never passes `connecting`, and the controller (which this call
// did not create) is left alone. The same setup with the right identity stages (so the refusal
// is the identity's doing).
#[tokio::test(flavor = "multi_thread")]
async fn identity_mismatch_is_refused_before_the_device_is_touched() {
    let lo = LoopDevice::new(SIZE);
    let root = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(root.path()).unwrap();
    let vol = "pvc-n1";
    add_volume_on_loop(&mut f, 0, 0, vol, identity("pvc-someone-else"), &lo);
    let h = Harness::nvme(f.paths().clone(), TIMEOUT).await;
    let (staging, _g) = h.path("staging");

    let err = h
        .stage(vol, &staging, mount_cap("ext4"), nvme_ctx(vol))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        err.message().contains("not volume pvc-n1's namespace"),
        "{}",
        err.message()
    );
    assert_eq!(lo.fs_type(), None);
    assert!(mount_at(&staging).is_none());
    assert_eq!(h.record(vol).unwrap()["phase"], "connecting");
    assert!(f.deletes_requested().is_empty());

    // Positive control: the volume's own identity on the same device stages.
    let root2 = tempfile::tempdir().unwrap();
    let mut f2 = FakeSysfs::new(root2.path()).unwrap();
    add_volume_on_loop(&mut f2, 0, 0, vol, identity(vol), &lo);
    let h2 = Harness::nvme(f2.paths().clone(), TIMEOUT).await;
    let (staging2, _g2) = h2.path("staging");
    h2.stage(vol, &staging2, mount_cap("ext4"), nvme_ctx(vol))
        .await
        .unwrap();
    assert_eq!(lo.fs_type().as_deref(), Some("ext4"));
    h2.unstage(vol, &staging2).await.unwrap();
}

// proves N1 (found by subsystem NQN, for this host only): a namespace of the volume's subsystem
// reachable only through another host's controller is not used.
#[tokio::test(flavor = "multi_thread")]
async fn another_hosts_namespace_is_not_used() {
    require_root_and_loop();
    let root = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(root.path()).unwrap();
    let vol = "pvc-other-host";
    f.add_subsystem(0, nqn(vol).as_str()).unwrap();
    f.add_controller(&controller(0, 0, OTHER_HOST_NQN, "live"))
        .unwrap();
    f.add_namespace(&FakeNamespace {
        subsys_instance: 0,
        head_instance: 1,
        nsid: 1,
        multipath: false,
        ctrl_instances: vec![0],
        uuid: Some(identity(vol).uuid),
        nguid: Some(identity(vol).nguid),
        size_sectors: 8,
    })
    .unwrap();
    let h = Harness::nvme(f.paths().clone(), TIMEOUT).await;
    let (staging, _g) = h.path("staging");
    // Not this host's controller, so the service connects, and this fake has no
    // /dev/nvme-fabrics: UNAVAILABLE, with the record at `connecting` (rule N2).
    let err = h
        .stage(vol, &staging, block_cap(), nvme_ctx(vol))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{}", err.message());
    assert!(err.message().contains("nvme-fabrics"), "{}", err.message());
    assert_eq!(h.record(vol).unwrap()["phase"], "connecting");
    h.unstage(vol, &staging).await.unwrap();
    assert!(h.record(vol).is_none());
    // The other host's controller is not this node's to disconnect (rule N4).
    assert!(f.deletes_requested().is_empty());
}

// The whole NVMe/TCP life of a filesystem volume on the fake host with a real device: stage
// (find by NQN, verify, format, mount), publish, stats with the volume condition following the
// controller state, expand (controller rescanned, xfs grown), unpublish, unstage.
// proves N4: unstage deletes only this host's controller of this volume's subsystem: not
// another host's controller of the same subsystem, nor this host's controller of another volume.
#[tokio::test(flavor = "multi_thread")]
async fn nvme_volume_lifecycle_and_disconnect_only_this_subsystem() {
    let lo = LoopDevice::new(SIZE);
    let other = LoopDevice::new(SIZE);
    let root = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(root.path()).unwrap();
    let vol = "pvc-life";
    add_volume_on_loop(&mut f, 0, 0, vol, identity(vol), &lo);
    // Another host's controller of the same subsystem, and this host's controller of another
    // volume.
    f.add_controller(&controller(1, 0, OTHER_HOST_NQN, "live"))
        .unwrap();
    add_volume_on_loop(
        &mut f,
        1,
        2,
        "pvc-neighbour",
        identity("pvc-neighbour"),
        &other,
    );
    let h = Harness::nvme(f.paths().clone(), TIMEOUT).await;
    let (staging, _gs) = h.path("staging");
    let (target, _gt) = h.path("pods/a/volume");

    h.stage(vol, &staging, mount_cap("xfs"), nvme_ctx(vol))
        .await
        .unwrap();
    h.stage(vol, &staging, mount_cap("xfs"), nvme_ctx(vol))
        .await
        .unwrap();
    let rec = h.record(vol).unwrap();
    assert_eq!(rec["phase"], "mounted");
    assert_eq!(rec["device"], "nvme0n1");
    assert_eq!(rec["hostnqn"], HOST_NQN);
    assert_eq!(rec["traddr"], "192.0.2.10");
    assert_eq!(mount_at(&staging).unwrap().0, "xfs");
    h.publish(vol, &staging, &target, mount_cap("xfs"), false)
        .await
        .unwrap();
    fs::write(target.join("data"), b"nvme").unwrap();

    let s = h.stats(vol, &target).await.unwrap();
    let c = s.volume_condition.unwrap();
    assert!(!c.abnormal, "{c:?}");
    f.set_state(0, "connecting").unwrap();
    let c = h
        .stats(vol, &target)
        .await
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(c.abnormal);
    assert!(c.message.contains("nvme0 (connecting)"), "{}", c.message);
    // Another host's live controller does not make this host's path healthy.
    assert!(!c.message.contains("nvme1"), "{}", c.message);
    f.set_state(0, "live").unwrap();
    assert!(
        !h.stats(vol, &target)
            .await
            .unwrap()
            .volume_condition
            .unwrap()
            .abnormal
    );
    // The host dropped the namespace (after `identifiers changed`) while the controller stays
    // live: the condition must say so.
    let disk = f.paths().sys.join("block/nvme0n1");
    let parked = root.path().join("parked-nvme0n1");
    fs::rename(&disk, &parked).unwrap();
    let c = h
        .stats(vol, &target)
        .await
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(c.abnormal && c.message.contains("gone"), "{c:?}");
    fs::rename(&parked, &disk).unwrap();
    assert!(
        !h.stats(vol, &target)
            .await
            .unwrap()
            .volume_condition
            .unwrap()
            .abnormal
    );

    let before = h.stats(vol, &target).await.unwrap().usage[0].total;
    lo.grow(2 * SIZE);
    let size = h.expand(vol, &target, i64_of(2 * SIZE)).await.unwrap();
    assert_eq!(size, i64_of(2 * SIZE));
    let rescan = root.path().join("sys/class/nvme/nvme0/rescan_controller");
    assert_eq!(fs::read_to_string(rescan).unwrap(), "1");
    // Only this host's controller of this subsystem was rescanned.
    for other_ctrl in ["nvme1", "nvme2"] {
        let p = root
            .path()
            .join(format!("sys/class/nvme/{other_ctrl}/rescan_controller"));
        assert_eq!(fs::read_to_string(p).unwrap(), "", "{other_ctrl}");
    }
    let after = h.stats(vol, &target).await.unwrap().usage[0].total;
    assert!(
        after > before + i64_of(SIZE) * 9 / 10,
        "{before} -> {after}"
    );

    assert_code(h.unstage(vol, &staging).await, Code::FailedPrecondition);
    assert!(f.deletes_requested().is_empty());
    h.unpublish(vol, &target).await.unwrap();
    h.unstage(vol, &staging).await.unwrap();
    assert!(mount_at(&staging).is_none());
    assert_eq!(f.deletes_requested(), [0]);
    assert!(h.record(vol).is_none());
    assert_eq!(fs::read(staging.join("data")).ok(), None);
}

// A block volume on the NVMe path: publish finds the device again by NQN and verified identity
// (never trusting the recorded name) and binds it; a namespace whose identity changed since the
// stage is refused at publish too.
#[tokio::test(flavor = "multi_thread")]
async fn nvme_block_publish_reverifies_the_device() {
    let lo = LoopDevice::new(SIZE);
    let root = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(root.path()).unwrap();
    let vol = "pvc-nvme-block";
    add_volume_on_loop(&mut f, 3, 5, vol, identity(vol), &lo);
    let h = Harness::nvme(f.paths().clone(), TIMEOUT).await;
    let (staging, _gs) = h.path("staging");
    let (target, _gt) = h.path("pods/a/dev/volume");
    h.stage(vol, &staging, block_cap(), nvme_ctx(vol))
        .await
        .unwrap();
    h.publish(vol, &staging, &target, block_cap(), false)
        .await
        .unwrap();
    let s = h.stats(vol, &target).await.unwrap();
    assert_eq!(s.usage[0].total, i64_of(SIZE));
    h.unpublish(vol, &target).await.unwrap();

    // The kernel now shows another identity under this subsystem (e.g. a re-created export).
    let nguid = root.path().join("sys/block/nvme3n1/nguid");
    fs::write(&nguid, format!("{}\n", identity("pvc-other").nguid)).unwrap();
    assert_code(
        h.publish(vol, &staging, &target, block_cap(), false).await,
        Code::FailedPrecondition,
    );
    assert!(mount_at(&target).is_none());
    h.unstage(vol, &staging).await.unwrap();
    assert_eq!(f.deletes_requested(), [5]);
}

// proves N2: a record left at `connecting` by a crash (this host's controller exists, nothing
// mounted) lets unstage disconnect that subsystem's controller and remove the record.
#[tokio::test(flavor = "multi_thread")]
async fn connecting_record_lets_unstage_disconnect() {
    require_root_and_loop();
    let root = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(root.path()).unwrap();
    let vol = "pvc-crashed";
    f.add_subsystem(4, nqn(vol).as_str()).unwrap();
    f.add_controller(&controller(7, 4, HOST_NQN, "connecting"))
        .unwrap();
    f.add_subsystem(5, nqn("pvc-untouched").as_str()).unwrap();
    f.add_controller(&controller(8, 5, HOST_NQN, "live"))
        .unwrap();
    let h = Harness::nvme(f.paths().clone(), TIMEOUT).await;
    let (staging, _g) = h.path("staging");
    let store = StageStore::open(&h.state).unwrap();
    store
        .write(&StageRecord {
            volume: VolumeId::parse(vol).unwrap(),
            nqn: nqn(vol),
            hostnqn: host_nqn(),
            traddr: "192.0.2.10".parse().unwrap(),
            trsvcid: 4420,
            device: None,
            staging_path: staging.clone(),
            mode: StageMode::Block,
            phase: StagePhase::Connecting,
            reservation: false,
        })
        .unwrap();
    h.unstage(vol, &staging).await.unwrap();
    assert_eq!(f.deletes_requested(), [7]);
    assert!(h.record(vol).is_none());
}

// proves N2 (the window after attach, before the record says so, and a lost record): no record
// but a mount at the staging path: unstage unmounts and disconnects by the NQN derived from the
// volume ID.
#[tokio::test(flavor = "multi_thread")]
async fn unstage_without_record_disconnects_by_derived_nqn() {
    let lo = LoopDevice::new(SIZE);
    let root = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(root.path()).unwrap();
    let vol = "pvc-no-record";
    add_volume_on_loop(&mut f, 0, 6, vol, identity(vol), &lo);
    let h = Harness::nvme(f.paths().clone(), TIMEOUT).await;
    let (staging, _g) = h.path("staging");
    h.stage(vol, &staging, mount_cap("ext4"), nvme_ctx(vol))
        .await
        .unwrap();
    fs::remove_file(h.record_path(vol)).unwrap();
    h.unstage(vol, &staging).await.unwrap();
    assert!(mount_at(&staging).is_none());
    assert_eq!(f.deletes_requested(), [6]);
}

// The per-volume lock: while a stage waits for its namespace, a second call on the same volume
// is ABORTED at once (retry later), a call on another volume is not blocked; the waiting stage
// ends UNAVAILABLE after the connect timeout, naming what it saw (rule C5).
#[tokio::test(flavor = "multi_thread")]
async fn busy_volume_is_aborted_and_a_missing_namespace_is_unavailable() {
    require_root_and_loop();
    let root = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(root.path()).unwrap();
    let vol = "pvc-slow";
    f.add_subsystem(0, nqn(vol).as_str()).unwrap();
    f.add_controller(&controller(0, 0, HOST_NQN, "live"))
        .unwrap();
    let h = std::sync::Arc::new(Harness::nvme(f.paths().clone(), TIMEOUT).await);
    let staging = h.work.join("staging");
    let slow = {
        let h = h.clone();
        let staging = staging.clone();
        tokio::spawn(async move { h.stage(vol, &staging, block_cap(), nvme_ctx(vol)).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let start = Instant::now();
    assert_code(
        h.stage(vol, &staging, block_cap(), nvme_ctx(vol)).await,
        Code::Aborted,
    );
    assert_code(h.unstage(vol, &staging).await, Code::Aborted);
    assert!(start.elapsed() < Duration::from_secs(1));
    // Another volume is not blocked (it is simply not staged).
    h.unstage("pvc-else", &staging).await.unwrap();
    let err = slow.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{}", err.message());
    assert!(err.message().contains("nvme0 (live"), "{}", err.message());
    // The lock is free again.
    h.unstage(vol, &staging).await.unwrap();
    assert!(f.deletes_requested() == [0]);
}

// A block volume recorded as staged is staged only while its device is there: when the device
// is gone (a reboot, a lost controller), NodeStageVolume attaches again instead of answering OK
// (rule N2: the record is rewritten at `connecting` first).
#[tokio::test(flavor = "multi_thread")]
async fn block_restage_reattaches_when_the_device_is_gone() {
    let lo = LoopDevice::new(SIZE);
    let root = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(root.path()).unwrap();
    let vol = "pvc-reboot";
    let disk = add_volume_on_loop(&mut f, 0, 0, vol, identity(vol), &lo);
    let h = Harness::nvme(f.paths().clone(), Duration::from_millis(500)).await;
    let (staging, _g) = h.path("staging");
    h.stage(vol, &staging, block_cap(), nvme_ctx(vol))
        .await
        .unwrap();
    h.stage(vol, &staging, block_cap(), nvme_ctx(vol))
        .await
        .unwrap();

    let node = f.paths().dev.join(&disk);
    fs::remove_file(&node).unwrap();
    assert_code(
        h.stage(vol, &staging, block_cap(), nvme_ctx(vol)).await,
        Code::Unavailable,
    );
    assert_eq!(h.record(vol).unwrap()["phase"], "connecting");

    let (major, minor) = lo.devnum();
    let st = std::process::Command::new("mknod")
        .arg(&node)
        .arg("b")
        .arg(major.to_string())
        .arg(minor.to_string())
        .status()
        .unwrap();
    assert!(st.success());
    h.stage(vol, &staging, block_cap(), nvme_ctx(vol))
        .await
        .unwrap();
    assert_eq!(h.record(vol).unwrap()["phase"], "mounted");
    h.unstage(vol, &staging).await.unwrap();
}

// proves W9 (issue 22, also noticed): NodeGetVolumeStats takes the reservation back only under
// the volume's lock. While another operation holds the volume (here an expand waiting for a
// size the device never reaches; an unstage releasing the reservation is the case that
// matters), stats reports usage and condition but does not touch the reservation, so it can
// never re-acquire what an unstage just released; once the volume is free again it does. The
// stand-in device answers no NVMe command, so every attempt shows as an abnormal condition
// naming the reservation. On the old code stats attempted it while the volume was busy.
#[tokio::test(flavor = "multi_thread")]
async fn stats_takes_the_reservation_back_only_under_the_volume_lock() {
    let lo = LoopDevice::new(SIZE);
    let root = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(root.path()).unwrap();
    let vol = "pvc-stats-lock";
    add_volume_on_loop(&mut f, 0, 0, vol, identity(vol), &lo);
    // The expand below holds the volume for this long, whatever the machine's load.
    let h = Harness::nvme(f.paths().clone(), Duration::from_secs(5)).await;
    let (staging, _gs) = h.path("staging");
    let (target, _gt) = h.path("pods/a/volume");
    h.stage(vol, &staging, mount_cap("ext4"), nvme_ctx(vol))
        .await
        .unwrap();
    h.publish(vol, &staging, &target, mount_cap("ext4"), false)
        .await
        .unwrap();
    // Staged as a stage with reservations on would have left it (this device cannot take one).
    let path = h.record_path(vol);
    let mut rec: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    rec["reservation"] = serde_json::Value::Bool(true);
    fs::write(&path, serde_json::to_vec(&rec).unwrap()).unwrap();
    let attempted = |c: &pillar_csi::csi::VolumeCondition| {
        c.abnormal && c.message.contains("NVMe Write Exclusive reservation")
    };
    let c = h
        .stats(vol, &target)
        .await
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(attempted(&c), "stats does take the reservation back: {c:?}");

    // An expand holds the volume until its wait gives up (5 s).
    let busy = {
        let client = h.client.clone();
        let target = target.clone();
        tokio::spawn(async move {
            let mut client = client;
            loop {
                let answer = client
                    .node_expand_volume(pillar_csi::csi::NodeExpandVolumeRequest {
                        volume_id: vol.into(),
                        volume_path: path_str(&target),
                        capacity_range: Some(pillar_csi::csi::CapacityRange {
                            required_bytes: i64_of(3 * SIZE),
                            limit_bytes: 0,
                        }),
                        ..Default::default()
                    })
                    .await;
                // The probe below held the volume at that moment: as a CO would, ask again.
                if !matches!(&answer, Err(s) if s.code() == Code::Aborted) {
                    return answer;
                }
            }
        })
    };
    // The volume is held once a cheap call on it is refused as busy.
    let (probe, _gp) = h.path("not-published-here");
    loop {
        if busy.is_finished() {
            panic!(
                "the expand ended before it was seen holding the volume: {:?}",
                busy.await.unwrap()
            );
        }
        if let Err(s) = h.unpublish(vol, &probe).await
            && s.code() == Code::Aborted
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let s = h.stats(vol, &target).await.unwrap();
    assert!(!s.usage.is_empty());
    let c = s.volume_condition.unwrap();
    assert!(
        !attempted(&c),
        "stats took the reservation back while another operation held the volume: {c:?}"
    );
    assert_code(busy.await.unwrap(), Code::Unavailable);
    let c = h
        .stats(vol, &target)
        .await
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(attempted(&c), "free again: {c:?}");

    h.unpublish(vol, &target).await.unwrap();
    h.unstage(vol, &staging).await.unwrap();
}
