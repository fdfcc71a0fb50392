//! The agent's view of the NVMe-oF target: the kernel's configfs or the configfs test double,
//! both changed through the engine, plus the records of adopted namespace identities.
//!
//! Invariants:
//! - Every configfs change runs as read -> plan -> apply -> read back -> verify while holding
//!   the target lock: shared by changes confined to their own subsystem (its attributes,
//!   namespaces, host links and port links), so different volumes change concurrently (each
//!   volume's own lock orders changes of one volume); exclusive for a change that creates or
//!   removes a shared entry (a port or a host entry, see [`touches_shared`]) and for loading the
//!   model, so no plan is computed from shared entries another request is changing.
//! - A shared entry goes with its last user: a change under the shared lock that lets go of a
//!   port or host entry another subsystem still used when it planned looks again once it is
//!   applied and read back, and decides under the exclusive lock when nobody else seems to use
//!   it ([`Target::release`]); of several letting go at once, the last to look sees nobody
//!   left. One still used elsewhere costs no exclusive lock.
//! - An operation reads from the kernel only what it touches (`observe_scope`: its subsystem,
//!   the ports, the host entries' names) and plans with the in-memory [`TargetModel`] for the
//!   rest; the model is loaded from a full read under the exclusive lock, kept current by each
//!   operation's scoped read-back, and dropped (reloaded by the next operation) after any failed
//!   apply or read.
//! - The double is only ever used when selected explicitly, and is reported as such. Its plans
//!   take the engine's configfs path as the kernel's do: the double sits below the engine, as
//!   the rules of a plain tree ([`ConfigfsRoot::ruled`]).
//! - An identity record exists exactly while an adopted (kernel-random) identity is in use: it
//!   is written durably before the plan that relies on it runs, and removed after unexport.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use pillar_nvmet::{
    ConfigfsDouble, NamespaceIdentity, Nguid, Op, Released, Serial, TargetModel, TargetState,
    VolumeId, observe, observe_scope, plan_release,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::engine::{ConfigfsRoot, DurableDir, Engine, EngineError};
use crate::hooks::{HookPoint, Hooks};

/// Where configfs lives.
#[derive(Debug, Clone)]
pub enum TargetConfig {
    /// The kernel's nvmet tree (normally `/sys/kernel/config/nvmet`).
    Kernel { root: PathBuf },
    /// The test double at `root`, for machines without nvmet. Never the default.
    Double { root: PathBuf },
}

