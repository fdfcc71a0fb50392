//! Volumes at the agent: create, grow, delete, list, and pool capacity.
//!
//! Invariants:
//! - Create, expand and delete are fenced (`fencing`) under the volume's lock before the
//!   backend changes; a delete is refused while the volume is exported or a snapshot or clone
//!   depends on it, both checked before its lifecycle ends.
//! - A grown volume's live namespace is revalidated in the same call, so hosts see the size the
//!   call answers.

use pillar_nvmet::{NamespaceId, VolumeId, plan_revalidate};

use super::{Agent, AgentError, VolumeSize};
use crate::backend::{BackendError, Capacity, VolumeInfo};
use crate::fence::{Intent, Token};

impl Agent {
    /// Creates the volume's backing device (idempotent).
    pub async fn create_volume(
        &self,
        token: Option<Token>,
        volume: &VolumeId,
        pool: &str,
        size: VolumeSize,
    ) -> Result<VolumeInfo, AgentError> {
        let backend = self.pool(pool)?;
        self.ensure_not_lost().await?;
        let _lock = self.lock_volume(volume).await;
        self.fence(volume, token.as_ref(), Intent::Create).await?;
        Ok(backend.create(volume, size.bytes()).await?)
    }

    /// Grows the volume, and the live namespace if it is exported (`revalidate_size`).
    pub async fn expand_volume(
        &self,
        token: Option<Token>,
        volume: &VolumeId,
        pool: &str,
        size: VolumeSize,
    ) -> Result<VolumeInfo, AgentError> {
        let backend = self.pool(pool)?;
        self.ensure_not_lost().await?;
        let _lock = self.lock_volume(volume).await;
        self.fence(volume, token.as_ref(), Intent::Expand).await?;
        let info = backend.expand(volume, size.bytes()).await?;
        let nqn = volume.subsystem_nqn();
        let (guard, ops) = self
            .plan_under_lock(
                &nqn,
                |view| {
                    let live = view
                        .subsystem(&nqn)
                        .and_then(|s| s.namespaces.get(&NamespaceId::VOLUME))
                        .is_some_and(|ns| ns.enabled);
                    if !live {
                        return Ok(Vec::new());
                    }
                    plan_revalidate(view, &nqn, NamespaceId::VOLUME).map_err(|source| {
                        AgentError::Plan {
                            volume: volume.to_string(),
                            source,
                        }
                    })
                },
                |ops| ops,
            )
            .await?;
        self.target.apply(&guard, ops).await?;
        Ok(info)
    }

    /// Deletes the volume's backing device and ends its lifecycle. Refused while exported.
    pub async fn delete_volume(
        &self,
        token: Option<Token>,
        volume: &VolumeId,
        pool: &str,
    ) -> Result<(), AgentError> {
        let backend = self.pool(pool)?;
        self.ensure_not_lost().await?;
        let _lock = self.lock_volume(volume).await;
        // Reject stale requests before revealing anything about the volume.
        let decision = self.check(volume, token.as_ref(), Intent::Delete).await?;
        {
            let nqn = volume.subsystem_nqn();
            let guard = self.target.shared().await;
            if self.target.subsystem_exists(&guard, nqn.as_str()).await? {
                return Err(AgentError::StillExported {
                    volume: volume.to_string(),
                });
            }
        }
        // Refused before the lifecycle ends: a volume a snapshot or clone depends on stays
        // usable. Snapshots and clones of it take this volume's lock, so none appears between
        // this check and the delete.
        if let Some(dependent) = backend.deletion_blocked_by(volume).await? {
            return Err(BackendError::HasDependents {
                volume: volume.clone(),
                dependent,
            }
            .into());
        }
        self.commit(volume, decision).await?;
        Ok(backend.delete(volume).await?)
    }

    /// Volumes of one pool, or of all pools when `pool` is empty.
    pub async fn list_volumes(&self, pool: &str) -> Result<Vec<(String, VolumeInfo)>, AgentError> {
        let mut out = Vec::new();
        for (name, backend) in &self.pools {
            if pool.is_empty() || pool == name {
                out.extend(backend.list().await?.into_iter().map(|v| (name.clone(), v)));
            }
        }
        if !pool.is_empty() && !self.pools.contains_key(pool) {
            return Err(AgentError::UnknownPool {
                pool: pool.to_owned(),
            });
        }
        Ok(out)
    }

    /// Capacity of a pool.
    pub async fn capacity(&self, pool: &str) -> Result<Capacity, AgentError> {
        Ok(self.pool(pool)?.capacity().await?)
    }
}
