//! One storage node: the real agent (`pillar_agent::server::build_agent`: synchronous engine,
//! fencing marks in a state directory, the nvmet configfs double, a plain-file pool), served by
//! tonic behind [`ChaosAgent`] on the node's [`Link`], and crashed and restarted at the
//! simulation's word.
//!
//! What survives a crash is what survives on a real node: the configfs tree (the kernel's), the
//! pool's files (the disks) and, unless the crash loses it, the state directory. What dies is
//! the process: its request tasks stop at whatever await point they reached (tracked through
//! the agent's hooks), its connections break, and the next incarnation starts waiting for the
//! controller's resync.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use pillar_agent::AgentSettings;
use pillar_agent::Hooks;
use pillar_agent::TargetConfig;
use pillar_agent::grpc::AgentService;
use pillar_agent::metrics::Metrics;
use pillar_agent::server::build_agent_with_fs;
use pillar_agent::{EngineKind, Listen, ServerConfig};
use pillar_agent::{PoolConfig, PoolKind};
use pillar_agent_api::v1::agent_server::AgentServer;
use pillar_durable::crash::{CrashState, Model};
use pillar_durable::record::Recorder;
use pillar_durable::{DurableFile, DurableFs};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Mutex, PoisonError};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;

use crate::chaos::Chaos;
use crate::transport::{ChaosAgent, KillSwitch, Link};

/// The pool every simulated agent has.
pub const POOL: &str = "p1";

/// One simulated storage node.
#[derive(Debug)]
pub struct SimAgent {
    pub name: String,
    pub state: PathBuf,
    pub configfs: PathBuf,
    pub pool: PathBuf,
    pub link: Arc<Link>,
    /// The NVMe/TCP address its target listens on.
    pub address: std::net::IpAddr,
    hooks: Hooks,
    chaos: Chaos,
    running: Option<(Arc<KillSwitch>, JoinHandle<()>)>,
    pub incarnation: u32,
    /// The durable writes of this boot (since the last power loss or state loss).
    recorder: Option<PowerSwitch>,
    grid: Arc<PowerGrid>,
}

/// The agent's durable file operations: the boot's recorder, behind a switch that cuts the
/// power after a set number of further operations (every later one fails with EIO, as a
/// write to a disk without power does), so a loss can land in the middle of a durable write.
#[derive(Clone, Debug)]
struct PowerSwitch {
    inner: Recorder,
    grid: Arc<PowerGrid>,
    off: Arc<PowerOff>,
}

/// An armed power loss, shared by every agent: it strikes the node whose durable file
/// operation comes `left` operations from now, whichever node that is (a loss landing in the
/// middle of some durable write, rather than on a node that happens to be idle).
#[derive(Debug)]
pub struct PowerGrid {
    /// Operations left before the cut; negative: not armed.
    left: AtomicI64,
    /// Told when a node's power goes.
    notify: Notify,
}

impl Default for PowerGrid {
    fn default() -> Self {
        Self {
            left: AtomicI64::new(-1),
            notify: Notify::new(),
        }
    }
}

impl PowerGrid {
    /// Arms the loss: the `after`-th next durable file operation of any node (from 0) is cut.
    pub fn arm(&self, after: i64) {
        self.left.store(after, Ordering::Relaxed);
    }

    /// Disarms it (the loss happened, or was cut by the simulation).
    pub fn disarm(&self) {
        self.left.store(-1, Ordering::Relaxed);
    }

    /// Waits for a node's power to go, at most `limit`.
    pub async fn wait(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, self.notify.notified()).await;
    }
}

/// The moment the power goes: the node stops answering at once (its connections break and
/// nothing more gets in or out), and the simulation is told so it can take the node down.
#[derive(Debug)]
struct PowerOff {
    tripped: AtomicBool,
    link: Arc<Link>,
    /// The running incarnation's connections.
    kill: Mutex<Option<Arc<KillSwitch>>>,
}

fn cut() -> std::io::Error {
    std::io::Error::other("the power is off")
}

