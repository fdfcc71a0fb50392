//! Why an agent operation failed: one variant per refused or failed step, mapped to gRPC
//! codes once, at the edge (`grpc`).
//!
//! Invariants:
//! - An error names the volume (or snapshot) and the step; none carries a secret (W10: host
//!   keys go to configfs only).

use crate::backend::BackendError;
use crate::fence::{MarkError, Rejection};
use crate::target::TargetError;

/// Why an agent operation failed. Mapped to gRPC codes once, in `grpc`.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },
    #[error("unknown pool {pool:?}")]
    UnknownPool { pool: String },
    #[error(transparent)]
    Fenced(#[from] Rejection),
    #[error(transparent)]
    Mark(#[from] MarkError),
    #[error(
        "the agent restarted and waits for the controller's export resync; it creates no export until then"
    )]
    WaitingForResync,
    #[error(
        "the agent's state directory was lost (it holds volumes without fencing marks, or its \
         state identity vanished); it changes nothing until the controller re-seeds the marks \
         with a resync carrying the state epoch its Health reports"
    )]
    StateLost,
    #[error(
        "{volume} is held on this node without a fencing mark and the controller's resync after \
         the state loss did not claim it; refusing every change to it (an operator decides)"
    )]
    Unclaimed { volume: String },
    #[error("the state directory cannot be opened again after it was lost")]
    StateDir(#[source] crate::engine::EngineError),
    #[error(transparent)]
    StateIdentity(#[from] crate::state::StateError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("volume {volume} does not exist in pool {pool:?}")]
    VolumeNotFound { volume: String, pool: String },
    #[error("volume {volume} is not exported")]
    NotExported { volume: String },
    #[error("volume {volume} is still exported; unexport it before deleting")]
    StillExported { volume: String },
    #[error("no safe configfs plan for {volume}")]
    Plan {
        volume: String,
        source: pillar_nvmet::PlanError,
    },
    #[error(
        "allowed_hosts of {volume} holds {host:?}, which is not a host NQN pillar writes; refusing \
         to change an ACL someone else edited"
    )]
    ForeignAclEntry { volume: String, host: String },
    #[error(transparent)]
    Target(#[from] TargetError),
    #[error("read-back after the change does not match")]
    Verify(#[from] pillar_nvmet::VerifyError),
    #[error("the request's task failed (a panic, or the agent is shutting down)")]
    Task(#[source] tokio::task::JoinError),
    #[error(
        "{what} {id} is not the live lifecycle {uid:?} here (deleted, never made, or re-created)"
    )]
    SourceNotLive {
        what: &'static str,
        id: String,
        uid: String,
    },
    #[error(
        "volume {volume} is in use and pool {pool:?} cannot reflink: a copy of it would not be one \
         point in time; retry once it is unpublished"
    )]
    SourceInUse { volume: String, pool: String },
    #[error(
        "volume {volume}'s export requires DH-HMAC-CHAP, but this node's kernel has no NVMe \
         in-band authentication (host entries have no dhchap_key: CONFIG_NVME_TARGET_AUTH is \
         not set): refusing rather than admitting hosts on their NQN alone; set `auth: none` \
         on the PillarProtocol to opt out (visibly), or serve the pool from a kernel with it"
    )]
    AuthUnsupported { volume: String },
    #[error(
        "volume {volume}'s export requires TLS for NVMe/TCP, but this node's kernel has none \
         (ports have no addr_tsas, tls1.3 is refused, or there is no .nvme keyring: \
         CONFIG_NVME_TARGET_TCP_TLS is not set): refusing rather than taking plain hosts; set \
         `tls: none` on the PillarProtocol, or serve the pool from a kernel with it"
    )]
    TlsUnsupported { volume: String },
    #[error("{what}")]
    Keyring { what: String },
    #[error(
        "snapshot {snapshot} exists in the pool but has no fencing mark (the agent's state was \
         lost?); refusing to adopt it"
    )]
    UnmarkedSnapshot { snapshot: String },
}
