//! The client-to-server half of an HTTP/2 connection, with every request's `:authority` made
//! acceptable to the server.
//!
//! Invariants:
//! - Every byte that is not part of a header block (the connection preface, every other frame,
//!   a HEADERS frame's priority fields) is passed through unchanged and in order; padding is
//!   dropped.
//! - Every header block is decoded with the client's HPACK state (so its dynamic table stays the
//!   one the client's encoder assumes) and sent on with every field as a "literal never
//!   indexed": the server's decoder table is never filled, so nothing the server decodes can
//!   depend on what this rewriter dropped, and a field the client marked sensitive stays so.
//! - A `:authority` that is not a valid URI authority (a socket path, raw or %-encoded) becomes
//!   `localhost`, what Go clients send on unix sockets; a valid one is kept.
//! - Anything this cannot follow (a broken header block, a CONTINUATION out of place, a
//!   PUSH_PROMISE, whose header block only a server may send) or will
//!   not (a header frame larger than the server's frame size, a block larger than
//!   [`MAX_BLOCK`] encoded or [`MAX_HEADER_LIST_SIZE`] decoded) is an error: the connection is
//!   closed, never passed on half rewritten.
//!
//! Bounds: per connection this holds at most one header frame ([`MAX_FRAME`] bytes), one
//! encoded block ([`MAX_BLOCK`]), the HPACK table (4 KiB), the room to decode a Huffman-coded
//! name and value (each at most 8/5 of the block's bytes while it is decoded, at most 1 KiB
//! kept between blocks, the `hpack` module) and the output waiting to be read,
//! which [`Rewriter::feed`] stops adding to at [`OUT_HIGH_WATER`] (plus at most one frame or one
//! rewritten block). The decoded size is what a header block can expand to, by 1-byte references
//! to a 4 KiB table entry (4,000x): it is counted while decoding without copying the referenced
//! entries, and a block over the bound is refused before anything of it is re-encoded beyond
//! the bound. The bound is the one hyper's HTTP/2 server applies to decoded header lists by
//! default (16 KiB, RFC 9113 6.5.2: name + value + 32 bytes per field), which the servers also
//! set explicitly, so it refuses nothing the server would have accepted. It also bounds the
//! number of fields (at most 512: 32 bytes each at least).

use std::collections::VecDeque;

use crate::hpack::DecodeError;

/// The HTTP/2 client connection preface.
const PREFACE_LEN: usize = 24;
/// Frame header length.
const FRAME_HEADER: usize = 9;
/// The largest frame every HTTP/2 server accepts (SETTINGS_MAX_FRAME_SIZE's initial value; the
/// servers do not raise it): a larger header frame is the server's FRAME_SIZE_ERROR anyway.
pub const MAX_FRAME: usize = 16_384;
/// The largest decoded header list (RFC 9113 6.5.2 size: name + value + 32 per field) this
/// passes on; hyper's HTTP/2 server default, and the servers' `http2_max_header_list_size`.
/// A gRPC request's headers are a few hundred bytes.
pub const MAX_HEADER_LIST_SIZE: usize = 16 * 1024;
/// The largest encoded header block (all its frames) this buffers. A field encoded as any sane
/// encoder does (Huffman only where shorter) takes fewer bytes than its decoded size counts
/// (the 32 cover its length prefixes), so a block within [`MAX_HEADER_LIST_SIZE`] decoded fits;
/// the rest is room for table size updates.
pub const MAX_BLOCK: usize = MAX_HEADER_LIST_SIZE + 1024;
/// [`Rewriter::feed`] takes no more input while this many rewritten bytes wait to be read.
pub const OUT_HIGH_WATER: usize = 32 * 1024;
/// The dynamic table size the server's SETTINGS allow (the protocol's initial value; tonic's
/// server does not change it).
const TABLE_SIZE: usize = 4096;

const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
/// A server's frame only (RFC 9113 8.4): it carries a header block this rewriter would have
/// to follow, and a server treats it from a client as a connection error.
const PUSH_PROMISE: u8 = 0x5;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// The authority sent in place of one the server would refuse.
pub const REPLACEMENT: &str = "localhost";

