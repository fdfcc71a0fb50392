//! Why a controller call failed, and the one table that turns it into a gRPC code.
//!
//! Agent errors are decided on the reason the agent sends (`pillar_agent_api::reason_of`),
//! never on message text: a stale token is ABORTED (another operation on the volume overtook
//! this one, retry), what the agent says is missing is NOT_FOUND, a corrupt mark is DATA_LOSS. Only
//! failures of the storage node itself are INTERNAL.

use pillar_agent_api::{ErrorReason, reason_of};
use pillar_state::crd::AccessMode;
use pillar_state::store::StoreError;
use tonic::{Code, Status};

use crate::agents::ConnectError;
use crate::capability::CapabilityError;

/// Why a controller call failed. Mapped to gRPC codes once, in [`code_of`].
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error(transparent)]
    Capability(#[from] CapabilityError),
    #[error("volume {0} does not exist")]
    VolumeNotFound(String),
    #[error("node {0:?} is unknown: {1}")]
    NodeNotFound(String, String),
    #[error("volume {0} already exists with other properties: {1}")]
    AlreadyExists(String, String),
    #[error(
        "volume {volume} is published at node ID {node_id} ({mode:?}); a single-node volume cannot be published to {requested}"
    )]
    PublishedElsewhere {
        volume: String,
        node_id: String,
        mode: AccessMode,
        requested: String,
    },
    #[error(
        "volume {volume} is already published to node {node} with another capability or readonly flag"
    )]
    PublishedDifferently { volume: String, node: String },
    #[error("volume {volume} is being deleted; it takes no publication or change")]
    Deleting { volume: String },
    #[error("volume {volume} is still being unpublished from node {node}; retry")]
    Revoking { volume: String, node: String },
    #[error(
        "volume {volume}: the publication to node {node} this call acted on was withdrawn while the storage node was being resynced; retry"
    )]
    PublicationWithdrawn { volume: String, node: String },
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
    Unreachable(String),
    #[error("snapshot {0} does not exist")]
    SnapshotNotFound(String),
    #[error("snapshot {0} already exists with source volume {1}")]
    SnapshotExists(String, String),
    #[error("snapshot {0} is being deleted")]
    SnapshotDeleting(String),
    #[error("snapshot {0} is not ready to use yet; retry")]
    SnapshotNotReady(String),
    #[error(
        "PillarAgent {agent:?} of snapshot {snapshot} does not exist; refusing to act without the storage node"
    )]
    SnapshotAgentMissing { snapshot: String, agent: String },
    #[error("starting_token {0:?} is not one this controller issued")]
    BadStartingToken(String),
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
}

/// The gRPC code of every controller error.
pub fn code_of(err: &ControllerError) -> Code {
    use ControllerError as E;
    match err {
        E::InvalidArgument(_) | E::Capability(_) => Code::InvalidArgument,
        E::VolumeNotFound(_) | E::NodeNotFound(..) | E::SnapshotNotFound(_) => Code::NotFound,
        E::AlreadyExists(..) | E::PublishedDifferently { .. } | E::SnapshotExists(..) => {
            Code::AlreadyExists
        }
        E::SnapshotDeleting(_) | E::SnapshotNotReady(_) => Code::Aborted,
        // CSI: unable to provision in the accessible topology.
        E::Unreachable(_) => Code::ResourceExhausted,
        E::SnapshotAgentMissing { .. } => Code::FailedPrecondition,
        E::PublishedElsewhere { .. }
        | E::StillPublished { .. }
        | E::AgentMissing { .. }
        | E::ProtocolMissing(_) => Code::FailedPrecondition,
        E::Revoking { .. }
        | E::PublicationWithdrawn { .. }
        | E::Deleting { .. }
        | E::LifecycleGone { .. }
        | E::Contention { .. } => Code::Aborted,
        // CSI: an invalid starting_token of ListVolumes is ABORTED.
        E::BadStartingToken(_) => Code::Aborted,
        E::OutOfRange(_) => Code::OutOfRange,
        E::Store(e) if e.is_conflict() || e.is_lifecycle_gone() => Code::Aborted,
        // W10: no credentials for the node: refused, never admitted on its NQN alone.
        E::Store(StoreError::NoCredentials { .. }) => Code::FailedPrecondition,
        E::Store(_) | E::Connect(_) => Code::Unavailable,
        E::Agent { status, .. } => agent_code(status),
    }
}

