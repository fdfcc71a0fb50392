//! The composition root: the one place that wires the controller's and the node plugin's
//! components together. `pillar-csi` (controller, node), `pillar-local` and the simulation
//! all build through it, so a new component or setting is wired once.
//!
//! A controller is [`ControllerBuilder`]: its store, how it reaches agents ([`AgentReach`]),
//! optionally its resync loop with the [`Leader`] that gates it, optionally a metrics
//! listener; [`ControllerBuilder::build`] returns a [`WiredController`], whose
//! [`controller`](WiredController::controller) the simulation drives directly and whose
//! [`serve`](WiredController::serve) the binaries put on a CSI socket. A node plugin is
//! [`WiredNode`], from a [`NodeConfig`].
//!
//! What stays with the callers is what differs between them: which store (Kubernetes,
//! embedded, the simulation's), which Lease, which records to seed, which socket.
//!
//! Invariants: an elected replica's elector runs for as long as its service does and releases
//! the Lease when the service stops (a standby takes over at once); the elector starts only
//! once everything that can fail to start has started, so a replica that fails at start never
//! holds the Lease.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use pillar_state::clock::{SystemClock, WallClock};
use pillar_state::lease::{Elector, Leadership};
use pillar_state::store::StateStore;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::agents::{Agents, ControllerTls, Dialer};
use crate::controller::metrics::{MetricsError, serve_metrics};
use crate::controller::{Controller, ControllerService};
use crate::credentials_delivery::client::CredentialsClient;
use crate::credentials_delivery::server::Bound;
use crate::identity::IdentityService;
use crate::node::{NodeConfig, NodeError, NodeService};
use crate::serve::{ServeError, serve_with_limits};

/// The CSI servers' bounds, for callers that take the defaults.
pub use pillar_grpc_unix::Limits;

/// How long the controller waits to connect to an agent over the network.
pub const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// How the controller reaches storage-node agents.
pub enum AgentReach {
    /// Over the network, by each PillarAgent's address: mutual TLS with `tls`, plaintext only
    /// to agents without TLS settings and only when `allow_plaintext` (see [`crate::agents`]).
    Network {
        tls: Option<ControllerTls>,
        allow_plaintext: bool,
        timeout: Duration,
    },
    /// Through an in-process transport (the simulation's); no binary uses it.
    Dialer(Dialer),
}

impl AgentReach {
    /// Over the network with the default connect timeout.
    pub fn network(tls: Option<ControllerTls>, allow_plaintext: bool) -> Self {
        Self::Network {
            tls,
            allow_plaintext,
            timeout: AGENT_CONNECT_TIMEOUT,
        }
    }

    fn agents(self) -> Arc<Agents> {
        match self {
            Self::Network {
                tls,
                allow_plaintext,
                timeout,
            } => Agents::new(tls, allow_plaintext, timeout),
            Self::Dialer(dialer) => Agents::with_dialer(dialer),
        }
    }
}

impl std::fmt::Debug for AgentReach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Network {
                tls,
                allow_plaintext,
                timeout,
            } => f
                .debug_struct("Network")
                .field("tls", tls)
                .field("allow_plaintext", allow_plaintext)
                .field("timeout", timeout)
                .finish(),
            Self::Dialer(_) => f.write_str("Dialer"),
        }
    }
}

/// Which replica runs the background loops.
#[derive(Debug)]
pub enum Leader {
    /// The only process (the embedded store): always.
    Sole,
    /// The holder of a Lease: the elector (from [`Elector::new`]) runs while the controller is
    /// served and releases the Lease when it stops. Boxed: an elector is large beside `Sole`.
    Elected(Box<Elector>, Leadership),
}

impl Leader {
    /// The holder of a Lease, from what [`Elector::new`] returns.
    pub fn elected((elector, leadership): (Elector, Leadership)) -> Self {
        Self::Elected(Box::new(elector), leadership)
    }
}

/// A controller's components, before they are wired.
#[derive(Debug)]
pub struct ControllerBuilder {
    store: Arc<dyn StateStore>,
    reach: AgentReach,
    resync: Option<(Duration, Leader)>,
    metrics_listen: Option<SocketAddr>,
    credentials: Option<Bound>,
    clock: Arc<dyn WallClock>,
}

/// A wired controller: its resync loop and elector (if any) running, its metrics (if any)
/// served.
#[derive(Debug)]
pub struct WiredController {
    controller: Arc<Controller>,
    /// Stops the elector; its task releases the Lease and ends.
    elector: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
    metrics: Option<SocketAddr>,
    credentials: Option<SocketAddr>,
}

