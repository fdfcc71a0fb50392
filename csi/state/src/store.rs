//! The store the CSI controller keeps its records in, with explicit compare-and-swap.
//!
//! Every write that changes an existing object names the [`Revision`] it expects: the object's
//! UID (one lifecycle of the name, F3) and its resourceVersion. A stale resourceVersion is
//! [`StoreError::Conflict`]; an object of another lifecycle is [`StoreError::UidMismatch`] (or
//! [`StoreError::NotFound`] when the name is gone). Nothing is ever overwritten blindly: the caller
//! re-reads and retries, or reports ABORTED.
//!
//! The store is generic over the kind, as kube's `Api<K>` is: [`ObjectApi<K>`] (get, list,
//! create, replace spec, replace status, delete) for any [`PillarObject`] `K`, and
//! [`StateStore`] is every kind's `ObjectApi` plus where volume events go, with the controller's
//! per-kind shorthands (`get_volume`, `replace_volume_status`, ...) as provided methods.
//!
//! Adapters: [`KubeStore`](crate::kube_store::KubeStore) over the Kubernetes API,
//! [`EmbeddedStore`](crate::embedded::EmbeddedStore) on a local directory for single-machine mode,
//! and [`MemoryStore`](crate::memory::MemoryStore) in memory (the simulation, tests). The last two
//! (and the API server test double) apply the compare-and-swap rules of [`core`](crate::core),
//! written once; the first gets them from the API server.

use std::convert::Infallible;
use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;

use async_trait::async_trait;

use crate::crd::{
    PillarAgent, PillarAgentSpec, PillarAgentStatus, PillarProtocol, PillarProtocolSpec,
    PillarSnapshotState, PillarSnapshotStateSpec, PillarSnapshotStateStatus, PillarVolumeState,
    PillarVolumeStateSpec, PillarVolumeStateStatus,
};
pub use crate::object::PillarObject;

