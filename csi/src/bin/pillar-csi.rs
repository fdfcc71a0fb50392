//! `pillar-csi`: the CSI controller or the CSI node plugin. Thin: parses flags, opens the store
//! and the Lease the flags name, and hands them to the composition root (`pillar_csi::root`).
//! The single-machine mode is the `pillar-local` binary.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use pillar_csi::agents::ControllerTls;
use pillar_csi::cli::{Args, CheckArgs, ControllerArgs, Mode, NodeArgs, RotateArgs};
use pillar_csi::node::{AttachMode, NodeConfig};
use pillar_csi::root::{AgentReach, ControllerBuilder, Leader, WiredNode};
use pillar_csi::serve::socket_path;
use pillar_host::HostPaths;
use pillar_state::lease::{Elector, LeaseSettings};
use pillar_state::store::StateStore;

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
        Mode::Controller(args) => controller(args).await,
        Mode::Node(args) => node(args).await,
        Mode::RotateNodeCredentials(args) => rotate(args).await,
        Mode::CheckNodeCredentials(args) => check(args).await,
    }
}

/// One request for this node's pair, as a stage makes it; the secrets are never shown.
async fn check(args: CheckArgs) -> anyhow::Result<()> {
    let client = args
        .credentials
        .client()
        .context("--credentials-endpoint (or PILLAR_CREDENTIALS_ENDPOINT) is required")?;
    let host_nqn = read_trimmed(&args.hostnqn_file)?
        .parse()
        .context("host NQN")?;
    let volume = pillar_nvmet::VolumeId::parse("check-node-credentials").context("volume ID")?;
    match client.fetch(&args.node_name, &host_nqn, &volume).await {
        Ok(_) => {
            tracing::info!(node = %args.node_name, %host_nqn, endpoint = %client.endpoint, "delivered: the controller answered this node's DH-HMAC-CHAP pair");
            Ok(())
        }
        Err(e) => Err(anyhow::anyhow!(
            "not delivered ({:?} at a stage): {}",
            e.code(),
            pillar_csi::error_chain(&e)
        )),
    }
}

/// One rotation of a node's pair with the controller's store and agent reach; fails when a
/// storage node kept the old pair (it takes the new one at its next resync).
async fn rotate(args: RotateArgs) -> anyhow::Result<()> {
    let (store, _, _) = store_and_leader(&args.controller).await?;
    let c = args.controller;
    let tls = c
        .agent_client_cert
        .zip(c.agent_client_key)
        .map(|(cert, key)| ControllerTls { cert, key });
    let wired = ControllerBuilder::new(store, AgentReach::network(tls, c.agent_insecure_plaintext))
        .build()
        .await?;
    let rotation = wired
        .controller()
        .rotate_node_credentials(&args.node)
        .await
        .with_context(|| format!("rotating the DH-HMAC-CHAP pair of node {}", args.node))?;
    tracing::info!(node = %args.node, agents = ?rotation.agents, "rotated: these storage nodes hold the new pair");
    if !rotation.failed.is_empty() {
        anyhow::bail!(
            "rotated in the store, but these storage nodes keep the old pair until their next resync: {:?}",
            rotation.failed
        );
    }
    Ok(())
}

async fn controller(args: ControllerArgs) -> anyhow::Result<()> {
    let (store, leader, client) = store_and_leader(&args).await?;
    let credentials = credentials_endpoint(&args, &store, client).await?;
    let tls = args
        .agent_client_cert
        .zip(args.agent_client_key)
        .map(|(cert, key)| ControllerTls { cert, key });
    ControllerBuilder::new(
        store,
        AgentReach::network(tls, args.agent_insecure_plaintext),
    )
    .resync_every(Duration::from_secs(args.resync_interval_secs), leader)
    .metrics_at(args.metrics_listen)
    .credentials_endpoint(credentials)
    .build()
    .await?
    .serve(
        &socket_path(&args.endpoint),
        args.grpc,
        pillar_csi::until_signal(),
    )
    .await
    .context("controller")
}

