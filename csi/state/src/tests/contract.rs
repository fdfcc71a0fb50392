//! The store contract, written once and run over the core's own store (`MemoryStore`), the
//! EmbeddedStore, the KubeStore over the API server double (itself on the core), and the generic
//! fault-injecting wrapper, disarmed.

use crate::StateStore;
use crate::crd::{AccessMode, PillarVolumeStateStatus, PublishedNode};
use crate::store::{Revision, StoreError};
use crate::test_support::{agent_spec, protocol_spec, volume_spec};

fn rv_num(rv: &Revision) -> u64 {
    rv.resource_version
        .parse()
        .expect("numeric resourceVersion")
}

fn published(node: &str) -> PillarVolumeStateStatus {
    PillarVolumeStateStatus {
        published_nodes: vec![PublishedNode {
            node: node.to_owned(),
            host_nqn: format!("nqn.2014-08.org.nvmexpress:uuid:{node}"),
            access_mode: AccessMode::SingleNodeWriter,
            readonly: false,
            revoking: false,
            recorded_generation: 0,
        }],
        publication_generation: 1,
        deleting: false,
        conditions: vec![],
    }
}

async fn create_then_get(store: &dyn StateStore) {
    let created = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let rev = Revision::of(&created).unwrap();
    assert!(!rev.uid.is_empty());
    assert!(rv_num(&rev) > 0);
    assert_eq!(created.metadata.generation, Some(1));
    assert!(created.metadata.creation_timestamp.is_some());
    assert_eq!(created.status, None, "create never writes a status");
    assert_eq!(created.spec, volume_spec("vol-a"));
    let got = store.get_volume("vol-a").await.unwrap().unwrap();
    assert_eq!(got, created);
    assert_eq!(store.get_volume("vol-b").await.unwrap(), None);

    let agent = store
        .create_agent("storage-1", agent_spec("node-1"))
        .await
        .unwrap();
    assert_eq!(store.get_agent("storage-1").await.unwrap().unwrap(), agent);
    let proto = store
        .create_protocol("nvme-tcp", protocol_spec())
        .await
        .unwrap();
    assert_eq!(
        store.get_protocol("nvme-tcp").await.unwrap().unwrap(),
        proto
    );
    assert_eq!(proto.spec.nvme_tcp.port, 4420);
    assert!(proto.spec.nvme_tcp.acl);
}

async fn create_twice_is_already_exists(store: &dyn StateStore) {
    let first = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let mut other = volume_spec("other");
    other.size_bytes = 7;
    let err = store.create_volume("vol-a", other).await.unwrap_err();
    assert!(
        matches!(err, StoreError::AlreadyExists { .. }),
        "got {err:?}"
    );
    assert_eq!(store.get_volume("vol-a").await.unwrap().unwrap(), first);
    let err = store
        .create_agent("a", agent_spec("n"))
        .await
        .and(store.create_agent("a", agent_spec("n")).await)
        .unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err:?}");
}

// proves W1: the publication record is written by compare-and-swap on resourceVersion
async fn status_cas_bumps_resource_version(store: &dyn StateStore) {
    let created = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let rev0 = Revision::of(&created).unwrap();
    let written = store
        .replace_volume_status("vol-a", &rev0, published("node-1"))
        .await
        .unwrap();
    let rev1 = Revision::of(&written).unwrap();
    assert_eq!(rev1.uid, rev0.uid);
    assert!(rv_num(&rev1) > rv_num(&rev0));
    assert_eq!(written.status, Some(published("node-1")));
    assert_eq!(written.spec, created.spec, "a status write keeps the spec");
    assert_eq!(
        written.metadata.generation,
        Some(1),
        "status writes keep generation"
    );
    assert_eq!(store.get_volume("vol-a").await.unwrap().unwrap(), written);
}

