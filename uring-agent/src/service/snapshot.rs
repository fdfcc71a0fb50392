//! Snapshots, restores and clones at the agent.
//!
//! Invariants:
//! - A snapshot has a lifecycle of its own: its own token (the PillarSnapshotState's UID and
//!   generation), checked and made durable in the snapshots' marks before anything changes on
//!   the node (F5, F7 as for volumes), and ended by DeleteSnapshot.
//! - A source is used only as the live lifecycle the caller recorded: its mark exists, names
//!   that UID and has not ended. A delayed request cannot snapshot or copy a re-created volume
//!   or snapshot of the same ID. The source is checked under its lock, which is held until the
//!   copy is done, so the source cannot be deleted, granted or restored meanwhile.
//! - Lock order: volume locks (by ID) before snapshot locks, so no two operations wait on each
//!   other in a cycle.
//! - A backend whose snapshot is a copy (a file pool) copies a volume a host may write (a
//!   namespace enabled) only by reflink, one point in time: the copy itself decides, between
//!   the very two files, and a copy that cannot be a reflink is refused, never made run by run.
//!   A volume no host can write (its namespace disabled: no host admitted, W7) is copied any
//!   way. The volume lock held across the check and the copy keeps a grant out until the copy
//!   is done.

use pillar_nvmet::VolumeId;

use super::{Agent, AgentError, VolumeSize};
use crate::backend::{
    Backend, BackendError, ContentSource, CopyInto, CopyPolicy, SnapshotInfo, VolumeInfo,
};
use crate::fence::{Intent, MarkStore, Token};

impl Agent {
    /// Cuts `snapshot` of `source` (lifecycle `source_uid`) in `pool`. Idempotent.
    pub async fn create_snapshot(
        &self,
        token: Option<Token>,
        snapshot: &VolumeId,
        pool: &str,
        source: &VolumeId,
        source_uid: &str,
    ) -> Result<SnapshotInfo, AgentError> {
        let backend = self.pool(pool)?;
        // Refused before any lock or mark when the pool takes no snapshots at all.
        backend.snapshots_supported()?;
        self.ensure_not_lost().await?;
        let _source = self.lock_volume(source).await;
        let _snapshot = self.snapshot_locks.lock(snapshot.clone()).await;
        let decision = self
            .check_in(
                &self.snapshot_marks,
                snapshot,
                token.as_ref(),
                Intent::Create,
            )
            .await?;
        if backend.lookup_snapshot(snapshot).await?.is_some() {
            match self.snapshot_marks.read(snapshot)? {
                // This lifecycle's retry: its mark was written before the cut; a newer token
                // still moves it on.
                Some(mark) if token.as_ref().is_some_and(|t| t.uid == mark.owner_uid) => {
                    self.commit_in(&self.snapshot_marks, snapshot, decision)
                        .await?;
                    // Cut already: returned as it is, no copy is made.
                    return Ok(backend
                        .create_snapshot(source, snapshot, CopyPolicy::AtOnce)
                        .await?);
                }
                // Left by a delete interrupted after its mark ended the old lifecycle: that
                // lifecycle is over, so its content goes before the new one is cut.
                Some(mark) if mark.ended => backend.delete_snapshot(snapshot).await?,
                _ => {
                    return Err(AgentError::UnmarkedSnapshot {
                        snapshot: snapshot.to_string(),
                    });
                }
            }
        }
        live(&self.marks, "volume", source, source_uid)?;
        let policy = self
            .copy_policy(backend, source, pool, CopyInto::Snapshot)
            .await?;
        self.commit_in(&self.snapshot_marks, snapshot, decision)
            .await?;
        backend
            .create_snapshot(source, snapshot, policy)
            .await
            .map_err(|e| in_use(e, source, pool))
    }

    /// Ends `snapshot`'s lifecycle and removes it. Idempotent.
    pub async fn delete_snapshot(
        &self,
        token: Option<Token>,
        snapshot: &VolumeId,
        pool: &str,
    ) -> Result<(), AgentError> {
        let backend = self.pool(pool)?;
        self.ensure_not_lost().await?;
        let _snapshot = self.snapshot_locks.lock(snapshot.clone()).await;
        let decision = self
            .check_in(
                &self.snapshot_marks,
                snapshot,
                token.as_ref(),
                Intent::Delete,
            )
            .await?;
        if self.snapshot_marks.read(snapshot)?.is_none()
            && backend.lookup_snapshot(snapshot).await?.is_some()
        {
            // C6: a snapshot without a mark lost it; no token can be judged against it.
            return Err(AgentError::Unclaimed {
                volume: snapshot.to_string(),
            });
        }
        self.commit_in(&self.snapshot_marks, snapshot, decision)
            .await?;
        Ok(backend.delete_snapshot(snapshot).await?)
    }

