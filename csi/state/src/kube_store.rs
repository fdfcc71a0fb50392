//! [`KubeStore`]: the store over the Kubernetes API, through kube-rs: one `ObjectApi<K>` for
//! every kind. The compare-and-swap rules are the API server's own.
//!
//! Request shapes (what the API server enforces, and what the test double checks):
//! - create: `POST /apis/pillar-csi.io/v1alpha1/<plural>` with the object (no status: the server
//!   drops it anyway). 409 `AlreadyExists` -> [`StoreError::AlreadyExists`].
//! - status write: `PUT .../pillarvolumestates/<name>/status` whose body carries
//!   `metadata.uid` (a UID precondition on the real server) and `metadata.resourceVersion` (the
//!   optimistic lock). 409 with a UID precondition message -> [`StoreError::UidMismatch`], other
//!   409 -> [`StoreError::Conflict`], 404 -> [`StoreError::NotFound`].
//! - spec write: `GET` then `PUT .../<plural>/<name>` of the object read, with the new spec and
//!   the expected uid and resourceVersion, so labels and annotations survive and the write is
//!   still conditional on the expected revision.
//! - delete: `DELETE .../<plural>/<name>` with `DeleteOptions.preconditions` `{uid,
//!   resourceVersion}`.
//! - event: `POST /apis/events.k8s.io/v1/namespaces/default/events`, an `events.k8s.io/v1`
//!   Event whose `regarding` names the PillarVolumeState (kind, name, uid). A cluster-scoped
//!   object's events live in `default`, the namespace the API server accepts for them (and
//!   kube-runtime's recorder uses); `kubectl describe` finds them there. Best-effort: the
//!   caller logs a failure.
//! - credentials: nodes' DH-HMAC-CHAP pairs in Secrets of pillar's namespace
//!   (`kube_credentials`): `GET`, `POST`, `PUT` under `/api/v1/namespaces/<ns>/secrets`.

use std::fmt;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::core::Status;

use crate::crd::PillarVolumeState;
use crate::store::{
    ObjectApi, PillarObject, Revision, StateStore, StoreError, VolumeEvent, validate_name,
};

/// The namespace events about pillar's cluster-scoped objects are created in.
pub const EVENT_NAMESPACE: &str = "default";
/// `reportingController` of pillar's events.
pub const REPORTING_CONTROLLER: &str = "pillar-csi.io/controller";
/// `reportingInstance` when none was set ([`KubeStore::with_reporting_instance`]).
pub const DEFAULT_REPORTING_INSTANCE: &str = "pillar-csi-controller";
/// The API server's limit on `reportingInstance`, `action` and `reason`.
const EVENT_FIELD_LIMIT: usize = 128;

/// The store backed by the Kubernetes API.
#[derive(Clone)]
pub struct KubeStore {
    client: kube::Client,
    reporting_instance: String,
    /// Where nodes' credentials Secrets live (`kube_credentials`): pillar's namespace.
    credentials_namespace: String,
}

impl fmt::Debug for KubeStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeStore")
            .field("default_namespace", &self.client.default_namespace())
            .field("reporting_instance", &self.reporting_instance)
            .field("credentials_namespace", &self.credentials_namespace)
            .finish_non_exhaustive()
    }
}

