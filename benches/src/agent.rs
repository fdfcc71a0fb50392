//! An agent served in-process on a unix socket, for the end-to-end and density benchmarks:
//! io_uring engine, marks in a state directory on the disk under test, the configfs double and
//! a plain-file pool on tmpfs (so the figures are the agent's, not a device's).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use pillar_agent::AgentSettings;
use pillar_agent::TargetConfig;
use pillar_agent::grpc::AgentService;
use pillar_agent::metrics::Metrics;
use pillar_agent::server::build_agent;
use pillar_agent::service::Agent;
use pillar_agent::{EngineKind, Listen, ServerConfig};
use pillar_agent::{PoolConfig, PoolKind};
use pillar_agent_api::v1 as api;
use pillar_agent_api::v1::agent_client::AgentClient;
use pillar_agent_api::v1::agent_server::AgentServer;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// The agent's gRPC client.
pub type Client = AgentClient<Channel>;

const POOL: &str = "bench";
const SERVICE: u32 = 4420;

/// The volume ID of volume `n`.
pub fn volume(n: usize) -> String {
    format!("pvc-bench-{n:06}")
}

/// Host NQN `n`.
pub fn host(n: u32) -> String {
    format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-{n:012}")
}

fn token(volume: &str, generation: u64) -> Option<api::FencingToken> {
    Some(api::FencingToken {
        lifecycle_uid: format!("uid-{volume}"),
        generation,
    })
}

fn export_request(volume: &str, hosts: &[String]) -> api::ExportRequest {
    api::ExportRequest {
        token: token(volume, 2),
        volume_id: volume.to_owned(),
        pool: POOL.into(),
        protocol: Some(api::ExportProtocol {
            service: SERVICE,
            acl: true,
            auth_none: true,
            tls: false,
        }),
        allowed_host_nqns: hosts.to_vec(),
        credentials: vec![],
    }
}

/// A running agent.
#[allow(missing_debug_implementations)] // holds the agent and a task
pub struct Node {
    root: PathBuf,
    shm: Arc<tempfile::TempDir>,
    agent: Arc<Agent>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Node {
    /// Starts an agent with its state under `<dir>/<name>` and serves it (after an empty
    /// resync, so it accepts exports).
    pub async fn start(dir: &Path, name: &str) -> anyhow::Result<Self> {
        let root = dir.join(name);
        std::fs::create_dir_all(&root)?;
        let shm = Arc::new(tempfile::tempdir_in("/dev/shm")?);
        std::fs::create_dir_all(shm.path().join("pool"))?;
        let node = Self::serve(root, shm).await?;
        node.client()
            .await?
            .resync_exports(api::ResyncExportsRequest::default())
            .await?;
        Ok(node)
    }

    async fn serve(root: PathBuf, shm: Arc<tempfile::TempDir>) -> anyhow::Result<Self> {
        let config = server_config(
            EngineKind::Uring,
            root.join("state"),
            root.join("agent.sock"),
            shm.path().join("configfs"),
            shm.path().join("pool"),
        )?;
        let metrics = Arc::new(Metrics::new());
        let agent = build_agent(&config, &metrics).await?;
        let socket = root.join("agent.sock");
        let _ = std::fs::remove_file(&socket);
        let listener = tokio::net::UnixListener::bind(&socket)?;
        let service = AgentService::new(Arc::clone(&agent), metrics);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let incoming = pillar_grpc_unix::incoming(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(AgentServer::new(service))
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Self {
            root,
            shm,
            agent,
            stop: Some(stop),
            task,
        })
    }

    /// A client on the agent's socket.
    pub async fn client(&self) -> anyhow::Result<Client> {
        connect(&self.root.join("agent.sock")).await
    }

    /// The engine's `io_uring_enter` calls and eventfd writes so far.
    pub fn syscalls(&self) -> (u64, u64) {
        self.agent.engine().stats().syscalls()
    }

    /// Creates `volume` (1 MiB).
    pub async fn create(&self, client: &mut Client, volume: &str) -> anyhow::Result<()> {
        create(client, volume).await
    }

    /// Exports `volume` to `hosts` (ACL on).
    pub async fn export(
        &self,
        client: &mut Client,
        volume: &str,
        hosts: &[String],
    ) -> anyhow::Result<()> {
        export(client, volume, hosts).await
    }

    /// Unexports and deletes `volume`.
    pub async fn unexport_and_delete(
        &self,
        client: &mut Client,
        volume: &str,
    ) -> anyhow::Result<()> {
        client
            .unexport(api::UnexportRequest {
                token: token(volume, 3),
                volume_id: volume.to_owned(),
            })
            .await?;
        client
            .delete_volume(api::DeleteVolumeRequest {
                token: token(volume, 4),
                volume_id: volume.to_owned(),
                pool: POOL.into(),
            })
            .await?;
        Ok(())
    }

    /// Stops this agent and starts another on the same state and pool with an empty target,
    /// as after a storage reboot; it waits for a resync.
    pub async fn restart_with_empty_target(self) -> anyhow::Result<Self> {
        let (root, shm) = (self.root.clone(), Arc::clone(&self.shm));
        self.stop().await;
        std::fs::remove_dir_all(shm.path().join("configfs"))?;
        Self::serve(root, shm).await
    }

    /// Resyncs volumes 1..=count exported to `hosts`; how many failed.
    pub async fn resync(
        &self,
        client: &mut Client,
        count: usize,
        hosts: &[String],
    ) -> anyhow::Result<usize> {
        let exports = (1..=count)
            .map(|n| export_request(&volume(n), hosts))
            .collect();
        let response = client
            .resync_exports(api::ResyncExportsRequest {
                exports,
                ..Default::default()
            })
            .await?
            .into_inner();
        let failed: BTreeMap<String, String> = response
            .results
            .into_iter()
            .filter(|r| !r.ok)
            .map(|r| (r.volume_id, r.message))
            .collect();
        if let Some((v, why)) = failed.iter().next() {
            print_resync_failure(v, why);
        }
        Ok(failed.len())
    }

    /// Stops the agent.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

#[allow(clippy::print_stderr)] // the benchmark's own diagnostics
fn print_resync_failure(volume: &str, why: &str) {
    eprintln!("resync of {volume} failed: {why}");
}

/// A client on the agent socket `socket`.
pub async fn connect(socket: &Path) -> anyhow::Result<Client> {
    let socket = socket.to_path_buf();
    let channel = Endpoint::try_from("http://agent.invalid")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let s = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(s).await?)) }
        }))
        .await?;
    Ok(AgentClient::new(channel))
}

