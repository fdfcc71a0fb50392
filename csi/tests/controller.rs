//! The CSI controller through its real gRPC service, a real agent (file backend, configfs test
//! double) and both state stores: the publish table, the fail-closed rules and the resync.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pillar_agent_api::v1 as agent_api;
use pillar_csi::csi;
use pillar_state::condition::{ACL_DISABLED, ConditionStatus, REVOKING, find_condition};
use pillar_state::faults::VolumeWrite;
use pillar_state::store::Revision;
use support::{
    AGENT, Env, Mode, StoreKind, create, delete, host, node_id, nqn, publish, unpublish,
};
use tonic::Code;

const STORES: [StoreKind; 2] = [StoreKind::Embedded, StoreKind::Kube];

async fn published_nodes(env: &Env, volume: &str) -> Vec<(String, bool)> {
    let v = env.store.get_volume(volume).await.unwrap().unwrap();
    v.status_or_default()
        .published_nodes
        .into_iter()
        .map(|p| (p.node, p.revoking))
        .collect()
}

/// Moves the agent's fencing mark for `volume` far ahead, so every later controller call with
/// an ordinary generation is refused there: a stand-in for a failing grant or revoke.
async fn fence_ahead(env: &Env, volume: &str) {
    let uid = env
        .store
        .get_volume(volume)
        .await
        .unwrap()
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let ch = support::channel(&env.agent.socket).await;
    let mut agent = agent_api::agent_client::AgentClient::new(ch);
    agent
        .revoke_initiator(agent_api::RevokeInitiatorRequest {
            token: Some(agent_api::FencingToken {
                lifecycle_uid: uid,
                generation: 1_000_000,
            }),
            volume_id: volume.into(),
            host_nqn: host(99),
        })
        .await
        .unwrap();
}

/// What the controller advertises is what it does: a read-only publish is honoured (N5), and
/// SINGLE_NODE_MULTI_WRITER is advertised by the node service too (`node_requests.rs`).
#[tokio::test]
async fn the_controller_advertises_read_only_publish_and_single_node_multi_writer() {
    use csi::controller_service_capability::{Type, rpc};
    let mut env = Env::start(StoreKind::Embedded, true).await;
    let caps: Vec<i32> = env
        .client
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .map(|c| match c.r#type {
            Some(Type::Rpc(r)) => r.r#type,
            None => panic!("capability without a type"),
        })
        .collect();
    for wanted in [rpc::Type::PublishReadonly, rpc::Type::SingleNodeMultiWriter] {
        assert!(caps.contains(&i32::from(wanted)), "{wanted:?} in {caps:?}");
    }
}

// proves W2 (every row of the publish table), W1, W6
#[tokio::test]
async fn the_publish_table() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        let c = &mut env.client;
        c.create_volume(create("rwo-vol", Mode::SingleNodeWriter))
            .await
            .unwrap();
        let ctx = c
            .controller_publish_volume(publish("rwo-vol", 1, Mode::SingleNodeWriter, false))
            .await
            .unwrap()
            .into_inner()
            .publish_context;
        assert_eq!(ctx[pillar_csi::context::NQN], nqn("rwo-vol"));
        assert_eq!(ctx[pillar_csi::context::TRADDR], "127.0.0.1");
        // W1: recorded, and granted on the target (acl: only published hosts).
        assert_eq!(
            published_nodes(&env, "rwo-vol").await,
            vec![("node-1".into(), false)]
        );
        let sub = &env.agent.state().subsystems[&nqn("rwo-vol")];
        assert!(
            !sub.allow_any_host && sub.allowed_hosts.contains(&host(1)),
            "{kind:?}"
        );
        let c = &mut env.client;
        // Idempotent: the same publication again.
        c.controller_publish_volume(publish("rwo-vol", 1, Mode::SingleNodeWriter, false))
            .await
            .unwrap();

        // RWO on node-1 + any mode on node-2: FAILED_PRECONDITION naming node-1's node ID (the
        // spec's SHOULD: the caller can tell which node to unpublish from).
        for mode in [
            Mode::SingleNodeWriter,
            Mode::MultiNodeReaderOnly,
            Mode::SingleNodeSingleWriter,
        ] {
            let s = c
                .controller_publish_volume(publish(
                    "rwo-vol",
                    2,
                    mode,
                    mode == Mode::MultiNodeReaderOnly,
                ))
                .await
                .unwrap_err();
            assert_eq!(
                s.code(),
                Code::FailedPrecondition,
                "{kind:?} {mode:?}: {}",
                s.message()
            );
            assert!(s.message().contains(&node_id(1)), "{}", s.message());
        }
        // Same node, another mode or readonly flag: ALREADY_EXISTS.
        let s = c
            .controller_publish_volume(publish("rwo-vol", 1, Mode::SingleNodeWriter, true))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::AlreadyExists, "{}", s.message());
        let s = c
            .controller_publish_volume(publish("rwo-vol", 1, Mode::SingleNodeSingleWriter, false))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::AlreadyExists, "{}", s.message());
        // Node-2 got nothing on the target.
        assert!(
            !env.agent.state().subsystems[&nqn("rwo-vol")]
                .allowed_hosts
                .contains(&host(2))
        );

        // ROX + ROX on two nodes: allowed.
        let c = &mut env.client;
        c.create_volume(create("rox-vol", Mode::MultiNodeReaderOnly))
            .await
            .unwrap();
        c.controller_publish_volume(publish("rox-vol", 1, Mode::MultiNodeReaderOnly, true))
            .await
            .unwrap();
        c.controller_publish_volume(publish("rox-vol", 2, Mode::MultiNodeReaderOnly, true))
            .await
            .unwrap();
        let hosts = &env.agent.state().subsystems[&nqn("rox-vol")].allowed_hosts;
        assert!(hosts.contains(&host(1)) && hosts.contains(&host(2)));

        // A publication still being revoked + the same node again: ABORTED.
        let v = env.store.get_volume("rwo-vol").await.unwrap().unwrap();
        let mut status = v.status_or_default();
        status.published_nodes[0].revoking = true;
        env.store
            .replace_volume_status("rwo-vol", &Revision::of(&v).unwrap(), status)
            .await
            .unwrap();
        let s = env
            .client
            .controller_publish_volume(publish("rwo-vol", 1, Mode::SingleNodeWriter, false))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::Aborted, "{}", s.message());

        let c = &mut env.client;
        for (v, n) in [("rwo-vol", 1), ("rox-vol", 1), ("rox-vol", 2)] {
            c.controller_unpublish_volume(unpublish(v, n))
                .await
                .unwrap();
        }
        // After the unpublish, node-2 may take the RWO volume.
        c.controller_publish_volume(publish("rwo-vol", 2, Mode::SingleNodeWriter, false))
            .await
            .unwrap();
        let hosts = &env.agent.state().subsystems[&nqn("rwo-vol")].allowed_hosts;
        assert_eq!(
            hosts.iter().collect::<Vec<_>>(),
            vec![&host(2)],
            "{kind:?}: node-1 revoked, node-2 granted"
        );
        let c = &mut env.client;
        c.controller_unpublish_volume(unpublish("rwo-vol", 2))
            .await
            .unwrap();
        c.delete_volume(delete("rwo-vol")).await.unwrap();
        c.delete_volume(delete("rox-vol")).await.unwrap();
    }
}

