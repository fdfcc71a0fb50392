//! The agent's operations, independent of gRPC.
//!
//! Invariants:
//! - Every mutating operation takes the volume's lock, reads the fencing mark, decides, makes the
//!   new mark durable, and applies the change, all before releasing the lock (F5, F7). A
//!   rejected request changes nothing. The mark is written before the target lock is taken,
//!   so no volume's fsync holds up another volume's configfs change.
//! - The target lock is shared by changes confined to their own subsystem and exclusive for
//!   changes of ports and host entries (`Target`, `plan_under_lock`): operations on different
//!   volumes run concurrently, and their engine work shares submissions and group commits.
//! - Requests arrive parsed: volume IDs, host NQNs, ports and sizes are typed values, checked at
//!   the gRPC edge (`grpc`) before anything here runs, so a malformed request changes nothing.
//! - After a start the agent is `WaitingForResync`: it creates no export and grants nothing until
//!   the controller has sent the complete export state of this node (C3).
//! - An agent whose state was lost is `StateLost` and changes nothing until the controller has
//!   re-seeded its marks (C6, `loss`): a missing mark is believed only when it cannot be a lost
//!   one.
//! - Exports use the derived identity (I1), or the recorded adopted one (I4); the identity is set
//!   before enable and read back after every change (I2), and never changed on a live namespace
//!   (I3, enforced by the planner).
//! - A grant or revoke changes the ACL (`plan_acl`) and the subsystem's port links, nothing
//!   else: whatever the namespace shows, an ACL change never removes or rewrites it.
//! - A revoke under `acl` removes the host from the ACL and then cuts the subsystem's live
//!   connections, so the revoked host can no longer do I/O when the call returns (W7). The cut
//!   links the subsystem back to the ports its export belongs on (`export_ports`), and a grant
//!   makes sure it is on them: a cut that failed between its unlink and its link is finished by
//!   the next revoke or grant, never answered OK with the export on no port.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU16;
use std::sync::Arc;

use pillar_lock_by_id::{IdGuard, LockById};
use pillar_nvmet::{
    ExportSpec, HostAccess, HostNqn, NamespaceId, NamespaceIdentity, PortId, PortSpec,
    SubsystemNqn, VolumeId, plan_acl, plan_cut_connections, plan_export, plan_links,
    plan_revalidate, plan_unexport, verify, verify_acl, verify_links, volume_export,
};
use pillar_nvmet::{HostAuth, Op, Released, TargetState};
use tokio::sync::RwLock;

use crate::backend::{Backend, BackendError, Capacity, MAX_VOLUME_BYTES, VolumeInfo};
use crate::engine::Engine;
use crate::fence::{Decision, Intent, MarkError, MarkStore, Rejection, Token, decide};
use crate::hooks::{HookPoint, Hooks};
use crate::metrics::Metrics;
use crate::target::{IdentityRecord, Target, TargetError, TargetGuard, touches_shared};

/// How many exports a resync applies at once: enough that the engine gathers their configfs
/// chains and mark writes into shared submissions and group commits.
const RESYNC_IN_FLIGHT: usize = 64;

mod auth;
mod loss;
mod snapshot;

