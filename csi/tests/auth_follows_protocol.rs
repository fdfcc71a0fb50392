//! `auth: none` is visible, and the target follows the PillarProtocol's `auth` (W10, issue 25):
//! a published volume's `AuthDisabled` condition says what its storage node was confirmed to
//! enforce, a transition to True records one Warning event, and an edit of `auth` reaches a
//! volume that stays published at the next scan of the leader's resync loop (as `acl` does,
//! issue 22 defect 10). On the Kubernetes store the controller runs as its ServiceAccount,
//! held to deploy/base/rbac.yaml by the API server double.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pillar_nvmet::ConfigfsDouble;
use pillar_state::condition::{AUTH_DISABLED, ConditionStatus, find_condition};
use pillar_state::crd::ProtocolAuth;
use pillar_state::store::Revision;
use support::{Env, Mode, StoreKind, create, host, node_secret, nqn, publish, unpublish};

const STORES: [StoreKind; 2] = [StoreKind::Embedded, StoreKind::Kube];

async fn set_protocol(env: &Env, acl: bool, auth: ProtocolAuth) {
    let proto = env.store.get_protocol("nvme-tcp").await.unwrap().unwrap();
    let mut spec = proto.spec.clone();
    spec.nvme_tcp.acl = acl;
    spec.nvme_tcp.auth = auth;
    env.store
        .replace_protocol_spec("nvme-tcp", &Revision::of(&proto).unwrap(), spec)
        .await
        .unwrap();
}

/// The volume's `AuthDisabled` condition: (status, reason, message).
async fn auth_condition(env: &Env, volume: &str) -> Option<(ConditionStatus, String, String)> {
    let v = env.store.get_volume(volume).await.unwrap().unwrap();
    find_condition(&v.status_or_default().conditions, AUTH_DISABLED)
        .map(|c| (c.status, c.reason.clone(), c.message.clone()))
}

fn auth_warnings(env: &Env, volume: &str) -> usize {
    env.events(volume)
        .iter()
        .filter(|(t, r)| t == "Warning" && r == "AuthDisabled")
        .count()
}

fn port_of(env: &Env, volume: &str) -> u16 {
    let state = env.agent.state();
    let port = state.ports_linking(&nqn(volume)).next().expect("linked");
    port.get()
}

// proves W10 (visible auth: none): a publication under `auth: none` sets AuthDisabled=True
// (reason ProtocolAuthNone, a message saying any host presenting a published node's NQN is
// admitted) once the agent confirmed the export, records one Warning `AuthDisabled`, and the
// target does admit the node's NQN without a secret; a second publication records no second
// warning; `acl: false` shows AuthDisabled=True too (ProtocolAclOff: the kernel authenticates
// none; the warning is AclDisabled's); the last unpublish clears it. On the old code no AuthDisabled condition nor event was
// written (a log line only).
#[tokio::test]
async fn auth_none_is_a_condition_on_the_volume_and_one_warning_per_transition() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        let double = ConfigfsDouble::create(&env.agent.configfs).unwrap();
        set_protocol(&env, true, ProtocolAuth::None).await;
        env.client
            .create_volume(create("open", Mode::MultiNodeReaderOnly))
            .await
            .unwrap();
        env.client
            .controller_publish_volume(publish("open", 1, Mode::MultiNodeReaderOnly, true))
            .await
            .unwrap();
        let (status, reason, message) = auth_condition(&env, "open").await.expect("condition");
        assert_eq!(
            (status, reason.as_str()),
            (ConditionStatus::True, "ProtocolAuthNone"),
            "{kind:?}"
        );
        assert!(
            message.contains("any host presenting a published node's host NQN"),
            "{kind:?}: {message}"
        );
        assert_eq!(auth_warnings(&env, "open"), 1, "{kind:?}");
        // What the condition says is what the target does: the NQN alone is admitted.
        let port = port_of(&env, "open");
        double
            .host_connects_with_secret(&nqn("open"), &host(1), port, None)
            .unwrap();
        env.client
            .controller_publish_volume(publish("open", 2, Mode::MultiNodeReaderOnly, true))
            .await
            .unwrap();
        assert_eq!(
            auth_warnings(&env, "open"),
            1,
            "{kind:?}: one per transition"
        );

        // Unpublished from both: cleared.
        for n in [1, 2] {
            env.client
                .controller_unpublish_volume(unpublish("open", n))
                .await
                .unwrap();
        }
        let (status, reason, _) = auth_condition(&env, "open").await.unwrap();
        assert_eq!(
            (status, reason.as_str()),
            (ConditionStatus::False, "NotPublished"),
            "{kind:?}"
        );

        // acl: false: the kernel authenticates nobody, whatever `auth` says.
        set_protocol(&env, false, ProtocolAuth::Dhchap).await;
        env.client
            .controller_publish_volume(publish("open", 1, Mode::MultiNodeReaderOnly, true))
            .await
            .unwrap();
        let (status, reason, _) = auth_condition(&env, "open").await.unwrap();
        assert_eq!(
            (status, reason.as_str()),
            (ConditionStatus::True, "ProtocolAclOff"),
            "{kind:?}"
        );
        // Its warning is AclDisabled's (one decision, one warning).
        assert_eq!(auth_warnings(&env, "open"), 1, "{kind:?}");
    }
}