// proves W3
#[tokio::test]
async fn rwx_is_rejected_at_provisioning() {
    let mut env = Env::start(StoreKind::Embedded, true).await;
    let s = env
        .client
        .create_volume(create("rwx", Mode::MultiNodeMultiWriter))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(
        env.store.get_volume("rwx").await.unwrap().is_none(),
        "nothing recorded"
    );
    assert!(
        env.agent.state().subsystems.is_empty(),
        "nothing on the storage node"
    );
}

// proves W1 (the record precedes the grant) and W4/C2 (a failed grant or revoke keeps the
// record, and the volume stays blocked for other single-writer publishers), and F6 at the
// controller: a publish or unpublish whose token the agent finds stale is answered ABORTED
#[tokio::test]
async fn failed_grants_and_revokes_keep_the_record() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        env.client
            .create_volume(create("vol", Mode::SingleNodeWriter))
            .await
            .unwrap();
        fence_ahead(&env, "vol").await;
        let s = env
            .client
            .controller_publish_volume(publish("vol", 1, Mode::SingleNodeWriter, false))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::Aborted, "{kind:?}: {}", s.message());
        assert_eq!(
            published_nodes(&env, "vol").await,
            vec![("node-1".into(), false)],
            "recorded before the grant"
        );
        let s = env
            .client
            .controller_publish_volume(publish("vol", 2, Mode::SingleNodeWriter, false))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::FailedPrecondition, "node-2 stays blocked");

        let s = env
            .client
            .controller_unpublish_volume(unpublish("vol", 1))
            .await
            .unwrap_err();
        assert_ne!(s.code(), Code::Ok);
        assert_eq!(
            published_nodes(&env, "vol").await,
            vec![("node-1".into(), true)],
            "{kind:?}: kept, marked revoking"
        );
        let s = env
            .client
            .controller_publish_volume(publish("vol", 2, Mode::SingleNodeWriter, false))
            .await
            .unwrap_err();
        assert_eq!(
            s.code(),
            Code::FailedPrecondition,
            "still blocked while the revoke is unconfirmed"
        );
        let s = env.client.delete_volume(delete("vol")).await.unwrap_err();
        assert_eq!(
            s.code(),
            Code::FailedPrecondition,
            "W5: no delete while a publication is recorded"
        );
    }
}

// proves W4 (missing PillarAgent on unpublish), C1 (missing PillarAgent on delete), F10
#[tokio::test]
async fn a_missing_agent_fails_closed() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        env.client
            .create_volume(create("vol", Mode::SingleNodeWriter))
            .await
            .unwrap();
        env.client
            .controller_publish_volume(publish("vol", 1, Mode::SingleNodeWriter, false))
            .await
            .unwrap();
        let agent = env.store.get_agent(AGENT).await.unwrap().unwrap();
        env.store
            .delete_agent(AGENT, &Revision::of(&agent).unwrap())
            .await
            .unwrap();

        let s = env
            .client
            .controller_unpublish_volume(unpublish("vol", 1))
            .await
            .unwrap_err();
        assert_eq!(
            s.code(),
            Code::FailedPrecondition,
            "{kind:?}: {}",
            s.message()
        );
        assert!(s.message().contains(AGENT), "{}", s.message());
        assert_eq!(
            published_nodes(&env, "vol").await,
            vec![("node-1".into(), false)]
        );

        // Force the record away as an operator would, then delete: still refused without the agent.
        let v = env.store.get_volume("vol").await.unwrap().unwrap();
        let mut status = v.status_or_default();
        status.published_nodes.clear();
        env.store
            .replace_volume_status("vol", &Revision::of(&v).unwrap(), status)
            .await
            .unwrap();
        let s = env.client.delete_volume(delete("vol")).await.unwrap_err();
        assert_eq!(s.code(), Code::FailedPrecondition, "{}", s.message());
        assert!(
            env.store.get_volume("vol").await.unwrap().is_some(),
            "the record is kept"
        );

        // F10: a volume with no record owns nothing; deleting it needs no agent.
        env.client
            .delete_volume(delete("never-created"))
            .await
            .unwrap();
        env.client
            .controller_unpublish_volume(unpublish("never-created", 1))
            .await
            .unwrap();
        support::detach_loops_under(&env.agent.pool);
    }
}

