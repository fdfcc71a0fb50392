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
//! - Anything this cannot follow (a broken header block, a CONTINUATION out of place) or will
//!   not (a header frame larger than the server's frame size, a block larger than
//!   [`MAX_BLOCK`] encoded or [`MAX_HEADER_LIST_SIZE`] decoded) is an error: the connection is
//!   closed, never passed on half rewritten.
//!
//! Bounds: per connection this holds at most one header frame ([`MAX_FRAME`] bytes), one
//! encoded block ([`MAX_BLOCK`]), the HPACK table (4 KiB) and the output waiting to be read,
//! which [`Rewriter::feed`] stops adding to at [`OUT_HIGH_WATER`] (plus at most one frame or one
//! rewritten block). The decoded size is what a header block can expand to, by 1-byte references
//! to a 4 KiB table entry (4,000x): it is counted while decoding without copying the referenced
//! entries, and a block over the bound is refused before anything of it is re-encoded beyond
//! the bound. The bound is the one hyper's HTTP/2 server applies to decoded header lists by
//! default (16 KiB, RFC 9113 6.5.2: name + value + 32 bytes per field), which the servers also
//! set explicitly, so it refuses nothing the server would have accepted. It also bounds the
//! number of fields (at most 512: 32 bytes each at least).

use std::collections::VecDeque;

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
            | Self::StrayContinuation { .. } => 0x1,
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
    decoder: loona_hpack::Decoder<'static>,
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
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        Self {
            preface_left: PREFACE_LEN,
            passthrough_left: 0,
            frame: Vec::with_capacity(FRAME_HEADER),
            block: None,
            decoder,
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
    /// [`MAX_HEADER_LIST_SIZE`]; past it the rest is only counted (a reference into the table is
    /// borrowed, not copied), so a refused block costs no more than the bound.
    fn finish(&mut self, open: OpenBlock) -> Result<(), RewriteError> {
        size_updates_first(&open.fragment).map_err(|reason| RewriteError::Hpack {
            stream: open.stream,
            reason: reason.to_owned(),
        })?;
        let mut block = Vec::with_capacity(open.fragment.len().min(MAX_HEADER_LIST_SIZE) + 16);
        let mut size = 0_usize;
        let mut replaced = 0;
        self.decoder
            .decode_with_cb(&open.fragment, |name, value| {
                if size > MAX_HEADER_LIST_SIZE {
                    return;
                }
                let value: &[u8] = if *name == *b":authority" && !valid_authority(&value) {
                    replaced += 1;
                    REPLACEMENT.as_bytes()
                } else {
                    &value
                };
                size = size.saturating_add(name.len() + value.len() + 32);
                if size <= MAX_HEADER_LIST_SIZE {
                    encode_never_indexed(&mut block, &name, value);
                }
            })
            .map_err(|e| RewriteError::Hpack {
                stream: open.stream,
                reason: format!("{e:?}"),
            })?;
        if size > MAX_HEADER_LIST_SIZE {
            return Err(RewriteError::HeaderListTooLarge {
                stream: open.stream,
            });
        }
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

/// RFC 7541 4.2: a dynamic table size update only at the beginning of a block. The decoder
/// used here takes one anywhere (the server's refuses it), so the block's representations are
/// walked first: their kinds and lengths only, nothing decoded. A block this cannot walk is
/// left to the decoder to refuse.
fn size_updates_first(block: &[u8]) -> Result<(), &'static str> {
    let mut rest = block;
    let mut fields = false;
    while let Some(&first) = rest.first() {
        let (prefix, strings) = match first {
            0x80.. => (7, 0),      // indexed field
            0x40..=0x7f => (6, 2), // literal with incremental indexing
            0x20..=0x3f if fields => return Err("dynamic table size update after a field"),
            0x20..=0x3f => (5, 0), // dynamic table size update
            _ => (4, 2),           // literal without indexing, never indexed
        };
        let Some((index, used)) = decode_integer(rest, prefix) else {
            return Ok(());
        };
        rest = &rest[used..];
        fields |= first & 0xe0 != 0x20;
        // A literal names its field by index, or by a string when the index is 0.
        let strings = if strings == 2 && index != 0 {
            1
        } else {
            strings
        };
        for _ in 0..strings {
            let Some((len, used)) = decode_integer(rest, 7) else {
                return Ok(());
            };
            let Some(after) = used.checked_add(len).and_then(|end| rest.get(end..)) else {
                return Ok(());
            };
            rest = after;
        }
    }
    Ok(())
}

/// RFC 7541 5.1: an integer with a `prefix_bits`-bit prefix at the start of `bytes`; (value,
/// bytes used), or None where truncated or beyond `usize`.
fn decode_integer(bytes: &[u8], prefix_bits: u32) -> Option<(usize, usize)> {
    let max = (1_usize << prefix_bits) - 1;
    let mut value = usize::from(*bytes.first()?) & max;
    if value < max {
        return Some((value, 1));
    }
    for (i, &byte) in bytes.iter().enumerate().skip(1) {
        let shift = u32::try_from(7 * (i - 1)).ok()?;
        let part = usize::from(byte & 0x7f).checked_shl(shift)?;
        if shift >= usize::BITS || part >> shift != usize::from(byte & 0x7f) {
            return None;
        }
        value = value.checked_add(part)?;
        if byte & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
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
fn encode_integer(out: &mut Vec<u8>, first: u8, prefix_bits: u32, mut value: usize) {
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
mod tests {
    use super::*;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = u32::try_from(payload.len()).unwrap().to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        f
    }

    /// RFC 7541 6.2.1, literal with incremental indexing, new name.
    fn indexed_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
        out.push(0x40);
        encode_string(out, name);
        encode_string(out, value);
    }

    /// A request's block as a C-core client sends it: fields added to the dynamic table.
    fn request_block(authority: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.push(0x83); // :method POST (static 3)
        b.push(0x86); // :scheme http (static 6)
        indexed_literal(&mut b, b":path", b"/csi.v1.Identity/GetPluginInfo");
        indexed_literal(&mut b, b":authority", authority);
        indexed_literal(&mut b, b"content-type", b"application/grpc");
        indexed_literal(&mut b, b"te", b"trailers");
        b
    }

    /// The frames the rewriter emits, split back into (kind, flags, stream, payload).
    fn frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len = payload_len(bytes);
            out.push((
                bytes[3],
                bytes[4],
                stream_of(bytes),
                bytes[9..9 + len].to_vec(),
            ));
            bytes = &bytes[9 + len..];
        }
        out
    }

    fn run(input: &[u8], chunk: usize) -> Result<(Vec<u8>, u64), RewriteError> {
        let mut r = Rewriter::new();
        let mut out = Vec::new();
        let mut buf = vec![0; 4096];
        for mut piece in input.chunks(chunk) {
            while !piece.is_empty() {
                let taken = r.feed(piece)?;
                piece = &piece[taken..];
                assert!(r.pending() <= OUT_HIGH_WATER + MAX_FRAME + FRAME_HEADER);
                let n = r.read_into(&mut buf);
                out.extend(&buf[..n]);
            }
        }
        while r.pending() > 0 {
            let n = r.read_into(&mut buf);
            out.extend(&buf[..n]);
        }
        Ok((out, r.replaced()))
    }

    fn decode_all(decoder: &mut loona_hpack::Decoder<'_>, payload: &[u8]) -> Vec<(String, String)> {
        decoder
            .decode(payload)
            .unwrap()
            .into_iter()
            .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
            .collect()
    }

    #[test]
    fn a_socket_path_authority_becomes_localhost_and_everything_else_passes_unchanged() {
        let settings = frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100]);
        let data = frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 0]);
        // The second request refers to the first one's dynamic table entries (62.. = newest
        // first: te, content-type, :authority, :path), as a real client's encoder does.
        let second = [0x83, 0x86, 0xc1, 0xc0, 0xbf, 0xbe];
        let mut input = PREFACE.to_vec();
        input.extend(&settings);
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            1,
            &request_block(b"/run/csi/csi.sock"),
        ));
        input.extend(&data);
        input.extend(frame(HEADERS, END_HEADERS, 3, &second));
        for chunk in [1, 7, 4096] {
            let (out, replaced) = run(&input, chunk).unwrap();
            assert_eq!(replaced, 2, "chunk {chunk}");
            assert_eq!(&out[..24], PREFACE);
            let got = frames(&out[24..]);
            assert_eq!(got.len(), 4);
            assert_eq!(frame(got[0].0, got[0].1, got[0].2, &got[0].3), settings);
            assert_eq!(frame(got[2].0, got[2].1, got[2].2, &got[2].3), data);
            // The server's decoder, fresh: it sees full requests, localhost for the path.
            let mut server = loona_hpack::Decoder::new();
            for (i, stream) in [(1, 1), (3, 3)] {
                let (kind, flags, s, payload) = &got[i];
                assert_eq!((*kind, *flags, *s), (HEADERS, END_HEADERS, stream));
                assert_eq!(
                    decode_all(&mut server, payload),
                    [
                        (":method", "POST"),
                        (":scheme", "http"),
                        (":path", "/csi.v1.Identity/GetPluginInfo"),
                        (":authority", "localhost"),
                        ("content-type", "application/grpc"),
                        ("te", "trailers"),
                    ]
                    .map(|(n, v)| (n.to_owned(), v.to_owned()))
                );
            }
        }
    }

    #[test]
    fn a_valid_authority_is_kept() {
        for authority in [&b"localhost"[..], b"csi.sock", b"127.0.0.1:9000"] {
            let mut input = PREFACE.to_vec();
            input.extend(frame(
                HEADERS,
                END_HEADERS | END_STREAM,
                1,
                &request_block(authority),
            ));
            let (out, replaced) = run(&input, 5).unwrap();
            assert_eq!(replaced, 0);
            let got = frames(&out[24..]);
            assert_eq!((got[0].0, got[0].1), (HEADERS, END_HEADERS | END_STREAM));
            let fields = decode_all(&mut loona_hpack::Decoder::new(), &got[0].3);
            assert_eq!(fields[3].1.as_bytes(), authority);
        }
        for invalid in [
            &b"/var/lib/kubelet/plugins/csi.sock"[..],
            b"%2Frun%2Fcsi.sock",
            b"",
        ] {
            assert!(!valid_authority(invalid), "{invalid:?}");
        }
    }

    #[test]
    fn padding_priority_and_continuations_are_followed() {
        let block = request_block(b"/tmp/a.sock");
        let (a, b) = block.split_at(10);
        let mut headers = vec![3_u8]; // pad length
        headers.extend([0, 0, 0, 0, 16]); // priority: dependency 0, weight 16
        headers.extend(a);
        headers.extend([0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 5, &headers));
        input.extend(frame(CONTINUATION, END_HEADERS, 5, b));
        let (out, replaced) = run(&input, 3).unwrap();
        assert_eq!(replaced, 1);
        let got = frames(&out[24..]);
        assert_eq!(got.len(), 1);
        assert_eq!(
            (got[0].0, got[0].1, got[0].2),
            (HEADERS, PRIORITY | END_STREAM | END_HEADERS, 5)
        );
        // The priority fields as they came, padding dropped.
        assert_eq!(got[0].3[..5], [0, 0, 0, 0, 16]);
        let fields = decode_all(&mut loona_hpack::Decoder::new(), &got[0].3[5..]);
        assert_eq!(fields[3], (":authority".into(), "localhost".into()));
    }

    /// `block` sent as the client would: frames of at most `frame` bytes.
    fn block_frames(stream: u32, block: &[u8], frame_len: usize) -> Vec<u8> {
        let parts: Vec<&[u8]> = block.chunks(frame_len).collect();
        let mut out = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let kind = if i == 0 { HEADERS } else { CONTINUATION };
            let flags = if i + 1 == parts.len() { END_HEADERS } else { 0 };
            out.extend(frame(kind, flags, stream, part));
        }
        out
    }

    /// The decoded size (RFC 9113 6.5.2) of `request_block(b"/tmp/a.sock")` once rewritten.
    fn request_size() -> usize {
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/csi.v1.Identity/GetPluginInfo"),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        .iter()
        .map(|(n, v)| n.len() + v.len() + 32)
        .sum()
    }

    #[test]
    fn a_block_in_continuations_is_joined_and_a_block_at_the_bound_passes() {
        // Exactly MAX_HEADER_LIST_SIZE decoded, sent in frames of 5,000 bytes.
        let big = MAX_HEADER_LIST_SIZE - request_size() - "x-big".len() - 32;
        let mut block = request_block(b"/tmp/a.sock");
        indexed_literal(&mut block, b"x-big", &vec![b'a'; big]);
        let mut input = PREFACE.to_vec();
        input.extend(block_frames(1, &block, 5000));
        let (out, _) = run(&input, 1000).unwrap();
        let got = frames(&out[24..]);
        assert_eq!(got.len(), 1, "a block within the bound fits one frame");
        assert_eq!((got[0].0, got[0].1, got[0].2), (HEADERS, END_HEADERS, 1));
        let fields = decode_all(&mut loona_hpack::Decoder::new(), &got[0].3);
        assert_eq!(fields[6].1.len(), big);

        // With priority fields too: a block within the bound re-encoded is at least 27 bytes
        // per field shorter than its decoded size, so the 5 bytes still fit one frame.
        let mut input = PREFACE.to_vec();
        let mut first = vec![0, 0, 0, 3, 200];
        first.extend(&block[..5000]);
        input.extend(frame(HEADERS, PRIORITY, 1, &first));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, &block[5000..]));
        let (out, _) = run(&input, 1000).unwrap();
        let got = frames(&out[24..]);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].0, got[0].1), (HEADERS, PRIORITY | END_HEADERS));
        assert!(got[0].3.len() <= MAX_FRAME);
        assert_eq!(got[0].3[..5], [0, 0, 0, 3, 200]);
        let fields = decode_all(&mut loona_hpack::Decoder::new(), &got[0].3[5..]);
        assert_eq!(fields[6].1.len(), big);
    }

    #[test]
    fn a_header_list_over_the_bound_is_refused_however_it_is_encoded() {
        // One byte over, as a literal.
        let big = MAX_HEADER_LIST_SIZE - request_size() - "x-big".len() - 32 + 1;
        let mut block = request_block(b"/tmp/a.sock");
        indexed_literal(&mut block, b"x-big", &vec![b'a'; big]);
        let mut input = PREFACE.to_vec();
        input.extend(block_frames(1, &block, 5000));
        let err = run(&input, 1000).unwrap_err();
        assert!(
            matches!(err, RewriteError::HeaderListTooLarge { stream: 1 }),
            "{err}"
        );
        assert_eq!(err.h2_code(), 0xb);

        // As references to one table entry: 5 references to a 4,000-byte entry.
        let mut first = request_block(b"/tmp/a.sock");
        indexed_literal(&mut first, b"x-big", &[b'a'; 4000]);
        let mut second = vec![0x83, 0x86];
        second.extend([0xbe; 5]); // index 62: the newest entry, x-big
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &first));
        input.extend(frame(HEADERS, END_HEADERS, 3, &second));
        let mut r = Rewriter::new();
        let err = r.feed(&input).unwrap_err();
        assert!(
            matches!(err, RewriteError::HeaderListTooLarge { stream: 3 }),
            "{err}"
        );
        assert_eq!(r.last_stream(), 1, "stream 3 was not passed on");
        assert!(r.pending() < 24 + 9 + 4000 + 200, "{}", r.pending());

        // A frame larger than the server's frame size, and a block larger than MAX_BLOCK in
        // continuations (table size updates: nothing decoded, everything buffered).
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &vec![0x20; MAX_FRAME + 1]));
        assert!(matches!(
            run(&input, 4096),
            Err(RewriteError::FrameTooLarge { stream: 1, .. })
        ));
        let mut input = PREFACE.to_vec();
        input.extend(block_frames(1, &vec![0x20; MAX_BLOCK + 1], MAX_FRAME));
        assert!(matches!(
            run(&input, 4096),
            Err(RewriteError::BlockTooLarge { stream: 1 })
        ));
    }

    #[test]
    fn output_waiting_to_be_read_stops_the_input() {
        // Many small blocks each expanding to ~4 KB: feed stops taking input at the high water.
        let mut first = request_block(b"/tmp/a.sock");
        indexed_literal(&mut first, b"x-big", &[b'a'; 4000]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &first));
        for stream in (3..400).step_by(2) {
            input.extend(frame(HEADERS, END_HEADERS, stream, &[0x83, 0x86, 0xbe]));
        }
        let mut r = Rewriter::new();
        let taken = r.feed(&input).unwrap();
        assert!(taken < input.len(), "took all {taken} bytes");
        assert!(r.pending() < OUT_HIGH_WATER + 5000, "{}", r.pending());
        // Everything arrives once read.
        let (out, _) = run(&input, 100).unwrap();
        assert_eq!(frames(&out[24..]).len(), 200);
    }

    #[test]
    fn what_cannot_be_followed_is_an_error() {
        let mut broken = PREFACE.to_vec();
        broken.extend(frame(HEADERS, END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff])); // index overflow
        assert!(matches!(
            run(&broken, 64),
            Err(RewriteError::Hpack { stream: 1, .. })
        ));

        let mut stray = PREFACE.to_vec();
        stray.extend(frame(CONTINUATION, END_HEADERS, 1, &[0x83]));
        assert!(matches!(
            run(&stray, 64),
            Err(RewriteError::StrayContinuation { stream: 1 })
        ));

        let mut interleaved = PREFACE.to_vec();
        interleaved.extend(frame(HEADERS, 0, 1, &[0x83]));
        interleaved.extend(frame(0x0, 0, 1, &[1, 2]));
        assert!(matches!(
            run(&interleaved, 64),
            Err(RewriteError::Interleaved { .. })
        ));

        let mut padding = PREFACE.to_vec();
        padding.extend(frame(HEADERS, PADDED | END_HEADERS, 1, &[9, 0x83]));
        assert!(matches!(
            run(&padding, 64),
            Err(RewriteError::Padding { stream: 1 })
        ));
    }

    #[test]
    fn a_size_update_after_a_field_is_refused() {
        let mut input = PREFACE.to_vec();
        // :method POST, a size update to 0, :scheme http: refused; at the start: followed.
        input.extend(frame(HEADERS, END_HEADERS, 1, &[0x83, 0x20, 0x86]));
        assert!(matches!(
            run(&input, 64),
            Err(RewriteError::Hpack { stream: 1, .. })
        ));
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            1,
            &[0x20, 0x3f, 0xe1, 0x1f, 0x83],
        ));
        run(&input, 64).unwrap();
        // Literals are walked over, strings included, so their bytes are not taken for one.
        let mut block = vec![0x83];
        indexed_literal(&mut block, b"x-a", b"\x20\x20");
        block.push(0x00);
        encode_string(&mut block, b"x-b");
        encode_string(&mut block, b"\x3f");
        block.push(0x1f);
        block.push(0x00); // never indexed, name index 15
        encode_string(&mut block, b"\x20");
        assert_eq!(size_updates_first(&block), Ok(()));
        block.push(0x20);
        assert!(size_updates_first(&block).is_err());
    }

    #[test]
    fn integers_follow_rfc_7541() {
        // RFC 7541 C.1.1-C.1.3.
        let mut out = Vec::new();
        encode_integer(&mut out, 0, 5, 10);
        assert_eq!(out, [0x0a]);
        out.clear();
        encode_integer(&mut out, 0, 5, 1337);
        assert_eq!(out, [0x1f, 0x9a, 0x0a]);
        out.clear();
        encode_integer(&mut out, 0, 8, 42);
        assert_eq!(out, [0x2a]);
        assert_eq!(decode_integer(&[0x0a], 5), Some((10, 1)));
        assert_eq!(decode_integer(&[0x1f, 0x9a, 0x0a], 5), Some((1337, 3)));
        assert_eq!(decode_integer(&[0x1f, 0x9a], 5), None);
        assert_eq!(
            decode_integer(
                &[
                    0x1f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff
                ],
                5
            ),
            None
        );
    }
}
