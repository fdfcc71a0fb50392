//! The fencing steps every mutating operation runs under the volume's lock: check the token
//! against the mark, make the decided mark durable, then change (F5, F7); and the gate that
//! keeps exports and grants out until the resync (C3).
//!
//! Invariants:
//! - `check` writes nothing; a rejection changes nothing and is counted and logged.
//! - `commit` makes the mark durable before the change it allows runs, under the same volume
//!   lock as the `check` that decided it.
//! - A missing mark is believed only when it cannot be a lost one (C6, `loss`).

use pillar_lock_by_id::IdGuard;
use pillar_nvmet::VolumeId;

use super::{Agent, AgentError, Readiness};
use crate::fence::{Decision, Intent, MarkError, MarkStore, Token, decide};
use crate::hooks::HookPoint;

impl Agent {
    pub(super) async fn lock_volume(&self, volume: &VolumeId) -> IdGuard<VolumeId> {
        self.locks.lock(volume.clone()).await
    }

    /// Checks the token against the volume's mark, without writing anything. Must be called
    /// with the volume lock held, and the decision committed under the same lock.
    pub(super) async fn check(
        &self,
        volume: &VolumeId,
        token: Option<&Token>,
        intent: Intent,
    ) -> Result<Decision, AgentError> {
        self.check_in(&self.marks, volume, token, intent).await
    }

    /// [`check`](Self::check) against the marks of `marks` (volumes' or snapshots').
    pub(super) async fn check_in(
        &self,
        marks: &MarkStore,
        volume: &VolumeId,
        token: Option<&Token>,
        intent: Intent,
    ) -> Result<Decision, AgentError> {
        let mark = marks.read(volume)?;
        if mark.is_none() {
            // C6: no mark may be a lost mark.
            self.confirm_no_mark(marks, volume, intent).await?;
        }
        decide(volume, mark.as_ref(), token, intent).map_err(|rejection| {
            self.metrics.fence_rejected(rejection.reason());
            tracing::warn!(%volume, reason = rejection.reason(), "fencing rejected a request: {rejection}");
            rejection.into()
        })
    }

    /// Makes the mark a [`check`](Self::check) decided durable, before the change runs.
    pub(super) async fn commit(&self, volume: &VolumeId, decision: Decision) -> Result<(), AgentError> {
        self.commit_in(&self.marks, volume, decision).await
    }

    /// [`commit`](Self::commit) into `marks`.
    pub(super) async fn commit_in(
        &self,
        marks: &MarkStore,
        volume: &VolumeId,
        decision: Decision,
    ) -> Result<(), AgentError> {
        self.settings
            .hooks
            .pass(HookPoint::BetweenCheckAndCommit)
            .await;
        if let Some(next) = decision {
            if self.settings.hooks.fails(HookPoint::MarkWrite) {
                return Err(MarkError::Write {
                    volume: volume.to_string(),
                    source: crate::engine::EngineError::Unavailable {
                        reason: "injected failure (test hook)".into(),
                    },
                }
                .into());
            }
            marks.write(&self.engine, volume, &next).await?;
            if std::ptr::eq(marks, &self.marks) {
                self.unmarked_set().remove(volume);
            }
        }
        Ok(())
    }

    /// [`check`](Self::check) then [`commit`](Self::commit), for operations with nothing to
    /// inspect in between.
    pub(super) async fn fence(
        &self,
        volume: &VolumeId,
        token: Option<&Token>,
        intent: Intent,
    ) -> Result<(), AgentError> {
        let decision = self.check(volume, token, intent).await?;
        self.commit(volume, decision).await
    }

    pub(super) async fn ensure_serving(&self) -> Result<(), AgentError> {
        match *self.readiness.read().await {
            Readiness::Serving => Ok(()),
            Readiness::WaitingForResync => Err(AgentError::WaitingForResync),
            Readiness::StateLost => Err(AgentError::StateLost),
        }
    }
}
