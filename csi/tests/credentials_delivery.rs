//! A node gets its own DH-HMAC-CHAP pair and no other node's (W10, issue 25): the controller
//! reviews the node plugin's projected, audience-bound token with the API server (the double,
//! enforcing deploy/base/rbac.yaml on the controller's ServiceAccount) and answers the pair of
//! the node the token is bound to. The attacks: another node's pair, a token for another
//! audience or of another ServiceAccount, a forged token, a replay after the pod is gone, an API
//! server that will not review.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use pillar_csi::credentials_delivery::{AUDIENCE, Delivery, DeliveryError};
use pillar_state::apiserver_double::ApiServerDouble;
use pillar_state::apiserver_double::rbac::ServiceAccount;
use pillar_state::kube_credentials::secret_name;
use pillar_state::{KubeStore, StateStore};

const NS: &str = "pillar-system";

fn node_plugin() -> ServiceAccount {
    ServiceAccount::new(NS, "pillar-node")
}

// proves W10 (delivery to its node only): node 1's token gets node 1's pair (the one the
// agent holds), again on a replay while its pod lives; asking with it for node 2's pair is
// PERMISSION_DENIED and makes nothing for node 2; a token for the API server's default
// audience, a forged one, or one whose pod was deleted is UNAUTHENTICATED; the controller's
// own ServiceAccount's token is PERMISSION_DENIED; a reviewer the API server refuses is
// UNAVAILABLE. Before this change the Kubernetes store handed nobody a pair (no Secrets, no
// review): the node's stage failed for want of it.
#[tokio::test]
async fn a_node_gets_its_own_pair_and_no_other() {
    let double = ApiServerDouble::start().await.unwrap();
    let store: Arc<dyn StateStore> = Arc::new(
        KubeStore::new(double.controller_client().unwrap()).with_credentials_namespace(NS),
    );
    let delivery = Delivery::new(Arc::clone(&store), double.controller_client().unwrap(), NS);
    // Made at node 1's publication.
    let granted = store.node_credentials("node-1", "nqn.h:1").await.unwrap();

    let token = double.issue_pod_token(&node_plugin(), "pillar-node-a", "node-1", &[AUDIENCE]);
    let got = delivery
        .credentials_for(&token, "node-1", "nqn.h:1")
        .await
        .unwrap();
    assert_eq!(got, granted);
    // A replay while the pod lives yields the same node's pair, nothing more.
    assert_eq!(
        delivery
            .credentials_for(&token, "node-1", "nqn.h:1")
            .await
            .unwrap(),
        granted
    );

    let err = delivery
        .credentials_for(&token, "node-2", "nqn.h:2")
        .await
        .unwrap_err();
    assert!(matches!(err, DeliveryError::OtherNode { .. }), "{err}");
    assert_eq!(err.code(), tonic::Code::PermissionDenied);
    assert!(
        double.secret(NS, &secret_name("node-2")).is_none(),
        "a refused request made node 2's pair"
    );

    let api_audience = double.issue_pod_token(
        &node_plugin(),
        "pillar-node-a",
        "node-1",
        &["https://kubernetes.default.svc"],
    );
    for bad in [api_audience.as_str(), "forged-token"] {
        let err = delivery
            .credentials_for(bad, "node-1", "nqn.h:1")
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err}");
    }

    let controller_token = double.issue_pod_token(
        &ServiceAccount::pillar_controller(),
        "pillar-controller-x",
        "node-1",
        &[AUDIENCE],
    );
    let err = delivery
        .credentials_for(&controller_token, "node-1", "nqn.h:1")
        .await
        .unwrap_err();
    assert!(matches!(err, DeliveryError::Account { .. }), "{err}");

    // The pod is gone: its token (stolen, replayed) no longer opens anything.
    double.delete_pod("pillar-node-a");
    let err = delivery
        .credentials_for(&token, "node-1", "nqn.h:1")
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err}");

    // A reviewer without `create tokenreviews` (here the node plugin's own account): refused
    // by RBAC, answered UNAVAILABLE, never a pair.
    let fresh = double.issue_pod_token(&node_plugin(), "pillar-node-b", "node-1", &[AUDIENCE]);
    let unreviewed = Delivery::new(
        Arc::clone(&store),
        double.client_as(&node_plugin()).unwrap(),
        NS,
    );
    let err = unreviewed
        .credentials_for(&fresh, "node-1", "nqn.h:1")
        .await
        .unwrap_err();
    assert!(matches!(err, DeliveryError::Review(_)), "{err}");
    assert_eq!(err.code(), tonic::Code::Unavailable);
    // And the controller's own account may review it.
    assert_eq!(
        delivery
            .credentials_for(&fresh, "node-1", "nqn.h:1")
            .await
            .unwrap(),
        granted
    );
}
