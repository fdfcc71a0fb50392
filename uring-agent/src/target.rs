//! The agent's view of the NVMe-oF target: the kernel's configfs (through the engine) or the
//! configfs test double, plus the records of adopted namespace identities.
//!
//! Invariants:
//! - Every configfs change runs as observe -> plan -> apply -> observe -> verify while holding
//!   the target lock, so plans are never computed from a state another request is changing
//!   (ports and hosts are shared between volumes).
//! - The double is only ever used when selected explicitly, and is reported as such.
//! - An identity record exists exactly while an adopted (kernel-random) identity is in use: it
//!   is written durably before the plan that relies on it runs, and removed after unexport.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pillar_nvmet::{
    ConfigfsDouble, Executor, NamespaceIdentity, Nguid, Op, Serial, TargetState, VolumeId, observe,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, MutexGuard};

use crate::engine::{DurableDir, Engine, EngineError};
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
    #[error("the configfs test double refused a step")]
    DoubleApply(#[source] pillar_nvmet::ApplyError),
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

enum Backing {
    Kernel(Arc<DurableDir>),
    Double(ConfigfsDouble),
}

/// The NVMe-oF target of this node.
pub struct Target {
    backing: Backing,
    root: PathBuf,
    lock: Mutex<()>,
    engine: Arc<Engine>,
    identities: Arc<DurableDir>,
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

/// The target lock: held across observe, plan, apply and verify.
#[derive(Debug)]
pub struct TargetGuard<'a>(#[allow(dead_code)] MutexGuard<'a, ()>);

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
        let (backing, root) = match config {
            TargetConfig::Kernel { root } => {
                if !root.join("subsystems").is_dir() {
                    return Err(TargetError::NoNvmet { root: root.clone() });
                }
                (
                    Backing::Kernel(DurableDir::open(root).map_err(TargetError::Apply)?),
                    root.clone(),
                )
            }
            TargetConfig::Double { root } => {
                let double =
                    ConfigfsDouble::create(root).map_err(|source| TargetError::Double {
                        root: root.clone(),
                        source,
                    })?;
                (Backing::Double(double), root.clone())
            }
        };
        Ok(Self {
            backing,
            root,
            lock: Mutex::new(()),
            engine,
            identities,
            hooks,
        })
    }

    /// "kernel" or "test-double".
    pub fn kind(&self) -> &'static str {
        match self.backing {
            Backing::Kernel(_) => "kernel",
            Backing::Double(_) => "test-double",
        }
    }

    /// The nvmet root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Takes the target lock.
    pub async fn lock(&self) -> TargetGuard<'_> {
        TargetGuard(self.lock.lock().await)
    }

    /// Reads the whole tree.
    pub async fn observe(&self, _guard: &TargetGuard<'_>) -> Result<TargetState, TargetError> {
        let root = self.root.clone();
        Ok(crate::blocking::spawn(move || observe(&root))
            .await
            .map_err(TargetError::Join)??)
    }

    /// Applies a plan, in order, stopping at the first failure.
    pub async fn apply(&self, _guard: &TargetGuard<'_>, ops: Vec<Op>) -> Result<(), TargetError> {
        if ops.is_empty() {
            return Ok(());
        }
        match &self.backing {
            Backing::Kernel(root) => self
                .engine
                .apply_configfs(root, ops)
                .await
                .map_err(TargetError::Apply),
            Backing::Double(double) => {
                let mut double = double.clone();
                let hooks = self.hooks.clone();
                crate::blocking::spawn(move || {
                    hooks.blocking(HookPoint::ConfigfsApply);
                    pillar_nvmet::apply(&mut double as &mut dyn Executor, &ops)
                })
                .await
                .map_err(TargetError::Join)?
                .map_err(TargetError::DoubleApply)
            }
        }
    }

    fn identity_file(volume: &VolumeId) -> String {
        format!("{volume}.json")
    }

    /// The adopted identity recorded for `volume`, if any. A corrupt record is an error.
    pub fn identity_record(
        &self,
        volume: &VolumeId,
    ) -> Result<Option<IdentityRecord>, TargetError> {
        let path = self.identities.path().join(Self::identity_file(volume));
        match std::fs::read(&path) {
            Ok(bytes) => {
                let record: IdentityRecord = serde_json::from_slice(&bytes).map_err(|e| {
                    TargetError::CorruptIdentityRecord {
                        path: path.clone(),
                        reason: e.to_string(),
                    }
                })?;
                record
                    .validate()
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
        let bytes =
            serde_json::to_vec_pretty(record).map_err(|e| TargetError::WriteIdentityRecord {
                volume: volume.to_string(),
                source: EngineError::Unavailable {
                    reason: e.to_string(),
                },
            })?;
        self.engine
            .replace_file(&self.identities, &Self::identity_file(volume), bytes)
            .await
            .map_err(|source| TargetError::WriteIdentityRecord {
                volume: volume.to_string(),
                source,
            })
    }

    /// Durably removes the identity record of `volume` (absent is fine).
    pub async fn forget_identity(&self, volume: &VolumeId) -> Result<(), TargetError> {
        self.engine
            .remove_file(&self.identities, &Self::identity_file(volume))
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
    fn validate(&self) -> Result<(), String> {
        self.namespace()?;
        Serial::parse(&self.serial).map_err(|e| e.to_string())?;
        Ok(())
    }

    /// The namespace identity of the record.
    pub fn namespace(&self) -> Result<NamespaceIdentity, String> {
        Ok(NamespaceIdentity {
            uuid: pillar_nvmet::identity::parse_uuid(&self.uuid).map_err(|e| e.to_string())?,
            nguid: Nguid::parse(&self.nguid).map_err(|e| e.to_string())?,
        })
    }
}
