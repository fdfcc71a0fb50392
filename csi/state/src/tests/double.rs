//! The API server double behaves as the real API server does for custom resources.

use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use serde_json::json;

use crate::apiserver_double::{ApiServerDouble, InjectedFailure};
use crate::crd::{PillarVolumeState, PillarVolumeStateStatus};
use crate::store::{Revision, StoreError};
use crate::test_support::volume_spec;
use crate::{KubeStore, StateStore};

async fn setup() -> (ApiServerDouble, Api<PillarVolumeState>) {
    let double = ApiServerDouble::start().await.unwrap();
    let api = Api::all(double.client().unwrap());
    (double, api)
}

fn status(generation: u64) -> PillarVolumeStateStatus {
    PillarVolumeStateStatus {
        published_nodes: vec![],
        publication_generation: generation,
        deleting: false,
        conditions: vec![],
    }
}

fn api_status(err: kube::Error) -> kube::core::Status {
    match err {
        kube::Error::Api(s) => *s,
        other => panic!("expected an API status, got {other:?}"),
    }
}

async fn created(api: &Api<PillarVolumeState>) -> PillarVolumeState {
    let mut v = PillarVolumeState::new("vol-a", volume_spec("vol-a"));
    v.status = Some(status(9));
    api.create(&PostParams::default(), &v).await.unwrap()
}

#[tokio::test]
async fn post_assigns_server_fields_and_drops_status() {
    let (double, api) = setup().await;
    let v = created(&api).await;
    assert_eq!(
        v.status, None,
        "create cannot set status when /status exists"
    );
    assert_eq!(v.metadata.generation, Some(1));
    assert!(v.metadata.uid.as_deref().is_some_and(|u| u.len() == 36));
    assert_eq!(v.metadata.resource_version.as_deref(), Some("1"));
    assert!(v.metadata.creation_timestamp.is_some());
    assert_eq!(double.resource_version(), 1);

    let mut again = PillarVolumeState::new("vol-a", volume_spec("vol-a"));
    let s = api_status(
        api.create(&PostParams::default(), &again)
            .await
            .unwrap_err(),
    );
    assert_eq!((s.code, s.reason.as_str()), (409, "AlreadyExists"));
    assert!(s.is_already_exists());
    assert_eq!(
        s.message,
        "pillarvolumestates.pillar-csi.io \"vol-a\" already exists"
    );
    again.metadata.name = Some("vol-b".into());
    again.metadata.resource_version = Some("5".into());
    let s = api_status(
        api.create(&PostParams::default(), &again)
            .await
            .unwrap_err(),
    );
    assert_eq!(s.code, 500, "{s:?}");
    assert_eq!(
        s.message,
        "resourceVersion should not be set on objects to be created"
    );
    assert_eq!(api.get_opt("vol-b").await.unwrap(), None);
}

#[tokio::test]
async fn put_main_resource_ignores_status_and_bumps_generation_on_spec_change() {
    let (_double, api) = setup().await;
    let v = created(&api).await;
    let v = api
        .replace_status("vol-a", &PostParams::default(), &{
            let mut v = v.clone();
            v.status = Some(status(1));
            v
        })
        .await
        .unwrap();
    let mut edit = v.clone();
    edit.spec.size_bytes = 5;
    edit.status = Some(status(77));
    edit.metadata.generation = Some(40);
    let out = api
        .replace("vol-a", &PostParams::default(), &edit)
        .await
        .unwrap();
    assert_eq!(out.spec.size_bytes, 5);
    assert_eq!(
        out.status,
        Some(status(1)),
        "status changes through the main resource are ignored"
    );
    assert_eq!(
        out.metadata.generation,
        Some(2),
        "generation is the server's, bumped once"
    );

    // A status-only change through the main resource is a no-op: same resourceVersion.
    let mut edit = out.clone();
    edit.status = Some(status(78));
    let same = api
        .replace("vol-a", &PostParams::default(), &edit)
        .await
        .unwrap();
    assert_eq!(same, out);
}