/// Why a connection's bytes could not be followed.
#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    #[error("HTTP/2 HEADERS frame on stream {stream} has padding longer than its payload")]
    Padding { stream: u32 },
    #[error("HTTP/2 HEADERS frame on stream {stream} is too short for its priority fields")]
    Priority { stream: u32 },
    #[error(
        "HTTP/2 frame of type {kind:#x} on stream {stream} while a header block of stream {open} is open"
    )]
    Interleaved { kind: u8, stream: u32, open: u32 },
    #[error("HTTP/2 CONTINUATION on stream {stream} without an open header block")]
    StrayContinuation { stream: u32 },
    #[error("HTTP/2 PUSH_PROMISE on stream {stream} from a client")]
    PushPromise { stream: u32 },
    #[error("HTTP/2 header frame on stream {stream} has {len} bytes, more than {MAX_FRAME}")]
    FrameTooLarge { stream: u32, len: usize },
    #[error("HTTP/2 header block on stream {stream} exceeds {MAX_BLOCK} bytes")]
    BlockTooLarge { stream: u32 },
    #[error("HTTP/2 header list on stream {stream} exceeds {MAX_HEADER_LIST_SIZE} bytes decoded")]
    HeaderListTooLarge { stream: u32 },
    #[error("HPACK header block on stream {stream} cannot be decoded: {reason}")]
    Hpack { stream: u32, reason: String },
}

impl RewriteError {
    /// The HTTP/2 error code (RFC 9113 7) a GOAWAY answering this carries: a bound refused is
    /// ENHANCE_YOUR_CALM (gRPC clients report RESOURCE_EXHAUSTED), an undecodable block
    /// COMPRESSION_ERROR, a frame too large FRAME_SIZE_ERROR, the rest PROTOCOL_ERROR.
    pub fn h2_code(&self) -> u32 {
        match self {
            Self::BlockTooLarge { .. } | Self::HeaderListTooLarge { .. } => 0xb,
            Self::Hpack { .. } => 0x9,
            Self::FrameTooLarge { .. } => 0x6,
            Self::Padding { .. }
            | Self::Priority { .. }
            | Self::Interleaved { .. }
            | Self::StrayContinuation { .. }
            | Self::PushPromise { .. } => 0x1,
        }
    }
}

/// A header block being gathered from HEADERS and CONTINUATION frames.
#[derive(Debug)]
struct OpenBlock {
    stream: u32,
    end_stream: bool,
    /// The HEADERS frame's stream dependency and weight, passed on as they came.
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// The rewriting state of one connection's client-to-server bytes.
pub struct Rewriter {
    preface_left: usize,
    /// Bytes of a passed-through frame's payload still to come.
    passthrough_left: usize,
    /// A frame header, and for header frames their payload, being gathered.
    frame: Vec<u8>,
    block: Option<OpenBlock>,
    decoder: crate::hpack::Decoder,
    out: VecDeque<u8>,
    replaced: u64,
    /// The highest stream whose header block was passed on (a GOAWAY's last stream).
    last_stream: u32,
}

impl std::fmt::Debug for Rewriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rewriter")
            .field("preface_left", &self.preface_left)
            .field("passthrough_left", &self.passthrough_left)
            .field("pending_out", &self.out.len())
            .field("replaced", &self.replaced)
            .finish_non_exhaustive()
    }
}

impl Default for Rewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl Rewriter {
    /// A rewriter at the start of a connection.
    pub fn new() -> Self {
        Self {
            preface_left: PREFACE_LEN,
            passthrough_left: 0,
            frame: Vec::with_capacity(FRAME_HEADER),
            block: None,
            decoder: crate::hpack::Decoder::new(TABLE_SIZE),
            out: VecDeque::new(),
            replaced: 0,
            last_stream: 0,
        }
    }

    /// How many `:authority` values were replaced so far.
    pub fn replaced(&self) -> u64 {
        self.replaced
    }

    /// The highest stream whose header block was passed on to the server.
    pub fn last_stream(&self) -> u32 {
        self.last_stream
    }

    /// How many rewritten bytes wait to be read.
    pub fn pending(&self) -> usize {
        self.out.len()
    }

    /// Moves up to `buf.len()` rewritten bytes into `buf`; how many.
    pub fn read_into(&mut self, buf: &mut [u8]) -> usize {
        let n = buf.len().min(self.out.len());
        for (slot, byte) in buf.iter_mut().zip(self.out.drain(..n)) {
            *slot = byte;
        }
        n
    }

