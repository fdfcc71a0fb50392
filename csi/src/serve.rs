//! Serving the CSI services on a unix socket, as kubelet and the sidecars expect.

use std::path::{Path, PathBuf};

use tonic::transport::Server;

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

/// Serves Identity, and the Controller and/or Node services given, on `socket` until
/// `shutdown` completes.
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
        .map_err(ServeError::Reflection)?;
    tracing::info!(socket = %socket.display(), controller = controller.is_some(), node = node.is_some(), "serving CSI");
    Server::builder()
        .add_service(csi::identity_server::IdentityServer::new(identity))
        .add_optional_service(controller.map(csi::controller_server::ControllerServer::new))
        .add_optional_service(node.map(csi::node_server::NodeServer::new))
        .add_service(reflection)
        // Every client's authority accepted (C-core clients send the socket path).
        .serve_with_incoming_shutdown(pillar_grpc_unix::incoming(listener), shutdown)
        .await
        .map_err(ServeError::Serve)
}
