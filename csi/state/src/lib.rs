//! pillar: PillarVolumeState, PillarAgent and PillarProtocol records and their compare-and-swap
//! stores.
//!
//! - [`clock`]: the wall clock the controller reads ([`clock::WallClock`]), the machine's or
//!   one that moves with tokio's (the simulation).
//! - [`condition`]: status conditions in the shape of `metav1.Condition`, and
//!   [`set_condition`](condition::set_condition), which replaces one by type.
//! - [`crd`]: the four custom resources (group `pillar-csi.io`, version `v1alpha1`).
//! - [`object`]: [`PillarObject`], what the stores know of each kind, and [`object::KINDS`].
//! - [`store`]: [`ObjectApi<K>`](ObjectApi) (get, list, create, replace spec or status, delete of
//!   any kind), [`StateStore`] (every kind's, with the controller's per-kind shorthands),
//!   [`Revision`] (the UID + resourceVersion a write expects) and [`StoreError`].
//! - [`core`]: the API server's compare-and-swap rules, written once, and [`core::Memory`], the
//!   in-memory tables they run on.
//! - [`memory`]: [`MemoryStore`], the store in memory on the core (the simulation, tests).
//! - [`kube_store`]: [`KubeStore`], the store over the Kubernetes API.
//! - [`lease`]: leader election on a `coordination.k8s.io` Lease for the controller's own
//!   background loops ([`lease::Elector`], [`lease::Leadership`]).
//! - [`embedded`]: [`EmbeddedStore`], the core's rules on a local directory (single-machine
//!   mode).
//! - `apiserver_double` (feature `test-double`, and in this crate's tests): a Kubernetes API
//!   server test double for these resources, on the core; `faults` (feature `faults`, which
//!   `test-double` includes): one generic store wrapper that injects faults into writes, for
//!   tests and the simulation.
//!
//! - [`embedded_error`]: [`EmbeddedError`], the embedded store's disk failures.
//!
//! Imports run one way: `object` <- `store` <- `core` <- `memory`, `embedded`, the double;
//! `kube_store` and `faults` sit on `store` alone; `store` reaches down only to `object`, `crd`
//! and `embedded_error`.

pub mod clock;
pub mod condition;
pub mod core;
pub mod crd;
pub mod credentials;
pub mod embedded;
pub mod embedded_error;
pub mod kube_credentials;
pub mod kube_store;
pub mod lease;
pub mod memory;
pub mod object;
pub mod store;

#[cfg(any(test, feature = "test-double"))]
pub mod apiserver_double;
#[cfg(any(test, feature = "faults"))]
pub mod faults;

#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;

pub use embedded::{EmbeddedError, EmbeddedStore};
pub use kube_store::KubeStore;
pub use memory::MemoryStore;
pub use object::{Kind, NoStatus, PillarObject};
pub use store::{
    EventType, ObjectApi, Revision, StateStore, StoreError, VolumeEvent, validate_name,
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
