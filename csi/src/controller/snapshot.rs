//! CreateSnapshot, DeleteSnapshot, ListSnapshots and GetSnapshot: a snapshot's lifecycle.
//!
//! Invariants (the volume rules, applied to snapshots):
//! - The PillarSnapshotState is created before the agent is asked for anything (F10). Its UID
//!   and status `generation`, bumped by compare-and-swap pinned to that UID, are the snapshot's
//!   fencing token (F2, F3); the agent keeps snapshots' marks apart from volumes'.
//! - The record names the source volume's lifecycle (its UID when the snapshot was asked
//!   for): the agent cuts only that lifecycle, so a delayed request never snapshots a volume
//!   re-created under the same ID.
//! - `readyToUse` is recorded only after the agent confirmed the cut; a failed call leaves the
//!   record, which a retry of the same CreateSnapshot completes or a DeleteSnapshot removes. A
//!   cut the agent refuses for good (its source lifecycle gone, in use, too large) removes the
//!   record it left, by compare-and-swap on that record, so nothing outlives the source; a
//!   record not ready is never listed.
//! - DeleteSnapshot sets `deleting` in the compare-and-swap that takes its token: from then on
//!   no restore is recorded from it, and the agent refuses one that was (its mark has ended).
//!   The record goes only after the agent confirmed; a missing PillarAgent keeps it (C1).

use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::{ErrorReason, reason_of};
use pillar_state::crd::{
    PillarSnapshotState, PillarSnapshotStateSpec, PillarSnapshotStateStatus, PillarVolumeState,
};
use pillar_state::store::{Revision, StoreError};

use super::Controller;
use super::error::{ControllerError, agent_err, describe};
use super::record::{CAS_ATTEMPTS, token};
use super::request::{self, VolumeRef};
use crate::agents::Client;
use crate::csi;

/// The CSI view of a snapshot record.
fn csi_snapshot(s: &PillarSnapshotState) -> csi::Snapshot {
    let status = s.status_or_default();
    csi::Snapshot {
        size_bytes: i64::try_from(status.size_bytes).unwrap_or(i64::MAX),
        snapshot_id: s.spec.snapshot_id.clone(),
        source_volume_id: s.spec.source_volume_id.clone(),
        creation_time: status
            .creation_unix_seconds
            .map(|seconds| prost_types::Timestamp {
                seconds,
                nanos: status.creation_nanos,
            }),
        ready_to_use: status.ready_to_use,
        group_snapshot_id: String::new(),
    }
}

/// Whether the agent refused a cut for good, for a reason about its source that no retry of
/// the same record can change (the source lifecycle the record names is gone or not there, in
/// use where the pool cannot copy it at one point in time, or too large). A refusal that may
/// mean the agent holds something it will not adopt (an unmarked snapshot: `BackendRefused`)
/// is not: removing the record would have the agent delete it.
fn refused_for_good(e: &ControllerError) -> bool {
    let ControllerError::Agent { status, .. } = e else {
        return false;
    };
    matches!(
        reason_of(status),
        ErrorReason::SourceNotLive
            | ErrorReason::SourceInUse
            | ErrorReason::VolumeNotFound
            | ErrorReason::SizeOutOfRange
    )
}

fn lock_key(id: &str) -> String {
    // Snapshot and volume IDs are separate spaces; the lock map is shared.
    format!("snapshot/{id}")
}

