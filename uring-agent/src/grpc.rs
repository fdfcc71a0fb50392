//! The gRPC edge: request parsing, the one place errors become `tonic::Status`, per-RPC metrics
//! and tracing spans carrying the volume ID.
//!
//! Every request is parsed here into typed values (volume IDs, host NQNs, ports, sizes) before
//! the service sees it; a malformed field is INVALID_ARGUMENT naming the field. Every error
//! leaves as a status with an `ErrorReason` (the contract in the proto, see
//! `pillar_agent_api::error_status`): [`reason_of`] is the table from agent errors to reasons,
//! and the reason fixes the gRPC code.

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error as _;
use std::num::NonZeroU16;
use std::sync::Arc;
use std::time::Instant;

use pillar_agent_api::v1 as api;
use pillar_agent_api::{ErrorReason, code_of, error_status};
use pillar_nvmet::{HostNqn, VolumeId};
use tonic::{Code, Request, Response, Status};
use tracing::Instrument;

use crate::backend::{BackendError, ContentSource};
use crate::engine::EngineError;
use crate::fence::{MarkError, Rejection, Token};
use crate::hooks::Hooks;
use crate::metrics::Metrics;
use crate::service::{Agent, AgentError, ExportRequest, Protocol, Readiness, VolumeSize};
use pillar_nvmet::HostAuth;
use crate::target::TargetError;

/// The reason of every agent error. Changing a row changes the controller's behaviour.
pub fn reason_of(err: &AgentError) -> ErrorReason {
    use ErrorReason as R;
    if overloaded(err) {
        return R::Overloaded;
    }
    match err {
        AgentError::InvalidArgument { .. } => R::InvalidRequest,
        AgentError::UnknownPool { .. } => R::UnknownPool,
        AgentError::VolumeNotFound { .. } => R::VolumeNotFound,
        AgentError::Fenced(rejection) => match rejection {
            Rejection::NoToken => R::NoToken,
            Rejection::StaleGeneration { .. } => R::StaleGeneration,
            Rejection::ForeignOwner { .. } => R::ForeignOwner,
            Rejection::Retired { .. } => R::RetiredLifecycle,
            Rejection::Ended { .. } => R::EndedLifecycle,
        },
        AgentError::Mark(MarkError::Corrupt { .. }) => R::MarkCorrupt,
        AgentError::Mark(MarkError::Unreadable { .. } | MarkError::Write { .. }) => R::MarkIo,
        AgentError::WaitingForResync => R::WaitingForResync,
        AgentError::StateLost => R::StateLost,
        AgentError::Unclaimed { .. } => R::UnclaimedVolume,
        AgentError::StateDir(_) | AgentError::StateIdentity(_) => R::MarkIo,
        AgentError::NotExported { .. } => R::NotExported,
        AgentError::StillExported { .. } => R::StillExported,
        AgentError::Plan { .. } | AgentError::ForeignAclEntry { .. } => R::NoSafePlan,
        AgentError::Backend(b) => match b {
            BackendError::InvalidSize { .. } | BackendError::UnsupportedName { .. } => {
                R::UnsupportedByBackend
            }
            BackendError::SizeUnsupported { .. }
            | BackendError::ShrinkRefused { .. }
            | BackendError::SmallerThanSource { .. } => R::SizeOutOfRange,
            BackendError::SnapshotNotFound { .. } => R::SnapshotNotFound,
            BackendError::SizeMismatch { .. } => R::SizeMismatch,
            BackendError::NotFound { .. } => R::VolumeNotFound,
            BackendError::NotOwned { .. }
            | BackendError::Busy { .. }
            | BackendError::HasDependents { .. }
            | BackendError::InvalidConfig { .. }
            | BackendError::PoolMissing { .. }
            | BackendError::SnapshotsUnsupported { .. } => R::BackendRefused,
            _ => R::BackendFailed,
        },
        AgentError::Target(TargetError::NoNvmet { .. }) => R::NoNvmet,
        AgentError::Target(TargetError::CorruptIdentityRecord { .. }) => R::IdentityRecordCorrupt,
        AgentError::Target(_) => R::TargetFailed,
        AgentError::Verify(_) => R::ReadBackMismatch,
        AgentError::Task(_) => R::AgentFailed,
        AgentError::SourceNotLive { .. } => R::SourceNotLive,
        AgentError::SourceInUse { .. } => R::SourceInUse,
        AgentError::AuthUnsupported { .. } => R::AuthUnsupported,
        AgentError::TlsUnsupported { .. } => R::TlsUnsupported,
        AgentError::Keyring { .. } => R::TargetFailed,
        AgentError::UnmarkedSnapshot { .. } => R::BackendRefused,
    }
}

