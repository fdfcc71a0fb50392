//! The shared state store and each replica's view of it, where the simulation stalls and fails
//! writes.
//!
//! The store is `pillar-state`'s [`MemoryStore`]: the API server's compare-and-swap rules as
//! `pillar-state`'s `core` writes them once, the same code under the embedded store and the API
//! server test double. Here its UIDs come from the seed and its creation times are fixed, so one
//! seed is one run. [`shared_store`] builds it.
//!
//! A replica's client is `pillar-state`'s generic [`FaultyStore`] with the [`ReplicaChaos`]
//! policy: before a volume write (status, spec, delete) or a snapshot status write it may stall
//! (the replica paused between its read and its write: the other replica overtakes) or fail with
//! a conflict that did not happen (as an API server does under contention); after a status
//! write landed it may stall before the replica acts on it.

use std::sync::Arc;

use async_trait::async_trait;
use pillar_state::crd::{PillarSnapshotState, PillarVolumeState};
use pillar_state::faults::{Faults, FaultyStore, Op, Write};
use pillar_state::{MemoryStore, PillarObject, StateStore, StoreError};

use crate::chaos::{Chaos, Fault};

/// The shared store: empty, its UIDs drawn from `chaos`.
pub fn shared_store(chaos: &Chaos) -> Arc<MemoryStore> {
    let chaos = chaos.clone();
    Arc::new(MemoryStore::deterministic(move || chaos.uuid()))
}

/// One replica's client of the shared store (see the module documentation).
pub type ReplicaStore = FaultyStore<ReplicaChaos>;

/// Replica `replica`'s view of `inner`.
pub fn replica_store(
    inner: Arc<dyn StateStore>,
    chaos: Chaos,
    replica: usize,
) -> Arc<ReplicaStore> {
    FaultyStore::with_faults(inner, ReplicaChaos { chaos, replica })
}

/// The faults of one replica's writes (see the module documentation).
pub struct ReplicaChaos {
    chaos: Chaos,
    replica: usize,
}

impl std::fmt::Debug for ReplicaChaos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaChaos")
            .field("replica", &self.replica)
            .finish_non_exhaustive()
    }
}

/// The name the trace gives `write`, if the chaos strikes it before it lands.
fn stalls_before(write: &Write<'_>) -> Option<&'static str> {
    let volume = write.kind == PillarVolumeState::KIND;
    let snapshot = write.kind == PillarSnapshotState::KIND;
    match write.op {
        Op::Status if volume => Some("status write"),
        Op::Spec if volume => Some("spec write"),
        Op::Delete if volume => Some("delete"),
        Op::Status if snapshot => Some("snapshot status write"),
        _ => None,
    }
}

#[async_trait]
impl Faults for ReplicaChaos {
    /// Maybe stall (others overtake), maybe fail with a conflict.
    async fn before(&self, write: &Write<'_>) -> Result<(), StoreError> {
        let Some(what) = stalls_before(write) else {
            return Ok(());
        };
        let (k, name) = (&self.chaos.knobs, write.name);
        if self.chaos.strikes(
            Fault::ReplicaPaused,
            k.pause,
            &format!("replica {} stalls before {what} {name}", self.replica),
        ) {
            tokio::time::sleep(self.chaos.pause(300)).await;
        }
        if self.chaos.strikes(
            Fault::StoreConflict,
            k.conflict,
            &format!("replica {}: {what} {name} conflicts", self.replica),
        ) {
            return Err(write.conflict("injected conflict"));
        }
        Ok(())
    }

    /// After a status write landed: maybe stall before the replica acts on it (a token taken,
    /// its agent call not yet sent), long enough for an agent to crash and restart in between.
    async fn after(&self, write: &Write<'_>, answer: Result<(), &StoreError>) {
        let Some(what) = stalls_before(write).filter(|_| write.op == Op::Status) else {
            return;
        };
        if answer.is_ok()
            && self.chaos.strikes(
                Fault::ReplicaPausedAfterWrite,
                self.chaos.knobs.pause_after_write,
                &format!(
                    "replica {} stalls after {what} {}",
                    self.replica, write.name
                ),
            )
        {
            tokio::time::sleep(self.chaos.pause(2_000)).await;
        }
    }
}
