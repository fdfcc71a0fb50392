//! The single-machine mode: agent (file backend), controller (embedded store) and node plugin in
//! one process, without Kubernetes, each on its own unix socket.
//!
//! On a kernel with nvmet and the NVMe/TCP host it runs the real target and connects over
//! loopback. On a kernel without them (containers, CI machines) it says so and runs the target
//! on the configfs test double, with the node using the local loop device: that is named in
//! every line it prints, never passed off as NVMe/TCP.
//!
//! Authentication. The protocol it records says `auth: none`: the host and the target are this
//! one machine, meeting on 127.0.0.1 (the port listens there only), so DH-HMAC-CHAP would prove
//! nothing about a network no other host is on; and the node-stage secret a kubelet hands the
//! node plugin from the PV's Secret has no kubelet here to carry it. The controller shows it as
//! on every `auth: none` protocol (each published volume's `AuthDisabled` condition and a
//! warning), and the banner says it.
//!
//! This is the one crate that links the agent (`pillar-agent`) with the CSI plugin: the
//! controller and node plugin themselves reach agents only through `pillar-agent-api`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pillar_agent::AgentSettings;
use pillar_agent::TargetConfig;
use pillar_agent::{EngineKind, Listen, ServerConfig};
use pillar_agent::{PoolConfig, PoolKind};
use pillar_host::HostPaths;
use pillar_nvmet::HostNqn;
use pillar_state::EmbeddedStore;
use pillar_state::crd::{NvmeTcp, PillarAgentSpec, PillarProtocolSpec, PoolRef, ProtocolAuth};
use pillar_state::store::StateStore;

use pillar_csi::node::{AttachMode, NodeConfig};
use pillar_csi::root::{AgentReach, ControllerBuilder, Leader, Limits, WiredNode};

pub mod demo;

/// Options of the single-machine mode.
#[derive(Clone, Debug)]
pub struct LocalConfig {
    /// Everything lives here: sockets, agent state, pool files, store, node state.
    pub dir: PathBuf,
    pub engine: EngineKind,
    /// Use the configfs test double even where the kernel has nvmet.
    pub force_double: bool,
}

/// Where the three services listen.
#[derive(Clone, Debug)]
pub struct LocalSockets {
    pub agent: PathBuf,
    pub controller: PathBuf,
    pub node: PathBuf,
    /// "kernel" or "test-double".
    pub target: &'static str,
}

/// Why the single-machine mode could not start.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("cannot prepare {path}")]
    Prepare {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("embedded store")]
    Store(#[from] pillar_state::StoreError),
    #[error("controller metrics")]
    Metrics(#[source] pillar_csi::controller::metrics::MetricsError),
    #[error("node plugin")]
    Node(#[source] pillar_csi::node::NodeError),
    #[error("host NQN {0:?} in the node state is invalid")]
    HostNqn(String),
}

fn prepare(path: &Path) -> Result<(), LocalError> {
    std::fs::create_dir_all(path).map_err(|source| LocalError::Prepare {
        path: path.to_owned(),
        source,
    })
}

/// Whether this kernel can run the real target and host.
pub fn kernel_has_nvmet() -> bool {
    Path::new(pillar_nvmet::KERNEL_NVMET_ROOT)
        .join("subsystems")
        .is_dir()
        && Path::new("/dev/nvme-fabrics").exists()
}

/// The node's host identity, generated once and kept in `dir`.
fn host_identity(dir: &Path) -> Result<(HostNqn, uuid::Uuid), LocalError> {
    let id_path = dir.join("hostid");
    let id = match std::fs::read_to_string(&id_path) {
        Ok(s) => s.trim().parse().map_err(|_| LocalError::HostNqn(s))?,
        Err(_) => {
            let id = uuid::Uuid::new_v4();
            std::fs::write(&id_path, id.to_string()).map_err(|source| LocalError::Prepare {
                path: id_path.clone(),
                source,
            })?;
            id
        }
    };
    let nqn = format!("{}{id}", pillar_nvmet::UUID_NQN_PREFIX);
    Ok((
        HostNqn::parse(&nqn).map_err(|_| LocalError::HostNqn(nqn))?,
        id,
    ))
}

/// Starts the three services; they run until `shutdown` resolves. Returns their sockets once
/// all three answer.
pub async fn start(
    config: LocalConfig,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> Result<LocalSockets, LocalError> {
    let dir = &config.dir;
    for sub in ["agent", "pool", "store", "node"] {
        prepare(&dir.join(sub))?;
    }
    let real = !config.force_double && kernel_has_nvmet();
    let sockets = LocalSockets {
        agent: dir.join("agent.sock"),
        controller: dir.join("controller.sock"),
        node: dir.join("node.sock"),
        target: if real { "kernel" } else { "test-double" },
    };
    let stop = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|v| *v).await;
    };

    let agent_config = agent_config(&config, &sockets, real);
    let agent_stop = stop(shutdown.clone());
    tokio::spawn(async move {
        if let Err(e) = pillar_agent::serve(agent_config, agent_stop).await {
            tracing::error!(error = ?e, "agent stopped");
        }
    });

    // Controller over the embedded store, its one agent and protocol recorded.
    let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::open(dir.join("store")).await?);
    seed_records(store.as_ref(), &sockets.agent).await?;
    let controller = ControllerBuilder::new(store, AgentReach::network(None, true))
        .resync_every(Duration::from_secs(1), Leader::Sole)
        .build()
        .await
        .map_err(LocalError::Metrics)?;
    let controller_socket = sockets.controller.clone();
    let controller_stop = stop(shutdown.clone());
    tokio::spawn(async move {
        let r = controller
            .serve(&controller_socket, Limits::default(), controller_stop)
            .await;
        if let Err(e) = r {
            tracing::error!(error = ?e, "controller stopped");
        }
    });

    // Node plugin.
    let (host_nqn, host_id) = host_identity(&dir.join("node"))?;
    let node = WiredNode::new(NodeConfig {
        node_name: "local".into(),
        host_nqn,
        host_id,
        state_dir: dir.join("node"),
        paths: HostPaths::system(),
        attach: if real {
            AttachMode::NvmeTcp
        } else {
            AttachMode::LocalDevice
        },
        connect_timeout: Duration::from_secs(30),
        reservations: true,
        topology: Default::default(),
    })
    .map_err(LocalError::Node)?;
    let node_socket = sockets.node.clone();
    let node_stop = stop(shutdown.clone());
    tokio::spawn(async move {
        if let Err(e) = node.serve(&node_socket, Limits::default(), node_stop).await {
            tracing::error!(error = ?e, "node plugin stopped");
        }
    });
    for socket in [&sockets.agent, &sockets.controller, &sockets.node] {
        wait_for_socket(socket).await;
    }
    Ok(sockets)
}