/// Whether the engine refused a step of the request because it holds as many requests as it
/// admits ([`EngineError::QueueFull`]), at whatever depth (a mark write, a configfs apply, an
/// identity record).
fn overloaded(err: &AgentError) -> bool {
    let mut source = err.source();
    while let Some(e) = source {
        if matches!(e.downcast_ref(), Some(EngineError::QueueFull { .. })) {
            return true;
        }
        source = e.source();
    }
    false
}

/// The error and its causes, one line.
fn describe(err: &AgentError) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn status(err: &AgentError) -> Status {
    error_status(reason_of(err), describe(err))
}

fn invalid(field: &'static str, reason: impl Into<String>) -> AgentError {
    AgentError::InvalidArgument {
        field,
        reason: reason.into(),
    }
}

fn token(t: Option<api::FencingToken>) -> Option<Token> {
    t.map(|t| Token {
        uid: t.lifecycle_uid,
        generation: t.generation,
    })
}

fn volume_id(raw: &str) -> Result<VolumeId, AgentError> {
    VolumeId::parse(raw).map_err(|e| invalid("volume_id", e.to_string()))
}

fn snapshot_id(field: &'static str, raw: &str) -> Result<VolumeId, AgentError> {
    VolumeId::parse(raw).map_err(|e| invalid(field, e.to_string()))
}

/// The content source of a CreateVolume, with the lifecycle UID the caller recorded for it.
fn content_source(
    raw: Option<api::ContentSource>,
) -> Result<Option<(ContentSource, String)>, AgentError> {
    use api::content_source::Source;
    let Some(raw) = raw else {
        return Ok(None);
    };
    let source = match raw.source {
        Some(Source::SnapshotId(id)) => {
            ContentSource::Snapshot(snapshot_id("source.snapshot_id", &id)?)
        }
        Some(Source::VolumeId(id)) => ContentSource::Volume(snapshot_id("source.volume_id", &id)?),
        None => return Err(invalid("source", "names neither a snapshot nor a volume")),
    };
    if raw.lifecycle_uid.is_empty() {
        return Err(invalid("source.lifecycle_uid", "is required"));
    }
    Ok(Some((source, raw.lifecycle_uid)))
}

fn host_nqn(field: &'static str, raw: &str) -> Result<HostNqn, AgentError> {
    HostNqn::parse(raw).map_err(|e| invalid(field, e.to_string()))
}

fn size(raw: u64) -> Result<VolumeSize, AgentError> {
    VolumeSize::new(raw).ok_or_else(|| {
        invalid(
            "size_bytes",
            format!(
                "{raw} is not between 1 and {}",
                crate::backend::MAX_VOLUME_BYTES
            ),
        )
    })
}

fn protocol(raw: Option<api::ExportProtocol>) -> Result<Protocol, AgentError> {
    let raw = raw.ok_or_else(|| invalid("protocol", "is required"))?;
    let service = u16::try_from(raw.service)
        .ok()
        .and_then(NonZeroU16::new)
        .ok_or_else(|| {
            invalid(
                "protocol.service",
                format!("{} is not a TCP port (1-65535)", raw.service),
            )
        })?;
    let auth = raw.acl && !raw.auth_none;
    if raw.tls && !auth {
        return Err(invalid(
            "protocol.tls",
            "TLS needs acl and DH-HMAC-CHAP: each host's PSK is derived from its secret",
        ));
    }
    Ok(Protocol {
        service,
        acl: raw.acl,
        auth,
        tls: raw.tls,
    })
}

