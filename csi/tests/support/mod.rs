//! Harness for controller tests: a real agent (file backend on loop devices, configfs test
//! double) serving gRPC on a unix socket, a state store (embedded, or kube-rs against the API
//! server double), and the CSI controller served on its own unix socket.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use pillar_agent::AgentSettings;
use pillar_agent::Hooks;
use pillar_agent::TargetConfig;
use pillar_agent::{EngineKind, Listen, ServerConfig, serve as serve_agent};
use pillar_agent::{PoolConfig, PoolKind};
use pillar_csi::agents::Agents;
use pillar_csi::controller::{Controller, ControllerService};
use pillar_csi::csi;
use pillar_csi::csi::controller_client::ControllerClient;
use pillar_state::apiserver_double::ApiServerDouble;
use pillar_state::crd::{NvmeTcp, PillarAgentSpec, PillarProtocolSpec, PoolRef, ProtocolAuth};
use pillar_state::embedded::EmbeddedStore;
use pillar_state::faults::FaultyStore;
use pillar_state::kube_store::KubeStore;
use pillar_state::store::StateStore;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

pub async fn channel(socket: &Path) -> Channel {
    let socket = socket.to_owned();
    for _ in 0..200 {
        let s = socket.clone();
        let ch = Endpoint::try_from("http://csi.invalid")
            .unwrap()
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let s = s.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(s).await?)) }
            }))
            .await;
        if let Ok(ch) = ch {
            return ch;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("nothing listens on {}", socket.display());
}

/// Which store the controller uses.
#[derive(Clone, Copy, Debug)]
pub enum StoreKind {
    Embedded,
    Kube,
}

