//! The target follows the PillarProtocol's `acl` when an operator changes it, and `AclDisabled`
//! says what the target enforces (issue 22, defect 10): the next publication of a volume whose
//! target mode is not the protocol's re-exports its subsystem from the recorded publications
//! (an ACL closing an open subsystem also cuts the live connections of hosts it no longer
//! admits), a resync does the same, and the condition is written from what the agent did.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pillar_nvmet::ConfigfsDouble;
use pillar_state::condition::{ACL_DISABLED, ConditionStatus, find_condition};
use pillar_state::store::Revision;
use support::{Env, Mode, StoreKind, create, host, node_secret, nqn, publish, unpublish};

const STORES: [StoreKind; 2] = [StoreKind::Embedded, StoreKind::Kube];

async fn set_protocol_acl(env: &Env, acl: bool) {
    let proto = env.store.get_protocol("nvme-tcp").await.unwrap().unwrap();
    let mut spec = proto.spec.clone();
    spec.nvme_tcp.acl = acl;
    env.store
        .replace_protocol_spec("nvme-tcp", &Revision::of(&proto).unwrap(), spec)
        .await
        .unwrap();
}

async fn acl_condition(env: &Env, volume: &str) -> Option<(ConditionStatus, String)> {
    let v = env.store.get_volume(volume).await.unwrap().unwrap();
    find_condition(&v.status_or_default().conditions, ACL_DISABLED)
        .map(|c| (c.status, c.reason.clone()))
}

/// What the target enforces for `volume`: (admits any host, allowed hosts).
fn target_access(env: &Env, volume: &str) -> (bool, Vec<String>) {
    let sub = &env.agent.state().subsystems[&nqn(volume)];
    (
        sub.allow_any_host,
        sub.allowed_hosts.iter().cloned().collect(),
    )
}

/// The port the volume's subsystem is linked to.
fn port_of(env: &Env, volume: &str) -> u16 {
    let state = env.agent.state();
    let port = state.ports_linking(&nqn(volume)).next().expect("linked");
    port.get()
}

fn acl_warnings(env: &Env, volume: &str) -> usize {
    env.events(volume)
        .iter()
        .filter(|(t, r)| t == "Warning" && r == "AclDisabled")
        .count()
}

