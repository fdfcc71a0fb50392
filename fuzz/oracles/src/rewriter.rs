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
        let split = || differential::decode_coalesced(&stream[PREFACE.len()..]);
        differential::compare(&original, &rewritten, refused.as_ref(), split);
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
        decode_with(h2::Codec::new(Memory {
            data: frames.to_vec(),
            at: 0,
        }))
    }

    /// What h2 decodes from `frames` once each header block split over HEADERS and
    /// CONTINUATION frames is joined into one HEADERS frame (padding dropped, nothing else
    /// changed), with frames of any size allowed.
    ///
    /// Why: h2 0.4 forgives a malformed field (a pseudo-header after a regular one, a
    /// connection-specific header) decoded in a fragment that ends mid-field:
    /// `HeaderBlock::load` returns on the decoder's "need more" before it looks at its
    /// `malformed` flag, and the next fragment starts with a fresh one. The rewriter decodes
    /// the whole block and re-encodes it, so the same fields may reach h2 in one fragment,
    /// which h2 refuses (a stream reset). Joined, the original is refused as well: that is the
    /// one refusal of the rewritten stream the oracle accepts without the rewriter refusing.
    pub(super) fn decode_coalesced(frames: &[u8]) -> Vec<Decoded> {
        decode_with(h2::Codec::with_max_recv_frame_size(
            Memory {
                data: coalesce(frames),
                at: 0,
            },
            MAX_FRAME_SIZE,
        ))
    }

    /// HTTP/2's largest frame payload (2^24 - 1, RFC 9113 4.2).
    const MAX_FRAME_SIZE: usize = (1 << 24) - 1;

    const HEADERS: u8 = 0x1;
    const CONTINUATION: u8 = 0x9;
    const END_HEADERS: u8 = 0x4;
    const PADDED: u8 = 0x8;

    /// `frames` with every header block in one HEADERS frame. Stops joining (and copies the
    /// rest as it is) where the frames stop making sense: h2 stops there in both streams.
    pub(super) fn coalesce(frames: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(frames.len());
        // The header block being joined: its frame header (type, flags, stream) and payload.
        let mut open: Option<([u8; 6], Vec<u8>)> = None;
        let mut at = 0;
        while let Some(head) = frames.get(at..at + 9) {
            let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let Some(payload) = frames.get(at + 9..at + 9 + len) else {
                break;
            };
            let (kind, flags) = (head[3], head[4]);
            match (&mut open, kind) {
                (None, HEADERS) if flags & END_HEADERS == 0 => {
                    let Some(block) = unpadded(flags, payload) else {
                        break;
                    };
                    let mut kept = [0; 6];
                    kept.copy_from_slice(&head[3..9]);
                    kept[1] = (flags | END_HEADERS) & !PADDED;
                    open = Some((kept, block.to_vec()));
                }
                (Some((_, block)), CONTINUATION) => {
                    block.extend_from_slice(payload);
                    if flags & END_HEADERS != 0 {
                        if let Some((kept, block)) = open.take() {
                            push_frame(&mut out, &kept, &block);
                        }
                    }
                }
                (Some(_), _) => break,
                (None, _) => out.extend_from_slice(&frames[at..at + 9 + len]),
            }
            at += 9 + len;
        }
        if let Some((kept, block)) = open {
            // An unfinished block: as h2 would see it, a HEADERS frame still waiting.
            let mut waiting = kept;
            waiting[1] &= !END_HEADERS;
            push_frame(&mut out, &waiting, &block);
        }
        out.extend_from_slice(frames.get(at..).unwrap_or_default());
        out
    }

    /// A HEADERS payload without its padding (`None` where the padding does not fit: h2
    /// refuses that frame in both streams).
    fn unpadded(flags: u8, payload: &[u8]) -> Option<&[u8]> {
        if flags & PADDED == 0 {
            return Some(payload);
        }
        let (&pad, rest) = payload.split_first()?;
        rest.get(..rest.len().checked_sub(usize::from(pad))?)
    }

    fn push_frame(out: &mut Vec<u8>, kept: &[u8; 6], payload: &[u8]) {
        let len = payload.len().min(MAX_FRAME_SIZE);
        out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8]);
        out.extend_from_slice(kept);
        out.extend_from_slice(&payload[..len]);
    }

    fn decode_with(mut codec: h2::Codec<Memory, bytes::Bytes>) -> Vec<Decoded> {
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

    /// `joined` decodes the original with its header blocks joined ([`decode_coalesced`]),
    /// run only where h2 refuses a rewritten frame it decoded from the original.
    pub(super) fn compare(
        original: &[Decoded],
        rewritten: &[Decoded],
        refused: Option<&RewriteError>,
        joined: impl FnOnce() -> Vec<Decoded>,
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
                        refused.is_some() || joined().get(i) == Some(&Decoded::Error),
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

#[cfg(all(test, feature = "h2"))]
mod tests {
    use super::differential::{Decoded, coalesce, decode, decode_coalesced};
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// A request whose block puts `:path` after a regular field (malformed, RFC 9113 8.3), split
    /// over HEADERS and CONTINUATION in the middle of a later field.
    fn split_malformed_request() -> Vec<u8> {
        // :method GET, :scheme http (static 2, 6), a: b (literal), :path / (static 4: after a
        // regular field), then x: yz, cut after its value's length.
        let block: &[u8] = &[
            0x82, 0x86, 0x00, 1, b'a', 1, b'b', 0x84, 0x00, 1, b'x', 2, b'y', b'z',
        ];
        let (first, rest) = block.split_at(12);
        let mut stream = frame(0x4, 0, 0, &[]); // SETTINGS
        stream.extend(frame(0x1, 0x1, 1, first)); // HEADERS, END_STREAM, no END_HEADERS
        stream.extend(frame(0x9, 0x4, 1, rest)); // CONTINUATION, END_HEADERS
        stream
    }

    #[test]
    fn h2_forgives_a_malformed_block_split_mid_field_and_the_oracle_allows_only_that() {
        let stream = split_malformed_request();
        // h2 decodes the split block but refuses the same block in one frame.
        let split = decode(&stream);
        assert!(
            matches!(split.get(1), Some(Decoded::Frame { .. })),
            "{split:?}"
        );
        let joined = decode_coalesced(&stream);
        assert_eq!(joined.get(1), Some(&Decoded::Error), "{joined:?}");
        // The whole check passes (the input's first byte picks the read size).
        let mut input = vec![0];
        input.extend(&stream);
        check(&input);
    }

    #[test]
    fn joining_a_block_keeps_every_byte_of_it_and_drops_only_the_padding() {
        let mut stream = frame(0x1, 0x8, 3, &[2, 0x82, 0x86, 0, 0]); // PADDED, 2 bytes of padding
        stream.extend(frame(0x9, 0, 3, &[0x84]));
        stream.extend(frame(0x9, 0x4, 3, &[0x41, 1, b'h']));
        stream.extend(frame(0x8, 0, 0, &[0, 0, 0, 1])); // WINDOW_UPDATE, copied as it is
        let mut expected = frame(0x1, 0x4, 3, &[0x82, 0x86, 0x84, 0x41, 1, b'h']);
        expected.extend(frame(0x8, 0, 0, &[0, 0, 0, 1]));
        assert_eq!(coalesce(&stream), expected);
    }

    #[test]
    fn a_well_formed_split_block_decodes_alike_joined() {
        let block: &[u8] = &[
            0x82, 0x86, 0x84, 0x41, 9, b'l', b'o', b'c', b'a', b'l', b'h', b'o', b's', b't',
        ];
        let (first, rest) = block.split_at(5);
        let mut stream = frame(0x1, 0x1, 1, first);
        stream.extend(frame(0x9, 0x4, 1, rest));
        assert_eq!(decode(&stream), decode_coalesced(&stream));
        assert!(matches!(
            decode(&stream).first(),
            Some(Decoded::Frame { .. })
        ));
    }
}