/// A host's credentials; the messages name the field, never the secret.
fn credentials(
    field: &'static str,
    raw: api::HostCredentials,
) -> Result<(HostNqn, HostAuth), AgentError> {
    use pillar_nvmet::{DhGroup, DhchapHash, DhchapSecret};
    let host = host_nqn(field, &raw.host_nqn)?;
    let secret =
        DhchapSecret::parse(&raw.dhchap_secret).map_err(|e| invalid(field, e.to_string()))?;
    let ctrl_secret = if raw.dhchap_ctrl_secret.is_empty() {
        None
    } else {
        Some(
            DhchapSecret::parse(&raw.dhchap_ctrl_secret)
                .map_err(|e| invalid(field, format!("controller secret: {e}")))?,
        )
    };
    let hash = if raw.hash.is_empty() {
        DhchapHash::default()
    } else {
        DhchapHash::parse(&raw.hash).map_err(|e| invalid(field, e.to_string()))?
    };
    let dhgroup = if raw.dhgroup.is_empty() {
        DhGroup::default()
    } else {
        DhGroup::parse(&raw.dhgroup).map_err(|e| invalid(field, e.to_string()))?
    };
    Ok((
        host,
        HostAuth {
            secret,
            ctrl_secret,
            hash,
            dhgroup,
        },
    ))
}

fn export_request(r: api::ExportRequest) -> Result<ExportRequest, AgentError> {
    // Parse order (the first bad field is the one named): volume, protocol, hosts, credentials.
    let volume = volume_id(&r.volume_id)?;
    let protocol = protocol(r.protocol)?;
    let allowed_hosts = r
        .allowed_host_nqns
        .iter()
        .map(|h| host_nqn("allowed_host_nqns", h))
        .collect::<Result<BTreeSet<_>, _>>()?;
    let mut creds = BTreeMap::new();
    for raw in r.credentials {
        let (host, auth) = credentials("credentials", raw)?;
        if !allowed_hosts.contains(&host) {
            return Err(invalid(
                "credentials",
                format!("{host} is not among allowed_host_nqns"),
            ));
        }
        creds.insert(host, auth);
    }
    if protocol.auth
        && let Some(missing) = allowed_hosts.iter().find(|h| !creds.contains_key(*h))
    {
        return Err(invalid(
            "credentials",
            format!("the export requires DH-HMAC-CHAP and {missing} has no credentials"),
        ));
    }
    Ok(ExportRequest {
        token: token(r.token),
        volume,
        pool: r.pool,
        protocol,
        allowed_hosts,
        credentials: creds,
    })
}

/// The request-field parsers the handlers below apply to what a client sent, for the fuzz
/// targets (`fuzz/`, through the `test-seams` feature); not part of the crate's API.
#[cfg(feature = "test-seams")]
#[doc(hidden)]
pub mod fuzzing {
    use super::{AgentError, ContentSource, ExportRequest, api};
    use pillar_nvmet::{HostNqn, VolumeId};

    pub fn volume_id(raw: &str) -> Result<VolumeId, AgentError> {
        super::volume_id(raw)
    }

    pub fn snapshot_id(field: &'static str, raw: &str) -> Result<VolumeId, AgentError> {
        super::snapshot_id(field, raw)
    }

    pub fn content_source(
        raw: Option<api::ContentSource>,
    ) -> Result<Option<(ContentSource, String)>, AgentError> {
        super::content_source(raw)
    }

    pub fn host_nqn(field: &'static str, raw: &str) -> Result<HostNqn, AgentError> {
        super::host_nqn(field, raw)
    }

    /// The size, in bytes, of a valid `size_bytes`.
    pub fn size(raw: u64) -> Result<u64, AgentError> {
        super::size(raw).map(|s| s.bytes())
    }

    pub fn export_request(r: api::ExportRequest) -> Result<ExportRequest, AgentError> {
        super::export_request(r)
    }

    /// The gRPC code a client gets for `err`.
    pub fn code(err: &AgentError) -> tonic::Code {
        super::code_of(super::reason_of(err))
    }
}