/// The credentials endpoint the flags ask for, bound (Kubernetes store only: the node's token
/// is reviewed by the API server).
async fn credentials_endpoint(
    args: &ControllerArgs,
    store: &Arc<dyn StateStore>,
    client: Option<kube::Client>,
) -> anyhow::Result<Option<pillar_csi::credentials_delivery::server::Bound>> {
    if args.credentials.credentials_listen.is_none() {
        return Ok(None);
    }
    let Some(client) = client else {
        anyhow::bail!(
            "--credentials-listen needs the Kubernetes store (the API server reviews the nodes' \
             tokens); with the embedded store NodeStageVolume carries the node's secrets"
        );
    };
    let delivery = pillar_csi::credentials_delivery::Delivery::new(
        Arc::clone(store),
        client,
        &args.credentials_namespace,
    );
    match args.credentials.endpoint(delivery)? {
        Some(endpoint) => Ok(Some(endpoint.bind().await?)),
        None => Ok(None),
    }
}

/// The store the flags name, who runs the background loops (the embedded store is one
/// process; with Kubernetes, the holder of the Lease, or every replica without election), and
/// the Kubernetes client where there is one.
async fn store_and_leader(
    args: &ControllerArgs,
) -> anyhow::Result<(Arc<dyn StateStore>, Leader, Option<kube::Client>)> {
    // The pod's name (deploy/base/controller.yaml sets POD_NAME) names this replica in its
    // Events and as the Lease holder. Without one the controller refuses to start with the
    // Kubernetes store (an empty holder would be every nameless replica's own Lease, and an
    // Event needs a reporting instance); a generated name would change with every restart and
    // name no pod an operator can find.
    let instance = ["POD_NAME", "HOSTNAME"]
        .into_iter()
        .find_map(|var| std::env::var(var).ok().filter(|v| !v.trim().is_empty()))
        .unwrap_or_default();
    if let Some(dir) = &args.embedded_store {
        let store = pillar_state::EmbeddedStore::open(dir)
            .await
            .context("opening the embedded store")?;
        return Ok((Arc::new(store), Leader::Sole, None));
    }
    if instance.is_empty() {
        anyhow::bail!(
            "neither POD_NAME nor HOSTNAME names this controller replica; set POD_NAME to the \
             pod's name (deploy/base/controller.yaml does, from metadata.name)"
        );
    }
    let client = kube::Client::try_default()
        .await
        .context("connecting to Kubernetes")?;
    let leader = if args.leader_election {
        let settings = LeaseSettings {
            lease_duration: Duration::from_secs(args.leader_election_lease_duration_secs),
            renew_deadline: Duration::from_secs(args.leader_election_renew_deadline_secs),
            retry_period: Duration::from_secs(args.leader_election_retry_period_secs),
            ..LeaseSettings::new(
                &args.leader_election_namespace,
                &args.leader_election_lease,
                &instance,
            )
        };
        Leader::elected(Elector::new(client.clone(), settings).context("leader election")?)
    } else {
        Leader::Sole
    };
    let store = pillar_state::KubeStore::new(client.clone())
        .with_reporting_instance(&instance)
        .with_credentials_namespace(&args.credentials_namespace);
    Ok((Arc::new(store), leader, Some(client)))
}

async fn node(args: NodeArgs) -> anyhow::Result<()> {
    let (attach, reservations) = if args.test_local_device_attach {
        tracing::warn!(
            "TEST ONLY: --test-local-device-attach: volumes are the agent's local devices, not NVMe/TCP; no identity check, no reservation"
        );
        (AttachMode::LocalDevice, false)
    } else {
        (AttachMode::NvmeTcp, true)
    };
    let host_nqn = read_trimmed(&args.hostnqn_file)?
        .parse()
        .context("host NQN")?;
    let host_id = read_trimmed(&args.hostid_file)?
        .parse()
        .context("host ID")?;
    WiredNode::new(NodeConfig {
        node_name: args.node_name,
        host_nqn,
        host_id,
        state_dir: args.state_dir,
        paths: HostPaths::system(),
        attach,
        connect_timeout: Duration::from_secs(30),
        reservations,
        topology: args.topology.into_iter().collect(),
    })
    .context("node plugin")?
    .credentials_delivery(args.credentials.client())
    .serve(
        &socket_path(&args.endpoint),
        args.grpc,
        pillar_csi::until_signal(),
    )
    .await
    .context("node plugin")
}
