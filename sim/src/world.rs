//! One seed: the world (store, two controller replicas, agents, hosts), the random operations
//! and faults, the invariant checks, the final drain.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pillar_csi::controller::Controller;
use pillar_csi::root::{AgentReach, ControllerBuilder};
use pillar_state::clock::{Timestamp, TokioClock, WallClock};
use pillar_state::crd::{NvmeTcp, PillarAgentSpec, PillarProtocolSpec, PillarVolumeState, PoolRef};
use pillar_state::{MemoryStore, StateStore};

use crate::chaos::{Chaos, Fault, FaultCounts, Knobs};
use crate::error::SimError;
use crate::host::{Fabric, Publication, Reservations, SharedHost, SimHost, Targets};
use crate::invariants::{Checker, NodeAck, StageKey, View, Violation};
use crate::node::{POOL, PowerGrid, SimAgent};
use crate::store::{replica_store, shared_store};
use crate::transport::{Link, dialer};

/// The shape of every seed's run.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Operations started per seed.
    pub steps: usize,
    /// Volume names in play (re-created under the same name after deletes).
    pub volumes: usize,
    /// Kubernetes nodes; each has two host NQNs it may present, each a host of its own.
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
            agents: 3,
            knobs: Knobs::default(),
        }
    }
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

pub(crate) const PROTOCOL: &str = "nvme-tcp";

/// Host NQN `variant` of node `node`.
pub(crate) fn host(node: u32, variant: u32) -> String {
    format!(
        "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-{:012}",
        node * 10 + variant
    )
}

