//! The credentials endpoint's transport (W10, issue 25): the controller's server
//! (`credentials_delivery::server`) and the node plugin's client (`credentials_delivery::client`)
//! speaking real gRPC over TLS on loopback TCP, the token reviewed by the API server double
//! (which enforces deploy/base/rbac.yaml on the controller's ServiceAccount), and the node
//! service staging through it on the node test harness (a fake sysfs whose
//! `/dev/nvme-fabrics` is a plain file, so the options line a connect writes can be read).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod node_support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use node_support::{HOST_NQN, Harness, OTHER_HOST_NQN, assert_code, config, mount_cap, nvme_ctx};
use pillar_csi::context;
use pillar_csi::credentials_delivery::client::{CredentialsClient, FetchError};
use pillar_csi::credentials_delivery::proto::node_credentials_client::NodeCredentialsClient;
use pillar_csi::credentials_delivery::proto::node_credentials_server::{
    NodeCredentials, NodeCredentialsServer,
};
use pillar_csi::credentials_delivery::proto::{
    GetNodeCredentialsRequest, GetNodeCredentialsResponse,
};
use pillar_csi::credentials_delivery::server::EndpointArgs;
use pillar_csi::credentials_delivery::{AUDIENCE, Delivery};
use pillar_csi::node::AttachMode;
use pillar_host::fake::FakeSysfs;
use pillar_nvmet::{HostNqn, VolumeId};
use pillar_state::apiserver_double::ApiServerDouble;
use pillar_state::apiserver_double::rbac::ServiceAccount;
use pillar_state::credentials::NodeCredentials as Pair;
use pillar_state::kube_credentials::secret_name;
use pillar_state::{KubeStore, StateStore};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use tonic::Code;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

const NS: &str = "pillar-system";
const SERVER_NAME: &str = "pillar-controller.pillar-system.svc";
const NODE: &str = node_support::NODE;