/// Why an agent operation failed. Mapped to gRPC codes once, in `grpc`.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },
    #[error("unknown pool {pool:?}")]
    UnknownPool { pool: String },
    #[error(transparent)]
    Fenced(#[from] Rejection),
    #[error(transparent)]
    Mark(#[from] MarkError),
    #[error(
        "the agent restarted and waits for the controller's export resync; it creates no export until then"
    )]
    WaitingForResync,
    #[error(
        "the agent's state directory was lost (it holds volumes without fencing marks, or its \
         state identity vanished); it changes nothing until the controller re-seeds the marks \
         with a resync carrying the state epoch its Health reports"
    )]
    StateLost,
    #[error(
        "{volume} is held on this node without a fencing mark and the controller's resync after \
         the state loss did not claim it; refusing every change to it (an operator decides)"
    )]
    Unclaimed { volume: String },
    #[error("the state directory cannot be opened again after it was lost")]
    StateDir(#[source] crate::engine::EngineError),
    #[error(transparent)]
    StateIdentity(#[from] crate::state::StateError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("volume {volume} does not exist in pool {pool:?}")]
    VolumeNotFound { volume: String, pool: String },
    #[error("volume {volume} is not exported")]
    NotExported { volume: String },
    #[error("volume {volume} is still exported; unexport it before deleting")]
    StillExported { volume: String },
    #[error("no safe configfs plan for {volume}")]
    Plan {
        volume: String,
        source: pillar_nvmet::PlanError,
    },
    #[error(
        "allowed_hosts of {volume} holds {host:?}, which is not a host NQN pillar writes; refusing \
         to change an ACL someone else edited"
    )]
    ForeignAclEntry { volume: String, host: String },
    #[error(transparent)]
    Target(#[from] TargetError),
    #[error("read-back after the change does not match")]
    Verify(#[from] pillar_nvmet::VerifyError),
    #[error("the request's task failed (a panic, or the agent is shutting down)")]
    Task(#[source] tokio::task::JoinError),
    #[error(
        "{what} {id} is not the live lifecycle {uid:?} here (deleted, never made, or re-created)"
    )]
    SourceNotLive {
        what: &'static str,
        id: String,
        uid: String,
    },
    #[error(
        "volume {volume} is in use and pool {pool:?} cannot reflink: a copy of it would not be one \
         point in time; retry once it is unpublished"
    )]
    SourceInUse { volume: String, pool: String },
    #[error(
        "volume {volume}'s export requires DH-HMAC-CHAP, but this node's kernel has no NVMe \
         in-band authentication (host entries have no dhchap_key: CONFIG_NVME_TARGET_AUTH is \
         not set): refusing rather than admitting hosts on their NQN alone; set `auth: none` \
         on the PillarProtocol to opt out (visibly), or serve the pool from a kernel with it"
    )]
    AuthUnsupported { volume: String },
    #[error(
        "snapshot {snapshot} exists in the pool but has no fencing mark (the agent's state was \
         lost?); refusing to adopt it"
    )]
    UnmarkedSnapshot { snapshot: String },
}

/// Whether the agent serves exports yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readiness {
    WaitingForResync,
    Serving,
    /// The state directory was lost (C6): every mutating call is refused until a resync
    /// carrying the current state epoch re-seeds the marks.
    StateLost,
}

/// How hosts reach an export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Protocol {
    /// The TCP service hosts connect to; also the nvmet port ID.
    pub service: NonZeroU16,
    pub acl: bool,
    /// With `acl`: every admitted host must authenticate (DH-HMAC-CHAP, W10).
    pub auth: bool,
}

/// A volume size the backends accept: 1 byte to [`MAX_VOLUME_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VolumeSize(u64);

impl VolumeSize {
    /// `bytes` as a volume size, or `None` when it is 0 or above [`MAX_VOLUME_BYTES`].
    pub fn new(bytes: u64) -> Option<Self> {
        (bytes != 0 && bytes <= MAX_VOLUME_BYTES).then_some(Self(bytes))
    }

    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

/// One export as the controller wants it.
#[derive(Clone, Debug)]
pub struct ExportRequest {
    pub token: Option<Token>,
    pub volume: VolumeId,
    pub pool: String,
    pub protocol: Protocol,
    /// With `acl`, the hosts admitted from the start.
    pub allowed_hosts: BTreeSet<HostNqn>,
    /// With `acl` and `auth`, the credentials of each allowed host.
    pub credentials: BTreeMap<HostNqn, HostAuth>,
}

/// The result of an export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exported {
    pub nqn: SubsystemNqn,
    pub address: SocketAddr,
    pub identity_adopted: bool,
}

/// One volume's outcome in a resync.
#[derive(Debug)]
pub struct ResyncOutcome {
    pub volume: VolumeId,
    pub result: Result<Exported, AgentError>,
}

/// What ListExports reports.
#[derive(Clone, Debug)]
pub struct ExportSummary {
    pub volume: VolumeId,
    pub nqn: String,
    pub device_path: String,
    pub acl: bool,
    pub allowed_hosts: Vec<String>,
    pub services: Vec<u16>,
    pub enabled: bool,
}

/// Settings the agent needs besides its parts.
#[derive(Clone, Debug)]
pub struct AgentSettings {
    /// Where hosts connect (the `addr_traddr` of every port this agent creates).
    pub nvme_address: IpAddr,
    /// Test-only: leave namespace identity and serial to the kernel (random), to show what
    /// stable identity prevents. Never for production.
    pub kernel_random_identity: bool,
    /// Test-only: a revoke only removes the host from the ACL (no namespace drain, no cut of
    /// live connections), to show what W7 prevents. Never for production.
    pub unsafe_revoke_acl_only: bool,
    /// Test hooks; inert unless a `fault-injection` build arms them.
    pub hooks: Hooks,
}

