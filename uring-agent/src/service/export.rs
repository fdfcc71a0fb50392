//! Exports at the agent: export (the controller's call and each export of a resync) and
//! unexport.
//!
//! Invariants:
//! - An export is fenced, refused when its kernel lacks the authentication (W10) or the TLS it
//!   requires and when its volume does not exist, all before anything changes, the mark
//!   included. With TLS, the admitted hosts' PSKs are in the keyring before the ACL is applied.
//! - Exports use the derived identity (I1) or the recorded adopted one (I4); a live export
//!   showing another identity is adopted and recorded before the change is applied; the
//!   read-back after the change is verified against the plan (I2).
//! - A plan, once applied, leaves nothing to do: planned again from the read-back it is empty
//!   (asserted in debug builds, so the simulation and the tests catch a planner that never
//!   converges where it plans, not as a resync that rewrites the target for ever).
//! - An export that puts an ACL on a subsystem admitting any host cuts its live connections
//!   (W7).
//! - An unexport removes the subsystem and whatever only it used, checks the subsystem is gone,
//!   and forgets the adopted identity, the ports and the authentication requirement.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use pillar_nvmet::{
    ExportPlan, ExportSpec, HostAccess, HostAuth, HostNqn, Op, PortId, PortSpec, TargetState,
    VolumeId, plan_cut_connections, plan_export, plan_unexport, verify, volume_export,
};

use super::identity::{IDENTITY, apply_record, record_of, strip_writes};
use super::{Agent, AgentError, ExportRequest, Exported, Source, released_under};
use crate::backend::Backend;
use crate::fence::{Intent, Token};
use crate::target::{IdentityRecord, TargetGuard};

impl Agent {
    /// Exports the volume with the complete desired ACL.
    pub async fn export(&self, request: ExportRequest) -> Result<Exported, AgentError> {
        self.ensure_serving().await?;
        let volume = request.volume.clone();
        let exported = self.export_unchecked(request, Intent::Export).await?;
        self.unrestored_set().remove(&volume);
        Ok(exported)
    }

    /// Exports `request` under the volume's lock: fences it, decides the desired export, plans
    /// it under the target lock, applies and verifies it, and cuts what W7 requires. `export`
    /// and each export of a resync run this.
    pub(super) async fn export_unchecked(
        &self,
        request: ExportRequest,
        intent: Intent,
    ) -> Result<Exported, AgentError> {
        let volume = &request.volume;
        let backend = self.pool(&request.pool)?;
        let _lock = self.lock_volume(volume).await;
        let decision = self.check(volume, request.token.as_ref(), intent).await?;
        let auth = request.protocol.acl && request.protocol.auth;
        if request.protocol.tls {
            // Refused before anything changes, the mark included; first, as the more
            // specific reason (TLS requires authentication too).
            self.require_tls_support(volume).await?;
        }
        if auth {
            // W10: refused before anything changes, the mark included.
            self.require_auth_support(volume).await?;
        }
        let (spec, address, recorded) = self.desired_export(&request, backend).await?;
        self.commit(volume, decision).await?;
        self.export_ports_map()
            .insert(volume.clone(), spec.ports.clone());
        self.remember_export_auth(volume, Some(auth));
        let creds = if auth {
            request.credentials.clone()
        } else {
            BTreeMap::new()
        };
        if request.protocol.tls {
            // Before the ACL admits anyone: a host finds its PSK as soon as it may connect.
            self.install_psks(volume, &creds)?;
        }
        let nqn = spec.nqn.clone();
        let (guard, (mut plan, closes)) = self
            .plan_export_under_lock(volume, &spec, &creds, intent)
            .await?;
        let adopted = !plan.adoptions.is_empty();
        if adopted {
            let record = record_of(&plan.effective);
            tracing::warn!(%volume, ?plan.adoptions, "live export has a non-derived identity; keeping and recording it");
            self.target.record_identity(volume, &record).await?;
        }
        let ops = self
            .export_ops(&guard, volume, &spec, &creds, &mut plan)
            .await?;
        let released = released_under(&guard, &ops, &nqn);
        self.target.apply(&guard, ops).await?;
        let after = self.target.read_back(&guard, nqn.as_str()).await?;
        if !self.settings.kernel_random_identity {
            verify(&after, &plan.effective)?;
            debug_assert_converged(volume, &after, &plan.effective);
        }
        self.verify_host_keys(&creds)?;
        if closes {
            self.cut_after_closing(&guard, volume, &after, &spec)
                .await?;
        }
        drop(guard);
        self.target.release(nqn.as_str(), &released, &after).await?;
        tracing::info!(%volume, nqn = %spec.nqn, adopted, "exported");
        Ok(Exported {
            nqn: spec.nqn,
            address,
            identity_adopted: adopted || recorded.is_some(),
        })
    }