/// Why the target could not be used or changed.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error(
        "nvmet configfs not found at {root}: load the modules (modprobe nvmet nvmet-tcp) and mount \
         configfs, or run with --target test-double on a machine without nvmet"
    )]
    NoNvmet { root: PathBuf },
    #[error("cannot create the configfs test double at {root}")]
    Double {
        root: PathBuf,
        source: std::io::Error,
    },
    #[error("reading the nvmet configfs tree failed")]
    Observe(#[from] pillar_nvmet::ObserveError),
    #[error("applying a configfs plan failed")]
    Apply(#[source] EngineError),
    #[error("blocking task failed")]
    Join(#[source] tokio::task::JoinError),
    #[error("identity record {path} is corrupt ({reason}); refusing to guess the identity")]
    CorruptIdentityRecord { path: PathBuf, reason: String },
    #[error("identity record {path} cannot be read")]
    ReadIdentityRecord {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("identity record for {volume} could not be made durable")]
    WriteIdentityRecord { volume: String, source: EngineError },
}

/// The model and whether it may be trusted for new plans: not before the first full read, and
/// not after a failed apply or read (an operation already planning may finish with it: what it
/// plans under the shared lock reads no other subsystem's entries).
#[derive(Default)]
struct ModelSlot {
    model: TargetModel,
    current: bool,
}

/// The NVMe-oF target of this node.
pub struct Target {
    /// The kernel's tree, or the double's under its rules.
    configfs: ConfigfsRoot,
    root: PathBuf,
    lock: RwLock<()>,
    model: std::sync::Mutex<ModelSlot>,
    engine: Arc<Engine>,
    /// Replaced only by [`reopen_identities`](Target::reopen_identities), after the state
    /// directory was lost under the running agent.
    identities: std::sync::RwLock<Arc<DurableDir>>,
    hooks: Hooks,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("kind", &self.kind())
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

/// The target lock: held across read, plan, apply and verify.
#[derive(Debug)]
pub enum TargetGuard<'a> {
    /// Changes confined to one subsystem.
    Shared(#[allow(dead_code)] RwLockReadGuard<'a, ()>),
    /// Changes of shared entries, and loading the model.
    Exclusive(#[allow(dead_code)] RwLockWriteGuard<'a, ()>),
}

impl TargetGuard<'_> {
    /// Whether this is the exclusive lock.
    pub fn is_exclusive(&self) -> bool {
        matches!(self, Self::Exclusive(_))
    }
}

/// Whether `op` creates, removes or configures an entry that several subsystems share: a port
/// (its directory or `addr_*` attributes) or a host entry under `hosts/`. Links a subsystem
/// makes to existing ports and hosts are its own.
pub fn touches_shared(op: &Op) -> bool {
    let mut parts = op.path().components();
    let top = parts.next().map(|c| c.as_os_str());
    let shared_dir = top == Some(pillar_nvmet::PORTS.as_ref())
        || top == Some(pillar_nvmet::HOSTS.as_ref());
    match op {
        Op::Mkdir { .. } | Op::Rmdir { .. } => shared_dir && parts.clone().count() == 1,
        // A port's address and a host entry's keys are shared by every subsystem using them.
        Op::Write { .. } => shared_dir,
        Op::Symlink { .. } | Op::Unlink { .. } => false,
    }
}

impl Target {
    /// Opens the target, and the identity records under `<state_dir>/nvmet-identity/`.
    pub fn open(
        config: &TargetConfig,
        engine: Arc<Engine>,
        state_dir: &Path,
        hooks: Hooks,
    ) -> Result<Self, TargetError> {
        let identities =
            DurableDir::open(state_dir.join("nvmet-identity")).map_err(TargetError::Apply)?;
        let (configfs, root) = match config {
            TargetConfig::Kernel { root } => {
                if !root.join("subsystems").is_dir() {
                    return Err(TargetError::NoNvmet { root: root.clone() });
                }
                let dir = DurableDir::open(root).map_err(TargetError::Apply)?;
                (ConfigfsRoot::kernel(dir), root.clone())
            }
            TargetConfig::Double { root } => {
                let double =
                    ConfigfsDouble::create(root).map_err(|source| TargetError::Double {
                        root: root.clone(),
                        source,
                    })?;
                let dir = DurableDir::open(root).map_err(TargetError::Apply)?;
                (ConfigfsRoot::ruled(dir, Arc::new(double)), root.clone())
            }
        };
        Ok(Self {
            configfs,
            root,
            lock: RwLock::new(()),
            model: std::sync::Mutex::new(ModelSlot::default()),
            engine,
            identities: std::sync::RwLock::new(identities),
            hooks,
        })
    }

    /// "kernel" or "test-double" (a tree under rules is only ever the double's).
    pub fn kind(&self) -> &'static str {
        match self.configfs.rules() {
            None => "kernel",
            Some(_) => "test-double",
        }
    }

    /// The nvmet root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Takes the target lock for a change confined to one subsystem.
    pub async fn shared(&self) -> TargetGuard<'_> {
        TargetGuard::Shared(self.lock.read().await)
    }

    /// Takes the target lock alone.
    pub async fn exclusive(&self) -> TargetGuard<'_> {
        TargetGuard::Exclusive(self.lock.write().await)
    }

    fn model(&self) -> std::sync::MutexGuard<'_, ModelSlot> {
        // Every update of the model is one assignment or one `refresh`; a panic inside one
        // leaves at worst a stale entry, which the next scoped read of that subsystem replaces.
        self.model
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the model is current (otherwise the next plan needs the exclusive lock).
    pub fn model_current(&self) -> bool {
        self.model().current
    }

    /// Marks the model stale; the next operation reloads it with a full read.
    pub fn invalidate(&self) {
        self.model().current = false;
    }

    /// Reads the whole tree; under the exclusive lock also reloads the model from it (a full
    /// read while other subsystems change could catch one half-changed).
    pub async fn observe_all(&self, guard: &TargetGuard<'_>) -> Result<TargetState, TargetError> {
        let root = self.root.clone();
        let full = crate::blocking::spawn(move || observe(&root))
            .await
            .map_err(TargetError::Join)?
            .inspect_err(|_| self.invalidate())?;
        if guard.is_exclusive() {
            *self.model() = ModelSlot {
                model: TargetModel::new(full.clone()),
                current: true,
            };
        }
        Ok(full)
    }

    /// The subsystem names the model holds, when it is current.
    pub fn modelled_subsystems(&self) -> Option<Vec<String>> {
        let slot = self.model();
        slot.current
            .then(|| slot.model.state().subsystems.keys().cloned().collect())
    }

    /// Reads what an operation on `nqn` touches from the kernel, folds it into the model and
    /// returns the state to plan with ([`TargetModel::view`]). `None` when the model is not
    /// current and `guard` is shared: take the exclusive lock and ask again.
    pub async fn plan_view(
        &self,
        guard: &TargetGuard<'_>,
        nqn: &str,
    ) -> Result<Option<TargetState>, TargetError> {
        self.plan_view_with_hosts(guard, nqn, &BTreeSet::new())
            .await
    }

    /// [`plan_view`](Self::plan_view) with a witness for each of `hosts` too
    /// ([`TargetModel::view_with_hosts`]).
    async fn plan_view_with_hosts(
        &self,
        guard: &TargetGuard<'_>,
        nqn: &str,
        hosts: &BTreeSet<String>,
    ) -> Result<Option<TargetState>, TargetError> {
        if !self.model_current() {
            if !guard.is_exclusive() {
                return Ok(None);
            }
            // The full read just now covers `nqn` too.
            self.observe_all(guard).await?;
            return Ok(Some(self.model().model.view_with_hosts(nqn, hosts)));
        }
        let scoped = self.read_scope(nqn).await?;
        let mut slot = self.model();
        slot.model.refresh(nqn, &scoped);
        Ok(Some(slot.model.view_with_hosts(nqn, hosts)))
    }

    /// Removes the shared entries `released` by a change of `nqn` that ran under the shared
    /// lock, where nothing uses them any more; `after` is that change's read-back. The change
    /// planned while other subsystems changed beside it: each of two subsystems letting go of
    /// one port or host entry at once may have seen the other still using it. Whoever finds,
    /// after its own change and read-back, that nobody else uses an entry any more decides
    /// again under the exclusive lock, once every change in flight finished ([`Self::settle`]):
    /// of several letting go at once, the last to look sees nobody left.
    pub async fn release(
        &self,
        nqn: &str,
        released: &Released,
        after: &TargetState,
    ) -> Result<(), TargetError> {
        let unsettled = self.settle(released, after);
        if unsettled.is_empty() {
            return Ok(());
        }
        let guard = self.exclusive().await;
        let Some(view) = self
            .plan_view_with_hosts(&guard, nqn, &unsettled.hosts)
            .await?
        else {
            return Ok(());
        };
        self.apply(&guard, plan_release(&view, &unsettled)).await
    }

    /// The entries of `released` that may be unused now and need the exclusive decision. Two
    /// subsystems letting go of one entry at once each look after their own change: whoever
    /// looks first may still see the other, and then the other, looking later, sees it gone.
    /// - A port: `after` was read from the kernel after the unlink; another subsystem linked
    ///   to it then will look after its own unlink.
    /// - A host entry: the model, into which every change folds its own read-back before it
    ///   looks; another subsystem it shows linking the host will look after its own read-back.
    ///   A model that is not current answers nothing: every host is decided again.
    fn settle(&self, released: &Released, after: &TargetState) -> Released {
        let ports = released
            .ports
            .iter()
            .filter(|p| after.ports.get(p).is_some_and(|p| p.subsystems.is_empty()))
            .copied()
            .collect();
        let slot = self.model();
        let hosts = released
            .hosts
            .iter()
            .filter(|h| after.hosts.contains(*h))
            .filter(|h| !slot.current || !slot.model.host_linked(h))
            .cloned()
            .collect();
        Released { ports, hosts }
    }

    /// The state to plan `nqn` with, from the model alone (no read): for a resync, whose full
    /// read loaded the model moments before. A plan from it that the kernel's state no longer
    /// matches fails at its first step or at the read-back, like any stale plan. `None` as for
    /// [`plan_view`](Self::plan_view).
    pub fn model_view(&self, _guard: &TargetGuard<'_>, nqn: &str) -> Option<TargetState> {
        let slot = self.model();
        slot.current.then(|| slot.model.view(nqn))
    }

    /// Reads back what an operation on `nqn` touches, after a change, and folds it into the
    /// model. Verify against what this returns: it is the kernel's, not the model's.
    pub async fn read_back(
        &self,
        _guard: &TargetGuard<'_>,
        nqn: &str,
    ) -> Result<TargetState, TargetError> {
        let scoped = self.read_scope(nqn).await?;
        self.model().model.refresh(nqn, &scoped);
        Ok(scoped)
    }

    /// Whether the subsystem `nqn` exists, as the kernel shows it now (a scoped read).
    pub async fn subsystem_exists(
        &self,
        guard: &TargetGuard<'_>,
        nqn: &str,
    ) -> Result<bool, TargetError> {
        Ok(self
            .read_back(guard, nqn)
            .await?
            .subsystems
            .contains_key(nqn))
    }

    /// [`read_back`](Self::read_back), then the state to plan the rest of an operation with.
    pub async fn read_back_view(
        &self,
        guard: &TargetGuard<'_>,
        nqn: &str,
    ) -> Result<TargetState, TargetError> {
        self.read_back(guard, nqn).await?;
        Ok(self.model().model.view(nqn))
    }

    async fn read_scope(&self, nqn: &str) -> Result<TargetState, TargetError> {
        let root = self.root.clone();
        let nqn = nqn.to_owned();
        Ok(crate::blocking::spawn(move || observe_scope(&root, &nqn))
            .await
            .map_err(TargetError::Join)?
            .inspect_err(|_| self.invalidate())?)
    }

    /// Applies a plan, in order, stopping at the first failure. A plan that touches a shared
    /// entry needs the exclusive lock. A failure drops the model.
    pub async fn apply(&self, guard: &TargetGuard<'_>, ops: Vec<Op>) -> Result<(), TargetError> {
        if ops.is_empty() {
            return Ok(());
        }
        debug_assert!(
            guard.is_exclusive() || !ops.iter().any(touches_shared),
            "a plan that changes shared entries under the shared lock"
        );
        let result = self.apply_unchecked(ops).await;
        if result.is_err() {
            self.invalidate();
        }
        result
    }

    async fn apply_unchecked(&self, ops: Vec<Op>) -> Result<(), TargetError> {
        self.hooks.pass(HookPoint::ConfigfsApply).await;
        self.engine
            .apply_configfs(&self.configfs, ops)
            .await
            .map_err(TargetError::Apply)
    }

    fn identities(&self) -> Arc<DurableDir> {
        Arc::clone(
            &self
                .identities
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Opens the identity records' directory again by its path (creating it), after the state
    /// directory was deleted under the agent.
    pub fn reopen_identities(&self) -> Result<(), TargetError> {
        let fresh =
            DurableDir::open(self.identities().path().to_path_buf()).map_err(TargetError::Apply)?;
        *self
            .identities
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
        Ok(())
    }

    fn identity_file(volume: &VolumeId) -> String {
        format!("{volume}.json")
    }

    /// The adopted identity recorded for `volume`, if any. A corrupt record is an error.
    pub fn identity_record(
        &self,
        volume: &VolumeId,
    ) -> Result<Option<IdentityRecord>, TargetError> {
        let path = self.identities().path().join(Self::identity_file(volume));
        match std::fs::read(&path) {
            Ok(bytes) => {
                let record = IdentityRecord::decode(&bytes)
                    .map_err(|reason| TargetError::CorruptIdentityRecord { path, reason })?;
                Ok(Some(record))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(TargetError::ReadIdentityRecord { path, source }),
        }
    }

    /// Durably records an adopted identity.
    pub async fn record_identity(
        &self,
        volume: &VolumeId,
        record: &IdentityRecord,
    ) -> Result<(), TargetError> {
        let bytes = record
            .encode()
            .map_err(|e| TargetError::WriteIdentityRecord {
                volume: volume.to_string(),
                source: EngineError::Unavailable {
                    reason: e.to_string(),
                },
            })?;
        self.engine
            .replace_file(&self.identities(), &Self::identity_file(volume), bytes)
            .await
            .map_err(|source| TargetError::WriteIdentityRecord {
                volume: volume.to_string(),
                source,
            })
    }

    /// Durably removes the identity record of `volume` (absent is fine).
    pub async fn forget_identity(&self, volume: &VolumeId) -> Result<(), TargetError> {
        self.engine
            .remove_file(&self.identities(), &Self::identity_file(volume))
            .await
            .map_err(|source| TargetError::WriteIdentityRecord {
                volume: volume.to_string(),
                source,
            })
    }
}

/// An adopted identity: what a live export showed when pillar found it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityRecord {
    pub uuid: String,
    pub nguid: String,
    pub serial: String,
}

impl IdentityRecord {
    /// Parses and checks a record file's content; the reason when it is not a valid record.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let record: Self = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        record.validate()?;
        Ok(record)
    }

    /// A record file's content.
    pub fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec_pretty(self)
    }

    fn validate(&self) -> Result<(), String> {
        self.namespace()?;
        Serial::parse(&self.serial).map_err(|e| e.to_string())?;
        Ok(())
    }

    /// The namespace identity of the record.
    pub fn namespace(&self) -> Result<NamespaceIdentity, String> {
        Ok(NamespaceIdentity {
            uuid: pillar_nvmet::parse_uuid(&self.uuid).map_err(|e| e.to_string())?,
            nguid: Nguid::parse(&self.nguid).map_err(|e| e.to_string())?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sync::SyncEngine;
    use crate::engine::uring::{UringConfig, UringEngine};

    // The double sits below the engine: a plan on it is one of the engine's configfs plans (on
    // the old code it ran beside the engine, which never saw it), and a refusal by the double
    // comes back as the engine's error naming the operation.
    #[tokio::test]
    async fn a_plan_on_the_double_goes_through_the_engine() {
        let engines = [
            Engine::Uring(UringEngine::start(UringConfig::default()).expect("io_uring works")),
            Engine::Sync(SyncEngine::new()),
        ];
        for engine in engines {
            let engine = Arc::new(engine);
            let tmp = tempfile::tempdir().unwrap();
            let config = TargetConfig::Double {
                root: tmp.path().join("configfs"),
            };
            let state = tmp.path().join("state");
            let target =
                Target::open(&config, Arc::clone(&engine), &state, Hooks::default()).unwrap();
            assert_eq!(target.kind(), "test-double");
            let guard = target.exclusive().await;
            let port = Op::Mkdir {
                path: "ports/1".into(),
            };
            target.apply(&guard, vec![port.clone()]).await.unwrap();
            assert!(target.root().join("ports/1/addr_trtype").is_file());
            assert_eq!(engine.stats().snapshot()[4], 1, "{}", engine.name());

            let err = target.apply(&guard, vec![port.clone()]).await.unwrap_err();
            let TargetError::Apply(EngineError::Configfs(refused)) = err else {
                panic!("{}: {err:?}", engine.name())
            };
            assert_eq!((refused.index, refused.op), (0, port));
            assert_eq!(refused.source.raw_os_error(), Some(libc::EEXIST));
        }
    }
}
