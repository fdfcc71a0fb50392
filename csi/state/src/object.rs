//! What every store needs to know about each of pillar's four record kinds, written once:
//! [`PillarObject`] (kind, plural, spec and status types), [`Kind`] and [`KINDS`], the one list
//! of the kinds.
//!
//! A kind without a status subresource (`PillarProtocol`) has [`NoStatus`] as its status type:
//! an enum without values, so a status write of such a kind cannot even be written down.

use std::fmt::Debug;

use kube::Resource;
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::crd::{
    PillarAgent, PillarAgentSpec, PillarAgentStatus, PillarProtocol, PillarProtocolSpec,
    PillarSnapshotState, PillarSnapshotStateSpec, PillarSnapshotStateStatus, PillarVolumeState,
    PillarVolumeStateSpec, PillarVolumeStateStatus,
};

/// The status of a kind that has no status subresource: it has no values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NoStatus {}

/// The types a record's spec and status must be.
pub trait Part:
    Clone + Debug + PartialEq + Serialize + DeserializeOwned + Send + Sync + 'static
{
}

impl<T> Part for T where
    T: Clone + Debug + PartialEq + Serialize + DeserializeOwned + Send + Sync + 'static
{
}

/// What the stores need to know about each record type.
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
    /// The resource's plural name (URL segment, table name).
    const PLURAL: &'static str;
    /// Whether the type has a status subresource.
    const HAS_STATUS: bool;
    /// The spec type.
    type Spec: Part;
    /// The status type ([`NoStatus`] for a kind without a status subresource).
    type Status: Part;

    /// A new object with only a name and a spec.
    fn build(name: &str, spec: Self::Spec) -> Self;
    /// The spec.
    fn spec(&self) -> &Self::Spec;
    /// Replaces the spec.
    fn set_spec(&mut self, spec: Self::Spec);
    /// The status, if one was written.
    fn status(&self) -> Option<&Self::Status>;
    /// Replaces the status.
    fn set_status(&mut self, status: Option<Self::Status>);
}

/// One kind's names, for code that handles every kind alike (tables, URL routes, errors).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kind {
    /// `kind`.
    pub kind: &'static str,
    /// The plural name.
    pub plural: &'static str,
    /// Whether it has a status subresource.
    pub has_status: bool,
}

impl Kind {
    /// The names of `K`.
    pub const fn of<K: PillarObject>() -> Self {
        Self {
            kind: K::KIND,
            plural: K::PLURAL,
            has_status: K::HAS_STATUS,
        }
    }
}

/// Every kind pillar keeps.
pub const KINDS: [Kind; 4] = [
    Kind::of::<PillarVolumeState>(),
    Kind::of::<PillarSnapshotState>(),
    Kind::of::<PillarAgent>(),
    Kind::of::<PillarProtocol>(),
];

/// `impl PillarObject` for a kind with a status subresource.
macro_rules! with_status {
    ($ty:ty, $kind:literal, $plural:literal, $spec:ty, $status:ty) => {
        impl PillarObject for $ty {
            const KIND: &'static str = $kind;
            const PLURAL: &'static str = $plural;
            const HAS_STATUS: bool = true;
            type Spec = $spec;
            type Status = $status;
            fn build(name: &str, spec: Self::Spec) -> Self {
                Self::new(name, spec)
            }
            fn spec(&self) -> &Self::Spec {
                &self.spec
            }
            fn set_spec(&mut self, spec: Self::Spec) {
                self.spec = spec;
            }
            fn status(&self) -> Option<&Self::Status> {
                self.status.as_ref()
            }
            fn set_status(&mut self, status: Option<Self::Status>) {
                self.status = status;
            }
        }
    };
}

with_status!(
    PillarVolumeState,
    "PillarVolumeState",
    "pillarvolumestates",
    PillarVolumeStateSpec,
    PillarVolumeStateStatus
);
with_status!(
    PillarSnapshotState,
    "PillarSnapshotState",
    "pillarsnapshotstates",
    PillarSnapshotStateSpec,
    PillarSnapshotStateStatus
);
with_status!(
    PillarAgent,
    "PillarAgent",
    "pillaragents",
    PillarAgentSpec,
    PillarAgentStatus
);

impl PillarObject for PillarProtocol {
    const KIND: &'static str = "PillarProtocol";
    const PLURAL: &'static str = "pillarprotocols";
    const HAS_STATUS: bool = false;
    type Spec = PillarProtocolSpec;
    type Status = NoStatus;
    fn build(name: &str, spec: Self::Spec) -> Self {
        Self::new(name, spec)
    }
    fn spec(&self) -> &Self::Spec {
        &self.spec
    }
    fn set_spec(&mut self, spec: Self::Spec) {
        self.spec = spec;
    }
    fn status(&self) -> Option<&Self::Status> {
        None
    }
    fn set_status(&mut self, status: Option<Self::Status>) {
        if let Some(never) = status {
            match never {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kinds_match_their_crds() {
        use kube::CustomResourceExt;
        let crds = [
            PillarVolumeState::crd(),
            PillarSnapshotState::crd(),
            PillarAgent::crd(),
            PillarProtocol::crd(),
        ];
        for (kind, crd) in KINDS.iter().zip(crds) {
            assert_eq!(crd.spec.names.kind, kind.kind);
            assert_eq!(crd.spec.names.plural, kind.plural);
            let has_status = crd.spec.versions[0]
                .subresources
                .as_ref()
                .is_some_and(|s| s.status.is_some());
            assert_eq!(has_status, kind.has_status, "{}", kind.kind);
        }
    }
}
