//! Scenario 12: snapshots, restores and clones of the lvm-thin backend on device-mapper, with
//! the data written and read through NVMe/TCP.

use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::{ErrorReason, reason_of};
use tonic::Code;

use crate::attach::{attach, detach, from};
use crate::harness::MIB;
use crate::harness::data::pattern;
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::lab::Lab;
use crate::harness::machine::drop_caches;
use crate::lvm::{Lifecycle, S8_THIN_POOL, ScratchVg, find_lv, lvs, read_at, write_at};

const VG: &str = "pillar-s12";
const POOL: &str = "thin";

fn lv_names() -> Vec<String> {
    let mut names: Vec<String> = lvs(VG).into_iter().map(|l| l.name).collect();
    names.sort();
    names
}

/// Scenario 12 (issue 12 item 7): a thin volume written through NVMe/TCP, a snapshot cut while
/// the host is connected, more writes, a restore of the snapshot into a new volume (larger) and
/// a clone of the volume, each attached and read back through NVMe/TCP; the restore holds
/// exactly the data at the cut, the clone the data after. Deletes in the orders LVM thin allows
/// (the source before its snapshot, the snapshot before its restore); a delete of an exported
/// volume and a stale snapshot token are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
#[allow(clippy::too_many_lines)]
async fn s12_lvm_thin_snapshots() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s12_lvm_thin_snapshots");
    let mut lab = Lab::new("s12", false).await;
    let mut vg = ScratchVg::create(
        &lab.dir.join("pv.img"),
        VG,
        1 << 30,
        S8_THIN_POOL,
        256 * MIB,
    );
    let thin_pool = format!("{POOL}=lvm-thin:{VG}/{S8_THIN_POOL}");
    let mut agent = lab.start_agent(&["--pool", &thin_pool]).await;
    agent
        .resync_exports(agent_api::ResyncExportsRequest {
            exports: vec![],
            ..Default::default()
        })
        .await
        .expect("resync");
    sc.step(&format!(
        "VG {VG} with thin pool {S8_THIN_POOL}; agent serving pool {POOL}"
    ));

    let (src_uid, snap_uid) = ("s12-src-uid", "s12-snap-uid");
    let mut src = Lifecycle::new(src_uid);
    agent
        .create_volume(agent_api::CreateVolumeRequest {
            token: src.next(),
            volume_id: "kl-s12-src".into(),
            pool: POOL.into(),
            size_bytes: 32 * MIB,
            source: None,
        })
        .await
        .expect("CreateVolume");
    let a = attach(&mut agent, POOL, "kl-s12-src", &mut src).await;
    let mib = usize::try_from(MIB).unwrap();
    let (before_head, before_tail) = (pattern(1200, mib), pattern(1201, mib));
    write_at(&a.dev, 0, &before_head);
    write_at(&a.dev, a.size - MIB, &before_tail);
    sc.step(&format!(
        "kl-s12-src attached at {}; first and last MiB written",
        a.dev.display()
    ));

    // The cut, with the host still connected: a thin snapshot is one point in time.
    let mut snap = Lifecycle::new(snap_uid);
    let cut = agent
        .create_snapshot(agent_api::CreateSnapshotRequest {
            token: snap.next(),
            snapshot_id: "kl-s12-snap".into(),
            pool: POOL.into(),
            source_volume_id: "kl-s12-src".into(),
            source_lifecycle_uid: src_uid.into(),
        })
        .await
        .expect("CreateSnapshot")
        .into_inner();
    assert_eq!(cut.size_bytes, 32 * MIB);
    assert_eq!(cut.method, "lvm-thin");
    let snap_lv = find_lv(VG, "snap+kl-s12-snap").expect("the snapshot LV exists");
    assert_eq!(snap_lv.tags, vec!["pillar-snapshot".to_owned()]);
    assert_eq!(snap_lv.pool_lv, S8_THIN_POOL);
    // lv_attr: 5th character the state (not active), 10th the activation skip flag.
    assert_ne!(
        snap_lv.attr.chars().nth(4),
        Some('a'),
        "snapshot active: {}",
        snap_lv.attr
    );
    assert_eq!(
        snap_lv.attr.chars().nth(9),
        Some('k'),
        "activation skip: {}",
        snap_lv.attr
    );
    let retry = agent
        .create_snapshot(agent_api::CreateSnapshotRequest {
            token: snap.again(),
            snapshot_id: "kl-s12-snap".into(),
            pool: POOL.into(),
            source_volume_id: "kl-s12-src".into(),
            source_lifecycle_uid: src_uid.into(),
        })
        .await
        .expect("CreateSnapshot retried")
        .into_inner();
    assert_eq!(
        (retry.creation_unix_seconds, retry.method.as_str()),
        (cut.creation_unix_seconds, "")
    );
    let stale = agent
        .create_snapshot(agent_api::CreateSnapshotRequest {
            token: Lifecycle::new("s12-other-uid").next(),
            snapshot_id: "kl-s12-other".into(),
            pool: POOL.into(),
            source_volume_id: "kl-s12-src".into(),
            source_lifecycle_uid: "an-older-lifecycle".into(),
        })
        .await
        .expect_err("a snapshot of another lifecycle of the source");
    assert_eq!(
        reason_of(&stale),
        ErrorReason::SourceNotLive,
        "{}",
        stale.message()
    );
    sc.step(&format!(
        "CreateSnapshot with the host connected: LV {} tagged pillar-snapshot, inactive, \
         activation skip set ({}); a retry is the same snapshot; another source lifecycle refused",
        snap_lv.name, snap_lv.attr
    ));

    let (after_head, after_tail) = (pattern(1300, mib), pattern(1301, mib));
    write_at(&a.dev, 0, &after_head);
    write_at(&a.dev, a.size - MIB, &after_tail);
    drop_caches();
    assert_eq!(read_at(&a.dev, 0, mib), after_head);

    // The restore, larger than the snapshot, and the clone.
    let mut restored = Lifecycle::new("s12-restored-uid");
    let r = agent
        .create_volume(agent_api::CreateVolumeRequest {
            token: restored.next(),
            volume_id: "kl-s12-restored".into(),
            pool: POOL.into(),
            size_bytes: 48 * MIB,
            source: from(Some("kl-s12-snap"), None, snap_uid),
        })
        .await
        .expect("CreateVolume from the snapshot")
        .into_inner();
    assert_eq!(r.size_bytes, 48 * MIB);
    let mut cloned = Lifecycle::new("s12-cloned-uid");
    agent
        .create_volume(agent_api::CreateVolumeRequest {
            token: cloned.next(),
            volume_id: "kl-s12-cloned".into(),
            pool: POOL.into(),
            size_bytes: 32 * MIB,
            source: from(None, Some("kl-s12-src"), src_uid),
        })
        .await
        .expect("CreateVolume from the volume");
    let small = agent
        .create_volume(agent_api::CreateVolumeRequest {
            token: Lifecycle::new("s12-small-uid").next(),
            volume_id: "kl-s12-small".into(),
            pool: POOL.into(),
            size_bytes: 16 * MIB,
            source: from(Some("kl-s12-snap"), None, snap_uid),
        })
        .await
        .expect_err("a restore smaller than its snapshot");
    assert_eq!(small.code(), Code::OutOfRange, "{}", small.message());
    for vol in ["kl-s12-restored", "kl-s12-cloned"] {
        let lv = find_lv(VG, vol).expect("LV");
        assert_eq!(
            lv.tags,
            vec!["pillar".to_owned()],
            "{vol} tagged as a volume"
        );
        assert_eq!(
            lv.attr.chars().nth(4),
            Some('a'),
            "{vol} active: {}",
            lv.attr
        );
    }
    sc.step(
        "CreateVolume from the snapshot (48 MiB) and from the volume (a clone): thin LVs \
             tagged pillar, active; a restore smaller than the snapshot OUT_OF_RANGE",
    );

    let r_att = attach(&mut agent, POOL, "kl-s12-restored", &mut restored).await;
    assert_eq!(
        r_att.size,
        48 * MIB,
        "the host sees the restored volume's size"
    );
    let c_att = attach(&mut agent, POOL, "kl-s12-cloned", &mut cloned).await;
    drop_caches();
    assert!(
        read_at(&r_att.dev, 0, mib) == before_head,
        "restore: first MiB is not the cut's"
    );
    assert!(
        read_at(&r_att.dev, 32 * MIB - MIB, mib) == before_tail,
        "restore: last MiB of the source is not the cut's"
    );
    assert!(
        read_at(&r_att.dev, 40 * MIB, mib).iter().all(|&b| b == 0),
        "restore: the grown part is not zero"
    );
    assert!(
        read_at(&c_att.dev, 0, mib) == after_head,
        "clone: first MiB is not the volume's"
    );
    assert!(
        read_at(&c_att.dev, 32 * MIB - MIB, mib) == after_tail,
        "clone: last MiB is not the volume's"
    );
    // Writes to the restore reach neither the snapshot nor the source.
    write_at(&r_att.dev, 0, &pattern(1400, mib));
    drop_caches();
    assert!(
        read_at(&a.dev, 0, mib) == after_head,
        "a write to the restore reached the source"
    );
    sc.step(
        "through NVMe/TCP: the restore holds exactly the data at the cut (and zeros past the \
             source's size), the clone the data after it; a write to the restore leaves the \
             source alone",
    );

    // Orders: an exported volume is not deleted; the source goes before its snapshot, the
    // snapshot before its restore (thin snapshots share blocks, they do not depend on an
    // origin); a stale snapshot token is refused.
    let busy = agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: src.next(),
            volume_id: "kl-s12-src".into(),
            pool: POOL.into(),
        })
        .await
        .expect_err("DeleteVolume of an exported volume");
    assert_eq!(busy.code(), Code::FailedPrecondition, "{}", busy.message());
    detach(&mut agent, "kl-s12-src", &a, &mut src).await;
    agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: src.next(),
            volume_id: "kl-s12-src".into(),
            pool: POOL.into(),
        })
        .await
        .expect("DeleteVolume of the source while its snapshot lives");
    assert!(find_lv(VG, "kl-s12-src").is_none());
    let mut again = Lifecycle::new("s12-again-uid");
    agent
        .create_volume(agent_api::CreateVolumeRequest {
            token: again.next(),
            volume_id: "kl-s12-again".into(),
            pool: POOL.into(),
            size_bytes: 32 * MIB,
            source: from(Some("kl-s12-snap"), None, snap_uid),
        })
        .await
        .expect("a restore after the source is gone");
    // A newer call on the snapshot (a CreateSnapshot retried with a newer token) moves its
    // mark to generation 2; a delete carrying generation 1 is then stale.
    agent
        .create_snapshot(agent_api::CreateSnapshotRequest {
            token: snap.next(),
            snapshot_id: "kl-s12-snap".into(),
            pool: POOL.into(),
            source_volume_id: "kl-s12-src".into(),
            source_lifecycle_uid: src_uid.into(),
        })
        .await
        .expect("CreateSnapshot with a newer token: the same snapshot");
    let stale = agent
        .delete_snapshot(agent_api::DeleteSnapshotRequest {
            token: Some(agent_api::FencingToken {
                lifecycle_uid: snap_uid.into(),
                generation: 1,
            }),
            snapshot_id: "kl-s12-snap".into(),
            pool: POOL.into(),
        })
        .await
        .expect_err("a stale DeleteSnapshot");
    assert_eq!(
        reason_of(&stale),
        ErrorReason::StaleGeneration,
        "{}",
        stale.message()
    );
    agent
        .delete_snapshot(agent_api::DeleteSnapshotRequest {
            token: snap.next(),
            snapshot_id: "kl-s12-snap".into(),
            pool: POOL.into(),
        })
        .await
        .expect("DeleteSnapshot while its restores live");
    assert!(find_lv(VG, "snap+kl-s12-snap").is_none());
    drop_caches();
    assert!(
        read_at(&r_att.dev, 32 * MIB - MIB, mib) == before_tail,
        "the restore lost data with its snapshot"
    );
    let gone = agent
        .create_volume(agent_api::CreateVolumeRequest {
            token: Lifecycle::new("s12-late-uid").next(),
            volume_id: "kl-s12-late".into(),
            pool: POOL.into(),
            size_bytes: 32 * MIB,
            source: from(Some("kl-s12-snap"), None, snap_uid),
        })
        .await
        .expect_err("a restore of a deleted snapshot");
    assert_eq!(
        reason_of(&gone),
        ErrorReason::SourceNotLive,
        "{}",
        gone.message()
    );
    sc.step(
        "DeleteVolume of an exported volume FAILED_PRECONDITION; the source deleted before its \
             snapshot, a restore after that works; a stale DeleteSnapshot refused; the snapshot \
             deleted before its restore, which keeps its data; a restore of it then refused",
    );

    for (vol, att, life) in [
        ("kl-s12-restored", &r_att, &mut restored),
        ("kl-s12-cloned", &c_att, &mut cloned),
    ] {
        detach(&mut agent, vol, att, life).await;
        agent
            .delete_volume(agent_api::DeleteVolumeRequest {
                token: life.next(),
                volume_id: vol.into(),
                pool: POOL.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("DeleteVolume {vol}: {e}"));
    }
    agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: again.next(),
            volume_id: "kl-s12-again".into(),
            pool: POOL.into(),
        })
        .await
        .expect("DeleteVolume kl-s12-again");
    assert_eq!(lv_names(), vec![S8_THIN_POOL.to_owned()], "LVs left");
    lab.agent.as_mut().unwrap().stop();
    vg.teardown()
        .expect("remove the volume group and its loop device");
    sc.step("every volume deleted; only the thin pool was left; VG removed");
}