// CSI codes for unknown volumes and nodes, and the other controller calls.
#[tokio::test]
async fn codes_for_unknown_volumes_nodes_and_bad_input() {
    let mut env = Env::start(StoreKind::Kube, false).await;
    let c = &mut env.client;
    let s = c
        .controller_publish_volume(publish("nope", 1, Mode::SingleNodeWriter, false))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::NotFound);
    c.create_volume(create("vol", Mode::SingleNodeWriter))
        .await
        .unwrap();
    let mut bad_node = publish("vol", 1, Mode::SingleNodeWriter, false);
    bad_node.node_id = "node-without-nqn".into();
    assert_eq!(
        c.controller_publish_volume(bad_node)
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    let mut no_cap = publish("vol", 1, Mode::SingleNodeWriter, false);
    no_cap.volume_capability = None;
    assert_eq!(
        c.controller_publish_volume(no_cap)
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    let mut no_vol = publish("", 1, Mode::SingleNodeWriter, false);
    no_vol.volume_id.clear();
    assert_eq!(
        c.controller_publish_volume(no_vol)
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );

    let validate = |id: &str| csi::ValidateVolumeCapabilitiesRequest {
        volume_id: id.into(),
        volume_capabilities: vec![support::cap(Mode::SingleNodeWriter)],
        ..Default::default()
    };
    assert_eq!(
        c.validate_volume_capabilities(validate("nope"))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    assert!(
        c.validate_volume_capabilities(validate("vol"))
            .await
            .unwrap()
            .into_inner()
            .confirmed
            .is_some()
    );
    let mut rwx = validate("vol");
    rwx.volume_capabilities = vec![support::cap(Mode::MultiNodeMultiWriter)];
    assert!(
        c.validate_volume_capabilities(rwx)
            .await
            .unwrap()
            .into_inner()
            .confirmed
            .is_none()
    );

    // Re-create: same properties is idempotent; other properties ALREADY_EXISTS.
    c.create_volume(create("vol", Mode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(
        c.create_volume(create("vol", Mode::MultiNodeReaderOnly))
            .await
            .unwrap_err()
            .code(),
        Code::AlreadyExists
    );
    let mut bigger = create("vol", Mode::SingleNodeWriter);
    bigger.capacity_range = Some(csi::CapacityRange {
        required_bytes: 1 << 30,
        limit_bytes: 0,
    });
    assert_eq!(
        c.create_volume(bigger).await.unwrap_err().code(),
        Code::AlreadyExists
    );
    for bad in ["", "bell\u{7}"] {
        assert_eq!(
            c.create_volume(create(bad, Mode::SingleNodeWriter))
                .await
                .unwrap_err()
                .code(),
            Code::InvalidArgument,
            "{bad:?}"
        );
    }
    // Any other CSI name is accepted: one that is not a valid ID gets a derived one, the same
    // on every retry.
    for odd in ["../x", "Sanity-Volume-7510CB3E", &"n".repeat(128)] {
        let a = c
            .create_volume(create(odd, Mode::SingleNodeWriter))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        let b = c
            .create_volume(create(odd, Mode::SingleNodeWriter))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        assert_eq!(a.volume_id, b.volume_id, "{odd:?}");
        c.delete_volume(delete(&a.volume_id)).await.unwrap();
    }

    // GetCapacity with empty parameters works (a public driver got this wrong).
    let cap = c
        .get_capacity(csi::GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(cap.available_capacity > 0);

    // ListVolumes with published nodes; paging; a bad token is ABORTED.
    c.controller_publish_volume(publish("vol", 3, Mode::SingleNodeWriter, false))
        .await
        .unwrap();
    c.create_volume(create("vol2", Mode::SingleNodeWriter))
        .await
        .unwrap();
    let page = c
        .list_volumes(csi::ListVolumesRequest {
            max_entries: 1,
            starting_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page.entries.len(), 1);
    assert_eq!(
        page.entries[0].status.as_ref().unwrap().published_node_ids,
        vec![node_id(3)]
    );
    let rest = c
        .list_volumes(csi::ListVolumesRequest {
            max_entries: 0,
            starting_token: page.next_token,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rest.entries.len(), 1);
    let s = c
        .list_volumes(csi::ListVolumesRequest {
            max_entries: 0,
            starting_token: "zz".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Aborted);

    // ControllerGetVolume and expansion.
    let got = c
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: "vol".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.status.unwrap().published_node_ids, vec![node_id(3)]);
    assert_eq!(
        c.controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: "nope".into()
        })
        .await
        .unwrap_err()
        .code(),
        Code::NotFound
    );
    let grown = c
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: "vol".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 64 << 20,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 64 << 20);
    assert!(grown.node_expansion_required);
    assert_eq!(
        env.store
            .get_volume("vol")
            .await
            .unwrap()
            .unwrap()
            .spec
            .size_bytes,
        64 << 20
    );

    let c = &mut env.client;
    c.controller_unpublish_volume(unpublish("vol", 3))
        .await
        .unwrap();
    c.delete_volume(delete("vol")).await.unwrap();
    c.delete_volume(delete("vol2")).await.unwrap();
    assert!(env.agent.state().subsystems.is_empty());
}

// proves C3 from the controller's side: an agent that restarted is sent the complete export
// state of its node, with the ACL of the recorded publications, before it serves.
#[tokio::test]
async fn a_restarted_agent_is_resynced_with_the_recorded_publications() {
    let mut env = Env::start(StoreKind::Kube, true).await;
    env.client
        .create_volume(create("vol", Mode::SingleNodeWriter))
        .await
        .unwrap();
    env.client
        .controller_publish_volume(publish("vol", 4, Mode::SingleNodeWriter, false))
        .await
        .unwrap();
    // A storage reboot: the target is empty and the agent restarts.
    env.agent.stop().await;
    std::fs::remove_dir_all(&env.agent.configfs).unwrap();
    env.agent.restart().await;
    assert!(env.agent.state().subsystems.is_empty());
    env.controller.resync_waiting_agents().await;
    let sub = &env.agent.state().subsystems[&nqn("vol")];
    assert_eq!(sub.allowed_hosts.iter().collect::<Vec<_>>(), vec![&host(4)]);
    // A second publish to the same node works against the resynced agent.
    env.client
        .controller_publish_volume(publish("vol", 4, Mode::SingleNodeWriter, false))
        .await
        .unwrap();
    env.client
        .controller_unpublish_volume(unpublish("vol", 4))
        .await
        .unwrap();
    env.client.delete_volume(delete("vol")).await.unwrap();
}

// The race: two controllers (replicas, or an old and a new leader) publish one RWO volume to two
// nodes at the same moment through the Kubernetes store double, over and over. The
// compare-and-swap on resourceVersion lets exactly one win every time. proves W1, W2
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_publishes_of_one_rwo_volume_have_exactly_one_winner() {
    let mut env = Env::start(StoreKind::Kube, true).await;
    env.client
        .create_volume(create("race", Mode::SingleNodeWriter))
        .await
        .unwrap();
    let (a, a_store) = env.replica();
    let (b, b_store) = env.replica();
    let rounds = 40;
    for round in 0..rounds {
        let (ra, rb) = tokio::join!(
            a.publish(publish("race", 1, Mode::SingleNodeWriter, false)),
            b.publish(publish("race", 2, Mode::SingleNodeWriter, false)),
        );
        let winners = [ra.is_ok(), rb.is_ok()];
        assert_eq!(
            winners.iter().filter(|w| **w).count(),
            1,
            "round {round}: {ra:?} / {rb:?}"
        );
        let (winner, loser_err) = match (ra, rb) {
            (Ok(_), Err(e)) => (1, e),
            (Err(e), Ok(_)) => (2, e),
            _ => unreachable!("exactly one winner was asserted above"),
        };
        assert!(
            matches!(
                pillar_csi::controller::code_of(&loser_err),
                Code::FailedPrecondition | Code::Aborted
            ),
            "round {round}: {loser_err}"
        );
        let nodes = published_nodes(&env, "race").await;
        assert_eq!(
            nodes,
            vec![(format!("node-{winner}"), false)],
            "round {round}"
        );
        let hosts = env.agent.state().subsystems[&nqn("race")]
            .allowed_hosts
            .clone();
        assert_eq!(
            hosts.into_iter().collect::<Vec<_>>(),
            vec![host(winner)],
            "round {round}: only the winner granted"
        );
        env.client
            .controller_unpublish_volume(unpublish("race", winner))
            .await
            .unwrap();
    }
    // The compare-and-swap really was contended: some writes met the other's newer record.
    let conflicts = a_store.conflicts(VolumeWrite::Status) + b_store.conflicts(VolumeWrite::Status);
    assert!(conflicts > 0, "no round raced: the test proved nothing");
    env.client.delete_volume(delete("race")).await.unwrap();
}

// A size the agent grew the volume to is recorded, or the call fails: under persistent
// conflicts the controller answers ABORTED (retry), never OK with the old size on record.
#[tokio::test]
async fn expand_under_persistent_conflicts_is_aborted() {
    let mut env = Env::start(StoreKind::Embedded, true).await;
    env.client
        .create_volume(create("grow", Mode::SingleNodeWriter))
        .await
        .unwrap();
    env.faults.conflict(VolumeWrite::Spec, usize::MAX);
    let status = env
        .client
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: "grow".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 32 << 20,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Aborted, "{}", status.message());
    assert_eq!(
        env.faults.injected(VolumeWrite::Spec),
        pillar_csi::controller::CAS_ATTEMPTS,
        "every attempt conflicted"
    );
    let recorded = env.store.get_volume("grow").await.unwrap().unwrap();
    assert_eq!(recorded.spec.size_bytes, 16 << 20, "nothing recorded");
    // Once the conflicts stop, the retry records the size.
    env.faults.conflict(VolumeWrite::Spec, 0);
    let grown = env
        .client
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: "grow".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 32 << 20,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 32 << 20);
    let recorded = env.store.get_volume("grow").await.unwrap().unwrap();
    assert_eq!(recorded.spec.size_bytes, 32 << 20);
    env.client.delete_volume(delete("grow")).await.unwrap();
}

// The agent's NOT_FOUND reaches the CSI caller as NOT_FOUND (typed reason, not INTERNAL): the
// storage node lost the volume's backing file.
#[tokio::test]
async fn an_agent_not_found_is_not_found_for_the_csi_caller() {
    let mut env = Env::start(StoreKind::Embedded, true).await;
    env.client
        .create_volume(create("lost", Mode::SingleNodeWriter))
        .await
        .unwrap();
    let backing: Vec<_> = std::fs::read_dir(&env.agent.pool)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("lost.")
        })
        .collect();
    assert_eq!(backing.len(), 1, "{backing:?}");
    std::fs::remove_file(&backing[0]).unwrap();
    let status = env
        .client
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: "lost".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 32 << 20,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{}", status.message());
    assert!(
        status.message().contains("does not exist"),
        "{}",
        status.message()
    );
}

