//! One seed: the world (store, two controller replicas, agents), the random operations and
//! faults, the invariant checks, the final drain.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use pillar_agent::blocking::Deferral;
use pillar_csi::controller::{Controller, code_of, volume_id_for_name};
use pillar_csi::csi;
use pillar_csi::root::{AgentReach, ControllerBuilder};
use pillar_state::StateStore;
use pillar_state::crd::{NvmeTcp, PillarAgentSpec, PillarProtocolSpec, PillarVolumeState, PoolRef};

use crate::chaos::{Chaos, Fault, FaultCounts, Knobs};
use crate::invariants::{Checker, Violation};
use crate::node::{POOL, SimAgent};
use crate::store::{replica_store, shared_store};
use crate::transport::{Link, dialer};

/// The shape of every seed's run.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Operations started per seed.
    pub steps: usize,
    /// Volume names in play (re-created under the same name after deletes).
    pub volumes: usize,
    /// Kubernetes nodes; each has two host NQNs it may present.
    pub nodes: u32,
    /// Storage nodes (agents).
    pub agents: usize,
    /// Fault rates.
    pub knobs: Knobs,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            steps: 40,
            volumes: 2,
            nodes: 3,
            agents: 2,
            knobs: Knobs::default(),
        }
    }
}

/// Why a seed could not be run at all (not a finding).
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("cannot build the runtime or the world's directories")]
    Io(#[from] std::io::Error),
    #[error("the store refused the world's setup")]
    Store(#[from] pillar_state::StoreError),
    #[error("an agent failed to start")]
    Agent(#[from] pillar_agent::ServerError),
    #[error("a controller replica failed to start")]
    Controller(#[from] pillar_csi::controller::metrics::MetricsError),
}

/// What one seed did.
#[derive(Debug)]
pub struct SeedOutcome {
    pub seed: u64,
    pub violation: Option<Violation>,
    pub counts: FaultCounts,
    pub trace: Vec<String>,
    /// Operations that completed OK.
    pub ok: usize,
}

const PROTOCOL: &str = "nvme-tcp";

fn host(node: u32, variant: u32) -> String {
    format!(
        "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-{:012}",
        node * 10 + variant
    )
}

fn capability() -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter.into(),
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
    }
}

/// The temp directory root: tmpfs when there is one (fsync of marks is free there).
fn temp_root() -> std::io::Result<tempfile::TempDir> {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir()
        && let Ok(dir) = tempfile::Builder::new()
            .prefix("pillar-sim")
            .tempdir_in(shm)
    {
        return Ok(dir);
    }
    tempfile::Builder::new().prefix("pillar-sim").tempdir()
}

type Op = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// Runs seed `seed` to its end or its first violation.
pub fn run_seed(seed: u64, config: &Config) -> Result<SeedOutcome, SimError> {
    let chaos = Chaos::new(seed, config.knobs);
    let deferral = {
        let chaos = chaos.clone();
        move || {
            let k = chaos.knobs;
            let mut d = Deferral::default();
            if chaos.strikes(Fault::WorkDeferred, k.defer_work, "blocking work deferred") {
                d.yields = u32::try_from(1 + chaos.below(16)).unwrap_or(1);
            }
            if chaos.strikes(Fault::WorkSlow, k.slow_work, "blocking work slow") {
                d.delay = chaos.pause(300);
            }
            d
        }
    };
    let _claim = pillar_agent::blocking::claim_thread(deferral);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    let dir = temp_root()?;
    let result = runtime.block_on(async { world(seed, config, &chaos, dir.path()).await });
    // Background tasks (channels, servers) die with the runtime.
    runtime.shutdown_background();
    let (violation, ok) = result?;
    Ok(SeedOutcome {
        seed,
        violation,
        counts: chaos.counts(),
        trace: chaos.trace_lines(),
        ok,
    })
}

async fn world(
    seed: u64,
    config: &Config,
    chaos: &Chaos,
    dir: &std::path::Path,
) -> Result<(Option<Violation>, usize), SimError> {
    let store = shared_store(chaos);
    store
        .create_protocol(
            PROTOCOL,
            PillarProtocolSpec {
                nvme_tcp: NvmeTcp {
                    acl: true,
                    ..NvmeTcp::default()
                },
            },
        )
        .await?;
    let mut agents = Vec::new();
    let mut links: BTreeMap<String, Arc<Link>> = BTreeMap::new();
    for i in 0..config.agents {
        let name = format!("storage-{i}");
        store
            .create_agent(
                &name,
                PillarAgentSpec {
                    node: name.clone(),
                    address: format!("sim://{name}"),
                    tls: None,
                    pools: vec![PoolRef {
                        name: POOL.into(),
                        kind: "plain-file".into(),
                    }],
                    nvme_address: "127.0.0.1".into(),
                    topology: Default::default(),
                },
            )
            .await?;
        let mut agent = SimAgent::new(&name, &dir.join(&name), chaos.clone())?;
        agent.start().await?;
        links.insert(name, Arc::clone(&agent.link));
        agents.push(agent);
    }
    let dial = dialer(Arc::new(links));
    let mut replicas: Vec<Arc<Controller>> = Vec::new();
    for r in 0..2 {
        let store = replica_store(Arc::clone(&store) as Arc<dyn StateStore>, chaos.clone(), r);
        let wired = ControllerBuilder::new(store, AgentReach::Dialer(Arc::clone(&dial)))
            .build()
            .await?;
        replicas.push(wired.controller());
    }
    chaos.trace(format!("seed {seed}: {config:?}"));
    replicas[0].resync_waiting_agents().await;

    let ok = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut checker = Checker::default();
    let mut tasks = Vec::new();
    let mut violation = None;
    for step in 0..config.steps {
        let r = usize::try_from(chaos.below(2)).unwrap_or(0);
        let replica = Arc::clone(&replicas[r]);
        // One name in four is a restore's ("vol-r<k>"): restores, and what happens to them.
        let name = if chaos.below(4) == 0 {
            format!("vol-r{}", chaos.below(config.volumes as u64))
        } else {
            format!("vol-{}", chaos.below(config.volumes as u64))
        };
        let id = volume_id_for_name(&name)
            .map(|v| v.to_string())
            .unwrap_or_default();
        let node = 1 + u32::try_from(chaos.below(u64::from(config.nodes))).unwrap_or(0);
        let variant = u32::try_from(chaos.below(2)).unwrap_or(0);
        let node_id = format!("node-{node}/{}", host(node, variant));
        let roll = chaos.below(100);
        let snapshot = format!("snap-{}", chaos.below(config.volumes as u64));
        let (label, op): (String, Op) = match roll {
            0..14 => {
                let mut parameters = HashMap::new();
                let agent = chaos.below(config.agents as u64);
                // A restore's name: a volume restored from a snapshot (on the snapshot's agent).
                let restore = name.starts_with("vol-r");
                if !restore {
                    parameters.insert(
                        pillar_csi::controller::params::AGENT.to_owned(),
                        format!("storage-{agent}"),
                    );
                }
                let req = csi::CreateVolumeRequest {
                    name: name.clone(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: 16 << 20,
                        limit_bytes: 0,
                    }),
                    volume_capabilities: vec![capability()],
                    parameters,
                    volume_content_source: restore.then(|| csi::VolumeContentSource {
                        r#type: Some(csi::volume_content_source::Type::Snapshot(
                            csi::volume_content_source::SnapshotSource {
                                snapshot_id: snapshot.clone(),
                            },
                        )),
                    }),
                    ..Default::default()
                };
                let label = if restore {
                    format!("CreateVolume {name} from {snapshot}")
                } else {
                    format!("CreateVolume {name} on storage-{agent}")
                };
                (
                    label,
                    Box::pin(async move {
                        replica
                            .create_volume(req)
                            .await
                            .map(drop)
                            .map_err(|e| format!("{:?}: {e}", code_of(&e)))
                    }),
                )
            }
            14..22 => {
                let req = csi::CreateSnapshotRequest {
                    name: snapshot.clone(),
                    source_volume_id: id.clone(),
                    ..Default::default()
                };
                (
                    format!("CreateSnapshot {snapshot} of {name}"),
                    Box::pin(async move {
                        replica
                            .create_snapshot(req)
                            .await
                            .map(drop)
                            .map_err(|e| format!("{:?}: {e}", code_of(&e)))
                    }),
                )
            }
            22..52 => {
                let req = csi::ControllerPublishVolumeRequest {
                    volume_id: id.clone(),
                    node_id: node_id.clone(),
                    volume_capability: Some(capability()),
                    readonly: false,
                    ..Default::default()
                };
                (
                    format!("Publish {name} to {node_id}"),
                    Box::pin(async move {
                        replica
                            .publish(req)
                            .await
                            .map(drop)
                            .map_err(|e| format!("{:?}: {e}", code_of(&e)))
                    }),
                )
            }
            52..80 => {
                // Now and then "from every node" (an empty node ID).
                let node_id = if chaos.below(5) == 0 {
                    String::new()
                } else {
                    node_id.clone()
                };
                let req = csi::ControllerUnpublishVolumeRequest {
                    volume_id: id.clone(),
                    node_id: node_id.clone(),
                    ..Default::default()
                };
                (
                    format!("Unpublish {name} from {node_id:?}"),
                    Box::pin(async move {
                        replica
                            .unpublish(req)
                            .await
                            .map(drop)
                            .map_err(|e| format!("{:?}: {e}", code_of(&e)))
                    }),
                )
            }
            80..91 => {
                let req = csi::DeleteVolumeRequest {
                    volume_id: id.clone(),
                    ..Default::default()
                };
                (
                    format!("DeleteVolume {name}"),
                    Box::pin(async move {
                        replica
                            .delete_volume(req)
                            .await
                            .map(drop)
                            .map_err(|e| format!("{:?}: {e}", code_of(&e)))
                    }),
                )
            }
            91..93 => {
                let req = csi::DeleteSnapshotRequest {
                    snapshot_id: snapshot.clone(),
                    ..Default::default()
                };
                (
                    format!("DeleteSnapshot {snapshot}"),
                    Box::pin(async move {
                        replica
                            .delete_snapshot(req)
                            .await
                            .map(drop)
                            .map_err(|e| format!("{:?}: {e}", code_of(&e)))
                    }),
                )
            }
            93..97 => (
                "resync waiting agents".to_owned(),
                Box::pin(async move {
                    replica.resync_waiting_agents().await;
                    Ok(())
                }),
            ),
            _ => {
                let which = usize::try_from(chaos.below(config.agents as u64)).unwrap_or(0);
                if chaos.strikes(Fault::AgentCrash, chaos.knobs.crash * 10, "agent crash") {
                    // Counted only with a crash: a loss without one is no loss.
                    let lose = chaos.strikes(
                        Fault::AgentStateLost,
                        chaos.knobs.state_loss,
                        "the state directory is lost",
                    );
                    let agent = &mut agents[which];
                    chaos.trace(format!(
                        "step {step}: crash {} (incarnation {}, state lost: {lose})",
                        agent.name, agent.incarnation
                    ));
                    agent.crash(lose).await;
                    tokio::time::sleep(chaos.pause(100)).await;
                    agent.start().await?;
                }
                if let Some(v) = checker.check(&agents, &store.records::<PillarVolumeState>()?) {
                    violation = Some(v);
                    break;
                }
                continue;
            }
        };
        let cancel_after = if chaos.enabled() && chaos.below(1000) < chaos.knobs.cancel {
            Some(chaos.pause(250))
        } else {
            None
        };
        chaos.trace(format!(
            "step {step}: replica {r}: {label} (deadline {cancel_after:?})"
        ));
        let (c, ok) = (chaos.clone(), Arc::clone(&ok));
        tasks.push(tokio::spawn(async move {
            let limit = cancel_after.unwrap_or(Duration::from_secs(600));
            let line = match tokio::time::timeout(limit, op).await {
                Ok(Ok(())) => {
                    ok.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    "ok".to_owned()
                }
                Ok(Err(e)) => e,
                Err(_) => {
                    c.count(
                        Fault::Cancelled,
                        &format!("step {step} dropped at an await point"),
                    );
                    "cancelled".to_owned()
                }
            };
            c.trace(format!("  step {step} ({label}) -> {line}"));
        }));
        tokio::time::sleep(chaos.pause(40)).await;
        if let Some(v) = checker.check(&agents, &store.records::<PillarVolumeState>()?) {
            violation = Some(v);
            break;
        }
    }
    if violation.is_none() {
        // Drain: no new faults; everything in flight lands or times out, agents are resynced.
        chaos.disable();
        chaos.trace("drain".into());
        for t in tasks {
            let _ = t.await;
        }
        tokio::time::sleep(Duration::from_secs(60)).await;
        replicas[0].resync_waiting_agents().await;
        tokio::time::sleep(Duration::from_secs(60)).await;
        violation = checker.check(&agents, &store.records::<PillarVolumeState>()?);
    }
    if let Some(v) = &violation {
        chaos.trace(format!("VIOLATION {v}"));
    }
    Ok((violation, ok.load(std::sync::atomic::Ordering::Relaxed)))
}