impl ControllerBuilder {
    /// A controller over `store`, reaching agents as `reach` says; no background loop, no
    /// metrics listener until asked for.
    pub fn new(store: Arc<dyn StateStore>, reach: AgentReach) -> Self {
        Self {
            store,
            reach,
            resync: None,
            metrics_listen: None,
            credentials: None,
            clock: Arc::new(SystemClock),
        }
    }

    /// Reads the time of day from `clock` (the machine's by default; the simulation's moves
    /// with tokio's paused clock, so its seed decides the times the records carry).
    pub fn clock(mut self, clock: Arc<dyn WallClock>) -> Self {
        self.clock = clock;
        self
    }

    /// Serves the credentials endpoint (a node's DH-HMAC-CHAP pair to that node) on its bound
    /// listener, if one is given (bound by the caller, so a port that cannot be bound stops
    /// the start before anything runs). Every replica serves it, leader or not.
    pub fn credentials_endpoint(mut self, endpoint: Option<Bound>) -> Self {
        self.credentials = endpoint;
        self
    }

    /// Runs the resync loop every `interval` while `leader` holds.
    pub fn resync_every(mut self, interval: Duration, leader: Leader) -> Self {
        self.resync = Some((interval, leader));
        self
    }

    /// Serves Prometheus metrics at `addr` (path `/metrics`), if one is given.
    pub fn metrics_at(mut self, addr: Option<SocketAddr>) -> Self {
        self.metrics_listen = addr;
        self
    }

    /// Wires the controller: agents registry, controller, metrics listener, credentials
    /// endpoint, then the elector and the resync loop (last, so a listener that cannot bind
    /// leaves no Lease held).
    pub async fn build(self) -> Result<WiredController, MetricsError> {
        let controller = Controller::with_clock(self.store, self.reach.agents(), self.clock);
        let mut metrics = None;
        if let Some(addr) = self.metrics_listen {
            let bound = serve_metrics(addr, controller.metrics(), std::future::pending()).await?;
            tracing::info!(%bound, "serving metrics at /metrics");
            metrics = Some(bound);
        }
        let mut credentials = None;
        if let Some(bound) = self.credentials {
            credentials = bound.local_addr();
            tokio::spawn(async move {
                if let Err(e) = bound.serve(std::future::pending()).await {
                    tracing::error!(error = %crate::error_chain(&e), "the credentials endpoint stopped");
                }
            });
        }
        let mut elector = None;
        if let Some((interval, leader)) = self.resync {
            let leadership = match leader {
                Leader::Sole => Leadership::sole(),
                Leader::Elected(lease, leadership) => {
                    let (stop, stopped) = oneshot::channel::<()>();
                    let task = tokio::spawn(lease.run(async {
                        let _ = stopped.await;
                    }));
                    elector = Some((stop, task));
                    leadership
                }
            };
            controller.spawn_resync_loop(interval, leadership);
        }
        Ok(WiredController {
            controller,
            elector,
            metrics,
            credentials,
        })
    }
}

impl WiredController {
    /// The controller, for a caller that drives it without a socket (the simulation).
    pub fn controller(&self) -> Arc<Controller> {
        Arc::clone(&self.controller)
    }

    /// Where the metrics are served, if they are.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics
    }

    /// Where the credentials endpoint is served, if it is.
    pub fn credentials_addr(&self) -> Option<SocketAddr> {
        self.credentials
    }

    /// Serves Identity and Controller on `socket` within `limits` until `shutdown` completes,
    /// then releases the Lease (if elected) so a standby takes over at once.
    pub async fn serve(
        self,
        socket: &Path,
        limits: Limits,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let served = serve_with_limits::<NodeService>(
            socket,
            IdentityService,
            Some(ControllerService::new(self.controller)),
            None,
            limits,
            shutdown,
        )
        .await;
        if let Some((stop, task)) = self.elector {
            let _ = stop.send(());
            let _ = task.await;
        }
        served
    }
}

/// A node plugin, ready to serve.
#[derive(Debug)]
pub struct WiredNode {
    service: NodeService,
}

impl WiredNode {
    /// The node plugin configured by `config` (its stage records opened).
    pub fn new(config: NodeConfig) -> Result<Self, NodeError> {
        Ok(Self {
            service: NodeService::new(config)?,
        })
    }

    /// Stages without their DH-HMAC-CHAP secret get this node's pair through `client`, if
    /// one is given (see [`NodeService::with_credentials_delivery`]).
    pub fn credentials_delivery(mut self, client: Option<CredentialsClient>) -> Self {
        if let Some(client) = client {
            self.service = self.service.with_credentials_delivery(client);
        }
        self
    }

    /// Serves Identity and Node on `socket` within `limits` until `shutdown` completes.
    pub async fn serve(
        self,
        socket: &Path,
        limits: Limits,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        serve_with_limits(
            socket,
            IdentityService,
            None,
            Some(self.service),
            limits,
            shutdown,
        )
        .await
    }
}
