//! The agent's I/O engines: durable small-file replacement (fencing marks, identity records)
//! and configfs plans.
//!
//! Two engines pass the same test suite:
//! - [`uring::UringEngine`]: one io_uring fed by every concurrent request. A durable replace is
//!   two linked chains (open, write, fsync, close; then rename, fsync of the directory);
//!   concurrent replaces in one directory share submissions and one directory fsync (group
//!   commit). configfs plans go in as linked chains, each ending at a directory operation.
//! - [`sync::SyncEngine`]: plain blocking syscalls on tokio's blocking pool, for hosts where
//!   io_uring is disabled or blocked by a seccomp profile.
//!
//! Invariants both keep:
//! - A replace writes its own temp file ([`temp_name`]), then either leaves the old file or
//!   installs the complete new one (rename is atomic); success is reported only after the
//!   directory fsync, so a reported success survives a crash.
//! - A configfs plan stops at the first failed operation; later operations never run.
//! - A plan on a double's tree ([`ConfigfsRoot::ruled`]) runs the same path as on the kernel,
//!   each operation admitted by the double's rules before its syscalls and completed after
//!   them; a refusal fails the plan at that operation exactly as the kernel's errno would
//!   ([`EngineError::Configfs`] naming it), and nothing after it runs.

pub mod sync;
pub mod uring;

use std::ffi::CString;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use pillar_nvmet::{ApplyError, ConfigfsRules, Op};

/// The steps of a durable replace, in order. Named in errors and used for fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DurableStep {
    Open,
    Write,
    Fsync,
    Close,
    Rename,
    Unlink,
    FsyncDir,
}

impl DurableStep {
    /// Every step of a replace, in chain order.
    pub const REPLACE: [Self; 6] = [
        Self::Open,
        Self::Write,
        Self::Fsync,
        Self::Close,
        Self::Rename,
        Self::FsyncDir,
    ];
}

impl fmt::Display for DurableStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Open => "open temp file",
            Self::Write => "write temp file",
            Self::Fsync => "fsync temp file",
            Self::Close => "close temp file",
            Self::Rename => "rename over the old file",
            Self::Unlink => "unlink",
            Self::FsyncDir => "fsync directory",
        })
    }
}

/// Why an engine operation failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{step} for {path} failed")]
    Step {
        step: DurableStep,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot open directory {path}")]
    OpenDir { path: PathBuf, source: io::Error },
    #[error("path {path} contains a NUL byte")]
    NulInPath { path: PathBuf },
    #[error("io_uring is unavailable: {reason}")]
    Unavailable { reason: String },
    #[error("the io_uring engine thread has stopped")]
    Stopped,
    #[error("the kernel refused an io_uring submission")]
    Submit { source: io::Error },
    #[error(
        "the io_uring engine already holds {limit} requests; refused (the node is overloaded, \
         retry later)"
    )]
    QueueFull { limit: usize },
    #[error(transparent)]
    Configfs(#[from] ApplyError),
    #[error("blocking task failed")]
    Join(#[source] tokio::task::JoinError),
}

/// A directory kept open, so renames and fsyncs address it by descriptor.
#[derive(Debug)]
pub struct DurableDir {
    path: PathBuf,
    fd: OwnedFd,
}

impl DurableDir {
    /// Opens `path` (creating it and its parents if missing).
    pub fn open(path: impl Into<PathBuf>) -> Result<Arc<Self>, EngineError> {
        let path = path.into();
        let err = |source| EngineError::OpenDir {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&path).map_err(err)?;
        let fd = std::fs::File::open(&path).map_err(err)?;
        Ok(Arc::new(Self {
            path,
            fd: fd.into(),
        }))
    }

    /// The directory's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// An nvmet tree configfs plans run against: the kernel's (configfs enforces its rules inside
/// the syscalls), or a plain tree with the kernel's rules kept beside it (the test double,
/// [`pillar_nvmet::ConfigfsDouble`]), which the engine applies around each operation's
/// syscalls. Either way the plan goes through the engine's own configfs path.
#[derive(Clone, Debug)]
pub struct ConfigfsRoot {
    dir: Arc<DurableDir>,
    rules: Option<Arc<dyn ConfigfsRules>>,
}

impl ConfigfsRoot {
    /// The kernel's tree, open at `dir`.
    pub fn kernel(dir: Arc<DurableDir>) -> Self {
        Self { dir, rules: None }
    }

    /// A plain tree at `dir` under `rules`.
    pub fn ruled(dir: Arc<DurableDir>, rules: Arc<dyn ConfigfsRules>) -> Self {
        Self {
            dir,
            rules: Some(rules),
        }
    }

    /// The tree's directory.
    pub fn dir(&self) -> &Arc<DurableDir> {
        &self.dir
    }

    /// The rules kept beside a plain tree; `None` for the kernel's.
    pub fn rules(&self) -> Option<&Arc<dyn ConfigfsRules>> {
        self.rules.as_ref()
    }
}

fn c_path(path: &Path) -> Result<CString, EngineError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| EngineError::NulInPath {
        path: path.to_owned(),
    })
}