struct Pki(CertifiedIssuer<'static, KeyPair>);

impl Pki {
    fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Self(CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap())
    }

    /// (certificate PEM, key PEM) for `name` as a DNS SAN.
    fn leaf(&self, name: &str) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![name.to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.signed_by(&key, &self.0).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn node_plugin() -> ServiceAccount {
    ServiceAccount::new(NS, "pillar-node")
}

/// The controller's endpoint on loopback, over the double, and what a node needs to call it.
struct World {
    double: ApiServerDouble,
    store: Arc<dyn StateStore>,
    pki: Pki,
    dir: tempfile::TempDir,
    addr: SocketAddr,
    ca_file: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl World {
    /// The endpoint with `args` (listen, certificate and key filled in), reviewing with
    /// `reviewer` (the controller's client of the double when `None`).
    async fn start(tune: impl FnOnce(&mut EndpointArgs), reviewer: Option<kube::Client>) -> Self {
        let double = ApiServerDouble::start().await.unwrap();
        let store: Arc<dyn StateStore> = Arc::new(
            KubeStore::new(double.controller_client().unwrap()).with_credentials_namespace(NS),
        );
        let reviewer = reviewer.unwrap_or_else(|| double.controller_client().unwrap());
        let delivery = Delivery::new(Arc::clone(&store), reviewer, NS);
        let pki = Pki::new("pillar test CA");
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = pki.leaf(SERVER_NAME);
        let mut args = EndpointArgs {
            credentials_listen: Some("127.0.0.1:0".parse().unwrap()),
            credentials_tls_cert: Some(write(dir.path(), "tls.crt", &cert)),
            credentials_tls_key: Some(write(dir.path(), "tls.key", &key)),
            credentials_max_connections: 256,
            credentials_max_in_flight: 16,
            credentials_max_request_bytes: 16 * 1024,
            credentials_handshake_timeout_secs: 5,
            credentials_review_timeout_secs: 10,
        };
        tune(&mut args);
        let bound = args
            .endpoint(delivery)
            .unwrap()
            .unwrap()
            .bind()
            .await
            .unwrap();
        let addr = bound.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            bound
                .serve(async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        let ca_file = write(dir.path(), "ca.crt", &pki.0.pem());
        Self {
            double,
            store,
            pki,
            dir,
            addr,
            ca_file,
            stop: Some(stop),
            server,
        }
    }

    /// A token of the node plugin's pod on `node` for `audiences`, in a file of its own.
    fn token_file(&self, node: &str, audiences: &[&str]) -> (String, PathBuf) {
        let token = self
            .double
            .issue_pod_token(&node_plugin(), "pillar-node-a", node, audiences);
        let path = write(
            self.dir.path(),
            &format!("token-{}", uuid::Uuid::new_v4()),
            &token,
        );
        (token, path)
    }

    fn client(&self, token_file: &Path) -> CredentialsClient {
        CredentialsClient {
            endpoint: format!("https://{}", self.addr),
            server_name: Some(SERVER_NAME.into()),
            ca_file: self.ca_file.clone(),
            token_file: token_file.to_path_buf(),
            timeout: Duration::from_secs(5),
        }
    }

    /// A raw gRPC client over TLS (no checks of the node plugin's), for hostile requests.
    async fn raw(&self) -> NodeCredentialsClient<tonic::transport::Channel> {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(self.pki.0.pem()))
            .domain_name(SERVER_NAME);
        let channel = Endpoint::from_shared(format!("https://{}", self.addr))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
            .unwrap();
        NodeCredentialsClient::new(channel)
    }

    /// Stops the endpoint (its files stay until the world is dropped).
    async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.server).await;
    }
}

fn host() -> HostNqn {
    HostNqn::parse(HOST_NQN).unwrap()
}

fn vol() -> VolumeId {
    VolumeId::parse("pvc-auth").unwrap()
}

#[track_caller]
fn refused(result: Result<impl std::fmt::Debug, FetchError>, code: Code) -> FetchError {
    match result {
        Err(e @ FetchError::Refused { code: c, .. }) if c == code => e,
        other => panic!("expected the endpoint to refuse with {code:?}, got {other:?}"),
    }
}

// proves W10 (delivery to its node only, over the real transport): node worker-1's plugin,
// with its projected token, gets worker-1's pair (the one the agent was granted) over TLS; the
// same token asking for worker-2's pair is PERMISSION_DENIED and makes nothing for worker-2; a
// forged token, one for another audience, an expired one and one whose pod is gone are
// UNAUTHENTICATED; another ServiceAccount's is PERMISSION_DENIED; a client that does not trust
// the endpoint's CA, or expects another name, never sends its token. Fails on a server that
// skips the review (`credentials_for` answering the store's pair directly: every refusal here
// turns into a pair) and on a client without the CA check.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_gets_its_own_pair_over_tls_and_no_other() {
    let mut w = World::start(|_| {}, None).await;
    let granted: Pair = w.store.node_credentials(NODE, HOST_NQN).await.unwrap();
    let (token, own) = w.token_file(NODE, &[AUDIENCE]);

    let got = w.client(&own).fetch(NODE, &host(), &vol()).await.unwrap();
    assert_eq!(got.secret, granted.secret);
    assert_eq!(
        got.ctrl_secret.as_deref(),
        Some(granted.ctrl_secret.as_str())
    );
    assert!(
        !format!("{got:?}").contains(&granted.secret),
        "Debug shows a secret"
    );

    // Asking for another node's pair with this node's token.
    let other_nqn = HostNqn::parse(OTHER_HOST_NQN).unwrap();
    let e = refused(
        w.client(&own).fetch("worker-2", &other_nqn, &vol()).await,
        Code::PermissionDenied,
    );
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(w.double.secret(NS, &secret_name("worker-2")).is_none());

    // Tokens that are not this node plugin's, for this audience, now.
    let forged = write(w.dir.path(), "forged", "eyJhbGciOiJSUzI1NiJ9.forged.token");
    refused(
        w.client(&forged).fetch(NODE, &host(), &vol()).await,
        Code::Unauthenticated,
    );
    let (_, api_audience) = w.token_file(NODE, &["https://kubernetes.default.svc"]);
    refused(
        w.client(&api_audience).fetch(NODE, &host(), &vol()).await,
        Code::Unauthenticated,
    );
    let controller_token = w.double.issue_pod_token(
        &ServiceAccount::pillar_controller(),
        "pillar-controller-x",
        NODE,
        &[AUDIENCE],
    );
    let controller_file = write(w.dir.path(), "controller-token", &controller_token);
    refused(
        w.client(&controller_file)
            .fetch(NODE, &host(), &vol())
            .await,
        Code::PermissionDenied,
    );
    let (expiring, expiring_file) = w.token_file(NODE, &[AUDIENCE]);
    w.double.expire_token(&expiring);
    let e = refused(
        w.client(&expiring_file).fetch(NODE, &host(), &vol()).await,
        Code::Unauthenticated,
    );
    assert!(e.to_string().contains("expired"), "{e}");
    w.double.delete_pod("pillar-node-a");
    refused(
        w.client(&own).fetch(NODE, &host(), &vol()).await,
        Code::Unauthenticated,
    );
    assert!(!token.is_empty());

    // The client checks the endpoint: another CA, or another name, is no controller of ours.
    let (_, fresh) = {
        let t = w
            .double
            .issue_pod_token(&node_plugin(), "pillar-node-b", NODE, &[AUDIENCE]);
        let p = write(w.dir.path(), "fresh", &t);
        (t, p)
    };
    let mut stranger = w.client(&fresh);
    stranger.ca_file = write(w.dir.path(), "other-ca.crt", &Pki::new("other CA").0.pem());
    let e = stranger.fetch(NODE, &host(), &vol()).await.unwrap_err();
    assert!(matches!(e, FetchError::Connect { .. }), "{e:?}");
    let mut misnamed = w.client(&fresh);
    misnamed.server_name = Some("impostor.pillar.test".into());
    let e = misnamed.fetch(NODE, &host(), &vol()).await.unwrap_err();
    assert!(matches!(e, FetchError::Connect { .. }), "{e:?}");
    // And the right one still answers the live pod's token.
    assert_eq!(
        w.client(&fresh)
            .fetch(NODE, &host(), &vol())
            .await
            .unwrap()
            .secret,
        granted.secret
    );
    w.stop().await;
}

