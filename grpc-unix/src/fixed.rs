//! A connection read through the authority [`Rewriter`], and how a refusal reaches the client.
//!
//! Invariants:
//! - The server reads exactly what the rewriter produced, in order; the client's bytes are read
//!   from the socket only once the rewriter took all of the previous read, and the rewriter
//!   takes input only while little of its output waits (see [`crate::rewrite`]): per
//!   connection the buffers are bounded whatever the client sends.
//! - The server's bytes reach the client unchanged. The only bytes added are one GOAWAY, after
//!   a refusal, and only between two of the server's frames.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::rewrite::{RewriteError, Rewriter};

/// A connection (a unix socket, or TLS on one) whose client bytes reach the server with any
/// invalid `:authority` replaced.
///
/// What the rewriter refuses (see [`rewrite`]) ends the connection as an HTTP/2 connection
/// error: the client gets a GOAWAY naming the last stream the server saw and why
/// ([`RewriteError::h2_code`]), written between two of the server's frames, and the server's
/// next read fails, so it drops the connection. The GOAWAY is best effort (a client that reads
/// nothing does not hold the connection open).
#[derive(Debug)]
pub struct AuthorityFixed<S> {
    inner: S,
    rewriter: Rewriter,
    scratch: Box<[u8]>,
    /// `scratch[start..end]`: read from the client, not yet taken by the rewriter.
    start: usize,
    end: usize,
    eof: bool,
    /// The rewriter refused the client's bytes: reported once the output before it is read.
    failed: Option<RewriteError>,
    /// The connection was ended by a refusal; every later read fails.
    dead: bool,
    /// Where the server's output is in its frames, so a GOAWAY goes between two of them.
    server_frames: FrameCursor,
    /// A GOAWAY to write before the server's next frame, and how much of it is written.
    goaway: Option<(Vec<u8>, usize)>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> AuthorityFixed<S> {
    /// Wraps an accepted connection (after its TLS handshake, if any: the rewriter reads
    /// HTTP/2, never TLS records).
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rewriter: Rewriter::new(),
            scratch: vec![0; 16 * 1024].into_boxed_slice(),
            start: 0,
            end: 0,
            eof: false,
            failed: None,
            dead: false,
            server_frames: FrameCursor::default(),
            goaway: None,
        }
    }

    /// Writes what is left of a queued GOAWAY, if the server's output is between frames.
    fn poll_goaway(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((frame, written)) = &mut self.goaway {
            if *written == 0 && !self.server_frames.at_boundary() {
                return Poll::Ready(Ok(()));
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &frame[*written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += n;
            if *written == frame.len() {
                self.goaway = None;
                return Pin::new(&mut self.inner).poll_flush(cx);
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Ends the connection for `error`: queues the client's GOAWAY, tries to write it now.
    fn refuse(&mut self, error: RewriteError, cx: &mut Context<'_>) -> io::Error {
        tracing::debug!(error = %error, "closing a unix-socket connection whose header data was refused");
        self.dead = true;
        self.goaway = Some((
            goaway_frame(
                self.rewriter.last_stream(),
                error.h2_code(),
                &error.to_string(),
            ),
            0,
        ));
        // Best effort: the server is about to drop the connection.
        let _ = self.poll_goaway(cx);
        io::Error::new(io::ErrorKind::InvalidData, error)
    }
}

/// A GOAWAY frame (RFC 9113 6.8) with `reason` as debug data (at most 256 bytes of it).
pub(crate) fn goaway_frame(last_stream: u32, code: u32, reason: &str) -> Vec<u8> {
    let debug = &reason.as_bytes()[..reason.len().min(256)];
    let len = u32::try_from(8 + debug.len()).unwrap_or(8);
    let mut frame = len.to_be_bytes()[1..].to_vec();
    frame.extend([0x7, 0]);
    frame.extend(0_u32.to_be_bytes());
    frame.extend((last_stream & 0x7fff_ffff).to_be_bytes());
    frame.extend(code.to_be_bytes());
    frame.extend(debug);
    frame
}

/// Follows a stream of HTTP/2 frames (the server's output) to know where one ends.
#[derive(Debug, Default)]
struct FrameCursor {
    header: [u8; 9],
    have: usize,
    /// Payload bytes of the current frame still to come.
    left: usize,
}

impl FrameCursor {
    fn at_boundary(&self) -> bool {
        self.have == 0 && self.left == 0
    }

    /// How many of the next bytes belong to the current frame's header or payload, at most
    /// (`usize::MAX` at a boundary).
    fn until_boundary(&self) -> usize {
        if self.at_boundary() {
            usize::MAX
        } else if self.have > 0 {
            // The header's rest and then the payload, whose length is not known yet: the header
            // only, so the length is read before going on.
            9 - self.have
        } else {
            self.left
        }
    }

    fn advance(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.left > 0 {
                let n = self.left.min(bytes.len());
                self.left -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (9 - self.have).min(bytes.len());
            self.header[self.have..self.have + n].copy_from_slice(&bytes[..n]);
            self.have += n;
            bytes = &bytes[n..];
            if self.have == 9 {
                self.have = 0;
                self.left = usize::from(self.header[0]) << 16
                    | usize::from(self.header[1]) << 8
                    | usize::from(self.header[2]);
            }
        }
    }
}

impl<S> Drop for AuthorityFixed<S> {
    fn drop(&mut self) {
        if self.rewriter.replaced() > 0 {
            tracing::debug!(
                replaced = self.rewriter.replaced(),
                "a unix-socket client sent an authority that is not one; served as localhost"
            );
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for AuthorityFixed<S> {
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
            if let Some(error) = this.failed.take() {
                return Poll::Ready(Err(this.refuse(error, cx)));
            }
            if this.dead {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "the connection was refused",
                )));
            }
            if this.start < this.end {
                match this.rewriter.feed(&this.scratch[this.start..this.end]) {
                    Ok(taken) => this.start += taken,
                    Err(error) => {
                        this.start = this.end;
                        this.failed = Some(error);
                    }
                }
                continue;
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut scratch = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut scratch))?;
            let n = scratch.filled().len();
            (this.start, this.end) = (0, n);
            if n == 0 {
                this.eof = true;
            }
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for AuthorityFixed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_goaway(cx))?;
        // With a GOAWAY waiting, only the current frame's rest goes first.
        let len = if this.goaway.is_some() {
            buf.len().min(this.server_frames.until_boundary())
        } else {
            buf.len()
        };
        let n = ready!(Pin::new(&mut this.inner).poll_write(cx, &buf[..len]))?;
        this.server_frames.advance(&buf[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_goaway(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_goaway(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_frame_cursor_follows_frames_split_anywhere() {
        let mut frames = Vec::new();
        for len in [0_usize, 6, 300, 0] {
            frames.extend(&u32::try_from(len).unwrap_or(0).to_be_bytes()[1..]);
            frames.extend([0x4, 0, 0, 0, 0, 0]);
            frames.extend(std::iter::repeat_n(7, len));
        }
        let ends = [9, 24, 333, 342];
        for step in [1, 2, 5, 9, 100] {
            let mut cursor = FrameCursor::default();
            let mut at = 0;
            while at < frames.len() {
                let n = step.min(frames.len() - at).min(cursor.until_boundary());
                cursor.advance(&frames[at..at + n]);
                at += n;
                assert_eq!(
                    cursor.at_boundary(),
                    ends.contains(&at),
                    "step {step} at {at}"
                );
            }
        }
    }

    #[test]
    fn a_goaway_names_the_last_stream_and_the_code() {
        let frame = goaway_frame(5, 0xb, "too large");
        assert_eq!(&frame[..9], &[0, 0, 17, 0x7, 0, 0, 0, 0, 0]);
        assert_eq!(&frame[9..17], &[0, 0, 0, 5, 0, 0, 0, 0xb]);
        assert_eq!(&frame[17..], b"too large");
    }
}
