//! Knowing that the state directory was lost, and failing closed until the controller has
//! re-seeded the marks (C6).
//!
//! Invariants:
//! - "No mark" is believed only when it cannot be a lost mark: the state's identity is intact
//!   and the volume is not among those held here without a mark ([`Agent::unmarked`]).
//! - Once a loss is known (at start: a volume in a pool or an export in configfs with no mark;
//!   while running: the state identity gone or changed), the agent is `StateLost` under a new
//!   epoch and refuses every mutating call (`STATE_LOST`), until a resync carrying that epoch
//!   has run to its end. The controller reads the epoch before it takes the resync's tokens,
//!   so every mark the resync seeds is newer than any token applied before the loss; a resync
//!   whose tokens may be older (it carries no epoch, or the epoch of an earlier loss) is
//!   refused whole.
//! - Volumes still held without a mark after that resync (the controller has no live record
//!   of them) are refused one by one (`UNCLAIMED_VOLUME`): neither deleted nor adopted by a
//!   token nobody can judge.

use std::collections::{BTreeSet, HashSet};

use pillar_nvmet::{SubsystemNqn, VolumeId};

use super::{Agent, AgentError, Readiness};
use crate::fence::{Intent, MarkStore};

impl Agent {
    /// Every volume this node holds (in a pool, or exported) without a mark.
    pub(super) async fn scan_unmarked(&self) -> Result<BTreeSet<VolumeId>, AgentError> {
        // The pools and the target first, the marks after, never at once: a mark is made
        // durable before its volume is made or exported, so whatever the first listing shows
        // has its mark in the second. Listed the other way round, or together, a volume created
        // between the two listings (a rescan after a loss runs while requests are served)
        // would be held without a mark and refused as unclaimed.
        let held = self.held_volumes().await?;
        let unmarked = self.marks.retain_unmarked(held).await?;
        Ok(unmarked.into_iter().collect())
    }

    /// Every volume this node holds: in a pool, or exported. A hash set: with 100,000 volumes
    /// a tree's comparisons of IDs were a quarter of the start-up.
    async fn held_volumes(&self) -> Result<HashSet<VolumeId>, AgentError> {
        let mut held = HashSet::new();
        for backend in self.pools.values() {
            held.extend(backend.held().await?);
        }
        let guard = self.target.exclusive().await;
        let state = self.target.observe_all(&guard).await?;
        held.extend(
            state
                .subsystems
                .keys()
                .filter_map(|name| SubsystemNqn::parse(name).ok()?.volume_id().ok()),
        );
        Ok(held)
    }

    /// At start: the state is lost when this node holds a volume without a mark, or the state
    /// identity was corrupt. A first start on an empty node holds nothing, and is no loss.
    pub async fn detect_loss_at_start(&self, identity_corrupt: bool) -> Result<(), AgentError> {
        let unmarked = self.scan_unmarked().await?;
        if unmarked.is_empty() && !identity_corrupt {
            return Ok(());
        }
        tracing::error!(
            unmarked = unmarked.len(),
            identity_corrupt,
            "the agent's state directory was lost: every mutating call is refused until the controller re-seeds the marks"
        );
        self.enter_lost(unmarked).await;
        Ok(())
    }

    async fn enter_lost(&self, unmarked: BTreeSet<VolumeId>) {
        let mut readiness = self.readiness.write().await;
        let epoch = uuid::Uuid::new_v4().to_string();
        *self.unmarked_set() = unmarked;
        *self.epoch_slot() = Some(epoch.clone());
        *readiness = Readiness::StateLost;
        tracing::error!(%epoch, "state lost: waiting for the controller's re-seeding resync");
    }

    pub(super) fn unmarked_set(&self) -> std::sync::MutexGuard<'_, BTreeSet<VolumeId>> {
        self.unmarked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn epoch_slot(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.loss_epoch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The epoch a re-seeding resync must carry; `None` unless the state is lost.
    pub fn state_epoch(&self) -> Option<String> {
        self.epoch_slot().clone()
    }

    /// Volumes held without a mark that no resync claimed (reported while serving).
    pub fn unclaimed(&self) -> Vec<VolumeId> {
        self.unmarked_set().iter().cloned().collect()
    }

    /// Refuses a mutating call while the state is lost.
    pub(super) async fn ensure_not_lost(&self) -> Result<(), AgentError> {
        match *self.readiness.read().await {
            Readiness::StateLost => Err(AgentError::StateLost),
            Readiness::WaitingForResync | Readiness::Serving => Ok(()),
        }
    }

    /// Whether "no mark" for `volume` in `marks` may be believed (see the module invariants).
    /// Called under the volume's lock, after the read that found no mark.
    pub(super) async fn confirm_no_mark(
        &self,
        marks: &MarkStore,
        volume: &VolumeId,
        intent: Intent,
    ) -> Result<(), AgentError> {
        if !self.state_id.intact() {
            self.lost_under_us().await?;
            return Err(AgentError::StateLost);
        }
        if !std::ptr::eq(marks, &self.marks) || !self.unmarked_set().contains(volume) {
            return Ok(());
        }
        match *self.readiness.read().await {
            // The re-seeding resync (its epoch checked at its start): its fresh token is the mark.
            Readiness::StateLost if intent == Intent::Resync => Ok(()),
            Readiness::StateLost => Err(AgentError::StateLost),
            Readiness::WaitingForResync | Readiness::Serving => Err(AgentError::Unclaimed {
                volume: volume.to_string(),
            }),
        }
    }

    /// The state directory vanished (or was replaced) under the running agent: start a new one
    /// and hold every volume of this node as unmarked until the controller re-seeds it.
    async fn lost_under_us(&self) -> Result<(), AgentError> {
        let _one = self.loss_lock.lock().await;
        if self.state_id.intact() {
            // Another request saw it first and started the new state.
            return Ok(());
        }
        self.marks.reopen().map_err(AgentError::StateDir)?;
        self.snapshot_marks.reopen().map_err(AgentError::StateDir)?;
        self.target.reopen_identities()?;
        self.state_id.renew()?;
        let unmarked = self.scan_unmarked().await?;
        self.enter_lost(unmarked).await;
        Ok(())
    }

    /// At the start of a resync: while the state is lost, `epoch` must be the current one.
    /// Returns the epoch the resync serves under (checked again at its end).
    pub(super) fn resync_epoch(&self, epoch: &str) -> Result<Option<String>, AgentError> {
        let current = self.state_epoch();
        match &current {
            Some(e) if e != epoch => Err(AgentError::StateLost),
            _ => Ok(current),
        }
    }
}
