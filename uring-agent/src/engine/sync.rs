//! The synchronous engine: one blocking syscall per step on tokio's blocking pool. The baseline
//! the io_uring engine is measured against, and the fallback where io_uring is unavailable.

use std::io::{self, Write as _};
use std::path::Path;
use std::sync::Arc;

use pillar_durable::DurableFs;
use pillar_nvmet::{KernelExecutor, Op, Ruled, apply};

use super::{
    ConfigfsRoot, DurableDir, DurableStep, EngineError, EngineStats, FaultInjection, temp_name,
};

/// See the module documentation.
#[derive(Debug)]
pub struct SyncEngine {
    stats: EngineStats,
    fault: FaultInjection,
    /// Every file operation of a durable replace or removal goes through it: `std::fs` in
    /// production, a recorder in the crash-state tests.
    fs: Arc<dyn DurableFs>,
}

impl Default for SyncEngine {
    fn default() -> Self {
        Self {
            stats: EngineStats::default(),
            fault: FaultInjection::default(),
            fs: pillar_durable::std_fs(),
        }
    }
}

fn injected(step: DurableStep) -> io::Error {
    io::Error::other(format!("injected failure at {step}"))
}

impl SyncEngine {
    /// A synchronous engine.
    pub fn new() -> Self {
        Self::default()
    }

    /// A synchronous engine that fails every durable operation at one step.
    #[cfg(feature = "fault-injection")]
    pub fn with_fault(fault: FaultInjection) -> Self {
        Self {
            fault,
            ..Self::default()
        }
    }

    /// A synchronous engine whose durable file operations go through `fs` (the crash-state
    /// tests record them).
    #[cfg(any(test, feature = "test-seams"))]
    pub fn with_fs(fs: Arc<dyn DurableFs>) -> Self {
        Self {
            fs,
            ..Self::default()
        }
    }

    #[cfg(any(test, feature = "test-seams"))]
    pub(super) fn stats(&self) -> &EngineStats {
        &self.stats
    }

    pub(super) async fn replace_file(
        &self,
        dir: &Arc<DurableDir>,
        name: &str,
        contents: Vec<u8>,
    ) -> Result<(), EngineError> {
        let dir = Arc::clone(dir);
        let name = name.to_owned();
        let fault = self.fault;
        let fs = Arc::clone(&self.fs);
        EngineStats::add(&self.stats.submissions, 1);
        crate::blocking::spawn(move || replace_blocking(&*fs, &dir, &name, &contents, fault))
            .await
            .map_err(EngineError::Join)??;
        EngineStats::add(&self.stats.durable_ops, 1);
        EngineStats::add(&self.stats.dir_fsyncs, 1);
        Ok(())
    }

    pub(super) async fn remove_file(
        &self,
        dir: &Arc<DurableDir>,
        name: &str,
    ) -> Result<(), EngineError> {
        let dir = Arc::clone(dir);
        let name = name.to_owned();
        let fs = Arc::clone(&self.fs);
        EngineStats::add(&self.stats.submissions, 1);
        crate::blocking::spawn(move || {
            let path = dir.path().join(&name);
            let step = |step, source| EngineError::Step {
                step,
                path: path.clone(),
                source,
            };
            match fs.remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(step(DurableStep::Unlink, e)),
            }
            fs.sync_dir(dir.path())
                .map_err(|e| step(DurableStep::FsyncDir, e))
        })
        .await
        .map_err(EngineError::Join)??;
        EngineStats::add(&self.stats.durable_ops, 1);
        EngineStats::add(&self.stats.dir_fsyncs, 1);
        Ok(())
    }

    pub(super) async fn apply_configfs(
        &self,
        root: &ConfigfsRoot,
        ops: Vec<Op>,
    ) -> Result<(), EngineError> {
        let mut exec = KernelExecutor::new(root.dir().path());
        let rules = root.rules().cloned();
        EngineStats::add(&self.stats.submissions, 1);
        crate::blocking::spawn(move || match &rules {
            None => apply(&mut exec, &ops),
            // A double's tree: its rules around each syscall.
            Some(rules) => apply(&mut Ruled::new(rules.as_ref(), exec), &ops),
        })
            .await
            .map_err(EngineError::Join)??;
        EngineStats::add(&self.stats.configfs_plans, 1);
        Ok(())
    }
}

fn replace_blocking(
    fs: &dyn DurableFs,
    dir: &DurableDir,
    name: &str,
    contents: &[u8],
    fault: FaultInjection,
) -> Result<(), EngineError> {
    let tmp = dir.path().join(temp_name(name));
    let target = dir.path().join(name);
    let fail = |step: DurableStep, source: io::Error| EngineError::Step {
        step,
        path: target.clone(),
        source,
    };
    let check = |step: DurableStep| {
        if fault.fail_at == Some(step) {
            Err(fail(step, injected(step)))
        } else {
            Ok(())
        }
    };

    check(DurableStep::Open)?;
    let mut file = fs
        .create_new(&tmp, 0o600)
        .map_err(|e| fail(DurableStep::Open, e))?;
    let mut temp = TempFile(fs, Some(&tmp));
    check(DurableStep::Write)?;
    file.write_all(contents)
        .map_err(|e| fail(DurableStep::Write, e))?;
    check(DurableStep::Fsync)?;
    if !fault.skip_fsync {
        file.sync_all().map_err(|e| fail(DurableStep::Fsync, e))?;
    }
    check(DurableStep::Close)?;
    drop(file);
    check(DurableStep::Rename)?;
    fs.rename(&tmp, &target)
        .map_err(|e| fail(DurableStep::Rename, e))?;
    temp.renamed();
    check(DurableStep::FsyncDir)?;
    fs.sync_dir(dir.path())
        .map_err(|e| fail(DurableStep::FsyncDir, e))
}

/// This write's own temp file, removed unless the rename installed it (nobody else uses it).
struct TempFile<'a>(&'a dyn DurableFs, Option<&'a Path>);

impl TempFile<'_> {
    fn renamed(&mut self) {
        self.1 = None;
    }
}

impl Drop for TempFile<'_> {
    fn drop(&mut self) {
        if let Some(path) = self.1 {
            let _ = self.0.remove_file(path);
        }
    }
}
