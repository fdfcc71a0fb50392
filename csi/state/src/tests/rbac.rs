//! The controller's every kind of request, made as its ServiceAccount against the double, which
//! enforces `deploy/base/rbac.yaml` as a real API server does: what pillar ships must let the
//! controller do what its code does, and nothing the operator owns.

use crate::apiserver_double::rbac::{RbacPolicy, ServiceAccount};
use crate::apiserver_double::{ApiServerDouble, deploy_base};
use crate::crd::{PillarAgentStatus, PillarSnapshotStateSpec, PillarVolumeStateStatus};
use crate::lease::{Elector, LeaseSettings};
use crate::store::{EventType, Revision, StoreError, VolumeEvent};
use crate::test_support::{agent_spec, protocol_spec, volume_spec};
use crate::{KubeStore, StateStore};

fn shipped_rbac() -> String {
    std::fs::read_to_string(deploy_base().join("rbac.yaml")).unwrap()
}

/// The status code and message of a refused request.
fn refusal(err: &StoreError) -> Option<(u16, String)> {
    match err {
        StoreError::Refused { source, .. } => Some((source.code, source.message.clone())),
        _ => None,
    }
}

/// The operator's objects, created as the double's administrator.
async fn with_operator_objects(double: &ApiServerDouble) -> (KubeStore, KubeStore) {
    let admin = KubeStore::new(double.client().unwrap());
    admin
        .create_agent("storage-1", agent_spec("storage-1"))
        .await
        .unwrap();
    admin
        .create_protocol("nvme-tcp", protocol_spec())
        .await
        .unwrap();
    let controller = KubeStore::new(double.controller_client().unwrap());
    (admin, controller)
}

// proves W1: the controller records publications, snapshots, agent status and events as its
// ServiceAccount under the shipped RBAC (each of these is a 403 in a real cluster if a rule is
// missing; the double enforces the same rules).
#[tokio::test]
async fn the_shipped_rbac_lets_the_controller_do_what_its_code_does() {
    let double = ApiServerDouble::start().await.unwrap();
    let (_admin, store) = with_operator_objects(&double).await;

    assert_eq!(store.list_agents().await.unwrap().len(), 1);
    assert_eq!(store.list_protocols().await.unwrap().len(), 1);
    assert!(store.get_protocol("nvme-tcp").await.unwrap().is_some());
    let agent = store.get_agent("storage-1").await.unwrap().unwrap();
    let status = PillarAgentStatus {
        state: "Serving".into(),
        ..PillarAgentStatus::default()
    };
    store
        .replace_agent_status("storage-1", &Revision::of(&agent).unwrap(), status)
        .await
        .expect("the resync loop's PillarAgent status write (pillaragents/status)");

    let v = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let v = store
        .replace_volume_status(
            "vol-a",
            &Revision::of(&v).unwrap(),
            PillarVolumeStateStatus::default(),
        )
        .await
        .unwrap();
    let snapshot = PillarSnapshotStateSpec {
        snapshot_id: "snap-a".into(),
        source_volume_id: "vol-a".into(),
        source_uid: v.metadata.uid.clone().unwrap(),
        agent: "storage-1".into(),
        pool: "p1".into(),
    };
    let s = store.create_snapshot("snap-a", snapshot).await.unwrap();
    store
        .delete_snapshot("snap-a", &Revision::of(&s).unwrap())
        .await
        .unwrap();
    assert_eq!(store.list_volumes().await.unwrap().len(), 1);
    store
        .delete_volume("vol-a", &Revision::of(&v).unwrap())
        .await
        .unwrap();
    store
        .record_volume_event(&VolumeEvent {
            volume: "vol-a".into(),
            uid: v.metadata.uid.clone().unwrap(),
            type_: EventType::Warning,
            reason: "AclDisabled".into(),
            action: "Publish".into(),
            note: "published under acl: false".into(),
            pv: Some("pvc-1".into()),
        })
        .await
        .unwrap();
    // One about the PillarVolumeState, one about the PersistentVolume.
    assert_eq!(double.events().len(), 2);

    // The resync loop's Lease, in the controller's namespace.
    let settings = LeaseSettings::new("pillar-system", "pillar-controller", "controller-0");
    let (mut elector, _leadership) =
        Elector::new(double.controller_client().unwrap(), settings).unwrap();
    assert!(elector.try_acquire_or_renew().await.unwrap());
    assert!(double.lease("pillar-system", "pillar-controller").is_some());
}

// The operator's objects stay the operator's: the controller can neither edit a PillarAgent's
// spec nor create a PillarProtocol, and its Role gives it no Lease outside its namespace.
#[tokio::test]
async fn the_controller_cannot_write_what_the_operator_owns() {
    let double = ApiServerDouble::start().await.unwrap();
    let (_admin, store) = with_operator_objects(&double).await;
    let agent = store.get_agent("storage-1").await.unwrap().unwrap();
    let err = store
        .replace_agent_spec("storage-1", &Revision::of(&agent).unwrap(), agent_spec("x"))
        .await
        .unwrap_err();
    assert_eq!(refusal(&err).map(|r| r.0), Some(403), "{err:?}");
    let err = store
        .create_protocol("other", protocol_spec())
        .await
        .unwrap_err();
    assert_eq!(refusal(&err).map(|r| r.0), Some(403), "{err:?}");
    let settings = LeaseSettings::new("kube-system", "pillar-controller", "controller-0");
    let (mut elector, _leadership) =
        Elector::new(double.controller_client().unwrap(), settings).unwrap();
    assert!(elector.try_acquire_or_renew().await.is_err());
}

// The RBAC of pillar before this rule was added (issue 21): the resync loop's status write is a
// 403, with the message a real API server gives, so the State and LastResync columns stayed empty.
#[tokio::test]
async fn without_the_pillaragents_status_rule_the_agent_status_write_is_forbidden() {
    let rbac = shipped_rbac();
    assert!(rbac.contains("\"pillaragents/status\""));
    let without = rbac.replace(", \"pillaragents/status\"", "");
    let policy = RbacPolicy::from_yaml(&without, "pillar-system").unwrap();
    let double = ApiServerDouble::start_with_policy(policy).await.unwrap();
    let (_admin, store) = with_operator_objects(&double).await;
    let agent = store.get_agent("storage-1").await.unwrap().unwrap();
    let err = store
        .replace_agent_status(
            "storage-1",
            &Revision::of(&agent).unwrap(),
            PillarAgentStatus::default(),
        )
        .await
        .unwrap_err();
    let (code, message) = refusal(&err).unwrap();
    assert_eq!(code, 403);
    assert!(
        message.contains("cannot update resource \"pillaragents/status\""),
        "{message}"
    );
}

// A client without a token the double issued is 401, as an anonymous client of a real server
// with anonymous auth off; an unknown ServiceAccount gets nothing.
#[tokio::test]
async fn unknown_clients_are_refused() {
    let double = ApiServerDouble::start().await.unwrap();
    let nobody = double
        .client_as(&ServiceAccount::new("pillar-system", "pillar-node"))
        .unwrap();
    let err = KubeStore::new(nobody).list_volumes().await.unwrap_err();
    assert_eq!(refusal(&err).map(|r| r.0), Some(403), "{err:?}");
    let url: http::Uri = double.url().parse().unwrap();
    let anonymous = kube::Client::try_from(kube::Config::new(url)).unwrap();
    let err = KubeStore::new(anonymous).list_volumes().await.unwrap_err();
    assert_eq!(refusal(&err).map(|r| r.0), Some(401), "{err:?}");
}