// proves C3 and defect 7 of the safety review: a call that finds its agent waiting for a resync
// resyncs it and retries with a fresh token (the resync overtook the first one). On the old
// code the retry reused the stale token and was ABORTED every time.
#[tokio::test]
async fn a_call_that_meets_a_restarted_agent_succeeds_after_the_resync() {
    let mut env = Env::start(StoreKind::Embedded, true).await;
    env.client
        .create_volume(create("fresh", Mode::SingleNodeWriter))
        .await
        .unwrap();
    env.agent.stop().await;
    env.agent.restart().await;
    // No resync loop runs here: the publish itself meets WAITING_FOR_RESYNC.
    env.client
        .controller_publish_volume(publish("fresh", 1, Mode::SingleNodeWriter, false))
        .await
        .unwrap();
    assert_eq!(
        env.agent.state().subsystems[&nqn("fresh")]
            .allowed_hosts
            .iter()
            .cloned()
            .collect::<Vec<_>>(),
        vec![host(1)]
    );
}

// proves C3 and defects 5 and 6 of the safety review: one volume with a bad record (its
// PillarProtocol is gone) is left out of the resync and reported; the rest of the node is
// restored and the agent serves. Exports the agent could not restore are listed in its health
// and exported again by the controller's next round.
#[tokio::test]
async fn one_bad_record_does_not_stall_the_node_and_failed_exports_are_retried() {
    let mut env = Env::start(StoreKind::Embedded, true).await;
    for v in ["good", "bad"] {
        env.client
            .create_volume(create(v, Mode::SingleNodeWriter))
            .await
            .unwrap();
    }
    let bad = env.store.get_volume("bad").await.unwrap().unwrap();
    let mut spec = bad.spec.clone();
    spec.protocol = "deleted-protocol".into();
    env.store
        .replace_volume_spec("bad", &Revision::of(&bad).unwrap(), spec)
        .await
        .unwrap();
    // A storage reboot, and every mark write fails during the resync.
    env.agent.stop().await;
    std::fs::remove_dir_all(&env.agent.configfs).unwrap();
    env.agent.restart().await;
    env.agent
        .hooks
        .fail(pillar_agent::hooks::HookPoint::MarkWrite);
    env.controller.resync_waiting_agents().await;
    let ch = support::channel(&env.agent.socket).await;
    let mut agent = agent_api::agent_client::AgentClient::new(ch);
    let health = agent
        .health(agent_api::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        health.state(),
        agent_api::health_response::State::Serving,
        "the agent serves after a partial resync"
    );
    assert_eq!(health.unrestored_volume_ids, vec!["good".to_owned()]);
    assert!(env.agent.state().subsystems.is_empty());
    // The fault clears; the controller's next round restores what failed.
    env.agent
        .hooks
        .clear(pillar_agent::hooks::HookPoint::MarkWrite);
    env.controller.resync_waiting_agents().await;
    assert!(env.agent.state().subsystems.contains_key(&nqn("good")));
    assert!(!env.agent.state().subsystems.contains_key(&nqn("bad")));
    let health = agent
        .health(agent_api::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(health.unrestored_volume_ids.is_empty());
}

/// The volume's `AclDisabled` condition: (status, reason, lastTransitionTime).
async fn acl_condition(env: &Env, volume: &str) -> Option<(ConditionStatus, String, String)> {
    let v = env.store.get_volume(volume).await.unwrap().unwrap();
    find_condition(&v.status_or_default().conditions, ACL_DISABLED)
        .map(|c| (c.status, c.reason.clone(), c.last_transition_time.clone()))
}

/// Stamps the stored `AclDisabled` condition with a transition time no controller write would
/// produce, through a write of its own (an unrelated status update), so a later write that
/// re-stamped it could not hide within the same second.
async fn backdate_acl_condition(env: &Env, volume: &str) -> String {
    const LONG_AGO: &str = "2000-01-01T00:00:00Z";
    let v = env.store.get_volume(volume).await.unwrap().unwrap();
    let mut status = v.status_or_default();
    for c in &mut status.conditions {
        if c.type_ == ACL_DISABLED {
            c.last_transition_time = LONG_AGO.into();
        }
    }
    env.store
        .replace_volume_status(volume, &Revision::of(&v).unwrap(), status)
        .await
        .unwrap();
    LONG_AGO.into()
}

fn acl_warning() -> (String, String) {
    ("Warning".into(), "AclDisabled".into())
}

// proves W6, W7 (operator visibility of acl: false): a publication recorded under a protocol
// with acl: false sets AclDisabled=True once the agent confirmed the export that opens the
// subsystem (the recording write, decided again through conflicts, then one write of the
// condition) and records one Warning event; a retried publish, another node's
// publish and another node's unpublish keep the condition and its transition time and record
// nothing; the last unpublish clears it; a new transition warns again; a publish under a
// protocol turned acl: true sets it False.
#[tokio::test]
async fn acl_off_is_a_condition_on_the_volume_and_one_warning_per_transition() {
    for kind in STORES {
        let mut env = Env::start(kind, false).await;
        env.client
            .create_volume(create("open-vol", Mode::MultiNodeReaderOnly))
            .await
            .unwrap();
        assert_eq!(acl_condition(&env, "open-vol").await, None, "{kind:?}");
        // Conflicts on the recording write: decided again each time; the condition is written
        // after the agent's export, one event from the write that landed.
        env.faults.conflict(VolumeWrite::Status, 3);
        let writes = env.faults.calls(VolumeWrite::Status);
        env.client
            .controller_publish_volume(publish("open-vol", 1, Mode::MultiNodeReaderOnly, true))
            .await
            .unwrap();
        assert_eq!(env.faults.injected(VolumeWrite::Status), 3, "{kind:?}");
        assert_eq!(
            env.faults.calls(VolumeWrite::Status) - writes,
            5,
            "{kind:?}: the recording write (after 3 conflicts), then the condition's"
        );
        let (status, reason, _) = acl_condition(&env, "open-vol").await.unwrap();
        assert_eq!(
            (status, reason.as_str()),
            (ConditionStatus::True, "ProtocolAclOff"),
            "{kind:?}"
        );
        let v = env.store.get_volume("open-vol").await.unwrap().unwrap();
        let c = find_condition(&v.status_or_default().conditions, ACL_DISABLED)
            .unwrap()
            .clone();
        assert!(
            c.message
                .contains("unpublishing cannot keep a lost node out")
        );
        assert_eq!(c.observed_generation, v.metadata.generation, "{kind:?}");
        assert_eq!(env.events("open-vol"), vec![acl_warning()], "{kind:?}");
        // The target really admits any host: what the condition warns about.
        assert!(env.agent.state().subsystems[&nqn("open-vol")].allow_any_host);

        let long_ago = backdate_acl_condition(&env, "open-vol").await;
        // A retry of the same publish: no transition, no event, the time kept.
        env.client
            .controller_publish_volume(publish("open-vol", 1, Mode::MultiNodeReaderOnly, true))
            .await
            .unwrap();
        // Another node's publication: still True since then.
        env.client
            .controller_publish_volume(publish("open-vol", 2, Mode::MultiNodeReaderOnly, true))
            .await
            .unwrap();
        // An unpublish of one node while another stays published.
        env.client
            .controller_unpublish_volume(unpublish("open-vol", 2))
            .await
            .unwrap();
        assert_eq!(
            acl_condition(&env, "open-vol").await,
            Some((ConditionStatus::True, "ProtocolAclOff".into(), long_ago)),
            "{kind:?}"
        );
        assert_eq!(env.events("open-vol"), vec![acl_warning()], "{kind:?}");

        // The last publication goes: False, in the write that removes it.
        env.client
            .controller_unpublish_volume(unpublish("open-vol", 1))
            .await
            .unwrap();
        let (status, reason, _) = acl_condition(&env, "open-vol").await.unwrap();
        assert_eq!(
            (status, reason.as_str()),
            (ConditionStatus::False, "NotPublished"),
            "{kind:?}"
        );
        assert_eq!(env.events("open-vol"), vec![acl_warning()], "{kind:?}");

        // Published again under acl: false: a new transition, a new warning.
        env.client
            .controller_publish_volume(publish("open-vol", 1, Mode::MultiNodeReaderOnly, true))
            .await
            .unwrap();
        assert_eq!(
            acl_condition(&env, "open-vol").await.map(|c| c.0),
            Some(ConditionStatus::True),
            "{kind:?}"
        );
        assert_eq!(
            env.events("open-vol"),
            vec![acl_warning(), acl_warning()],
            "{kind:?}"
        );

        // The protocol turned acl: true: the next publication's write sets False, no event.
        let proto = env.store.get_protocol("nvme-tcp").await.unwrap().unwrap();
        let mut spec = proto.spec.clone();
        spec.nvme_tcp.acl = true;
        env.store
            .replace_protocol_spec("nvme-tcp", &Revision::of(&proto).unwrap(), spec)
            .await
            .unwrap();
        env.client
            .controller_publish_volume(publish("open-vol", 2, Mode::MultiNodeReaderOnly, true))
            .await
            .unwrap();
        let (status, reason, _) = acl_condition(&env, "open-vol").await.unwrap();
        assert_eq!(
            (status, reason.as_str()),
            (ConditionStatus::False, "ProtocolAclOn"),
            "{kind:?}"
        );
        assert_eq!(env.events("open-vol").len(), 2, "{kind:?}");

        for node in [1, 2] {
            env.client
                .controller_unpublish_volume(unpublish("open-vol", node))
                .await
                .unwrap();
        }
        env.client.delete_volume(delete("open-vol")).await.unwrap();
    }
}

// proves W6: under acl: true (the default) a publication leaves AclDisabled False and records
// no event, on both stores.
#[tokio::test]
async fn acl_on_leaves_the_condition_false_and_records_no_event() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        env.client
            .create_volume(create("closed-vol", Mode::SingleNodeWriter))
            .await
            .unwrap();
        for _ in 0..2 {
            env.client
                .controller_publish_volume(publish("closed-vol", 1, Mode::SingleNodeWriter, false))
                .await
                .unwrap();
        }
        let (status, reason, _) = acl_condition(&env, "closed-vol").await.unwrap();
        assert_eq!(
            (status, reason.as_str()),
            (ConditionStatus::False, "ProtocolAclOn"),
            "{kind:?}"
        );
        assert!(env.events("closed-vol").is_empty(), "{kind:?}");
        env.client
            .controller_unpublish_volume(unpublish("closed-vol", 1))
            .await
            .unwrap();
        let (status, reason, _) = acl_condition(&env, "closed-vol").await.unwrap();
        assert_eq!(
            (status, reason.as_str()),
            (ConditionStatus::False, "NotPublished"),
            "{kind:?}"
        );
        assert!(env.events("closed-vol").is_empty(), "{kind:?}");
        env.client
            .delete_volume(delete("closed-vol"))
            .await
            .unwrap();
    }
}

