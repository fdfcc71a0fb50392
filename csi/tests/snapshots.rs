//! Snapshots, restores and clones through the controller's real gRPC service and a real agent
//! (file pool on loop devices, configfs double), on the embedded store and on kube-rs against
//! the API server double: records first, fencing, ListSnapshots paging, restore sizes.

#![allow(clippy::unwrap_used)]

mod support;

use std::io::{Read, Seek, SeekFrom, Write};

use pillar_csi::csi;
use pillar_state::store::Revision;
use support::{Env, Mode, StoreKind, create};
use tonic::Code;

const STORES: [StoreKind; 2] = [StoreKind::Embedded, StoreKind::Kube];

fn snapshot(name: &str, source: &str) -> csi::CreateSnapshotRequest {
    csi::CreateSnapshotRequest {
        source_volume_id: source.into(),
        name: name.into(),
        ..Default::default()
    }
}

fn restore(name: &str, snapshot_id: &str, bytes: i64) -> csi::CreateVolumeRequest {
    use csi::volume_content_source::{SnapshotSource, Type};
    csi::CreateVolumeRequest {
        capacity_range: Some(csi::CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_content_source: Some(csi::VolumeContentSource {
            r#type: Some(Type::Snapshot(SnapshotSource {
                snapshot_id: snapshot_id.into(),
            })),
        }),
        ..create(name, Mode::SingleNodeWriter)
    }
}

fn clone_of(name: &str, source: &str) -> csi::CreateVolumeRequest {
    use csi::volume_content_source::{Type, VolumeSource};
    csi::CreateVolumeRequest {
        volume_content_source: Some(csi::VolumeContentSource {
            r#type: Some(Type::Volume(VolumeSource {
                volume_id: source.into(),
            })),
        }),
        ..create(name, Mode::SingleNodeWriter)
    }
}

fn write_marker(env: &Env, volume: &str, byte: u8) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(env.agent.pool.join(format!("{volume}.img")))
        .unwrap();
    f.seek(SeekFrom::Start(1 << 20)).unwrap();
    f.write_all(&[byte; 512]).unwrap();
    f.sync_all().unwrap();
}

fn read_marker(env: &Env, volume: &str) -> u8 {
    let mut f = std::fs::File::open(env.agent.pool.join(format!("{volume}.img"))).unwrap();
    f.seek(SeekFrom::Start(1 << 20)).unwrap();
    let mut b = [0u8; 512];
    f.read_exact(&mut b).unwrap();
    assert!(b.iter().all(|&x| x == b[0]));
    b[0]
}

fn ids(r: &csi::ListSnapshotsResponse) -> Vec<String> {
    r.entries
        .iter()
        .map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone())
        .collect()
}