impl Controller {
    /// A status change of snapshot `name` (lifecycle `uid`) decided from the current record,
    /// by compare-and-swap; re-read and re-decided on a conflict.
    async fn update_snapshot<T>(
        &self,
        name: &str,
        uid: &str,
        mut change: impl FnMut(
            &PillarSnapshotState,
            &mut PillarSnapshotStateStatus,
        ) -> Result<T, ControllerError>,
    ) -> Result<(PillarSnapshotState, T), ControllerError> {
        let gone = || ControllerError::LifecycleGone {
            volume: format!("snapshot {name}"),
        };
        for _ in 0..CAS_ATTEMPTS {
            let current = self
                .store
                .get_snapshot(name)
                .await?
                .filter(|s| s.metadata.uid.as_deref() == Some(uid))
                .ok_or_else(gone)?;
            let mut status = current.status_or_default();
            let out = change(&current, &mut status)?;
            if Some(&status) == current.status.as_ref() {
                return Ok((current, out));
            }
            match self
                .store
                .replace_snapshot_status(name, &Revision::of(&current)?, status)
                .await
            {
                Ok(after) => return Ok((after, out)),
                Err(e) if e.is_conflict() => {
                    self.metrics.cas_conflict("PillarSnapshotState");
                }
                Err(e) if e.is_lifecycle_gone() => return Err(gone()),
                Err(e) => return Err(e.into()),
            }
        }
        Err(ControllerError::Contention {
            volume: format!("snapshot {name}"),
        })
    }

    /// A fresh token of snapshot `name`, taken only while it is not being deleted (unless
    /// `for_delete`).
    async fn snapshot_token(
        &self,
        name: &str,
        uid: &str,
        for_delete: bool,
    ) -> Result<Option<agent_api::FencingToken>, ControllerError> {
        let (_, generation) = self
            .update_snapshot(name, uid, |_, s| {
                if s.deleting && !for_delete {
                    return Err(ControllerError::SnapshotDeleting(name.to_owned()));
                }
                s.deleting |= for_delete;
                s.generation += 1;
                Ok(s.generation)
            })
            .await?;
        Ok(token(uid, generation))
    }

    /// The snapshot's agent client; a missing PillarAgent fails closed.
    async fn snapshot_client(&self, s: &PillarSnapshotState) -> Result<Client, ControllerError> {
        let agent = self.store.get_agent(&s.spec.agent).await?.ok_or_else(|| {
            ControllerError::SnapshotAgentMissing {
                snapshot: s.spec.snapshot_id.clone(),
                agent: s.spec.agent.clone(),
            }
        })?;
        Ok(self.agents.client(&agent).await?)
    }

    /// Runs `call` with a fresh token; when the agent waits for a resync, resyncs it and runs
    /// it once more with another fresh token (the first is stale by then). `used` is set to the
    /// generation of the last token taken.
    async fn call_snapshot_agent<T, F, Fut>(
        &self,
        s: &PillarSnapshotState,
        what: &'static str,
        for_delete: bool,
        used: &mut u64,
        mut call: F,
    ) -> Result<T, ControllerError>
    where
        F: FnMut(Client, Option<agent_api::FencingToken>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let name = s.spec.snapshot_id.as_str();
        let uid = s.metadata.uid.clone().unwrap_or_default();
        let client = self.snapshot_client(s).await?;
        let token = self.snapshot_token(name, &uid, for_delete).await?;
        *used = token.as_ref().map_or(0, |t| t.generation);
        let first = call(client.clone(), token).await;
        match first {
            Ok(r) => return Ok(r.into_inner()),
            Err(st) if super::agent::needs_resync(&st) => {
                tracing::info!(
                    snapshot = name,
                    call = what,
                    "agent waits for a resync: {}",
                    st.message()
                );
            }
            Err(st) => return Err(agent_err(what, name)(st)),
        }
        let agent = self.store.get_agent(&s.spec.agent).await?.ok_or_else(|| {
            ControllerError::SnapshotAgentMissing {
                snapshot: name.to_owned(),
                agent: s.spec.agent.clone(),
            }
        })?;
        self.resync_agent(&agent).await?;
        let token = self.snapshot_token(name, &uid, for_delete).await?;
        *used = token.as_ref().map_or(0, |t| t.generation);
        call(client, token)
            .await
            .map(tonic::Response::into_inner)
            .map_err(agent_err(what, name))
    }

