//! Nodes' DH-HMAC-CHAP credentials in the Kubernetes store (W10): a Secret per node in pillar's
//! namespace, made and rotated by the controller as its ServiceAccount under the shipped RBAC,
//! readable by nobody else of pillar's, and the double's Secrets held to the server's rules.

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};

use crate::apiserver_double::ApiServerDouble;
use crate::apiserver_double::rbac::ServiceAccount;
use crate::kube_credentials::{NODE_ANNOTATION, SECRET_TYPE, secret_name};
use crate::store::StoreError;
use crate::{KubeStore, StateStore};

const NS: &str = "pillar-system";

fn controller_store(double: &ApiServerDouble) -> KubeStore {
    KubeStore::new(double.controller_client().unwrap()).with_credentials_namespace(NS)
}

fn status_code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

// proves W10 (credentials with the Kubernetes store): the controller's ServiceAccount makes a
// node's pair once (the same pair on every later call, from any replica), a Secret per node in
// pillar's namespace holding no other node's; a new host NQN or a rotation replaces it; the node
// plugin's ServiceAccount (and the controller's outside pillar's namespace) is refused; a
// corrupt Secret fails closed and is not overwritten. On the old code the Kubernetes store
// refused every node's credentials (NoCredentials).
#[tokio::test]
async fn one_secret_per_node_made_and_rotated_by_the_controller_only() {
    let double = ApiServerDouble::start().await.unwrap();
    let store = controller_store(&double);
    let replica = controller_store(&double);
    let a = store.node_credentials("node-a", "nqn.h:a").await.unwrap();
    assert_eq!(
        replica.node_credentials("node-a", "nqn.h:a").await.unwrap(),
        a
    );
    let b = store.node_credentials("node-b", "nqn.h:b").await.unwrap();
    assert_ne!(a.secret, b.secret);
    assert_ne!(a.secret, a.ctrl_secret);
    let stored = double.secret(NS, &secret_name("node-a")).expect("a Secret");
    assert_eq!(stored["type"], SECRET_TYPE);
    assert_eq!(stored["metadata"]["annotations"][NODE_ANNOTATION], "node-a");
    let shown = serde_json::to_string(&stored).unwrap();
    assert!(
        !shown.contains(&b.secret),
        "node b's secret in node a's Secret"
    );
    assert!(!format!("{a:?}").contains(&a.secret[10..]));

    let moved = store.node_credentials("node-a", "nqn.h:a2").await.unwrap();
    assert_ne!(moved.secret, a.secret);
    assert_eq!(moved.host_nqn, "nqn.h:a2");
    let rotated = store
        .rotate_node_credentials("node-a", "nqn.h:a2")
        .await
        .unwrap();
    assert_ne!(rotated.secret, moved.secret);
    assert_eq!(
        replica
            .node_credentials("node-a", "nqn.h:a2")
            .await
            .unwrap(),
        rotated
    );

    // Nobody else of pillar's reads them.
    let node_client = double
        .client_as(&ServiceAccount::new(NS, "pillar-node"))
        .unwrap();
    let as_node: Api<Secret> = Api::namespaced(node_client, NS);
    let refused = as_node.get(&secret_name("node-a")).await.unwrap_err();
    assert_eq!(status_code(&refused), Some(403), "{refused}");
    let elsewhere =
        KubeStore::new(double.controller_client().unwrap()).with_credentials_namespace("default");
    match elsewhere.node_credentials("node-a", "nqn.h:a").await {
        Err(StoreError::Refused { source, .. }) => assert_eq!(source.code, 403),
        other => panic!("outside pillar's namespace: {other:?}"),
    }

    // Corrupt: an error naming the Secret, never new credentials over it.
    let admin: Api<Secret> = Api::namespaced(double.client().unwrap(), NS);
    let mut s = admin.get(&secret_name("node-b")).await.unwrap();
    if let Some(d) = s.data.as_mut() {
        d.insert("dhchapSecret".into(), ByteString(b"not a secret".to_vec()));
    }
    admin
        .replace(&secret_name("node-b"), &PostParams::default(), &s)
        .await
        .unwrap();
    let err = store
        .node_credentials("node-b", "nqn.h:b")
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("corrupt") || crate::error_chain(&err).contains("corrupt"),
        "{}",
        crate::error_chain(&err)
    );
    assert!(!crate::error_chain(&err).contains("not a secret"));
    let after = admin.get(&secret_name("node-b")).await.unwrap();
    assert_eq!(after.data, s.data, "a corrupt Secret was overwritten");
}