// proves F10 and F2 for snapshots, and what CreateSnapshot, ListSnapshots and GetSnapshot
// answer
#[tokio::test]
async fn a_snapshot_is_recorded_cut_listed_and_restored() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        let c = &mut env.client;
        c.create_volume(create("src", Mode::SingleNodeWriter))
            .await
            .unwrap();
        c.create_volume(create("other", Mode::SingleNodeWriter))
            .await
            .unwrap();
        write_marker(&env, "src", 0x11);
        let c = &mut env.client;

        // Refusals decided before anything is recorded.
        let s = c.create_snapshot(snapshot("", "src")).await.unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument, "{}", s.message());
        let s = c.create_snapshot(snapshot("snap-x", "")).await.unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument, "{}", s.message());
        let s = c
            .create_snapshot(snapshot("snap-x", "nope"))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::NotFound, "{}", s.message());
        assert!(env.store.list_snapshots().await.unwrap().is_empty());

        let c = &mut env.client;
        let first = c
            .create_snapshot(snapshot("snap-a", "src"))
            .await
            .unwrap()
            .into_inner()
            .snapshot
            .unwrap();
        assert!(first.ready_to_use);
        assert_eq!(first.source_volume_id, "src");
        assert_eq!(first.size_bytes, 16 << 20);
        assert!(first.creation_time.is_some());
        // Idempotent: the same answer, creation time included.
        let again = c
            .create_snapshot(snapshot("snap-a", "src"))
            .await
            .unwrap()
            .into_inner()
            .snapshot
            .unwrap();
        assert_eq!(again, first);
        // The same name from another source: ALREADY_EXISTS.
        let s = c
            .create_snapshot(snapshot("snap-a", "other"))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::AlreadyExists, "{}", s.message());
        // Recorded with its own lifecycle, naming the source's.
        let record = env
            .store
            .get_snapshot(&first.snapshot_id)
            .await
            .unwrap()
            .unwrap();
        let src = env.store.get_volume("src").await.unwrap().unwrap();
        assert_eq!(record.spec.source_uid, src.metadata.uid.clone().unwrap());
        assert_ne!(record.metadata.uid, src.metadata.uid);
        assert!(record.status_or_default().generation >= 1);

        // The source moves on; the restore holds the cut, the clone the present.
        write_marker(&env, "src", 0x22);
        let c = &mut env.client;
        for name in ["snap-b", "snap-c"] {
            c.create_snapshot(snapshot(name, "src")).await.unwrap();
        }
        c.create_snapshot(snapshot("snap-o", "other"))
            .await
            .unwrap();
        let restored = c
            .create_volume(restore("restored", &first.snapshot_id, 32 << 20))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        assert_eq!(restored.capacity_bytes, 32 << 20);
        assert!(matches!(
            restored.content_source.unwrap().r#type,
            Some(csi::volume_content_source::Type::Snapshot(ref s)) if s.snapshot_id == first.snapshot_id
        ));
        assert_eq!(read_marker(&env, "restored"), 0x11);
        let c = &mut env.client;
        c.create_volume(clone_of("cloned", "src")).await.unwrap();
        assert_eq!(read_marker(&env, "cloned"), 0x22);
        let c = &mut env.client;
        // Smaller than the snapshot: OUT_OF_RANGE; unknown snapshot or volume: NOT_FOUND.
        let s = c
            .create_volume(restore("small", &first.snapshot_id, 8 << 20))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::OutOfRange, "{}", s.message());
        let s = c
            .create_volume(restore("lost", "no-such-snap", 16 << 20))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::NotFound, "{}", s.message());
        let s = c
            .create_volume(clone_of("lost", "no-such-volume"))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::NotFound, "{}", s.message());
        // The same name again with another source: ALREADY_EXISTS.
        let s = c
            .create_volume(clone_of("restored", "src"))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::AlreadyExists, "{}", s.message());

        // ListSnapshots: all, in pages, by source, by ID.
        let all = c
            .list_snapshots(csi::ListSnapshotsRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ids(&all), ["snap-a", "snap-b", "snap-c", "snap-o"]);
        let page1 = c
            .list_snapshots(csi::ListSnapshotsRequest {
                max_entries: 3,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ids(&page1), ["snap-a", "snap-b", "snap-c"]);
        let page2 = c
            .list_snapshots(csi::ListSnapshotsRequest {
                max_entries: 3,
                starting_token: page1.next_token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ids(&page2), ["snap-o"]);
        assert!(page2.next_token.is_empty());
        let by_source = c
            .list_snapshots(csi::ListSnapshotsRequest {
                source_volume_id: "other".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ids(&by_source), ["snap-o"]);
        for (id, want) in [("snap-b", vec!["snap-b"]), ("snap-zzz", vec![])] {
            let by_id = c
                .list_snapshots(csi::ListSnapshotsRequest {
                    snapshot_id: id.into(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(ids(&by_id), want);
        }
        let s = c
            .list_snapshots(csi::ListSnapshotsRequest {
                starting_token: "not-a-token".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::Aborted, "{}", s.message());
        let got = c
            .get_snapshot(csi::GetSnapshotRequest {
                snapshot_id: "snap-a".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(got.snapshot.unwrap(), first);

        // Delete: gone from the list, the agent and the store; again is a success; a restore
        // from it is NOT_FOUND.
        c.delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: "snap-a".into(),
            ..Default::default()
        })
        .await
        .unwrap();
        c.delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: "snap-a".into(),
            ..Default::default()
        })
        .await
        .unwrap();
        assert!(!env.agent.pool.join(".snapshots/snap-a.img").exists());
        assert!(env.store.get_snapshot("snap-a").await.unwrap().is_none());
        let c = &mut env.client;
        let s = c
            .create_volume(restore("late", "snap-a", 16 << 20))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::NotFound, "{}", s.message());
        // The source can be deleted while its snapshots live on (file pools copy).
        c.delete_volume(csi::DeleteVolumeRequest {
            volume_id: "src".into(),
            ..Default::default()
        })
        .await
        .unwrap();
        c.create_volume(restore("after-source", "snap-b", 16 << 20))
            .await
            .unwrap();
        assert_eq!(read_marker(&env, "after-source"), 0x22);
    }
}

// proves F10 for snapshots: the record is written before the agent call, and a failed call
// leaves it; a retry completes it, a delete removes it
#[tokio::test]
async fn a_failed_cut_leaves_a_record_that_a_retry_completes_or_a_delete_removes() {
    let mut env = Env::start(StoreKind::Embedded, true).await;
    env.client
        .create_volume(create("src", Mode::SingleNodeWriter))
        .await
        .unwrap();
    env.agent
        .hooks
        .fail(pillar_agent::hooks::HookPoint::MarkWrite);
    for name in ["snap-retry", "snap-drop"] {
        let s = env
            .client
            .create_snapshot(snapshot(name, "src"))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::Internal, "{}", s.message());
        let record = env.store.get_snapshot(name).await.unwrap().unwrap();
        assert!(!record.status_or_default().ready_to_use);
        assert!(
            !env.agent
                .pool
                .join(format!(".snapshots/{name}.img"))
                .exists()
        );
        // Not restorable while not cut.
        let s = env
            .client
            .create_volume(restore(&format!("from-{name}"), name, 16 << 20))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::Aborted, "{}", s.message());
    }
    env.agent
        .hooks
        .clear(pillar_agent::hooks::HookPoint::MarkWrite);
    let done = env
        .client
        .create_snapshot(snapshot("snap-retry", "src"))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert!(done.ready_to_use);
    assert!(env.agent.pool.join(".snapshots/snap-retry.img").exists());
    env.client
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: "snap-drop".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(env.store.get_snapshot("snap-drop").await.unwrap().is_none());
}

