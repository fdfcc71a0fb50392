//! The controller-to-agent transport: real tonic clients and servers over in-memory byte pipes
//! (`tokio::io::duplex`), with the simulation deciding the fate of every message.
//!
//! - [`Link`]: one agent node's address. Its current incarnation (a running agent process)
//!   accepts connections; while the agent is down, connecting is refused. A crash kills every
//!   connection of the incarnation ([`KillSwitch`]): reads and writes fail at once, so tonic's
//!   channel reconnects to the next incarnation, as it would after a TCP reset.
//! - [`ChaosAgent`]: sits between tonic's server and the agent's real gRPC service
//!   (`pillar_agent::grpc::AgentService`) and, per request, drops it, delays it (so requests
//!   overtake each other), delivers it twice, or loses or delays the reply after the work ran.
//!   The agent's own code runs unchanged behind it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use pillar_agent::grpc::AgentService;
use pillar_agent_api::v1 as api;
use pillar_csi::agents::{ConnectError, Dialer};
use pillar_state::crd::PillarAgent;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Response, Status};

use crate::chaos::{Chaos, Fault};

type WakerSlot = Arc<Mutex<Option<Waker>>>;

fn wake(slot: &WakerSlot) {
    if let Some(w) = slot.lock().unwrap_or_else(PoisonError::into_inner).take() {
        w.wake();
    }
}

/// Kills every connection of one agent incarnation at once.
#[derive(Debug, Default)]
pub struct KillSwitch {
    killed: AtomicBool,
    slots: Mutex<Vec<WakerSlot>>,
}

impl KillSwitch {
    /// Breaks every pipe made under this switch; blocked reads and writes wake and fail.
    pub fn kill(&self) {
        self.killed.store(true, Ordering::Release);
        for slot in self
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
        {
            wake(&slot);
        }
    }

    fn killed(&self) -> bool {
        self.killed.load(Ordering::Acquire)
    }

    fn slot(&self) -> WakerSlot {
        let slot = WakerSlot::default();
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::clone(&slot));
        slot
    }
}

/// One end of an in-memory connection that a [`KillSwitch`] can break.
#[derive(Debug)]
pub struct SimIo {
    inner: DuplexStream,
    kill: Arc<KillSwitch>,
    read: WakerSlot,
    write: WakerSlot,
}

impl SimIo {
    fn new(inner: DuplexStream, kill: &Arc<KillSwitch>) -> Self {
        Self {
            inner,
            kill: Arc::clone(kill),
            read: kill.slot(),
            write: kill.slot(),
        }
    }

    fn broken() -> io::Error {
        io::Error::new(io::ErrorKind::ConnectionReset, "the agent crashed")
    }

    fn arm(slot: &WakerSlot, cx: &Context<'_>) {
        *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(cx.waker().clone());
    }
}

impl AsyncRead for SimIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.kill.killed() {
            return Poll::Ready(Err(Self::broken()));
        }
        Self::arm(&self.read, cx);
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for SimIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.kill.killed() {
            return Poll::Ready(Err(Self::broken()));
        }
        Self::arm(&self.write, cx);
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.kill.killed() {
            return Poll::Ready(Err(Self::broken()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for SimIo {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

/// Where the server side of new connections goes.
pub type Incoming = mpsc::UnboundedSender<Result<SimIo, io::Error>>;

/// One agent node's address (see the module documentation).
#[derive(Debug, Default)]
pub struct Link {
    current: Mutex<Option<(Arc<KillSwitch>, Incoming)>>,
}

impl Link {
    /// Connections go to this incarnation from now on.
    pub fn up(&self, kill: Arc<KillSwitch>, incoming: Incoming) {
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = Some((kill, incoming));
    }

    /// The agent is down: connecting is refused until [`up`](Self::up).
    pub fn down(&self) {
        self.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    fn connect(&self) -> io::Result<SimIo> {
        let current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        let Some((kill, incoming)) = current.as_ref() else {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "the agent is down",
            ));
        };
        let (client, server) = tokio::io::duplex(1 << 16);
        incoming
            .send(Ok(SimIo::new(server, kill)))
            .map_err(|_| io::Error::new(io::ErrorKind::ConnectionRefused, "the agent is down"))?;
        Ok(SimIo::new(client, kill))
    }
}

/// The controller's dialer: a lazy tonic channel per agent over its [`Link`].
pub fn dialer(links: Arc<std::collections::BTreeMap<String, Arc<Link>>>) -> Dialer {
    Arc::new(
        move |agent: &PillarAgent| -> Result<Channel, ConnectError> {
            let name = agent.metadata.name.clone().unwrap_or_default();
            let link = links
                .get(&name)
                .cloned()
                .ok_or_else(|| ConnectError::Dial {
                    agent: name.clone(),
                    reason: "no such simulated agent".into(),
                })?;
            let channel = Endpoint::from_static("http://agent.sim")
                .timeout(Duration::from_secs(30))
                .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                    let link = Arc::clone(&link);
                    async move { link.connect().map(TokioIo::new) }
                }));
            Ok(channel)
        },
    )
}

/// See the module documentation.
#[derive(Clone, Debug)]
pub struct ChaosAgent {
    inner: AgentService,
    chaos: Chaos,
    node: String,
    /// The incarnation's kill switch: a message held back or copied never reaches a process
    /// that crashed meanwhile (a dead process receives nothing).
    kill: Arc<KillSwitch>,
    /// Requests that arrived, in order.
    arrived: Arc<AtomicU64>,
    /// The highest arrival number delivered to the agent so far.
    delivered: Arc<AtomicU64>,
}