// proves W10 (least privilege: the delivery only reads): a node asking for its pair before any
// ControllerPublish made one, or naming another host NQN than its stored pair's, is refused
// FAILED_PRECONDITION, and its Secret is neither made nor replaced; asked with its own host NQN
// it gets the stored pair. Fails on a delivery through `node_credentials` (that makes a missing
// pair and replaces one made for another host NQN, rotating the node's pair from a read).
#[tokio::test(flavor = "multi_thread")]
async fn the_delivery_never_makes_or_replaces_a_pair() {
    let mut w = World::start(|_| {}, None).await;
    let (_, own) = w.token_file(NODE, &[AUDIENCE]);
    let stored = |w: &World| w.double.secret(NS, &secret_name(NODE));

    let e = refused(
        w.client(&own).fetch(NODE, &host(), &vol()).await,
        Code::FailedPrecondition,
    );
    assert!(e.to_string().contains("ControllerPublishVolume"), "{e}");
    assert!(stored(&w).is_none(), "the delivery made a pair");

    let granted: Pair = w.store.node_credentials(NODE, HOST_NQN).await.unwrap();
    let before = stored(&w);
    assert!(before.is_some());
    let other = HostNqn::parse(OTHER_HOST_NQN).unwrap();
    refused(
        w.client(&own).fetch(NODE, &other, &vol()).await,
        Code::FailedPrecondition,
    );
    assert_eq!(stored(&w), before, "the delivery replaced the node's pair");

    let got = w.client(&own).fetch(NODE, &host(), &vol()).await.unwrap();
    assert_eq!(got.secret, granted.secret);
    w.stop().await;
}

