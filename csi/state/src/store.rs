//! The store the CSI controller keeps its records in, with explicit compare-and-swap.
//!
//! Every write that changes an existing object names the [`Revision`] it expects: the object's
//! UID (one lifecycle of the name, F3) and its resourceVersion. A stale resourceVersion is
//! [`StoreError::Conflict`]; an object of another lifecycle is [`StoreError::UidMismatch`] (or
//! [`StoreError::NotFound`] when the name is gone). Nothing is ever overwritten blindly: the caller
//! re-reads and retries, or reports ABORTED.
//!
//! Two implementations: [`KubeStore`](crate::kube_store::KubeStore) over the Kubernetes API and
//! [`EmbeddedStore`](crate::embedded::EmbeddedStore) on a local directory for single-machine mode.
//! Both follow the API server's semantics: creating never writes a status, a status write never
//! changes the spec, a spec write never changes the status, and a write that changes nothing
//! keeps the resourceVersion.

use std::fmt::Debug;

use async_trait::async_trait;
use kube::Resource;
use serde::{Serialize, de::DeserializeOwned};

use crate::crd::{
    PillarAgent, PillarAgentSpec, PillarAgentStatus, PillarProtocol, PillarProtocolSpec,
    PillarSnapshotState, PillarSnapshotStateSpec, PillarSnapshotStateStatus, PillarVolumeState,
    PillarVolumeStateSpec, PillarVolumeStateStatus,
};

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
    /// The embedded store failed on disk.
    #[error(transparent)]
    Embedded(#[from] crate::embedded::EmbeddedError),
    /// This store keeps no DH-HMAC-CHAP credentials (W10).
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

/// Compare-and-swap access to pillar's records.
///
/// Objects come back with `metadata.uid` and `metadata.resourceVersion` set; pass
/// [`Revision::of`] of what you read to any write.
#[async_trait]
pub trait StateStore: Send + Sync + Debug {
    /// One volume, or `None`.
    async fn get_volume(&self, name: &str) -> Result<Option<PillarVolumeState>, StoreError>;
    /// Every volume, ordered by name.
    async fn list_volumes(&self) -> Result<Vec<PillarVolumeState>, StoreError>;
    /// Creates a volume record with no status. [`StoreError::AlreadyExists`] if the name is taken.
    async fn create_volume(
        &self,
        name: &str,
        spec: PillarVolumeStateSpec,
    ) -> Result<PillarVolumeState, StoreError>;
    /// Replaces the status if the object is still `expected`; the spec is untouched.
    async fn replace_volume_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarVolumeStateStatus,
    ) -> Result<PillarVolumeState, StoreError>;
    /// Replaces the spec if the object is still `expected`; the status is untouched.
    async fn replace_volume_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarVolumeStateSpec,
    ) -> Result<PillarVolumeState, StoreError>;
    /// Deletes the volume record if it is still `expected`.
    async fn delete_volume(&self, name: &str, expected: &Revision) -> Result<(), StoreError>;

    /// One snapshot, or `None`.
    async fn get_snapshot(&self, name: &str) -> Result<Option<PillarSnapshotState>, StoreError>;
    /// Every snapshot, ordered by name.
    async fn list_snapshots(&self) -> Result<Vec<PillarSnapshotState>, StoreError>;
    /// Creates a snapshot record with no status. [`StoreError::AlreadyExists`] if the name is
    /// taken.
    async fn create_snapshot(
        &self,
        name: &str,
        spec: PillarSnapshotStateSpec,
    ) -> Result<PillarSnapshotState, StoreError>;
    /// Replaces a snapshot's status if it is still `expected`; the spec is untouched.
    async fn replace_snapshot_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarSnapshotStateStatus,
    ) -> Result<PillarSnapshotState, StoreError>;
    /// Deletes a snapshot record if it is still `expected`.
    async fn delete_snapshot(&self, name: &str, expected: &Revision) -> Result<(), StoreError>;

    /// One agent, or `None`.
    async fn get_agent(&self, name: &str) -> Result<Option<PillarAgent>, StoreError>;
    /// Every agent, ordered by name.
    async fn list_agents(&self) -> Result<Vec<PillarAgent>, StoreError>;
    /// Creates an agent record.
    async fn create_agent(
        &self,
        name: &str,
        spec: PillarAgentSpec,
    ) -> Result<PillarAgent, StoreError>;
    /// Replaces an agent's spec if it is still `expected`.
    async fn replace_agent_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarAgentSpec,
    ) -> Result<PillarAgent, StoreError>;
    /// Replaces an agent's status if it is still `expected`.
    async fn replace_agent_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarAgentStatus,
    ) -> Result<PillarAgent, StoreError>;
    /// Deletes an agent record if it is still `expected`.
    async fn delete_agent(&self, name: &str, expected: &Revision) -> Result<(), StoreError>;

    /// One protocol, or `None`.
    async fn get_protocol(&self, name: &str) -> Result<Option<PillarProtocol>, StoreError>;
    /// Every protocol, ordered by name.
    async fn list_protocols(&self) -> Result<Vec<PillarProtocol>, StoreError>;
    /// Creates a protocol record.
    async fn create_protocol(
        &self,
        name: &str,
        spec: PillarProtocolSpec,
    ) -> Result<PillarProtocol, StoreError>;
    /// Replaces a protocol's spec if it is still `expected`.
    async fn replace_protocol_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarProtocolSpec,
    ) -> Result<PillarProtocol, StoreError>;
    /// Deletes a protocol record if it is still `expected`.
    async fn delete_protocol(&self, name: &str, expected: &Revision) -> Result<(), StoreError>;

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
}