// proves C1 for snapshots: without its PillarAgent a snapshot is not deleted and keeps its
// record
#[tokio::test]
async fn a_snapshot_without_its_agent_keeps_its_record() {
    let mut env = Env::start(StoreKind::Embedded, true).await;
    env.client
        .create_volume(create("src", Mode::SingleNodeWriter))
        .await
        .unwrap();
    env.client
        .create_snapshot(snapshot("snap-a", "src"))
        .await
        .unwrap();
    let agent = env.store.list_agents().await.unwrap().remove(0);
    let name = agent.metadata.name.clone().unwrap();
    env.store
        .delete_agent(&name, &Revision::of(&agent).unwrap())
        .await
        .unwrap();
    let s = env
        .client
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: "snap-a".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition, "{}", s.message());
    assert!(env.store.get_snapshot("snap-a").await.unwrap().is_some());
    assert!(env.agent.pool.join(".snapshots/snap-a.img").exists());
}

// Issue 21 item 7: a CreateSnapshot the agent refuses (here: its record names a source
// lifecycle that was deleted and re-created after a first attempt failed) removes the not-ready
// record it wrote, so nothing outlives the source; ListSnapshots never reports a record whose
// cut did not happen; the name can be snapshotted again. A removal cut short (the agent's
// DeleteSnapshot fails) leaves the record deleting and unlisted, and the next CreateSnapshot of
// the name finishes it and cuts anew. On the old code the refused record stayed, not ready, and
// ListSnapshots reported it.
#[tokio::test]
async fn a_refused_snapshot_leaves_no_record_behind() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        env.client
            .create_volume(create("src", Mode::SingleNodeWriter))
            .await
            .unwrap();
        let listed = |env: &Env| {
            let mut c = env.client.clone();
            async move {
                ids(&c
                    .list_snapshots(csi::ListSnapshotsRequest::default())
                    .await
                    .unwrap()
                    .into_inner())
            }
        };
        env.agent
            .hooks
            .fail(pillar_agent::hooks::HookPoint::MarkWrite);
        for name in ["s-old", "s-stuck"] {
            let s = env
                .client
                .create_snapshot(snapshot(name, "src"))
                .await
                .unwrap_err();
            assert_eq!(s.code(), Code::Internal, "{kind:?}: {}", s.message());
        }
        env.agent
            .hooks
            .clear(pillar_agent::hooks::HookPoint::MarkWrite);
        assert!(env.store.get_snapshot("s-old").await.unwrap().is_some());
        assert!(
            listed(&env).await.is_empty(),
            "{kind:?}: a record whose cut failed is listed"
        );
        // The source goes and comes back as a new lifecycle; the retry names the old one.
        env.client
            .delete_volume(support::delete("src"))
            .await
            .unwrap();
        env.client
            .create_volume(create("src", Mode::SingleNodeWriter))
            .await
            .unwrap();
        let s = env
            .client
            .create_snapshot(snapshot("s-old", "src"))
            .await
            .unwrap_err();
        assert_eq!(
            s.code(),
            Code::FailedPrecondition,
            "{kind:?}: {}",
            s.message()
        );
        assert!(
            env.store.get_snapshot("s-old").await.unwrap().is_none(),
            "{kind:?}: the refused record outlives its source"
        );
        assert!(listed(&env).await.is_empty(), "{kind:?}");
        let again = env
            .client
            .create_snapshot(snapshot("s-old", "src"))
            .await
            .unwrap()
            .into_inner()
            .snapshot
            .unwrap();
        assert!(again.ready_to_use, "{kind:?}");
        assert_eq!(listed(&env).await, ["s-old"], "{kind:?}");

        // Refused again, and the agent cannot end the snapshot's mark this time.
        env.agent
            .hooks
            .fail(pillar_agent::hooks::HookPoint::MarkWrite);
        let s = env
            .client
            .create_snapshot(snapshot("s-stuck", "src"))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::FailedPrecondition, "{kind:?}: {s:?}");
        env.agent
            .hooks
            .clear(pillar_agent::hooks::HookPoint::MarkWrite);
        let stuck = env.store.get_snapshot("s-stuck").await.unwrap().unwrap();
        assert!(stuck.status_or_default().deleting, "{kind:?}");
        assert_eq!(listed(&env).await, ["s-old"], "{kind:?}");
        let cut = env
            .client
            .create_snapshot(snapshot("s-stuck", "src"))
            .await
            .unwrap()
            .into_inner()
            .snapshot
            .unwrap();
        assert!(cut.ready_to_use, "{kind:?}");
        let now = env.store.get_snapshot("s-stuck").await.unwrap().unwrap();
        assert_ne!(
            now.metadata.uid, stuck.metadata.uid,
            "{kind:?}: recorded anew"
        );
        assert_eq!(listed(&env).await, ["s-old", "s-stuck"], "{kind:?}");
    }
}