// proves C7 (a hostile client gets a clear code and bounded memory): a request over the
// endpoint's size bound is RESOURCE_EXHAUSTED (refused from its length prefix), malformed
// fields INVALID_ARGUMENT and a missing token UNAUTHENTICATED, none of them reviewed; with an
// API server that never answers, a call ends UNAVAILABLE at the review timeout, and a call
// beyond the in-flight bound meanwhile is RESOURCE_EXHAUSTED at once. Fails with the size or
// in-flight bound taken out of `EndpointArgs::limits` (the oversized request is then reviewed
// and answered UNAUTHENTICATED; the second call waits its turn) or without the timeout (the
// call hangs past the test's own deadline).
#[tokio::test(flavor = "multi_thread")]
async fn hostile_requests_get_a_clear_code_and_nothing_is_reviewed() {
    let mut w = World::start(|_| {}, None).await;
    let mut raw = w.raw().await;
    let request = |token: String, node: &str, nqn: &str| GetNodeCredentialsRequest {
        token,
        node: node.into(),
        host_nqn: nqn.into(),
        volume_id: "pvc-1".into(),
    };
    w.double.clear_requests();
    let big = raw
        .get_node_credentials(request("x".repeat(32 * 1024), NODE, HOST_NQN))
        .await
        .unwrap_err();
    assert_eq!(big.code(), Code::ResourceExhausted, "{}", big.message());
    for (r, code) in [
        (request("t".into(), "", HOST_NQN), Code::InvalidArgument),
        (
            request("t".into(), NODE, "not-an-nqn"),
            Code::InvalidArgument,
        ),
        (
            request(String::new(), NODE, HOST_NQN),
            Code::Unauthenticated,
        ),
    ] {
        let e = raw.get_node_credentials(r).await.unwrap_err();
        assert_eq!(e.code(), code, "{}", e.message());
    }
    assert!(
        w.double.requests().is_empty(),
        "a refused request reached the API server: {:?}",
        w.double.requests()
    );
    w.stop().await;

    // An API server that accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let reviewer = kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
    let mut w = World::start(
        |a| {
            a.credentials_review_timeout_secs = 2;
            a.credentials_max_in_flight = 1;
        },
        Some(reviewer),
    )
    .await;
    let mut first = w.raw().await;
    let mut second = w.raw().await;
    let started = std::time::Instant::now();
    let slow = tokio::spawn(async move {
        first
            .get_node_credentials(request("t".into(), NODE, HOST_NQN))
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let e = second
        .get_node_credentials(request("t".into(), NODE, HOST_NQN))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{}", e.message());
    let e = tokio::time::timeout(Duration::from_secs(20), slow)
        .await
        .expect("the review timeout ends the call")
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{}", e.message());
    assert!(started.elapsed() >= Duration::from_secs(2));
    drop(silent);
    w.stop().await;
}

/// The node harness in NVMe/TCP mode on a fake sysfs whose control device is a plain file,
/// with the credentials client `client`. Returns the harness and the control file.
async fn node(client: Option<CredentialsClient>) -> (Harness, PathBuf, tempfile::TempDir) {
    let root = tempfile::tempdir().unwrap();
    let f = FakeSysfs::new(root.path()).unwrap();
    let paths = f.paths().clone();
    let fabrics = paths.dev.join("nvme-fabrics");
    std::fs::write(&fabrics, "").unwrap();
    let h = Harness::start_with(
        move |dir| {
            let mut c = config(dir, AttachMode::NvmeTcp, paths);
            c.connect_timeout = Duration::from_secs(1);
            c
        },
        move |service| match client {
            Some(c) => service.with_credentials_delivery(c),
            None => service,
        },
    )
    .await;
    (h, fabrics, root)
}

fn dhchap_ctx(volume: &str) -> std::collections::HashMap<String, String> {
    let mut ctx = nvme_ctx(volume);
    ctx.insert(context::AUTH.into(), "dhchap".into());
    ctx
}

// proves W10 (the node never connects without its secret): a NodeStageVolume that requires
// DH-HMAC-CHAP and carries no secret connects with the pair the controller's endpoint
// delivered (the options line written to /dev/nvme-fabrics carries both secrets); with the
// endpoint down, or refusing this node, the stage fails naming the missing secret (UNAVAILABLE,
// FAILED_PRECONDITION) before anything is done: no stage record, nothing written to the
// control device. Fails on a node service that stages without calling the endpoint
// (MissingSecret) and on one that connects when the delivery failed.
#[tokio::test(flavor = "multi_thread")]
async fn a_stage_without_its_secret_connects_with_the_delivered_pair_or_not_at_all() {
    let mut w = World::start(|_| {}, None).await;
    let granted: Pair = w.store.node_credentials(NODE, HOST_NQN).await.unwrap();
    let (_, token) = w.token_file(NODE, &[AUDIENCE]);
    let (h, fabrics, _root) = node(Some(w.client(&token))).await;
    let (staging, _g) = h.path("staging");

    // Delivered: the connect carries this node's pair. (The plain file answers no controller,
    // so the stage fails after the write; the write is what this test reads.)
    let _ = h
        .stage(
            "pvc-auth",
            &staging,
            mount_cap("ext4"),
            dhchap_ctx("pvc-auth"),
        )
        .await;
    let line = std::fs::read_to_string(&fabrics).unwrap();
    assert!(
        line.contains(&format!(",dhchap_secret={}", granted.secret))
            && line.contains(&format!(",dhchap_ctrl_secret={}", granted.ctrl_secret))
            && line.contains(&format!("hostnqn={HOST_NQN}")),
        "the connect did not carry the delivered pair"
    );
    h.unstage("pvc-auth", &staging).await.unwrap();

    // Refused: a token bound to another node.
    std::fs::write(&fabrics, "").unwrap();
    let other = w
        .double
        .issue_pod_token(&node_plugin(), "pillar-node-z", "worker-9", &[AUDIENCE]);
    std::fs::write(&token, other).unwrap();
    let e = h
        .stage(
            "pvc-auth",
            &staging,
            mount_cap("ext4"),
            dhchap_ctx("pvc-auth"),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    assert!(e.message().contains("dhchapSecret"), "{}", e.message());
    assert!(h.record("pvc-auth").is_none());
    assert_eq!(std::fs::read_to_string(&fabrics).unwrap(), "");

    // The endpoint down.
    w.stop().await;
    let e = h
        .stage(
            "pvc-auth",
            &staging,
            mount_cap("ext4"),
            dhchap_ctx("pvc-auth"),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{}", e.message());
    assert!(
        e.message().contains("dhchapSecret") && e.message().contains("credentials endpoint"),
        "{}",
        e.message()
    );
    assert!(h.record("pvc-auth").is_none());
    assert_eq!(std::fs::read_to_string(&fabrics).unwrap(), "");
}

/// An endpoint that answers every request with `answer` (a misbehaving or impostor controller
/// holding a certificate of the right CA).
struct Fixed(GetNodeCredentialsResponse);

#[tonic::async_trait]
impl NodeCredentials for Fixed {
    async fn get_node_credentials(
        &self,
        _: tonic::Request<GetNodeCredentialsRequest>,
    ) -> Result<tonic::Response<GetNodeCredentialsResponse>, tonic::Status> {
        Ok(tonic::Response::new(self.0.clone()))
    }
}

// proves W10 (a node stages only with its own pair): an answer carrying the pair of another
// host NQN, or of another node, or a secret that is no DH-HMAC-CHAP secret, fails the stage
// FAILED_PRECONDITION before anything is written. Fails with the client's check of the
// answer's node and host NQN removed (the other host's secret reaches the connect line).
#[tokio::test(flavor = "multi_thread")]
async fn a_pair_for_another_host_is_never_used() {
    let pki = Pki::new("pillar test CA");
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = pki.leaf(SERVER_NAME);
    let other = pillar_nvmet::DhchapSecret::generate().unwrap();
    let answers = [
        (NODE, OTHER_HOST_NQN, other.expose().to_owned()),
        ("worker-2", HOST_NQN, other.expose().to_owned()),
        (NODE, HOST_NQN, "DHHC-1:00:bm90IGEgc2VjcmV0:".to_owned()),
    ];
    for (node_name, nqn, secret) in answers {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let answer = GetNodeCredentialsResponse {
            node: node_name.into(),
            host_nqn: nqn.into(),
            dhchap_secret: secret.clone(),
            dhchap_ctrl_secret: String::new(),
        };
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .tls_config(
                    ServerTlsConfig::new().identity(Identity::from_pem(cert.clone(), key.clone())),
                )
                .unwrap()
                .add_service(NodeCredentialsServer::new(Fixed(answer)))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let client = CredentialsClient {
            endpoint: format!("https://{addr}"),
            server_name: Some(SERVER_NAME.into()),
            ca_file: write(dir.path(), "ca.crt", &pki.0.pem()),
            token_file: write(dir.path(), "token", "a-token"),
            timeout: Duration::from_secs(5),
        };
        let (h, fabrics, _root) = node(Some(client)).await;
        let (staging, _g) = h.path("staging");
        let e = h
            .stage(
                "pvc-auth",
                &staging,
                mount_cap("ext4"),
                dhchap_ctx("pvc-auth"),
            )
            .await;
        assert_code(e, Code::FailedPrecondition);
        assert!(h.record("pvc-auth").is_none());
        assert_eq!(
            std::fs::read_to_string(&fabrics).unwrap(),
            "",
            "{node_name} {nqn}"
        );
        server.abort();
    }
}
