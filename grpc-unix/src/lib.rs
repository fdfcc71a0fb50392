//! gRPC servers on unix sockets that every gRPC client can call, and the bounds every pillar
//! gRPC server (agent, CSI controller, CSI node) applies to what its clients can make it hold.
//!
//! tonic's HTTP/2 stack refuses a request whose `:authority` is not a valid URI authority, and
//! resets its stream (PROTOCOL_ERROR). Go clients send `localhost` on unix sockets; C-core
//! based clients (Python, Ruby, C++) and grpc-java send the socket path, raw or %-encoded. So a
//! CSI or agent socket served by plain tonic works with kubelet and the sidecars and with
//! nobody else. [`Incoming`] reads each unix-socket connection through a [`rewrite::Rewriter`]
//! (under TLS, where TLS is used), which replaces such an authority with `localhost` (its
//! invariants are in its module). The server-to-client direction is untouched but for a GOAWAY
//! when the rewriter refuses a client's bytes ([`AuthorityFixed`]).
//!
//! On a unix socket the authority means nothing: the peer reached this one socket, and neither
//! the CSI services nor the agent route or authorise by it.
//!
//! [`Incoming`] also does the servers' TLS ([`tls`]), so that the client certificate reaches the
//! services as [`ConnectInfo`] on unix sockets as on TCP, and caps the connections; [`Limits`]
//! are all the bounds of a server, and the tonic server that applies them.

mod fixed;
mod hpack;
mod huffman;
mod incoming;
mod limits;
pub mod rewrite;
pub mod tls;

use std::io;

use futures::Stream;
use tokio::net::UnixListener;

pub use fixed::AuthorityFixed;
pub use incoming::{AcceptOptions, AcceptStats, ConnectInfo, Connection, Incoming, Listener};
pub use limits::{Limits, STREAM_WINDOW};
pub use tokio_rustls::rustls;

/// The plaintext connections accepted on `listener` with the default bounds, each read through
/// an authority rewriter; for `tonic::transport::Server::serve_with_incoming[_shutdown]`.
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = io::Result<Connection>> + Send + 'static {
    Incoming::new(Listener::Unix(listener), AcceptOptions::default())
}