// proves W6: recording the event is best-effort: an API server that refuses it fails nothing,
// and the condition is recorded all the same.
#[tokio::test]
async fn a_refused_event_fails_no_publish() {
    let mut env = Env::start(StoreKind::Kube, false).await;
    env.client
        .create_volume(create("quiet-vol", Mode::SingleNodeWriter))
        .await
        .unwrap();
    env.double
        .as_ref()
        .unwrap()
        .inject_failure(pillar_state::apiserver_double::InjectedFailure {
            method: pillar_state::apiserver_double::HttpMethod::POST,
            path_suffix: "/events".into(),
            code: 403,
            reason: "Forbidden".into(),
            message: "events.events.k8s.io is forbidden".into(),
        });
    env.client
        .controller_publish_volume(publish("quiet-vol", 1, Mode::SingleNodeWriter, false))
        .await
        .unwrap();
    assert_eq!(
        acl_condition(&env, "quiet-vol").await.map(|c| c.0),
        Some(ConditionStatus::True)
    );
    assert!(env.events("quiet-vol").is_empty());
    env.client
        .controller_unpublish_volume(unpublish("quiet-vol", 1))
        .await
        .unwrap();
    env.client.delete_volume(delete("quiet-vol")).await.unwrap();
}

/// The volume's `Revoking` condition: (status, reason, message).
async fn revoking_condition(env: &Env, volume: &str) -> Option<(ConditionStatus, String, String)> {
    let v = env.store.get_volume(volume).await.unwrap().unwrap();
    find_condition(&v.status_or_default().conditions, REVOKING)
        .map(|c| (c.status, c.reason.clone(), c.message.clone()))
}