/// `s` cut at a character boundary to at most `limit` bytes.
fn cut(s: &str, limit: usize) -> &str {
    let mut end = s.len().min(limit);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The `events.k8s.io/v1` Event for `event`, stamped `now`. Its name is the volume's with a
/// random suffix, as the API server's own recorders name theirs.
pub fn event_object(
    event: &VolumeEvent,
    reporting_instance: &str,
    now: k8s_openapi::jiff::Timestamp,
) -> Event {
    type K = PillarVolumeState;
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let prefix = cut(&event.volume, 253 - suffix.len() - 1).trim_end_matches(['.', '-']);
    Event {
        metadata: ObjectMeta {
            name: Some(format!("{prefix}.{suffix}")),
            namespace: Some(EVENT_NAMESPACE.to_owned()),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(now)),
        reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
        reporting_instance: Some(cut(reporting_instance, EVENT_FIELD_LIMIT).to_owned()),
        action: Some(cut(&event.action, EVENT_FIELD_LIMIT).to_owned()),
        reason: Some(cut(&event.reason, EVENT_FIELD_LIMIT).to_owned()),
        type_: Some(event.type_.as_str().to_owned()),
        note: Some(event.bounded_note().to_owned()),
        regarding: Some(ObjectReference {
            api_version: Some(crate::crd::API_VERSION.to_owned()),
            kind: Some(K::KIND.to_owned()),
            name: Some(event.volume.clone()),
            uid: Some(event.uid.clone()),
            ..ObjectReference::default()
        }),
        ..Event::default()
    }
}

/// The same event about the PersistentVolume `pv` (core v1, cluster-scoped, so also in
/// [`EVENT_NAMESPACE`]), with the PillarVolumeState as the related object.
pub fn pv_event_object(
    event: &VolumeEvent,
    pv: &str,
    reporting_instance: &str,
    now: k8s_openapi::jiff::Timestamp,
) -> Event {
    let mut obj = event_object(event, reporting_instance, now);
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let prefix = cut(pv, 253 - suffix.len() - 1).trim_end_matches(['.', '-']);
    obj.metadata.name = Some(format!("{prefix}.{suffix}"));
    obj.related = obj.regarding.take();
    obj.regarding = Some(ObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("PersistentVolume".to_owned()),
        name: Some(pv.to_owned()),
        ..ObjectReference::default()
    });
    obj
}

/// What an API failure means for one operation.
#[derive(Clone, Copy)]
enum Verb {
    Get,
    List,
    Create,
    Replace,
    ReplaceStatus,
    Delete,
}

impl Verb {
    fn as_str(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::List => "list",
            Self::Create => "create",
            Self::Replace => "replace",
            Self::ReplaceStatus => "replace the status of",
            Self::Delete => "delete",
        }
    }
}

/// Whether a 409's message is the API server's UID precondition failure. Two texts exist:
/// `rest.BeforeDelete` says "the UID in the precondition (..) does not match the UID in record
/// (..)", the storage layer says "Precondition failed: UID in precondition: .., UID in object
/// meta: ..".
fn is_uid_precondition_failure(status: &Status) -> bool {
    status.message.contains("UID in the precondition")
        || status.message.contains("UID in precondition")
}

/// Whether a 404 says that this object is absent, as opposed to the resource type (a CRD not
/// installed, a wrong path) or a proxy answering 404. Only the former may read as "no such
/// volume": a missing CRD must fail closed rather than look like an empty store. The registry's
/// NotFound names the object in `details.name`.
fn is_object_not_found(status: &Status, name: &str) -> bool {
    status.is_not_found()
        && !name.is_empty()
        && status.details.as_ref().is_some_and(|d| d.name == name)
}

impl KubeStore {
    /// A store using `client`: cluster-scoped requests for pillar's records; nodes'
    /// credentials Secrets in the client's namespace (in a pod: its ServiceAccount's, pillar's
    /// own) unless [`Self::with_credentials_namespace`] names another.
    pub fn new(client: kube::Client) -> Self {
        let credentials_namespace = client.default_namespace().to_owned();
        Self {
            client,
            reporting_instance: DEFAULT_REPORTING_INSTANCE.to_owned(),
            credentials_namespace,
        }
    }

    /// The same store, keeping nodes' credentials Secrets in `namespace`.
    pub fn with_credentials_namespace(mut self, namespace: &str) -> Self {
        namespace.clone_into(&mut self.credentials_namespace);
        self
    }

    pub(crate) fn client(&self) -> &kube::Client {
        &self.client
    }

    pub(crate) fn credentials_namespace(&self) -> &str {
        &self.credentials_namespace
    }

    /// The same store, naming `instance` (for example the pod's name) as the `reportingInstance`
    /// of its events. An empty name keeps the default.
    pub fn with_reporting_instance(mut self, instance: &str) -> Self {
        if !instance.is_empty() {
            self.reporting_instance = cut(instance, EVENT_FIELD_LIMIT).to_owned();
        }
        self
    }

