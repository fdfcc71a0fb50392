//! Assembling and serving the agent: engine, marks, target, pools, gRPC (mTLS or, only when
//! asked explicitly, plaintext), server reflection and the metrics endpoint.
//!
//! Invariants:
//! - gRPC over TCP or a unix socket is mutually authenticated TLS unless `insecure_plaintext` is
//!   set; with TLS, every call's client certificate must name the authorised controller (DNS or
//!   URI subject alternative name, or common name), else PERMISSION_DENIED. Server reflection
//!   sits behind the same check.
//! - Every client-held resource of the gRPC server is bounded by [`Limits`] (connections,
//!   streams per connection, calls in flight, header and message sizes); a bound hit is
//!   answered RESOURCE_EXHAUSTED or UNAVAILABLE before any handler runs.
//! - Metrics are served only where `metrics_listen` says (no default); they carry no
//!   authentication, so an address other than loopback is logged as a warning.
//! - When io_uring cannot be used, the agent refuses to start with the io_uring engine and says
//!   how to run the synchronous one; it never switches silently.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pillar_agent_api::v1::FILE_DESCRIPTOR_SET;
use pillar_agent_api::v1::agent_server::AgentServer;
use pillar_grpc_unix::tls::TlsSource;
use pillar_grpc_unix::{ConnectInfo, Incoming, Limits, Listener};
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Status};

use crate::backend::{Backend, BackendError, PoolConfig, SystemRunner};
use crate::engine::sync::SyncEngine;
use crate::engine::uring::{UringConfig, UringEngine};
use crate::engine::{Engine, EngineError};
use crate::fence::MarkStore;
use crate::grpc::AgentService;
use crate::metrics::Metrics;
use crate::service::{Agent, AgentSettings};
use crate::state::{Found, StateIdentity};
use crate::target::{Target, TargetConfig, TargetError};

/// Where the gRPC server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl std::str::FromStr for Listen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix://") {
            return Ok(Self::Unix(path.into()));
        }
        let addr = s.strip_prefix("tcp://").unwrap_or(s);
        addr.parse()
            .map(Self::Tcp)
            .map_err(|e| format!("{s:?} is neither unix:///path nor tcp://host:port: {e}"))
    }
}

/// Which engine to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineKind {
    #[value(name = "io_uring")]
    Uring,
    Sync,
}

/// mTLS material and the controller identity to authorise.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: PathBuf,
    pub authorized_client: String,
}

/// Everything the agent needs to start.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub state_dir: PathBuf,
    pub listen: Listen,
    pub engine: EngineKind,
    pub target: TargetConfig,
    pub pools: Vec<PoolConfig>,
    pub settings: AgentSettings,
    pub tls: Option<TlsFiles>,
    pub insecure_plaintext: bool,
    pub metrics_listen: Option<SocketAddr>,
    pub command_timeout: Duration,
}

