//! The authority rewriter (`pillar_grpc_unix::rewrite`) against the HTTP/2 stack tonic serves
//! with: a differential oracle.
//!
//! The input is a client's bytes after the connection preface (the first input byte chooses
//! how the bytes are split into reads). Properties:
//! - Differential: h2's frame codec (HPACK included) decodes from the rewritten stream the same
//!   frames as from the original, `:authority` aside (kept when valid, `localhost` where not);
//!   a frame the rewriter passes on is one h2 decodes alike, and where the rewriter refuses
//!   (an error: the connection is closed), what it passed on before is such a prefix.
//! - The output does not depend on how the input is split into reads.
//! - Bounded: the output waiting to be read never exceeds what `feed` promises.
//!
//! The differential part needs h2's frame codec (feature `h2`, on in the fuzz targets); the
//! replay test of the root workspace checks the others.

use pillar_grpc_unix::rewrite::{
    MAX_FRAME, MAX_HEADER_LIST_SIZE, OUT_HIGH_WATER, RewriteError, Rewriter,
};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Most a single `feed` step can add to the output beyond the high water: a whole rewritten
/// block in frames, or a frame header and a read's worth of passed-through payload.
const STEP_MAX: usize = MAX_HEADER_LIST_SIZE + 2 * MAX_FRAME;

pub fn check(data: &[u8]) {
    let Some((&split, input)) = data.split_first() else {
        return;
    };
    let mut stream = PREFACE.to_vec();
    stream.extend(input);
    let read = usize::from(split) * 16 + 1;
    let (out, refused) = rewrite(&stream, read);
    let (whole, whole_refused) = rewrite(&stream, stream.len());
    assert_eq!(out, whole, "the output depends on how the input is read");
    assert_eq!(refused.is_some(), whole_refused.is_some());
    assert!(out.len() >= PREFACE.len() && out[..PREFACE.len()] == *PREFACE);

    #[cfg(feature = "h2")]
    {
        let original = differential::decode(&stream[PREFACE.len()..]);
        let rewritten = differential::decode(&out[PREFACE.len()..]);
        differential::compare(&original, &rewritten, refused.as_ref());
    }
}

/// Feeds `stream` in reads of `read` bytes, reading all output after each; (output, refusal).
fn rewrite(stream: &[u8], read: usize) -> (Vec<u8>, Option<RewriteError>) {
    let mut r = Rewriter::new();
    let mut out = Vec::new();
    let mut buf = vec![0; 4096];
    for mut piece in stream.chunks(read) {
        while !piece.is_empty() {
            match r.feed(piece) {
                Ok(taken) => piece = &piece[taken..],
                Err(e) => return (drain(&mut r, &mut out, &mut buf), Some(e)),
            }
            assert!(
                r.pending() <= OUT_HIGH_WATER + STEP_MAX,
                "{} bytes of output wait",
                r.pending()
            );
            let n = r.read_into(&mut buf);
            out.extend(&buf[..n]);
        }
    }
    (drain(&mut r, &mut out, &mut buf), None)
}

fn drain(r: &mut Rewriter, out: &mut Vec<u8>, buf: &mut [u8]) -> Vec<u8> {
    while r.pending() > 0 {
        let n = r.read_into(buf);
        out.extend(&buf[..n]);
    }
    std::mem::take(out)
}

/// What h2's frame codec decodes from either stream, compared.
#[cfg(feature = "h2")]
mod differential {
    use std::io;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use futures::StreamExt;
    use h2::frame::Frame;
    use pillar_grpc_unix::rewrite::{REPLACEMENT, RewriteError, valid_authority};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

    /// What h2 decoded: a frame (normalised, its authority apart) or where it stopped.
    #[derive(Debug, PartialEq)]
    pub(super) enum Decoded {
        Frame {
            frame: String,
            authority: Option<Vec<u8>>,
        },
        Error,
    }