/// Runs a request on its own task: once started it runs to its end (done, or a durable
/// failure) holding its locks, whatever the caller does (F11). A caller that goes away (a
/// deadline, a crash) drops only the wait for the answer, never the work its locks guard.
/// The task is known to the agent's hooks, so a simulation can abort it as a crash would.
async fn to_the_end<T: Send + 'static>(
    hooks: &Hooks,
    work: impl Future<Output = Result<T, AgentError>> + Send + 'static,
) -> Result<T, AgentError> {
    let task = tokio::spawn(work.in_current_span());
    hooks.track(&task);
    task.await.map_err(AgentError::Task)?
}

fn failed_result(volume: String, err: &AgentError) -> api::resync_exports_response::Result {
    let reason = reason_of(err);
    api::resync_exports_response::Result {
        volume_id: volume,
        ok: false,
        code: format!("{:?}", code_of(reason)),
        message: describe(err),
        reason: reason.into(),
    }
}

/// The tonic service.
#[derive(Debug, Clone)]
pub struct AgentService {
    agent: Arc<Agent>,
    metrics: Arc<Metrics>,
}

impl AgentService {
    /// Serves `agent`.
    pub fn new(agent: Arc<Agent>, metrics: Arc<Metrics>) -> Self {
        Self { agent, metrics }
    }

    /// Runs one RPC in a span, records its latency and maps its error.
    async fn call<T>(
        &self,
        method: &'static str,
        volume: &str,
        work: impl Future<Output = Result<T, AgentError>>,
    ) -> Result<Response<T>, Status> {
        let span = tracing::info_span!("rpc", method, volume_id = volume);
        let started = Instant::now();
        let result = work.instrument(span.clone()).await;
        let code = result
            .as_ref()
            .map_or_else(|e| code_of(reason_of(e)), |_| Code::Ok);
        self.metrics
            .rpc(method, code, started.elapsed().as_secs_f64());
        match result {
            Ok(v) => Ok(Response::new(v)),
            Err(e) => {
                let _entered = span.enter();
                // The resync refusal is the expected answer after every start: not an error.
                let expected = matches!(e, AgentError::WaitingForResync);
                if !expected && matches!(code, Code::Internal | Code::DataLoss | Code::Unavailable)
                {
                    tracing::error!(code = ?code, "{}", describe(&e));
                } else {
                    tracing::info!(code = ?code, "{}", describe(&e));
                }
                Err(status(&e))
            }
        }
    }
}

#[tonic::async_trait]
impl api::agent_server::Agent for AgentService {
    async fn get_capabilities(
        &self,
        _: Request<api::GetCapabilitiesRequest>,
    ) -> Result<Response<api::GetCapabilitiesResponse>, Status> {
        let agent = &self.agent;
        self.call("GetCapabilities", "", async {
            Ok(api::GetCapabilitiesResponse {
                agent_version: env!("CARGO_PKG_VERSION").to_owned(),
                engine: agent.engine().name().to_owned(),
                target: agent.target().kind().to_owned(),
                pools: agent
                    .pools()
                    .map(|(name, kind)| api::Pool {
                        name: name.to_owned(),
                        kind: kind.to_owned(),
                    })
                    .collect(),
            })
        })
        .await
    }

    async fn health(
        &self,
        _: Request<api::HealthRequest>,
    ) -> Result<Response<api::HealthResponse>, Status> {
        let agent = &self.agent;
        self.call("Health", "", async {
            let (state, message) = match agent.readiness().await {
                Readiness::WaitingForResync => (
                    api::health_response::State::WaitingForResync,
                    "waiting for the controller's export resync; no export is created until then",
                ),
                Readiness::Serving => (api::health_response::State::Serving, "serving"),
                Readiness::StateLost => (
                    api::health_response::State::Lost,
                    "the state directory was lost; every change is refused until the controller re-seeds the marks",
                ),
            };
            Ok(api::HealthResponse {
                state: state.into(),
                message: message.to_owned(),
                boot_id: agent.boot_id().to_owned(),
                unrestored_volume_ids: agent.unrestored().iter().map(ToString::to_string).collect(),
                state_epoch: agent.state_epoch().unwrap_or_default(),
                unclaimed_volume_ids: agent.unclaimed().iter().map(ToString::to_string).collect(),
            })
        })
        .await
    }