/// A fresh temp file name for one replace of `name`: `.{name}.{process}-{n}.tmp`, where
/// `process` is 64 random bits drawn once per process and `n` counts the process's replaces. No
/// two writes share a temp file, even of one file at once or across restarts (a crashed run's
/// leftovers keep their own names), and no randomness is drawn per write.
///
/// Hidden (a leading `.`), so whatever lists a directory of marks or records skips it; engines
/// remove it when a replace fails before its rename, and only a crash mid-write leaves one.
pub fn temp_name(name: &str) -> String {
    static PROCESS: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let process = *PROCESS.get_or_init(|| uuid::Uuid::new_v4().as_u64_pair().0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!(".{name}.{process:016x}-{n}.tmp")
}

/// Counters every engine keeps (for metrics and the syscall comparison in benchmarks).
#[derive(Debug, Default)]
pub struct EngineStats {
    /// `io_uring_enter` calls (io_uring) or blocking jobs (sync).
    pub submissions: AtomicU64,
    /// Submission queue entries pushed (io_uring only).
    pub sqes: AtomicU64,
    /// Durable replaces and removals completed.
    pub durable_ops: AtomicU64,
    /// Directory fsyncs issued; fewer than `durable_ops` means group commit shared some.
    pub dir_fsyncs: AtomicU64,
    /// configfs plans applied.
    pub configfs_plans: AtomicU64,
    /// Every `io_uring_enter` call, whether it submitted, waited or both (io_uring only).
    pub enters: AtomicU64,
    /// Wake-ups of the ring thread: eventfd writes by requesting threads (io_uring only).
    pub wakes: AtomicU64,
}

impl EngineStats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The syscalls the io_uring engine made, as (`io_uring_enter` calls, eventfd writes).
    #[cfg(any(test, feature = "test-seams"))]
    pub fn syscalls(&self) -> (u64, u64) {
        (
            self.enters.load(Ordering::Relaxed),
            self.wakes.load(Ordering::Relaxed),
        )
    }

    /// A point-in-time copy.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn snapshot(&self) -> [u64; 5] {
        [
            self.submissions.load(Ordering::Relaxed),
            self.sqes.load(Ordering::Relaxed),
            self.durable_ops.load(Ordering::Relaxed),
            self.dir_fsyncs.load(Ordering::Relaxed),
            self.configfs_plans.load(Ordering::Relaxed),
        ]
    }
}

/// Makes one step of every durable replace fail, to prove crash safety step by step, or leaves
/// the temp file's fsync out of every replace (a broken write order, for showing that the
/// crash-state checks catch it). Only settable in builds with the `fault-injection` feature.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultInjection {
    pub fail_at: Option<DurableStep>,
    /// Leave out the fsync of the temp file ([`DurableStep::Fsync`]): the replace is answered
    /// as durable although its data may not be.
    pub skip_fsync: bool,
}

impl FaultInjection {
    /// The environment variable a `fault-injection` build reads at start
    /// ([`from_env`](Self::from_env)): the kernel lane runs the agent binary with one fsync
    /// dropped to show that its crash-state check catches the broken order.
    #[cfg(feature = "fault-injection")]
    pub const SKIP_FSYNC_ENV: &'static str = "PILLAR_AGENT_TEST_SKIP_FSYNC";

    /// `skip_fsync` when [`SKIP_FSYNC_ENV`](Self::SKIP_FSYNC_ENV) is `1`; nothing otherwise.
    #[cfg(feature = "fault-injection")]
    pub fn from_env() -> Self {
        let skip_fsync = std::env::var(Self::SKIP_FSYNC_ENV).as_deref() == Ok("1");
        if skip_fsync {
            tracing::warn!(
                "TEST ONLY: {} is set: every durable replace leaves out its file fsync",
                Self::SKIP_FSYNC_ENV
            );
        }
        Self {
            fail_at: None,
            skip_fsync,
        }
    }
}

/// Observer of io_uring submission batch sizes (SQEs per `io_uring_enter`), for metrics.
pub type BatchObserver = Arc<dyn Fn(u64) + Send + Sync>;

/// Which engine the agent runs.
#[derive(Debug)]
pub enum Engine {
    Uring(uring::UringEngine),
    Sync(sync::SyncEngine),
}

impl Engine {
    /// The engine's name as shown in capabilities and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Uring(_) => "io_uring",
            Self::Sync(_) => "sync",
        }
    }

    /// Counters of this engine.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn stats(&self) -> &EngineStats {
        match self {
            Self::Uring(e) => e.stats(),
            Self::Sync(e) => e.stats(),
        }
    }

    /// Durably replaces `dir/name` with `contents`: old or new content survives any crash, and
    /// success means the new content is on stable storage.
    pub async fn replace_file(
        &self,
        dir: &Arc<DurableDir>,
        name: &str,
        contents: Vec<u8>,
    ) -> Result<(), EngineError> {
        match self {
            Self::Uring(e) => e.replace_file(dir, name, contents).await,
            Self::Sync(e) => e.replace_file(dir, name, contents).await,
        }
    }

    /// Durably removes `dir/name` (absent is fine).
    pub async fn remove_file(&self, dir: &Arc<DurableDir>, name: &str) -> Result<(), EngineError> {
        match self {
            Self::Uring(e) => e.remove_file(dir, name).await,
            Self::Sync(e) => e.remove_file(dir, name).await,
        }
    }

    /// Runs a configfs plan against the nvmet tree `root`, in order, stopping at the first
    /// failure.
    pub async fn apply_configfs(
        &self,
        root: &ConfigfsRoot,
        ops: Vec<Op>,
    ) -> Result<(), EngineError> {
        if ops.is_empty() {
            return Ok(());
        }
        match self {
            Self::Uring(e) => e.apply_configfs(root, ops).await,
            Self::Sync(e) => e.apply_configfs(root, ops).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_replace_gets_its_own_hidden_temp_name() {
        let first = temp_name("v1.json");
        let second = temp_name("v1.json");
        assert_ne!(first, second);
        for name in [&first, &second] {
            assert!(name.starts_with(".v1.json."), "{name}");
            assert!(name.ends_with(".tmp"), "{name}");
        }
        // The same process part, a different count.
        let process = |n: &str| n.split('-').next().map(str::to_owned);
        assert_eq!(process(&first), process(&second));
    }
}
