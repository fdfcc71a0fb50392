//! Two controller replicas over one store, one of them stalled between its read of a record
//! and its write (W8): every decision is re-checked inside the compare-and-swap that records
//! it, against the identity of the publication it acted on, so the stalled replica never undoes
//! the other's newer work, and no rule depends on leader election.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pillar_csi::csi;
use pillar_state::faults::{FaultyStore, VolumeWrite};
use support::{AGENT, Env, Mode, StoreKind, cap, create, delete, host, nqn, publish, unpublish};
use tonic::Code;

const STORES: [StoreKind; 2] = [StoreKind::Embedded, StoreKind::Kube];

fn publish_as(volume: &str, node: &str, host_n: u32) -> csi::ControllerPublishVolumeRequest {
    csi::ControllerPublishVolumeRequest {
        volume_id: volume.into(),
        node_id: format!("{node}/{}", host(host_n)),
        volume_capability: Some(cap(Mode::SingleNodeWriter)),
        readonly: false,
        ..Default::default()
    }
}

fn unpublish_as(volume: &str, node: &str, host_n: u32) -> csi::ControllerUnpublishVolumeRequest {
    csi::ControllerUnpublishVolumeRequest {
        volume_id: volume.into(),
        node_id: format!("{node}/{}", host(host_n)),
        ..Default::default()
    }
}

async fn records(env: &Env, volume: &str) -> Vec<(String, String, bool)> {
    env.store
        .get_volume(volume)
        .await
        .unwrap()
        .unwrap()
        .status_or_default()
        .published_nodes
        .into_iter()
        .map(|p| (p.node, p.host_nqn, p.revoking))
        .collect()
}

fn acl(env: &Env, volume: &str) -> Vec<String> {
    env.agent.state().subsystems[&nqn(volume)]
        .allowed_hosts
        .iter()
        .cloned()
        .collect()
}

/// The race really happened: the stalled replica's compare-and-swap met the other replica's
/// newer record and the store answered a conflict (counted by the store double, not injected).
/// Without it, a test could pass because the stalled write never raced at all.
fn assert_conflicted(stale_store: &FaultyStore, kind: StoreKind) {
    assert!(
        stale_store.conflicts(VolumeWrite::Status) >= 1,
        "{kind:?}: the stalled write met no conflict: the race was not exercised"
    );
    assert_eq!(
        stale_store.injected(VolumeWrite::Status),
        0,
        "{kind:?}: every conflict came from the store itself"
    );
}

// proves W8, W1, W4 (defect 2a): a replica stalled in an unpublish of node-1 resumes after the
// other replica unpublished node-1 and published it again with another host. The stalled
// unpublish finds the publication it read gone and answers OK without touching the new one,
// so the volume is still held by node-1 and a second node is refused. On the old code the
// stale unpublish removed node-1's new record by node name, and node-2 got the RWO volume
// while host 9 stayed admitted: two writers.
#[tokio::test]
async fn a_stalled_unpublish_never_removes_a_newer_publication_of_the_node() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        env.client
            .create_volume(create("w8a", Mode::SingleNodeWriter))
            .await
            .unwrap();
        env.client
            .controller_publish_volume(publish_as("w8a", "node-1", 1))
            .await
            .unwrap();
        let (stale, stale_store) = env.replica();
        let pause = stale_store.pause_next(VolumeWrite::Status);
        let stalled =
            tokio::spawn(async move { stale.unpublish(unpublish_as("w8a", "node-1", 1)).await });
        pause.reached().await;
        // Meanwhile the other replica serves Kubernetes' retry and the next attach.
        env.client
            .controller_unpublish_volume(unpublish_as("w8a", "node-1", 1))
            .await
            .unwrap();
        env.client
            .controller_publish_volume(publish_as("w8a", "node-1", 9))
            .await
            .unwrap();
        pause.release();
        stalled
            .await
            .unwrap()
            .expect("the publication it read is gone: OK");
        assert!(
            stale_store.calls(VolumeWrite::Status) >= 1,
            "the stalled write reached the store"
        );
        assert_conflicted(&stale_store, kind);
        assert_eq!(
            records(&env, "w8a").await,
            vec![("node-1".into(), host(9), false)],
            "{kind:?}"
        );
        assert_eq!(acl(&env, "w8a"), vec![host(9)]);
        let refused = env
            .client
            .controller_publish_volume(publish("w8a", 2, Mode::SingleNodeWriter, false))
            .await
            .unwrap_err();
        assert_eq!(
            refused.code(),
            Code::FailedPrecondition,
            "{kind:?}: {refused:?}"
        );
        assert_eq!(acl(&env, "w8a"), vec![host(9)], "{kind:?}: one writer");
    }
}