/// The temp directory root: tmpfs when there is one (fsync of marks is free there).
pub(crate) fn temp_root() -> std::io::Result<tempfile::TempDir> {
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

/// Everything one seed runs.
pub(crate) struct World {
    pub config: Config,
    pub chaos: Chaos,
    pub store: Arc<MemoryStore>,
    pub agents: Vec<SimAgent>,
    pub replicas: Vec<Arc<Controller>>,
    /// Hosts, `(node - 1) * 2 + variant`.
    pub hosts: Vec<SharedHost>,
    pub fabric: Fabric,
    /// What each kubelet was told by ControllerPublish: (volume ID, node ID) to the answer.
    pub publications: Arc<Mutex<BTreeMap<(String, String), Publication>>>,
    /// Acknowledged expansions (invariant 8).
    pub expansions: Arc<Mutex<BTreeMap<(String, String), u64>>>,
    /// The capacity kubelets expand to on the node: (volume ID, lifecycle UID) to the largest
    /// size a ControllerExpandVolume answered with `node_expansion_required` (the PV's
    /// capacity once the resizer recorded it).
    pub node_resizes: Arc<Mutex<BTreeMap<(String, String), u64>>>,
    /// Acknowledged node expansions (invariant 9).
    pub node_expansions: Arc<Mutex<BTreeMap<StageKey, NodeAck>>>,
    /// An armed power loss: the agent cut if none tripped it by the step given.
    pub armed: Option<(usize, usize)>,
    grid: Arc<PowerGrid>,
    checker: Checker,
}

/// Steps an armed power loss may wait for the agent's next durable operations: the rest of a
/// seed, nearly always (most steps make no durable write on that agent); a loss still armed
/// when the steps end is cut then, before the drain.
const POWER_LOSS_STEPS: u64 = 1_000;
/// The time of day at a seed's start, the same for every seed.
const SIM_EPOCH: Timestamp = Timestamp::constant(1_767_225_600, 0);

/// The storage node `i`'s agent record.
fn agent_spec(name: &str, address: IpAddr) -> PillarAgentSpec {
    PillarAgentSpec {
        node: name.to_owned(),
        address: format!("sim://{name}"),
        tls: None,
        pools: vec![PoolRef {
            name: POOL.into(),
            kind: "plain-file".into(),
        }],
        nvme_address: address.to_string(),
        topology: Default::default(),
    }
}

/// Starts the agents, each with its own NVMe address.
async fn start_agents(
    config: &Config,
    chaos: &Chaos,
    store: &MemoryStore,
    dir: &std::path::Path,
    grid: &Arc<PowerGrid>,
) -> Result<Vec<SimAgent>, SimError> {
    let mut agents = Vec::new();
    for i in 0..config.agents {
        let name = format!("storage-{i}");
        let address = IpAddr::V4(Ipv4Addr::new(127, 0, 0, u8::try_from(i + 1).unwrap_or(1)));
        store
            .create_agent(&name, agent_spec(&name, address))
            .await?;
        let mut agent = SimAgent::new(
            &name,
            &dir.join(&name),
            address,
            chaos.clone(),
            Arc::clone(grid),
        )?;
        agent.start().await?;
        agents.push(agent);
    }
    Ok(agents)
}

/// Every node's two hosts, reaching `targets`.
fn make_hosts(
    config: &Config,
    dir: &std::path::Path,
    targets: &Targets,
    reservations: &Arc<Reservations>,
) -> Result<Vec<SharedHost>, SimError> {
    let mut hosts = Vec::new();
    for node in 1..=config.nodes {
        for variant in 0..2 {
            let name = format!("node-{node}");
            let path = dir.join("hosts").join(format!("{name}-{variant}"));
            let h = SimHost::new(
                &name,
                &host(node, variant),
                &path,
                Arc::clone(targets),
                Arc::clone(reservations),
            )
            .map_err(SimError::Host)?;
            hosts.push(Arc::new(Mutex::new(h)));
        }
    }
    Ok(hosts)
}

impl World {
    pub(crate) async fn build(
        config: &Config,
        chaos: &Chaos,
        dir: &std::path::Path,
    ) -> Result<Self, SimError> {
        let store = shared_store(chaos);
        let protocol = PillarProtocolSpec {
            nvme_tcp: NvmeTcp {
                acl: true,
                ..NvmeTcp::default()
            },
        };
        store.create_protocol(PROTOCOL, protocol).await?;
        let grid = Arc::new(PowerGrid::default());
        let agents = start_agents(config, chaos, &store, dir, &grid).await?;
        let links: BTreeMap<String, Arc<Link>> = agents
            .iter()
            .map(|a| (a.name.clone(), Arc::clone(&a.link)))
            .collect();
        let dial = dialer(Arc::new(links));
        // The records' times follow the paused runtime's clock from a fixed epoch: the seed
        // decides them, as it decides the resync intervals and the Lease deadlines.
        let clock: Arc<dyn WallClock> = Arc::new(TokioClock::starting_at(SIM_EPOCH));
        let mut replicas = Vec::new();
        for r in 0..2 {
            let store = replica_store(Arc::clone(&store) as Arc<dyn StateStore>, chaos.clone(), r);
            let wired = ControllerBuilder::new(store, AgentReach::Dialer(Arc::clone(&dial)))
                .clock(Arc::clone(&clock))
                .build()
                .await?;
            replicas.push(wired.controller());
        }
        let targets: Targets = Arc::new(
            agents
                .iter()
                .map(|a| (a.address, (a.name.clone(), a.configfs.clone())))
                .collect(),
        );
        let reservations = Arc::new(Reservations::default());
        Ok(Self {
            config: *config,
            chaos: chaos.clone(),
            store,
            hosts: make_hosts(config, dir, &targets, &reservations)?,
            agents,
            replicas,
            fabric: Fabric {
                targets,
                reservations,
                chaos: chaos.clone(),
            },
            publications: Arc::default(),
            expansions: Arc::default(),
            node_resizes: Arc::default(),
            node_expansions: Arc::default(),
            armed: None,
            grid,
            checker: Checker::default(),
        })
    }

    /// Checks every invariant now.
    pub(crate) fn check(&mut self) -> Result<Option<Violation>, SimError> {
        let volumes = self.store.records::<PillarVolumeState>()?;
        let expansions = self
            .expansions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let node_expansions = self
            .node_expansions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Ok(self.checker.check(View {
            agents: &self.agents,
            hosts: &self.hosts,
            targets: &self.fabric.targets,
            volumes: &volumes,
            expansions: &expansions,
            node_expansions: &node_expansions,
        }))
    }

    /// An agent crash, maybe a power loss or a lost state directory, at `step`. A power loss
    /// is armed, not done: it lands at one of the agent's next durable file operations, while
    /// the world runs on ([`settle_power_loss`](Self::settle_power_loss)).
    pub(crate) async fn crash(&mut self, step: usize) -> Result<(), SimError> {
        let chaos = self.chaos.clone();
        let which = usize::try_from(chaos.below(self.agents.len() as u64)).unwrap_or(0);
        if !chaos.strikes(Fault::AgentCrash, chaos.knobs.crash * 10, "agent crash") {
            return Ok(());
        }
        if self.armed.is_some_and(|(a, _)| a == which) {
            // The armed agent goes down now, between its durable writes.
            return self.settle_power_loss(step, true).await;
        }
        if chaos.strikes(Fault::PowerLoss, chaos.knobs.power_loss, "power loss") {
            // One armed power loss at a time: the one before is cut now.
            self.settle_power_loss(step, true).await?;
            let after = i64::try_from(chaos.below(6)).unwrap_or(0);
            let within = step + 1 + usize::try_from(chaos.below(POWER_LOSS_STEPS)).unwrap_or(0);
            self.grid.arm(after);
            chaos.trace(format!(
                "step {step}: power loss armed: at the durable operation {after} from now of any \
                 agent, else of {} by step {within}",
                self.agents[which].name
            ));
            self.armed = Some((which, within));
            return Ok(());
        }
        let agent = &mut self.agents[which];
        // Counted only with a crash: a loss without one is no loss.
        let lose = chaos.strikes(
            Fault::AgentStateLost,
            chaos.knobs.state_loss,
            "the state directory is lost",
        );
        chaos.trace(format!(
            "step {step}: crash {} (incarnation {}, state lost: {lose})",
            agent.name, agent.incarnation
        ));
        agent.crash(lose).await;
        tokio::time::sleep(chaos.pause(100)).await;
        let started = agent.start().await;
        // An armed power loss may strike this node while it finishes the work it had handed
        // to the kernel, or while it boots (its state identity is a durable write): that is
        // the loss, taken now.
        if agent.power_is_off() {
            chaos.trace(format!(
                "step {step}: {} lost power while crashing or booting",
                agent.name
            ));
            return self.settle_power_loss(step, true).await;
        }
        started
    }

    /// Lets the world run for `d`, waking early when an armed power loss trips.
    pub(crate) async fn run_for(&self, d: Duration) {
        match self.armed {
            Some(_) => self.grid.wait(d).await,
            None => tokio::time::sleep(d).await,
        }
    }

    /// Takes down the agent whose armed power loss tripped, or whose bound (`step`) is
    /// reached, or any armed one with `now`; restarts it.
    pub(crate) async fn settle_power_loss(
        &mut self,
        step: usize,
        now: bool,
    ) -> Result<(), SimError> {
        let Some((fallback, within)) = self.armed else {
            return Ok(());
        };
        let struck = self.agents.iter().position(SimAgent::power_is_off);
        let tripped = struck.is_some();
        if !(tripped || now || step >= within) {
            return Ok(());
        }
        self.armed = None;
        self.grid.disarm();
        let agent = &mut self.agents[struck.unwrap_or(fallback)];
        let chaos = self.chaos.clone();
        let loss = agent.cut_power().await?;
        self.fabric.reservations.forget(&agent.name);
        if loss.lost_writes {
            chaos.count(Fault::PowerLossLostWrites, "un-fsynced writes lost");
        }
        chaos.trace(format!(
            "step {step}: power loss of {} (incarnation {}, {}): {} crash states, writes lost: {}",
            agent.name,
            agent.incarnation,
            if tripped {
                "inside its durable writes"
            } else {
                "between durable writes"
            },
            loss.states,
            loss.lost_writes
        ));
        tokio::time::sleep(chaos.pause(100)).await;
        agent.start().await
    }
}
