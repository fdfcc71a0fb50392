//! `pillar-csi`'s command line, in the library so that a test parses the deploy manifests'
//! `args` with the parser the binary uses (a renamed flag fails that test).

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "pillar CSI plugin: the controller or the node plugin"
)]
pub struct Args {
    #[command(subcommand)]
    pub mode: Mode,
}

#[derive(Debug, Subcommand)]
pub enum Mode {
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
        /// Run the background loops (the resync loop) only on the holder of a
        /// coordination.k8s.io Lease, so of several replicas one does them. Kubernetes store
        /// only; the embedded store is one process and always runs them.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        leader_election: bool,
        /// Namespace of the Lease.
        #[arg(long, env = "POD_NAMESPACE", default_value = "pillar-system")]
        leader_election_namespace: String,
        /// Name of the Lease.
        #[arg(long, default_value = "pillar-controller")]
        leader_election_lease: String,
        /// Seconds a standby waits after the Lease last changed before taking over.
        #[arg(long, default_value_t = 15)]
        leader_election_lease_duration_secs: u64,
        /// Seconds the holder keeps acting after its last successful renewal started.
        #[arg(long, default_value_t = 10)]
        leader_election_renew_deadline_secs: u64,
        /// Seconds between renewals (and a standby's retries).
        #[arg(long, default_value_t = 2)]
        leader_election_retry_period_secs: u64,
        /// Serve Prometheus metrics on this address (path /metrics).
        #[arg(long)]
        metrics_listen: Option<std::net::SocketAddr>,
        /// Bounds of the CSI gRPC server.
        #[command(flatten)]
        grpc: pillar_grpc_unix::Limits,
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
        /// TEST ONLY: stage the agent's local block device named in the publish context
        /// instead of connecting over NVMe/TCP, with no identity check and no reservation. Only
        /// for an agent on the configfs test double on this same machine (the end-to-end suite
        /// where no NVMe/TCP exists); every stage says so in the log. Never in a deployment.
        #[arg(long, hide = true)]
        test_local_device_attach: bool,
        /// Bounds of the CSI gRPC server.
        #[command(flatten)]
        grpc: pillar_grpc_unix::Limits,
    },
}

pub fn parse_segment(raw: &str) -> Result<(String, String), String> {
    match raw.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{raw:?} is not KEY=VALUE")),
    }
}
