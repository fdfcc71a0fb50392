//! mTLS on the agent's gRPC: only the authorised controller identity may call; a client without
//! a certificate, or with one for another identity, is refused, server reflection included.
//! Also the metrics endpoint.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::path::Path;

use pillar_agent::{EngineKind, Listen, TlsFiles, serve};
use pillar_agent_api::v1 as api;
use pillar_agent_api::v1::agent_client::AgentClient;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use support::{Dirs, create_req, token};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    fn new() -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "pillar test CA");
        Self {
            ca: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    /// (certificate PEM, key PEM) for `name` as a DNS SAN.
    fn leaf(&self, name: &str) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![name.to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.signed_by(&key, &self.ca).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

async fn client(
    addr: SocketAddr,
    pki: &Pki,
    identity: Option<&str>,
) -> Result<AgentClient<Channel>, tonic::transport::Error> {
    Ok(AgentClient::new(channel(addr, pki, identity).await?))
}

async fn channel(
    addr: SocketAddr,
    pki: &Pki,
    identity: Option<&str>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(pki.ca.pem()))
        .domain_name("agent.pillar.test");
    if let Some(name) = identity {
        let (cert, key) = pki.leaf(name);
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await
}

/// The services the agent's reflection lists to this channel's client.
async fn reflected_services(channel: Channel) -> Result<Vec<String>, tonic::Status> {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::iter([request]))
        .await?
        .into_inner();
    match stream.message().await?.and_then(|r| r.message_response) {
        Some(MessageResponse::ListServicesResponse(list)) => {
            Ok(list.service.into_iter().map(|s| s.name).collect())
        }
        other => panic!("unexpected reflection answer {other:?}"),
    }
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[tokio::test]
async fn only_the_authorised_controller_may_call() {
    let pki = Pki::new();
    let dirs = Dirs::new();
    let (cert, key) = pki.leaf("agent.pillar.test");
    let addr = free_port();
    let metrics = free_port();
    let mut config = dirs.config(EngineKind::Uring);
    config.listen = Listen::Tcp(addr);
    config.insecure_plaintext = false;
    config.metrics_listen = Some(metrics);
    config.tls = Some(TlsFiles {
        cert: write(dirs.tmp.path(), "server.pem", &cert),
        key: write(dirs.tmp.path(), "server.key", &key),
        client_ca: write(dirs.tmp.path(), "ca.pem", &pki.ca.pem()),
        authorized_client: "controller.pillar.test".into(),
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(config, async {
        let _ = stopped.await;
    }));

    let mut good = None;
    for _ in 0..100 {
        if let Ok(mut c) = client(addr, &pki, Some("controller.pillar.test")).await
            && c.health(api::HealthRequest {}).await.is_ok()
        {
            good = Some(c);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut good = good.expect("the authorised controller gets through");

    // Another identity signed by the same CA: authenticated, not authorised.
    let mut other = client(addr, &pki, Some("intruder.pillar.test"))
        .await
        .unwrap();
    let status = other
        .create_volume(create_req("u1", 1, "t1", 1 << 20))
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::PermissionDenied,
        "{}",
        status.message()
    );

    // Reflection answers the authorised controller only.
    let listed = reflected_services(
        channel(addr, &pki, Some("controller.pillar.test"))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert!(
        listed.iter().any(|s| s == "pillar.agent.v1.Agent"),
        "{listed:?}"
    );
    let status = reflected_services(
        channel(addr, &pki, Some("intruder.pillar.test"))
            .await
            .unwrap(),
    )
    .await
    .unwrap_err();
    assert_eq!(
        status.code(),
        Code::PermissionDenied,
        "{}",
        status.message()
    );

    // No client certificate: the handshake or the call fails; nothing reaches the agent.
    let refused = match client(addr, &pki, None).await {
        Err(_) => true,
        Ok(mut c) => c.health(api::HealthRequest {}).await.is_err(),
    };
    assert!(refused, "a client without a certificate was served");

    // The fence rejection the intruder could not even cause, caused by the controller, shows
    // up in the metrics together with RPC latencies and io_uring batch sizes.
    let mut no_token = create_req("u1", 1, "t1", 1 << 20);
    no_token.token = None;
    assert_eq!(
        good.create_volume(no_token).await.unwrap_err().code(),
        Code::FailedPrecondition
    );
    good.resync_exports(api::ResyncExportsRequest {
        exports: vec![],
        ..Default::default()
    })
    .await
    .unwrap();
    good.revoke_initiator(api::RevokeInitiatorRequest {
        token: token("u1", 1),
        volume_id: "t1".into(),
        host_nqn: support::host(1),
    })
    .await
    .unwrap();
    let text = scrape(metrics).await;
    assert!(
        text.contains("pillar_agent_fence_rejections_total{reason=\"no_token\"} 1"),
        "{text}"
    );
    assert!(text.contains("pillar_agent_rpc_duration_seconds_count{method=\"CreateVolume\",code=\"FailedPrecondition\"} 1"), "{text}");
    assert!(
        text.contains("pillar_agent_uring_batch_entries_count"),
        "{text}"
    );

    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

async fn scrape(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// Starts an mTLS agent on `listen` authorising `controller.pillar.test`.
fn serve_mtls(
    pki: &Pki,
    dirs: &Dirs,
    listen: Listen,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), pillar_agent::ServerError>>,
) {
    let (cert, key) = pki.leaf("agent.pillar.test");
    let mut config = dirs.config(EngineKind::Sync);
    config.listen = listen;
    config.insecure_plaintext = false;
    config.tls = Some(TlsFiles {
        cert: write(dirs.tmp.path(), "server.pem", &cert),
        key: write(dirs.tmp.path(), "server.key", &key),
        client_ca: write(dirs.tmp.path(), "ca.pem", &pki.ca.pem()),
        authorized_client: "controller.pillar.test".into(),
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(config, async {
        let _ = stopped.await;
    }));
    (stop, server)
}

/// A channel to the agent's unix socket, TLS by tonic's client.
async fn unix_channel(
    socket: &Path,
    pki: &Pki,
    identity: Option<&str>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(pki.ca.pem()))
        .domain_name("agent.pillar.test");
    if let Some(name) = identity {
        let (cert, key) = pki.leaf(name);
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let socket = socket.to_owned();
    Endpoint::from_static("https://agent.pillar.test")
        .tls_config(tls)?
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
}

/// Waits for the agent's socket to accept a connection.
async fn socket_up(socket: &Path) {
    for _ in 0..200 {
        if tokio::net::UnixStream::connect(socket).await.is_ok() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("the agent did not listen on {}", socket.display());
}

/// Issue 22, defect 4: the authorisation read the client certificate through tonic's TCP-only
/// connect info, so on a unix socket it found none and refused even the authorised controller.
#[tokio::test]
async fn mtls_on_a_unix_socket_authorises_the_controller_and_refuses_others() {
    let pki = Pki::new();
    let dirs = Dirs::new();
    let socket = dirs.socket();
    let (stop, server) = serve_mtls(&pki, &dirs, Listen::Unix(socket.clone()));
    socket_up(&socket).await;

    let mut good = AgentClient::new(
        unix_channel(&socket, &pki, Some("controller.pillar.test"))
            .await
            .unwrap(),
    );
    if let Err(status) = good.health(api::HealthRequest {}).await {
        panic!("the authorised controller was refused: {status:?}");
    }
    let mut other = AgentClient::new(
        unix_channel(&socket, &pki, Some("intruder.pillar.test"))
            .await
            .unwrap(),
    );
    let status = other
        .create_volume(create_req("u1", 1, "t1", 1 << 20))
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::PermissionDenied,
        "{}",
        status.message()
    );
    let refused = match unix_channel(&socket, &pki, None).await {
        Err(_) => true,
        Ok(c) => AgentClient::new(c)
            .health(api::HealthRequest {})
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate was served");

    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

/// A `SecureRandom` for the client whose every output puts `frame` (an HTTP/2 frame header's
/// length and type) at bytes 13..17 of the ClientHello random: bytes 24..28 of the connection.
#[derive(Debug)]
struct CraftedRandom {
    frame: [u8; 4],
}

impl tokio_rustls::rustls::crypto::SecureRandom for CraftedRandom {
    fn fill(&self, buf: &mut [u8]) -> Result<(), tokio_rustls::rustls::crypto::GetRandomFailed> {
        buf.fill(0x5a);
        if buf.len() >= 17 {
            buf[13..17].copy_from_slice(&self.frame);
        }
        Ok(())
    }
}

/// A TLS connection to `socket` whose ClientHello has `frame` at bytes 24..28.
async fn crafted_tls(
    socket: std::path::PathBuf,
    pki_ca: String,
    identity: (String, String),
    frame: [u8; 4],
) -> std::io::Result<hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::UnixStream>>>
{
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};
    let mut provider = tokio_rustls::rustls::crypto::ring::default_provider();
    provider.secure_random = Box::leak(Box::new(CraftedRandom { frame }));
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(pki_ca.as_bytes()).unwrap())
        .unwrap();
    let certs = CertificateDer::pem_slice_iter(identity.0.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(identity.1.as_bytes()).unwrap();
    let mut config = ClientConfig::builder_with_provider(std::sync::Arc::new(provider))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(certs, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let stream = tokio::net::UnixStream::connect(socket).await?;
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(ServerName::try_from("agent.pillar.test").unwrap(), stream)
        .await?;
    Ok(hyper_util::rt::TokioIo::new(tls))
}

/// Issue 22, defect 3: the rewriter wrapped the raw socket with TLS on top, so it read bytes
/// 24..33 of the ClientHello (its random) as an HTTP/2 frame header; when they named HEADERS or
/// CONTINUATION (2 in 256 handshakes) the connection was closed or stalled for ever. Here the
/// client's random says so every time, with a length that stalls and one that closes.
#[tokio::test]
async fn mtls_on_a_unix_socket_completes_whatever_the_client_hello_holds() {
    let pki = Pki::new();
    let dirs = Dirs::new();
    let socket = dirs.socket();
    let (stop, server) = serve_mtls(&pki, &dirs, Listen::Unix(socket.clone()));
    socket_up(&socket).await;
    let identity = pki.leaf("controller.pillar.test");
    for frame in [
        [0x00, 0x01, 0x00, 0x01], // HEADERS of 256 bytes: waited for, for ever
        [0x0f, 0xff, 0xff, 0x09], // CONTINUATION of 1 MiB: refused, connection closed
        [0x00, 0x00, 0x10, 0x01], // HEADERS of 16 bytes: decoded as HPACK
    ] {
        let endpoint = Endpoint::from_static("http://agent.pillar.test");
        let connect = {
            let (socket, ca, identity) = (socket.clone(), pki.ca.pem(), identity.clone());
            endpoint.connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                crafted_tls(socket.clone(), ca.clone(), identity.clone(), frame)
            }))
        };
        let channel = tokio::time::timeout(std::time::Duration::from_secs(10), connect)
            .await
            .unwrap_or_else(|_| panic!("handshake with {frame:02x?} at byte 24 stalled"))
            .unwrap_or_else(|e| panic!("handshake with {frame:02x?} at byte 24 failed: {e:?}"));
        let answer = AgentClient::new(channel)
            .health(api::HealthRequest {})
            .await;
        assert!(answer.is_ok(), "{frame:02x?}: {answer:?}");
    }
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

/// Replaces `name` in `dir` as a Secret volume's update does: a new file renamed over the old
/// one (a new inode), never a half-written file under the served name.
fn replace(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.new"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

/// Health through a new connection to the unix socket, as `identity` of `pki`.
async fn healthy_as(socket: &Path, pki: &Pki, identity: &str) -> bool {
    match unix_channel(socket, pki, Some(identity)).await {
        Ok(channel) => AgentClient::new(channel)
            .health(api::HealthRequest {})
            .await
            .is_ok(),
        Err(_) => false,
    }
}

/// A rotated TLS Secret (new CA, new certificates: cert-manager's renewal, an operator's
/// rotation) is served without restarting the agent; a connection made before keeps working; a
/// change that does not load (a key that is not PEM) leaves the last good material in use.
#[tokio::test]
async fn a_rotated_tls_secret_is_served_without_a_restart() {
    let (old, new, newer) = (Pki::new(), Pki::new(), Pki::new());
    let dirs = Dirs::new();
    let socket = dirs.tmp.path().join("agent.sock");
    let (stop, server) = serve_mtls(&old, &dirs, Listen::Unix(socket.clone()));
    socket_up(&socket).await;
    let before = unix_channel(&socket, &old, Some("controller.pillar.test"))
        .await
        .unwrap();
    let mut before = AgentClient::new(before);
    before.health(api::HealthRequest {}).await.unwrap();
    assert!(!healthy_as(&socket, &new, "controller.pillar.test").await);

    let rotate = |pki: &Pki| {
        let (cert, key) = pki.leaf("agent.pillar.test");
        replace(dirs.tmp.path(), "ca.pem", &pki.ca.pem());
        replace(dirs.tmp.path(), "server.key", &key);
        replace(dirs.tmp.path(), "server.pem", &cert);
    };
    rotate(&new);
    assert!(
        healthy_as(&socket, &new, "controller.pillar.test").await,
        "the rotated material is not served"
    );
    assert!(
        !healthy_as(&socket, &old, "controller.pillar.test").await,
        "a client of the old CA still gets through after the rotation"
    );
    before
        .health(api::HealthRequest {})
        .await
        .expect("a connection made before the rotation keeps working");

    // A key that does not load: the agent keeps serving with what it had.
    replace(dirs.tmp.path(), "server.key", "not a key\n");
    assert!(
        healthy_as(&socket, &new, "controller.pillar.test").await,
        "a bad rotation broke the served material"
    );
    rotate(&newer);
    assert!(healthy_as(&socket, &newer, "controller.pillar.test").await);
    assert!(!healthy_as(&socket, &new, "controller.pillar.test").await);

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}