// proves W1: a stale resourceVersion is refused and changes nothing (never overwrite)
async fn stale_resource_version_is_conflict(store: &dyn StateStore) {
    let created = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let stale = Revision::of(&created).unwrap();
    let first = store
        .replace_volume_status("vol-a", &stale, published("node-1"))
        .await
        .unwrap();
    let err = store
        .replace_volume_status("vol-a", &stale, published("node-2"))
        .await
        .unwrap_err();
    assert!(err.is_conflict(), "got {err:?}");
    assert!(!err.is_lifecycle_gone());
    assert_eq!(store.get_volume("vol-a").await.unwrap().unwrap(), first);

    // The same for spec writes and deletes.
    let err = store
        .replace_volume_spec("vol-a", &stale, volume_spec("changed"))
        .await
        .unwrap_err();
    assert!(err.is_conflict(), "got {err:?}");
    let err = store.delete_volume("vol-a", &stale).await.unwrap_err();
    assert!(err.is_conflict(), "got {err:?}");
    assert_eq!(store.get_volume("vol-a").await.unwrap().unwrap(), first);
}

// proves F3: every compare-and-swap is pinned to the UID the operation started with
async fn cas_is_pinned_to_uid(store: &dyn StateStore) {
    let old = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let old_rev = Revision::of(&old).unwrap();
    store.delete_volume("vol-a", &old_rev).await.unwrap();

    // Deleted and not re-created: the old lifecycle is simply gone.
    let err = store
        .replace_volume_status("vol-a", &old_rev, published("node-1"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "got {err:?}");

    let new = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let new_rev = Revision::of(&new).unwrap();
    assert_ne!(
        new_rev.uid, old_rev.uid,
        "a re-created name is a new lifecycle"
    );

    // The old operation's revision, unchanged.
    let err = store
        .replace_volume_status("vol-a", &old_rev, published("node-1"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::UidMismatch { .. }), "got {err:?}");
    assert!(err.is_lifecycle_gone());
    // Even with the new object's current resourceVersion, the old UID is refused: the UID is a
    // precondition of its own, not implied by the resourceVersion.
    let forged = Revision {
        uid: old_rev.uid.clone(),
        resource_version: new_rev.resource_version.clone(),
    };
    for err in [
        store
            .replace_volume_status("vol-a", &forged, published("node-1"))
            .await
            .unwrap_err(),
        store
            .replace_volume_spec("vol-a", &forged, volume_spec("x"))
            .await
            .unwrap_err(),
        store.delete_volume("vol-a", &forged).await.unwrap_err(),
    ] {
        assert!(matches!(err, StoreError::UidMismatch { .. }), "got {err:?}");
    }
    assert_eq!(store.get_volume("vol-a").await.unwrap().unwrap(), new);
}

async fn delete_needs_matching_preconditions(store: &dyn StateStore) {
    let v = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let rev = Revision::of(&v).unwrap();
    let wrong_uid = Revision {
        uid: "00000000-0000-4000-8000-000000000000".into(),
        ..rev.clone()
    };
    let err = store.delete_volume("vol-a", &wrong_uid).await.unwrap_err();
    assert!(matches!(err, StoreError::UidMismatch { .. }), "got {err:?}");
    let wrong_rv = Revision {
        resource_version: (rv_num(&rev) + 1000).to_string(),
        ..rev.clone()
    };
    let err = store.delete_volume("vol-a", &wrong_rv).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict { .. }), "got {err:?}");
    assert_eq!(store.get_volume("vol-a").await.unwrap().unwrap(), v);

    store.delete_volume("vol-a", &rev).await.unwrap();
    assert_eq!(store.get_volume("vol-a").await.unwrap(), None);
    let err = store.delete_volume("vol-a", &rev).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "got {err:?}");
}