    /// Takes the client's next bytes, as many as it can while fewer than [`OUT_HIGH_WATER`]
    /// rewritten bytes wait to be read; how many it took. The caller keeps the rest and offers
    /// it again once it read some output.
    pub fn feed(&mut self, input: &[u8]) -> Result<usize, RewriteError> {
        let total = input.len();
        let mut input = input;
        while !input.is_empty() && self.out.len() < OUT_HIGH_WATER {
            if self.preface_left > 0 || self.passthrough_left > 0 {
                let left = if self.preface_left > 0 {
                    &mut self.preface_left
                } else {
                    &mut self.passthrough_left
                };
                let n = (*left).min(input.len());
                self.out.extend(&input[..n]);
                *left -= n;
                input = &input[n..];
                continue;
            }
            let wanted = if self.frame.len() < FRAME_HEADER {
                FRAME_HEADER
            } else {
                FRAME_HEADER + payload_len(&self.frame)
            };
            let n = (wanted - self.frame.len()).min(input.len());
            self.frame.extend_from_slice(&input[..n]);
            input = &input[n..];
            self.step()?;
        }
        Ok(total - input.len())
    }

    /// Acts on a gathered frame header or header frame, if complete.
    fn step(&mut self) -> Result<(), RewriteError> {
        if self.frame.len() < FRAME_HEADER {
            return Ok(());
        }
        let (len, kind, stream) = (
            payload_len(&self.frame),
            self.frame[3],
            stream_of(&self.frame),
        );
        if kind == PUSH_PROMISE {
            // Its header block would change the client's HPACK table behind this rewriter's
            // back; no server accepts one from a client anyway.
            return Err(RewriteError::PushPromise { stream });
        }
        if kind != HEADERS && kind != CONTINUATION {
            if let Some(open) = &self.block {
                return Err(RewriteError::Interleaved {
                    kind,
                    stream,
                    open: open.stream,
                });
            }
            self.out.extend(&self.frame);
            self.frame.clear();
            self.passthrough_left = len;
            return Ok(());
        }
        if len > MAX_FRAME {
            return Err(RewriteError::FrameTooLarge { stream, len });
        }
        if self.frame.len() < FRAME_HEADER + len {
            return Ok(());
        }
        let frame = std::mem::take(&mut self.frame);
        self.header_frame(kind, frame[4], stream, &frame[FRAME_HEADER..])?;
        self.frame = frame;
        self.frame.clear();
        Ok(())
    }

    fn header_frame(
        &mut self,
        kind: u8,
        flags: u8,
        stream: u32,
        mut payload: &[u8],
    ) -> Result<(), RewriteError> {
        if kind == HEADERS {
            if let Some(open) = &self.block {
                return Err(RewriteError::Interleaved {
                    kind,
                    stream,
                    open: open.stream,
                });
            }
            if flags & PADDED != 0 {
                let (&pad, rest) = payload
                    .split_first()
                    .ok_or(RewriteError::Padding { stream })?;
                let keep = rest
                    .len()
                    .checked_sub(usize::from(pad))
                    .ok_or(RewriteError::Padding { stream })?;
                payload = &rest[..keep];
            }
            let mut priority = None;
            if flags & PRIORITY != 0 {
                // Stream dependency and weight: not part of the block; the server checks them
                // (a stream depending on itself is an error), so they go on unchanged.
                let (fields, rest) = payload
                    .split_first_chunk::<5>()
                    .ok_or(RewriteError::Priority { stream })?;
                priority = Some(*fields);
                payload = rest;
            }
            self.block = Some(OpenBlock {
                stream,
                end_stream: flags & END_STREAM != 0,
                priority,
                fragment: payload.to_vec(),
            });
        } else {
            match &mut self.block {
                Some(open) if open.stream == stream => {
                    if open.fragment.len() + payload.len() > MAX_BLOCK {
                        return Err(RewriteError::BlockTooLarge { stream });
                    }
                    open.fragment.extend_from_slice(payload);
                }
                _ => return Err(RewriteError::StrayContinuation { stream }),
            }
        }
        if flags & END_HEADERS != 0 {
            let open = self.block.take().expect("a header block was opened above");
            self.finish(open)?;
        }
        Ok(())
    }