impl PowerSwitch {
    fn step(&self) -> std::io::Result<()> {
        if self.off.tripped.load(Ordering::Acquire) {
            return Err(cut());
        }
        let left = &self.grid.left;
        if left.load(Ordering::Relaxed) < 0 {
            return Ok(());
        }
        if left.fetch_sub(1, Ordering::Relaxed) <= 0 {
            left.store(-1, Ordering::Relaxed);
            self.trip();
            self.grid.notify.notify_one();
            return Err(cut());
        }
        Ok(())
    }

    fn trip(&self) {
        if self.off.tripped.swap(true, Ordering::AcqRel) {
            return;
        }
        self.off.link.down();
        if let Some(kill) = self
            .off
            .kill
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            kill.kill();
        }
    }
}

#[derive(Debug)]
struct SwitchedFile {
    inner: Box<dyn DurableFile>,
    switch: PowerSwitch,
}

impl std::io::Write for SwitchedFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.switch.step()?;
        self.inner.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl DurableFile for SwitchedFile {
    fn sync_all(&mut self) -> std::io::Result<()> {
        self.switch.step()?;
        self.inner.sync_all()
    }
}

impl DurableFs for PowerSwitch {
    fn create_new(&self, path: &Path, mode: u32) -> std::io::Result<Box<dyn DurableFile>> {
        self.step()?;
        let inner = self.inner.create_new(path, mode)?;
        Ok(Box::new(SwitchedFile {
            inner,
            switch: self.clone(),
        }))
    }

    fn create(&self, path: &Path) -> std::io::Result<Box<dyn DurableFile>> {
        self.step()?;
        let inner = self.inner.create(path)?;
        Ok(Box::new(SwitchedFile {
            inner,
            switch: self.clone(),
        }))
    }

    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        self.step()?;
        self.inner.rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> std::io::Result<()> {
        self.step()?;
        self.inner.remove_file(path)
    }

    fn create_dir_all(&self, path: &Path) -> std::io::Result<()> {
        self.step()?;
        self.inner.create_dir_all(path)
    }

    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        self.step()?;
        self.inner.sync_dir(dir)
    }
}

/// What a power loss left of the state directory.
#[derive(Clone, Copy, Debug)]
pub struct PowerLoss {
    /// Crash states the boot's operations allow.
    pub states: usize,
    /// Whether the state chosen lost something the directory held (un-fsynced writes).
    pub lost_writes: bool,
}

/// The state directory as it is now, in the crash model's terms.
fn current_state(root: &Path) -> std::io::Result<CrashState> {
    let mut state = CrashState {
        dirs: Default::default(),
        files: Default::default(),
    };
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for entry in std::fs::read_dir(root.join(&rel))? {
            let entry = entry?;
            let name = rel.join(entry.file_name());
            if entry.file_type()?.is_dir() {
                state.dirs.insert(name.clone());
                stack.push(name);
            } else {
                state.files.insert(name, std::fs::read(entry.path())?);
            }
        }
    }
    Ok(state)
}

/// Writes `state` under the empty `root`; a file's directory is made if the state lacks it
/// (directories the agent makes outside the recorder are durable, see the module docs).
fn rebuild(state: &CrashState, root: &Path) -> std::io::Result<()> {
    for dir in &state.dirs {
        std::fs::create_dir_all(root.join(dir))?;
    }
    for (path, bytes) in &state.files {
        let path = root.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, bytes)?;
    }
    Ok(())
}

impl SimAgent {
    /// A node named `name` with its directories under `dir`; not started.
    pub fn new(
        name: &str,
        dir: &Path,
        address: std::net::IpAddr,
        chaos: Chaos,
        grid: Arc<PowerGrid>,
    ) -> std::io::Result<Self> {
        let pool = dir.join("pool");
        std::fs::create_dir_all(&pool)?;
        let hooks = Hooks::default();
        hooks.track_requests();
        Ok(Self {
            name: name.to_owned(),
            state: dir.join("state"),
            configfs: dir.join("configfs"),
            pool,
            link: Arc::new(Link::default()),
            address,
            hooks,
            chaos,
            running: None,
            incarnation: 0,
            recorder: None,
            grid,
        })
    }