impl ChaosAgent {
    /// Wraps agent `node`'s service.
    pub fn new(inner: AgentService, chaos: Chaos, node: &str, kill: Arc<KillSwitch>) -> Self {
        Self {
            inner,
            chaos,
            node: node.to_owned(),
            kill,
            arrived: Arc::default(),
            delivered: Arc::default(),
        }
    }

    fn deliver(&self, number: u64, method: &str) {
        let before = self.delivered.fetch_max(number, Ordering::AcqRel);
        if before > number {
            self.chaos.count(
                Fault::Reordered,
                &format!("{method} to {} overtaken by a later request", self.node),
            );
        }
    }

    async fn relay<Q, P, F, Fut>(
        &self,
        method: &'static str,
        mutating: bool,
        msg: Q,
        call: F,
    ) -> Result<Response<P>, Status>
    where
        Q: Clone + Send + 'static,
        P: Send + 'static,
        F: Fn(AgentService, Q) -> Fut + Copy + Send + Sync + 'static,
        Fut: Future<Output = Result<Response<P>, Status>> + Send + 'static,
    {
        let c = &self.chaos;
        let k = c.knobs;
        let number = self.arrived.fetch_add(1, Ordering::AcqRel) + 1;
        let at = format!("{method} to {}", self.node);
        if mutating && c.strikes(Fault::RequestDropped, k.drop_request, &at) {
            tokio::time::sleep(c.pause(50)).await;
            return Err(Status::unavailable(
                "request lost in the network (simulated)",
            ));
        }
        if c.strikes(Fault::RequestDelayed, k.delay_request, &at) {
            tokio::time::sleep(c.pause(200)).await;
        }
        if mutating && c.strikes(Fault::Duplicated, k.duplicate, &at) {
            let (inner, copy, delay) = (self.inner.clone(), msg.clone(), c.pause(300));
            let me = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                if me.kill.killed() {
                    return;
                }
                me.deliver(number, method);
                let _ = call(inner, copy).await;
            });
        }
        if self.kill.killed() {
            return Err(Status::unavailable("the agent crashed (simulated)"));
        }
        self.deliver(number, method);
        let result = call(self.inner.clone(), msg).await;
        if mutating && c.strikes(Fault::ReplyDropped, k.drop_reply, &at) {
            return Err(Status::unavailable("reply lost in the network (simulated)"));
        }
        if c.strikes(Fault::ReplyDelayed, k.delay_reply, &at) {
            tokio::time::sleep(c.pause(200)).await;
        }
        result
    }
}

/// Implements the agent service for [`ChaosAgent`]: every method relayed through
/// [`ChaosAgent::relay`] (one macro, so `async_trait` sees the expanded methods).
macro_rules! relay_all {
    ($(($name:ident, $req:ty, $resp:ty, $label:literal, $mutating:expr)),* $(,)?) => {
        #[tonic::async_trait]
        impl api::agent_server::Agent for ChaosAgent {
            $(
                async fn $name(&self, r: Request<$req>) -> Result<Response<$resp>, Status> {
                    self.relay(
                        $label,
                        $mutating,
                        r.into_inner(),
                        |svc: AgentService, m: $req| async move { svc.$name(Request::new(m)).await },
                    )
                    .await
                }
            )*
        }
    };
}

relay_all!(
    (
        get_capabilities,
        api::GetCapabilitiesRequest,
        api::GetCapabilitiesResponse,
        "GetCapabilities",
        false
    ),
    (
        health,
        api::HealthRequest,
        api::HealthResponse,
        "Health",
        false
    ),
    (
        create_volume,
        api::CreateVolumeRequest,
        api::CreateVolumeResponse,
        "CreateVolume",
        true
    ),
    (
        expand_volume,
        api::ExpandVolumeRequest,
        api::ExpandVolumeResponse,
        "ExpandVolume",
        true
    ),
    (
        delete_volume,
        api::DeleteVolumeRequest,
        api::DeleteVolumeResponse,
        "DeleteVolume",
        true
    ),
    (
        create_snapshot,
        api::CreateSnapshotRequest,
        api::CreateSnapshotResponse,
        "CreateSnapshot",
        true
    ),
    (
        delete_snapshot,
        api::DeleteSnapshotRequest,
        api::DeleteSnapshotResponse,
        "DeleteSnapshot",
        true
    ),
    (
        export,
        api::ExportRequest,
        api::ExportResponse,
        "Export",
        true
    ),
    (
        unexport,
        api::UnexportRequest,
        api::UnexportResponse,
        "Unexport",
        true
    ),
    (
        grant_initiator,
        api::GrantInitiatorRequest,
        api::GrantInitiatorResponse,
        "GrantInitiator",
        true
    ),
    (
        revoke_initiator,
        api::RevokeInitiatorRequest,
        api::RevokeInitiatorResponse,
        "RevokeInitiator",
        true
    ),
    (
        resync_exports,
        api::ResyncExportsRequest,
        api::ResyncExportsResponse,
        "ResyncExports",
        true
    ),
    (
        list_volumes,
        api::ListVolumesRequest,
        api::ListVolumesResponse,
        "ListVolumes",
        false
    ),
    (
        list_exports,
        api::ListExportsRequest,
        api::ListExportsResponse,
        "ListExports",
        false
    ),
    (
        get_capacity,
        api::GetCapacityRequest,
        api::GetCapacityResponse,
        "GetCapacity",
        false
    ),
);