// proves W8 (defect 2b): the same with the same host NQN: the stalled unpublish must not
// revoke the live re-publication, which Kubernetes believes attached.
#[tokio::test]
async fn a_stalled_unpublish_never_revokes_a_live_republication() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        env.client
            .create_volume(create("w8b", Mode::SingleNodeWriter))
            .await
            .unwrap();
        env.client
            .controller_publish_volume(publish("w8b", 1, Mode::SingleNodeWriter, false))
            .await
            .unwrap();
        let (stale, stale_store) = env.replica();
        let pause = stale_store.pause_next(VolumeWrite::Status);
        let stalled = tokio::spawn(async move { stale.unpublish(unpublish("w8b", 1)).await });
        pause.reached().await;
        env.client
            .controller_unpublish_volume(unpublish("w8b", 1))
            .await
            .unwrap();
        env.client
            .controller_publish_volume(publish("w8b", 1, Mode::SingleNodeWriter, false))
            .await
            .unwrap();
        pause.release();
        stalled.await.unwrap().unwrap();
        assert_conflicted(&stale_store, kind);
        assert_eq!(
            records(&env, "w8b").await,
            vec![("node-1".into(), host(1), false)],
            "{kind:?}: the re-publication stands"
        );
        assert_eq!(acl(&env, "w8b"), vec![host(1)], "{kind:?}: still admitted");
    }
}

// proves W5, W8 (defect 2c): a replica stalled in a DeleteVolume after it saw no publication
// resumes after the other replica published the volume: "no publication" is decided in the
// compare-and-swap that marks the volume deleting, so the delete is refused and the published
// volume keeps its backend and export. On the old code the delete answered OK and the backend
// of a published volume was gone.
#[tokio::test]
async fn a_stalled_delete_never_deletes_a_volume_published_meanwhile() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        env.client
            .create_volume(create("w8c", Mode::SingleNodeWriter))
            .await
            .unwrap();
        let (stale, stale_store) = env.replica();
        let pause = stale_store.pause_next(VolumeWrite::Status);
        let stalled = tokio::spawn(async move { stale.delete_volume(delete("w8c")).await });
        pause.reached().await;
        env.client
            .controller_publish_volume(publish("w8c", 1, Mode::SingleNodeWriter, false))
            .await
            .unwrap();
        pause.release();
        let err = stalled.await.unwrap().unwrap_err();
        assert_conflicted(&stale_store, kind);
        assert_eq!(
            pillar_csi::controller::code_of(&err),
            Code::FailedPrecondition,
            "{kind:?}: {err}"
        );
        assert!(env.store.get_volume("w8c").await.unwrap().is_some());
        assert!(env.agent.state().subsystems.contains_key(&nqn("w8c")));
        assert_eq!(acl(&env, "w8c"), vec![host(1)]);
        // A delete that wins the race keeps later publishes out.
        env.client
            .controller_unpublish_volume(unpublish("w8c", 1))
            .await
            .unwrap();
        env.client.delete_volume(delete("w8c")).await.unwrap();
        let gone = env
            .client
            .controller_publish_volume(publish("w8c", 1, Mode::SingleNodeWriter, false))
            .await
            .unwrap_err();
        assert_eq!(gone.code(), Code::NotFound);
    }
}