    async fn create_volume(
        &self,
        r: Request<api::CreateVolumeRequest>,
    ) -> Result<Response<api::CreateVolumeResponse>, Status> {
        let r = r.into_inner();
        let agent = Arc::clone(&self.agent);
        self.call("CreateVolume", &r.volume_id.clone(), async move {
            let volume = volume_id(&r.volume_id)?;
            let size = size(r.size_bytes)?;
            let source = content_source(r.source)?;
            let info = to_the_end(self.agent.hooks(), async move {
                match source {
                    None => {
                        agent
                            .create_volume(token(r.token), &volume, &r.pool, size)
                            .await
                    }
                    Some((source, uid)) => {
                        agent
                            .create_volume_from(
                                token(r.token),
                                &volume,
                                &r.pool,
                                size,
                                &source,
                                &uid,
                            )
                            .await
                    }
                }
            })
            .await?;
            Ok(api::CreateVolumeResponse {
                size_bytes: info.size_bytes,
            })
        })
        .await
    }

    async fn create_snapshot(
        &self,
        r: Request<api::CreateSnapshotRequest>,
    ) -> Result<Response<api::CreateSnapshotResponse>, Status> {
        let r = r.into_inner();
        let agent = Arc::clone(&self.agent);
        self.call("CreateSnapshot", &r.source_volume_id.clone(), async move {
            let snapshot = snapshot_id("snapshot_id", &r.snapshot_id)?;
            let source = snapshot_id("source_volume_id", &r.source_volume_id)?;
            if r.source_lifecycle_uid.is_empty() {
                return Err(invalid("source_lifecycle_uid", "is required"));
            }
            let info = to_the_end(self.agent.hooks(), async move {
                agent
                    .create_snapshot(
                        token(r.token),
                        &snapshot,
                        &r.pool,
                        &source,
                        &r.source_lifecycle_uid,
                    )
                    .await
            })
            .await?;
            let since = info
                .created
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            Ok(api::CreateSnapshotResponse {
                size_bytes: info.size_bytes,
                creation_unix_seconds: i64::try_from(since.as_secs()).unwrap_or(i64::MAX),
                creation_nanos: i32::try_from(since.subsec_nanos())
                    .expect("sub-second nanoseconds fit in an i32"),
                method: info.method.unwrap_or_default().to_owned(),
            })
        })
        .await
    }

    async fn delete_snapshot(
        &self,
        r: Request<api::DeleteSnapshotRequest>,
    ) -> Result<Response<api::DeleteSnapshotResponse>, Status> {
        let r = r.into_inner();
        let agent = Arc::clone(&self.agent);
        self.call("DeleteSnapshot", &r.snapshot_id.clone(), async move {
            let snapshot = snapshot_id("snapshot_id", &r.snapshot_id)?;
            to_the_end(self.agent.hooks(), async move {
                agent
                    .delete_snapshot(token(r.token), &snapshot, &r.pool)
                    .await
            })
            .await?;
            Ok(api::DeleteSnapshotResponse {})
        })
        .await
    }

    async fn expand_volume(
        &self,
        r: Request<api::ExpandVolumeRequest>,
    ) -> Result<Response<api::ExpandVolumeResponse>, Status> {
        let r = r.into_inner();
        let agent = Arc::clone(&self.agent);
        self.call("ExpandVolume", &r.volume_id.clone(), async move {
            let volume = volume_id(&r.volume_id)?;
            let size = size(r.size_bytes)?;
            let info = to_the_end(self.agent.hooks(), async move {
                agent
                    .expand_volume(token(r.token), &volume, &r.pool, size)
                    .await
            })
            .await?;
            Ok(api::ExpandVolumeResponse {
                size_bytes: info.size_bytes,
            })
        })
        .await
    }

    async fn delete_volume(
        &self,
        r: Request<api::DeleteVolumeRequest>,
    ) -> Result<Response<api::DeleteVolumeResponse>, Status> {
        let r = r.into_inner();
        let agent = Arc::clone(&self.agent);
        self.call("DeleteVolume", &r.volume_id.clone(), async move {
            let volume = volume_id(&r.volume_id)?;
            to_the_end(self.agent.hooks(), async move {
                agent.delete_volume(token(r.token), &volume, &r.pool).await
            })
            .await?;
            Ok(api::DeleteVolumeResponse {})
        })
        .await
    }