    /// CreateSnapshot: record (F10), token, the agent's cut, then `readyToUse`. A cut the
    /// agent refuses for good (its source) removes the record this call left not ready
    /// ([`Self::withdraw_refused`]).
    pub async fn create_snapshot(
        &self,
        req: csi::CreateSnapshotRequest,
    ) -> Result<csi::CreateSnapshotResponse, ControllerError> {
        let (id, source) = request::create_snapshot(&req)?;
        let name = id.to_string();
        let _lock = self.locks.lock(lock_key(&name)).await;
        let source = source.existing()?.to_string();
        let volume = self
            .store
            .get_volume(&source)
            .await?
            .ok_or_else(|| ControllerError::VolumeNotFound(source.clone()))?;
        let record = self.snapshot_record(&name, &source, &volume).await?;
        if record.status_or_default().ready_to_use {
            return Ok(csi::CreateSnapshotResponse {
                snapshot: Some(csi_snapshot(&record)),
            });
        }
        let mut used = 0;
        let cut = self
            .call_snapshot_agent(
                &record,
                "CreateSnapshot",
                false,
                &mut used,
                |mut c, token| {
                    let r = agent_api::CreateSnapshotRequest {
                        token,
                        snapshot_id: name.clone(),
                        pool: record.spec.pool.clone(),
                        source_volume_id: record.spec.source_volume_id.clone(),
                        source_lifecycle_uid: record.spec.source_uid.clone(),
                    };
                    async move { c.create_snapshot(r).await }
                },
            )
            .await;
        let cut = match cut {
            Ok(cut) => cut,
            Err(e) if refused_for_good(&e) => {
                self.withdraw_refused(&record, used).await;
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        let uid = record.metadata.uid.clone().unwrap_or_default();
        let (after, ()) = self
            .update_snapshot(&name, &uid, |_, s| {
                // A delete that started meanwhile ended the lifecycle at the agent: the cut is
                // being removed, and the caller must not be told it is ready.
                if s.deleting {
                    return Err(ControllerError::SnapshotDeleting(name.clone()));
                }
                if !s.ready_to_use {
                    s.ready_to_use = true;
                    s.size_bytes = cut.size_bytes;
                    s.creation_unix_seconds = Some(cut.creation_unix_seconds);
                    s.creation_nanos = cut.creation_nanos;
                }
                Ok(())
            })
            .await?;
        tracing::info!(snapshot = %name, source = %source, size = cut.size_bytes, method = %cut.method, "snapshot cut");
        Ok(csi::CreateSnapshotResponse {
            snapshot: Some(csi_snapshot(&after)),
        })
    }

    /// The snapshot's record for a CreateSnapshot of `source`: the existing one, or a new one
    /// recorded after finishing the removal of a refused, never-ready cut. A record of another
    /// source, or a ready one being deleted, refuses the call.
    async fn snapshot_record(
        &self,
        name: &str,
        source: &str,
        volume: &PillarVolumeState,
    ) -> Result<PillarSnapshotState, ControllerError> {
        Ok(match self.store.get_snapshot(name).await? {
            Some(s) if s.spec.source_volume_id != *source => {
                return Err(ControllerError::SnapshotExists(
                    name.to_owned(),
                    s.spec.source_volume_id,
                ));
            }
            Some(s) if s.status_or_default().deleting => {
                if s.status_or_default().ready_to_use {
                    return Err(ControllerError::SnapshotDeleting(name.to_owned()));
                }
                // A refused cut whose removal did not finish (or a delete of a snapshot never
                // cut): finish it, then record the snapshot anew.
                self.remove_snapshot(&s).await?;
                self.record_snapshot(name, volume).await?
            }
            Some(s) => s,
            None => self.record_snapshot(name, volume).await?,
        })
    }

    /// A new record of snapshot `name` of `volume` (F10), naming the volume's lifecycle.
    async fn record_snapshot(
        &self,
        name: &str,
        volume: &PillarVolumeState,
    ) -> Result<PillarSnapshotState, ControllerError> {
        if volume.status_or_default().deleting {
            return Err(ControllerError::Deleting {
                volume: volume.spec.volume_id.clone(),
            });
        }
        let spec = PillarSnapshotStateSpec {
            snapshot_id: name.to_owned(),
            source_volume_id: volume.spec.volume_id.clone(),
            source_uid: volume.metadata.uid.clone().unwrap_or_default(),
            agent: volume.spec.agent.clone(),
            pool: volume.spec.pool.clone(),
        };
        match self.store.create_snapshot(name, spec).await {
            Ok(s) => Ok(s),
            // Another replica recorded it first: the caller retries and finds it.
            Err(StoreError::AlreadyExists { .. }) => Err(ControllerError::Contention {
                volume: name.to_owned(),
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes the record of a CreateSnapshot the agent refused, by compare-and-swap on the
    /// record as the refused call left it: not ready, not being deleted, and its generation the
    /// refused call's token (otherwise another call moved it on, and it is that call's). It is
    /// marked deleting with a new token, the agent ends the snapshot's mark (a new record of the
    /// name then takes it over) and removes anything of it, and the record goes. Best-effort:
    /// a removal cut short leaves the record deleting, hidden from ListSnapshots and refused
    /// for restores; the next CreateSnapshot of the name finishes it.
    async fn withdraw_refused(&self, record: &PillarSnapshotState, refused_generation: u64) {
        let name = record.spec.snapshot_id.as_str();
        let uid = record.metadata.uid.clone().unwrap_or_default();
        let marked = self
            .update_snapshot(name, &uid, |_, s| {
                if s.ready_to_use || s.deleting || s.generation != refused_generation {
                    return Ok(None);
                }
                s.deleting = true;
                s.generation += 1;
                Ok(Some(s.generation))
            })
            .await;
        let generation = match marked {
            Ok((_, Some(generation))) => generation,
            Ok((_, None)) => {
                tracing::info!(
                    snapshot = name,
                    "refused snapshot's record moved on since; left to the call that moved it"
                );
                return;
            }
            Err(e) => {
                tracing::warn!(snapshot = name, error = %describe(&e), "refused snapshot's record not removed");
                return;
            }
        };
        let removed = async {
            let mut c = self.snapshot_client(record).await?;
            c.delete_snapshot(agent_api::DeleteSnapshotRequest {
                token: token(&uid, generation),
                snapshot_id: name.to_owned(),
                pool: record.spec.pool.clone(),
            })
            .await
            .map_err(agent_err("DeleteSnapshot", name))?;
            self.forget_snapshot(name, &uid).await
        }
        .await;
        match removed {
            Ok(()) => tracing::info!(snapshot = name, "refused snapshot's record removed"),
            Err(e) => {
                tracing::warn!(snapshot = name, error = %describe(&e), "refused snapshot's record left deleting; the next CreateSnapshot of it removes it")
            }
        }
    }

    /// DeleteSnapshot: `deleting` and a token in one compare-and-swap, the agent's delete, then
    /// the record.
    pub async fn delete_snapshot(
        &self,
        req: csi::DeleteSnapshotRequest,
    ) -> Result<csi::DeleteSnapshotResponse, ControllerError> {
        let VolumeRef::Pillar(id) = request::snapshot_ref(&req.snapshot_id)? else {
            return Ok(csi::DeleteSnapshotResponse {});
        };
        let name = id.to_string();
        let _lock = self.locks.lock(lock_key(&name)).await;
        let Some(record) = self.store.get_snapshot(&name).await? else {
            return Ok(csi::DeleteSnapshotResponse {});
        };
        self.remove_snapshot(&record).await?;
        Ok(csi::DeleteSnapshotResponse {})
    }

    /// Removes a snapshot: `deleting` and a token in one compare-and-swap, the agent's delete
    /// (it ends the mark), then the record.
    async fn remove_snapshot(&self, record: &PillarSnapshotState) -> Result<(), ControllerError> {
        let name = record.spec.snapshot_id.as_str();
        let mut used = 0;
        self.call_snapshot_agent(record, "DeleteSnapshot", true, &mut used, |mut c, token| {
            let r = agent_api::DeleteSnapshotRequest {
                token,
                snapshot_id: name.to_owned(),
                pool: record.spec.pool.clone(),
            };
            async move { c.delete_snapshot(r).await }
        })
        .await?;
        let uid = record.metadata.uid.clone().unwrap_or_default();
        self.forget_snapshot(name, &uid).await?;
        tracing::info!(snapshot = %name, "snapshot deleted");
        Ok(())
    }

    /// Deletes the record of lifecycle `uid` of snapshot `name`, by compare-and-swap; gone
    /// already (or re-created as another lifecycle) is done.
    async fn forget_snapshot(&self, name: &str, uid: &str) -> Result<(), ControllerError> {
        for _ in 0..CAS_ATTEMPTS {
            let Some(current) = self
                .store
                .get_snapshot(name)
                .await?
                .filter(|s| s.metadata.uid.as_deref() == Some(uid))
            else {
                return Ok(());
            };
            match self
                .store
                .delete_snapshot(name, &Revision::of(&current)?)
                .await
            {
                Ok(()) => return Ok(()),
                Err(e) if e.is_conflict() => {
                    self.metrics.cas_conflict("PillarSnapshotState");
                }
                Err(e) if e.is_lifecycle_gone() => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
        Err(ControllerError::Contention {
            volume: name.to_owned(),
        })
    }

    /// ListSnapshots: by snapshot ID, by source volume, or all, in pages. Only snapshots the
    /// agent cut are listed: a CreateSnapshot answers only once the cut is recorded, so a record
    /// not ready is one whose cut failed (or is running right now), which no caller was given;
    /// snapshots being deleted are not listed either.
    pub async fn list_snapshots(
        &self,
        req: csi::ListSnapshotsRequest,
    ) -> Result<csi::ListSnapshotsResponse, ControllerError> {
        let page = request::list_snapshots(&req)?;
        let mut all: Vec<PillarSnapshotState> = self
            .store
            .list_snapshots()
            .await?
            .into_iter()
            .filter(|s| {
                let status = s.status_or_default();
                status.ready_to_use && !status.deleting
            })
            .filter(|s| req.snapshot_id.is_empty() || s.spec.snapshot_id == req.snapshot_id)
            .filter(|s| {
                req.source_volume_id.is_empty() || s.spec.source_volume_id == req.source_volume_id
            })
            .collect();
        let (entries, next_token) = request::paged(&mut all, |s| &s.spec.snapshot_id, &page);
        Ok(csi::ListSnapshotsResponse {
            entries: entries
                .iter()
                .map(|s| csi::list_snapshots_response::Entry {
                    snapshot: Some(csi_snapshot(s)),
                })
                .collect(),
            next_token,
        })
    }

    /// GetSnapshot.
    pub async fn get_snapshot(
        &self,
        req: csi::GetSnapshotRequest,
    ) -> Result<csi::GetSnapshotResponse, ControllerError> {
        let id = request::snapshot_ref(&req.snapshot_id)?;
        let VolumeRef::Pillar(id) = id else {
            return Err(ControllerError::SnapshotNotFound(req.snapshot_id));
        };
        let s = self
            .store
            .get_snapshot(id.as_str())
            .await?
            .filter(|s| !s.status_or_default().deleting)
            .ok_or_else(|| ControllerError::SnapshotNotFound(id.to_string()))?;
        Ok(csi::GetSnapshotResponse {
            snapshot: Some(csi_snapshot(&s)),
        })
    }

    /// The snapshot a restore copies, checked: it exists, is ready and not being deleted.
    pub(super) async fn restorable_snapshot(
        &self,
        id: VolumeRef,
    ) -> Result<PillarSnapshotState, ControllerError> {
        let id = match id {
            VolumeRef::Pillar(id) => id.to_string(),
            VolumeRef::Unknown(id) => return Err(ControllerError::SnapshotNotFound(id)),
        };
        let s = self
            .store
            .get_snapshot(&id)
            .await?
            .ok_or_else(|| ControllerError::SnapshotNotFound(id.clone()))?;
        let status = s.status_or_default();
        if status.deleting {
            return Err(ControllerError::SnapshotNotFound(id));
        }
        if !status.ready_to_use {
            return Err(ControllerError::SnapshotNotReady(id));
        }
        Ok(s)
    }
}
