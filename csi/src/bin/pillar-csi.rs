//! `pillar-csi`: the CSI controller, the CSI node plugin, or the single-machine mode. Thin:
//! parses flags and runs the library.

// The single-machine mode reports its sockets and the main job's steps on stdout.
#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use pillar_agent::server::EngineKind;
use pillar_csi::agents::{Agents, ControllerTls};
use pillar_csi::controller::{Controller, ControllerService};
use pillar_csi::identity::IdentityService;
use pillar_csi::local::{LocalConfig, start};
use pillar_csi::node::{AttachMode, NodeConfig, NodeService};
use pillar_csi::serve::{serve, socket_path};
use pillar_host::HostPaths;
use pillar_state::store::StateStore;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "pillar CSI plugin: controller, node plugin, or everything on one machine"
)]
struct Args {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Debug, Subcommand)]
enum Mode {
    /// The CSI controller (Identity + Controller services).
    Controller {
        /// CSI endpoint.
        #[arg(long, default_value = "unix:///csi/csi.sock")]
        endpoint: String,
        /// Keep records in a local directory instead of the Kubernetes API (no Kubernetes).
        #[arg(long)]
        embedded_store: Option<PathBuf>,
        /// The controller's client certificate towards agents (PEM).
        #[arg(long, requires = "agent_client_key")]
        agent_client_cert: Option<PathBuf>,
        /// Its private key (PEM).
        #[arg(long)]
        agent_client_key: Option<PathBuf>,
        /// Allow plaintext TCP to agents whose PillarAgent has no TLS settings.
        #[arg(long)]
        agent_insecure_plaintext: bool,
        /// How often agents are checked for a restart needing a resync, in seconds.
        #[arg(long, default_value_t = 5)]
        resync_interval_secs: u64,
    },
    /// The CSI node plugin (Identity + Node services).
    Node {
        #[arg(long, default_value = "unix:///csi/csi.sock")]
        endpoint: String,
        /// This node's Kubernetes name.
        #[arg(long, env = "NODE_NAME")]
        node_name: String,
        /// Stage records live here.
        #[arg(long, default_value = "/var/lib/pillar/node")]
        state_dir: PathBuf,
        /// The node's NVMe host NQN file.
        #[arg(long, default_value = "/etc/nvme/hostnqn")]
        hostnqn_file: PathBuf,
        /// The node's NVMe host ID file.
        #[arg(long, default_value = "/etc/nvme/hostid")]
        hostid_file: PathBuf,
    },
    /// Agent, controller and node plugin on this machine, without Kubernetes.
    Local {
        /// Working directory: sockets, state, pool files.
        #[arg(long, default_value = "/var/lib/pillar/local")]
        dir: PathBuf,
        #[arg(long, value_enum, default_value = "io_uring")]
        engine: EngineKind,
        /// Use the configfs test double even where the kernel has nvmet.
        #[arg(long)]
        test_double: bool,
        /// Run the main job once through the CSI sockets, then stop.
        #[arg(long)]
        demo: bool,
    },
}

async fn until_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = async { if let Some(t) = term.as_mut() { t.recv().await; } else { std::future::pending::<()>().await } } => {}
    }
}

fn read_trimmed(path: &PathBuf) -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(path)
        .with_context(|| format!("reading {}", path.display()))?
        .trim()
        .to_owned())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: logs collected by kubelet or CI stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match Args::parse().mode {
        Mode::Controller {
            endpoint,
            embedded_store,
            agent_client_cert,
            agent_client_key,
            agent_insecure_plaintext,
            resync_interval_secs,
        } => {
            let store: Arc<dyn StateStore> = match embedded_store {
                Some(dir) => Arc::new(
                    pillar_state::EmbeddedStore::open(dir)
                        .await
                        .context("opening the embedded store")?,
                ),
                None => Arc::new(pillar_state::KubeStore::new(
                    kube::Client::try_default()
                        .await
                        .context("connecting to Kubernetes")?,
                )),
            };
            let tls = agent_client_cert
                .zip(agent_client_key)
                .map(|(cert, key)| ControllerTls { cert, key });
            let controller = Controller::new(
                store,
                Agents::new(tls, agent_insecure_plaintext, Duration::from_secs(30)),
            );
            controller.spawn_resync_loop(Duration::from_secs(resync_interval_secs));
            serve::<NodeService>(
                &socket_path(&endpoint),
                IdentityService,
                Some(ControllerService::new(controller)),
                None,
                until_signal(),
            )
            .await
            .context("controller")
        }
        Mode::Node {
            endpoint,
            node_name,
            state_dir,
            hostnqn_file,
            hostid_file,
        } => {
            let host_nqn = read_trimmed(&hostnqn_file)?.parse().context("host NQN")?;
            let host_id = read_trimmed(&hostid_file)?.parse().context("host ID")?;
            let node = NodeService::new(NodeConfig {
                node_name,
                host_nqn,
                host_id,
                state_dir,
                paths: HostPaths::system(),
                attach: AttachMode::NvmeTcp,
                connect_timeout: Duration::from_secs(30),
            })
            .context("node plugin")?;
            serve(
                &socket_path(&endpoint),
                IdentityService,
                None,
                Some(node),
                until_signal(),
            )
            .await
            .context("node plugin")
        }
        Mode::Local {
            dir,
            engine,
            test_double,
            demo,
        } => {
            let (stop, stopped) = tokio::sync::watch::channel(false);
            let sockets = start(
                LocalConfig {
                    dir: dir.clone(),
                    engine,
                    force_double: test_double,
                },
                stopped,
            )
            .await
            .context("single-machine mode")?;
            let engine_name = match engine {
                EngineKind::Uring => "io_uring",
                EngineKind::Sync => "sync",
            };
            println!("pillar single-machine mode (agent engine: {engine_name})");
            if sockets.target == "kernel" {
                println!(
                    "  target:     Linux kernel nvmet (configfs); node attaches over NVMe/TCP on 127.0.0.1"
                );
            } else {
                println!(
                    "  target:     configfs TEST DOUBLE - this kernel has no nvmet/NVMe-TCP host (or --test-double);"
                );
                println!(
                    "              no NVMe/TCP connection is made: the node plugin uses the local loop device"
                );
            }
            println!("  agent:      unix://{}", sockets.agent.display());
            println!("  controller: unix://{}", sockets.controller.display());
            println!("  node:       unix://{}", sockets.node.display());
            if demo {
                println!(
                    "main job: one volume through the CSI calls kubelet and the sidecars make"
                );
                let work = dir.join("demo");
                let result = pillar_csi::demo::run(
                    &sockets.controller,
                    &sockets.node,
                    &work,
                    "demo-volume",
                    64 << 20,
                )
                .await;
                let _ = stop.send(true);
                result.context("main job")?;
                println!(
                    "main job: OK (data written through the filesystem and read back with a matching SHA-256)"
                );
                return Ok(());
            }
            until_signal().await;
            let _ = stop.send(true);
            Ok(())
        }
    }
}
