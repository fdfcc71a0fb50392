//! Test harness: a real agent (in-process or as a child process) serving real gRPC on a unix
//! socket, with the file backend on real loop devices and the configfs test double.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use pillar_agent::AgentSettings;
use pillar_agent::Hooks;
use pillar_agent::TargetConfig;
use pillar_agent::{EngineKind, Listen, ServerConfig, serve};
use pillar_agent::{PoolConfig, PoolKind};
use pillar_agent_api::v1 as api;
use pillar_agent_api::v1::agent_client::AgentClient;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

pub type Client = AgentClient<Channel>;

pub const ENGINES: [EngineKind; 2] = [EngineKind::Uring, EngineKind::Sync];

pub fn token(uid: &str, generation: u64) -> Option<api::FencingToken> {
    Some(api::FencingToken {
        lifecycle_uid: uid.into(),
        generation,
    })
}

pub fn host(n: u32) -> String {
    format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-{n:012}")
}

/// Directories of one agent: state, file pool, configfs double, socket.
pub struct Dirs {
    pub tmp: tempfile::TempDir,
}

impl Dirs {
    pub fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("pool")).unwrap();
        Self { tmp }
    }
    pub fn state(&self) -> PathBuf {
        self.tmp.path().join("state")
    }
    pub fn pool(&self) -> PathBuf {
        self.tmp.path().join("pool")
    }
    pub fn configfs(&self) -> PathBuf {
        self.tmp.path().join("configfs")
    }
    pub fn socket(&self) -> PathBuf {
        self.tmp.path().join("agent.sock")
    }
    pub fn config(&self, engine: EngineKind) -> ServerConfig {
        ServerConfig {
            state_dir: self.state(),
            listen: Listen::Unix(self.socket()),
            engine,
            target: TargetConfig::Double {
                root: self.configfs(),
            },
            pools: vec![PoolConfig {
                name: "p1".into(),
                kind: PoolKind::File { dir: self.pool() },
            }],
            settings: AgentSettings {
                nvme_address: "127.0.0.1".parse().unwrap(),
                kernel_random_identity: false,
                unsafe_revoke_acl_only: false,
                hooks: Default::default(),
            },
            tls: None,
            insecure_plaintext: true,
            metrics_listen: None,
            command_timeout: Duration::from_secs(10),
        }
    }
}