/// What the stores need to know about each of the three record types.
pub trait PillarObject:
    Resource<DynamicType = (), Scope = kube::core::ClusterResourceScope>
    + Clone
    + Debug
    + PartialEq
    + Serialize
    + DeserializeOwned
    + Send
    + Sync
    + 'static
{
    /// `kind`.
    const KIND: &'static str;
    /// The resource's plural name (URL segment, directory name).
    const PLURAL: &'static str;
    /// Whether the type has a status subresource.
    const HAS_STATUS: bool;
    /// The spec type.
    type Spec: Clone + Debug + PartialEq + Serialize + DeserializeOwned + Send + Sync + 'static;

    /// A new object with only a name and a spec.
    fn build(name: &str, spec: Self::Spec) -> Self;
    /// The spec.
    fn spec(&self) -> &Self::Spec;
    /// Replaces the spec.
    fn set_spec(&mut self, spec: Self::Spec);
}

impl PillarObject for PillarVolumeState {
    const KIND: &'static str = "PillarVolumeState";
    const PLURAL: &'static str = "pillarvolumestates";
    const HAS_STATUS: bool = true;
    type Spec = PillarVolumeStateSpec;
    fn build(name: &str, spec: Self::Spec) -> Self {
        Self::new(name, spec)
    }
    fn spec(&self) -> &Self::Spec {
        &self.spec
    }
    fn set_spec(&mut self, spec: Self::Spec) {
        self.spec = spec;
    }
}

impl PillarObject for PillarSnapshotState {
    const KIND: &'static str = "PillarSnapshotState";
    const PLURAL: &'static str = "pillarsnapshotstates";
    const HAS_STATUS: bool = true;
    type Spec = PillarSnapshotStateSpec;
    fn build(name: &str, spec: Self::Spec) -> Self {
        Self::new(name, spec)
    }
    fn spec(&self) -> &Self::Spec {
        &self.spec
    }
    fn set_spec(&mut self, spec: Self::Spec) {
        self.spec = spec;
    }
}

impl PillarObject for PillarAgent {
    const KIND: &'static str = "PillarAgent";
    const PLURAL: &'static str = "pillaragents";
    const HAS_STATUS: bool = false;
    type Spec = PillarAgentSpec;
    fn build(name: &str, spec: Self::Spec) -> Self {
        Self::new(name, spec)
    }
    fn spec(&self) -> &Self::Spec {
        &self.spec
    }
    fn set_spec(&mut self, spec: Self::Spec) {
        self.spec = spec;
    }
}

impl PillarObject for PillarProtocol {
    const KIND: &'static str = "PillarProtocol";
    const PLURAL: &'static str = "pillarprotocols";
    const HAS_STATUS: bool = false;
    type Spec = PillarProtocolSpec;
    fn build(name: &str, spec: Self::Spec) -> Self {
        Self::new(name, spec)
    }
    fn spec(&self) -> &Self::Spec {
        &self.spec
    }
    fn set_spec(&mut self, spec: Self::Spec) {
        self.spec = spec;
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