/// The agent.
pub struct Agent {
    engine: Arc<Engine>,
    marks: MarkStore,
    /// Snapshots' marks, apart from volumes' (a snapshot ID may equal a volume ID).
    snapshot_marks: MarkStore,
    target: Target,
    pools: BTreeMap<String, Backend>,
    locks: LockById<VolumeId>,
    /// Per-snapshot locks; taken after any volume lock of the same operation.
    snapshot_locks: LockById<VolumeId>,
    readiness: RwLock<Readiness>,
    /// Exports the last resync could not restore, until an Export or Unexport of them succeeds.
    unrestored: std::sync::Mutex<BTreeSet<VolumeId>>,
    /// The ports each export belongs on, as its last Export or resync asked, until its
    /// Unexport: a revoke's cut links the subsystem back to them and a grant makes sure it is on
    /// them, whatever links a failed cut left. In memory only: after a restart, the resync
    /// re-exports (and relinks) every export before any grant is served.
    export_ports: std::sync::Mutex<BTreeMap<VolumeId, Ports>>,
    /// Whether each export requires authentication, as its last Export or resync asked (W10):
    /// a grant on one that does must carry credentials. In memory, like `export_ports`.
    export_auth: std::sync::Mutex<BTreeMap<VolumeId, bool>>,
    /// Whether the kernel has NVMe in-band authentication, once looked at (`auth`).
    auth_supported: std::sync::OnceLock<bool>,
    boot_id: String,
    /// The state directory's identity (C6).
    state_id: crate::state::StateIdentity,
    /// Volumes held here without a mark since the last loss: refused unless re-seeded.
    unmarked: std::sync::Mutex<BTreeSet<VolumeId>>,
    /// While `StateLost`: the epoch a re-seeding resync must carry.
    loss_epoch: std::sync::Mutex<Option<String>>,
    /// One re-initialisation of a state directory lost under the agent at a time.
    loss_lock: tokio::sync::Mutex<()>,
    settings: AgentSettings,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("engine", &self.engine.name())
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl Agent {
    /// Assembles an agent. It starts `WaitingForResync`;
    /// [`detect_loss_at_start`](Self::detect_loss_at_start) decides whether its state was lost.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        engine: Arc<Engine>,
        state_id: crate::state::StateIdentity,
        marks: MarkStore,
        snapshot_marks: MarkStore,
        target: Target,
        pools: BTreeMap<String, Backend>,
        settings: AgentSettings,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            engine,
            marks,
            snapshot_marks,
            target,
            pools,
            locks: LockById::new(),
            snapshot_locks: LockById::new(),
            readiness: RwLock::new(Readiness::WaitingForResync),
            unrestored: std::sync::Mutex::new(BTreeSet::new()),
            export_ports: std::sync::Mutex::new(BTreeMap::new()),
            export_auth: std::sync::Mutex::new(BTreeMap::new()),
            auth_supported: std::sync::OnceLock::new(),
            boot_id: uuid::Uuid::new_v4().to_string(),
            state_id,
            unmarked: std::sync::Mutex::new(BTreeSet::new()),
            loss_epoch: std::sync::Mutex::new(None),
            loss_lock: tokio::sync::Mutex::new(()),
            settings,
            metrics,
        }
    }

    /// The test hooks this agent was built with.
    pub fn hooks(&self) -> &Hooks {
        &self.settings.hooks
    }

    /// The engine in use.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The target in use.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Pools and their backend kinds.
    pub fn pools(&self) -> impl Iterator<Item = (&str, &'static str)> {
        self.pools.iter().map(|(n, b)| (n.as_str(), b.kind_name()))
    }

    /// Changes at every start.
    pub fn boot_id(&self) -> &str {
        &self.boot_id
    }

    /// Serving or waiting for resync.
    pub async fn readiness(&self) -> Readiness {
        *self.readiness.read().await
    }

    /// Volumes whose export the last resync could not restore.
    pub fn unrestored(&self) -> Vec<VolumeId> {
        self.unrestored_set().iter().cloned().collect()
    }

    fn unrestored_set(&self) -> std::sync::MutexGuard<'_, BTreeSet<VolumeId>> {
        self.unrestored
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn export_ports_map(&self) -> std::sync::MutexGuard<'_, BTreeMap<VolumeId, Ports>> {
        self.export_ports
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The ports `volume`'s export belongs on; empty when unknown (not exported since the
    /// start): then only the links configfs shows are kept.
    fn ports_of(&self, volume: &VolumeId) -> Ports {
        self.export_ports_map()
            .get(volume)
            .cloned()
            .unwrap_or_default()
    }

    fn pool(&self, name: &str) -> Result<&Backend, AgentError> {
        self.pools.get(name).ok_or_else(|| AgentError::UnknownPool {
            pool: name.to_owned(),
        })
    }

    async fn lock_volume(&self, volume: &VolumeId) -> IdGuard<VolumeId> {
        self.locks.lock(volume.clone()).await
    }

    /// Checks the token against the volume's mark, without writing anything. Must be called
    /// with the volume lock held, and the decision committed under the same lock.
    async fn check(
        &self,
        volume: &VolumeId,
        token: Option<&Token>,
        intent: Intent,
    ) -> Result<Decision, AgentError> {
        self.check_in(&self.marks, volume, token, intent).await
    }

    /// [`check`](Self::check) against the marks of `marks` (volumes' or snapshots').
    async fn check_in(
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
    async fn commit(&self, volume: &VolumeId, decision: Decision) -> Result<(), AgentError> {
        self.commit_in(&self.marks, volume, decision).await
    }

    /// [`commit`](Self::commit) into `marks`.
    async fn commit_in(
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
    async fn fence(
        &self,
        volume: &VolumeId,
        token: Option<&Token>,
        intent: Intent,
    ) -> Result<(), AgentError> {
        let decision = self.check(volume, token, intent).await?;
        self.commit(volume, decision).await
    }

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

    async fn ensure_serving(&self) -> Result<(), AgentError> {
        match *self.readiness.read().await {
            Readiness::Serving => Ok(()),
            Readiness::WaitingForResync => Err(AgentError::WaitingForResync),
            Readiness::StateLost => Err(AgentError::StateLost),
        }
    }

    /// Exports the volume with the complete desired ACL.
    pub async fn export(&self, request: ExportRequest) -> Result<Exported, AgentError> {
        self.ensure_serving().await?;
        let volume = request.volume.clone();
        let exported = self.export_unchecked(request, Intent::Export).await?;
        self.unrestored_set().remove(&volume);
        Ok(exported)
    }

    async fn export_unchecked(
        &self,
        request: ExportRequest,
        intent: Intent,
    ) -> Result<Exported, AgentError> {
        let volume = &request.volume;
        let service = request.protocol.service.get();
        let backend = self.pool(&request.pool)?;
        let _lock = self.lock_volume(volume).await;
        let decision = self.check(volume, request.token.as_ref(), intent).await?;
        let auth = request.protocol.acl && request.protocol.auth;
        if auth {
            // W10: refused before anything changes, the mark included.
            self.require_auth_support(volume).await?;
        }
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
        let ports = [(PortId::new(service), PortSpec::tcp(address))]
            .into_iter()
            .collect();
        let mut spec = volume_export(volume, info.device_path, access, ports);
        let recorded = self.target.identity_record(volume)?;
        if let Some(record) = &recorded {
            apply_record(&mut spec, record);
        }
        self.commit(volume, decision).await?;
        self.export_ports_map()
            .insert(volume.clone(), spec.ports.clone());
        self.remember_export_auth(volume, Some(auth));
        let creds = if auth {
            request.credentials.clone()
        } else {
            BTreeMap::new()
        };
        let nqn = spec.nqn.clone();
        // A resync plans from the model its own full read loaded (one read for the node, not
        // one per export); the read-back below checks every export against the kernel.
        let source = if intent == Intent::Resync {
            Source::Model
        } else {
            Source::Kernel
        };
        let (guard, (plan, closes)) = self
            .plan_under_lock_from(
                &nqn,
                source,
                &mut |view| {
                    // W7: an export that turns a subsystem admitting any host into one with an
                    // ACL (the protocol's `acl` turned on) must also cut the live connections:
                    // a host connected while any host was admitted keeps its controller
                    // otherwise, whatever the ACL says.
                    let closes = matches!(spec.access, HostAccess::Only(_))
                        && view.subsystem(&nqn).is_some_and(|s| s.allow_any_host);
                    let mut plan = plan_export(view, &spec).map_err(|source| AgentError::Plan {
                        volume: volume.to_string(),
                        source,
                    })?;
                    let (ops, at) =
                        self.with_host_keys(volume, plan.ops, plan.replan_after, &creds)?;
                    plan.ops = ops;
                    plan.replan_after = at;
                    Ok((plan, closes))
                },
                |(plan, _)| &plan.ops,
            )
            .await?;
        let adopted = !plan.adoptions.is_empty();
        if adopted {
            let record = record_of(&plan.effective);
            tracing::warn!(%volume, ?plan.adoptions, "live export has a non-derived identity; keeping and recording it");
            self.target.record_identity(volume, &record).await?;
        }
        let strip = |ops| {
            if self.settings.kernel_random_identity {
                strip_writes(ops, IDENTITY)
            } else {
                ops
            }
        };
        let mut ops = plan.ops;
        let mut live_without_reservations = plan.live_without_reservations;
        if let Some(at) = plan.replan_after {
            // W9: nothing on the target showed whether it has `resv_enable`; create the
            // namespace directory, look at it, and plan the rest from what it shows.
            ops.truncate(at + 1);
            self.target.apply(&guard, strip(ops)).await?;
            let probed = self.target.read_back_view(&guard, nqn.as_str()).await?;
            let rest = plan_export(&probed, &spec).map_err(|source| AgentError::Plan {
                volume: volume.to_string(),
                source,
            })?;
            ops = self.with_host_keys(volume, rest.ops, None, &creds)?.0;
            live_without_reservations = rest.live_without_reservations;
        }
        if !live_without_reservations.is_empty() {
            tracing::info!(%volume, nsids = ?live_without_reservations, "namespace enabled without NVMe reservations keeps running without them (resv_enable cannot be written while enabled)");
        }
        let ops = strip(ops);
        let released = released_under(&guard, &ops, &nqn);
        self.target.apply(&guard, ops).await?;
        let after = self.target.read_back(&guard, nqn.as_str()).await?;
        if !self.settings.kernel_random_identity {
            verify(&after, &plan.effective)?;
        }
        self.verify_host_keys(&creds)?;
        if closes {
            // Unlinking the subsystem from its ports deletes its controllers; only the hosts
            // the ACL now admits reconnect.
            let cut = plan_cut_connections(&after, &nqn, &spec.ports).map_err(|source| {
                AgentError::Plan {
                    volume: volume.to_string(),
                    source,
                }
            })?;
            self.target.apply(&guard, cut).await?;
            tracing::info!(%volume, "export closed a subsystem that admitted any host: live connections cut");
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
        self.unrestored_set().remove(volume);
        tracing::info!(%volume, "unexported");
        Ok(())
    }

    /// Admits a host (with `acl`; without it any host is admitted already). With `creds` its
    /// host entry gets the keys first (or new keys: a rotation); an export that requires
    /// authentication refuses a grant without them (W10).
    pub async fn grant(
        &self,
        token: Option<Token>,
        volume: &VolumeId,
        host: &HostNqn,
        creds: Option<HostAuth>,
    ) -> Result<(), AgentError> {
        self.ensure_serving().await?;
        if creds.is_none() && self.export_requires_auth(volume) {
            return Err(AgentError::InvalidArgument {
                field: "credentials",
                reason: format!(
                    "volume {volume}'s export requires DH-HMAC-CHAP: a grant of {host} must \
                     carry the host's credentials"
                ),
            });
        }
        if creds.is_some() {
            self.require_auth_support(volume).await?;
        }
        let creds: BTreeMap<HostNqn, HostAuth> =
            creds.map(|c| (host.clone(), c)).into_iter().collect();
        self.change_acl(token, volume, host, Intent::Grant, &creds)
            .await
    }

    /// Removes a host from the ACL and cuts its live connections.
    pub async fn revoke(
        &self,
        token: Option<Token>,
        volume: &VolumeId,
        host: &HostNqn,
    ) -> Result<(), AgentError> {
        self.ensure_not_lost().await?;
        self.change_acl(token, volume, host, Intent::Revoke, &BTreeMap::new())
            .await
    }

    async fn change_acl(
        &self,
        token: Option<Token>,
        volume: &VolumeId,
        host: &HostNqn,
        intent: Intent,
        creds: &BTreeMap<HostNqn, HostAuth>,
    ) -> Result<(), AgentError> {
        let _lock = self.lock_volume(volume).await;
        let decision = self.check(volume, token.as_ref(), intent).await?;
        self.commit(volume, decision).await?;
        let nqn = volume.subsystem_nqn();
        let acl_only = intent == Intent::Revoke && self.settings.unsafe_revoke_acl_only;
        let ports = self.ports_of(volume);
        let plan_error = |source| AgentError::Plan {
            volume: volume.to_string(),
            source,
        };
        let (guard, (ops, access)) = self
            .plan_under_lock(
                &nqn,
                |view| {
                    let planned = self.plan_acl_change(view, volume, host, intent, acl_only)?;
                    // Removing the host from allowed_hosts stops new connections only;
                    // unlinking the subsystem from its ports deletes its controllers, and only
                    // allowed hosts reconnect. The cut links it back to the ports its export
                    // belongs on, not only to those it is on now: a retry after a cut that
                    // failed half-way finishes it. A grant makes sure the subsystem is on them.
                    let links = match intent {
                        Intent::Revoke if planned.is_some() && !acl_only => {
                            plan_cut_connections(view, &nqn, &ports).map_err(plan_error)?
                        }
                        Intent::Revoke => Vec::new(),
                        _ => plan_links(view, &nqn, &ports).map_err(plan_error)?,
                    };
                    let (mut ops, access) =
                        planned.map_or((Vec::new(), None), |(ops, access)| (ops, Some(access)));
                    if access.is_some() {
                        ops = self.with_host_keys(volume, ops, None, creds)?.0;
                    }
                    ops.extend(links);
                    Ok((ops, access))
                },
                |(ops, _)| ops.as_slice(),
            )
            .await?;
        if ops.is_empty() && access.is_none() {
            return Ok(());
        }
        // The ACL first; a revoke that leaves nobody admitted ends it with the namespace
        // disabled: the kernel returns from that write only once every command in flight on it
        // has completed; then the cut.
        let released = released_under(&guard, &ops, &nqn);
        self.target.apply(&guard, ops).await?;
        let after = self.target.read_back(&guard, nqn.as_str()).await?;
        if let Some(access) = &access {
            verify_acl(&after, &nqn, access)?;
            self.verify_host_keys(creds)?;
        }
        if !acl_only {
            verify_links(&after, &nqn, &ports)?;
        }
        drop(guard);
        self.target.release(nqn.as_str(), &released, &after).await?;
        tracing::info!(%volume, %host, ?intent, "ACL changed");
        Ok(())
    }

    /// The ACL change of `intent` for `host` on what `view` shows: `None` when there is nothing
    /// to change (a revoke of a volume not exported here; `acl: false`, where the controller's
    /// publication record is the only guard and cutting connections would keep nobody out).
    fn plan_acl_change(
        &self,
        view: &TargetState,
        volume: &VolumeId,
        host: &HostNqn,
        intent: Intent,
        acl_only: bool,
    ) -> Result<Option<(Vec<Op>, HostAccess)>, AgentError> {
        let nqn = volume.subsystem_nqn();
        let Some(sub) = view.subsystem(&nqn) else {
            if intent == Intent::Revoke {
                // Nothing exported: nobody can reach the volume through this node.
                return Ok(None);
            }
            return Err(AgentError::NotExported {
                volume: volume.to_string(),
            });
        };
        if sub.allow_any_host {
            return Ok(None);
        }
        let mut hosts = sub
            .allowed_hosts
            .iter()
            .map(|h| {
                h.parse::<HostNqn>()
                    .map_err(|_| AgentError::ForeignAclEntry {
                        volume: volume.to_string(),
                        host: h.clone(),
                    })
            })
            .collect::<Result<BTreeSet<_>, _>>()?;
        if intent == Intent::Grant {
            hosts.insert(host.clone());
        } else {
            hosts.remove(host);
        }
        let access = HostAccess::Only(hosts);
        let expected = self.expected_identities(volume, sub)?;
        let ops = plan_acl(view, &nqn, &access, &expected).map_err(|source| AgentError::Plan {
            volume: volume.to_string(),
            source,
        })?;
        let ops = if acl_only {
            strip_writes(ops, ENABLE)
        } else {
            ops
        };
        Ok(Some((ops, access)))
    }

    /// Takes the target lock and plans with `plan` on the state of `nqn`: under the shared lock
    /// when the plan stays inside the subsystem, under the exclusive lock when it creates,
    /// removes or configures a port or host entry, or the model must be loaded first; planned
    /// again after switching, since the state may have changed meanwhile.
    async fn plan_under_lock<P>(
        &self,
        nqn: &SubsystemNqn,
        mut plan: impl FnMut(&TargetState) -> Result<P, AgentError>,
        ops: impl Fn(&P) -> &[Op],
    ) -> Result<(TargetGuard<'_>, P), AgentError> {
        self.plan_under_lock_from(nqn, Source::Kernel, &mut plan, ops)
            .await
    }

    async fn plan_under_lock_from<P>(
        &self,
        nqn: &SubsystemNqn,
        source: Source,
        plan: &mut impl FnMut(&TargetState) -> Result<P, AgentError>,
        ops: impl Fn(&P) -> &[Op],
    ) -> Result<(TargetGuard<'_>, P), AgentError> {
        let mut exclusive = !self.target.model_current();
        loop {
            let guard = if exclusive {
                self.target.exclusive().await
            } else {
                self.target.shared().await
            };
            let view = match source {
                Source::Kernel => self.target.plan_view(&guard, nqn.as_str()).await?,
                Source::Model => match self.target.model_view(&guard, nqn.as_str()) {
                    Some(view) => Some(view),
                    None => self.target.plan_view(&guard, nqn.as_str()).await?,
                },
            };
            let Some(view) = view else {
                exclusive = true;
                continue;
            };
            let planned = plan(&view)?;
            if guard.is_exclusive() || !ops(&planned).iter().any(touches_shared) {
                return Ok((guard, planned));
            }
            exclusive = true;
        }
    }

    /// The identity each namespace of `volume` must show before a grant enables it: the
    /// adopted identity on record, else the derived one; in the test-only kernel-random mode,
    /// whatever the namespace shows.
    fn expected_identities(
        &self,
        volume: &VolumeId,
        sub: &pillar_nvmet::SubsystemState,
    ) -> Result<BTreeMap<NamespaceId, NamespaceIdentity>, AgentError> {
        if self.settings.kernel_random_identity {
            return Ok(sub
                .namespaces
                .iter()
                .filter_map(|(nsid, ns)| Some((*nsid, ns.shown_identity()?)))
                .collect());
        }
        let mut spec = volume_export(volume, "", HostAccess::AnyHost, BTreeMap::new());
        if let Some(record) = self.target.identity_record(volume)? {
            apply_record(&mut spec, &record);
        }
        Ok(spec
            .namespaces
            .into_iter()
            .map(|(nsid, ns)| (nsid, ns.identity))
            .collect())
    }

    /// Applies the controller's complete export state of this node, then starts serving.
    /// While the state is lost (C6) `epoch` must be the current state epoch, and the agent
    /// serves afterwards only if no other loss was detected meanwhile.
    pub async fn resync(
        &self,
        exports: Vec<ExportRequest>,
        epoch: &str,
    ) -> Result<(Vec<ResyncOutcome>, Vec<String>), AgentError> {
        use futures::StreamExt as _;
        let serves_under = self.resync_epoch(epoch)?;
        let listed: BTreeSet<VolumeId> = exports.iter().map(|e| e.volume.clone()).collect();
        {
            // One full read for the whole resync; every export then reads only its own scope.
            let guard = self.target.exclusive().await;
            self.target.observe_all(&guard).await?;
        }
        let outcomes: Vec<ResyncOutcome> = futures::stream::iter(exports)
            .map(|request| async move {
                let volume = request.volume.clone();
                let result = self.export_unchecked(request, Intent::Resync).await;
                if let Err(e) = &result {
                    tracing::warn!(%volume, error = %e, "resync of one export failed");
                }
                ResyncOutcome { volume, result }
            })
            .buffered(RESYNC_IN_FLIGHT)
            .collect()
            .await;
        let subsystems = match self.target.modelled_subsystems() {
            Some(names) => names,
            None => {
                let guard = self.target.exclusive().await;
                let state = self.target.observe_all(&guard).await?;
                state.subsystems.into_keys().collect()
            }
        };
        let unlisted = subsystems
            .iter()
            .filter_map(|name| SubsystemNqn::parse(name).ok()?.volume_id().ok())
            .filter(|v| !listed.contains(v))
            .map(|v| v.to_string())
            .collect::<Vec<_>>();
        *self.unrestored_set() = outcomes
            .iter()
            .filter(|o| o.result.is_err())
            .map(|o| o.volume.clone())
            .collect();
        {
            let mut readiness = self.readiness.write().await;
            let mut current = self.epoch_slot();
            if *current != serves_under {
                // The state was lost (again) during this resync: its seeds may be incomplete.
                return Err(AgentError::StateLost);
            }
            *current = None;
            *readiness = Readiness::Serving;
        }
        tracing::info!(
            exports = outcomes.len(),
            unlisted = unlisted.len(),
            "resync complete; serving"
        );
        Ok((outcomes, unlisted))
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

    /// pillar's exports on this node.
    pub async fn list_exports(&self) -> Result<Vec<ExportSummary>, AgentError> {
        let guard = self.target.exclusive().await;
        let state = self.target.observe_all(&guard).await?;
        let mut out = Vec::new();
        for (name, sub) in &state.subsystems {
            let Some(volume) = SubsystemNqn::parse(name)
                .ok()
                .and_then(|n| n.volume_id().ok())
            else {
                continue;
            };
            let ns = sub.namespaces.get(&NamespaceId::VOLUME);
            out.push(ExportSummary {
                volume,
                nqn: name.clone(),
                device_path: ns
                    .and_then(|n| n.device_path.as_ref())
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                acl: !sub.allow_any_host,
                allowed_hosts: sub.allowed_hosts.iter().cloned().collect(),
                services: state
                    .ports_linking(name)
                    .filter_map(|p| state.ports.get(&p)?.trsvcid.parse().ok())
                    .collect(),
                enabled: ns.is_some_and(|n| n.enabled),
            });
        }
        Ok(out)
    }

    /// Capacity of a pool.
    pub async fn capacity(&self, pool: &str) -> Result<Capacity, AgentError> {
        Ok(self.pool(pool)?.capacity().await?)
    }
}

/// The shared entries `ops` lets go of ([`Released::by`]) when it runs under the shared lock:
/// it may have kept one that another subsystem, changing beside it, was letting go of too. A
/// plan made under the exclusive lock saw every other subsystem as it stays, and removed what
/// nobody else uses.
fn released_under(guard: &TargetGuard<'_>, ops: &[Op], nqn: &SubsystemNqn) -> Released {
    if guard.is_exclusive() {
        Released::default()
    } else {
        Released::by(ops, nqn)
    }
}

/// The ports of one export, with their addresses.
type Ports = BTreeMap<PortId, PortSpec>;

/// Where a plan's view of the target comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// A scoped read of the kernel, folded into the model.
    Kernel,
    /// The model alone, when it is current.
    Model,
}

fn apply_record(spec: &mut ExportSpec, record: &IdentityRecord) {
    if let (Ok(id), Some(ns)) = (
        record.namespace(),
        spec.namespaces.get_mut(&NamespaceId::VOLUME),
    ) {
        ns.identity = id;
    }
    if let Ok(serial) = pillar_nvmet::Serial::parse(&record.serial) {
        spec.serial = serial;
    }
}

fn record_of(effective: &ExportSpec) -> IdentityRecord {
    let ns = effective.namespaces.get(&NamespaceId::VOLUME);
    IdentityRecord {
        uuid: ns.map(|n| n.identity.uuid.to_string()).unwrap_or_default(),
        nguid: ns.map(|n| n.identity.nguid.to_string()).unwrap_or_default(),
        serial: effective.serial.to_string(),
    }
}

/// Attributes the test-only modes leave out of a plan: namespace enable/disable (the ACL-only
/// revoke) and identity (the kernel-random mode).
const ENABLE: &[&str] = &["enable"];
const IDENTITY: &[&str] = &["device_uuid", "device_nguid", "attr_serial"];

/// Drops the writes of the attributes `names` from a plan.
fn strip_writes(ops: Vec<pillar_nvmet::Op>, names: &[&str]) -> Vec<pillar_nvmet::Op> {
    ops.into_iter()
        .filter(|op| {
            !matches!(op, pillar_nvmet::Op::Write { path, .. }
                if path.file_name().is_some_and(|n| names.iter().any(|x| n == *x)))
        })
        .collect()
}