/// Creates `volume` (1 MiB) in the benchmark pool.
pub async fn create(client: &mut Client, volume: &str) -> anyhow::Result<()> {
    client
        .create_volume(api::CreateVolumeRequest {
            token: token(volume, 1),
            volume_id: volume.to_owned(),
            pool: POOL.into(),
            size_bytes: 1 << 20,
            source: None,
        })
        .await?;
    Ok(())
}

/// Exports `volume` to `hosts` (ACL on).
pub async fn export(client: &mut Client, volume: &str, hosts: &[String]) -> anyhow::Result<()> {
    client.export(export_request(volume, hosts)).await?;
    Ok(())
}

/// The agent's real server (`pillar_agent::serve_with_limits`, default bounds) on the unix
/// socket `socket` until SIGTERM: `engine`, state in `state`, the configfs double at
/// `configfs`, a plain-file pool in `pool`.
pub async fn serve_until_sigterm(
    engine: EngineKind,
    state: PathBuf,
    socket: PathBuf,
    configfs: PathBuf,
    pool: PathBuf,
) -> anyhow::Result<()> {
    let config = server_config(engine, state, socket, configfs, pool)?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let shutdown = async move {
        term.recv().await;
    };
    pillar_agent::serve_with_limits(config, pillar_grpc_unix::Limits::default(), shutdown).await?;
    Ok(())
}

/// A benchmark agent's configuration: `engine`, state in `state`, listening on the unix socket
/// `socket`, the configfs double at `configfs`, a plain-file pool in `pool`, no TLS.
fn server_config(
    engine: EngineKind,
    state: PathBuf,
    socket: PathBuf,
    configfs: PathBuf,
    pool: PathBuf,
) -> anyhow::Result<ServerConfig> {
    Ok(ServerConfig {
        state_dir: state,
        listen: Listen::Unix(socket),
        engine,
        target: TargetConfig::Double { root: configfs },
        pools: vec![PoolConfig {
            name: POOL.into(),
            kind: PoolKind::PlainFile { dir: pool },
        }],
        settings: AgentSettings {
            nvme_address: "127.0.0.1".parse()?,
            kernel_random_identity: false,
            unsafe_revoke_acl_only: false,
            hooks: pillar_agent::Hooks::default(),
        },
        tls: None,
        insecure_plaintext: true,
        metrics_listen: None,
        command_timeout: Duration::from_secs(30),
    })
}

/// The pool the benchmark agents serve.
pub const POOL_NAME: &str = POOL;

/// Grants (or revokes) host 1 on `volume` with token generation `generation`.
pub async fn grant_or_revoke(
    client: &mut Client,
    volume: &str,
    generation: u64,
    grant: bool,
) -> anyhow::Result<()> {
    if grant {
        client
            .grant_initiator(api::GrantInitiatorRequest {
                token: token(volume, generation),
                volume_id: volume.to_owned(),
                host_nqn: host(1),
                credentials: None,
            })
            .await?;
    } else {
        client
            .revoke_initiator(api::RevokeInitiatorRequest {
                token: token(volume, generation),
                volume_id: volume.to_owned(),
                host_nqn: host(1),
            })
            .await?;
    }
    Ok(())
}