#[tokio::test]
async fn put_status_applies_only_the_status() {
    let (_double, api) = setup().await;
    let v = created(&api).await;
    let mut edit = v.clone();
    edit.spec.size_bytes = 5;
    edit.metadata.labels = Some([("a".to_string(), "b".to_string())].into());
    edit.status = Some(status(3));
    let out = api
        .replace_status("vol-a", &PostParams::default(), &edit)
        .await
        .unwrap();
    assert_eq!(out.status, Some(status(3)));
    assert_eq!(out.spec, v.spec, "spec changes through /status are ignored");
    assert_eq!(
        out.metadata.labels, None,
        "metadata changes through /status are ignored"
    );
    assert_eq!(out.metadata.generation, Some(1));
    assert_ne!(out.metadata.resource_version, v.metadata.resource_version);
}

#[tokio::test]
async fn put_without_resource_version_is_invalid_as_for_every_custom_resource() {
    let (_double, api) = setup().await;
    let v = created(&api).await;
    let mut edit = v.clone();
    edit.metadata.resource_version = None;
    edit.spec.size_bytes = 5;
    for result in [
        api.replace("vol-a", &PostParams::default(), &edit).await,
        api.replace_status("vol-a", &PostParams::default(), &edit)
            .await,
    ] {
        let s = api_status(result.unwrap_err());
        assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
        assert!(s.is_invalid());
        assert_eq!(
            s.message,
            "pillarvolumestates.pillar-csi.io \"vol-a\" is invalid: metadata.resourceVersion: \
             Invalid value: 0x0: must be specified for an update"
        );
    }
    assert_eq!(api.get("vol-a").await.unwrap(), v);
}

// proves F3: the API server itself refuses a write carrying another lifecycle's UID
#[tokio::test]
async fn put_with_another_uid_is_a_precondition_conflict() {
    let (_double, api) = setup().await;
    let v = created(&api).await;
    let mut edit = v.clone();
    edit.metadata.uid = Some("00000000-0000-4000-8000-000000000000".into());
    edit.status = Some(status(1));
    let s = api_status(
        api.replace_status("vol-a", &PostParams::default(), &edit)
            .await
            .unwrap_err(),
    );
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert!(
        s.message.contains(&format!(
            "Precondition failed: UID in precondition: 00000000-0000-4000-8000-000000000000, \
             UID in object meta: {}",
            v.metadata.uid.clone().unwrap()
        )),
        "{}",
        s.message
    );
    assert_eq!(api.get("vol-a").await.unwrap(), v);
}

#[tokio::test]
async fn stale_put_is_a_conflict() {
    let (_double, api) = setup().await;
    let v = created(&api).await;
    let mut edit = v.clone();
    edit.status = Some(status(1));
    let newer = api
        .replace_status("vol-a", &PostParams::default(), &edit)
        .await
        .unwrap();
    edit.status = Some(status(2));
    let s = api_status(
        api.replace_status("vol-a", &PostParams::default(), &edit)
            .await
            .unwrap_err(),
    );
    assert!(s.is_conflict());
    assert_eq!(
        s.message,
        "Operation cannot be fulfilled on pillarvolumestates.pillar-csi.io \"vol-a\": the object \
         has been modified; please apply your changes to the latest version and try again"
    );
    assert_eq!(api.get("vol-a").await.unwrap(), newer);
    let s = api_status(
        api.replace("absent", &PostParams::default(), &{
            let mut e = edit.clone();
            e.metadata.name = Some("absent".into());
            e
        })
        .await
        .unwrap_err(),
    );
    assert!(s.is_not_found(), "{s:?}");
}

