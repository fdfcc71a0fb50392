//! The rewriter's unit tests (a file of their own: they are longer than the code).

use super::*;
use crate::hpack::decode_integer;

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

// Found by the rewriter's long fuzz run: a client's PUSH_PROMISE carries a header block that
// the rewriter passed on undecoded, so the server's HPACK table and the client's parted.
#[test]
fn a_push_promise_from_a_client_is_refused() {
    let mut input = PREFACE.to_vec();
    let mut payload = 3_u32.to_be_bytes().to_vec(); // the promised stream
    payload.push(0x40); // literal with incremental indexing: it would enter the client's table
    encode_string(&mut payload, b"x-a");
    encode_string(&mut payload, b"b");
    input.extend(frame(PUSH_PROMISE, END_HEADERS, 1, &payload));
    let err = run(&input, 64).unwrap_err();
    assert!(
        matches!(err, RewriteError::PushPromise { stream: 1 }),
        "{err}"
    );
    assert_eq!(err.h2_code(), 0x1);
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
    let decode = |block: &[u8]| {
        crate::hpack::Decoder::new(TABLE_SIZE).decode(block, |_, _| Ok::<(), ()>(()))
    };
    assert_eq!(decode(&block), Ok(()));
    block.push(0x20);
    assert_eq!(
        decode(&block),
        Err(DecodeError::Malformed(
            crate::hpack::Malformed::SizeUpdateAfterField
        ))
    );
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