// Issue 22 (also noticed): a refused DeleteSnapshot (here: its PillarAgent is gone, C1) is a
// Refused event about the snapshot's source volume naming the snapshot, never about a volume
// that happens to share the snapshot's ID. On the old code the event looked up a *volume*
// named after the snapshot ID and was recorded on the unrelated volume "twin".
#[tokio::test]
async fn a_refused_snapshot_call_is_an_event_on_its_source_volume() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        for v in ["src", "twin"] {
            env.client
                .create_volume(create(v, Mode::SingleNodeWriter))
                .await
                .unwrap();
        }
        env.client
            .create_snapshot(snapshot("twin", "src"))
            .await
            .unwrap();
        let agent = env.store.list_agents().await.unwrap().remove(0);
        let name = agent.metadata.name.clone().unwrap();
        env.store
            .delete_agent(&name, &Revision::of(&agent).unwrap())
            .await
            .unwrap();
        let s = env
            .client
            .delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: "twin".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::FailedPrecondition, "{kind:?}: {s:?}");
        assert!(
            env.events("twin").is_empty(),
            "{kind:?}: an event on the unrelated volume: {:?}",
            env.events("twin")
        );
        assert_eq!(
            env.events("src"),
            [("Warning".to_owned(), "Refused".to_owned())],
            "{kind:?}"
        );
    }
}