#[tokio::test]
async fn delete_preconditions_and_absent_objects() {
    let (_double, api) = setup().await;
    let v = created(&api).await;
    let uid = v.metadata.uid.clone().unwrap();
    let dp = |uid: &str, rv: Option<&str>| DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(uid.to_owned()),
            resource_version: rv.map(str::to_owned),
        }),
        ..DeleteParams::default()
    };
    let s = api_status(
        api.delete("vol-a", &dp("other-uid", None))
            .await
            .unwrap_err(),
    );
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        s.message,
        format!(
            "Operation cannot be fulfilled on PillarVolumeState.pillar-csi.io \"vol-a\": the UID \
             in the precondition (other-uid) does not match the UID in record ({uid}). The object \
             might have been deleted and then recreated"
        )
    );
    let s = api_status(
        api.delete("vol-a", &dp(&uid, Some("999")))
            .await
            .unwrap_err(),
    );
    assert!(s.is_conflict());
    assert!(
        s.message
            .contains("the ResourceVersion in the precondition (999)"),
        "{}",
        s.message
    );
    assert_eq!(api.get("vol-a").await.unwrap(), v);

    api.delete("vol-a", &dp(&uid, v.metadata.resource_version.as_deref()))
        .await
        .unwrap();
    assert_eq!(api.get_opt("vol-a").await.unwrap(), None);
    let s = api_status(
        api.delete("vol-a", &DeleteParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!((s.code, s.reason.as_str()), (404, "NotFound"));
    assert_eq!(
        s.message,
        "pillarvolumestates.pillar-csi.io \"vol-a\" not found"
    );
}

#[tokio::test]
async fn list_carries_the_global_resource_version() {
    let (double, api) = setup().await;
    created(&api).await;
    let list = api.list(&Default::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    assert_eq!(
        list.metadata.resource_version,
        Some(double.resource_version().to_string())
    );
    assert_eq!(list.types.kind, "PillarVolumeStateList");
}

#[tokio::test]
async fn unknown_resources_and_mismatched_names_are_refused() {
    let (double, api) = setup().await;
    let v = created(&api).await;
    let s = api_status(
        api.replace("vol-b", &PostParams::default(), &v)
            .await
            .unwrap_err(),
    );
    assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"), "{s:?}");

    let client = double.client().unwrap();
    let req = http::Request::get("/apis/pillar-csi.io/v1alpha1/pillarwidgets")
        .body(Vec::new())
        .unwrap();
    let s = api_status(client.request_text(req).await.unwrap_err());
    assert_eq!(s.code, 404);
}

#[tokio::test]
async fn injected_failures_surface_through_kube_store() {
    let double = ApiServerDouble::start().await.unwrap();
    let store = KubeStore::new(double.client().unwrap());
    let v = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let rev = Revision::of(&v).unwrap();
    double.inject_failure(InjectedFailure {
        method: http::Method::PUT,
        path_suffix: "/vol-a/status".into(),
        code: 500,
        reason: "InternalError".into(),
        message: "etcd is down".into(),
    });
    let err = store
        .replace_volume_status("vol-a", &rev, status(1))
        .await
        .unwrap_err();
    match &err {
        StoreError::Refused { source, .. } => assert_eq!(source.code, 500),
        other => panic!("expected Refused, got {other:?}"),
    }
    // The failure was used once; the same write now succeeds.
    store
        .replace_volume_status("vol-a", &rev, status(1))
        .await
        .unwrap();
    assert_eq!(
        double.object("pillarvolumestates", "vol-a").unwrap()["status"],
        json!({ "publishedNodes": [], "publicationGeneration": 1, "deleting": false })
    );
}

// proves F10's premise: "no object" must mean the object is absent, not that the resource type
// is missing (a CRD not installed answers 404 without naming the object)
#[tokio::test]
async fn a_404_that_does_not_name_the_object_is_an_error_not_an_absent_volume() {
    let double = ApiServerDouble::start().await.unwrap();
    let store = KubeStore::new(double.client().unwrap());
    assert_eq!(store.get_volume("vol-a").await.unwrap(), None);
    double.inject_failure(InjectedFailure {
        method: http::Method::GET,
        path_suffix: "/pillarvolumestates/vol-a".into(),
        code: 404,
        reason: "NotFound".into(),
        message: "the server could not find the requested resource".into(),
    });
    let err = store.get_volume("vol-a").await.unwrap_err();
    assert!(matches!(err, StoreError::Refused { .. }), "{err:?}");
    assert!(!err.is_lifecycle_gone());
}

/// A raw API for pillar volume states, to send what the typed one cannot (unknown fields,
/// negative numbers, nulls).
fn raw_volumes(double: &ApiServerDouble) -> Api<kube::api::DynamicObject> {
    let resource = kube::api::ApiResource::erase::<PillarVolumeState>(&());
    Api::all_with(double.client().unwrap(), &resource)
}

fn raw_volume(spec: serde_json::Value) -> kube::api::DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "pillar-csi.io/v1alpha1",
        "kind": "PillarVolumeState",
        "metadata": { "name": "vol-raw" },
        "spec": spec,
    }))
    .unwrap()
}

