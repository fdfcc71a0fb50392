//! The controller's credentials endpoint: [`Delivery`] served as the gRPC service
//! `pillar.credentials.v1.NodeCredentials` over TLS on TCP (`--credentials-listen`).
//!
//! Any controller replica may serve it, leader or not: the answer is the store's pair (one
//! Secret per node, made by a create a racing replica loses and then reads), and the decision is
//! the API server's review of the token; nothing depends on the Lease (W8).
//!
//! Invariants:
//! - TLS always, with the controller's certificate read from files and read again when they
//!   change ([`TlsFiles::load_server_only`]); no client certificate is asked (a node proves
//!   itself with its token, in the call). There is no plaintext mode.
//! - Bounded (C7), a hostile client gets a clear code and bounded memory: connections open or
//!   handshaking ([`EndpointArgs::max_connections`], beyond: closed, UNAVAILABLE), the TLS
//!   handshake's time, calls handled at once (beyond: RESOURCE_EXHAUSTED before the handler
//!   runs), the request's size ([`EndpointArgs::max_request_bytes`], refused from the gRPC
//!   length prefix before it is buffered: RESOURCE_EXHAUSTED), header data, and each call's
//!   time to review and answer ([`EndpointArgs::review_timeout_secs`], then UNAVAILABLE).
//! - A request is checked before the review: a malformed node name, host NQN or volume ID is
//!   INVALID_ARGUMENT, a missing token UNAUTHENTICATED; neither reaches the API server.
//! - Never logs the token or a secret (the request's and answer's `Debug` redact them).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pillar_grpc_unix::tls::{TlsConfigError, TlsFiles, TlsSource};
use pillar_grpc_unix::{Incoming, Limits, Listener};
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use super::Delivery;
use super::proto::node_credentials_server::{NodeCredentials, NodeCredentialsServer};
use super::proto::{GetNodeCredentialsRequest, GetNodeCredentialsResponse};

/// The longest node name Kubernetes accepts (a DNS subdomain).
const MAX_NODE_NAME: usize = 253;
/// The longest volume ID this endpoint logs (the CSI spec's bound on an ID is 128 bytes; more
/// room for another CO's).
const MAX_VOLUME_ID: usize = 256;

/// The endpoint's flags (the controller's; README "Delivery of a node's pair").
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
#[command(next_help_heading = "Credentials endpoint (delivery of each node's DH-HMAC-CHAP pair)")]
pub struct EndpointArgs {
    /// Serve the credentials endpoint on this address (TLS; needs the Kubernetes store).
    /// Unset: not served, and nodes of a Kubernetes cluster get no pair (run `auth: none`).
    #[arg(long, requires_all = ["credentials_tls_cert", "credentials_tls_key"])]
    pub credentials_listen: Option<SocketAddr>,
    /// The endpoint's certificate (PEM; its DNS name is the one nodes check, e.g.
    /// `pillar-controller.pillar-system.svc`). Read again when it changes.
    #[arg(long)]
    pub credentials_tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long)]
    pub credentials_tls_key: Option<PathBuf>,
    /// Connections open or in their TLS handshake at once; one beyond is closed.
    #[arg(long, default_value_t = 256)]
    pub credentials_max_connections: usize,
    /// Calls handled at once; one beyond is answered RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 16)]
    pub credentials_max_in_flight: usize,
    /// Largest request, in bytes (a projected token is about 1 KiB); a larger one is answered
    /// RESOURCE_EXHAUSTED before it is read.
    #[arg(long, default_value_t = 16 * 1024)]
    pub credentials_max_request_bytes: usize,
    /// Seconds a client has to complete its TLS handshake.
    #[arg(long, default_value_t = 5)]
    pub credentials_handshake_timeout_secs: u64,
    /// Seconds one call may take to have the token reviewed and the pair read; then
    /// UNAVAILABLE.
    #[arg(long, default_value_t = 10)]
    pub credentials_review_timeout_secs: u64,
}

impl EndpointArgs {
    /// The server bounds these flags ask for.
    pub fn limits(&self) -> Limits {
        Limits {
            max_connections: self.credentials_max_connections,
            // One call per node stage: a client has no use for many streams.
            max_concurrent_streams: 4,
            max_in_flight: self.credentials_max_in_flight,
            max_request_bytes: self.credentials_max_request_bytes,
            handshake_timeout_secs: self.credentials_handshake_timeout_secs,
        }
    }

    /// The endpoint these flags describe, serving `delivery`; `None` when no listen address
    /// was given.
    pub fn endpoint(&self, delivery: Delivery) -> Result<Option<Endpoint>, EndpointError> {
        let (Some(listen), Some(cert), Some(key)) = (
            self.credentials_listen,
            &self.credentials_tls_cert,
            &self.credentials_tls_key,
        ) else {
            return Ok(None);
        };
        let tls = TlsFiles::load_server_only(cert, key).map_err(EndpointError::Tls)?;
        Ok(Some(Endpoint {
            listen,
            tls: TlsSource::Files(Arc::new(tls)),
            limits: self.limits(),
            review_timeout: Duration::from_secs(self.credentials_review_timeout_secs),
            delivery,
        }))
    }
}

