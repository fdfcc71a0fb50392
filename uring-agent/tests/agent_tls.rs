//! mTLS on the agent's gRPC: only the authorised controller identity may call; a client without
//! a certificate, or with one for another identity, is refused, server reflection included.
//! Also the metrics endpoint.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::path::Path;

use pillar_agent::server::{EngineKind, Listen, TlsFiles, serve};
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
    good.resync_exports(api::ResyncExportsRequest { exports: vec![] })
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
