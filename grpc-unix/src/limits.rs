//! The bounds of a pillar gRPC server, as flags, and the tonic server that applies them.
//!
//! What a client can make a server hold, and what answers a bound:
//! - connections: [`Limits::max_connections`] open or handshaking (see [`crate::incoming`]);
//!   one beyond is closed at once: UNAVAILABLE.
//! - header data: one bounded block per connection in the rewriter ([`crate::rewrite`]), and
//!   16 KiB decoded per header list in the server (`http2_max_header_list_size`): a larger
//!   block is a GOAWAY(ENHANCE_YOUR_CALM): RESOURCE_EXHAUSTED.
//! - streams: [`Limits::max_concurrent_streams`] per connection (HTTP/2
//!   SETTINGS_MAX_CONCURRENT_STREAMS; clients queue beyond it, a stream over it is
//!   REFUSED_STREAM: UNAVAILABLE).
//! - calls: [`Limits::max_in_flight`] handled at once per server; one beyond is answered
//!   RESOURCE_EXHAUSTED before any handler runs, so nothing of it is applied.
//! - request messages: [`Limits::max_request_bytes`] each, refused from the gRPC length prefix
//!   before the message is buffered; answered RESOURCE_EXHAUSTED (tonic says OUT_OF_RANGE; the
//!   [`InFlight`] layer renames it, as the gRPC spec and other implementations have it).
//! - buffered request data: the HTTP/2 flow-control windows ([`STREAM_WINDOW`],
//!   [`CONNECTION_WINDOW`]) per connection.
//!
//! So the memory a server's clients can make it hold is at most about
//! `max_connections x (CONNECTION_WINDOW + ~100 KiB rewriter and TLS buffers) +
//! max_in_flight x max_request_bytes`: with the defaults 256 x 356 KiB + 64 x 4 MiB,
//! ~345 MiB, in the worst case of every client sending the largest messages at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Semaphore;
use tonic::Status;
use tonic::transport::Server;

use crate::rewrite::MAX_HEADER_LIST_SIZE;

/// HTTP/2 receive window of each stream: request data buffered per call before it is read.
pub const STREAM_WINDOW: u32 = 64 * 1024;
/// HTTP/2 receive window of each connection, all its streams together.
pub const CONNECTION_WINDOW: u32 = 256 * 1024;

/// The bounds of one gRPC server. Defaults are for a control-plane API: a few clients (the
/// controller replicas; kubelet and the CSI sidecars) making small calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::Args)]
#[command(next_help_heading = "gRPC server bounds")]
pub struct Limits {
    /// Connections served at once (open or in their TLS handshake); one beyond is closed at
    /// once (clients see UNAVAILABLE).
    #[arg(long = "grpc-max-connections", default_value_t = Limits::DEFAULT.max_connections)]
    pub max_connections: usize,
    /// Calls in flight at once on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS).
    #[arg(long = "grpc-max-concurrent-streams", default_value_t = Limits::DEFAULT.max_concurrent_streams)]
    pub max_concurrent_streams: u32,
    /// Calls handled at once by the server, all connections together; one beyond is answered
    /// RESOURCE_EXHAUSTED before anything of it is done.
    #[arg(long = "grpc-max-in-flight", default_value_t = Limits::DEFAULT.max_in_flight)]
    pub max_in_flight: usize,
    /// Largest request message, in bytes; a larger one is answered RESOURCE_EXHAUSTED.
    #[arg(long = "grpc-max-request-bytes", default_value_t = Limits::DEFAULT.max_request_bytes)]
    pub max_request_bytes: usize,
    /// Seconds a client has to complete its TLS handshake.
    #[arg(long = "grpc-handshake-timeout-secs", default_value_t = Limits::DEFAULT.handshake_timeout_secs)]
    pub handshake_timeout_secs: u64,
}

impl Limits {
    pub const DEFAULT: Self = Self {
        max_connections: 256,
        max_concurrent_streams: 64,
        max_in_flight: 64,
        max_request_bytes: 4 << 20,
        handshake_timeout_secs: 10,
    };

    pub fn handshake_timeout(&self) -> Duration {
        Duration::from_secs(self.handshake_timeout_secs)
    }

    /// The accept options these bounds ask for, with `tls`.
    pub fn accept_options(&self, tls: Option<crate::tls::TlsSource>) -> crate::AcceptOptions {
        crate::AcceptOptions {
            tls,
            max_connections: self.max_connections,
            handshake_timeout: self.handshake_timeout(),
        }
    }

    /// A tonic server builder applying these bounds (the services' message size is
    /// [`Self::max_request_bytes`], set on each service). `refused` counts the calls refused
    /// by the in-flight bound.
    pub fn server(&self, refused: Arc<AtomicU64>) -> Server<InFlightStack> {
        Server::builder()
            .max_concurrent_streams(self.max_concurrent_streams)
            .http2_max_header_list_size(u32::try_from(MAX_HEADER_LIST_SIZE).unwrap_or(u32::MAX))
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            // A peer that vanished (TCP) gives its connection back within 80 s.
            .http2_keepalive_interval(Some(Duration::from_secs(60)))
            .http2_keepalive_timeout(Some(Duration::from_secs(20)))
            .layer(InFlightLayer {
                permits: Arc::new(Semaphore::new(self.max_in_flight.max(1))),
                limit: self.max_in_flight.max(1),
                refused,
            })
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The layers [`Limits::server`] adds.
pub type InFlightStack = tower::layer::util::Stack<InFlightLayer, tower::layer::util::Identity>;

/// Bounds the calls a server handles at once.
#[derive(Clone, Debug)]
pub struct InFlightLayer {
    permits: Arc<Semaphore>,
    limit: usize,
    refused: Arc<AtomicU64>,
}

impl<S> tower::Layer<S> for InFlightLayer {
    type Service = InFlight<S>;

    fn layer(&self, inner: S) -> InFlight<S> {
        InFlight {
            inner,
            layer: self.clone(),
        }
    }
}

/// A service behind [`InFlightLayer`].
#[derive(Clone, Debug)]
pub struct InFlight<S> {
    inner: S,
    layer: InFlightLayer,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// tonic's answer to a request message over its limit (OUT_OF_RANGE, from the length prefix).
const TOO_LARGE: &str = "Error, decoded message length too large";

impl<S, B> tower::Service<http::Request<B>> for InFlight<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let Ok(permit) = Arc::clone(&self.layer.permits).try_acquire_owned() else {
            self.layer.refused.fetch_add(1, Ordering::Relaxed);
            let status = Status::resource_exhausted(format!(
                "the server handles {} calls at once; retry later",
                self.layer.limit
            ));
            return Box::pin(std::future::ready(Ok(status.into_http())));
        };
        let call = self.inner.call(request);
        Box::pin(async move {
            let mut response = call.await?;
            drop(permit);
            rename_too_large(&mut response);
            Ok(response)
        })
    }
}

/// A request message over the limit is RESOURCE_EXHAUSTED (tonic answers OUT_OF_RANGE, in a
/// trailers-only response of a unary call).
fn rename_too_large(response: &mut http::Response<tonic::body::Body>) {
    let headers = response.headers_mut();
    if headers.get("grpc-status").is_none_or(|s| s != "11") {
        return;
    }
    let too_large = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .is_some_and(|m| m.starts_with(TOO_LARGE) || m.starts_with(&TOO_LARGE.replace(' ', "%20")));
    if too_large {
        headers.insert("grpc-status", http::HeaderValue::from_static("8"));
    }
}