/// The object a compare-and-swap expects to find: one lifecycle (UID) at one resourceVersion.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Revision {
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.resourceVersion`.
    pub resource_version: String,
}

impl Revision {
    /// The revision of an object read from a store.
    pub fn of<K: PillarObject>(obj: &K) -> Result<Self, StoreError> {
        let meta = obj.meta();
        let name = meta.name.clone().unwrap_or_default();
        let kind = K::KIND;
        let uid = meta.uid.clone().filter(|u| !u.is_empty()).ok_or_else(|| {
            StoreError::MissingMetadata {
                kind,
                name: name.clone(),
                field: "uid",
            }
        })?;
        let resource_version = meta
            .resource_version
            .clone()
            .filter(|v| !v.is_empty())
            .ok_or(StoreError::MissingMetadata {
                kind,
                name,
                field: "resourceVersion",
            })?;
        Ok(Self {
            uid,
            resource_version,
        })
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The name is not a DNS-1123 subdomain (what Kubernetes requires of these objects' names).
    #[error("{kind} name {name:?} is invalid: {reason}")]
    InvalidName {
        /// Object kind.
        kind: &'static str,
        /// The rejected name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// No object of that name.
    #[error("{kind} {name:?} not found")]
    NotFound {
        /// Object kind.
        kind: &'static str,
        /// Object name.
        name: String,
    },
    /// Create found an object of that name.
    #[error("{kind} {name:?} already exists")]
    AlreadyExists {
        /// Object kind.
        kind: &'static str,
        /// Object name.
        name: String,
    },
    /// The object changed since the expected resourceVersion: re-read and retry, or abort.
    #[error("{kind} {name:?} changed since resourceVersion {expected}: {message}")]
    Conflict {
        /// Object kind.
        kind: &'static str,
        /// Object name.
        name: String,
        /// The resourceVersion the caller expected.
        expected: String,
        /// What the store said.
        message: String,
    },
    /// The name now belongs to another lifecycle (deleted and re-created): the operation that
    /// started on the old UID must not touch it (F3).
    #[error("{kind} {name:?} is not lifecycle {expected}: {message}")]
    UidMismatch {
        /// Object kind.
        kind: &'static str,
        /// Object name.
        name: String,
        /// The UID the caller expected.
        expected: String,
        /// What the store said.
        message: String,
    },
    /// An object handed to [`Revision::of`] lacks a field every stored object has.
    #[error("{kind} {name:?} has no metadata.{field}: it was not read from a store")]
    MissingMetadata {
        /// Object kind.
        kind: &'static str,
        /// Object name.
        name: String,
        /// The missing field.
        field: &'static str,
    },
    /// The Kubernetes API answered with a failure status not covered above (Invalid, Forbidden,
    /// an internal error, ...).
    #[error("the Kubernetes API refused to {verb} {kind} {name:?}")]
    Refused {
        /// What was attempted.
        verb: &'static str,
        /// Object kind.
        kind: &'static str,
        /// Object name (empty for a list).
        name: String,
        /// The API server's status.
        #[source]
        source: Box<kube::core::Status>,
    },
    /// The request to the Kubernetes API did not complete (connection, TLS, decoding, ...).
    #[error("the Kubernetes API request to {verb} {kind} {name:?} failed")]
    Kube {
        /// What was attempted.
        verb: &'static str,
        /// Object kind.
        kind: &'static str,
        /// Object name (empty for a list).
        name: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// A record did not convert between its kind and the JSON the in-memory store keeps it as.
    #[error("a {kind} record does not convert to or from JSON")]
    Json {
        /// Object kind.
        kind: &'static str,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// The embedded store failed on disk.
    #[error(transparent)]
    Embedded(#[from] crate::embedded_error::EmbeddedError),
    /// This store keeps no DH-HMAC-CHAP credentials (W10): a store that implements none (every
    /// store of pillar's keeps them; a test's or an adapter's may not).
    #[error(
        "this controller's store keeps no DH-HMAC-CHAP credentials, so node {node} cannot be \
         admitted to an export that requires authentication (W10); refusing rather than \
         admitting it on its host NQN alone"
    )]
    NoCredentials {
        /// The node.
        node: String,
    },
}

/// A node's credentials could not be read or made: the store's own failure on disk or in the
/// OS's randomness, as every store reports it.
impl From<crate::credentials::CredentialsError> for StoreError {
    fn from(e: crate::credentials::CredentialsError) -> Self {
        Self::Embedded(crate::embedded_error::EmbeddedError::Credentials(e))
    }
}

impl From<Infallible> for StoreError {
    fn from(never: Infallible) -> Self {
        match never {}
    }
}

impl StoreError {
    /// A stale resourceVersion: the caller should re-read and try again (the re-read may show a
    /// new lifecycle, which is then an abort).
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::Conflict { .. })
    }

    /// The object the operation started on is gone: deleted, or replaced by another lifecycle.
    pub fn is_lifecycle_gone(&self) -> bool {
        matches!(self, Self::NotFound { .. } | Self::UidMismatch { .. })
    }
}

/// The type of a Kubernetes Event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventType {
    /// Nothing is wrong.
    Normal,
    /// Something an operator should look at.
    Warning,
}

impl EventType {
    /// The Event's `type`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "Normal",
            Self::Warning => "Warning",
        }
    }
}

/// A Kubernetes Event about one PillarVolumeState (`kubectl describe pillarvol <name>` shows
/// it). Recording one is best-effort: the caller logs a failure and goes on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeEvent {
    /// The PillarVolumeState's name.
    pub volume: String,
    /// Its `metadata.uid`: the lifecycle the event is about.
    pub uid: String,
    /// Normal or Warning.
    pub type_: EventType,
    /// CamelCase, machine-readable (at most 128 characters), for example `AclDisabled`.
    pub reason: String,
    /// What the controller did, CamelCase (at most 128 characters), for example `Publish`.
    pub action: String,
    /// For humans; cut to 1 KiB. Never a request or a secret.
    pub note: String,
    /// The PersistentVolume the sidecars named for the volume (CreateVolume parameter
    /// [`PV_NAME_PARAMETER`]), if any: the event is recorded about it too, so `kubectl describe
    /// pv` shows it.
    pub pv: Option<String>,
}

/// The CreateVolume parameter external-provisioner sets to the PersistentVolume's name (with
/// `--extra-create-metadata`).
pub const PV_NAME_PARAMETER: &str = "csi.storage.k8s.io/pv/name";

