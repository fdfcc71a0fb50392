//! The controller's Prometheus metrics, and the HTTP endpoint that serves them
//! (`--metrics-listen`, path `/metrics`): CSI call latency by method and code, agent call
//! latency by call and the agent's error reason, compare-and-swap conflicts by object kind,
//! resync rounds by result, and whether this replica holds the Lease.
//!
//! Labels are bounded sets (method names, gRPC codes, agent reasons, kinds): never a volume ID.
//!
//! `volumes_revoking` and `agent_waiting_for_resync` are what the leader's resync loop saw: a
//! replica that does not hold the Lease (it lost it, or never held it) exports them as zero and
//! no agent, never the values of its last rounds, since the alerts take the maximum over every
//! replica.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use pillar_state::lease::Leadership;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentLabels {
    agent: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

/// The controller's metrics registry.
#[derive(Debug)]
pub struct ControllerMetrics {
    registry: Registry,
    csi: Family<CallLabels, Histogram>,
    agent: Family<CallLabels, Histogram>,
    conflicts: Family<KindLabels, Counter>,
    resync: Family<ResultLabels, Histogram>,
    leader: Gauge,
    waiting: Family<AgentLabels, Gauge>,
    revoking: Gauge,
    /// Read at each scrape into `leader`.
    leadership: std::sync::Mutex<Option<Leadership>>,
    /// Set when a scrape found this replica not leading and reset the leader's gauges: the
    /// next round counts at once instead of waiting for its usual interval.
    leader_gauges_reset: std::sync::atomic::AtomicBool,
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ControllerMetrics {
    /// A registry with every controller metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("pillar_controller");
        // 1 ms to ~65 s: a CSI call is API server round trips plus agent calls.
        let buckets = || Histogram::new(exponential_buckets(0.001, 2.0, 17));
        let csi = Family::<CallLabels, Histogram>::new_with_constructor(buckets);
        registry.register(
            "csi_duration_seconds",
            "Latency of CSI controller calls by method and gRPC code",
            csi.clone(),
        );
        let agent = Family::<CallLabels, Histogram>::new_with_constructor(buckets);
        registry.register(
            "agent_call_duration_seconds",
            "Latency of calls to storage-node agents by call and the agent's answer (Ok or its \
             error reason)",
            agent.clone(),
        );
        let conflicts = Family::<KindLabels, Counter>::default();
        registry.register(
            "cas_conflicts",
            "Compare-and-swap writes that lost to a concurrent write and were decided again",
            conflicts.clone(),
        );
        let resync = Family::<ResultLabels, Histogram>::new_with_constructor(buckets);
        registry.register(
            "resync_duration_seconds",
            "Duration of an agent's export resync by result",
            resync.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica holds the Lease that runs the background loops",
            leader.clone(),
        );
        let waiting = Family::<AgentLabels, Gauge>::default();
        registry.register(
            "agent_waiting_for_resync",
            "1 while the agent answers that it waits for the controller's export resync (as \
             last seen by the leader's resync loop)",
            waiting.clone(),
        );
        let revoking = Gauge::default();
        registry.register(
            "volumes_revoking",
            "Volumes with an unpublish waiting for its revoke (condition Revoking), as last \
             counted by the leader",
            revoking.clone(),
        );
        Self {
            registry,
            csi,
            waiting,
            revoking,
            agent,
            conflicts,
            resync,
            leader,
            leadership: std::sync::Mutex::new(None),
            leader_gauges_reset: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Records one CSI call.
    pub fn csi_call(&self, method: &str, code: tonic::Code, seconds: f64) {
        self.csi
            .get_or_create(&CallLabels {
                method: method.to_owned(),
                code: format!("{code:?}"),
            })
            .observe(seconds);
    }

    /// Records one agent call; `answer` is `Ok` or the agent's error reason.
    pub fn agent_call(&self, call: &str, answer: &str, seconds: f64) {
        self.agent
            .get_or_create(&CallLabels {
                method: call.to_owned(),
                code: answer.to_owned(),
            })
            .observe(seconds);
    }

    /// Counts one lost compare-and-swap on an object of `kind`.
    pub fn cas_conflict(&self, kind: &str) {
        self.conflicts
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// Records one resync of an agent.
    pub fn resync(&self, ok: bool, seconds: f64) {
        let result = if ok { "ok" } else { "failed" };
        self.resync
            .get_or_create(&ResultLabels {
                result: result.to_owned(),
            })
            .observe(seconds);
    }

    /// Whether `agent` waits for a resync, as this round saw it.
    pub fn agent_waiting(&self, agent: &str, waiting: bool) {
        self.waiting
            .get_or_create(&AgentLabels {
                agent: agent.to_owned(),
            })
            .set(i64::from(waiting));
    }

    /// How many volumes have a revoke pending.
    pub fn set_volumes_revoking(&self, n: usize) {
        self.revoking.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// The leader gauge follows `leadership` (read at each scrape).
    pub fn watch_leadership(&self, leadership: Leadership) {
        *self
            .leadership
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(leadership);
    }

    /// Whether a scrape reset the leader's gauges since the last call (the counts must be
    /// taken again at once).
    pub fn take_leader_gauges_reset(&self) -> bool {
        self.leader_gauges_reset
            .swap(false, std::sync::atomic::Ordering::AcqRel)
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let watched = self
            .leadership
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(Leadership::is_leader);
        let leading = watched.unwrap_or(false);
        self.leader.set(i64::from(leading));
        if watched == Some(false) {
            // Not the leader (any more): what earlier rounds saw is stale, and another replica
            // reports the truth.
            self.revoking.set(0);
            self.waiting.clear();
            self.leader_gauges_reset
                .store(true, std::sync::atomic::Ordering::Release);
        }
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Why the metrics endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("binding the metrics listener {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Serves `metrics` at `GET /metrics` on `addr` until `shutdown` completes. Returns the bound
/// address (port 0 picks one) once listening.
pub async fn serve_metrics(
    addr: SocketAddr,
    metrics: Arc<ControllerMetrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<SocketAddr, MetricsError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    tokio::spawn(async move {
        tokio::pin!(shutdown);
        loop {
            let stream = tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        tracing::warn!(error = %e, "metrics: accept failed");
                        continue;
                    }
                },
            };
            let metrics = Arc::clone(&metrics);
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let metrics = Arc::clone(&metrics);
                    async move { Ok::<_, std::convert::Infallible>(answer(&metrics, &req)) }
                });
                if let Err(e) = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await
                {
                    tracing::debug!(error = %e, "metrics: connection ended");
                }
            });
        }
    });
    Ok(bound)
}

fn answer<B>(metrics: &ControllerMetrics, req: &Request<B>) -> Response<Full<Bytes>> {
    let (code, body, content_type) =
        if req.method() == Method::GET && req.uri().path() == "/metrics" {
            (
                StatusCode::OK,
                metrics.encode(),
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )
        } else {
            (
                StatusCode::NOT_FOUND,
                "not found\n".to_owned(),
                "text/plain",
            )
        };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    resp
}
