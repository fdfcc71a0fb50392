//! The CSI Controller service: who may use a volume, recorded before anything is granted.
//!
//! Invariants (REQUIREMENTS W, F, C):
//! - The PillarVolumeState is created before anything exists on a storage node (F10); a volume
//!   without one owns nothing, and deleting it needs no agent call.
//! - Every agent call that changes a volume carries a token: the PillarVolumeState's UID and a
//!   `publicationGeneration` bumped by compare-and-swap, pinned to the UID the operation started
//!   with (F2, F3). A lifecycle that disappeared or was re-created is ABORTED.
//! - A publication is recorded (CAS) before the agent grants it (W1), and checked against every
//!   recorded publication (W2). A record is removed only after the agent confirmed the revoke
//!   (W4); a failed revoke or a missing PillarAgent keeps it.
//! - DeleteVolume refuses while any publication is recorded (W5), and fails when the
//!   PillarAgent is missing (C1).
//! - When an agent restarted (it reports WAITING_FOR_RESYNC), it is sent the complete export
//!   state of its node before anything else (C3).
//! - Every store write is a compare-and-swap; a stale read is re-read and retried, never
//!   overwritten.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use pillar_agent_api::v1 as agent_api;
use pillar_nvmet::VolumeId;
use pillar_state::crd::{
    AccessMode, PillarAgent, PillarProtocol, PillarVolumeState, PillarVolumeStateSpec,
    PillarVolumeStateStatus, PublishedNode, VolumeMode,
};
use pillar_state::store::{Revision, StateStore, StoreError};
use tokio::sync::{Mutex, OwnedMutexGuard};
use tonic::{Code, Request, Response, Status};

use crate::agents::{Agents, Client, ConnectError};
use crate::context;
use crate::csi;
use crate::node_id::NodeId;

/// StorageClass parameters pillar understands.
pub mod params {
    /// The PillarAgent (storage node) to provision on; optional when there is exactly one.
    pub const AGENT: &str = "pillar.io/agent";
    /// The pool on that agent; optional when the agent has exactly one.
    pub const POOL: &str = "pillar.io/pool";
    /// The PillarProtocol; optional when there is exactly one.
    pub const PROTOCOL: &str = "pillar.io/protocol";
}

/// Size of a volume created without a capacity range.
pub const DEFAULT_VOLUME_BYTES: u64 = 1 << 30;
/// How often a contended compare-and-swap is retried before the call is ABORTED.
const CAS_ATTEMPTS: usize = 32;

