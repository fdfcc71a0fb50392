//! Serving the CSI services on a unix socket, as kubelet and the sidecars expect, within the
//! bounds of [`Limits`]: a bound hit is answered RESOURCE_EXHAUSTED or UNAVAILABLE before any
//! handler runs, so nothing of such a call is applied.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pillar_grpc_unix::{Incoming, Limits, Listener};

use crate::controller::ControllerService;
use crate::csi;
use crate::identity::IdentityService;

/// Why a CSI endpoint could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot bind CSI socket {path}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("building gRPC reflection")]
    Reflection(#[source] tonic_reflection::server::Error),
    #[error("CSI gRPC server failed")]
    Serve(#[source] tonic::transport::Error),
}

/// Parses a CSI endpoint (`unix:///path` or a plain path).
pub fn socket_path(endpoint: &str) -> PathBuf {
    PathBuf::from(endpoint.strip_prefix("unix://").unwrap_or(endpoint))
}

/// Serves Identity, and the Controller and/or Node services given, on `socket` with the
/// default bounds until `shutdown` completes.
pub async fn serve<N>(
    socket: &Path,
    identity: IdentityService,
    controller: Option<ControllerService>,
    node: Option<N>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError>
where
    N: csi::node_server::Node,
{
    serve_with_limits(
        socket,
        identity,
        controller,
        node,
        Limits::default(),
        shutdown,
    )
    .await
}

/// Serves Identity, and the Controller and/or Node services given, on `socket` within
/// `limits` (connections, streams, calls in flight, header and message sizes; see
/// [`Limits`]) until `shutdown` completes.
pub async fn serve_with_limits<N>(
    socket: &Path,
    identity: IdentityService,
    controller: Option<ControllerService>,
    node: Option<N>,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError>
where
    N: csi::node_server::Node,
{
    let _ = std::fs::remove_file(socket);
    if let Some(parent) = socket.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    let listener = tokio::net::UnixListener::bind(socket).map_err(|source| ServeError::Bind {
        path: socket.to_owned(),
        source,
    })?;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(csi::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(ServeError::Reflection)?
        .max_decoding_message_size(limits.max_request_bytes);
    tracing::info!(socket = %socket.display(), controller = controller.is_some(), node = node.is_some(), "serving CSI");
    let max = limits.max_request_bytes;
    limits
        .server(Arc::default())
        .add_service(
            csi::identity_server::IdentityServer::new(identity).max_decoding_message_size(max),
        )
        .add_optional_service(controller.map(|c| {
            csi::controller_server::ControllerServer::new(c).max_decoding_message_size(max)
        }))
        .add_optional_service(
            node.map(|n| csi::node_server::NodeServer::new(n).max_decoding_message_size(max)),
        )
        .add_service(reflection)
        // Every client's authority accepted (C-core clients send the socket path).
        .serve_with_incoming_shutdown(
            Incoming::new(Listener::Unix(listener), limits.accept_options(None)),
            shutdown,
        )
        .await
        .map_err(ServeError::Serve)
}