    /// The export `request` asks for: its volume's device (refused when the volume does not
    /// exist), the ACL, one TCP port on this node's address, and the adopted identity on record
    /// (I4), if any.
    async fn desired_export(
        &self,
        request: &ExportRequest,
        backend: &Backend,
    ) -> Result<(ExportSpec, SocketAddr, Option<IdentityRecord>), AgentError> {
        let volume = &request.volume;
        let service = request.protocol.service.get();
        let info = backend
            .lookup(volume)
            .await?
            .ok_or_else(|| AgentError::VolumeNotFound {
                volume: volume.to_string(),
                pool: request.pool.clone(),
            })?;
        let access = if request.protocol.acl {
            HostAccess::Only(request.allowed_hosts.clone())
        } else {
            HostAccess::AnyHost
        };
        let address = SocketAddr::new(self.settings.nvme_address, service);
        let port = PortSpec::tcp(address);
        let port = if request.protocol.tls {
            port.with_tls()
        } else {
            port
        };
        let ports = [(PortId::new(service), port)]
            .into_iter()
            .collect();
        let mut spec = volume_export(volume, info.device_path, access, ports);
        let recorded = self.target.identity_record(volume)?;
        if let Some(record) = &recorded {
            apply_record(&mut spec, record);
        }
        Ok((spec, address, recorded))
    }

    /// Plans `spec` under the target lock, with the hosts' keys, and tells whether the export
    /// closes a subsystem that admitted any host (W7). A resync plans from the model its own
    /// full read loaded (one read for the node, not one per export); the read-back after the
    /// change checks every export against the kernel.
    async fn plan_export_under_lock(
        &self,
        volume: &VolumeId,
        spec: &ExportSpec,
        creds: &BTreeMap<HostNqn, HostAuth>,
        intent: Intent,
    ) -> Result<(TargetGuard<'_>, (ExportPlan, bool)), AgentError> {
        let nqn = &spec.nqn;
        let source = if intent == Intent::Resync {
            Source::Model
        } else {
            Source::Kernel
        };
        self.plan_under_lock_from(
            nqn,
            source,
            &mut |view| {
                // W7: an export that turns a subsystem admitting any host into one with an
                // ACL (the protocol's `acl` turned on) must also cut the live connections:
                // a host connected while any host was admitted keeps its controller
                // otherwise, whatever the ACL says.
                let closes = matches!(spec.access, HostAccess::Only(_))
                    && view.subsystem(nqn).is_some_and(|s| s.allow_any_host);
                let mut plan = plan_export(view, spec).map_err(|source| AgentError::Plan {
                    volume: volume.to_string(),
                    source,
                })?;
                let (ops, at) = self.with_host_keys(volume, plan.ops, plan.replan_after, creds)?;
                plan.ops = ops;
                plan.replan_after = at;
                Ok((plan, closes))
            },
            |(plan, _)| &plan.ops,
        )
        .await
    }

    /// The operations of `plan` to apply. When nothing on the target showed whether it has
    /// `resv_enable` (W9), the namespace directory is created first, looked at, and the rest
    /// planned from what it shows. The test-only kernel-random mode drops the identity writes.
    async fn export_ops(
        &self,
        guard: &TargetGuard<'_>,
        volume: &VolumeId,
        spec: &ExportSpec,
        creds: &BTreeMap<HostNqn, HostAuth>,
        plan: &mut ExportPlan,
    ) -> Result<Vec<Op>, AgentError> {
        let mut ops = std::mem::take(&mut plan.ops);
        let mut live_without_reservations = std::mem::take(&mut plan.live_without_reservations);
        if let Some(at) = plan.replan_after {
            ops.truncate(at + 1);
            self.target.apply(guard, self.strip_identity(ops)).await?;
            let probed = self.target.read_back_view(guard, spec.nqn.as_str()).await?;
            let rest = plan_export(&probed, spec).map_err(|source| AgentError::Plan {
                volume: volume.to_string(),
                source,
            })?;
            ops = self.with_host_keys(volume, rest.ops, None, creds)?.0;
            live_without_reservations = rest.live_without_reservations;
        }
        if !live_without_reservations.is_empty() {
            tracing::info!(%volume, nsids = ?live_without_reservations, "namespace enabled without NVMe reservations keeps running without them (resv_enable cannot be written while enabled)");
        }
        Ok(self.strip_identity(ops))
    }