pub struct AgentUnderTest {
    /// The agent's test hooks; kept across restarts.
    pub hooks: Hooks,
    pub socket: PathBuf,
    pub state: PathBuf,
    pub pool: PathBuf,
    pub configfs: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl AgentUnderTest {
    pub async fn start(dir: &Path) -> Self {
        let mut a = Self {
            hooks: Hooks::default(),
            socket: dir.join("agent.sock"),
            state: dir.join("agent-state"),
            pool: dir.join("pool"),
            configfs: dir.join("configfs"),
            stop: None,
            task: None,
        };
        std::fs::create_dir_all(&a.pool).unwrap();
        a.restart().await;
        a
    }

    pub async fn restart(&mut self) {
        self.stop().await;
        let config = ServerConfig {
            state_dir: self.state.clone(),
            listen: Listen::Unix(self.socket.clone()),
            engine: EngineKind::Uring,
            target: TargetConfig::Double {
                root: self.configfs.clone(),
            },
            pools: vec![PoolConfig {
                name: "p1".into(),
                kind: PoolKind::File {
                    dir: self.pool.clone(),
                },
            }],
            settings: AgentSettings {
                nvme_address: "127.0.0.1".parse().unwrap(),
                kernel_random_identity: false,
                unsafe_revoke_acl_only: false,
                hooks: self.hooks.clone(),
            },
            tls: None,
            insecure_plaintext: true,
            metrics_listen: None,
            command_timeout: Duration::from_secs(10),
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        self.task = Some(tokio::spawn(async move {
            serve_agent(config, async {
                let _ = stopped.await;
            })
            .await
            .expect("agent serves");
        }));
        self.stop = Some(stop);
        let _ = channel(&self.socket).await;
    }

    pub async fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }

    pub fn state(&self) -> pillar_nvmet::TargetState {
        pillar_nvmet::observe(&self.configfs).unwrap()
    }
}

pub struct Env {
    pub dir: tempfile::TempDir,
    pub agent: AgentUnderTest,
    pub store: Arc<dyn StateStore>,
    /// The store the controllers use: on the Kubernetes double, authenticated as pillar's
    /// controller ServiceAccount (RBAC of deploy/base/rbac.yaml); otherwise `store`.
    pub controller_store: Arc<dyn StateStore>,
    /// The controller's store: `store` behind a wrapper that can make writes conflict.
    pub faults: Arc<FaultyStore>,
    pub controller: Arc<Controller>,
    pub client: ControllerClient<Channel>,
    pub double: Option<ApiServerDouble>,
    /// The embedded store itself (a handle on the same directory), when that is the store.
    pub embedded: Option<EmbeddedStore>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

pub const AGENT: &str = "storage-1";
/// pillar's namespace, where the Kubernetes store keeps nodes' credentials Secrets.
pub const CREDENTIALS_NAMESPACE: &str = "pillar-system";

impl Env {
    pub async fn start(kind: StoreKind, acl: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let agent = AgentUnderTest::start(dir.path()).await;
        // `store` is the operator's view (it creates the PillarAgent and PillarProtocol); the
        // controller's own store, on the Kubernetes double, runs as pillar's controller
        // ServiceAccount, so every request it makes is held to deploy/base/rbac.yaml.
        let (store, controller_store, double, embedded): (
            Arc<dyn StateStore>,
            Arc<dyn StateStore>,
            _,
            _,
        ) = match kind {
            StoreKind::Embedded => {
                let embedded = EmbeddedStore::open(dir.path().join("store")).await.unwrap();
                let store: Arc<dyn StateStore> = Arc::new(embedded.clone());
                (Arc::clone(&store), store, None, Some(embedded))
            }
            StoreKind::Kube => {
                let double = ApiServerDouble::start().await.unwrap();
                (
                    Arc::new(KubeStore::new(double.client().unwrap())),
                    Arc::new(
                        KubeStore::new(double.controller_client().unwrap())
                            .with_credentials_namespace(CREDENTIALS_NAMESPACE),
                    ),
                    Some(double),
                    None,
                )
            }
        };
        store
            .create_agent(
                AGENT,
                PillarAgentSpec {
                    node: AGENT.into(),
                    address: format!("unix://{}", agent.socket.display()),
                    tls: None,
                    pools: vec![PoolRef {
                        name: "p1".into(),
                        kind: "file".into(),
                    }],
                    nvme_address: "127.0.0.1".into(),
                    topology: Default::default(),
                },
            )
            .await
            .unwrap();
        store
            .create_protocol(
                "nvme-tcp",
                PillarProtocolSpec {
                    nvme_tcp: NvmeTcp {
                        acl,
                        // W10: both stores keep DH-HMAC-CHAP credentials (the Kubernetes
                        // store in Secrets), so every run has authentication on, as by default.
                        auth: ProtocolAuth::Dhchap,
                        ..NvmeTcp::default()
                    },
                },
            )
            .await
            .unwrap();
        let faults = FaultyStore::new(Arc::clone(&controller_store));
        let controller = Controller::new(
            Arc::clone(&faults) as Arc<dyn StateStore>,
            Agents::new(None, true, Duration::from_secs(10)),
        );
        // The agent just started: it waits for the resync the controller sends.
        controller.resync_waiting_agents().await;
        let socket = dir.path().join("controller.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let service = ControllerService::new(Arc::clone(&controller));
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(csi::controller_server::ControllerServer::new(service))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
                .unwrap();
        });
        let client = ControllerClient::new(channel(&socket).await);
        Self {
            dir,
            agent,
            store,
            controller_store,
            faults,
            controller,
            client,
            double,
            embedded,
            stop: Some(stop),
        }
    }

    /// The events recorded about `volume`, as `(type, reason)`, oldest first: read back from
    /// the embedded store, or from the API server double (`events.k8s.io/v1` objects).
    pub fn events(&self, volume: &str) -> Vec<(String, String)> {
        if let Some(e) = &self.embedded {
            return e
                .events()
                .into_iter()
                .filter(|e| e.volume == volume)
                .map(|e| (e.type_.as_str().to_owned(), e.reason))
                .collect();
        }
        let double = self.double.as_ref().expect("a store that records events");
        double
            .events()
            .into_iter()
            .filter(|e| e["regarding"]["name"] == volume)
            .map(|e| {
                let field = |k: &str| e[k].as_str().unwrap_or_default().to_owned();
                (field("type"), field("reason"))
            })
            .collect()
    }

