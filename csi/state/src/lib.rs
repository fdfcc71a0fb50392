//! pillar: PillarVolumeState, PillarAgent and PillarProtocol records and their compare-and-swap
//! stores.
//!
//! - [`condition`]: status conditions in the shape of `metav1.Condition`, and
//!   [`set_condition`](condition::set_condition), which replaces one by type.
//! - [`crd`]: the three custom resources (group `pillar-csi.io`, version `v1alpha1`).
//! - [`store`]: the [`StateStore`] trait, [`Revision`] (the UID + resourceVersion a write
//!   expects) and [`StoreError`].
//! - [`kube_store`]: [`KubeStore`], the store over the Kubernetes API.
//! - [`lease`]: leader election on a `coordination.k8s.io` Lease for the controller's own
//!   background loops ([`lease::Elector`], [`lease::Leadership`]).
//! - [`embedded`]: [`EmbeddedStore`], the same semantics on a local directory (single-machine
//!   mode).
//! - `apiserver_double` (feature `test-double`, and in this crate's tests): a Kubernetes API
//!   server test double for these resources; `faults` (same feature): a store wrapper that
//!   makes chosen compare-and-swap writes conflict.

pub mod condition;
pub mod crd;
pub mod credentials;
pub mod embedded;
pub mod kube_store;
pub mod lease;
pub mod store;

#[cfg(any(test, feature = "test-double"))]
pub mod apiserver_double;
#[cfg(any(test, feature = "test-double"))]
pub mod faults;

#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;

pub use embedded::{EmbeddedError, EmbeddedStore};
pub use kube_store::KubeStore;
pub use store::{
    EventType, PillarObject, Revision, StateStore, StoreError, VolumeEvent, validate_name,
};

/// An error and its chain of causes on one line, `outer: cause: root cause`, for gRPC status
/// messages and logs.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