/// Why the agent could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(
        "no TLS material given: pass --tls-cert/--tls-key/--tls-client-ca/--authorized-client, or --insecure-plaintext"
    )]
    NoTls,
    #[error("TLS material")]
    Tls(#[source] pillar_grpc_unix::tls::TlsConfigError),
    #[error("starting the engine")]
    Engine(#[from] EngineError),
    #[error("opening the target")]
    Target(#[from] TargetError),
    #[error("reading the state directory's identity")]
    StateIdentity(#[from] crate::state::StateError),
    #[error("looking for volumes held without a fencing mark")]
    StateScan(#[source] Box<crate::service::AgentError>),
    #[error("pool {pool:?}")]
    Pool { pool: String, source: BackendError },
    #[error("two pools are named {0:?}")]
    DuplicatePool(String),
    #[error("cannot bind {what}")]
    Bind {
        what: String,
        source: std::io::Error,
    },
    #[error("building gRPC reflection")]
    Reflection(#[source] tonic_reflection::server::Error),
    #[error("gRPC server failed")]
    Serve(#[source] tonic::transport::Error),
}

/// Builds the agent from `config` (no listening yet).
pub async fn build_agent(
    config: &ServerConfig,
    metrics: &Arc<Metrics>,
) -> Result<Arc<Agent>, ServerError> {
    build(config, metrics, None).await
}

/// [`build_agent`] with the synchronous engine's durable writes and the state identity's going
/// through `fs`: the simulation records them to model a power loss (`pillar_durable::crash`).
/// Fault injection from the environment is off in such an agent.
#[cfg(feature = "test-seams")]
pub async fn build_agent_with_fs(
    config: &ServerConfig,
    metrics: &Arc<Metrics>,
    fs: Arc<dyn pillar_durable::DurableFs>,
) -> Result<Arc<Agent>, ServerError> {
    build(config, metrics, Some(fs)).await
}

async fn build(
    config: &ServerConfig,
    metrics: &Arc<Metrics>,
    fs: Option<Arc<dyn pillar_durable::DurableFs>>,
) -> Result<Arc<Agent>, ServerError> {
    let uring = UringConfig::default().with_batch_observer(metrics.batch_observer());
    // A test build (feature `fault-injection`, never a release) may run with one fsync of
    // every durable replace left out, for the kernel lane's broken-order control.
    #[cfg(feature = "fault-injection")]
    let (uring, sync) = {
        let fault = crate::engine::FaultInjection::from_env();
        (uring.with_fault(fault), SyncEngine::with_fault(fault))
    };
    #[cfg(not(feature = "fault-injection"))]
    let sync = SyncEngine::new();
    #[cfg(feature = "test-seams")]
    let sync = match &fs {
        Some(fs) => SyncEngine::with_fs(Arc::clone(fs)),
        None => sync,
    };
    let engine = Arc::new(match config.engine {
        EngineKind::Uring => Engine::Uring(UringEngine::start(uring)?),
        EngineKind::Sync => Engine::Sync(sync),
    });
    let (state_id, found) = match fs {
        Some(fs) => StateIdentity::open_with(&config.state_dir, fs)?,
        None => StateIdentity::open(&config.state_dir)?,
    };
    let marks = MarkStore::open(&config.state_dir)?;
    let snapshot_marks = MarkStore::open_snapshots(&config.state_dir)?;
    let target = Target::open(
        &config.target,
        Arc::clone(&engine),
        &config.state_dir,
        config.settings.hooks.clone(),
    )?;
    let runner = Arc::new(SystemRunner::new(config.command_timeout));
    let mut pools = BTreeMap::new();
    for pool in &config.pools {
        let backend = Backend::open(pool, runner.clone())
            .await
            .map_err(|source| ServerError::Pool {
                pool: pool.name.clone(),
                source,
            })?;
        if pools.insert(pool.name.clone(), backend).is_some() {
            return Err(ServerError::DuplicatePool(pool.name.clone()));
        }
    }
    tracing::info!(engine = engine.name(), target = target.kind(), root = %target.root().display(), "agent ready; waiting for the controller's export resync");
    let agent = Arc::new(Agent::new(
        engine,
        state_id,
        marks,
        snapshot_marks,
        target,
        pools,
        config.settings.clone(),
        Arc::clone(metrics),
    ));
    agent
        .detect_loss_at_start(found == Found::Corrupt)
        .await
        .map_err(|e| ServerError::StateScan(Box::new(e)))?;
    Ok(agent)
}

/// The names a client certificate carries: DNS and URI subject alternative names, common names.
fn certificate_names(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let mut names: Vec<String> = cert
        .subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok().map(str::to_owned))
        .collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                x509_parser::extensions::GeneralName::DNSName(n)
                | x509_parser::extensions::GeneralName::URI(n) => {
                    names.push((*n).to_owned());
                }
                _ => {}
            }
        }
    }
    names
}

/// Authorises each call by the client certificate's identity, from the connection's TLS
/// session (the same on a unix socket as on TCP).
fn authorize(expected: Arc<str>) -> impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |req: Request<()>| {
        let certs = req
            .extensions()
            .get::<ConnectInfo>()
            .and_then(ConnectInfo::peer_certs)
            .ok_or_else(|| Status::unauthenticated("a client certificate is required"))?;
        let leaf = certs
            .first()
            .ok_or_else(|| Status::unauthenticated("a client certificate is required"))?;
        let names = certificate_names(leaf.as_ref());
        if names.iter().any(|n| **n == *expected) {
            Ok(req)
        } else {
            Err(Status::permission_denied(format!(
                "client certificate names {names:?}; only {expected:?} may call the agent"
            )))
        }
    }
}

async fn serve_metrics(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<(), ServerError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServerError::Bind {
            what: format!("metrics on {addr}"),
            source,
        })?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = Arc::clone(&metrics);
            async move { metrics.encode() }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok(())
}

