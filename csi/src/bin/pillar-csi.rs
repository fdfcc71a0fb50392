//! `pillar-csi`: the CSI controller or the CSI node plugin. Thin: parses flags and runs the
//! library. The single-machine mode is the `pillar-local` binary.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use pillar_csi::agents::{Agents, ControllerTls};
use pillar_csi::controller::{Controller, ControllerService};
use pillar_csi::identity::IdentityService;
use pillar_csi::node::{AttachMode, NodeConfig, NodeService};
use pillar_csi::serve::{serve, socket_path};
use pillar_host::HostPaths;
use pillar_state::store::StateStore;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "pillar CSI plugin: the controller or the node plugin"
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
        /// Allow plaintext connections (TCP or a unix socket) to agents whose PillarAgent has no
        /// TLS settings.
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
        /// A topology segment this node reports, `KEY=VALUE` (repeatable; e.g.
        /// `topology.pillar-csi.io/zone=a`, matching the PillarAgents' `spec.topology`).
        #[arg(long = "topology", value_parser = parse_segment)]
        topology: Vec<(String, String)>,
    },
}

fn parse_segment(raw: &str) -> Result<(String, String), String> {
    match raw.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{raw:?} is not KEY=VALUE")),
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
    pillar_csi::init_tracing();
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
                None => Arc::new(
                    pillar_state::KubeStore::new(
                        kube::Client::try_default()
                            .await
                            .context("connecting to Kubernetes")?,
                    )
                    // The pod's name (deploy/controller.yaml sets POD_NAME) names this replica
                    // in its Events.
                    .with_reporting_instance(
                        &std::env::var("POD_NAME")
                            .or_else(|_| std::env::var("HOSTNAME"))
                            .unwrap_or_default(),
                    ),
                ),
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
                pillar_csi::until_signal(),
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
            topology,
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
                reservations: true,
                topology: topology.into_iter().collect(),
            })
            .context("node plugin")?;
            serve(
                &socket_path(&endpoint),
                IdentityService,
                None,
                Some(node),
                pillar_csi::until_signal(),
            )
            .await
            .context("node plugin")
        }
    }
}