    /// Creates `volume` with the content of `source` (lifecycle `source_uid`), at least
    /// `size`. Idempotent.
    pub async fn create_volume_from(
        &self,
        token: Option<Token>,
        volume: &VolumeId,
        pool: &str,
        size: VolumeSize,
        source: &ContentSource,
        source_uid: &str,
    ) -> Result<VolumeInfo, AgentError> {
        let backend = self.pool(pool)?;
        if let ContentSource::Volume(id) = source
            && id == volume
        {
            return Err(AgentError::InvalidArgument {
                field: "source.volume_id",
                reason: "a volume cannot be cloned into itself".into(),
            });
        }
        // Refused before any lock or mark when the pool takes no snapshots at all.
        backend.snapshots_supported()?;
        self.ensure_not_lost().await?;
        // Volume locks in ID order, then the snapshot's.
        let (_first, _second, _snapshot) = match source {
            ContentSource::Volume(id) => {
                let (a, b) = if id < volume {
                    (id, volume)
                } else {
                    (volume, id)
                };
                let first = self.lock_volume(a).await;
                (first, Some(self.lock_volume(b).await), None)
            }
            ContentSource::Snapshot(id) => {
                let first = self.lock_volume(volume).await;
                (
                    first,
                    None,
                    Some(self.snapshot_locks.lock(id.clone()).await),
                )
            }
        };
        let decision = self.check(volume, token.as_ref(), Intent::Create).await?;
        // A snapshot is never written: any copy of it is one point in time.
        let mut policy = CopyPolicy::AnyWay;
        if backend.lookup(volume).await?.is_none() {
            match source {
                ContentSource::Snapshot(id) => {
                    live(&self.snapshot_marks, "snapshot", id, source_uid)?
                }
                ContentSource::Volume(id) => {
                    live(&self.marks, "volume", id, source_uid)?;
                    policy = self
                        .copy_policy(backend, id, pool, CopyInto::Volume)
                        .await?;
                }
            }
        }
        self.commit(volume, decision).await?;
        backend
            .create_from(volume, size.bytes(), source, policy)
            .await
            .map_err(|e| in_use(e, source.id(), pool))
    }

    /// How a copy of `volume` into `into` may be made: any way while no namespace of it is
    /// enabled (no host admitted, W7: nobody writes it), only as one point in time otherwise.
    /// Refused at once, before the caller's mark moves, where a probe between the directories
    /// the copy uses says the pool cannot copy at once; the copy itself still decides
    /// ([`CopyPolicy::AtOnce`]: refused, not copied run by run).
    async fn copy_policy(
        &self,
        backend: &Backend,
        volume: &VolumeId,
        pool: &str,
        into: CopyInto,
    ) -> Result<CopyPolicy, AgentError> {
        let nqn = volume.subsystem_nqn();
        let in_use = {
            let guard = self.target.shared().await;
            let state = self.target.read_back(&guard, nqn.as_str()).await?;
            state
                .subsystems
                .get(nqn.as_str())
                .is_some_and(|s| s.namespaces.values().any(|ns| ns.enabled))
        };
        if !in_use {
            return Ok(CopyPolicy::AnyWay);
        }
        if !backend.copies_at_once(into).await? {
            return Err(AgentError::SourceInUse {
                volume: volume.to_string(),
                pool: pool.to_owned(),
            });
        }
        Ok(CopyPolicy::AtOnce)
    }
}

/// A copy refused because it could not be one point in time ([`BackendError::NotAtOnce`]) is
/// the caller's [`AgentError::SourceInUse`].
fn in_use(e: BackendError, volume: &VolumeId, pool: &str) -> AgentError {
    match e {
        BackendError::NotAtOnce { .. } => {
            tracing::warn!(%volume, error = %e, "a copy of a volume in use could not be made at once");
            AgentError::SourceInUse {
                volume: volume.to_string(),
                pool: pool.to_owned(),
            }
        }
        other => other.into(),
    }
}

/// Checks that `id`'s mark in `marks` is the live lifecycle `uid`.
fn live(marks: &MarkStore, what: &'static str, id: &VolumeId, uid: &str) -> Result<(), AgentError> {
    match marks.read(id)? {
        Some(mark) if mark.owner_uid == uid && !mark.ended && !uid.is_empty() => Ok(()),
        _ => Err(AgentError::SourceNotLive {
            what,
            id: id.to_string(),
            uid: uid.to_owned(),
        }),
    }
}