    fn api<K: PillarObject>(&self) -> Api<K> {
        Api::all(self.client.clone())
    }

    fn map_err<K: PillarObject>(
        verb: Verb,
        name: &str,
        expected: Option<&Revision>,
        err: kube::Error,
    ) -> StoreError {
        let name = name.to_owned();
        match err {
            kube::Error::Api(status) => {
                if is_object_not_found(&status, &name) {
                    StoreError::NotFound {
                        kind: K::KIND,
                        name,
                    }
                } else if status.is_already_exists() && matches!(verb, Verb::Create) {
                    StoreError::AlreadyExists {
                        kind: K::KIND,
                        name,
                    }
                } else if status.is_conflict() && is_uid_precondition_failure(&status) {
                    StoreError::UidMismatch {
                        kind: K::KIND,
                        name,
                        expected: expected.map(|e| e.uid.clone()).unwrap_or_default(),
                        message: status.message,
                    }
                } else if status.is_conflict() && expected.is_some() {
                    StoreError::Conflict {
                        kind: K::KIND,
                        name,
                        expected: expected
                            .map(|e| e.resource_version.clone())
                            .unwrap_or_default(),
                        message: status.message,
                    }
                } else {
                    StoreError::Refused {
                        verb: verb.as_str(),
                        kind: K::KIND,
                        name,
                        source: status,
                    }
                }
            }
            source => StoreError::Kube {
                verb: verb.as_str(),
                kind: K::KIND,
                name,
                source,
            },
        }
    }

    async fn get<K: PillarObject>(&self, name: &str) -> Result<Option<K>, StoreError> {
        validate_name(K::KIND, name)?;
        match self.api::<K>().get(name).await {
            Ok(obj) => Ok(Some(obj)),
            Err(e) => match Self::map_err::<K>(Verb::Get, name, None, e) {
                StoreError::NotFound { .. } => Ok(None),
                other => Err(other),
            },
        }
    }

    async fn list<K: PillarObject>(&self) -> Result<Vec<K>, StoreError> {
        let mut items = self
            .api::<K>()
            .list(&ListParams::default())
            .await
            .map_err(|e| Self::map_err::<K>(Verb::List, "", None, e))?
            .items;
        items.sort_by(|a, b| a.meta().name.cmp(&b.meta().name));
        Ok(items)
    }

    async fn create<K: PillarObject>(&self, name: &str, spec: K::Spec) -> Result<K, StoreError> {
        validate_name(K::KIND, name)?;
        let obj = K::build(name, spec);
        let created = self
            .api::<K>()
            .create(&PostParams::default(), &obj)
            .await
            .map_err(|e| Self::map_err::<K>(Verb::Create, name, None, e))?;
        tracing::debug!(kind = K::KIND, name, uid = ?created.meta().uid, "created");
        Ok(created)
    }

    /// Replaces the status subresource of `name` if it is still `expected`.
    async fn replace_status<K: PillarObject>(
        &self,
        name: &str,
        expected: &Revision,
        status: &(impl serde::Serialize + Sync),
    ) -> Result<K, StoreError> {
        validate_name(K::KIND, name)?;
        // Status-only body: the status strategy ignores everything but `status`, and the UID in
        // metadata is a precondition.
        let body = serde_json::json!({
            "apiVersion": crate::crd::API_VERSION,
            "kind": K::KIND,
            "metadata": {
                "name": name,
                "uid": expected.uid,
                "resourceVersion": expected.resource_version,
            },
            "status": status,
        });
        self.api::<K>()
            .replace_subresource("status", name, &PostParams::default(), &body)
            .await
            .map_err(|e| Self::map_err::<K>(Verb::ReplaceStatus, name, Some(expected), e))
    }