// proves W6, W7 (issue 22, defect 10): `acl: false` turned `true` while a volume is published
// reaches the target at the next publication: the subsystem admits only the recorded hosts, a
// host that connected while any host was admitted (a force-detached node) loses its live
// connection and cannot connect again, and AclDisabled turns False only then. Turned back to
// false, the next publication opens the subsystem again, and AclDisabled turns True with one
// warning. A resync after an agent restart exports with the protocol's acl and the condition
// follows. On the old code the grant left the subsystem admitting any host, the lost node
// stayed connected and could reconnect, and AclDisabled said False.
#[tokio::test]
async fn the_target_follows_the_protocol_acl_and_the_condition_says_what_it_enforces() {
    for kind in STORES {
        let mut env = Env::start(kind, false).await;
        let double = ConfigfsDouble::create(&env.agent.configfs).unwrap();
        env.client
            .create_volume(create("flip", Mode::SingleNodeWriter))
            .await
            .unwrap();
        env.client
            .controller_publish_volume(publish("flip", 1, Mode::SingleNodeWriter, false))
            .await
            .unwrap();
        assert_eq!(target_access(&env, "flip"), (true, vec![]), "{kind:?}");
        let port = port_of(&env, "flip");
        // Node 1 is lost and force-detached; under acl: false it connects all the same.
        env.client
            .controller_unpublish_volume(unpublish("flip", 1))
            .await
            .unwrap();
        double.host_connects(&nqn("flip"), &host(1), port).unwrap();

        // The operator turns the ACL on; the next node is published.
        set_protocol_acl(&env, true).await;
        env.client
            .controller_publish_volume(publish("flip", 2, Mode::SingleNodeWriter, false))
            .await
            .unwrap();
        assert_eq!(
            target_access(&env, "flip"),
            (false, vec![host(2)]),
            "{kind:?}: the target follows acl: true"
        );
        assert!(
            double
                .controllers(&nqn("flip"))
                .unwrap()
                .iter()
                .all(|(_, h)| *h != host(1)),
            "{kind:?}: the lost node kept its live connection"
        );
        assert!(
            double.host_connects(&nqn("flip"), &host(1), port).is_err(),
            "{kind:?}: the lost node can connect again"
        );
        // W10: on the embedded store node 2 proves its secret.
        double
            .host_connects_with_secret(
                &nqn("flip"),
                &host(2),
                port,
                node_secret(&env, 2).as_deref(),
            )
            .unwrap();
        assert_eq!(
            acl_condition(&env, "flip").await,
            Some((ConditionStatus::False, "ProtocolAclOn".into())),
            "{kind:?}"
        );
        let warnings = acl_warnings(&env, "flip");

        // Turned back off: a retried publication opens the subsystem, AclDisabled turns True
        // with one warning.
        set_protocol_acl(&env, false).await;
        env.client
            .controller_publish_volume(publish("flip", 2, Mode::SingleNodeWriter, false))
            .await
            .unwrap();
        assert_eq!(target_access(&env, "flip"), (true, vec![]), "{kind:?}");
        assert_eq!(
            acl_condition(&env, "flip").await,
            Some((ConditionStatus::True, "ProtocolAclOff".into())),
            "{kind:?}"
        );
        assert_eq!(acl_warnings(&env, "flip"), warnings + 1, "{kind:?}");

        // On again, then the agent restarts: the resync exports with an ACL and the condition
        // follows what it did.
        set_protocol_acl(&env, true).await;
        env.agent.restart().await;
        env.controller.resync_waiting_agents().await;
        assert_eq!(
            target_access(&env, "flip"),
            (false, vec![host(2)]),
            "{kind:?}: the resync follows acl: true"
        );
        assert_eq!(
            acl_condition(&env, "flip").await,
            Some((ConditionStatus::False, "ProtocolAclOn".into())),
            "{kind:?}"
        );
        assert_eq!(acl_warnings(&env, "flip"), warnings + 1, "{kind:?}");
    }
}

// proves W6, W7 (issue 22, defect 10): an edit of the protocol's `acl` reaches a volume that
// stays published, with no new publication and no agent restart: the leader's resync loop
// scans the volumes (here: the first round of a new leader) and exports the subsystem again
// with an ACL of the recorded publications, the lost node's live connection is cut, and the
// condition follows. Without the scan the target kept admitting any host until the volume's
// next publication.
#[tokio::test]
async fn an_acl_edit_reaches_a_volume_that_stays_published() {
    for kind in STORES {
        let mut env = Env::start(kind, false).await;
        let double = ConfigfsDouble::create(&env.agent.configfs).unwrap();
        env.client
            .create_volume(create("stay", Mode::SingleNodeWriter))
            .await
            .unwrap();
        env.client
            .controller_publish_volume(publish("stay", 1, Mode::SingleNodeWriter, false))
            .await
            .unwrap();
        let port = port_of(&env, "stay");
        double.host_connects(&nqn("stay"), &host(9), port).unwrap();
        set_protocol_acl(&env, true).await;
        // The next scan of the volumes (a new leader scans at its first round).
        env.second_controller().resync_waiting_agents().await;
        assert_eq!(
            target_access(&env, "stay"),
            (false, vec![host(1)]),
            "{kind:?}: the target follows acl: true"
        );
        assert!(
            double
                .controllers(&nqn("stay"))
                .unwrap()
                .iter()
                .all(|(_, h)| *h != host(9)),
            "{kind:?}: a host the ACL does not admit kept its connection"
        );
        assert_eq!(
            acl_condition(&env, "stay").await,
            Some((ConditionStatus::False, "ProtocolAclOn".into())),
            "{kind:?}"
        );
        // A scan with nothing to change changes nothing.
        let before = env.store.get_volume("stay").await.unwrap().unwrap();
        env.second_controller().resync_waiting_agents().await;
        let after = env.store.get_volume("stay").await.unwrap().unwrap();
        assert_eq!(
            before.metadata.resource_version, after.metadata.resource_version,
            "{kind:?}"
        );
    }
}