    async fn export(
        &self,
        r: Request<api::ExportRequest>,
    ) -> Result<Response<api::ExportResponse>, Status> {
        let r = r.into_inner();
        let agent = Arc::clone(&self.agent);
        self.call("Export", &r.volume_id.clone(), async move {
            let request = export_request(r)?;
            let done = to_the_end(
                self.agent.hooks(),
                async move { agent.export(request).await },
            )
            .await?;
            Ok(api::ExportResponse {
                subsystem_nqn: done.nqn.to_string(),
                target_address: done.address.ip().to_string(),
                target_service: u32::from(done.address.port()),
                identity_adopted: done.identity_adopted,
            })
        })
        .await
    }

    async fn unexport(
        &self,
        r: Request<api::UnexportRequest>,
    ) -> Result<Response<api::UnexportResponse>, Status> {
        let r = r.into_inner();
        let agent = Arc::clone(&self.agent);
        self.call("Unexport", &r.volume_id.clone(), async move {
            let volume = volume_id(&r.volume_id)?;
            to_the_end(self.agent.hooks(), async move {
                agent.unexport(token(r.token), &volume).await
            })
            .await?;
            Ok(api::UnexportResponse {})
        })
        .await
    }

    async fn grant_initiator(
        &self,
        r: Request<api::GrantInitiatorRequest>,
    ) -> Result<Response<api::GrantInitiatorResponse>, Status> {
        let r = r.into_inner();
        let agent = Arc::clone(&self.agent);
        self.call("GrantInitiator", &r.volume_id.clone(), async move {
            let volume = volume_id(&r.volume_id)?;
            let host = host_nqn("host_nqn", &r.host_nqn)?;
            let creds = match r.credentials {
                None => None,
                Some(raw) => {
                    let (named, auth) = credentials("credentials", raw)?;
                    if named != host {
                        return Err(invalid(
                            "credentials.host_nqn",
                            format!("names {named}, not the granted {host}"),
                        ));
                    }
                    Some(auth)
                }
            };
            to_the_end(self.agent.hooks(), async move {
                agent.grant(token(r.token), &volume, &host, creds).await
            })
            .await?;
            Ok(api::GrantInitiatorResponse {})
        })
        .await
    }

    async fn revoke_initiator(
        &self,
        r: Request<api::RevokeInitiatorRequest>,
    ) -> Result<Response<api::RevokeInitiatorResponse>, Status> {
        let r = r.into_inner();
        let agent = Arc::clone(&self.agent);
        self.call("RevokeInitiator", &r.volume_id.clone(), async move {
            let volume = volume_id(&r.volume_id)?;
            let host = host_nqn("host_nqn", &r.host_nqn)?;
            to_the_end(self.agent.hooks(), async move {
                agent.revoke(token(r.token), &volume, &host).await
            })
            .await?;
            Ok(api::RevokeInitiatorResponse {})
        })
        .await
    }

    async fn resync_exports(
        &self,
        r: Request<api::ResyncExportsRequest>,
    ) -> Result<Response<api::ResyncExportsResponse>, Status> {
        let r = r.into_inner();
        let agent = Arc::clone(&self.agent);
        self.call("ResyncExports", "", async move {
            let epoch = r.state_epoch;
            let mut requests = Vec::with_capacity(r.exports.len());
            let mut results = Vec::new();
            for e in r.exports {
                let volume = e.volume_id.clone();
                match export_request(e) {
                    Ok(req) => requests.push(req),
                    Err(err) => results.push(failed_result(volume, &err)),
                }
            }
            let (outcomes, unlisted) = to_the_end(self.agent.hooks(), async move {
                agent.resync(requests, &epoch).await
            })
            .await?;
            results.extend(outcomes.into_iter().map(|o| match o.result {
                Ok(_) => api::resync_exports_response::Result {
                    volume_id: o.volume.to_string(),
                    ok: true,
                    code: "Ok".into(),
                    message: String::new(),
                    reason: ErrorReason::Unspecified.into(),
                },
                Err(err) => failed_result(o.volume.to_string(), &err),
            }));
            Ok(api::ResyncExportsResponse {
                results,
                unlisted_volume_ids: unlisted,
            })
        })
        .await
    }

