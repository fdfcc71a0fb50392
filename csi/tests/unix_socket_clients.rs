//! The CSI socket answers clients that send the socket path as `:authority` (C-core based
//! clients: Python, Ruby, C++; grpc-java), not only Go's `localhost`. A raw HTTP/2 client makes
//! the request exactly as they do; the same request against plain tonic is the control (reset
//! with PROTOCOL_ERROR). A real Python gRPC client runs where `grpcio` is installed (CI
//! installs it and sets `PILLAR_REQUIRE_PYTHON_GRPC=1`, so there it cannot be skipped).

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use pillar_csi::csi;
use pillar_csi::identity::{DRIVER_NAME, IdentityService};
use pillar_csi::node::NodeService;
use prost::Message as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = u32::try_from(payload.len()).unwrap().to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

/// An HPACK literal with incremental indexing, new name, no Huffman (RFC 7541 6.2.1); lengths
/// below 127.
fn literal(out: &mut Vec<u8>, name: &str, value: &str) {
    out.push(0x40);
    for s in [name, value] {
        out.push(u8::try_from(s.len()).unwrap());
        out.extend(s.as_bytes());
    }
}

/// What the server answered one request.
#[derive(Debug, PartialEq)]
enum Answer {
    /// The trailers' grpc-status and the message bytes.
    Served {
        grpc_status: String,
        message: Vec<u8>,
    },
    /// RST_STREAM with this error code.
    Reset(u32),
}

/// GetPluginInfo as a C-core client sends it on a unix socket: `:authority` is the path.
async fn get_plugin_info_raw(socket: &Path) -> Answer {
    let mut conn = UnixStream::connect(socket).await.unwrap();
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
    literal(&mut block, ":path", "/csi.v1.Identity/GetPluginInfo");
    literal(&mut block, ":authority", socket.to_str().unwrap());
    literal(&mut block, "content-type", "application/grpc");
    literal(&mut block, "te", "trailers");
    let mut out = PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    out.extend(frame(0x1, 0x4, 1, &block)); // HEADERS, END_HEADERS
    out.extend(frame(0x0, 0x1, 1, &[0, 0, 0, 0, 0])); // DATA: an empty message, END_STREAM
    conn.write_all(&out).await.unwrap();

    let mut decoder = loona_hpack::Decoder::new();
    let mut message = Vec::new();
    loop {
        let mut header = [0_u8; 9];
        conn.read_exact(&mut header).await.unwrap();
        let len =
            usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        let mut payload = vec![0; len];
        conn.read_exact(&mut payload).await.unwrap();
        let (kind, flags) = (header[3], header[4]);
        match kind {
            0x4 if flags & 0x1 == 0 => conn.write_all(&frame(0x4, 0x1, 0, &[])).await.unwrap(),
            0x3 => return Answer::Reset(u32::from_be_bytes(payload[..4].try_into().unwrap())),
            0x0 => message.extend(&payload),
            0x1 => {
                let fields = decoder.decode(&payload).unwrap();
                if flags & 0x1 != 0 {
                    let status = fields
                        .iter()
                        .find(|(n, _)| n == b"grpc-status")
                        .map(|(_, v)| String::from_utf8(v.clone()).unwrap())
                        .unwrap();
                    return Answer::Served {
                        grpc_status: status,
                        message,
                    };
                }
            }
            0x7 => panic!("GOAWAY: {payload:?}"),
            _ => {}
        }
    }
}

fn plugin_name(grpc_message: &[u8]) -> String {
    // Length-prefixed message: compressed flag, 4-byte length, the message.
    csi::GetPluginInfoResponse::decode(&grpc_message[5..])
        .unwrap()
        .name
}

async fn serve_pillar(dir: &Path) -> PathBuf {
    let socket = dir.join("csi.sock");
    let s = socket.clone();
    tokio::spawn(async move {
        pillar_csi::serve::serve::<NodeService>(
            &s,
            IdentityService,
            None,
            None,
            std::future::pending(),
        )
        .await
        .unwrap();
    });
    for _ in 0..200 {
        if UnixStream::connect(&socket).await.is_ok() {
            return socket;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("CSI socket never came up");
}

#[tokio::test]
async fn a_client_sending_the_socket_path_as_authority_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let socket = serve_pillar(dir.path()).await;
    // Twice on one connection would also exercise the HPACK table; once per connection here,
    // the rewriter's own tests cover the table.
    for _ in 0..2 {
        match get_plugin_info_raw(&socket).await {
            Answer::Served {
                grpc_status,
                message,
            } => {
                assert_eq!(grpc_status, "0");
                assert_eq!(plugin_name(&message), DRIVER_NAME);
            }
            other => panic!("{other:?}"),
        }
    }

    // The control: plain tonic resets the same request (PROTOCOL_ERROR).
    let plain = dir.path().join("plain.sock");
    let listener = tokio::net::UnixListener::bind(&plain).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(csi::identity_server::IdentityServer::new(IdentityService))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    assert_eq!(get_plugin_info_raw(&plain).await, Answer::Reset(0x1));
}

/// A real C-core client: Python's grpcio, calling by method path with raw bytes (no generated
/// stubs), with its default authority and with the socket path forced as the authority.
#[tokio::test]
async fn a_python_grpc_client_calls_the_csi_socket() {
    let python = std::env::var("PILLAR_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_grpc = std::process::Command::new(&python)
        .args(["-c", "import grpc"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_grpc {
        assert!(
            std::env::var_os("PILLAR_REQUIRE_PYTHON_GRPC").is_none(),
            "{python} has no grpc module and PILLAR_REQUIRE_PYTHON_GRPC is set"
        );
        eprintln!("skipped: {python} has no grpc module (pip install grpcio)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = serve_pillar(dir.path()).await;
    let script = r#"
import sys, grpc
path, force = sys.argv[1], sys.argv[2] == "1"
options = [("grpc.default_authority", path)] if force else []
with grpc.insecure_channel("unix:" + path, options=options) as channel:
    call = channel.unary_unary("/csi.v1.Identity/GetPluginInfo")
    sys.stdout.write(call(b"", timeout=10).hex())
"#;
    for force in ["0", "1"] {
        let out = tokio::process::Command::new(&python)
            .args(["-c", script, socket.to_str().unwrap(), force])
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "force={force}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let hex = String::from_utf8(out.stdout).unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let info = csi::GetPluginInfoResponse::decode(bytes.as_slice()).unwrap();
        assert_eq!(info.name, DRIVER_NAME, "force={force}");
    }
}