    /// Decodes a complete block and emits it re-encoded, split into frames the server accepts.
    ///
    /// Fields are re-encoded as they are decoded, while the decoded size stays within
    /// [`MAX_HEADER_LIST_SIZE`]; the first field past it stops the block (a reference into the
    /// table is borrowed, not copied), so a refused block costs no more than the bound.
    fn finish(&mut self, open: OpenBlock) -> Result<(), RewriteError> {
        let mut block = Vec::with_capacity(open.fragment.len().min(MAX_HEADER_LIST_SIZE) + 16);
        let mut size = 0_usize;
        let mut replaced = 0;
        self.decoder
            .decode(&open.fragment, |name, value| {
                let value: &[u8] = if name == b":authority" && !valid_authority(value) {
                    replaced += 1;
                    REPLACEMENT.as_bytes()
                } else {
                    value
                };
                size = size.saturating_add(name.len() + value.len() + 32);
                if size > MAX_HEADER_LIST_SIZE {
                    return Err(());
                }
                encode_never_indexed(&mut block, name, value);
                Ok(())
            })
            .map_err(|e| match e {
                DecodeError::Stopped(()) => RewriteError::HeaderListTooLarge {
                    stream: open.stream,
                },
                DecodeError::Malformed(e) => RewriteError::Hpack {
                    stream: open.stream,
                    reason: e.to_string(),
                },
            })?;
        self.replaced += replaced;
        self.last_stream = self.last_stream.max(open.stream);
        // The first frame carries the priority fields, if any, before its part of the block.
        let prefix: &[u8] = open.priority.as_ref().map_or(&[], |p| &p[..]);
        let (first, rest) = block.split_at(block.len().min(MAX_FRAME - prefix.len()));
        let mut chunks = rest.chunks(MAX_FRAME).peekable();
        let mut flags = if open.end_stream { END_STREAM } else { 0 };
        if open.priority.is_some() {
            flags |= PRIORITY;
        }
        if chunks.peek().is_none() {
            flags |= END_HEADERS;
        }
        self.emit_frame(HEADERS, flags, open.stream, &[prefix, first]);
        while let Some(chunk) = chunks.next() {
            let flags = if chunks.peek().is_none() {
                END_HEADERS
            } else {
                0
            };
            self.emit_frame(CONTINUATION, flags, open.stream, &[chunk]);
        }
        Ok(())
    }

    /// Emits a frame whose payload is `parts` one after the other.
    fn emit_frame(&mut self, kind: u8, flags: u8, stream: u32, parts: &[&[u8]]) {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let len = u32::try_from(len).expect("frames are at most MAX_FRAME bytes");
        self.out.extend(&len.to_be_bytes()[1..]);
        self.out.push_back(kind);
        self.out.push_back(flags);
        self.out.extend(&(stream & 0x7fff_ffff).to_be_bytes());
        for part in parts {
            self.out.extend(*part);
        }
    }
}

fn payload_len(frame: &[u8]) -> usize {
    usize::from(frame[0]) << 16 | usize::from(frame[1]) << 8 | usize::from(frame[2])
}

fn stream_of(frame: &[u8]) -> u32 {
    u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff
}

/// Whether the server's HTTP stack takes `value` as an authority.
pub fn valid_authority(value: &[u8]) -> bool {
    !value.is_empty() && http::uri::Authority::try_from(value).is_ok()
}

/// RFC 7541 6.2.3: literal header field never indexed, new name, no Huffman coding.
fn encode_never_indexed(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x10);
    encode_string(out, name);
    encode_string(out, value);
}

fn encode_string(out: &mut Vec<u8>, s: &[u8]) {
    encode_integer(out, 0x00, 7, s.len());
    out.extend_from_slice(s);
}

/// RFC 7541 5.1: an integer with an `prefix_bits`-bit prefix, `first` holding the high bits.
pub(crate) fn encode_integer(out: &mut Vec<u8>, first: u8, prefix_bits: u32, mut value: usize) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.push(first | u8::try_from(value).expect("below the prefix maximum"));
        return;
    }
    out.push(first | u8::try_from(max).expect("a prefix of at most 7 bits"));
    value -= max;
    while value >= 128 {
        out.push(u8::try_from(value % 128).expect("below 128") | 0x80);
        value /= 128;
    }
    out.push(u8::try_from(value).expect("below 128"));
}

#[cfg(test)]
#[path = "rewrite_tests.rs"]
mod tests;