    async fn replace_spec<K: PillarObject>(
        &self,
        name: &str,
        expected: &Revision,
        spec: K::Spec,
    ) -> Result<K, StoreError> {
        validate_name(K::KIND, name)?;
        let mut obj = self
            .get::<K>(name)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                kind: K::KIND,
                name: name.to_owned(),
            })?;
        // The PUT below carries `expected`, not what was just read, so it is conditional on the
        // caller's revision whatever happened in between; reading first only keeps labels and
        // annotations.
        obj.set_spec(spec);
        let meta = obj.meta_mut();
        meta.uid = Some(expected.uid.clone());
        meta.resource_version = Some(expected.resource_version.clone());
        meta.managed_fields = None;
        self.api::<K>()
            .replace(name, &PostParams::default(), &obj)
            .await
            .map_err(|e| Self::map_err::<K>(Verb::Replace, name, Some(expected), e))
    }

    async fn delete<K: PillarObject>(
        &self,
        name: &str,
        expected: &Revision,
    ) -> Result<(), StoreError> {
        validate_name(K::KIND, name)?;
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(expected.uid.clone()),
                resource_version: Some(expected.resource_version.clone()),
            }),
            ..DeleteParams::default()
        };
        self.api::<K>()
            .delete(name, &dp)
            .await
            .map_err(|e| Self::map_err::<K>(Verb::Delete, name, Some(expected), e))?;
        tracing::debug!(kind = K::KIND, name, uid = %expected.uid, "deleted");
        Ok(())
    }
}

impl KubeStore {
    async fn create_event(&self, event: &VolumeEvent, obj: Event) -> Result<(), StoreError> {
        let name = obj.metadata.name.clone().unwrap_or_default();
        let api: Api<Event> = Api::namespaced(self.client.clone(), EVENT_NAMESPACE);
        match api.create(&PostParams::default(), &obj).await {
            Ok(_) => {
                tracing::debug!(volume = %event.volume, event = %name, reason = %event.reason, "event recorded");
                Ok(())
            }
            Err(kube::Error::Api(status)) => Err(StoreError::Refused {
                verb: "create",
                kind: "Event",
                name,
                source: status,
            }),
            Err(source) => Err(StoreError::Kube {
                verb: "create",
                kind: "Event",
                name,
                source,
            }),
        }
    }
}

#[async_trait]
impl<K: PillarObject> ObjectApi<K> for KubeStore {
    async fn get(&self, name: &str) -> Result<Option<K>, StoreError> {
        KubeStore::get(self, name).await
    }
    async fn list(&self) -> Result<Vec<K>, StoreError> {
        KubeStore::list(self).await
    }
    async fn create(&self, name: &str, spec: K::Spec) -> Result<K, StoreError> {
        KubeStore::create(self, name, spec).await
    }
    async fn replace_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: K::Spec,
    ) -> Result<K, StoreError> {
        KubeStore::replace_spec(self, name, expected, spec).await
    }
    async fn replace_status(
        &self,
        name: &str,
        expected: &Revision,
        status: K::Status,
    ) -> Result<K, StoreError> {
        KubeStore::replace_status(self, name, expected, &status).await
    }
    async fn delete(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        KubeStore::delete::<K>(self, name, expected).await
    }
}

#[async_trait]
impl StateStore for KubeStore {
    async fn record_volume_event(&self, event: &VolumeEvent) -> Result<(), StoreError> {
        validate_name(PillarVolumeState::KIND, &event.volume)?;
        let now = k8s_openapi::jiff::Timestamp::now();
        self.create_event(event, event_object(event, &self.reporting_instance, now))
            .await?;
        if let Some(pv) = &event.pv {
            self.create_event(
                event,
                pv_event_object(event, pv, &self.reporting_instance, now),
            )
            .await?;
        }
        Ok(())
    }

    async fn node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<crate::credentials::NodeCredentials, StoreError> {
        self.credentials(node, host_nqn, false).await
    }

    async fn rotate_node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<crate::credentials::NodeCredentials, StoreError> {
        self.credentials(node, host_nqn, true).await
    }

    async fn stored_node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<Option<crate::credentials::NodeCredentials>, StoreError> {
        self.stored_credentials(node, host_nqn).await
    }
}