/// The mTLS configuration `config` asks for, or none where plaintext is asked for explicitly.
/// The files are read again when they change (a rotated Secret): see
/// [`pillar_grpc_unix::tls::TlsFiles`].
fn server_tls(config: &ServerConfig) -> Result<Option<TlsSource>, ServerError> {
    match (&config.tls, config.insecure_plaintext) {
        (Some(tls), _) => {
            pillar_grpc_unix::tls::TlsFiles::load(&tls.cert, &tls.key, &tls.client_ca)
                .map(|files| Some(TlsSource::Files(Arc::new(files))))
                .map_err(ServerError::Tls)
        }
        (None, true) => {
            tracing::warn!("serving gRPC without TLS (--insecure-plaintext)");
            Ok(None)
        }
        (None, false) => Err(ServerError::NoTls),
    }
}

/// Binds the gRPC listener.
async fn bind(listen: &Listen) -> Result<Listener, ServerError> {
    match listen {
        Listen::Unix(path) => {
            // A socket left by a previous run would make bind fail.
            let _ = std::fs::remove_file(path);
            if let Some(parent) = path.parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            let listener =
                tokio::net::UnixListener::bind(path).map_err(|source| ServerError::Bind {
                    what: path.display().to_string(),
                    source,
                })?;
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
            tracing::info!(socket = %path.display(), "serving gRPC");
            Ok(Listener::Unix(listener))
        }
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind {
                    what: addr.to_string(),
                    source,
                })?;
            tracing::info!(%addr, "serving gRPC");
            Ok(Listener::Tcp(listener))
        }
    }
}

/// Builds the agent and serves it with the default bounds until `shutdown` completes.
pub async fn serve(
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    serve_with_limits(config, Limits::default(), shutdown).await
}

/// Builds the agent and serves it within `limits` until `shutdown` completes.
pub async fn serve_with_limits(
    config: ServerConfig,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let metrics = Arc::new(Metrics::new());
    let agent = build_agent(&config, &metrics).await?;
    if let Some(addr) = config.metrics_listen {
        if !addr.ip().is_loopback() {
            tracing::warn!(%addr, "metrics are served without authentication on a non-loopback address");
        }
        serve_metrics(addr, Arc::clone(&metrics)).await?;
    }
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(ServerError::Reflection)?
        .max_decoding_message_size(limits.max_request_bytes);
    let agent = AgentServer::new(AgentService::new(agent, metrics))
        .max_decoding_message_size(limits.max_request_bytes);
    let tls = server_tls(&config)?;
    let mut builder = limits.server(Arc::default());
    // `tls` is there exactly where `config.tls` is.
    let router = match &config.tls {
        Some(files) => {
            let expected: Arc<str> = files.authorized_client.as_str().into();
            // Reflection describes the API to whoever asks: only to the authorised client too.
            builder
                .add_service(InterceptedService::new(
                    agent,
                    authorize(Arc::clone(&expected)),
                ))
                .add_service(InterceptedService::new(reflection, authorize(expected)))
        }
        None => builder.add_service(agent).add_service(reflection),
    };
    // On a unix socket every client's authority is accepted (C-core clients send the socket
    // path), read under TLS where TLS is used.
    let incoming = Incoming::new(bind(&config.listen).await?, limits.accept_options(tls));
    router
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(ServerError::Serve)
}