/// The most a note may hold (`events.k8s.io/v1` refuses longer ones).
pub const EVENT_NOTE_LIMIT: usize = 1024;

impl VolumeEvent {
    /// The note, cut at a character boundary to at most [`EVENT_NOTE_LIMIT`] bytes.
    pub fn bounded_note(&self) -> &str {
        let mut end = self.note.len().min(EVENT_NOTE_LIMIT);
        while !self.note.is_char_boundary(end) {
            end -= 1;
        }
        &self.note[..end]
    }
}

/// A boxed future of a store call, as the typed shorthands of [`StateStore`] return.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// Compare-and-swap access to the records of one kind `K`, as kube's `Api<K>` offers it.
///
/// Objects come back with `metadata.uid` and `metadata.resourceVersion` set; pass
/// [`Revision::of`] of what you read to any write. Every adapter follows the rules of
/// [`core`](crate::core), the API server's: a create never writes a status, a status write never
/// changes the spec, a spec write never changes the status, and a write that changes nothing
/// keeps the resourceVersion.
#[async_trait]
pub trait ObjectApi<K: PillarObject>: Send + Sync {
    /// One object, or `None`.
    async fn get(&self, name: &str) -> Result<Option<K>, StoreError>;
    /// Every object of the kind, ordered by name.
    async fn list(&self) -> Result<Vec<K>, StoreError>;
    /// Creates an object with no status. [`StoreError::AlreadyExists`] if the name is taken.
    async fn create(&self, name: &str, spec: K::Spec) -> Result<K, StoreError>;
    /// Replaces the spec if the object is still `expected`; the status is untouched.
    async fn replace_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: K::Spec,
    ) -> Result<K, StoreError>;
    /// Replaces the status if the object is still `expected`; the spec is untouched.
    async fn replace_status(
        &self,
        name: &str,
        expected: &Revision,
        status: K::Status,
    ) -> Result<K, StoreError>;
    /// Deletes the object if it is still `expected`.
    async fn delete(&self, name: &str, expected: &Revision) -> Result<(), StoreError>;
}