    async fn list_volumes(
        &self,
        r: Request<api::ListVolumesRequest>,
    ) -> Result<Response<api::ListVolumesResponse>, Status> {
        let r = r.into_inner();
        let agent = &self.agent;
        self.call("ListVolumes", "", async move {
            let volumes = agent
                .list_volumes(&r.pool)
                .await?
                .into_iter()
                .map(|(pool, v)| api::Volume {
                    volume_id: v.volume.to_string(),
                    pool,
                    size_bytes: v.size_bytes,
                    device_path: v.device_path.display().to_string(),
                })
                .collect();
            Ok(api::ListVolumesResponse { volumes })
        })
        .await
    }

    async fn list_exports(
        &self,
        _: Request<api::ListExportsRequest>,
    ) -> Result<Response<api::ListExportsResponse>, Status> {
        let agent = &self.agent;
        self.call("ListExports", "", async move {
            let exports = agent
                .list_exports()
                .await?
                .into_iter()
                .map(|e| api::ExportInfo {
                    volume_id: e.volume.to_string(),
                    subsystem_nqn: e.nqn,
                    device_path: e.device_path,
                    acl: e.acl,
                    allowed_host_nqns: e.allowed_hosts,
                    services: e.services.into_iter().map(u32::from).collect(),
                    enabled: e.enabled,
                })
                .collect();
            Ok(api::ListExportsResponse { exports })
        })
        .await
    }