pub async fn connect(socket: &Path) -> Client {
    let socket = socket.to_owned();
    for _ in 0..200 {
        let s = socket.clone();
        let channel = Endpoint::try_from("http://agent.invalid")
            .unwrap()
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let s = s.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(s).await?)) }
            }))
            .await;
        if let Ok(channel) = channel {
            let mut client = AgentClient::new(channel);
            if client.health(api::HealthRequest {}).await.is_ok() {
                return client;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("agent did not come up on {}", socket.display());
}

/// An agent served in-process; stopped on drop. Volumes it created are deleted from their loop
/// devices by [`Agent::cleanup`].
pub struct Agent {
    pub dirs: Dirs,
    pub client: Client,
    /// The agent's test hooks (stall or delay a request at a named point).
    pub hooks: Hooks,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Everything a request may change: the state directory (marks, identity records), the pool and
/// the configfs tree, as [`snapshot`]s.
pub type AgentSnapshot = (
    Vec<(String, String)>,
    Vec<(String, String)>,
    Vec<(String, String)>,
);

impl Agent {
    /// The agent's files now: compare two to prove a request changed nothing.
    pub fn snapshot(&self) -> AgentSnapshot {
        (
            snapshot(&self.dirs.state()),
            snapshot(&self.dirs.pool()),
            snapshot(&self.dirs.configfs()),
        )
    }

    pub async fn start(engine: EngineKind) -> Self {
        Self::start_in(Dirs::new(), engine).await
    }

    pub async fn start_in(dirs: Dirs, engine: EngineKind) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let hooks = Hooks::default();
        let mut config = dirs.config(engine);
        config.settings.hooks = hooks.clone();
        let task = tokio::spawn(async move {
            serve(config, async {
                let _ = stopped.await;
            })
            .await
            .expect("agent serves");
        });
        let client = connect(&dirs.socket()).await;
        Self {
            dirs,
            client,
            hooks,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Stops the server and hands back its directories.
    pub async fn stop(mut self) -> Dirs {
        self.shutdown().await;
        std::mem::replace(&mut self.dirs, Dirs::new())
    }

    async fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    /// Sends an empty resync: the agent starts serving.
    pub async fn serve_now(&mut self) {
        self.client
            .resync_exports(api::ResyncExportsRequest {
                exports: vec![],
                ..Default::default()
            })
            .await
            .unwrap();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        detach_loops_under(&self.dirs.pool());
    }
}

/// The pool's loop devices go with the directories, wherever they end: a test that stops an
/// agent and keeps its `Dirs` (to restart on them) would otherwise leave them bound to deleted
/// files, two more at every run.
impl Drop for Dirs {
    fn drop(&mut self) {
        detach_loops_under(&self.pool());
    }
}

/// Detaches every loop device whose backing file lies under `dir` (test cleanup).
pub fn detach_loops_under(dir: &Path) {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        let Ok(backing) = std::fs::read_to_string(e.path().join("loop/backing_file")) else {
            continue;
        };
        if backing
            .trim()
            .trim_end_matches(" (deleted)")
            .starts_with(&dir.display().to_string())
        {
            let _ = Command::new("losetup")
                .arg("-d")
                .arg(format!("/dev/{name}"))
                .status();
        }
    }
}

/// The agent binary as a child process (for kill and restart tests).
pub struct AgentProcess {
    pub child: Child,
}

impl AgentProcess {
    pub fn spawn(dirs: &Dirs, engine: &str) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_pillar-agent"))
            .args(["--state-dir", dirs.state().to_str().unwrap()])
            .args(["--listen", &format!("unix://{}", dirs.socket().display())])
            .args(["--engine", engine, "--target", "test-double"])
            .args(["--configfs-root", dirs.configfs().to_str().unwrap()])
            .args(["--nvme-address", "127.0.0.1", "--insecure-plaintext"])
            .args(["--pool", &format!("p1=file:{}", dirs.pool().display())])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("agent binary starts");
        Self { child }
    }

    /// SIGKILL: no shutdown path runs.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> tonic::Code {
    r.expect_err("the call must fail").code()
}

pub fn export_req(
    uid: &str,
    generation: u64,
    volume: &str,
    acl: bool,
    hosts: &[u32],
) -> api::ExportRequest {
    api::ExportRequest {
        token: token(uid, generation),
        volume_id: volume.into(),
        pool: "p1".into(),
        protocol: Some(api::ExportProtocol {
            service: 4420,
            acl,
            auth_none: true,
            tls: false,
        }),
        allowed_host_nqns: hosts.iter().map(|h| host(*h)).collect(),
        credentials: vec![],
    }
}

pub fn create_req(uid: &str, generation: u64, volume: &str, size: u64) -> api::CreateVolumeRequest {
    api::CreateVolumeRequest {
        token: token(uid, generation),
        volume_id: volume.into(),
        pool: "p1".into(),
        size_bytes: size,
        source: None,
    }
}

pub const MIB: u64 = 1 << 20;

/// The files of a directory tree, recursively, with their content (for "nothing changed").
pub fn snapshot(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                stack.push(p);
                out.push((rel, "dir".into()));
            } else if ft.is_symlink() {
                out.push((rel, std::fs::read_link(&p).unwrap().display().to_string()));
            } else {
                out.push((
                    rel,
                    std::fs::read_to_string(&p).unwrap_or_else(|_| "<binary>".into()),
                ));
            }
        }
    }
    out.sort();
    out
}