// proves W10 (the target follows auth): `auth: none` turned `dhchap` while a volume stays
// published reaches the target at the next scan of the volumes: the agent sets the node's keys
// (a host presenting the node's NQN without its secret is refused, the node with it connects)
// and only then AuthDisabled turns False. Turned back to none, AuthDisabled turns True with one
// more warning. A scan with nothing to change writes nothing. On the old code the scan
// compared the `acl` alone: the target kept admitting the NQN alone and no condition said so.
#[tokio::test]
async fn an_auth_edit_reaches_a_volume_that_stays_published() {
    for kind in STORES {
        an_auth_edit_reaches(kind).await;
    }
}

async fn an_auth_edit_reaches(kind: StoreKind) {
    let mut env = Env::start(kind, true).await;
    let double = ConfigfsDouble::create(&env.agent.configfs).unwrap();
    set_protocol(&env, true, ProtocolAuth::None).await;
    env.client
        .create_volume(create("stay", Mode::SingleNodeWriter))
        .await
        .unwrap();
    env.client
        .controller_publish_volume(publish("stay", 1, Mode::SingleNodeWriter, false))
        .await
        .unwrap();
    let port = port_of(&env, "stay");
    double
        .host_connects_with_secret(&nqn("stay"), &host(1), port, None)
        .unwrap();
    assert_eq!(auth_warnings(&env, "stay"), 1);

    set_protocol(&env, true, ProtocolAuth::Dhchap).await;
    env.second_controller().resync_waiting_agents().await;
    let (status, reason, _) = auth_condition(&env, "stay").await.unwrap();
    assert_eq!(
        (status, reason.as_str()),
        (ConditionStatus::False, "ProtocolAuthDhchap")
    );
    assert!(
        double
            .host_connects_with_secret(&nqn("stay"), &host(1), port, None)
            .is_err(),
        "a host presenting the node's NQN without its secret is admitted"
    );
    let secret = node_secret(&env, 1).expect("the node's secret was made");
    double
        .host_connects_with_secret(&nqn("stay"), &host(1), port, Some(&secret))
        .unwrap();
    // Nothing to change: nothing written.
    let before = env.store.get_volume("stay").await.unwrap().unwrap();
    env.second_controller().resync_waiting_agents().await;
    let after = env.store.get_volume("stay").await.unwrap().unwrap();
    assert_eq!(
        before.metadata.resource_version,
        after.metadata.resource_version
    );

    set_protocol(&env, true, ProtocolAuth::None).await;
    env.second_controller().resync_waiting_agents().await;
    let (status, reason, _) = auth_condition(&env, "stay").await.unwrap();
    assert_eq!(
        (status, reason.as_str()),
        (ConditionStatus::True, "ProtocolAuthNone"),
        "{kind:?}"
    );
    assert_eq!(auth_warnings(&env, "stay"), 2, "{kind:?}");
    // The gap W10 (3): the host entry keeps its keys (shared by every export of this storage
    // node admitting the host), so the condition claims less than the target enforces.
    assert!(
        double
            .host_connects_with_secret(&nqn("stay"), &host(1), port, None)
            .is_err(),
        "{kind:?}"
    );
}

// proves W10 (rotation): rotating node 1's pair reaches every storage node where it holds a
// publication: the old secret no longer connects to either of its volumes, the new one does,
// and node 2's keys are untouched. A node holding no publication is refused (nothing holds its
// pair). On the old code there was no controller rotation: the store's pair changed and the
// targets kept the old keys until some later grant.
#[tokio::test]
async fn a_rotation_reaches_every_volume_of_the_node() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        let double = ConfigfsDouble::create(&env.agent.configfs).unwrap();
        for (v, n) in [("r1", 1), ("r2", 1), ("r3", 2)] {
            env.client
                .create_volume(create(v, Mode::SingleNodeWriter))
                .await
                .unwrap();
            env.client
                .controller_publish_volume(publish(v, n, Mode::SingleNodeWriter, false))
                .await
                .unwrap();
        }
        let old = node_secret(&env, 1).unwrap();
        let other = node_secret(&env, 2).unwrap();
        let rotation = env
            .controller
            .rotate_node_credentials("node-1")
            .await
            .unwrap();
        assert_eq!(rotation.agents, vec![support::AGENT.to_owned()], "{kind:?}");
        assert!(rotation.failed.is_empty(), "{kind:?}: {rotation:?}");
        let new = node_secret(&env, 1).unwrap();
        assert_ne!(new, old, "{kind:?}");
        for v in ["r1", "r2"] {
            let port = port_of(&env, v);
            assert!(
                double
                    .host_connects_with_secret(&nqn(v), &host(1), port, Some(&old))
                    .is_err(),
                "{kind:?}: the old secret still connects to {v}"
            );
            double
                .host_connects_with_secret(&nqn(v), &host(1), port, Some(&new))
                .unwrap();
        }
        assert_eq!(node_secret(&env, 2).unwrap(), other, "{kind:?}");
        double
            .host_connects_with_secret(&nqn("r3"), &host(2), port_of(&env, "r3"), Some(&other))
            .unwrap();
        assert!(
            env.controller
                .rotate_node_credentials("node-9")
                .await
                .is_err(),
            "{kind:?}"
        );
    }
}