/// The agent: file backend in `dir/pool`, the kernel target where `real`, else the configfs
/// double; plaintext on its unix socket only.
fn agent_config(config: &LocalConfig, sockets: &LocalSockets, real: bool) -> ServerConfig {
    let dir = &config.dir;
    ServerConfig {
        state_dir: dir.join("agent"),
        listen: Listen::Unix(sockets.agent.clone()),
        engine: config.engine,
        target: if real {
            TargetConfig::Kernel {
                root: pillar_nvmet::KERNEL_NVMET_ROOT.into(),
            }
        } else {
            TargetConfig::Double {
                root: dir.join("agent/configfs-double"),
            }
        },
        pools: vec![PoolConfig {
            name: "local".into(),
            kind: PoolKind::File {
                dir: dir.join("pool"),
            },
        }],
        settings: AgentSettings {
            nvme_address: "127.0.0.1"
                .parse()
                .unwrap_or(std::net::Ipv4Addr::LOCALHOST.into()),
            kernel_random_identity: false,
            unsafe_revoke_acl_only: false,
            hooks: Default::default(),
        },
        tls: None,
        // A unix socket in a directory only root reaches; no network listener at all.
        insecure_plaintext: true,
        metrics_listen: None,
        command_timeout: Duration::from_secs(60),
    }
}

/// Records the one PillarAgent (at `agent_socket`) and the `nvme-tcp` protocol, keeping what an
/// earlier run recorded where it is the same.
async fn seed_records(store: &dyn StateStore, agent_socket: &Path) -> Result<(), LocalError> {
    let agent_spec = PillarAgentSpec {
        node: "local".into(),
        address: format!("unix://{}", agent_socket.display()),
        tls: None,
        pools: vec![PoolRef {
            name: "local".into(),
            kind: "file".into(),
        }],
        nvme_address: "127.0.0.1".into(),
        topology: Default::default(),
    };
    match store.get_agent("local").await? {
        None => {
            store.create_agent("local", agent_spec).await?;
        }
        Some(existing) if existing.spec != agent_spec => {
            store
                .replace_agent_spec("local", &pillar_state::Revision::of(&existing)?, agent_spec)
                .await?;
        }
        Some(_) => {}
    }
    // An earlier run's record keeps what it says but authentication: before `auth: none`, runs
    // recorded the default, DH-HMAC-CHAP, which no kubelet here can carry a secret for.
    match store.get_protocol("nvme-tcp").await? {
        None => {
            store.create_protocol("nvme-tcp", local_protocol()).await?;
        }
        Some(existing) if existing.spec.nvme_tcp.auth != ProtocolAuth::None => {
            let mut spec = existing.spec.clone();
            spec.nvme_tcp.auth = ProtocolAuth::None;
            store
                .replace_protocol_spec("nvme-tcp", &pillar_state::Revision::of(&existing)?, spec)
                .await?;
        }
        Some(_) => {}
    }
    Ok(())
}

/// The single-machine mode's protocol: the ACL on (a revoke still keeps the host out),
/// authentication off (see the module's doc).
pub fn local_protocol() -> PillarProtocolSpec {
    PillarProtocolSpec {
        nvme_tcp: NvmeTcp {
            acl: true,
            auth: ProtocolAuth::None,
            ..NvmeTcp::default()
        },
    }
}

async fn wait_for_socket(path: &Path) {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(30) {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
