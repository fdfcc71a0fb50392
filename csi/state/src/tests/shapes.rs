//! What KubeStore sends, read from the API server double's request log.

use serde_json::json;

use crate::store::Revision;
use crate::test_support::{kube, volume_spec};

const BASE: &str = "/apis/pillar-csi.io/v1alpha1/pillarvolumestates";

// proves W1: the record is written with a CAS on resourceVersion, pinned to the UID (F3)
#[tokio::test]
async fn replace_status_is_a_put_on_the_status_subresource_with_uid_and_resource_version() {
    let h = kube().await;
    let double = h.double.clone().unwrap();
    let v = h
        .store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let rev = Revision::of(&v).unwrap();
    double.clear_requests();
    let mut status = v.status_or_default();
    status.publication_generation = 1;
    h.store
        .replace_volume_status("vol-a", &rev, status.clone())
        .await
        .unwrap();
    let reqs = double.requests();
    assert_eq!(reqs.len(), 1, "{reqs:#?}");
    let r = &reqs[0];
    assert_eq!(r.method, "PUT");
    assert_eq!(r.path, format!("{BASE}/vol-a/status"));
    let body = r.body.as_ref().unwrap();
    assert_eq!(
        body["metadata"]["resourceVersion"],
        json!(rev.resource_version)
    );
    assert_eq!(body["metadata"]["uid"], json!(rev.uid));
    assert_eq!(body["metadata"]["name"], json!("vol-a"));
    assert_eq!(body["kind"], json!("PillarVolumeState"));
    assert_eq!(body["apiVersion"], json!("pillar-csi.io/v1alpha1"));
    assert_eq!(body["status"], serde_json::to_value(&status).unwrap());
    assert_eq!(body["status"]["publicationGeneration"], json!(1));
    assert!(
        body.get("spec").is_none(),
        "a status write sends no spec: {body}"
    );
}

#[tokio::test]
async fn delete_carries_uid_and_resource_version_preconditions() {
    let h = kube().await;
    let double = h.double.clone().unwrap();
    let v = h
        .store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let rev = Revision::of(&v).unwrap();
    double.clear_requests();
    h.store.delete_volume("vol-a", &rev).await.unwrap();
    let reqs = double.requests();
    assert_eq!(reqs.len(), 1, "{reqs:#?}");
    assert_eq!(reqs[0].method, "DELETE");
    assert_eq!(reqs[0].path, format!("{BASE}/vol-a"));
    assert_eq!(
        reqs[0].body.as_ref().unwrap()["preconditions"],
        json!({ "uid": rev.uid, "resourceVersion": rev.resource_version })
    );
}

// proves F10: the record is created on its own (no status), before anything else exists
#[tokio::test]
async fn create_posts_the_object_without_status_or_server_fields() {
    let h = kube().await;
    let double = h.double.clone().unwrap();
    h.store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let reqs = double.requests();
    assert_eq!(reqs.len(), 1, "{reqs:#?}");
    assert_eq!(reqs[0].method, "POST");
    assert_eq!(reqs[0].path, BASE);
    let body = reqs[0].body.as_ref().unwrap();
    assert_eq!(body["metadata"], json!({ "name": "vol-a" }));
    assert_eq!(
        body["spec"],
        serde_json::to_value(volume_spec("vol-a")).unwrap()
    );
    assert_eq!(body["spec"]["sizeBytes"], json!(1u64 << 30));
    assert!(body.get("status").is_none());
}

#[tokio::test]
async fn replace_spec_reads_then_puts_the_main_resource_with_the_expected_revision() {
    let h = kube().await;
    let double = h.double.clone().unwrap();
    let v = h
        .store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let rev = Revision::of(&v).unwrap();
    double.clear_requests();
    let mut spec = volume_spec("vol-a");
    spec.size_bytes *= 2;
    h.store
        .replace_volume_spec("vol-a", &rev, spec)
        .await
        .unwrap();
    let reqs = double.requests();
    let shape: Vec<(&str, &str)> = reqs
        .iter()
        .map(|r| (r.method.as_str(), r.path.as_str()))
        .collect();
    let one = format!("{BASE}/vol-a");
    assert_eq!(shape, [("GET", one.as_str()), ("PUT", one.as_str())]);
    let body = reqs[1].body.as_ref().unwrap();
    assert_eq!(
        body["metadata"]["resourceVersion"],
        json!(rev.resource_version)
    );
    assert_eq!(body["metadata"]["uid"], json!(rev.uid));
    assert_eq!(body["spec"]["sizeBytes"], json!(2u64 << 30));
}

#[tokio::test]
async fn agents_and_protocols_use_their_own_cluster_scoped_paths() {
    let h = kube().await;
    let double = h.double.clone().unwrap();
    h.store
        .create_agent("agent-1", crate::test_support::agent_spec("n"))
        .await
        .unwrap();
    h.store.get_agent("agent-1").await.unwrap();
    h.store.list_protocols().await.unwrap();
    let paths: Vec<String> = double.requests().into_iter().map(|r| r.path).collect();
    assert_eq!(
        paths,
        [
            "/apis/pillar-csi.io/v1alpha1/pillaragents",
            "/apis/pillar-csi.io/v1alpha1/pillaragents/agent-1",
            "/apis/pillar-csi.io/v1alpha1/pillarprotocols",
        ]
    );
}