/// Why a controller call failed. Mapped to gRPC codes once, in [`code_of`].
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("volume {0} does not exist")]
    VolumeNotFound(String),
    #[error("node {0:?} is unknown: {1}")]
    NodeNotFound(String, String),
    #[error("volume {0} already exists with other properties: {1}")]
    AlreadyExists(String, String),
    #[error(
        "volume {volume} is published to node {node} ({mode:?}); a single-node volume cannot be published to {requested}"
    )]
    PublishedElsewhere {
        volume: String,
        node: String,
        mode: AccessMode,
        requested: String,
    },
    #[error(
        "volume {volume} is already published to node {node} with another capability or readonly flag"
    )]
    PublishedDifferently { volume: String, node: String },
    #[error("volume {volume} is still being unpublished from node {node}; retry")]
    Revoking { volume: String, node: String },
    #[error("volume {volume} is still published to {nodes:?}; unpublish it first")]
    StillPublished { volume: String, nodes: Vec<String> },
    #[error(
        "PillarAgent {agent:?} of volume {volume} does not exist; refusing to act without the storage node"
    )]
    AgentMissing { volume: String, agent: String },
    #[error("PillarProtocol {0:?} does not exist")]
    ProtocolMissing(String),
    #[error(
        "the lifecycle of volume {volume} that this call started on is gone (deleted or re-created); aborting"
    )]
    LifecycleGone { volume: String },
    #[error("volume {volume}: too many concurrent updates; retry")]
    Contention { volume: String },
    #[error("{0}")]
    OutOfRange(String),
    #[error("state store")]
    Store(#[from] StoreError),
    #[error("connecting to the agent")]
    Connect(#[from] ConnectError),
    #[error("agent call {call} for volume {volume} failed: {status}")]
    Agent {
        call: &'static str,
        volume: String,
        status: Status,
    },
    #[error("{0}")]
    Unimplemented(&'static str),
}

/// The gRPC code of every controller error.
pub fn code_of(err: &ControllerError) -> Code {
    match err {
        ControllerError::InvalidArgument(_) => Code::InvalidArgument,
        ControllerError::VolumeNotFound(_) | ControllerError::NodeNotFound(..) => Code::NotFound,
        ControllerError::AlreadyExists(..) | ControllerError::PublishedDifferently { .. } => {
            Code::AlreadyExists
        }
        ControllerError::PublishedElsewhere { .. }
        | ControllerError::StillPublished { .. }
        | ControllerError::AgentMissing { .. }
        | ControllerError::ProtocolMissing(_) => Code::FailedPrecondition,
        ControllerError::Revoking { .. }
        | ControllerError::LifecycleGone { .. }
        | ControllerError::Contention { .. } => Code::Aborted,
        ControllerError::OutOfRange(_) => Code::OutOfRange,
        ControllerError::Store(e) if e.is_conflict() || e.is_lifecycle_gone() => Code::Aborted,
        ControllerError::Store(_) => Code::Unavailable,
        ControllerError::Connect(_) => Code::Unavailable,
        ControllerError::Agent { status, .. } => match status.code() {
            // The agent refused our token: another operation on the volume overtook this one.
            Code::FailedPrecondition if status.message().contains("stale") => Code::Aborted,
            Code::Unavailable
            | Code::DeadlineExceeded
            | Code::OutOfRange
            | Code::AlreadyExists
            | Code::FailedPrecondition
            | Code::Aborted
            | Code::ResourceExhausted => status.code(),
            _ => Code::Internal,
        },
        ControllerError::Unimplemented(_) => Code::Unimplemented,
    }
}

fn describe(err: &ControllerError) -> String {
    crate::error_chain(err)
}

fn to_status(err: &ControllerError) -> Status {
    Status::new(code_of(err), describe(err))
}

/// Settings of the controller.
#[derive(Clone, Debug)]
pub struct ControllerSettings {
    /// How often agents are checked for a restart that needs a resync.
    pub resync_interval: Duration,
}

/// The controller.
#[derive(Debug)]
pub struct Controller {
    store: Arc<dyn StateStore>,
    agents: Arc<Agents>,
    locks: std::sync::Mutex<HashMap<String, Arc<Mutex<()>>>>,
    resync_lock: Mutex<()>,
}

fn access_mode(mode: i32) -> Result<AccessMode, ControllerError> {
    use csi::volume_capability::access_mode::Mode;
    match Mode::try_from(mode) {
        Ok(Mode::SingleNodeWriter) => Ok(AccessMode::SingleNodeWriter),
        Ok(Mode::SingleNodeReaderOnly) => Ok(AccessMode::SingleNodeReaderOnly),
        Ok(Mode::MultiNodeReaderOnly) => Ok(AccessMode::MultiNodeReaderOnly),
        Ok(Mode::MultiNodeSingleWriter) => Ok(AccessMode::MultiNodeSingleWriter),
        Ok(Mode::SingleNodeSingleWriter) => Ok(AccessMode::SingleNodeSingleWriter),
        Ok(Mode::SingleNodeMultiWriter) => Ok(AccessMode::SingleNodeMultiWriter),
        Ok(Mode::MultiNodeMultiWriter) => Err(ControllerError::InvalidArgument(
            "MULTI_NODE_MULTI_WRITER (RWX) is not supported: pillar volumes have one writer".into(),
        )),
        Ok(Mode::Unknown) | Err(_) => Err(ControllerError::InvalidArgument(format!(
            "access mode {mode} is not supported"
        ))),
    }
}

/// The access mode and volume mode of a capability, or why it is unsupported.
fn capability(cap: &csi::VolumeCapability) -> Result<(AccessMode, VolumeMode), ControllerError> {
    let mode = cap.access_mode.as_ref().ok_or_else(|| {
        ControllerError::InvalidArgument("volume capability has no access mode".into())
    })?;
    let mode = access_mode(mode.mode)?;
    let volume_mode = match &cap.access_type {
        Some(csi::volume_capability::AccessType::Block(_)) => VolumeMode::Block,
        Some(csi::volume_capability::AccessType::Mount(m)) => {
            if !matches!(m.fs_type.as_str(), "" | "ext4" | "xfs") {
                return Err(ControllerError::InvalidArgument(format!(
                    "filesystem {:?} is not supported (ext4 or xfs)",
                    m.fs_type
                )));
            }
            VolumeMode::Filesystem
        }
        None => {
            return Err(ControllerError::InvalidArgument(
                "volume capability has no access type".into(),
            ));
        }
    };
    Ok((mode, volume_mode))
}

fn capabilities(
    caps: &[csi::VolumeCapability],
) -> Result<(AccessMode, VolumeMode), ControllerError> {
    let mut parsed = caps.iter().map(capability);
    let first = parsed.next().ok_or_else(|| {
        ControllerError::InvalidArgument("volume capabilities are required".into())
    })??;
    for next in parsed {
        let (_, vm) = next?;
        if vm != first.1 {
            return Err(ControllerError::InvalidArgument(
                "block and mount capabilities cannot be mixed".into(),
            ));
        }
    }
    Ok(first)
}

/// Whether `id` is a volume ID pillar issues: a pillar `VolumeId` that is also a valid
/// Kubernetes object name (the PillarVolumeState is named after it).
fn volume_name(id: &str) -> Result<VolumeId, ControllerError> {
    if id.is_empty() {
        return Err(ControllerError::InvalidArgument(
            "volume ID is required".into(),
        ));
    }
    let volume =
        VolumeId::parse(id).map_err(|e| ControllerError::InvalidArgument(e.to_string()))?;
    pillar_state::store::validate_name("PillarVolumeState", id)
        .map_err(|e| ControllerError::InvalidArgument(e.to_string()))?;
    Ok(volume)
}

/// The volume ID for a CreateVolume `name`. CSI allows any Unicode name but a few control
/// characters; Kubernetes sends `pvc-<uuid>`. A name that already is a valid ID is kept, so IDs
/// stay readable; any other name maps to `pillar-` + the first 128 bits of its SHA-256 in hex.
/// The map is a function of the name, so retries of one name find the same volume.
pub fn volume_id_for_name(name: &str) -> Result<VolumeId, ControllerError> {
    if name.is_empty() {
        return Err(ControllerError::InvalidArgument("name is required".into()));
    }
    let banned = |c: char| matches!(c, '\u{0}'..='\u{8}' | '\u{b}' | '\u{c}' | '\u{e}'..='\u{1f}' | '\u{7f}'..='\u{9f}');
    if name.chars().any(banned) {
        return Err(ControllerError::InvalidArgument(
            "name contains a control character CSI does not allow".into(),
        ));
    }
    if let Ok(volume) = volume_name(name) {
        return Ok(volume);
    }
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(name.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    VolumeId::parse(&format!("pillar-{hex}"))
        .map_err(|e| ControllerError::InvalidArgument(e.to_string()))
}

fn agent_err<'a>(
    call: &'static str,
    volume: &'a str,
) -> impl FnOnce(Status) -> ControllerError + 'a {
    move |status| ControllerError::Agent {
        call,
        volume: volume.to_owned(),
        status,
    }
}

fn token(uid: &str, generation: u64) -> Option<agent_api::FencingToken> {
    Some(agent_api::FencingToken {
        lifecycle_uid: uid.to_owned(),
        generation,
    })
}

/// Whether a publication may coexist with publications on other nodes: only read-only access
/// with a multi-node mode (ROX, or a read-only MULTI_NODE_SINGLE_WRITER) is shared.
fn shareable(p: &PublishedNode) -> bool {
    p.access_mode.is_multi_node()
        && (p.readonly || p.access_mode == AccessMode::MultiNodeReaderOnly)
}

impl Controller {
    /// A controller over `store`, reaching agents through `agents`.
    pub fn new(store: Arc<dyn StateStore>, agents: Arc<Agents>) -> Arc<Self> {
        Arc::new(Self {
            store,
            agents,
            locks: std::sync::Mutex::new(HashMap::new()),
            resync_lock: Mutex::new(()),
        })
    }

    async fn lock(&self, name: &str) -> OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self
                .locks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            Arc::clone(locks.entry(name.to_owned()).or_default())
        };
        lock.lock_owned().await
    }

    /// Read-modify-CAS of a volume's status, pinned to `uid`, retried on conflict. `change`
    /// returns `Ok(None)` to leave the status as is.
    async fn update_status<T>(
        &self,
        name: &str,
        uid: &str,
        mut change: impl FnMut(
            &PillarVolumeState,
            &mut PillarVolumeStateStatus,
        ) -> Result<T, ControllerError>,
    ) -> Result<(PillarVolumeState, T), ControllerError> {
        for _ in 0..CAS_ATTEMPTS {
            let current = self.store.get_volume(name).await?;
            let Some(current) = current.filter(|v| v.metadata.uid.as_deref() == Some(uid)) else {
                return Err(ControllerError::LifecycleGone {
                    volume: name.to_owned(),
                });
            };
            let mut status = current.status_or_default();
            let out = change(&current, &mut status)?;
            let rev = Revision::of(&current)?;
            match self.store.replace_volume_status(name, &rev, status).await {
                Ok(updated) => return Ok((updated, out)),
                Err(e) if e.is_conflict() => continue,
                Err(e) if e.is_lifecycle_gone() => {
                    return Err(ControllerError::LifecycleGone {
                        volume: name.to_owned(),
                    });
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ControllerError::Contention {
            volume: name.to_owned(),
        })
    }

    /// A fresh fencing token for `name`'s lifecycle `uid` (F2, F3).
    async fn next_token(
        &self,
        name: &str,
        uid: &str,
    ) -> Result<Option<agent_api::FencingToken>, ControllerError> {
        let (v, ()) = self
            .update_status(name, uid, |_, s| {
                s.publication_generation += 1;
                Ok(())
            })
            .await?;
        Ok(token(uid, v.status_or_default().publication_generation))
    }

    async fn agent_of(
        &self,
        volume: &PillarVolumeState,
    ) -> Result<(PillarAgent, Client), ControllerError> {
        let name = &volume.spec.agent;
        let agent =
            self.store
                .get_agent(name)
                .await?
                .ok_or_else(|| ControllerError::AgentMissing {
                    volume: volume.spec.volume_id.clone(),
                    agent: name.clone(),
                })?;
        let client = self.agents.client(&agent).await?;
        Ok((agent, client))
    }

    async fn protocol_of(
        &self,
        volume: &PillarVolumeState,
    ) -> Result<PillarProtocol, ControllerError> {
        self.store
            .get_protocol(&volume.spec.protocol)
            .await?
            .ok_or_else(|| ControllerError::ProtocolMissing(volume.spec.protocol.clone()))
    }

    fn export_request(
        volume: &PillarVolumeState,
        protocol: &PillarProtocol,
        token: Option<agent_api::FencingToken>,
    ) -> agent_api::ExportRequest {
        let status = volume.status_or_default();
        agent_api::ExportRequest {
            token,
            volume_id: volume.spec.volume_id.clone(),
            pool: volume.spec.pool.clone(),
            protocol: Some(agent_api::ExportProtocol {
                service: u32::from(protocol.spec.nvme_tcp.port),
                acl: protocol.spec.nvme_tcp.acl,
            }),
            // A host being revoked is not re-admitted by an export.
            allowed_host_nqns: status
                .published_nodes
                .iter()
                .filter(|p| !p.revoking)
                .map(|p| p.host_nqn.clone())
                .collect(),
        }
    }

    /// Runs an agent call; when the agent says it waits for a resync, resyncs it and retries
    /// once.
    async fn with_resync<T, F, Fut>(
        &self,
        agent: &PillarAgent,
        client: &Client,
        mut call: F,
    ) -> Result<T, Status>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        match call(client.clone()).await {
            Err(s) if s.code() == Code::Unavailable && s.message().contains("resync") => {
                if let Err(e) = self.resync_agent(agent).await {
                    return Err(Status::unavailable(format!(
                        "agent waits for a resync, and the resync failed: {}",
                        describe(&e)
                    )));
                }
                call(client.clone()).await
            }
            other => other,
        }
    }

    // ------------------------------------------------------------------ CreateVolume

    async fn pick_agent(
        &self,
        parameters: &HashMap<String, String>,
    ) -> Result<(PillarAgent, String), ControllerError> {
        let agent = match parameters.get(params::AGENT) {
            Some(name) => self.store.get_agent(name).await?.ok_or_else(|| {
                ControllerError::InvalidArgument(format!(
                    "PillarAgent {name:?} named in {} does not exist",
                    params::AGENT
                ))
            })?,
            None => {
                let mut all = self.store.list_agents().await?;
                if all.len() != 1 {
                    return Err(ControllerError::InvalidArgument(format!(
                        "{} agents exist; name one with the {} parameter",
                        all.len(),
                        params::AGENT
                    )));
                }
                all.remove(0)
            }
        };
        let pool = match parameters.get(params::POOL) {
            Some(p) => {
                if !agent.spec.pools.iter().any(|x| x.name == *p) {
                    return Err(ControllerError::InvalidArgument(format!(
                        "agent has no pool {p:?}"
                    )));
                }
                p.clone()
            }
            None => match agent.spec.pools.as_slice() {
                [only] => only.name.clone(),
                _ => {
                    return Err(ControllerError::InvalidArgument(format!(
                        "name the pool with the {} parameter",
                        params::POOL
                    )));
                }
            },
        };
        Ok((agent, pool))
    }

    async fn pick_protocol(
        &self,
        parameters: &HashMap<String, String>,
    ) -> Result<PillarProtocol, ControllerError> {
        match parameters.get(params::PROTOCOL) {
            Some(name) => self
                .store
                .get_protocol(name)
                .await?
                .ok_or_else(|| ControllerError::ProtocolMissing(name.clone())),
            None => {
                let mut all = self.store.list_protocols().await?;
                if all.len() != 1 {
                    return Err(ControllerError::InvalidArgument(format!(
                        "{} protocols exist; name one with the {} parameter",
                        all.len(),
                        params::PROTOCOL
                    )));
                }
                Ok(all.remove(0))
            }
        }
    }

    /// CreateVolume.
    pub async fn create_volume(
        &self,
        req: csi::CreateVolumeRequest,
    ) -> Result<csi::CreateVolumeResponse, ControllerError> {
        let volume = volume_id_for_name(&req.name)?;
        let (mode, volume_mode) = capabilities(&req.volume_capabilities)?;
        if req.volume_content_source.is_some() {
            return Err(ControllerError::InvalidArgument(
                "volume content sources (snapshots, clones) are not supported".into(),
            ));
        }
        let (required, limit) = req
            .capacity_range
            .as_ref()
            .map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
        let (Ok(required), Ok(limit)) = (u64::try_from(required), u64::try_from(limit)) else {
            return Err(ControllerError::InvalidArgument(
                "capacity range must not be negative".into(),
            ));
        };
        if limit != 0 && limit < required {
            return Err(ControllerError::InvalidArgument(format!(
                "limit_bytes {limit} is below required_bytes {required}"
            )));
        }
        let size = if required == 0 {
            if limit != 0 {
                limit.min(DEFAULT_VOLUME_BYTES)
            } else {
                DEFAULT_VOLUME_BYTES
            }
        } else {
            required
        };
        let name = volume.to_string();
        let _lock = self.lock(&name).await;

        let existing = self.store.get_volume(&name).await?;
        let state = match existing {
            Some(v) => {
                let fits =
                    v.spec.size_bytes >= required && (limit == 0 || v.spec.size_bytes <= limit);
                if v.spec.access_mode != mode || v.spec.volume_mode != volume_mode || !fits {
                    return Err(ControllerError::AlreadyExists(
                        name,
                        format!(
                            "{:?}/{:?} with {} bytes",
                            v.spec.access_mode, v.spec.volume_mode, v.spec.size_bytes
                        ),
                    ));
                }
                v
            }
            None => {
                let (agent, pool) = self.pick_agent(&req.parameters).await?;
                let protocol = self.pick_protocol(&req.parameters).await?;
                let spec = PillarVolumeStateSpec {
                    volume_id: name.clone(),
                    agent: agent.metadata.name.clone().unwrap_or_default(),
                    pool,
                    size_bytes: size,
                    access_mode: mode,
                    volume_mode,
                    protocol: protocol.metadata.name.clone().unwrap_or_default(),
                    parameters: req
                        .parameters
                        .clone()
                        .into_iter()
                        .collect::<BTreeMap<_, _>>(),
                };
                // F10: the record exists before anything on a storage node.
                match self.store.create_volume(&name, spec).await {
                    Ok(v) => v,
                    Err(StoreError::AlreadyExists { .. }) => {
                        return Err(ControllerError::Contention { volume: name });
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        };
        let uid = state.metadata.uid.clone().unwrap_or_default();
        let (agent, client) = self.agent_of(&state).await?;
        let protocol = self.protocol_of(&state).await?;
        let t = self.next_token(&name, &uid).await?;
        let created = self
            .with_resync(&agent, &client, |mut c| {
                let r = agent_api::CreateVolumeRequest {
                    token: t.clone(),
                    volume_id: name.clone(),
                    pool: state.spec.pool.clone(),
                    size_bytes: state.spec.size_bytes,
                };
                async move { c.create_volume(r).await }
            })
            .await
            .map_err(agent_err("CreateVolume", &name))?
            .into_inner();
        if limit != 0 && created.size_bytes > limit {
            return Err(ControllerError::OutOfRange(format!(
                "the pool rounds the volume to {} bytes, above limit_bytes {limit}",
                created.size_bytes
            )));
        }
        let t = self.next_token(&name, &uid).await?;
        let current =
            self.store
                .get_volume(&name)
                .await?
                .ok_or_else(|| ControllerError::LifecycleGone {
                    volume: name.clone(),
                })?;
        let request = Self::export_request(&current, &protocol, t);
        let exported = self
            .with_resync(&agent, &client, |mut c| {
                let r = request.clone();
                async move { c.export(r).await }
            })
            .await
            .map_err(agent_err("Export", &name))?
            .into_inner();
        if exported.identity_adopted {
            tracing::warn!(volume = %name, "the storage node kept a live non-derived identity for this volume; nodes will refuse to stage it until it is re-exported");
        }
        tracing::info!(volume = %name, agent = %state.spec.agent, size = created.size_bytes, "volume created and exported");
        Ok(csi::CreateVolumeResponse {
            volume: Some(csi::Volume {
                capacity_bytes: i64::try_from(created.size_bytes).unwrap_or(i64::MAX),
                volume_id: name,
                volume_context: [(context::NQN.to_owned(), exported.subsystem_nqn)]
                    .into_iter()
                    .collect(),
                content_source: None,
                accessible_topology: Vec::new(),
            }),
        })
    }

    // ------------------------------------------------------------------ DeleteVolume

    /// DeleteVolume.
    pub async fn delete_volume(
        &self,
        req: csi::DeleteVolumeRequest,
    ) -> Result<csi::DeleteVolumeResponse, ControllerError> {
        if req.volume_id.is_empty() {
            return Err(ControllerError::InvalidArgument(
                "volume ID is required".into(),
            ));
        }
        let name = req.volume_id;
        let Ok(_) = volume_name(&name) else {
            // An ID pillar never issues names no volume: nothing to delete.
            return Ok(csi::DeleteVolumeResponse {});
        };
        let _lock = self.lock(&name).await;
        // F10: no record, nothing on any agent.
        let Some(state) = self.store.get_volume(&name).await? else {
            return Ok(csi::DeleteVolumeResponse {});
        };
        let published: Vec<String> = state
            .status_or_default()
            .published_nodes
            .iter()
            .map(|p| p.node.clone())
            .collect();
        if !published.is_empty() {
            return Err(ControllerError::StillPublished {
                volume: name,
                nodes: published,
            });
        }
        let uid = state.metadata.uid.clone().unwrap_or_default();
        let (agent, client) = self.agent_of(&state).await?;
        let t = self.next_token(&name, &uid).await?;
        self.with_resync(&agent, &client, |mut c| {
            let r = agent_api::UnexportRequest {
                token: t.clone(),
                volume_id: name.clone(),
            };
            async move { c.unexport(r).await }
        })
        .await
        .map_err(agent_err("Unexport", &name))?;
        let t = self.next_token(&name, &uid).await?;
        self.with_resync(&agent, &client, |mut c| {
            let r = agent_api::DeleteVolumeRequest {
                token: t.clone(),
                volume_id: name.clone(),
                pool: state.spec.pool.clone(),
            };
            async move { c.delete_volume(r).await }
        })
        .await
        .map_err(agent_err("DeleteVolume", &name))?;
        for _ in 0..CAS_ATTEMPTS {
            let Some(current) = self
                .store
                .get_volume(&name)
                .await?
                .filter(|v| v.metadata.uid.as_deref() == Some(uid.as_str()))
            else {
                return Ok(csi::DeleteVolumeResponse {});
            };
            match self
                .store
                .delete_volume(&name, &Revision::of(&current)?)
                .await
            {
                Ok(()) => {
                    tracing::info!(volume = %name, "volume deleted");
                    return Ok(csi::DeleteVolumeResponse {});
                }
                Err(e) if e.is_conflict() => continue,
                Err(e) if e.is_lifecycle_gone() => return Ok(csi::DeleteVolumeResponse {}),
                Err(e) => return Err(e.into()),
            }
        }
        Err(ControllerError::Contention { volume: name })
    }

    // ------------------------------------------------------------------ Publish

    /// ControllerPublishVolume.
    pub async fn publish(
        &self,
        req: csi::ControllerPublishVolumeRequest,
    ) -> Result<csi::ControllerPublishVolumeResponse, ControllerError> {
        if req.volume_id.is_empty() {
            return Err(ControllerError::InvalidArgument(
                "volume ID is required".into(),
            ));
        }
        if req.node_id.is_empty() {
            return Err(ControllerError::InvalidArgument(
                "node ID is required".into(),
            ));
        }
        let cap = req.volume_capability.as_ref().ok_or_else(|| {
            ControllerError::InvalidArgument("volume capability is required".into())
        })?;
        let (mode, volume_mode) = capability(cap)?;
        let name = req.volume_id.clone();
        let Ok(_) = volume_name(&name) else {
            return Err(ControllerError::VolumeNotFound(name));
        };
        let node = NodeId::parse(&req.node_id)
            .map_err(|e| ControllerError::NodeNotFound(req.node_id.clone(), e.to_string()))?;
        let _lock = self.lock(&name).await;
        let state = self
            .store
            .get_volume(&name)
            .await?
            .ok_or_else(|| ControllerError::VolumeNotFound(name.clone()))?;
        if state.spec.volume_mode != volume_mode {
            return Err(ControllerError::InvalidArgument(format!(
                "volume {name} is {:?}, the capability asks for {volume_mode:?}",
                state.spec.volume_mode
            )));
        }
        let uid = state.metadata.uid.clone().unwrap_or_default();
        // Check the agent exists before recording anything (C1: nothing recorded that cannot
        // be undone while the node is gone).
        let (agent, client) = self.agent_of(&state).await?;
        let protocol = self.protocol_of(&state).await?;

        // W1, W2: check against every record and record this one, in one compare-and-swap that
        // also bumps the generation for the grant's token.
        let wanted = PublishedNode {
            node: node.node.clone(),
            host_nqn: node.host_nqn.to_string(),
            access_mode: mode,
            readonly: req.readonly,
            revoking: false,
        };
        let (_, generation) = self
            .update_status(&name, &uid, |_, status| {
                for p in &status.published_nodes {
                    if p.node == wanted.node {
                        if p.revoking {
                            return Err(ControllerError::Revoking {
                                volume: name.clone(),
                                node: p.node.clone(),
                            });
                        }
                        if p.access_mode != wanted.access_mode
                            || p.readonly != wanted.readonly
                            || p.host_nqn != wanted.host_nqn
                        {
                            return Err(ControllerError::PublishedDifferently {
                                volume: name.clone(),
                                node: p.node.clone(),
                            });
                        }
                    } else if !(shareable(p) && shareable(&wanted)) {
                        return Err(ControllerError::PublishedElsewhere {
                            volume: name.clone(),
                            node: p.node.clone(),
                            mode: p.access_mode,
                            requested: wanted.node.clone(),
                        });
                    }
                }
                if !status.published_nodes.iter().any(|p| p.node == wanted.node) {
                    status.published_nodes.push(wanted.clone());
                }
                status.publication_generation += 1;
                Ok(status.publication_generation)
            })
            .await?;
        let t = token(&uid, generation);
        self.with_resync(&agent, &client, |mut c| {
            let r = agent_api::GrantInitiatorRequest {
                token: t.clone(),
                volume_id: name.clone(),
                host_nqn: node.host_nqn.to_string(),
            };
            async move { c.grant_initiator(r).await }
        })
        .await
        .map_err(agent_err("GrantInitiator", &name))?;
        let mut publish_context: HashMap<String, String> = [
            (
                context::NQN,
                state
                    .spec
                    .volume_id
                    .parse::<VolumeId>()
                    .map(|v| v.subsystem_nqn().to_string())
                    .unwrap_or_default(),
            ),
            (context::TRADDR, agent.spec.nvme_address.clone()),
            (context::TRSVCID, protocol.spec.nvme_tcp.port.to_string()),
            (
                context::CTRL_LOSS_TMO,
                protocol.spec.nvme_tcp.ctrl_loss_tmo.to_string(),
            ),
            (
                context::RECONNECT_DELAY,
                protocol.spec.nvme_tcp.reconnect_delay.to_string(),
            ),
            (
                context::FS_TYPE,
                protocol.spec.nvme_tcp.fs_type.as_str().to_owned(),
            ),
            (
                context::MKFS_OPTIONS,
                serde_json::to_string(&protocol.spec.nvme_tcp.mkfs_options)
                    .unwrap_or_else(|_| "[]".into()),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        if let Some(device) = self.local_device(&client, &state).await? {
            publish_context.insert(context::LOCAL_DEVICE.to_owned(), device);
        }
        tracing::info!(volume = %name, node = %node.node, ?mode, readonly = req.readonly, "published");
        Ok(csi::ControllerPublishVolumeResponse { publish_context })
    }

    /// With an agent on the configfs test double no host can connect over NVMe/TCP; the
    /// single-machine mode hands the node the local device instead, and says so.
    async fn local_device(
        &self,
        client: &Client,
        state: &PillarVolumeState,
    ) -> Result<Option<String>, ControllerError> {
        let mut c = client.clone();
        let caps = c
            .get_capabilities(agent_api::GetCapabilitiesRequest {})
            .await
            .map_err(agent_err("GetCapabilities", &state.spec.volume_id))?
            .into_inner();
        if caps.target != "test-double" {
            return Ok(None);
        }
        let volumes = c
            .list_volumes(agent_api::ListVolumesRequest {
                pool: state.spec.pool.clone(),
            })
            .await
            .map_err(agent_err("ListVolumes", &state.spec.volume_id))?
            .into_inner()
            .volumes;
        Ok(volumes
            .into_iter()
            .find(|v| v.volume_id == state.spec.volume_id)
            .map(|v| v.device_path))
    }

    // ------------------------------------------------------------------ Unpublish

    /// ControllerUnpublishVolume. An empty node ID unpublishes from every node.
    pub async fn unpublish(
        &self,
        req: csi::ControllerUnpublishVolumeRequest,
    ) -> Result<csi::ControllerUnpublishVolumeResponse, ControllerError> {
        if req.volume_id.is_empty() {
            return Err(ControllerError::InvalidArgument(
                "volume ID is required".into(),
            ));
        }
        let name = req.volume_id.clone();
        let Ok(_) = volume_name(&name) else {
            return Ok(csi::ControllerUnpublishVolumeResponse {});
        };
        let only: Option<String> =
            if req.node_id.is_empty() {
                None
            } else {
                Some(NodeId::parse(&req.node_id).map(|n| n.node).map_err(|e| {
                    ControllerError::NodeNotFound(req.node_id.clone(), e.to_string())
                })?)
            };
        let _lock = self.lock(&name).await;
        let Some(state) = self.store.get_volume(&name).await? else {
            return Ok(csi::ControllerUnpublishVolumeResponse {});
        };
        let uid = state.metadata.uid.clone().unwrap_or_default();
        let targets: Vec<PublishedNode> = state
            .status_or_default()
            .published_nodes
            .into_iter()
            .filter(|p| only.as_ref().is_none_or(|n| *n == p.node))
            .collect();
        if targets.is_empty() {
            return Ok(csi::ControllerUnpublishVolumeResponse {});
        }
        // W4: a missing agent keeps every record.
        let (agent, client) = self.agent_of(&state).await?;
        for target in targets {
            // Mark the record as being revoked (publishes to this node now get ABORTED), and
            // take the revoke's token in the same write.
            let (_, generation) = self
                .update_status(&name, &uid, |_, status| {
                    for p in &mut status.published_nodes {
                        if p.node == target.node {
                            p.revoking = true;
                        }
                    }
                    status.publication_generation += 1;
                    Ok(status.publication_generation)
                })
                .await?;
            let t = token(&uid, generation);
            self.with_resync(&agent, &client, |mut c| {
                let r = agent_api::RevokeInitiatorRequest {
                    token: t.clone(),
                    volume_id: name.clone(),
                    host_nqn: target.host_nqn.clone(),
                };
                async move { c.revoke_initiator(r).await }
            })
            .await
            .map_err(agent_err("RevokeInitiator", &name))?;
            // Confirmed: only now does the record go.
            self.update_status(&name, &uid, |_, status| {
                status.published_nodes.retain(|p| p.node != target.node);
                Ok(())
            })
            .await?;
            tracing::info!(volume = %name, node = %target.node, "unpublished");
        }
        Ok(csi::ControllerUnpublishVolumeResponse {})
    }

    // ------------------------------------------------------------------ Others

    /// ValidateVolumeCapabilities.
    pub async fn validate(
        &self,
        req: csi::ValidateVolumeCapabilitiesRequest,
    ) -> Result<csi::ValidateVolumeCapabilitiesResponse, ControllerError> {
        if req.volume_id.is_empty() {
            return Err(ControllerError::InvalidArgument(
                "volume ID is required".into(),
            ));
        }
        if req.volume_capabilities.is_empty() {
            return Err(ControllerError::InvalidArgument(
                "volume capabilities are required".into(),
            ));
        }
        let Ok(_) = volume_name(&req.volume_id) else {
            return Err(ControllerError::VolumeNotFound(req.volume_id));
        };
        let state = self
            .store
            .get_volume(&req.volume_id)
            .await?
            .ok_or_else(|| ControllerError::VolumeNotFound(req.volume_id.clone()))?;
        let unsupported = req
            .volume_capabilities
            .iter()
            .find_map(|c| match capability(c) {
                Err(e) => Some(e.to_string()),
                Ok((_, vm)) if vm != state.spec.volume_mode => {
                    Some(format!("volume is {:?}", state.spec.volume_mode))
                }
                Ok(_) => None,
            });
        Ok(match unsupported {
            Some(message) => csi::ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message,
            },
            None => csi::ValidateVolumeCapabilitiesResponse {
                confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                    volume_context: req.volume_context,
                    volume_capabilities: req.volume_capabilities,
                    parameters: req.parameters,
                    mutable_parameters: HashMap::new(),
                }),
                message: String::new(),
            },
        })
    }

    fn csi_volume(v: &PillarVolumeState) -> csi::Volume {
        csi::Volume {
            capacity_bytes: i64::try_from(v.spec.size_bytes).unwrap_or(i64::MAX),
            volume_id: v.spec.volume_id.clone(),
            volume_context: HashMap::new(),
            content_source: None,
            accessible_topology: Vec::new(),
        }
    }

    fn node_ids(v: &PillarVolumeState) -> Vec<String> {
        v.status_or_default()
            .published_nodes
            .iter()
            .filter_map(|p| {
                NodeId {
                    node: p.node.clone(),
                    host_nqn: p.host_nqn.parse().ok()?,
                }
                .format()
                .ok()
            })
            .collect()
    }

    /// ListVolumes, with the nodes each volume is published to.
    pub async fn list(
        &self,
        req: csi::ListVolumesRequest,
    ) -> Result<csi::ListVolumesResponse, ControllerError> {
        let volumes = self.store.list_volumes().await?;
        let start = if req.starting_token.is_empty() {
            0
        } else {
            match req.starting_token.parse::<usize>() {
                Ok(n) if n <= volumes.len() => n,
                _ => {
                    return Err(ControllerError::Contention {
                        volume: format!("(invalid starting_token {:?})", req.starting_token),
                    });
                }
            }
        };
        let max = usize::try_from(req.max_entries).map_err(|_| {
            ControllerError::InvalidArgument("max_entries must not be negative".into())
        })?;
        let end = if max == 0 {
            volumes.len()
        } else {
            (start + max).min(volumes.len())
        };
        let entries = volumes[start..end]
            .iter()
            .map(|v| csi::list_volumes_response::Entry {
                volume: Some(Self::csi_volume(v)),
                status: Some(csi::list_volumes_response::VolumeStatus {
                    published_node_ids: Self::node_ids(v),
                    volume_condition: None,
                }),
            })
            .collect();
        let next_token = if end < volumes.len() {
            end.to_string()
        } else {
            String::new()
        };
        Ok(csi::ListVolumesResponse {
            entries,
            next_token,
        })
    }

    /// ControllerGetVolume.
    pub async fn get(
        &self,
        req: csi::ControllerGetVolumeRequest,
    ) -> Result<csi::ControllerGetVolumeResponse, ControllerError> {
        if req.volume_id.is_empty() {
            return Err(ControllerError::InvalidArgument(
                "volume ID is required".into(),
            ));
        }
        let Ok(_) = volume_name(&req.volume_id) else {
            return Err(ControllerError::VolumeNotFound(req.volume_id));
        };
        let v = self
            .store
            .get_volume(&req.volume_id)
            .await?
            .ok_or_else(|| ControllerError::VolumeNotFound(req.volume_id.clone()))?;
        let revoking: Vec<String> = v
            .status_or_default()
            .published_nodes
            .iter()
            .filter(|p| p.revoking)
            .map(|p| p.node.clone())
            .collect();
        let condition = csi::VolumeCondition {
            abnormal: !revoking.is_empty(),
            message: if revoking.is_empty() {
                "ok".into()
            } else {
                format!("unpublish from {revoking:?} not yet confirmed by the storage node")
            },
        };
        Ok(csi::ControllerGetVolumeResponse {
            volume: Some(Self::csi_volume(&v)),
            status: Some(csi::controller_get_volume_response::VolumeStatus {
                published_node_ids: Self::node_ids(&v),
                volume_condition: Some(condition),
            }),
        })
    }

    /// GetCapacity: one pool when parameters name it, else every agent's pools together.
    pub async fn capacity(
        &self,
        req: csi::GetCapacityRequest,
    ) -> Result<csi::GetCapacityResponse, ControllerError> {
        let targets: Vec<(PillarAgent, String)> = if req.parameters.contains_key(params::AGENT)
            || req.parameters.contains_key(params::POOL)
        {
            vec![self.pick_agent(&req.parameters).await?]
        } else {
            self.store
                .list_agents()
                .await?
                .into_iter()
                .flat_map(|a| {
                    a.spec
                        .pools
                        .iter()
                        .map(|p| (a.clone(), p.name.clone()))
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        let mut available = 0u64;
        for (agent, pool) in targets {
            let mut c = self.agents.client(&agent).await?;
            let cap = c
                .get_capacity(agent_api::GetCapacityRequest { pool })
                .await
                .map_err(agent_err("GetCapacity", ""))?
                .into_inner();
            available = available.saturating_add(cap.available_bytes);
        }
        Ok(csi::GetCapacityResponse {
            available_capacity: i64::try_from(available).unwrap_or(i64::MAX),
            maximum_volume_size: None,
            minimum_volume_size: None,
        })
    }

    /// ControllerExpandVolume.
    pub async fn expand(
        &self,
        req: csi::ControllerExpandVolumeRequest,
    ) -> Result<csi::ControllerExpandVolumeResponse, ControllerError> {
        if req.volume_id.is_empty() {
            return Err(ControllerError::InvalidArgument(
                "volume ID is required".into(),
            ));
        }
        let range = req
            .capacity_range
            .ok_or_else(|| ControllerError::InvalidArgument("capacity range is required".into()))?;
        let required = u64::try_from(range.required_bytes).map_err(|_| {
            ControllerError::InvalidArgument("required_bytes must not be negative".into())
        })?;
        let name = req.volume_id.clone();
        let Ok(_) = volume_name(&name) else {
            return Err(ControllerError::VolumeNotFound(name));
        };
        let _lock = self.lock(&name).await;
        let state = self
            .store
            .get_volume(&name)
            .await?
            .ok_or_else(|| ControllerError::VolumeNotFound(name.clone()))?;
        let uid = state.metadata.uid.clone().unwrap_or_default();
        let (agent, client) = self.agent_of(&state).await?;
        let t = self.next_token(&name, &uid).await?;
        let grown = self
            .with_resync(&agent, &client, |mut c| {
                let r = agent_api::ExpandVolumeRequest {
                    token: t.clone(),
                    volume_id: name.clone(),
                    pool: state.spec.pool.clone(),
                    size_bytes: required.max(1),
                };
                async move { c.expand_volume(r).await }
            })
            .await
            .map_err(agent_err("ExpandVolume", &name))?
            .into_inner();
        for _ in 0..CAS_ATTEMPTS {
            let current = self
                .store
                .get_volume(&name)
                .await?
                .filter(|v| v.metadata.uid.as_deref() == Some(uid.as_str()));
            let Some(current) = current else {
                return Err(ControllerError::LifecycleGone { volume: name });
            };
            let mut spec = current.spec.clone();
            spec.size_bytes = grown.size_bytes;
            match self
                .store
                .replace_volume_spec(&name, &Revision::of(&current)?, spec)
                .await
            {
                Ok(_) => break,
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(csi::ControllerExpandVolumeResponse {
            capacity_bytes: i64::try_from(grown.size_bytes).unwrap_or(i64::MAX),
            node_expansion_required: state.spec.volume_mode == VolumeMode::Filesystem,
        })
    }

    // ------------------------------------------------------------------ Resync

    /// Sends `agent` the complete export state of its node (C3). Each volume gets a fresh token.
    pub async fn resync_agent(
        &self,
        agent: &PillarAgent,
    ) -> Result<agent_api::ResyncExportsResponse, ControllerError> {
        let _one_at_a_time = self.resync_lock.lock().await;
        let name = agent.metadata.name.clone().unwrap_or_default();
        let mut exports = Vec::new();
        for v in self
            .store
            .list_volumes()
            .await?
            .into_iter()
            .filter(|v| v.spec.agent == name)
        {
            let uid = v.metadata.uid.clone().unwrap_or_default();
            let protocol = self.protocol_of(&v).await?;
            let t = match self.next_token(&v.spec.volume_id, &uid).await {
                Ok(t) => t,
                Err(ControllerError::LifecycleGone { .. }) => continue,
                Err(e) => return Err(e),
            };
            let current = self.store.get_volume(&v.spec.volume_id).await?.unwrap_or(v);
            exports.push(Self::export_request(&current, &protocol, t));
        }
        let mut client = self.agents.client(agent).await?;
        let count = exports.len();
        let response = client
            .resync_exports(agent_api::ResyncExportsRequest { exports })
            .await
            .map_err(agent_err("ResyncExports", ""))?
            .into_inner();
        let failed: Vec<_> = response.results.iter().filter(|r| !r.ok).collect();
        tracing::info!(agent = %name, exports = count, failed = failed.len(), "resync sent");
        for f in &failed {
            tracing::warn!(agent = %name, volume = %f.volume_id, code = %f.code, "resync of a volume failed: {}", f.message);
        }
        for v in &response.unlisted_volume_ids {
            tracing::warn!(agent = %name, volume = %v, "the storage node exports a volume the controller has no record of; left in place");
        }
        Ok(response)
    }

    /// Checks every agent once; resyncs those that wait for it.
    pub async fn resync_waiting_agents(&self) {
        let agents = match self.store.list_agents().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list agents");
                return;
            }
        };
        for agent in agents {
            let name = agent.metadata.name.clone().unwrap_or_default();
            let health = match self.agents.client(&agent).await {
                Ok(mut c) => c.health(agent_api::HealthRequest {}).await,
                Err(e) => {
                    tracing::debug!(agent = %name, error = %e, "agent unreachable");
                    continue;
                }
            };
            match health {
                Ok(h)
                    if h.get_ref().state()
                        == agent_api::health_response::State::WaitingForResync =>
                {
                    if let Err(e) = self.resync_agent(&agent).await {
                        tracing::warn!(agent = %name, error = %describe(&e), "resync failed");
                    }
                }
                Ok(_) => {}
                Err(status) => {
                    tracing::debug!(agent = %name, %status, "agent health failed");
                    self.agents.forget(&name).await;
                }
            }
        }
    }

    /// Runs [`resync_waiting_agents`](Self::resync_waiting_agents) every `interval`.
    pub fn spawn_resync_loop(self: &Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                me.resync_waiting_agents().await;
                tokio::time::sleep(interval).await;
            }
        })
    }
}

/// The tonic service over a [`Controller`].
#[derive(Debug, Clone)]
pub struct ControllerService {
    inner: Arc<Controller>,
}

impl ControllerService {
    /// Serves `controller`.
    pub fn new(controller: Arc<Controller>) -> Self {
        Self { inner: controller }
    }
}

async fn respond<T>(
    method: &'static str,
    volume: &str,
    work: impl Future<Output = Result<T, ControllerError>>,
) -> Result<Response<T>, Status> {
    use tracing::Instrument;
    let span = tracing::info_span!("csi", method, volume_id = volume);
    match work.instrument(span.clone()).await {
        Ok(v) => Ok(Response::new(v)),
        Err(e) => {
            let status = to_status(&e);
            span.in_scope(|| tracing::info!(code = ?status.code(), "{}", status.message()));
            Err(status)
        }
    }
}

fn cap(t: csi::controller_service_capability::rpc::Type) -> csi::ControllerServiceCapability {
    csi::ControllerServiceCapability {
        r#type: Some(csi::controller_service_capability::Type::Rpc(
            csi::controller_service_capability::Rpc { r#type: t.into() },
        )),
    }
}

#[tonic::async_trait]
impl csi::controller_server::Controller for ControllerService {
    async fn create_volume(
        &self,
        r: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let r = r.into_inner();
        respond("CreateVolume", &r.name.clone(), self.inner.create_volume(r)).await
    }
    async fn delete_volume(
        &self,
        r: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let r = r.into_inner();
        respond(
            "DeleteVolume",
            &r.volume_id.clone(),
            self.inner.delete_volume(r),
        )
        .await
    }
    async fn controller_publish_volume(
        &self,
        r: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        let r = r.into_inner();
        respond(
            "ControllerPublishVolume",
            &r.volume_id.clone(),
            self.inner.publish(r),
        )
        .await
    }
    async fn controller_unpublish_volume(
        &self,
        r: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        let r = r.into_inner();
        respond(
            "ControllerUnpublishVolume",
            &r.volume_id.clone(),
            self.inner.unpublish(r),
        )
        .await
    }
    async fn validate_volume_capabilities(
        &self,
        r: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<csi::ValidateVolumeCapabilitiesResponse>, Status> {
        let r = r.into_inner();
        respond(
            "ValidateVolumeCapabilities",
            &r.volume_id.clone(),
            self.inner.validate(r),
        )
        .await
    }
    async fn list_volumes(
        &self,
        r: Request<csi::ListVolumesRequest>,
    ) -> Result<Response<csi::ListVolumesResponse>, Status> {
        respond("ListVolumes", "", self.inner.list(r.into_inner())).await
    }
    async fn get_capacity(
        &self,
        r: Request<csi::GetCapacityRequest>,
    ) -> Result<Response<csi::GetCapacityResponse>, Status> {
        respond("GetCapacity", "", self.inner.capacity(r.into_inner())).await
    }
    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csi::controller_service_capability::rpc::Type;
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities: [
                Type::CreateDeleteVolume,
                Type::PublishUnpublishVolume,
                Type::ListVolumes,
                Type::ListVolumesPublishedNodes,
                Type::GetCapacity,
                Type::ExpandVolume,
                Type::GetVolume,
                Type::VolumeCondition,
                Type::SingleNodeMultiWriter,
            ]
            .into_iter()
            .map(cap)
            .collect(),
        }))
    }
    async fn create_snapshot(
        &self,
        _: Request<csi::CreateSnapshotRequest>,
    ) -> Result<Response<csi::CreateSnapshotResponse>, Status> {
        Err(Status::unimplemented("snapshots are not supported"))
    }
    async fn delete_snapshot(
        &self,
        _: Request<csi::DeleteSnapshotRequest>,
    ) -> Result<Response<csi::DeleteSnapshotResponse>, Status> {
        Err(Status::unimplemented("snapshots are not supported"))
    }
    async fn list_snapshots(
        &self,
        _: Request<csi::ListSnapshotsRequest>,
    ) -> Result<Response<csi::ListSnapshotsResponse>, Status> {
        Err(Status::unimplemented("snapshots are not supported"))
    }
    async fn get_snapshot(
        &self,
        _: Request<csi::GetSnapshotRequest>,
    ) -> Result<Response<csi::GetSnapshotResponse>, Status> {
        Err(Status::unimplemented("snapshots are not supported"))
    }
    async fn controller_expand_volume(
        &self,
        r: Request<csi::ControllerExpandVolumeRequest>,
    ) -> Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        let r = r.into_inner();
        respond(
            "ControllerExpandVolume",
            &r.volume_id.clone(),
            self.inner.expand(r),
        )
        .await
    }
    async fn controller_get_volume(
        &self,
        r: Request<csi::ControllerGetVolumeRequest>,
    ) -> Result<Response<csi::ControllerGetVolumeResponse>, Status> {
        let r = r.into_inner();
        respond(
            "ControllerGetVolume",
            &r.volume_id.clone(),
            self.inner.get(r),
        )
        .await
    }
    async fn controller_modify_volume(
        &self,
        _: Request<csi::ControllerModifyVolumeRequest>,
    ) -> Result<Response<csi::ControllerModifyVolumeResponse>, Status> {
        Err(Status::unimplemented(
            "volume modification is not supported",
        ))
    }
}
