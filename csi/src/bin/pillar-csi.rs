//! `pillar-csi`: the CSI controller or the CSI node plugin. Thin: parses flags and runs the
//! library. The single-machine mode is the `pillar-local` binary.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use pillar_csi::agents::{Agents, ControllerTls};
use pillar_csi::cli::{Args, Mode};
use pillar_csi::controller::metrics::serve_metrics;
use pillar_csi::controller::{Controller, ControllerService};
use pillar_csi::identity::IdentityService;
use pillar_csi::node::{AttachMode, NodeConfig, NodeService};
use pillar_csi::serve::{serve_with_limits, socket_path};
use pillar_host::HostPaths;
use pillar_state::lease::{Elector, Leadership, LeaseSettings};
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
        Mode::Controller {
            endpoint,
            embedded_store,
            agent_client_cert,
            agent_client_key,
            agent_insecure_plaintext,
            resync_interval_secs,
            leader_election,
            leader_election_namespace,
            leader_election_lease,
            leader_election_lease_duration_secs,
            leader_election_renew_deadline_secs,
            leader_election_retry_period_secs,
            metrics_listen,
            grpc,
        } => {
            // The pod's name (deploy/base/controller.yaml sets POD_NAME) names this replica in its
            // Events and as the Lease holder. Without one the controller refuses to start with
            // the Kubernetes store (an empty holder would be every nameless replica's own Lease,
            // and an Event needs a reporting instance); a generated name would change with every
            // restart and name no pod an operator can find.
            let instance = ["POD_NAME", "HOSTNAME"]
                .into_iter()
                .find_map(|var| std::env::var(var).ok().filter(|v| !v.trim().is_empty()))
                .unwrap_or_default();
            if instance.is_empty() && embedded_store.is_none() {
                anyhow::bail!(
                    "neither POD_NAME nor HOSTNAME names this controller replica; set POD_NAME \
                     to the pod's name (deploy/base/controller.yaml does, from metadata.name)"
                );
            }
            let (store, elector): (Arc<dyn StateStore>, _) = match embedded_store {
                Some(dir) => (
                    Arc::new(
                        pillar_state::EmbeddedStore::open(dir)
                            .await
                            .context("opening the embedded store")?,
                    ),
                    None,
                ),
                None => {
                    let client = kube::Client::try_default()
                        .await
                        .context("connecting to Kubernetes")?;
                    let elector = if leader_election {
                        let settings = LeaseSettings {
                            lease_duration: Duration::from_secs(
                                leader_election_lease_duration_secs,
                            ),
                            renew_deadline: Duration::from_secs(
                                leader_election_renew_deadline_secs,
                            ),
                            retry_period: Duration::from_secs(leader_election_retry_period_secs),
                            ..LeaseSettings::new(
                                &leader_election_namespace,
                                &leader_election_lease,
                                &instance,
                            )
                        };
                        Some(Elector::new(client.clone(), settings).context("leader election")?)
                    } else {
                        None
                    };
                    (
                        Arc::new(
                            pillar_state::KubeStore::new(client).with_reporting_instance(&instance),
                        ),
                        elector,
                    )
                }
            };
            let tls = agent_client_cert
                .zip(agent_client_key)
                .map(|(cert, key)| ControllerTls { cert, key });
            let controller = Controller::new(
                store,
                Agents::new(tls, agent_insecure_plaintext, Duration::from_secs(30)),
            );
            let (leadership, elector) = match elector {
                Some((elector, leadership)) => {
                    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                    let task = tokio::spawn(elector.run(async {
                        let _ = stopped.await;
                    }));
                    (leadership, Some((stop, task)))
                }
                None => (Leadership::sole(), None),
            };
            controller.spawn_resync_loop(Duration::from_secs(resync_interval_secs), leadership);
            if let Some(addr) = metrics_listen {
                let bound =
                    serve_metrics(addr, controller.metrics(), std::future::pending()).await?;
                tracing::info!(%bound, "serving metrics at /metrics");
            }
            let served = serve_with_limits::<NodeService>(
                &socket_path(&endpoint),
                IdentityService,
                Some(ControllerService::new(controller)),
                None,
                grpc,
                pillar_csi::until_signal(),
            )
            .await
            .context("controller");
            // Shutting down: release the Lease so a standby takes over at once.
            if let Some((stop, task)) = elector {
                let _ = stop.send(());
                let _ = task.await;
            }
            served
        }
        Mode::Node {
            endpoint,
            node_name,
            state_dir,
            hostnqn_file,
            hostid_file,
            topology,
            test_local_device_attach,
            grpc,
        } => {
            let (attach, reservations) = if test_local_device_attach {
                tracing::warn!(
                    "TEST ONLY: --test-local-device-attach: volumes are the agent's local devices, not NVMe/TCP; no identity check, no reservation"
                );
                (AttachMode::LocalDevice, false)
            } else {
                (AttachMode::NvmeTcp, true)
            };
            let host_nqn = read_trimmed(&hostnqn_file)?.parse().context("host NQN")?;
            let host_id = read_trimmed(&hostid_file)?.parse().context("host ID")?;
            let node = NodeService::new(NodeConfig {
                node_name,
                host_nqn,
                host_id,
                state_dir,
                paths: HostPaths::system(),
                attach,
                connect_timeout: Duration::from_secs(30),
                reservations,
                topology: topology.into_iter().collect(),
            })
            .context("node plugin")?;
            serve_with_limits(
                &socket_path(&endpoint),
                IdentityService,
                None,
                Some(node),
                grpc,
                pillar_csi::until_signal(),
            )
            .await
            .context("node plugin")
        }
    }
}
