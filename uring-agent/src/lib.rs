//! pillar's storage-node agent: fenced volume, export and ACL operations on the Linux NVMe-oF
//! target, with an io_uring core.
//!
//! # The face
//!
//! What the agent's users (its binary, `pillar-local`, the CSI crates' tests) need, at the root:
//! - to run an agent: a [`ServerConfig`] and what it names ([`Listen`], [`EngineKind`],
//!   [`TargetConfig`], [`PoolConfig`] and [`PoolKind`], [`AgentSettings`] with its inert
//!   [`Hooks`], [`TlsFiles`]), served by [`serve`] or [`serve_with_limits`] until a shutdown
//!   future completes; [`ServerError`] says why it could not start or serve;
//! - its command line: [`cli`], so a manifest test parses with the binary's own parser.
//!
//! # Test seams
//!
//! The rooms below are the crate's own. The `test-seams` feature, which only tests, the
//! simulation and the benches enable, makes them public as well, so those can build an agent
//! piece by piece (`server::build_agent`, `grpc::AgentService`), drive an engine alone, decode
//! marks or run blocking work on the simulation's thread. `fault-injection` (tests and the
//! simulation) implies it and lets the hooks be armed.
//!
//! - `engine`: io_uring and synchronous engines for durable small files and configfs plans.
//! - `fence`: fencing marks and the token rules.
//! - `backend`: volume devices (file on loop, LVM, ZFS).
//! - `target`: configfs (kernel or test double) and adopted-identity records.
//! - `service`: the operations, with locking, fencing and the resync gate.
//! - `grpc`: the gRPC edge and its error code table; `server`: assembly, mTLS, metrics.
//! - `blocking`: where blocking work runs (tokio's pool; a task on a simulation's thread).
//! - `hooks`: points where tests stall or slow a request (armed only with `fault-injection`).

pub mod cli;

/// Declares each module public with `test-seams` and crate-private without it.
macro_rules! seams {
    ($($name:ident),+ $(,)?) => {
        $(
            #[cfg(feature = "test-seams")]
            pub mod $name;
            #[cfg(not(feature = "test-seams"))]
            mod $name;
        )+
    };
}

seams!(
    backend, blocking, engine, fence, grpc, hooks, metrics, server, service, state, target
);

pub use backend::{PoolConfig, PoolKind};
pub use hooks::Hooks;
pub use server::{
    EngineKind, Listen, ServerConfig, ServerError, TlsFiles, serve, serve_with_limits,
};
pub use service::AgentSettings;
pub use target::TargetConfig;