/// Every kind's [`ObjectApi`] and the volume events: what the controller keeps its records in.
///
/// An adapter writes its `ObjectApi<K>` once, for any `K`, and here only where its events go;
/// the per-kind methods are shorthands for the controller's call sites.
#[async_trait]
pub trait StateStore:
    ObjectApi<PillarVolumeState>
    + ObjectApi<PillarSnapshotState>
    + ObjectApi<PillarAgent>
    + ObjectApi<PillarProtocol>
    + Debug
{
    /// Records an Event about a volume. Best-effort for the caller: a failure is for the log,
    /// never a reason to fail the operation the event reports.
    async fn record_volume_event(&self, event: &VolumeEvent) -> Result<(), StoreError>;

    /// The DH-HMAC-CHAP credentials of `node` presenting `host_nqn` (W10), made the first time
    /// they are asked for (and again when the node's host NQN changed). Only the controller
    /// reads them; they go to the agent in grants and exports, never to a record's status.
    async fn node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<crate::credentials::NodeCredentials, StoreError> {
        let _ = host_nqn;
        Err(StoreError::NoCredentials {
            node: node.to_owned(),
        })
    }

    /// The DH-HMAC-CHAP credentials stored for `node` presenting `host_nqn`, if any: a read
    /// that never makes or replaces a pair (the delivery of a node's pair to that node reads;
    /// only ControllerPublish and rotation write). `None` when no pair is stored or it was
    /// made for another host NQN.
    async fn stored_node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<Option<crate::credentials::NodeCredentials>, StoreError> {
        let _ = host_nqn;
        Err(StoreError::NoCredentials {
            node: node.to_owned(),
        })
    }

    /// Replaces `node`'s credentials with new ones (rotation); the old ones stop working once
    /// every agent holding them got the new ones.
    async fn rotate_node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<crate::credentials::NodeCredentials, StoreError> {
        let _ = host_nqn;
        Err(StoreError::NoCredentials {
            node: node.to_owned(),
        })
    }

    /// [`ObjectApi::get`] of a volume.
    fn get_volume<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<PillarVolumeState>> {
        ObjectApi::<PillarVolumeState>::get(self, name)
    }
    /// [`ObjectApi::list`] of volumes.
    fn list_volumes(&self) -> StoreFuture<'_, Vec<PillarVolumeState>> {
        ObjectApi::<PillarVolumeState>::list(self)
    }
    /// [`ObjectApi::create`] of a volume.
    fn create_volume<'a>(
        &'a self,
        name: &'a str,
        spec: PillarVolumeStateSpec,
    ) -> StoreFuture<'a, PillarVolumeState> {
        ObjectApi::<PillarVolumeState>::create(self, name, spec)
    }
    /// [`ObjectApi::replace_status`] of a volume.
    fn replace_volume_status<'a>(
        &'a self,
        name: &'a str,
        expected: &'a Revision,
        status: PillarVolumeStateStatus,
    ) -> StoreFuture<'a, PillarVolumeState> {
        ObjectApi::<PillarVolumeState>::replace_status(self, name, expected, status)
    }
    /// [`ObjectApi::replace_spec`] of a volume.
    fn replace_volume_spec<'a>(
        &'a self,
        name: &'a str,
        expected: &'a Revision,
        spec: PillarVolumeStateSpec,
    ) -> StoreFuture<'a, PillarVolumeState> {
        ObjectApi::<PillarVolumeState>::replace_spec(self, name, expected, spec)
    }
    /// [`ObjectApi::delete`] of a volume.
    fn delete_volume<'a>(&'a self, name: &'a str, expected: &'a Revision) -> StoreFuture<'a, ()> {
        ObjectApi::<PillarVolumeState>::delete(self, name, expected)
    }

    /// [`ObjectApi::get`] of a snapshot.
    fn get_snapshot<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<PillarSnapshotState>> {
        ObjectApi::<PillarSnapshotState>::get(self, name)
    }
    /// [`ObjectApi::list`] of snapshots.
    fn list_snapshots(&self) -> StoreFuture<'_, Vec<PillarSnapshotState>> {
        ObjectApi::<PillarSnapshotState>::list(self)
    }
    /// [`ObjectApi::create`] of a snapshot.
    fn create_snapshot<'a>(
        &'a self,
        name: &'a str,
        spec: PillarSnapshotStateSpec,
    ) -> StoreFuture<'a, PillarSnapshotState> {
        ObjectApi::<PillarSnapshotState>::create(self, name, spec)
    }
    /// [`ObjectApi::replace_status`] of a snapshot.
    fn replace_snapshot_status<'a>(
        &'a self,
        name: &'a str,
        expected: &'a Revision,
        status: PillarSnapshotStateStatus,
    ) -> StoreFuture<'a, PillarSnapshotState> {
        ObjectApi::<PillarSnapshotState>::replace_status(self, name, expected, status)
    }
    /// [`ObjectApi::delete`] of a snapshot.
    fn delete_snapshot<'a>(&'a self, name: &'a str, expected: &'a Revision) -> StoreFuture<'a, ()> {
        ObjectApi::<PillarSnapshotState>::delete(self, name, expected)
    }

    /// [`ObjectApi::get`] of an agent.
    fn get_agent<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<PillarAgent>> {
        ObjectApi::<PillarAgent>::get(self, name)
    }
    /// [`ObjectApi::list`] of agents.
    fn list_agents(&self) -> StoreFuture<'_, Vec<PillarAgent>> {
        ObjectApi::<PillarAgent>::list(self)
    }
    /// [`ObjectApi::create`] of an agent.
    fn create_agent<'a>(
        &'a self,
        name: &'a str,
        spec: PillarAgentSpec,
    ) -> StoreFuture<'a, PillarAgent> {
        ObjectApi::<PillarAgent>::create(self, name, spec)
    }
    /// [`ObjectApi::replace_spec`] of an agent.
    fn replace_agent_spec<'a>(
        &'a self,
        name: &'a str,
        expected: &'a Revision,
        spec: PillarAgentSpec,
    ) -> StoreFuture<'a, PillarAgent> {
        ObjectApi::<PillarAgent>::replace_spec(self, name, expected, spec)
    }
    /// [`ObjectApi::replace_status`] of an agent.
    fn replace_agent_status<'a>(
        &'a self,
        name: &'a str,
        expected: &'a Revision,
        status: PillarAgentStatus,
    ) -> StoreFuture<'a, PillarAgent> {
        ObjectApi::<PillarAgent>::replace_status(self, name, expected, status)
    }
    /// [`ObjectApi::delete`] of an agent.
    fn delete_agent<'a>(&'a self, name: &'a str, expected: &'a Revision) -> StoreFuture<'a, ()> {
        ObjectApi::<PillarAgent>::delete(self, name, expected)
    }

    /// [`ObjectApi::get`] of a protocol.
    fn get_protocol<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<PillarProtocol>> {
        ObjectApi::<PillarProtocol>::get(self, name)
    }
    /// [`ObjectApi::list`] of protocols.
    fn list_protocols(&self) -> StoreFuture<'_, Vec<PillarProtocol>> {
        ObjectApi::<PillarProtocol>::list(self)
    }
    /// [`ObjectApi::create`] of a protocol.
    fn create_protocol<'a>(
        &'a self,
        name: &'a str,
        spec: PillarProtocolSpec,
    ) -> StoreFuture<'a, PillarProtocol> {
        ObjectApi::<PillarProtocol>::create(self, name, spec)
    }
    /// [`ObjectApi::replace_spec`] of a protocol.
    fn replace_protocol_spec<'a>(
        &'a self,
        name: &'a str,
        expected: &'a Revision,
        spec: PillarProtocolSpec,
    ) -> StoreFuture<'a, PillarProtocol> {
        ObjectApi::<PillarProtocol>::replace_spec(self, name, expected, spec)
    }
    /// [`ObjectApi::delete`] of a protocol.
    fn delete_protocol<'a>(&'a self, name: &'a str, expected: &'a Revision) -> StoreFuture<'a, ()> {
        ObjectApi::<PillarProtocol>::delete(self, name, expected)
    }
}