    /// `ops` without the identity writes in the test-only kernel-random mode; as they are
    /// otherwise.
    fn strip_identity(&self, ops: Vec<Op>) -> Vec<Op> {
        if self.settings.kernel_random_identity {
            strip_writes(ops, IDENTITY)
        } else {
            ops
        }
    }

    /// W7 for an export that closed a subsystem admitting any host: unlinking the subsystem
    /// from its ports deletes its controllers; only the hosts the ACL now admits reconnect.
    async fn cut_after_closing(
        &self,
        guard: &TargetGuard<'_>,
        volume: &VolumeId,
        after: &TargetState,
        spec: &ExportSpec,
    ) -> Result<(), AgentError> {
        let cut = plan_cut_connections(after, &spec.nqn, &spec.ports).map_err(|source| {
            AgentError::Plan {
                volume: volume.to_string(),
                source,
            }
        })?;
        self.target.apply(guard, cut).await?;
        tracing::info!(%volume, "export closed a subsystem that admitted any host: live connections cut");
        Ok(())
    }

    /// Removes the export and everything only it used; forgets an adopted identity.
    pub async fn unexport(
        &self,
        token: Option<Token>,
        volume: &VolumeId,
    ) -> Result<(), AgentError> {
        self.ensure_not_lost().await?;
        let _lock = self.lock_volume(volume).await;
        self.fence(volume, token.as_ref(), Intent::Unexport).await?;
        let nqn = volume.subsystem_nqn();
        let (guard, ops) = self
            .plan_under_lock(
                &nqn,
                |view| {
                    plan_unexport(view, &nqn).map_err(|source| AgentError::Plan {
                        volume: volume.to_string(),
                        source,
                    })
                },
                |ops| ops,
            )
            .await?;
        let released = released_under(&guard, &ops, &nqn);
        self.target.apply(&guard, ops).await?;
        let after = self.target.read_back(&guard, nqn.as_str()).await?;
        if after.subsystems.contains_key(nqn.as_str()) {
            return Err(AgentError::Verify(pillar_nvmet::VerifyError {
                nqn: nqn.to_string(),
                mismatches: vec![pillar_nvmet::Mismatch {
                    what: "subsystem".into(),
                    expected: "absent".into(),
                    found: "present".into(),
                }],
            }));
        }
        drop(guard);
        self.target.release(nqn.as_str(), &released, &after).await?;
        self.target.forget_identity(volume).await?;
        self.export_ports_map().remove(volume);
        self.remember_export_auth(volume, None);
        self.remove_psks(volume)?;
        self.unrestored_set().remove(volume);
        tracing::info!(%volume, "unexported");
        Ok(())
    }
}

/// Asserts, in debug builds, that `spec` planned again from `after` (the read-back of its applied
/// plan) has nothing left to do. `verify` checks the fields the spec names; this checks the
/// planner agrees with itself: an operation it plans again right after applying it is one every
/// later export and resync would repeat.
fn debug_assert_converged(volume: &VolumeId, after: &TargetState, spec: &ExportSpec) {
    if cfg!(debug_assertions) {
        let again = plan_export(after, spec).map(|p| p.ops);
        debug_assert!(
            matches!(&again, Ok(ops) if ops.is_empty()),
            "{volume}: the applied plan left work to do: {again:?}"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn spec() -> ExportSpec {
        let volume = VolumeId::parse("pvc-1").unwrap();
        let address: SocketAddr = "127.0.0.1:4420".parse().unwrap();
        let ports = [(PortId::new(4420), PortSpec::tcp(address))]
            .into_iter()
            .collect();
        volume_export(
            &volume,
            PathBuf::from("/dev/loop0"),
            HostAccess::AnyHost,
            ports,
        )
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "the applied plan left work to do")]
    fn a_target_the_plan_did_not_reach_fails_the_convergence_assertion() {
        // Nothing on the target: the export is still all to do.
        let volume = VolumeId::parse("pvc-1").unwrap();
        debug_assert_converged(&volume, &TargetState::default(), &spec());
    }
}