// proves W4 (what an operator sees while pillar fails closed): an unpublish whose revoke the
// storage node does not confirm keeps the publication, sets Revoking=True naming the node (in the
// write that marks it revoking) and records a RevokeFailed Warning; a confirmed unpublish turns
// Revoking False in the write that removes the publication and records nothing; a volume whose
// PillarAgent is gone is refused with an AgentMissing Warning. On both stores (the kube store's
// events are events.k8s.io/v1 objects in the API server double).
#[tokio::test]
async fn a_failed_revoke_and_a_missing_agent_are_conditions_and_events() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        for vol in ["rv-ok", "rv-stuck"] {
            // external-provisioner's --extra-create-metadata names the PersistentVolume.
            let mut req = create(vol, Mode::SingleNodeWriter);
            req.parameters
                .insert("csi.storage.k8s.io/pv/name".into(), format!("pv-{vol}"));
            env.client.create_volume(req).await.unwrap();
            env.client
                .controller_publish_volume(publish(vol, 1, Mode::SingleNodeWriter, false))
                .await
                .unwrap();
        }
        assert_eq!(revoking_condition(&env, "rv-ok").await, None, "{kind:?}");
        env.client
            .controller_unpublish_volume(unpublish("rv-ok", 1))
            .await
            .unwrap();
        let (status, reason, _) = revoking_condition(&env, "rv-ok").await.unwrap();
        assert_eq!(
            (status, reason.as_str()),
            (ConditionStatus::False, "NoRevokePending"),
            "{kind:?}"
        );
        assert!(env.events("rv-ok").is_empty(), "{kind:?}");

        // The storage node goes away: the revoke cannot be confirmed.
        env.agent.stop().await;
        let err = env
            .client
            .controller_unpublish_volume(unpublish("rv-stuck", 1))
            .await
            .expect_err("an unconfirmed revoke");
        assert_eq!(err.code(), Code::Unavailable, "{kind:?}: {}", err.message());
        let v = env.store.get_volume("rv-stuck").await.unwrap().unwrap();
        let published = v.status_or_default().published_nodes;
        assert_eq!(published.len(), 1, "{kind:?}: the publication must stay");
        assert!(published[0].revoking, "{kind:?}");
        let (status, reason, message) = revoking_condition(&env, "rv-stuck").await.unwrap();
        assert_eq!(
            (status, reason.as_str()),
            (ConditionStatus::True, "RevokeNotConfirmed"),
            "{kind:?}"
        );
        assert!(message.contains("node-1"), "{kind:?}: {message}");
        assert_eq!(
            env.events("rv-stuck"),
            vec![("Warning".to_owned(), "RevokeFailed".to_owned())],
            "{kind:?}"
        );

        // The PillarAgent is deleted: every call on the volume is refused, with a warning.
        let agent = env.store.get_agent(AGENT).await.unwrap().unwrap();
        env.store
            .delete_agent(AGENT, &Revision::of(&agent).unwrap())
            .await
            .unwrap();
        let err = env
            .client
            .controller_unpublish_volume(unpublish("rv-stuck", 1))
            .await
            .expect_err("no agent");
        assert_eq!(err.code(), Code::FailedPrecondition, "{kind:?}");
        assert_eq!(
            env.events("rv-stuck").last(),
            Some(&("Warning".to_owned(), "AgentMissing".to_owned())),
            "{kind:?}"
        );
        let v = env.store.get_volume("rv-stuck").await.unwrap().unwrap();
        assert_eq!(v.status_or_default().published_nodes.len(), 1, "{kind:?}");
        // The same warnings about the PersistentVolume (`kubectl describe pv`), the
        // PillarVolumeState as the related object.
        if let Some(double) = &env.double {
            let about_pv: Vec<(String, String)> = double
                .events()
                .into_iter()
                .filter(|e| {
                    e["regarding"]["kind"] == "PersistentVolume"
                        && e["regarding"]["name"] == "pv-rv-stuck"
                })
                .map(|e| {
                    assert_eq!(e["related"]["name"], "rv-stuck");
                    assert_eq!(e["related"]["kind"], "PillarVolumeState");
                    (
                        e["type"].as_str().unwrap().to_owned(),
                        e["reason"].as_str().unwrap().to_owned(),
                    )
                })
                .collect();
            assert_eq!(
                about_pv,
                [
                    ("Warning".to_owned(), "RevokeFailed".to_owned()),
                    ("Warning".to_owned(), "AgentMissing".to_owned())
                ]
            );
        }
    }
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).await.unwrap();
    out
}

