//! pillar's storage-node agent: fenced volume, export and ACL operations on the Linux NVMe-oF
//! target, with an io_uring core.
//!
//! - [`engine`]: io_uring and synchronous engines for durable small files and configfs plans.
//! - [`fence`]: fencing marks and the token rules.
//! - [`backend`]: volume devices (file on loop, LVM, ZFS).
//! - [`target`]: configfs (kernel or test double) and adopted-identity records.
//! - [`service`]: the operations, with locking, fencing and the resync gate.
//! - [`grpc`]: the gRPC edge and its error code table; [`server`]: assembly, mTLS, metrics.
//! - [`blocking`]: where blocking work runs (tokio's pool; a task on a simulation's thread).
//! - [`hooks`]: points where tests stall or slow a request (armed only with `fault-injection`).

pub mod backend;
pub mod blocking;
pub mod cli;
pub mod engine;
pub mod fence;
pub mod grpc;
pub mod hooks;
pub mod metrics;
pub mod server;
pub mod service;
pub mod state;
pub mod target;