/// The CSI code of an agent's error status, by its reason.
pub fn agent_code(status: &Status) -> Code {
    use ErrorReason as R;
    match reason_of(status) {
        // Another operation on the volume, or another lifecycle of its name, overtook this
        // call: the caller retries and reads the new state.
        R::StaleGeneration | R::ForeignOwner | R::RetiredLifecycle | R::EndedLifecycle => {
            Code::Aborted
        }
        // The controller always sends a token: a request without one is a controller bug.
        R::NoToken => Code::Internal,
        R::InvalidRequest | R::UnsupportedByBackend => Code::InvalidArgument,
        R::UnknownPool | R::VolumeNotFound | R::SnapshotNotFound => Code::NotFound,
        R::MarkCorrupt | R::IdentityRecordCorrupt => Code::DataLoss,
        R::WaitingForResync | R::NoNvmet | R::Overloaded | R::StateLost => Code::Unavailable,
        R::NotExported
        | R::StillExported
        | R::NoSafePlan
        | R::BackendRefused
        | R::SourceNotLive
        | R::SourceInUse
        | R::UnclaimedVolume
        // W10: the storage node's kernel cannot authenticate hosts; nothing was applied.
        | R::AuthUnsupported
        // The storage node's kernel has no TLS for NVMe/TCP; nothing was applied.
        | R::TlsUnsupported => Code::FailedPrecondition,
        R::SizeMismatch => Code::AlreadyExists,
        R::SizeOutOfRange => Code::OutOfRange,
        R::MarkIo | R::TargetFailed | R::ReadBackMismatch | R::BackendFailed | R::AgentFailed => {
            Code::Internal
        }
        // Not from the agent: the transport (unreachable, deadline) or something in between.
        R::Unspecified => match status.code() {
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => Code::Unavailable,
            Code::ResourceExhausted => Code::ResourceExhausted,
            _ => Code::Internal,
        },
    }
}

/// The error and its causes, one line.
pub fn describe(err: &ControllerError) -> String {
    crate::error_chain(err)
}

/// The status the CSI caller gets.
pub fn to_status(err: &ControllerError) -> Status {
    Status::new(code_of(err), describe(err))
}

/// Wraps an agent's error status with the call and volume it belongs to.
pub fn agent_err<'a>(
    call: &'static str,
    volume: &'a str,
) -> impl FnOnce(Status) -> ControllerError + 'a {
    move |status| ControllerError::Agent {
        call,
        volume: volume.to_owned(),
        status,
    }
}

#[cfg(test)]
mod tests {
    use pillar_agent_api::error_status;

    use super::*;

    #[test]
    fn agent_reasons_keep_their_meaning_at_the_csi_edge() {
        for (reason, want) in [
            (ErrorReason::StaleGeneration, Code::Aborted),
            (ErrorReason::RetiredLifecycle, Code::Aborted),
            (ErrorReason::VolumeNotFound, Code::NotFound),
            (ErrorReason::UnknownPool, Code::NotFound),
            (ErrorReason::InvalidRequest, Code::InvalidArgument),
            (ErrorReason::MarkCorrupt, Code::DataLoss),
            (ErrorReason::WaitingForResync, Code::Unavailable),
            (ErrorReason::NoSafePlan, Code::FailedPrecondition),
            (ErrorReason::SizeOutOfRange, Code::OutOfRange),
            (ErrorReason::TargetFailed, Code::Internal),
        ] {
            assert_eq!(agent_code(&error_status(reason, "x")), want, "{reason:?}");
        }
        // Message text decides nothing.
        assert_eq!(
            agent_code(&Status::failed_precondition("stale request")),
            Code::Internal
        );
        assert_eq!(
            agent_code(&Status::unavailable("connection refused")),
            Code::Unavailable
        );
    }
}