// The CRD's structural schema, as the real server applies it: unknown fields are pruned and
// defaults filled in on create; a status write is validated too.
#[tokio::test]
async fn the_schema_prunes_unknown_fields_and_fills_defaults() {
    let double = ApiServerDouble::start().await.unwrap();
    let api = raw_volumes(&double);
    let mut spec = serde_json::to_value(volume_spec("vol-raw")).unwrap();
    spec["notAField"] = json!("dropped");
    spec.as_object_mut().unwrap().remove("parameters");
    api.create(&PostParams::default(), &raw_volume(spec))
        .await
        .unwrap();
    let stored = double.object("pillarvolumestates", "vol-raw").unwrap();
    assert!(stored["spec"].get("notAField").is_none(), "{stored}");
    assert_eq!(
        stored["spec"]["parameters"],
        json!({}),
        "the schema's default"
    );

    let typed: Api<PillarVolumeState> = Api::all(double.client().unwrap());
    let v = typed.get("vol-raw").await.unwrap();
    let mut raw = serde_json::to_value(&v).unwrap();
    raw["status"] = json!({ "publicationGeneration": -1 });
    let obj: kube::api::DynamicObject = serde_json::from_value(raw).unwrap();
    let s = api_status(
        api.replace_status("vol-raw", &PostParams::default(), &obj)
            .await
            .unwrap_err(),
    );
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"), "{s:?}");
    assert!(
        s.message.contains("status.publicationGeneration"),
        "{}",
        s.message
    );
}

// Validation, with every violation named: a negative size, an access mode outside the enum and
// a missing required field are one 422, and nothing is stored.
#[tokio::test]
async fn the_schema_refuses_invalid_objects_with_422() {
    let double = ApiServerDouble::start().await.unwrap();
    let api = raw_volumes(&double);
    let mut spec = serde_json::to_value(volume_spec("vol-raw")).unwrap();
    spec["sizeBytes"] = json!(-5);
    spec["accessMode"] = json!("EveryoneWrites");
    spec.as_object_mut().unwrap().remove("pool");
    let s = api_status(
        api.create(&PostParams::default(), &raw_volume(spec))
            .await
            .unwrap_err(),
    );
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"), "{s:?}");
    for field in ["spec.sizeBytes", "spec.accessMode", "spec.pool"] {
        assert!(s.message.contains(field), "{field} in {}", s.message);
    }
    assert!(double.object("pillarvolumestates", "vol-raw").is_none());
}

// While its storage initialises a real API server answers 429 with Retry-After; kube's client
// (as pillar's controller builds it) waits and retries, so a short spell of 429s delays a call
// rather than failing it. Each refused request reached the server.
#[tokio::test]
async fn a_429_is_retried_after_the_servers_delay() {
    let double = ApiServerDouble::start().await.unwrap();
    let store = KubeStore::new(double.controller_client().unwrap());
    double.answer_too_many_requests(2);
    double.clear_requests();
    let started = std::time::Instant::now();
    assert!(store.list_volumes().await.unwrap().is_empty());
    assert_eq!(double.requests().len(), 3, "two refused, then served");
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(2),
        "Retry-After: 1 honoured"
    );
}
