//! A client cannot make the rewriter produce more than a bounded header block, whatever its HPACK
//! dynamic table holds: one ~4 KB entry referenced by 1-byte indices expands a few KB sent into
//! megabytes decoded. Over a real unix socket, through the same `incoming` the servers use.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use futures::StreamExt;
use pillar_grpc_unix::rewrite::MAX_HEADER_LIST_SIZE;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const GOAWAY: u8 = 0x7;
const END_HEADERS: u8 = 0x4;
const ENHANCE_YOUR_CALM: u32 = 0xb;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = u32::try_from(payload.len()).unwrap().to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

/// A header block sent as HEADERS and CONTINUATION frames of at most 16 KiB.
fn header_frames(stream: u32, block: &[u8]) -> Vec<u8> {
    let parts: Vec<&[u8]> = block.chunks(16_384).collect();
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        let kind = if i == 0 { HEADERS } else { CONTINUATION };
        let flags = if i + 1 == parts.len() { END_HEADERS } else { 0 };
        out.extend(frame(kind, flags, stream, part));
    }
    out
}

/// The bomb: stream 1 puts one 4,000-byte header in the dynamic table (a legitimate block of
/// ~4 KB), stream 3 refers to it 20,000 times (20 KB sent, ~80 MB decoded).
fn bomb() -> Vec<u8> {
    let mut first = vec![0x83, 0x86, 0x84]; // :method POST, :scheme http, :path /
    first.push(0x40); // literal with incremental indexing, new name
    first.push(6);
    first.extend(b"x-bomb");
    first.push(0x7f); // value length 4000 = 127 + 3873 (RFC 7541 5.1)
    first.extend([0xa1, 0x1e]);
    first.extend(std::iter::repeat_n(b'a', 4000));
    let mut second = vec![0x83, 0x86, 0x84];
    second.extend(std::iter::repeat_n(0xbe, 20_000)); // index 62: the newest dynamic entry
    let mut out = PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    out.extend(header_frames(1, &first));
    out.extend(header_frames(3, &second));
    out
}

#[tokio::test]
async fn a_header_block_of_references_cannot_expand_beyond_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let mut incoming = Box::pin(pillar_grpc_unix::incoming(
        UnixListener::bind(&path).unwrap(),
    ));

    let client = tokio::spawn({
        let path = path.clone();
        async move {
            let mut conn = UnixStream::connect(&path).await.unwrap();
            // The server may close before all is written: that is an answer too.
            let _ = conn.write_all(&bomb()).await;
            let _ = conn.shutdown().await;
            let mut answer = Vec::new();
            let _ = conn.read_to_end(&mut answer).await;
            answer
        }
    });

    // The server side: everything the rewriter hands the HTTP/2 server, until it ends.
    let mut served = incoming.next().await.unwrap().unwrap();
    let mut produced = 0_usize;
    let mut buf = vec![0; 64 * 1024];
    let ended = loop {
        match served.read(&mut buf).await {
            Ok(0) => break Ok(()),
            Ok(n) => produced += n,
            Err(e) => break Err(e),
        }
    };
    drop(served);
    // The preface, SETTINGS, the first block (~4 KB) and at most one bounded block more.
    let bound = PREFACE.len() + 9 + 2 * (MAX_HEADER_LIST_SIZE + 64);
    assert!(
        produced <= bound,
        "the rewriter produced {produced} bytes from a 28 KB input (bound {bound})"
    );
    let err = ended.expect_err("a block over the bound is a connection error");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");

    // The client is told why: GOAWAY(ENHANCE_YOUR_CALM), last stream 1 (stream 3 was never
    // handed to the server, so the client may retry it elsewhere).
    let answer = client.await.unwrap();
    assert!(answer.len() >= 17, "no GOAWAY in {answer:?}");
    assert_eq!(answer[3], GOAWAY, "{answer:?}");
    assert_eq!(u32::from_be_bytes(answer[9..13].try_into().unwrap()), 1);
    assert_eq!(
        u32::from_be_bytes(answer[13..17].try_into().unwrap()),
        ENHANCE_YOUR_CALM
    );
}