/// The value of the sample line starting with `series` (name and labels) in `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
}

// The controller's metrics over real HTTP: CSI calls by method and code, agent calls by call and
// answer, compare-and-swap conflicts; nothing but /metrics is served. A refused call is also a
// Warning event on the volume.
#[tokio::test]
async fn the_controller_serves_its_metrics_over_http() {
    let env = Env::start(StoreKind::Kube, true).await;
    let addr = pillar_csi::controller::metrics::serve_metrics(
        "127.0.0.1:0".parse().unwrap(),
        env.controller.metrics(),
        std::future::pending(),
    )
    .await
    .unwrap();
    let mut client = env.client.clone();
    client
        .create_volume(create("m-vol", Mode::SingleNodeWriter))
        .await
        .unwrap();
    env.faults.conflict(VolumeWrite::Status, 2);
    client
        .controller_publish_volume(publish("m-vol", 1, Mode::SingleNodeWriter, false))
        .await
        .unwrap();
    let refused = client
        .delete_volume(delete("m-vol"))
        .await
        .expect_err("a published volume is not deleted");
    assert_eq!(refused.code(), Code::FailedPrecondition);
    // proves W5 (visible): the refusal is a Warning on the volume, naming the call and why.
    assert_eq!(
        env.events("m-vol"),
        [("Warning".to_owned(), "Refused".to_owned())]
    );
    let event = env.double.as_ref().unwrap().events().pop().unwrap();
    assert_eq!(event["action"], "DeleteVolume");
    assert!(
        event["note"].as_str().unwrap().contains("still published"),
        "{event}"
    );

    let response = http_get(addr, "/metrics").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    let count = |series: &str| {
        sample(&response, series).unwrap_or_else(|| panic!("no {series} in\n{response}"))
    };
    assert_eq!(
        count(r#"pillar_controller_csi_duration_seconds_count{method="CreateVolume",code="Ok"}"#),
        1.0
    );
    assert_eq!(
        count(
            r#"pillar_controller_csi_duration_seconds_count{method="ControllerPublishVolume",code="Ok"}"#
        ),
        1.0
    );
    assert_eq!(
        count(
            r#"pillar_controller_csi_duration_seconds_count{method="DeleteVolume",code="FailedPrecondition"}"#
        ),
        1.0
    );
    assert!(
        count(r#"pillar_controller_agent_call_duration_seconds_count{method="Export",code="Ok"}"#)
            >= 1.0
    );
    assert_eq!(
        count(r#"pillar_controller_cas_conflicts_total{kind="PillarVolumeState"}"#),
        2.0
    );
    // The resync round Env::start ran: the agent served (not waiting), no revoke pending.
    assert_eq!(
        count(r#"pillar_controller_agent_waiting_for_resync{agent="storage-1"}"#),
        0.0
    );
    assert_eq!(count("pillar_controller_volumes_revoking"), 0.0);
    assert!(!response.contains("m-vol"), "a volume ID in a label");
    let other = http_get(addr, "/").await;
    assert!(other.starts_with("HTTP/1.1 404"), "{other}");
}

// What the resync loop saw of an agent is its PillarAgent status (issue 13 item 3): Serving with
// the time of the resync that brought it back, then Unreachable with why once it is gone; written
// only on a change (a round that sees the same writes nothing), and kept by a spec write.
#[tokio::test]
async fn the_agent_status_shows_what_the_resync_loop_saw() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        let agent = env.store.get_agent(AGENT).await.unwrap().unwrap();
        let status = agent
            .status
            .clone()
            .expect("a status after the first round");
        assert_eq!(status.state, "Serving", "{kind:?}");
        assert!(status.last_resync_time.is_some(), "{kind:?}");
        assert!(status.last_transition_time.is_some(), "{kind:?}");
        assert_eq!((status.exports_restored, status.exports_failed), (0, 0));
        // The same again: no write.
        let rv = agent.metadata.resource_version.clone();
        env.controller.resync_waiting_agents().await;
        let again = env.store.get_agent(AGENT).await.unwrap().unwrap();
        assert_eq!(
            again.metadata.resource_version, rv,
            "{kind:?}: a write without a change"
        );
        // An operator edits the spec: the status stays.
        let mut spec = again.spec.clone();
        spec.nvme_address = "127.0.0.2".into();
        env.store
            .replace_agent_spec(AGENT, &Revision::of(&again).unwrap(), spec)
            .await
            .unwrap();
        let edited = env.store.get_agent(AGENT).await.unwrap().unwrap();
        assert_eq!(edited.status, again.status, "{kind:?}");

        env.agent.stop().await;
        env.controller.resync_waiting_agents().await;
        let gone = env
            .store
            .get_agent(AGENT)
            .await
            .unwrap()
            .unwrap()
            .status
            .unwrap();
        assert_eq!(gone.state, "Unreachable", "{kind:?}");
        assert!(!gone.message.is_empty(), "{kind:?}");
        assert_eq!(gone.last_resync_time, status.last_resync_time, "{kind:?}");
        assert_ne!(gone.last_transition_time, None);
        if let Some(double) = &env.double {
            let stored = double.object("pillaragents", AGENT).unwrap();
            assert_eq!(stored["status"]["state"], "Unreachable");
        }
    }
}
