//! Events about volumes: what each store records, the `events.k8s.io/v1` object the KubeStore
//! creates, and the API server's rules for it as the double enforces them.

use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, PostParams};

use crate::apiserver_double::{ApiServerDouble, InjectedFailure};
use crate::kube_store::{EVENT_NAMESPACE, REPORTING_CONTROLLER, event_object};
use crate::store::{EventType, StoreError, VolumeEvent};
use crate::{EmbeddedStore, KubeStore, StateStore};

fn event(volume: &str) -> VolumeEvent {
    VolumeEvent {
        volume: volume.to_owned(),
        uid: "0b7c1f3e-0000-4000-8000-000000000001".into(),
        type_: EventType::Warning,
        reason: "AclDisabled".into(),
        action: "Publish".into(),
        note: "published under acl: false".into(),
        pv: None,
    }
}

// proves W6: the warning about acl: false reaches the embedded store's event list (single-
// machine mode), note bounded to 1 KiB.
#[tokio::test]
async fn the_embedded_store_keeps_events_in_order_with_bounded_notes() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path().join("state")).await.unwrap();
    store.record_volume_event(&event("vol-a")).await.unwrap();
    let mut long = event("vol-b");
    long.note = "é".repeat(1000);
    store.record_volume_event(&long).await.unwrap();
    let events = store.events();
    assert_eq!(events.len(), 2);
    assert_eq!(events[0], event("vol-a"));
    assert_eq!(events[1].volume, "vol-b");
    assert!(events[1].note.len() <= 1024 && events[1].note.len() >= 1022);
    assert!(matches!(
        store.record_volume_event(&event("Not/A/Name")).await,
        Err(StoreError::InvalidName { .. })
    ));
    // A clone (what a controller holds) shares the list.
    assert_eq!(store.clone().events().len(), 2);
}

// proves W6: the KubeStore creates an events.k8s.io/v1 Warning about the PillarVolumeState in
// `default`, and the double accepts it under the API server's validation.
#[tokio::test]
async fn the_kube_store_creates_an_events_k8s_io_event_about_the_volume() {
    let double = ApiServerDouble::start().await.unwrap();
    let store =
        KubeStore::new(double.controller_client().unwrap()).with_reporting_instance("controller-0");
    store.record_volume_event(&event("vol-a")).await.unwrap();
    let events = double.events();
    assert_eq!(events.len(), 1);
    let e = &events[0];
    assert_eq!(e["apiVersion"], "events.k8s.io/v1");
    assert_eq!(e["kind"], "Event");
    assert_eq!(e["metadata"]["namespace"], EVENT_NAMESPACE);
    assert!(
        e["metadata"]["name"]
            .as_str()
            .unwrap()
            .starts_with("vol-a.")
    );
    assert_eq!(e["type"], "Warning");
    assert_eq!(e["reason"], "AclDisabled");
    assert_eq!(e["action"], "Publish");
    assert_eq!(e["note"], "published under acl: false");
    assert_eq!(e["reportingController"], REPORTING_CONTROLLER);
    assert_eq!(e["reportingInstance"], "controller-0");
    assert!(e["eventTime"].is_string());
    assert_eq!(e["regarding"]["apiVersion"], "pillar-csi.io/v1alpha1");
    assert_eq!(e["regarding"]["kind"], "PillarVolumeState");
    assert_eq!(e["regarding"]["name"], "vol-a");
    assert_eq!(e["regarding"]["uid"], event("vol-a").uid);
    let posts: Vec<_> = double
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .map(|r| r.path)
        .collect();
    assert_eq!(
        posts,
        vec!["/apis/events.k8s.io/v1/namespaces/default/events"]
    );
    // Two events about one volume get two names.
    store.record_volume_event(&event("vol-a")).await.unwrap();
    let names: Vec<_> = double
        .events()
        .iter()
        .map(|e| e["metadata"]["name"].clone())
        .collect();
    assert_eq!(names.len(), 2);
    assert_ne!(names[0], names[1]);
}

// The double refuses what the API server refuses, so the KubeStore's event is checked against
// the real rules: an event about a cluster-scoped object outside default/kube-system, and an
// event missing reportingInstance or eventTime, are 422.
#[tokio::test]
async fn the_double_validates_events_like_the_api_server() {
    let double = ApiServerDouble::start().await.unwrap();
    let client = double.client().unwrap();
    let now = k8s_openapi::jiff::Timestamp::now();
    let good = event_object(&event("vol-a"), "controller-0", now);

    let elsewhere: Api<Event> = Api::namespaced(client.clone(), "pillar-system");
    let mut wrong_ns = good.clone();
    wrong_ns.metadata.namespace = Some("pillar-system".into());
    let err = elsewhere
        .create(&PostParams::default(), &wrong_ns)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422),
        "{err:?}"
    );

    let api: Api<Event> = Api::namespaced(client, "default");
    let mut no_instance = good.clone();
    no_instance.reporting_instance = None;
    let mut no_time = good.clone();
    no_time.event_time = None;
    let mut bad_type = good.clone();
    bad_type.type_ = Some("Error".into());
    for bad in [no_instance, no_time, bad_type] {
        let err = api.create(&PostParams::default(), &bad).await.unwrap_err();
        assert!(
            matches!(&err, kube::Error::Api(s) if s.code == 422),
            "{err:?}"
        );
    }
    assert!(double.events().is_empty());
    api.create(&PostParams::default(), &good).await.unwrap();
    let err = api.create(&PostParams::default(), &good).await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409),
        "{err:?}"
    );
    assert_eq!(double.events().len(), 1);
}

// An API server that refuses the event makes record_volume_event fail with the store's error
// (the controller logs it and goes on).
#[tokio::test]
async fn a_refused_event_is_an_error_for_the_caller_to_log() {
    let double = ApiServerDouble::start().await.unwrap();
    let store = KubeStore::new(double.controller_client().unwrap());
    double.inject_failure(InjectedFailure {
        method: http::Method::POST,
        path_suffix: "/events".into(),
        code: 403,
        reason: "Forbidden".into(),
        message: "events.events.k8s.io is forbidden".into(),
    });
    let err = store
        .record_volume_event(&event("vol-a"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Refused { kind: "Event", .. }),
        "{err:?}"
    );
    assert!(double.events().is_empty());
}