// proves W8, W4 (found by the deterministic simulation): a publish whose grant meets a
// restarted agent resyncs it and sends the grant again with a fresh token. While that replica
// is stalled in the resync, the other one unpublishes the node (its revoke confirmed, its record
// removed). The retried grant must not re-admit the host: its token is newer than the revoke's,
// so the agent would take it. The retry's token is taken only while the publication is still
// recorded and not being revoked, in one compare-and-swap; on the old code the grant landed and
// host 1 stayed admitted with no record, free to write next to the volume's next owner.
#[tokio::test]
async fn a_grant_retried_after_a_resync_never_readmits_a_revoked_host() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        env.client
            .create_volume(create("w8r", Mode::SingleNodeWriter))
            .await
            .unwrap();
        env.agent.stop().await;
        env.agent.restart().await;
        let (stale, stale_store) = env.replica();
        let recorded = stale_store.pause_next(VolumeWrite::Status);
        let stalled =
            tokio::spawn(async move { stale.publish(publish_as("w8r", "node-1", 1)).await });
        recorded.reached().await;
        // The next write of the stale replica is the token its resync takes for the volume.
        let resyncing = stale_store.pause_next(VolumeWrite::Status);
        recorded.release();
        resyncing.reached().await;
        assert_eq!(
            records(&env, "w8r").await,
            vec![("node-1".into(), host(1), false)],
            "{kind:?}: the publication was recorded before the grant"
        );
        // Kubernetes gave up on the attach; the other replica detaches.
        env.client
            .controller_unpublish_volume(unpublish_as("w8r", "node-1", 1))
            .await
            .unwrap();
        assert!(records(&env, "w8r").await.is_empty(), "{kind:?}");
        resyncing.release();
        let refused = stalled
            .await
            .unwrap()
            .expect_err("the publication was withdrawn during the resync");
        assert_eq!(
            pillar_csi::controller::code_of(&refused),
            Code::Aborted,
            "{kind:?}: {refused}"
        );
        assert!(
            acl(&env, "w8r").is_empty(),
            "{kind:?}: a revoked host was admitted again with no record: {:?}",
            acl(&env, "w8r")
        );
        assert!(records(&env, "w8r").await.is_empty(), "{kind:?}");
    }
}

// proves W5, W8 (issue 22, defect 12): a resync that listed a volume before another replica
// marked it deleting takes no token for it and does not export it again: the token is taken
// only while the volume is not being deleted, in the same compare-and-swap. The deleting
// replica is held after its Unexport, before the token of its agent DeleteVolume, where the
// resync's export would land. On the old code the resync took a token regardless, exported the
// volume again, and the DeleteVolume failed "still exported" with a Refused event.
#[tokio::test]
async fn a_resync_never_exports_a_volume_another_replica_is_deleting() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        env.client
            .create_volume(create("w8d", Mode::SingleNodeWriter))
            .await
            .unwrap();
        let agent = env.store.get_agent(AGENT).await.unwrap().unwrap();
        let (resyncer, resyncer_store) = env.replica();
        let resync_token = resyncer_store.pause_next(VolumeWrite::Status);
        let resync = tokio::spawn(async move { resyncer.resync_agent(&agent).await });
        resync_token.reached().await;
        // The other replica marks the volume deleting and unexports it; it is held before the
        // token of its DeleteVolume (its second status write).
        let marking = env.faults.pause_next(VolumeWrite::Status);
        let mut client = env.client.clone();
        let deleting = tokio::spawn(async move { client.delete_volume(delete("w8d")).await });
        marking.reached().await;
        let delete_token = env.faults.pause_next(VolumeWrite::Status);
        marking.release();
        delete_token.reached().await;
        assert!(
            !env.agent.state().subsystems.contains_key(&nqn("w8d")),
            "{kind:?}: unexported by the deleting replica"
        );
        resync_token.release();
        let response = resync.await.unwrap().unwrap();
        assert_conflicted(&resyncer_store, kind);
        assert!(
            response.results.iter().all(|r| r.volume_id != "w8d"),
            "{kind:?}: the resync sent a volume being deleted: {:?}",
            response.results
        );
        assert!(
            !env.agent.state().subsystems.contains_key(&nqn("w8d")),
            "{kind:?}: a resync exported again a volume being deleted"
        );
        delete_token.release();
        deleting
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{kind:?}: DeleteVolume: {e:?}"));
        assert!(env.store.get_volume("w8d").await.unwrap().is_none());
        assert!(
            env.events("w8d").is_empty(),
            "{kind:?}: {:?}",
            env.events("w8d")
        );
    }
}
