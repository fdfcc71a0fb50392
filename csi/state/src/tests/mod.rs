//! This crate's tests. Each names the rule it proves (`// proves W1`, ...), see
//! `docs/rules.md`.

mod contract;
mod crds;
mod double;
mod embedded;
mod events;
mod kube_credentials;
mod lease;
mod race;
mod rbac;
mod shapes;