    /// Another controller replica over the same store, through its own wrapper, so a test can
    /// stall or fail its writes alone.
    pub fn replica(&self) -> (Arc<Controller>, Arc<FaultyStore>) {
        let faults = FaultyStore::new(Arc::clone(&self.controller_store));
        let controller = Controller::new(
            Arc::clone(&faults) as Arc<dyn StateStore>,
            Agents::new(None, true, Duration::from_secs(10)),
        );
        (controller, faults)
    }

    /// A second controller (another replica, or the next leader) over the same store.
    pub fn second_controller(&self) -> Arc<Controller> {
        Controller::new(
            Arc::clone(&self.controller_store),
            Agents::new(None, true, Duration::from_secs(10)),
        )
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        detach_loops_under(&self.agent.pool);
    }
}

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
            let _ = std::process::Command::new("losetup")
                .arg("-d")
                .arg(format!("/dev/{name}"))
                .status();
        }
    }
}

pub fn host(n: u32) -> String {
    format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-{n:012}")
}

pub fn node_id(n: u32) -> String {
    format!("node-{n}/{}", host(n))
}

pub fn cap(mode: csi::volume_capability::access_mode::Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode.into() }),
        access_type: Some(csi::volume_capability::AccessType::Mount(
            csi::volume_capability::MountVolume {
                fs_type: "ext4".into(),
                mount_flags: vec![],
                volume_mount_group: String::new(),
            },
        )),
    }
}

pub use csi::volume_capability::access_mode::Mode;

pub fn create(name: &str, mode: Mode) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: 16 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap(mode)],
        ..Default::default()
    }
}

/// The DH-HMAC-CHAP secret the controller made for node `n` (W10), as kubelet would pass it:
/// read from the embedded store's file or the Kubernetes store's Secret; `None` before the
/// node's first publication.
pub fn node_secret(env: &Env, n: u32) -> Option<String> {
    let node = node_id(n);
    let name = node.split('/').next().unwrap_or_default().to_owned();
    if let Some(double) = &env.double {
        let secret = double.secret_data(
            CREDENTIALS_NAMESPACE,
            &pillar_state::kube_credentials::secret_name(&name),
            "dhchapSecret",
        )?;
        return Some(String::from_utf8(secret).unwrap());
    }
    let embedded = env.embedded.as_ref()?;
    let dir = embedded
        .root()
        .join(pillar_state::embedded::CREDENTIALS_DIR);
    pillar_state::credentials::read(&dir, &name)
        .unwrap()
        .map(|c| c.secret)
}

pub fn publish(
    volume: &str,
    node: u32,
    mode: Mode,
    readonly: bool,
) -> csi::ControllerPublishVolumeRequest {
    csi::ControllerPublishVolumeRequest {
        volume_id: volume.into(),
        node_id: node_id(node),
        volume_capability: Some(cap(mode)),
        readonly,
        ..Default::default()
    }
}

pub fn unpublish(volume: &str, node: u32) -> csi::ControllerUnpublishVolumeRequest {
    csi::ControllerUnpublishVolumeRequest {
        volume_id: volume.into(),
        node_id: node_id(node),
        ..Default::default()
    }
}

pub fn delete(volume: &str) -> csi::DeleteVolumeRequest {
    csi::DeleteVolumeRequest {
        volume_id: volume.into(),
        ..Default::default()
    }
}

pub fn nqn(volume: &str) -> String {
    pillar_nvmet::VolumeId::parse(volume)
        .unwrap()
        .subsystem_nqn()
        .to_string()
}