/// Why the endpoint could not be served.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("the credentials endpoint's TLS certificate and key do not load")]
    Tls(#[source] TlsConfigError),
    #[error("cannot bind the credentials endpoint on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the credentials endpoint's gRPC server failed")]
    Serve(#[source] tonic::transport::Error),
}

/// Everything one endpoint needs.
#[derive(Debug)]
pub struct Endpoint {
    /// Where it listens (port 0: any free port, see [`Endpoint::bind`]).
    pub listen: SocketAddr,
    /// The server certificate.
    pub tls: TlsSource,
    /// Connections, calls in flight, request size, handshake time.
    pub limits: Limits,
    /// How long one call may take to review and answer.
    pub review_timeout: Duration,
    /// The controller's side of the exchange.
    pub delivery: Delivery,
}

/// An endpoint whose listener is bound, ready to serve.
#[derive(Debug)]
pub struct Bound {
    listener: tokio::net::TcpListener,
    endpoint: Endpoint,
}

impl Endpoint {
    /// Binds the listener (an error here stops the controller's start, before any Lease).
    pub async fn bind(self) -> Result<Bound, EndpointError> {
        let listener = tokio::net::TcpListener::bind(self.listen)
            .await
            .map_err(|source| EndpointError::Bind {
                addr: self.listen,
                source,
            })?;
        Ok(Bound {
            listener,
            endpoint: self,
        })
    }
}

impl Bound {
    /// The bound address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves until `shutdown` completes.
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), EndpointError> {
        let Endpoint {
            tls,
            limits,
            review_timeout,
            delivery,
            ..
        } = self.endpoint;
        tracing::info!(addr = ?self.listener.local_addr().ok(), "serving the credentials endpoint (TLS)");
        let service = NodeCredentialsServer::new(CredentialsService {
            delivery,
            review_timeout,
        })
        .max_decoding_message_size(limits.max_request_bytes);
        limits
            .server(Arc::default())
            .add_service(service)
            .serve_with_incoming_shutdown(
                Incoming::new(
                    Listener::Tcp(self.listener),
                    limits.accept_options(Some(tls)),
                ),
                shutdown,
            )
            .await
            .map_err(EndpointError::Serve)
    }
}

/// The gRPC service over [`Delivery`].
#[derive(Debug)]
pub struct CredentialsService {
    delivery: Delivery,
    review_timeout: Duration,
}

/// The request's fields as the review needs them, or INVALID_ARGUMENT / UNAUTHENTICATED.
fn check_request(req: &GetNodeCredentialsRequest) -> Result<(), Status> {
    if req.node.is_empty() || req.node.len() > MAX_NODE_NAME || req.node.contains('/') {
        return Err(Status::invalid_argument(format!(
            "node must be a node name (1 to {MAX_NODE_NAME} bytes, no '/')"
        )));
    }
    if let Err(e) = pillar_nvmet::HostNqn::parse(&req.host_nqn) {
        return Err(Status::invalid_argument(format!("host_nqn: {e}")));
    }
    if req.volume_id.len() > MAX_VOLUME_ID {
        return Err(Status::invalid_argument(format!(
            "volume_id is longer than {MAX_VOLUME_ID} bytes"
        )));
    }
    if req.token.is_empty() {
        return Err(Status::unauthenticated(
            "no token: send the node plugin's projected ServiceAccount token",
        ));
    }
    Ok(())
}

#[tonic::async_trait]
impl NodeCredentials for CredentialsService {
    async fn get_node_credentials(
        &self,
        request: Request<GetNodeCredentialsRequest>,
    ) -> Result<Response<GetNodeCredentialsResponse>, Status> {
        let req = request.into_inner();
        check_request(&req)?;
        let span = tracing::info_span!(
            "GetNodeCredentials",
            node = %req.node,
            host_nqn = %req.host_nqn,
            volume_id = %req.volume_id
        );
        async {
            let answer = tokio::time::timeout(
                self.review_timeout,
                self.delivery
                    .credentials_for(&req.token, &req.node, &req.host_nqn),
            )
            .await
            .map_err(|_| {
                Status::unavailable(format!(
                    "the review of node {}'s token and the read of its pair did not finish \
                     within {:?}",
                    req.node, self.review_timeout
                ))
            })?;
            let creds = answer.map_err(|e| Status::new(e.code(), crate::error_chain(&e)))?;
            tracing::info!("delivered the node's DH-HMAC-CHAP pair to that node");
            Ok(Response::new(GetNodeCredentialsResponse {
                node: creds.node.clone(),
                host_nqn: creds.host_nqn.clone(),
                dhchap_secret: creds.secret.clone(),
                dhchap_ctrl_secret: creds.ctrl_secret.clone(),
            }))
        }
        .instrument(span)
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(node: &str, nqn: &str, token: &str) -> GetNodeCredentialsRequest {
        GetNodeCredentialsRequest {
            token: token.into(),
            node: node.into(),
            host_nqn: nqn.into(),
            volume_id: "pvc-1".into(),
        }
    }

    const NQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0a0a0a0a-0000-4000-8000-00000000000a";

    // proves C7 (bad input refused before any work): malformed fields are INVALID_ARGUMENT and
    // a missing token UNAUTHENTICATED, decided before the API server is asked.
    #[test]
    fn malformed_requests_are_refused_before_the_review() {
        check_request(&req("node-1", NQN, "t")).unwrap();
        let code = |r: GetNodeCredentialsRequest| check_request(&r).unwrap_err().code();
        assert_eq!(code(req("", NQN, "t")), tonic::Code::InvalidArgument);
        assert_eq!(code(req("a/b", NQN, "t")), tonic::Code::InvalidArgument);
        assert_eq!(
            code(req(&"n".repeat(254), NQN, "t")),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            code(req("node-1", "nqn", "t")),
            tonic::Code::InvalidArgument
        );
        assert_eq!(code(req("node-1", NQN, "")), tonic::Code::Unauthenticated);
        let mut long = req("node-1", NQN, "t");
        long.volume_id = "v".repeat(257);
        assert_eq!(code(long), tonic::Code::InvalidArgument);
        // The token never shows in a request's Debug.
        assert!(!format!("{:?}", req("node-1", NQN, "secret-token")).contains("secret-token"));
    }
}