    /// What an HTTP/2 server's codec decodes from a client's frames, up to its first error.
    pub(super) fn decode(frames: &[u8]) -> Vec<Decoded> {
        let mut codec: h2::Codec<Memory, bytes::Bytes> = h2::Codec::new(Memory {
            data: frames.to_vec(),
            at: 0,
        });
        let mut out = Vec::new();
        futures::executor::block_on(async {
            while let Some(item) = codec.next().await {
                match item {
                    Ok(frame) => out.push(normalise(frame)),
                    Err(_) => {
                        out.push(Decoded::Error);
                        break;
                    }
                }
            }
        });
        out
    }

    fn normalise(frame: Frame) -> Decoded {
        match frame {
            Frame::Headers(h) => {
                let (id, end_stream, over_size) =
                    (h.stream_id(), h.is_end_stream(), h.is_over_size());
                let (mut pseudo, fields) = h.into_parts();
                let authority = pseudo
                    .authority
                    .take()
                    .map(|a| AsRef::<[u8]>::as_ref(&a).to_vec());
                Decoded::Frame {
                    frame: format!(
                        "HEADERS {id:?} end={end_stream} over={over_size} {pseudo:?} {fields:?}"
                    ),
                    authority,
                }
            }
            other => Decoded::Frame {
                frame: format!("{other:?}"),
                authority: None,
            },
        }
    }

    pub(super) fn compare(
        original: &[Decoded],
        rewritten: &[Decoded],
        refused: Option<&RewriteError>,
    ) {
        for (i, (o, r)) in original.iter().zip(rewritten).enumerate() {
            match (o, r) {
                (Decoded::Error, Decoded::Error) => return,
                (
                    Decoded::Frame {
                        frame: of,
                        authority: oa,
                    },
                    Decoded::Frame {
                        frame: rf,
                        authority: ra,
                    },
                ) => {
                    assert_eq!(of, rf, "frame {i} differs");
                    let expected = oa.as_ref().map(|a| {
                        if valid_authority(a) {
                            a.clone()
                        } else {
                            REPLACEMENT.as_bytes().to_vec()
                        }
                    });
                    assert_eq!(&expected, ra, "frame {i}'s authority");
                }
                // The rewriter stopped (its output ends mid-frame or not at all) where h2 went on:
                // only where it refused.
                (Decoded::Frame { .. }, Decoded::Error) => {
                    assert!(
                        refused.is_some(),
                        "frame {i}: h2 cannot decode the rewritten {o:?}"
                    );
                    return;
                }
                // h2 refuses a block whose authority is not UTF-8 (or not a valid value); the
                // rewriter replaces such an authority by design: the only difference h2 may see.
                // Nothing after it can be compared (h2 stopped at the original's).
                (Decoded::Error, Decoded::Frame { authority, .. })
                    if authority.as_deref() == Some(REPLACEMENT.as_bytes()) =>
                {
                    return;
                }
                (Decoded::Error, Decoded::Frame { .. }) => {
                    panic!("frame {i}: h2 refuses the original but decodes the rewritten {r:?}")
                }
            }
        }
        if refused.is_none() {
            // Nothing dropped: h2 decodes as many frames from either (a trailing partial frame is
            // held back by the rewriter and an error for h2, which ends the original's list).
            let complete = |d: &[Decoded]| d.iter().filter(|x| **x != Decoded::Error).count();
            assert_eq!(
                complete(original),
                complete(rewritten),
                "the rewriter dropped frames: {original:?} vs {rewritten:?}"
            );
        }
    }

    /// An in-memory connection: reads `data`, then the end; writes go nowhere.
    struct Memory {
        data: Vec<u8>,
        at: usize,
    }

    impl AsyncRead for Memory {
        fn poll_read(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let this = self.get_mut();
            let n = buf.remaining().min(this.data.len() - this.at);
            buf.put_slice(&this.data[this.at..this.at + n]);
            this.at += n;
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for Memory {
        fn poll_write(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }
}
