//! gRPC servers on unix sockets that every gRPC client can call.
//!
//! tonic's HTTP/2 stack refuses a request whose `:authority` is not a valid URI authority, and
//! resets its stream (PROTOCOL_ERROR). Go clients send `localhost` on unix sockets; C-core
//! based clients (Python, Ruby, C++) and grpc-java send the socket path, raw or %-encoded. So a
//! CSI or agent socket served by plain tonic works with kubelet and the sidecars and with
//! nobody else. [`incoming`] wraps each accepted connection so the server reads the client's
//! bytes through a [`rewrite::Rewriter`], which replaces such an authority with `localhost`
//! (its invariants are in its module). The server-to-client direction is untouched.
//!
//! On a unix socket the authority means nothing: the peer reached this one socket, and neither
//! the CSI services nor the agent route or authorise by it.

pub mod rewrite;

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::server::{Connected, UdsConnectInfo};

use rewrite::Rewriter;

/// The connections accepted on `listener`, each read through an authority rewriter; for
/// `tonic::transport::Server::serve_with_incoming[_shutdown]`.
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = io::Result<AuthorityFixed>> + Send + 'static {
    futures::StreamExt::map(
        tokio_stream::wrappers::UnixListenerStream::new(listener),
        |accepted| accepted.map(AuthorityFixed::new),
    )
}

/// A unix-socket connection whose client bytes reach the server with any invalid `:authority`
/// replaced.
#[derive(Debug)]
pub struct AuthorityFixed {
    inner: UnixStream,
    rewriter: Rewriter,
    scratch: Box<[u8]>,
    eof: bool,
}

impl AuthorityFixed {
    /// Wraps an accepted connection.
    pub fn new(inner: UnixStream) -> Self {
        Self {
            inner,
            rewriter: Rewriter::new(),
            scratch: vec![0; 16 * 1024].into_boxed_slice(),
            eof: false,
        }
    }
}

impl Drop for AuthorityFixed {
    fn drop(&mut self) {
        if self.rewriter.replaced() > 0 {
            tracing::debug!(
                replaced = self.rewriter.replaced(),
                "a unix-socket client sent an authority that is not one; served as localhost"
            );
        }
    }
}

impl AsyncRead for AuthorityFixed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let pending = this.rewriter.pending();
            if pending > 0 {
                let n = this
                    .rewriter
                    .read_into(buf.initialize_unfilled_to(pending.min(buf.remaining())));
                buf.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut scratch = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut scratch))?;
            if scratch.filled().is_empty() {
                this.eof = true;
                continue;
            }
            this.rewriter
                .feed(scratch.filled())
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        }
    }
}

impl AsyncWrite for AuthorityFixed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl Connected for AuthorityFixed {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}