    async fn get_capacity(
        &self,
        r: Request<api::GetCapacityRequest>,
    ) -> Result<Response<api::GetCapacityResponse>, Status> {
        let r = r.into_inner();
        let agent = &self.agent;
        self.call("GetCapacity", "", async move {
            let c = agent.capacity(&r.pool).await?;
            Ok(api::GetCapacityResponse {
                total_bytes: c.total_bytes,
                available_bytes: c.available_bytes,
            })
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    //! The request parsers the handlers run, on arbitrary field values. Bounded for CI: 512
    //! cases per property.
    #![allow(clippy::unwrap_used)]

    use pillar_nvmet::DISCOVERY_NQN;
    use proptest::prelude::*;

    use super::*;

    /// Almost-valid and arbitrary text, so both the accept and the reject branches are reached.
    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            "[a-zA-Z0-9._/ -]{0,140}",
            "nqn\\.2014-08\\.org\\.nvmexpress:uuid:[0-9a-f-]{34,38}",
            "nqn\\.20[0-9]{2}-[01][0-9]\\.[a-z.]{1,10}:[ -~]{0,30}",
        ]
    }

    fn size_value() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(0),
            Just(crate::backend::MAX_VOLUME_BYTES),
            Just(crate::backend::MAX_VOLUME_BYTES + 1),
            any::<u64>(),
            1u64..1 << 40,
        ]
    }

    fn export_raw() -> impl Strategy<Value = api::ExportRequest> {
        (
            prop::option::of((any::<String>(), any::<u64>())),
            text(),
            any::<String>(),
            prop::option::of((
                prop_oneof![Just(0u32), 1u32..=65535, any::<u32>()],
                any::<bool>(),
            )),
            prop::collection::vec(text(), 0..4),
        )
            .prop_map(|(t, volume_id, pool, p, hosts)| api::ExportRequest {
                token: t.map(|(lifecycle_uid, generation)| api::FencingToken {
                    lifecycle_uid,
                    generation,
                }),
                volume_id,
                pool,
                protocol: p.map(|(service, acl)| api::ExportProtocol { service, acl, auth_none: true, tls: false }),
                allowed_host_nqns: hosts,
                credentials: vec![],
            })
    }

    // The engine's bound at the edge: a request the engine refused because it holds as many as
    // it admits leaves as UNAVAILABLE with the Overloaded reason, whichever step met it.
    #[test]
    fn a_request_the_full_engine_refused_is_unavailable_and_overloaded() {
        let full = || EngineError::QueueFull { limit: 8 };
        for err in [
            AgentError::Mark(MarkError::Write {
                volume: "v1".into(),
                source: full(),
            }),
            AgentError::Target(TargetError::Apply(full())),
            AgentError::Target(TargetError::WriteIdentityRecord {
                volume: "v1".into(),
                source: full(),
            }),
        ] {
            let status = status(&err);
            assert_eq!(status.code(), Code::Unavailable, "{err:?}");
            assert_eq!(
                pillar_agent_api::reason_of(&status),
                ErrorReason::Overloaded,
                "{err:?}"
            );
        }
    }

    /// A rejected request leaves as INVALID_ARGUMENT with the InvalidRequest reason, naming the
    /// field.
    fn rejected_as_invalid(err: &AgentError, field: &str) -> Result<(), TestCaseError> {
        prop_assert!(
            matches!(err, AgentError::InvalidArgument { field: f, .. } if f.starts_with(field)),
            "{err:?}"
        );
        let status = status(err);
        prop_assert_eq!(status.code(), Code::InvalidArgument);
        prop_assert_eq!(
            pillar_agent_api::reason_of(&status),
            ErrorReason::InvalidRequest
        );
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        // proves C4 at the edge (nothing malformed reaches the service): the field parsers that
        // every handler runs accept exactly the documented values and reject the rest as
        // INVALID_ARGUMENT naming the field.
        #[test]
        fn field_parsers_accept_only_valid_values(raw in text(), bytes in size_value()) {
            match volume_id(&raw) {
                Ok(v) => prop_assert_eq!(VolumeId::parse(&raw).unwrap(), v),
                Err(e) => rejected_as_invalid(&e, "volume_id")?,
            }
            match host_nqn("host_nqn", &raw) {
                Ok(h) => {
                    prop_assert_eq!(h.as_str(), raw.as_str());
                    prop_assert!(raw != DISCOVERY_NQN);
                    prop_assert!(!raw.contains(['/', ',']) && !raw.chars().any(char::is_whitespace));
                }
                Err(e) => rejected_as_invalid(&e, "host_nqn")?,
            }
            match size(bytes) {
                Ok(s) => prop_assert!(s.bytes() == bytes && (1..=crate::backend::MAX_VOLUME_BYTES).contains(&bytes)),
                Err(e) => {
                    prop_assert!(bytes == 0 || bytes > crate::backend::MAX_VOLUME_BYTES);
                    rejected_as_invalid(&e, "size_bytes")?;
                }
            }
        }

        // proves C4, W6 at the edge: an Export (and each entry of a ResyncExports, which runs
        // the same parser) is accepted only with a valid volume ID, a TCP port 1-65535 and valid
        // host NQNs; the typed request carries exactly those values; the token is passed through
        // untouched for the fence to judge (a missing token is the fence's FAILED_PRECONDITION,
        // not a parse error).
        #[test]
        fn export_requests_parse_to_valid_typed_values(raw in export_raw()) {
            let sent = raw.clone();
            match export_request(raw) {
                Ok(req) => {
                    prop_assert_eq!(req.volume.as_str(), sent.volume_id.as_str());
                    prop_assert_eq!(&req.pool, &sent.pool);
                    let p = sent.protocol.unwrap();
                    prop_assert_eq!(u32::from(req.protocol.service.get()), p.service);
                    prop_assert_eq!(req.protocol.acl, p.acl);
                    let hosts: BTreeSet<&str> = sent.allowed_host_nqns.iter().map(String::as_str).collect();
                    let typed: BTreeSet<&str> = req.allowed_hosts.iter().map(HostNqn::as_str).collect();
                    prop_assert_eq!(hosts, typed);
                    prop_assert_eq!(
                        req.token,
                        sent.token.map(|t| Token { uid: t.lifecycle_uid, generation: t.generation })
                    );
                }
                Err(e) => {
                    let field = match &e {
                        AgentError::InvalidArgument { field, .. } => *field,
                        other => return Err(TestCaseError::fail(format!("{other:?}"))),
                    };
                    prop_assert!(
                        ["volume_id", "protocol", "protocol.service", "allowed_host_nqns"].contains(&field),
                        "{field}"
                    );
                    rejected_as_invalid(&e, field)?;
                    // The first bad field in parse order is the one named.
                    let volume_ok = VolumeId::parse(&sent.volume_id).is_ok();
                    prop_assert_eq!(field == "volume_id", !volume_ok);
                }
            }
        }
    }
}
