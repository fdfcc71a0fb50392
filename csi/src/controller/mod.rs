//! The CSI Controller service: who may use a volume, recorded before anything is granted.
//!
//! Rooms:
//! - `request`: each CSI request parsed once into typed values (INVALID_ARGUMENT decided there);
//! - `record`: the one compare-and-swap loop every write to a PillarVolumeState goes through;
//! - `publish`: the publish table ([`decide_publication`]), publish and unpublish;
//! - `provision`: create (empty, or restored or cloned from a source), delete, expand;
//!   `snapshot`: a snapshot's lifecycle; `topology`: which agents a request may use;
//!   `read`: validate, list, get, capacity;
//! - `agent`: reaching a volume's agent; `resync`: bringing a restarted agent back; `acl`:
//!   an edit of a protocol's `acl` or `auth` applied to the volumes already published;
//!   `rotate`: a node's DH-HMAC-CHAP pair replaced and sent to its storage nodes;
//! - `condition`: status conditions (`AclDisabled`, `AuthDisabled`, `Revoking`) set inside the writes they describe, and
//!   best-effort Kubernetes Events on their transitions;
//! - `error`: the error type and the code table; `service`: the tonic adapter.
//!
//! Invariants (`docs/rules.md` W, F, C):
//! - The PillarVolumeState is created before anything exists on a storage node (F10); a volume
//!   without one owns nothing, and deleting it needs no agent call.
//! - Every agent call that changes a volume carries a token: the PillarVolumeState's UID and a
//!   `publicationGeneration` bumped by compare-and-swap, pinned to the UID the operation started
//!   with (F2, F3). A lifecycle that disappeared or was re-created is ABORTED.
//! - A publication is recorded (CAS) before the agent grants it (W1), and checked against every
//!   recorded publication in the same CAS (W2). A record is removed only after the agent
//!   confirmed the revoke (W4); a failed revoke or a missing PillarAgent keeps it.
//! - DeleteVolume refuses while any publication is recorded (W5), and fails when the
//!   PillarAgent is missing (C1).
//! - When an agent restarted (it reports WAITING_FOR_RESYNC), it is sent the complete export
//!   state of its node before anything else (C3).
//! - Every store write is a compare-and-swap; a stale read is re-read and retried, never
//!   overwritten. One call at a time per volume in this process (a lock per volume ID); the
//!   store's compare-and-swap orders calls of different replicas.
//! - Agent errors are decided on their typed reason, never on message text.

mod acl;
mod agent;
mod condition;
mod error;
pub mod metrics;
mod provision;
mod publish;
mod read;
mod record;
mod request;
mod resync;
mod rotate;
mod service;
mod snapshot;
mod topology;

use std::sync::Arc;

use pillar_lock_by_id::LockById;
use pillar_state::clock::{SystemClock, WallClock, condition_time};
use pillar_state::store::StateStore;
use tokio::sync::Mutex;

use crate::agents::Agents;
use metrics::ControllerMetrics;

pub use error::{ControllerError, agent_code, code_of};
pub use publish::{Decision, decide_publication};
pub use record::CAS_ATTEMPTS;
pub use request::volume_id_for_name;
pub use rotate::Rotation;
pub use service::ControllerService;

/// The request parsers each RPC applies to what a client sent, for the fuzz targets (`fuzz/`);
/// not part of the crate's API.
#[doc(hidden)]
pub mod fuzzing {
    pub use super::request::{
        Create, Expand, Page, Publish, SizeRange, Source, Unpublish, VolumeRef, create,
        create_snapshot, delete, expand, get, list, list_snapshots, page_token, publish,
        snapshot_ref, unpublish, validate, volume_id_for_name,
    };
}

/// StorageClass parameters pillar understands.
pub mod params {
    /// The PillarAgent (storage node) to provision on; optional when there is exactly one.
    pub const AGENT: &str = "pillar.io/agent";
    /// The pool on that agent; optional when the agent has exactly one.
    pub const POOL: &str = "pillar.io/pool";
    /// The PillarProtocol; optional when there is exactly one.
    pub const PROTOCOL: &str = "pillar.io/protocol";
}

/// Size of a volume created without a capacity range.
pub const DEFAULT_VOLUME_BYTES: u64 = 1 << 30;

/// The controller.
#[derive(Debug)]
pub struct Controller {
    store: Arc<dyn StateStore>,
    metrics: Arc<ControllerMetrics>,
    agents: Arc<Agents>,
    /// One call at a time per volume ID in this process.
    locks: LockById<String>,
    resync_lock: Mutex<()>,
    /// When the resync loop last scanned every volume (revokes pending, acl edits): tokio's
    /// clock, which the simulation controls.
    volumes_scanned: Mutex<Option<tokio::time::Instant>>,
    /// The time of day the records' conditions and statuses carry.
    clock: Arc<dyn WallClock>,
}

impl Controller {
    /// A controller over `store`, reaching agents through `agents`.
    pub fn new(store: Arc<dyn StateStore>, agents: Arc<Agents>) -> Arc<Self> {
        Self::with_clock(store, agents, Arc::new(SystemClock))
    }

    /// A controller that reads the time of day from `clock` (the simulation's follows tokio's).
    pub fn with_clock(
        store: Arc<dyn StateStore>,
        agents: Arc<Agents>,
        clock: Arc<dyn WallClock>,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            metrics: Arc::new(ControllerMetrics::new()),
            agents,
            locks: LockById::new(),
            resync_lock: Mutex::new(()),
            volumes_scanned: Mutex::new(None),
            clock,
        })
    }

    /// Now, as a condition's transition time.
    pub(crate) fn condition_time(&self) -> String {
        condition_time(self.clock.now())
    }

    /// This controller's metrics (served by [`metrics::serve_metrics`]).
    pub fn metrics(&self) -> Arc<ControllerMetrics> {
        Arc::clone(&self.metrics)
    }
}
