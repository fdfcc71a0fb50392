//! Writes to a volume's PillarVolumeState: one compare-and-swap loop for every kind of write.
//!
//! Each write is decided from the record as read and made with that record's revision: the
//! decision and the write are one atomic step, whatever another controller replica does in
//! between (it makes the write conflict, and the decision is taken again on the new record).
//! Every write is pinned to the lifecycle (UID) the operation started with (F3): a record that
//! is gone or belongs to another lifecycle ends the operation with `LifecycleGone`. A write
//! that keeps conflicting is ABORTED after [`CAS_ATTEMPTS`], never dropped and never reported
//! as done.

use pillar_agent_api::v1 as agent_api;
use pillar_state::crd::{PillarVolumeState, PillarVolumeStateSpec, PillarVolumeStateStatus};
use pillar_state::store::Revision;

use super::Controller;
use super::error::ControllerError;

/// How often a contended compare-and-swap is retried before the call is ABORTED.
pub const CAS_ATTEMPTS: usize = 32;

/// The write a decision asks for.
#[derive(Debug)]
pub enum Write {
    Status(PillarVolumeStateStatus),
    Spec(PillarVolumeStateSpec),
    Delete,
    /// Nothing to write: the record already says what the decision wants.
    Nothing,
}

/// What must still hold of a volume's record for an agent call to be sent with a fresh token.
pub type Precondition<'a> =
    dyn Fn(&PillarVolumeState) -> Result<(), ControllerError> + Send + Sync + 'a;

/// The precondition of calls that only need the lifecycle (checked by every write anyway).
pub fn always(_: &PillarVolumeState) -> Result<(), ControllerError> {
    Ok(())
}

/// The precondition of calls that must not reach a volume being deleted.
pub fn not_deleting(current: &PillarVolumeState) -> Result<(), ControllerError> {
    if current.status_or_default().deleting {
        return Err(ControllerError::Deleting {
            volume: current.spec.volume_id.clone(),
        });
    }
    Ok(())
}

/// A fencing token of lifecycle `uid` at `generation`.
pub fn token(uid: &str, generation: u64) -> Option<agent_api::FencingToken> {
    Some(agent_api::FencingToken {
        lifecycle_uid: uid.to_owned(),
        generation,
    })
}

impl Controller {
    /// Reads `name`'s record of lifecycle `uid`, asks `decide` what to write, and writes it by
    /// compare-and-swap; on a conflict, reads and decides again. Returns the record after the
    /// write (`None` once deleted) and what `decide` returned with the write that landed.
    pub(super) async fn compare_and_swap<T>(
        &self,
        name: &str,
        uid: &str,
        mut decide: impl FnMut(&PillarVolumeState) -> Result<(Write, T), ControllerError>,
    ) -> Result<(Option<PillarVolumeState>, T), ControllerError> {
        let gone = || ControllerError::LifecycleGone {
            volume: name.to_owned(),
        };
        for _ in 0..CAS_ATTEMPTS {
            let current = self
                .store
                .get_volume(name)
                .await?
                .filter(|v| v.metadata.uid.as_deref() == Some(uid))
                .ok_or_else(gone)?;
            let (write, out) = decide(&current)?;
            let rev = Revision::of(&current)?;
            let written = match write {
                Write::Nothing => return Ok((Some(current), out)),
                Write::Status(status) => self
                    .store
                    .replace_volume_status(name, &rev, status)
                    .await
                    .map(Some),
                Write::Spec(spec) => self
                    .store
                    .replace_volume_spec(name, &rev, spec)
                    .await
                    .map(Some),
                Write::Delete => self.store.delete_volume(name, &rev).await.map(|()| None),
            };
            match written {
                Ok(after) => return Ok((after, out)),
                Err(e) if e.is_conflict() => {
                    self.metrics.cas_conflict("PillarVolumeState");
                }
                Err(e) if e.is_lifecycle_gone() => return Err(gone()),
                Err(e) => return Err(e.into()),
            }
        }
        Err(ControllerError::Contention {
            volume: name.to_owned(),
        })
    }

    /// A status change decided from the current record: `change` edits a copy of the status, or
    /// refuses.
    pub(super) async fn update_status<T>(
        &self,
        name: &str,
        uid: &str,
        mut change: impl FnMut(
            &PillarVolumeState,
            &mut PillarVolumeStateStatus,
        ) -> Result<T, ControllerError>,
    ) -> Result<(PillarVolumeState, T), ControllerError> {
        let (after, out) = self
            .compare_and_swap(name, uid, |current| {
                let mut status = current.status_or_default();
                let out = change(current, &mut status)?;
                Ok((Write::Status(status), out))
            })
            .await?;
        let after = after.ok_or_else(|| ControllerError::LifecycleGone {
            volume: name.to_owned(),
        })?;
        Ok((after, out))
    }

    /// A fresh fencing token for `name`'s lifecycle `uid` (F2, F3), taken only while `still`
    /// holds of the record: the check and the generation bump are one compare-and-swap, so
    /// whatever another replica records after it carries a newer generation and is ordered
    /// after this token at the agent (W8). Every token is taken with a precondition; a call
    /// that needs none passes [`always`].
    pub(super) async fn next_token_if(
        &self,
        name: &str,
        uid: &str,
        still: &Precondition<'_>,
    ) -> Result<Option<agent_api::FencingToken>, ControllerError> {
        let (_, generation) = self
            .update_status(name, uid, |current, s| {
                still(current)?;
                s.publication_generation += 1;
                Ok(s.publication_generation)
            })
            .await?;
        Ok(token(uid, generation))
    }
}