async fn list_is_sorted_and_complete(store: &dyn StateStore) {
    assert!(store.list_volumes().await.unwrap().is_empty());
    for name in ["vol-c", "vol-a", "vol-b"] {
        store.create_volume(name, volume_spec(name)).await.unwrap();
    }
    let names = |vols: Vec<crate::crd::PillarVolumeState>| {
        vols.into_iter()
            .map(|v| v.metadata.name.unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        names(store.list_volumes().await.unwrap()),
        ["vol-a", "vol-b", "vol-c"]
    );
    let b = store.get_volume("vol-b").await.unwrap().unwrap();
    store
        .delete_volume("vol-b", &Revision::of(&b).unwrap())
        .await
        .unwrap();
    assert_eq!(
        names(store.list_volumes().await.unwrap()),
        ["vol-a", "vol-c"]
    );

    store
        .create_agent("agent-2", agent_spec("n2"))
        .await
        .unwrap();
    store
        .create_agent("agent-1", agent_spec("n1"))
        .await
        .unwrap();
    let agents = store.list_agents().await.unwrap();
    assert_eq!(agents.len(), 2);
    assert_eq!(agents[0].spec.node, "n1");
    store.create_protocol("p", protocol_spec()).await.unwrap();
    assert_eq!(store.list_protocols().await.unwrap().len(), 1);
}

async fn no_op_write_keeps_resource_version(store: &dyn StateStore) {
    let v = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let w1 = store
        .replace_volume_status("vol-a", &Revision::of(&v).unwrap(), published("n"))
        .await
        .unwrap();
    let w2 = store
        .replace_volume_status("vol-a", &Revision::of(&w1).unwrap(), published("n"))
        .await
        .unwrap();
    assert_eq!(w2, w1, "an unchanged status keeps the resourceVersion");
    let w3 = store
        .replace_volume_spec("vol-a", &Revision::of(&w2).unwrap(), volume_spec("vol-a"))
        .await
        .unwrap();
    assert_eq!(
        w3, w1,
        "an unchanged spec keeps resourceVersion and generation"
    );
}

async fn spec_write_bumps_generation_and_keeps_status(store: &dyn StateStore) {
    let v = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let with_status = store
        .replace_volume_status("vol-a", &Revision::of(&v).unwrap(), published("n"))
        .await
        .unwrap();
    let mut bigger = volume_spec("vol-a");
    bigger.size_bytes *= 2;
    let expanded = store
        .replace_volume_spec(
            "vol-a",
            &Revision::of(&with_status).unwrap(),
            bigger.clone(),
        )
        .await
        .unwrap();
    assert_eq!(expanded.spec, bigger);
    assert_eq!(
        expanded.status,
        Some(published("n")),
        "a spec write keeps the status"
    );
    assert_eq!(expanded.metadata.generation, Some(2));
    assert_eq!(expanded.metadata.uid, v.metadata.uid);
    assert!(
        rv_num(&Revision::of(&expanded).unwrap()) > rv_num(&Revision::of(&with_status).unwrap())
    );
    assert_eq!(store.get_volume("vol-a").await.unwrap().unwrap(), expanded);
}

async fn agents_and_protocols_are_compare_and_swap(store: &dyn StateStore) {
    let a = store
        .create_agent("agent-1", agent_spec("n1"))
        .await
        .unwrap();
    let rev = Revision::of(&a).unwrap();
    let mut moved = agent_spec("n1");
    moved.address = "10.0.0.9:9500".into();
    let a2 = store
        .replace_agent_spec("agent-1", &rev, moved.clone())
        .await
        .unwrap();
    assert_eq!(a2.spec, moved);
    let err = store
        .replace_agent_spec("agent-1", &rev, agent_spec("n1"))
        .await
        .unwrap_err();
    assert!(err.is_conflict(), "{err:?}");
    let err = store.delete_agent("agent-1", &rev).await.unwrap_err();
    assert!(err.is_conflict(), "{err:?}");
    store
        .delete_agent("agent-1", &Revision::of(&a2).unwrap())
        .await
        .unwrap();
    assert_eq!(store.get_agent("agent-1").await.unwrap(), None);

    let p = store.create_protocol("p", protocol_spec()).await.unwrap();
    let mut xfs = protocol_spec();
    xfs.nvme_tcp.fs_type = crate::crd::FsType::Xfs;
    let p2 = store
        .replace_protocol_spec("p", &Revision::of(&p).unwrap(), xfs.clone())
        .await
        .unwrap();
    assert_eq!(p2.spec, xfs);
    let err = store
        .delete_protocol("p", &Revision::of(&p).unwrap())
        .await
        .unwrap_err();
    assert!(err.is_conflict(), "{err:?}");
    store
        .delete_protocol("p", &Revision::of(&p2).unwrap())
        .await
        .unwrap();
    assert_eq!(store.get_protocol("p").await.unwrap(), None);
}

// proves F3 for snapshot records: status written by compare-and-swap pinned to the snapshot's
// own lifecycle; a re-created snapshot of the same name is another lifecycle
async fn snapshots_are_compare_and_swap_records_with_their_own_lifecycle(store: &dyn StateStore) {
    let spec = crate::crd::PillarSnapshotStateSpec {
        snapshot_id: "snap-a".into(),
        source_volume_id: "vol-a".into(),
        source_uid: "uid-of-vol-a".into(),
        agent: "agent-1".into(),
        pool: "pool-1".into(),
    };
    let s = store.create_snapshot("snap-a", spec.clone()).await.unwrap();
    assert_eq!(s.status, None);
    let err = store
        .create_snapshot("snap-a", spec.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err:?}");
    let rev = Revision::of(&s).unwrap();
    let ready = crate::crd::PillarSnapshotStateStatus {
        generation: 1,
        ready_to_use: true,
        size_bytes: 1 << 20,
        creation_unix_seconds: Some(1_700_000_000),
        creation_nanos: 5,
        deleting: false,
    };
    let s2 = store
        .replace_snapshot_status("snap-a", &rev, ready.clone())
        .await
        .unwrap();
    assert_eq!(s2.status.as_ref(), Some(&ready));
    assert_eq!(s2.spec, spec);
    let err = store
        .replace_snapshot_status("snap-a", &rev, ready.clone())
        .await
        .unwrap_err();
    assert!(err.is_conflict(), "{err:?}");
    assert_eq!(store.list_snapshots().await.unwrap(), vec![s2.clone()]);
    store
        .delete_snapshot("snap-a", &Revision::of(&s2).unwrap())
        .await
        .unwrap();
    assert_eq!(store.get_snapshot("snap-a").await.unwrap(), None);
    // A new lifecycle of the name: the old revision's UID no longer matches.
    let again = store.create_snapshot("snap-a", spec).await.unwrap();
    assert_ne!(again.metadata.uid, s.metadata.uid);
    let err = store
        .replace_snapshot_status("snap-a", &Revision::of(&s2).unwrap(), ready)
        .await
        .unwrap_err();
    assert!(err.is_lifecycle_gone() || err.is_conflict(), "{err:?}");
    // Snapshots and volumes are different records: the same name in each.
    store
        .create_volume("snap-a", volume_spec("snap-a"))
        .await
        .unwrap();
}

async fn invalid_names_are_refused(store: &dyn StateStore) {
    for name in ["", "Vol", "../etc", "a/b", ".hidden"] {
        let err = store
            .create_volume(name, volume_spec("x"))
            .await
            .unwrap_err();
        assert!(
            matches!(err, StoreError::InvalidName { .. }),
            "{name}: {err:?}"
        );
        let err = store.get_volume(name).await.unwrap_err();
        assert!(
            matches!(err, StoreError::InvalidName { .. }),
            "{name}: {err:?}"
        );
    }
}

// proves F2: publicationGeneration increments by compare-and-swap, one per operation, with the
// UID forming the rest of the token
async fn generation_increments_are_sequential(store: &dyn StateStore) {
    let mut v = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let uid = v.metadata.uid.clone();
    for expected in 1..=5u64 {
        let mut status = v.status_or_default();
        status.publication_generation += 1;
        v = store
            .replace_volume_status("vol-a", &Revision::of(&v).unwrap(), status)
            .await
            .unwrap();
        assert_eq!(v.status_or_default().publication_generation, expected);
        assert_eq!(v.metadata.uid, uid);
    }
}

// proves W1: one resourceVersion counter for every kind, and a delete takes a value of it too
// (as etcd's revision): a version is never handed out twice.
async fn one_counter_for_every_kind(store: &dyn StateStore) {
    let v = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let a = store
        .create_agent("agent-1", agent_spec("n1"))
        .await
        .unwrap();
    let p = store.create_protocol("p", protocol_spec()).await.unwrap();
    let (rv_v, rv_a, rv_p) = (
        rv_num(&Revision::of(&v).unwrap()),
        rv_num(&Revision::of(&a).unwrap()),
        rv_num(&Revision::of(&p).unwrap()),
    );
    assert!(rv_v < rv_a && rv_a < rv_p, "{rv_v} {rv_a} {rv_p}");
    store
        .delete_volume("vol-a", &Revision::of(&v).unwrap())
        .await
        .unwrap();
    let again = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let rv_again = rv_num(&Revision::of(&again).unwrap());
    assert!(
        rv_again > rv_p + 1,
        "the delete took {}: {rv_again}",
        rv_p + 1
    );
}

// proves W1 (and W2's single writer): two writers holding the same revision write at once;
// exactly one wins and the other gets Conflict, whatever the adapter
async fn concurrent_writers_one_wins(store: &dyn StateStore) {
    let v = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let rev = Revision::of(&v).unwrap();
    let (a, b) = tokio::join!(
        store.replace_volume_status("vol-a", &rev, published("node-1")),
        store.replace_volume_status("vol-a", &rev, published("node-2")),
    );
    let (winner, loser) = match (a, b) {
        (Ok(w), Err(e)) | (Err(e), Ok(w)) => (w, e),
        other => panic!("exactly one writer must win: {other:?}"),
    };
    assert!(loser.is_conflict(), "got {loser:?}");
    assert_eq!(store.get_volume("vol-a").await.unwrap().unwrap(), winner);
    // The same for a spec write against a status write.
    let rev = Revision::of(&winner).unwrap();
    let mut bigger = volume_spec("vol-a");
    bigger.size_bytes *= 2;
    let (a, b) = tokio::join!(
        store.replace_volume_spec("vol-a", &rev, bigger),
        store.replace_volume_status("vol-a", &rev, published("node-3")),
    );
    assert!(
        a.is_ok() != b.is_ok(),
        "exactly one writer must win: {a:?} {b:?}"
    );
    let err = a.err().or(b.err()).unwrap();
    assert!(err.is_conflict(), "got {err:?}");
}

// proves W1: a status write never changes the spec, and a spec write never the status, for
// every kind with a status
async fn halves_are_written_apart(store: &dyn StateStore) {
    let a = store
        .create_agent("agent-1", agent_spec("n1"))
        .await
        .unwrap();
    let status = crate::crd::PillarAgentStatus {
        state: "Serving".into(),
        message: String::new(),
        last_transition_time: None,
        last_resync_time: None,
        exports_restored: 1,
        exports_failed: 0,
    };
    let with_status = store
        .replace_agent_status("agent-1", &Revision::of(&a).unwrap(), status.clone())
        .await
        .unwrap();
    assert_eq!(with_status.spec, a.spec, "a status write keeps the spec");
    assert_eq!(with_status.metadata.generation, Some(1));
    let moved = store
        .replace_agent_spec(
            "agent-1",
            &Revision::of(&with_status).unwrap(),
            agent_spec("n2"),
        )
        .await
        .unwrap();
    assert_eq!(moved.status, Some(status), "a spec write keeps the status");
    assert_eq!(moved.spec, agent_spec("n2"));
    assert_eq!(moved.metadata.generation, Some(2));
    assert_eq!(store.get_agent("agent-1").await.unwrap().unwrap(), moved);
}

macro_rules! contract {
    ($($case:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test]
                async fn $case() {
                    let h = crate::test_support::embedded().await;
                    super::$case(&*h.store).await;
                }
            )*
        }
        mod kube_over_double {
            $(
                #[tokio::test]
                async fn $case() {
                    let h = crate::test_support::kube().await;
                    super::$case(&*h.store).await;
                }
            )*
        }
        mod memory {
            $(
                #[tokio::test]
                async fn $case() {
                    let h = crate::test_support::memory();
                    super::$case(&*h.store).await;
                }
            )*
        }
        mod faulty_memory {
            $(
                #[tokio::test]
                async fn $case() {
                    let h = crate::test_support::faulty_memory();
                    super::$case(&*h.store).await;
                }
            )*
        }
    };
}

contract!(
    create_then_get,
    create_twice_is_already_exists,
    status_cas_bumps_resource_version,
    stale_resource_version_is_conflict,
    cas_is_pinned_to_uid,
    delete_needs_matching_preconditions,
    list_is_sorted_and_complete,
    no_op_write_keeps_resource_version,
    spec_write_bumps_generation_and_keeps_status,
    agents_and_protocols_are_compare_and_swap,
    snapshots_are_compare_and_swap_records_with_their_own_lifecycle,
    invalid_names_are_refused,
    generation_increments_are_sequential,
    one_counter_for_every_kind,
    concurrent_writers_one_wins,
    halves_are_written_apart,
);