    fn config(&self) -> ServerConfig {
        ServerConfig {
            state_dir: self.state.clone(),
            // Never bound: the simulation serves the agent on its own transport.
            listen: Listen::Unix(self.state.join("unused.sock")),
            engine: EngineKind::Sync,
            target: TargetConfig::Double {
                root: self.configfs.clone(),
            },
            pools: vec![PoolConfig {
                name: POOL.into(),
                kind: PoolKind::PlainFile {
                    dir: self.pool.clone(),
                },
            }],
            settings: AgentSettings {
                nvme_address: self.address,
                kernel_random_identity: false,
                unsafe_revoke_acl_only: false,
                hooks: self.hooks.clone(),
            },
            tls: None,
            insecure_plaintext: true,
            metrics_listen: None,
            command_timeout: Duration::from_secs(10),
        }
    }

    /// Starts a new incarnation (it waits for the controller's resync, C3).
    pub async fn start(&mut self) -> Result<(), crate::error::SimError> {
        let metrics = Arc::new(Metrics::new());
        let recorder = match &self.recorder {
            Some(r) => r.clone(),
            None => {
                std::fs::create_dir_all(&self.state)?;
                let r = PowerSwitch {
                    inner: Recorder::new(&self.state)?,
                    grid: Arc::clone(&self.grid),
                    off: Arc::new(PowerOff {
                        tripped: AtomicBool::new(false),
                        link: Arc::clone(&self.link),
                        kill: Mutex::new(None),
                    }),
                };
                self.recorder = Some(r.clone());
                r
            }
        };
        let agent =
            build_agent_with_fs(&self.config(), &metrics, Arc::new(recorder.clone())).await?;
        let kill = Arc::new(KillSwitch::default());
        let service = ChaosAgent::new(
            AgentService::new(agent, metrics),
            self.chaos.clone(),
            &self.name,
            Arc::clone(&kill),
        );
        let (tx, rx) = mpsc::unbounded_channel();
        let serve = tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
            // Ends when the incarnation is aborted; an error here is the crash itself.
            let _ = tonic::transport::Server::builder()
                .add_service(AgentServer::new(service))
                .serve_with_incoming(incoming)
                .await;
        });
        self.incarnation += 1;
        *recorder
            .off
            .kill
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&kill));
        self.link.up(Arc::clone(&kill), tx);
        self.running = Some((kill, serve));
        Ok(())
    }

    /// Kills the process: connections break, request tasks die where they are, work already
    /// handed to the blocking seam finishes (it was in the kernel's hands). With `lose_state`
    /// the state directory is gone too.
    pub async fn crash(&mut self, lose_state: bool) {
        self.link.down();
        if let Some((kill, serve)) = self.running.take() {
            kill.kill();
            serve.abort();
        }
        self.hooks.abort_requests();
        // Work already given to the blocking seam completes before the next incarnation starts.
        for _ in 0..10_000 {
            if pillar_agent::blocking::pending() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if lose_state {
            let _ = std::fs::remove_dir_all(&self.state);
            self.recorder = None;
        }
    }

    /// Whether the armed cut has happened (the node stopped answering).
    pub fn power_is_off(&self) -> bool {
        self.recorder
            .as_ref()
            .is_some_and(|s| s.off.tripped.load(Ordering::Acquire))
    }

    /// The power is off (the armed cut happened, or the simulation cuts it now, between two
    /// durable operations): the process dies, the state directory is left as one crash state
    /// of this boot's writes (chosen by the seed), the target's memory is gone (see the module
    /// documentation).
    pub async fn cut_power(&mut self) -> std::io::Result<PowerLoss> {
        if let Some(switch) = &self.recorder {
            switch.trip();
        }
        self.crash(false).await;
        let Some(switch) = self.recorder.take() else {
            return Ok(PowerLoss {
                states: 0,
                lost_writes: false,
            });
        };
        let recording = switch.inner.recording();
        let states = recording.states_after(recording.ops.len(), Model::SECTOR);
        let pick = usize::try_from(self.chaos.below(states.len() as u64)).unwrap_or(0);
        let now = current_state(&self.state)?;
        let chosen = states
            .iter()
            .nth(pick)
            .cloned()
            .unwrap_or_else(|| now.clone());
        std::fs::remove_dir_all(&self.state)?;
        std::fs::create_dir_all(&self.state)?;
        rebuild(&chosen, &self.state)?;
        let _ = std::fs::remove_dir_all(&self.configfs);
        Ok(PowerLoss {
            states: states.len(),
            lost_writes: chosen.files != now.files,
        })
    }
}
