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
//!
//! Where each part lives: `fencing` (check, commit, the serving gate), `volume` (create, grow,
//! delete), `export` (export, unexport), `acl` (grant, revoke), `identity` (the identity an
//! export must show), `resync` (the resync and ListExports), `auth` (DH-HMAC-CHAP keys), `loss`
//! (a lost state directory), `snapshot` (snapshots, restores, clones); `error` and `request`
//! hold the types the operations take and answer. This file holds the agent, its accessors and
//! the target-lock planning step every change goes through.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use pillar_lock_by_id::LockById;
use pillar_nvmet::{Op, PortId, PortSpec, Released, SubsystemNqn, TargetState, VolumeId};
use tokio::sync::RwLock;

use crate::backend::Backend;
use crate::engine::Engine;
use crate::fence::MarkStore;
use crate::hooks::Hooks;
use crate::metrics::Metrics;
use crate::target::{Target, TargetGuard, touches_shared};

mod acl;
mod auth;
mod error;
mod export;
mod fencing;
mod identity;
mod loss;
mod request;
mod resync;
mod snapshot;
mod tls;
mod volume;

pub use error::AgentError;
pub use request::{
    AgentSettings, ExportRequest, ExportSummary, Exported, Protocol, Readiness, ResyncOutcome, VolumeSize,
};

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
    /// Whether the kernel has TLS for the NVMe/TCP target, once looked at (`tls`).
    tls_supported: std::sync::OnceLock<bool>,
    /// Where hosts' TLS PSKs go (`tls`): the kernel's `.nvme` keyring, or a folder beside the
    /// double.
    psk_keyring: tls::PskKeyring,
    /// The hosts whose PSK was installed for each export since the start, so an unexport
    /// invalidates them. In memory, like `export_ports`: a resync installs them again.
    psk_hosts: std::sync::Mutex<BTreeMap<VolumeId, BTreeSet<pillar_nvmet::HostNqn>>>,
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
        let psk_keyring = tls::PskKeyring::for_target(target.kind(), target.root());
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
            tls_supported: std::sync::OnceLock::new(),
            psk_keyring,
            psk_hosts: std::sync::Mutex::new(BTreeMap::new()),
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
