//! Accepting connections for a tonic server: at most so many at once, TLS handshakes off the
//! accept loop and bounded in time, the authority rewriter on unix sockets above TLS.
//!
//! Invariants:
//! - At most `max_connections` connections are open or handshaking at once: each holds a
//!   permit from accept until the server drops it. A connection beyond is accepted and refused
//!   at once; nothing waits in a queue of this process beyond the listen backlog. A plaintext
//!   one is answered SETTINGS and GOAWAY(REFUSED_STREAM) once its first request arrived, which
//!   gRPC clients report as UNAVAILABLE, and kept until the client closes it or
//!   [`REFUSAL_LINGER`] passed (closed earlier, the client's request would fail writing,
//!   without the reason), at most [`MAX_LINGERING`] at once (beyond, closed at once); a TLS one
//!   is closed at once (the client's TLS connect fails: UNAVAILABLE).
//! - A TLS handshake runs in its own task and ends within `handshake_timeout`, so a client that
//!   stops mid-handshake holds its permit no longer than that and never blocks the accept loop.
//! - On a unix socket the rewriter reads the decrypted stream: it never sees TLS records.
//! - Every connection's [`ConnectInfo`] carries the client certificate chain where TLS was used,
//!   on unix sockets as on TCP.

use std::future::Future as _;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tonic::transport::CertificateDer;
use tonic::transport::server::Connected;

use crate::fixed::AuthorityFixed;
use crate::tls::TlsSource;

/// Where connections come from.
#[derive(Debug)]
pub enum Listener {
    /// A unix socket: every connection is read through the authority rewriter.
    Unix(UnixListener),
    /// TCP: clients send a host as authority; nothing is rewritten.
    Tcp(TcpListener),
}

/// How connections are accepted.
#[derive(Clone, Debug)]
pub struct AcceptOptions {
    /// Mutual TLS on every connection, or plaintext.
    pub tls: Option<TlsSource>,
    /// Connections open (or handshaking) at once.
    pub max_connections: usize,
    /// How long a TLS handshake may take.
    pub handshake_timeout: Duration,
}

impl Default for AcceptOptions {
    fn default() -> Self {
        Self {
            tls: None,
            max_connections: crate::Limits::DEFAULT.max_connections,
            handshake_timeout: crate::Limits::DEFAULT.handshake_timeout(),
        }
    }
}

/// What a request's extensions tell about its connection (tonic puts it there).
#[derive(Clone, Debug, Default)]
pub struct ConnectInfo {
    peer_addr: Option<SocketAddr>,
    peer_certs: Option<Arc<Vec<CertificateDer<'static>>>>,
}

impl ConnectInfo {
    /// The client's address, on TCP.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_addr
    }

    /// The client's certificate chain (leaf first), where TLS was used.
    pub fn peer_certs(&self) -> Option<Arc<Vec<CertificateDer<'static>>>> {
        self.peer_certs.clone()
    }
}

/// Counters of an [`Incoming`], for metrics and tests.
#[derive(Debug, Default)]
pub struct AcceptStats {
    /// Connections handed to the server.
    pub served: AtomicU64,
    /// Connections closed at once because `max_connections` were open.
    pub refused: AtomicU64,
    /// TLS handshakes that failed or timed out.
    pub handshakes_failed: AtomicU64,
}

trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// An accepted connection, ready for HTTP/2.
pub struct Connection {
    io: Box<dyn Io>,
    info: ConnectInfo,
    /// Released when the server drops the connection.
    _permit: OwnedSemaphorePermit,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl Connected for Connection {
    type ConnectInfo = ConnectInfo;

    fn connect_info(&self) -> ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// How long a refused plaintext connection is kept for its client to read the refusal.
pub const REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// How much of a refused client's first bytes are read, at most, looking for its request.
pub const REFUSAL_WAIT: usize = 16 * 1024;
/// Refused connections kept at once for their clients to read the refusal.
pub const MAX_LINGERING: usize = 256;

/// A freshly accepted socket.
enum Accepted {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream, SocketAddr),
}

impl Accepted {
    /// Answers the refusal once the client sent its first request (or [`REFUSAL_WAIT`] bytes,
    /// or stopped), then keeps the socket, reading and dropping what the client sends, until
    /// the client closes it; all within [`REFUSAL_LINGER`], holding `permit` so long.
    ///
    /// Answered before its request went out, a client (tonic's) takes the connection for
    /// closed before it was used, reconnects at once and queues the call again, for ever;
    /// answered after, the call is refused (REFUSED_STREAM: UNAVAILABLE) and ends.
    fn refuse(self, permit: OwnedSemaphorePermit) {
        tokio::spawn(async move {
            let _permit = permit;
            let linger = async {
                let mut io: Box<dyn Io> = match self {
                    Self::Unix(s) => Box::new(s),
                    Self::Tcp(s, _) => Box::new(s),
                };
                let mut seen = Vec::new();
                let mut chunk = [0_u8; 1024];
                while !sent_a_request(&seen) && seen.len() < REFUSAL_WAIT {
                    let n = io.read(&mut chunk).await?;
                    if n == 0 {
                        break;
                    }
                    seen.extend(&chunk[..n]);
                }
                io.write_all(&refusal()).await?;
                while io.read(&mut chunk).await? > 0 {}
                Ok::<_, io::Error>(())
            };
            let _ = tokio::time::timeout(REFUSAL_LINGER, linger).await;
        });
    }
}

/// Whether a client's first bytes (the preface, then frames) hold a HEADERS frame's header.
fn sent_a_request(bytes: &[u8]) -> bool {
    let mut frames = bytes.get(24..).unwrap_or_default();
    while let Some(header) = frames.get(..9) {
        if header[3] == 0x1 {
            return true;
        }
        let len =
            usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        frames = frames.get(9 + len..).unwrap_or_default();
    }
    false
}

/// SETTINGS (none) and GOAWAY(last stream 0, REFUSED_STREAM): the server's whole answer to a
/// plaintext connection beyond the limit. gRPC clients report UNAVAILABLE.
fn refusal() -> Vec<u8> {
    let mut bytes = vec![0, 0, 0, 0x4, 0, 0, 0, 0, 0];
    bytes.extend(crate::fixed::goaway_frame(
        0,
        0x7,
        "connection limit reached",
    ));
    bytes
}

/// The connections of a [`Listener`]; for `serve_with_incoming[_shutdown]`.
pub struct Incoming {
    listener: Listener,
    tls: Option<TlsSource>,
    handshake_timeout: Duration,
    permits: Arc<Semaphore>,
    /// Refused connections kept for their clients to read why.
    lingering: Arc<Semaphore>,
    handshakes: JoinSet<Option<Connection>>,
    /// After an accept error (out of file descriptors), accepting waits for this.
    backoff: Option<Pin<Box<tokio::time::Sleep>>>,
    stats: Arc<AcceptStats>,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("listener", &self.listener)
            .field("tls", &self.tls.is_some())
            .field("handshaking", &self.handshakes.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Incoming {
    pub fn new(listener: Listener, options: AcceptOptions) -> Self {
        Self {
            listener,
            tls: options.tls,
            handshake_timeout: options.handshake_timeout,
            permits: Arc::new(Semaphore::new(options.max_connections.max(1))),
            lingering: Arc::new(Semaphore::new(MAX_LINGERING)),
            handshakes: JoinSet::new(),
            backoff: None,
            stats: Arc::default(),
        }
    }

    /// The counters, shared with this stream.
    pub fn stats(&self) -> Arc<AcceptStats> {
        Arc::clone(&self.stats)
    }

    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Accepted>> {
        match &self.listener {
            Listener::Unix(l) => l
                .poll_accept(cx)
                .map_ok(|(stream, _)| Accepted::Unix(stream)),
            Listener::Tcp(l) => l.poll_accept(cx).map_ok(|(stream, addr)| {
                // gRPC messages are small and latency matters more than packet count.
                let _ = stream.set_nodelay(true);
                Accepted::Tcp(stream, addr)
            }),
        }
    }

    /// Starts serving `accepted`: at once in plaintext, after a handshake task with TLS.
    fn admit(&mut self, accepted: Accepted, permit: OwnedSemaphorePermit) -> Option<Connection> {
        let Some(tls) = self
            .tls
            .as_ref()
            .map(|source| TlsAcceptor::from(source.current()))
        else {
            let (io, peer_addr): (Box<dyn Io>, _) = match accepted {
                Accepted::Unix(s) => (Box::new(AuthorityFixed::new(s)), None),
                Accepted::Tcp(s, addr) => (Box::new(s), Some(addr)),
            };
            let info = ConnectInfo {
                peer_addr,
                peer_certs: None,
            };
            return Some(Connection {
                io,
                info,
                _permit: permit,
            });
        };
        let timeout = self.handshake_timeout;
        let stats = Arc::clone(&self.stats);
        self.handshakes.spawn(async move {
            let handshake = async {
                Ok::<_, io::Error>(match accepted {
                    Accepted::Unix(s) => {
                        let tls = tls.accept(s).await?;
                        let certs = peer_certs(tls.get_ref().1);
                        (
                            Box::new(AuthorityFixed::new(tls)) as Box<dyn Io>,
                            None,
                            certs,
                        )
                    }
                    Accepted::Tcp(s, addr) => {
                        let tls = tls.accept(s).await?;
                        let certs = peer_certs(tls.get_ref().1);
                        (Box::new(tls) as Box<dyn Io>, Some(addr), certs)
                    }
                })
            };
            match tokio::time::timeout(timeout, handshake).await {
                Ok(Ok((io, peer_addr, peer_certs))) => Some(Connection {
                    io,
                    info: ConnectInfo {
                        peer_addr,
                        peer_certs,
                    },
                    _permit: permit,
                }),
                Ok(Err(e)) => {
                    stats.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(error = %e, "TLS handshake failed");
                    None
                }
                Err(_) => {
                    stats.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(?timeout, "TLS handshake timed out");
                    None
                }
            }
        });
        None
    }
}

fn peer_certs(
    session: &tokio_rustls::rustls::ServerConnection,
) -> Option<Arc<Vec<CertificateDer<'static>>>> {
    session
        .peer_certificates()
        .map(|certs| Arc::new(certs.iter().map(|c| c.clone().into_owned()).collect()))
}

impl Stream for Incoming {
    type Item = io::Result<Connection>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        // Refusing a flood of connections must not keep this task from yielding.
        let mut budget = 64;
        loop {
            budget -= 1;
            if budget == 0 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            while let Poll::Ready(Some(done)) = this.handshakes.poll_join_next(cx) {
                if let Ok(Some(connection)) = done {
                    this.stats.served.fetch_add(1, Ordering::Relaxed);
                    return Poll::Ready(Some(Ok(connection)));
                }
            }
            if let Some(backoff) = &mut this.backoff {
                if backoff.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.backoff = None;
            }
            let accepted = match this.poll_accept(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(accepted)) => accepted,
                Poll::Ready(Err(e)) => {
                    // EMFILE and the like: the next accept would fail at once too.
                    tracing::warn!(error = %e, "accepting a gRPC connection failed");
                    this.backoff = Some(Box::pin(tokio::time::sleep(Duration::from_millis(50))));
                    continue;
                }
            };
            let Ok(permit) = Arc::clone(&this.permits).try_acquire_owned() else {
                this.stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("connection limit reached; a connection was refused");
                if this.tls.is_none()
                    && let Ok(linger) = Arc::clone(&this.lingering).try_acquire_owned()
                {
                    accepted.refuse(linger);
                }
                continue;
            };
            if let Some(connection) = this.admit(accepted, permit) {
                this.stats.served.fetch_add(1, Ordering::Relaxed);
                return Poll::Ready(Some(Ok(connection)));
            }
        }
    }
}
