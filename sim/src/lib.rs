//! pillar-sim: a deterministic simulation that drives pillar's real controller and agent code
//! through random operations and faults, and checks nine safety invariants after every step.
//!
//! # What is real and what is simulated
//!
//! Real: two `pillar_csi::controller::Controller` replicas (publish, unpublish, create, delete,
//! expand, resync, their compare-and-swap loops and tokens); the node plugin
//! (`pillar_csi::node::NodeService`: stage, publish, unpublish, unstage, expand) on six hosts
//! over a kernel double ([`kernel`]); one or more agents assembled by
//! `pillar_agent::server::build_agent` (synchronous engine writing real fencing marks in a
//! state directory, the nvmet configfs double `pillar_nvmet::ConfigfsDouble` rooted in a temp
//! directory below that engine's configfs path, the agent's gRPC service with its `to_the_end`
//! tasks); tonic clients and servers
//! between them, speaking HTTP/2 over in-memory pipes.
//!
//! Simulated: the Kubernetes API (`pillar-state`'s `MemoryStore`: the API server's
//! compare-and-swap rules as the embedded store and the API server double run them, with seeded
//! UIDs; [`store`]); the network ([`transport`]: drops, delays, reordering, duplicates, lost replies,
//! crashes that break connections); the disks (the plain-file backend, sparse files without
//! loop devices); time (paused tokio time: a 30 s deadline costs nothing); the blocking pool
//! (`pillar_agent::blocking`: on the simulation's thread, blocking work runs on a task after a
//! seeded number of yields, so it can complete out of order).
//!
//! # The scheduler
//!
//! One current-thread tokio runtime with paused time, and one seeded generator
//! ([`rng::SimRng`], xoshiro256**) behind every decision: which operation, which replica,
//! which faults, how long each wait. Tasks interleave only at await points, in an order fixed
//! by the seed. We chose this over madsim, turmoil or shuttle: madsim replaces tokio and tonic
//! with its own builds (pillar's crates would have to be compiled against them, and its tonic
//! lags the one pillar uses); turmoil simulates hosts and TCP but leaves tokio's blocking pool
//! on real threads, and its network is the only fault it controls; shuttle explores thread
//! interleavings of std/`shuttle::sync` primitives and does not run tokio or tonic at all. A
//! tokio runtime of our own runs tonic unchanged, and the one seam in the agent
//! (`pillar_agent::blocking`) brings its blocking work under the same seed.
//!
//! Determinism caveat: tokio's own `select!` fairness uses a per-runtime random seed that only
//! an unstable tokio API can fix, and hyper/h2 use `select!` internally. A seed replays the
//! same operations and fault decisions; where h2 polls two ready branches in another order the
//! run may still diverge. In practice a violating seed reproduced its violation when run
//! again (see `sim/README.md`).
//!
//! # Invariants
//!
//! See [`invariants`]: one writer at the target; marks never move back; an old lifecycle never
//! touches a new one; a record outlives the host's access; a published volume is never
//! deleted; two hosts never write one volume; a host reaches a volume only while its record
//! names it; an acknowledged expansion is never lost, at the controller (8) and on the node
//! (9).

pub mod chaos;
pub mod error;
pub mod host;
pub mod invariants;
pub mod kernel;
pub mod node;
#[cfg(test)]
mod node_expand_tests;
mod ops;
pub mod rng;
pub mod run;
pub mod store;
pub mod targets;
pub mod transport;
pub mod world;

pub use chaos::{Fault, FaultCounts, Knobs};
pub use error::SimError;
pub use invariants::{Invariant, Violation};
pub use run::run_seed;
pub use world::{Config, SeedOutcome};
