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
    Controller(ControllerArgs),
    /// The CSI node plugin (Identity + Node services).
    Node(NodeArgs),
    /// Rotates a node's DH-HMAC-CHAP pair and has every storage node where it holds a
    /// publication take the new one (W10), then exits; takes the controller's flags (store,
    /// agent TLS), so run it where the controller runs.
    RotateNodeCredentials(RotateArgs),
    /// Asks the controller's credentials endpoint for this node's DH-HMAC-CHAP pair as a stage
    /// would (the node plugin's token, CA and endpoint flags), says whether it was delivered
    /// (never the secrets), then exits: run it in the node plugin's pod to check the delivery.
    CheckNodeCredentials(CheckArgs),
}

/// The flags of `check-node-credentials`.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// This node's Kubernetes name.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// The node's NVMe host NQN file.
    #[arg(long, default_value = "/etc/nvme/hostnqn")]
    pub hostnqn_file: PathBuf,
    /// The endpoint, token and CA, as the node plugin takes them.
    #[command(flatten)]
    pub credentials: crate::credentials_delivery::client::ClientArgs,
}

/// The flags of `rotate-node-credentials`.
#[derive(Debug, clap::Args)]
pub struct RotateArgs {
    /// The node whose pair is replaced (its CSI node name, the Kubernetes node name).
    #[arg(long)]
    pub node: String,
    /// The controller's flags.
    #[command(flatten)]
    pub controller: ControllerArgs,
}

/// The controller's flags.
#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    /// CSI endpoint.
    #[arg(long, default_value = "unix:///csi/csi.sock")]
    pub endpoint: String,
    /// Keep records in a local directory instead of the Kubernetes API (no Kubernetes).
    #[arg(long)]
    pub embedded_store: Option<PathBuf>,
    /// The controller's client certificate towards agents (PEM).
    #[arg(long, requires = "agent_client_key")]
    pub agent_client_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long)]
    pub agent_client_key: Option<PathBuf>,
    /// Allow plaintext connections (TCP or a unix socket) to agents whose PillarAgent has no
    /// TLS settings.
    #[arg(long)]
    pub agent_insecure_plaintext: bool,
    /// How often agents are checked for a restart needing a resync, in seconds.
    #[arg(long, default_value_t = 5)]
    pub resync_interval_secs: u64,
    /// Run the background loops (the resync loop) only on the holder of a
    /// coordination.k8s.io Lease, so of several replicas one does them. Kubernetes store
    /// only; the embedded store is one process and always runs them.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_election: bool,
    /// Namespace of the Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "pillar-system")]
    pub leader_election_namespace: String,
    /// Namespace of the Secrets holding nodes' DH-HMAC-CHAP credentials (one per node, made
    /// and rotated by the controller; only its ServiceAccount may read them: W10).
    #[arg(long, env = "POD_NAMESPACE", default_value = "pillar-system")]
    pub credentials_namespace: String,
    /// Name of the Lease.
    #[arg(long, default_value = "pillar-controller")]
    pub leader_election_lease: String,
    /// Seconds a standby waits after the Lease last changed before taking over.
    #[arg(long, default_value_t = 15)]
    pub leader_election_lease_duration_secs: u64,
    /// Seconds the holder keeps acting after its last successful renewal started.
    #[arg(long, default_value_t = 10)]
    pub leader_election_renew_deadline_secs: u64,
    /// Seconds between renewals (and a standby's retries).
    #[arg(long, default_value_t = 2)]
    pub leader_election_retry_period_secs: u64,
    /// Serve Prometheus metrics on this address (path /metrics).
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Bounds of the CSI gRPC server.
    #[command(flatten)]
    pub grpc: pillar_grpc_unix::Limits,
    /// The credentials endpoint (a node's DH-HMAC-CHAP pair to that node).
    #[command(flatten)]
    pub credentials: crate::credentials_delivery::server::EndpointArgs,
}

/// The node plugin's flags.
#[derive(Debug, clap::Args)]
pub struct NodeArgs {
    #[arg(long, default_value = "unix:///csi/csi.sock")]
    pub endpoint: String,
    /// This node's Kubernetes name.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Stage records live here.
    #[arg(long, default_value = "/var/lib/pillar/node")]
    pub state_dir: PathBuf,
    /// The node's NVMe host NQN file.
    #[arg(long, default_value = "/etc/nvme/hostnqn")]
    pub hostnqn_file: PathBuf,
    /// The node's NVMe host ID file.
    #[arg(long, default_value = "/etc/nvme/hostid")]
    pub hostid_file: PathBuf,
    /// A topology segment this node reports, `KEY=VALUE` (repeatable; e.g.
    /// `topology.pillar-csi.io/zone=a`, matching the PillarAgents' `spec.topology`).
    #[arg(long = "topology", value_parser = parse_segment)]
    pub topology: Vec<(String, String)>,
    /// TEST ONLY: stage the agent's local block device named in the publish context
    /// instead of connecting over NVMe/TCP, with no identity check and no reservation. Only
    /// for an agent on the configfs test double on this same machine (the end-to-end suite
    /// where no NVMe/TCP exists); every stage says so in the log. Never in a deployment.
    #[arg(long, hide = true)]
    pub test_local_device_attach: bool,
    /// Bounds of the CSI gRPC server.
    #[command(flatten)]
    pub grpc: pillar_grpc_unix::Limits,
    /// The controller's credentials endpoint, for stages that need this node's pair.
    #[command(flatten)]
    pub credentials: crate::credentials_delivery::client::ClientArgs,
}

pub fn parse_segment(raw: &str) -> Result<(String, String), String> {
    match raw.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{raw:?} is not KEY=VALUE")),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::{Args, Mode};

    // proves W10 (rotation from the command line): the subcommand takes the node and the
    // controller's own flags.
    #[test]
    fn rotate_node_credentials_takes_the_node_and_the_controllers_flags() {
        let args = Args::try_parse_from([
            "pillar-csi",
            "rotate-node-credentials",
            "--node",
            "worker-1",
            "--credentials-namespace",
            "pillar",
            "--agent-insecure-plaintext",
        ])
        .unwrap();
        let Mode::RotateNodeCredentials(r) = args.mode else {
            panic!("parsed as {:?}", args.mode);
        };
        assert_eq!(r.node, "worker-1");
        assert_eq!(r.controller.credentials_namespace, "pillar");
        assert!(r.controller.agent_insecure_plaintext);
        assert!(Args::try_parse_from(["pillar-csi", "rotate-node-credentials"]).is_err());
    }
}
