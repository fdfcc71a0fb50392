//! pillar: PillarVolumeState, PillarAgent and PillarProtocol records and their compare-and-swap
//! stores.
//!
//! - [`condition`]: status conditions in the shape of `metav1.Condition`, and
//!   [`set_condition`](condition::set_condition), which replaces one by type.
//! - [`crd`]: the three custom resources (group `pillar-csi.io`, version `v1alpha1`).
//! - [`store`]: the [`StateStore`] trait, [`Revision`] (the UID + resourceVersion a write
//!   expects) and [`StoreError`].
//! - [`kube_store`]: [`KubeStore`], the store over the Kubernetes API.
//! - [`embedded`]: [`EmbeddedStore`], the same semantics on a local directory (single-machine
//!   mode).
//! - `apiserver_double` (feature `test-double`, and in this crate's tests): a Kubernetes API
//!   server test double for these resources; `faults` (same feature): a store wrapper that
//!   makes chosen compare-and-swap writes conflict.

pub mod condition;
pub mod crd;
pub mod embedded;
pub mod kube_store;
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