/// Checks that `name` is a DNS-1123 subdomain, as Kubernetes requires of these objects' names:
/// at most 253 characters of `[a-z0-9.-]`, starting and ending with `[a-z0-9]`. This also keeps
/// names safe as file names and URL path segments.
pub fn validate_name(kind: &'static str, name: &str) -> Result<(), StoreError> {
    let invalid = |reason| StoreError::InvalidName {
        kind,
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("empty"));
    }
    if name.len() > 253 {
        return Err(invalid("longer than 253 characters"));
    }
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    if !name.chars().all(ok_char) {
        return Err(invalid(
            "only lowercase letters, digits, '-' and '.' are allowed",
        ));
    }
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    if !name.starts_with(alnum) || !name.ends_with(alnum) {
        return Err(invalid(
            "must start and end with a lowercase letter or digit",
        ));
    }
    for label in name.split('.') {
        if label.is_empty() || !label.starts_with(alnum) || !label.ends_with(alnum) {
            return Err(invalid(
                "each '.'-separated part must start and end with a lowercase letter or digit",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_dns_subdomain_rules() {
        for good in ["a", "pvc-1234", "a.b-c.d", "0abc"] {
            assert!(validate_name("X", good).is_ok(), "{good}");
        }
        let long = "a".repeat(254);
        for bad in [
            "", "A", "a/b", "..", ".", "a..b", "-a", "a-", "a.", "a_b", "a b", &long,
        ] {
            assert!(validate_name("X", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn revision_needs_uid_and_resource_version() {
        let mut v = PillarVolumeState::new("v", crate::test_support::volume_spec("v"));
        assert!(matches!(
            Revision::of(&v),
            Err(StoreError::MissingMetadata { field: "uid", .. })
        ));
        v.metadata.uid = Some("u".into());
        assert!(matches!(
            Revision::of(&v),
            Err(StoreError::MissingMetadata {
                field: "resourceVersion",
                ..
            })
        ));
        v.metadata.resource_version = Some("7".into());
        assert_eq!(
            Revision::of(&v).unwrap(),
            Revision {
                uid: "u".into(),
                resource_version: "7".into()
            }
        );
    }
}