// proves W10: replicas asking for a new node's credentials at once all get the one pair that
// was stored (the create that lost reads the winner's).
#[tokio::test]
async fn racing_replicas_hand_out_one_pair() {
    let double = ApiServerDouble::start().await.unwrap();
    let stores: Vec<KubeStore> = (0..4).map(|_| controller_store(&double)).collect();
    let got = futures::future::join_all(
        stores
            .iter()
            .map(|s| s.node_credentials("node-r", "nqn.h:r")),
    )
    .await;
    let first = got[0].as_ref().unwrap();
    for g in &got {
        assert_eq!(g.as_ref().unwrap(), first);
    }
    let stored = controller_store(&double)
        .node_credentials("node-r", "nqn.h:r")
        .await
        .unwrap();
    assert_eq!(&stored, first);
}

// The double's Secrets follow the API server's rules pillar's use meets: base64 data, config
// keys, stringData merged, type defaulted and immutable, AlreadyExists, a stale resourceVersion
// refused, a missing one 404.
#[tokio::test]
async fn the_double_keeps_secrets_by_the_servers_rules() {
    let double = ApiServerDouble::start().await.unwrap();
    let api: Api<Secret> = Api::namespaced(double.client().unwrap(), NS);
    let pp = PostParams::default();
    let mut s: Secret = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "s1" },
        "stringData": { "k": "v" },
    }))
    .unwrap();
    let made = api.create(&pp, &s).await.unwrap();
    assert_eq!(made.type_.as_deref(), Some("Opaque"));
    assert_eq!(made.data.unwrap()["k"].0, b"v");
    assert!(made.string_data.is_none());
    assert_eq!(
        status_code(&api.create(&pp, &s).await.unwrap_err()),
        Some(409)
    );
    s.metadata.name = Some("s2".into());
    s.string_data = Some([("bad/key".to_owned(), "v".to_owned())].into());
    assert_eq!(
        status_code(&api.create(&pp, &s).await.unwrap_err()),
        Some(422)
    );
    let mut current = api.get("s1").await.unwrap();
    current.type_ = Some("other".into());
    assert_eq!(
        status_code(&api.replace("s1", &pp, &current).await.unwrap_err()),
        Some(422),
        "type is immutable"
    );
    let mut stale = api.get("s1").await.unwrap();
    let mut fresh = stale.clone();
    fresh.string_data = Some([("k".to_owned(), "w".to_owned())].into());
    api.replace("s1", &pp, &fresh).await.unwrap();
    stale.string_data = Some([("k".to_owned(), "x".to_owned())].into());
    assert_eq!(
        status_code(&api.replace("s1", &pp, &stale).await.unwrap_err()),
        Some(409)
    );
    assert_eq!(api.get("s1").await.unwrap().data.unwrap()["k"].0, b"w");
    assert!(api.get_opt("missing").await.unwrap().is_none());
    // Not base64: refused before anything is stored.
    let raw = serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": { "name": "s3" }, "data": { "k": "***" },
    });
    let req = http::Request::post(format!("{}/api/v1/namespaces/{NS}/secrets", double.url()))
        .header("content-type", "application/json")
        .body(raw.to_string().into_bytes())
        .unwrap();
    let err = double
        .client()
        .unwrap()
        .request::<Secret>(req)
        .await
        .unwrap_err();
    assert_eq!(status_code(&err), Some(400), "{err}");
    assert!(double.secret(NS, "s3").is_none());
}

// proves W10 (least privilege of the delivery's read): on each store, the stored pair is read
// without being made (nothing stored: `None`, and still nothing stored after), and a read naming
// another host NQN than the stored pair's gets `None` and leaves the pair as it was.
#[tokio::test]
async fn a_read_of_a_stored_pair_never_makes_or_replaces_one() {
    let double = ApiServerDouble::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stores: Vec<Box<dyn StateStore>> = vec![
        Box::new(controller_store(&double)),
        Box::new(crate::EmbeddedStore::open(dir.path()).await.unwrap()),
        Box::new(crate::MemoryStore::new()),
    ];
    for store in stores {
        assert_eq!(
            store
                .stored_node_credentials("node-s", "nqn.h:s")
                .await
                .unwrap(),
            None
        );
        assert_eq!(
            store
                .stored_node_credentials("node-s", "nqn.h:s")
                .await
                .unwrap(),
            None,
            "{store:?}: a read made a pair"
        );
        let made = store.node_credentials("node-s", "nqn.h:s").await.unwrap();
        assert_eq!(
            store
                .stored_node_credentials("node-s", "nqn.h:s")
                .await
                .unwrap(),
            Some(made.clone())
        );
        assert_eq!(
            store
                .stored_node_credentials("node-s", "nqn.h:other")
                .await
                .unwrap(),
            None
        );
        assert_eq!(
            store
                .stored_node_credentials("node-s", "nqn.h:s")
                .await
                .unwrap(),
            Some(made),
            "{store:?}: a read naming another host NQN replaced the pair"
        );
    }
}
