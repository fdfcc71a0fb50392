//! Prometheus metrics: latency per RPC, fencing rejections by reason, io_uring batch sizes.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::engine::BatchObserver;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabels {
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

/// The agent's metrics registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    rpc: Family<RpcLabels, Histogram>,
    fence: Family<ReasonLabels, Counter>,
    batch: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every pillar agent metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("pillar_agent");
        // 50 us to ~1.6 s: fsync-bound operations sit in the sub-millisecond buckets.
        let rpc = Family::<RpcLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
        });
        registry.register(
            "rpc_duration_seconds",
            "Latency of agent RPCs by method and gRPC code",
            rpc.clone(),
        );
        let fence = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "fence_rejections",
            "Requests refused by stale-operation fencing, by reason",
            fence.clone(),
        );
        let batch = Histogram::new(exponential_buckets(1.0, 2.0, 10));
        registry.register(
            "uring_batch_entries",
            "Submission queue entries per io_uring_enter",
            batch.clone(),
        );
        Self {
            registry,
            rpc,
            fence,
            batch,
        }
    }

    /// Records one RPC.
    pub fn rpc(&self, method: &str, code: tonic::Code, seconds: f64) {
        let labels = RpcLabels {
            method: method.to_owned(),
            code: format!("{code:?}"),
        };
        self.rpc.get_or_create(&labels).observe(seconds);
    }

    /// Counts one fencing rejection.
    pub fn fence_rejected(&self, reason: &str) {
        self.fence
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// A callback for the io_uring engine's batch sizes.
    pub fn batch_observer(self: &Arc<Self>) -> BatchObserver {
        let batch = self.batch.clone();
        Arc::new(move |n| {
            #[allow(clippy::cast_precision_loss)] // batch sizes are far below 2^52
            batch.observe(n as f64);
        })
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
