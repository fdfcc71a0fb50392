//! The node service's error type, one variant per step that can fail, and the single table
//! ([`code_of`]) that turns them into gRPC codes at the edge.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use pillar_host::{ErrorClass, HostError};
use pillar_nvmet::NameError;
use tonic::Code;

use crate::node_id::NodeIdError;

/// Every way a node call can fail.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    // ---- configuration ----
    #[error("invalid node configuration: {0}")]
    Config(String),
    #[error("the node ID cannot be formed")]
    NodeId(#[source] NodeIdError),
    #[error("opening the stage record directory under {dir:?} failed")]
    OpenStageStore {
        dir: PathBuf,
        #[source]
        source: Box<HostError>,
    },

    // ---- the request ----
    #[error("{0} is required")]
    MissingField(&'static str),
    #[error("{field} {path:?} must be an absolute path")]
    RelativePath { field: &'static str, path: String },
    #[error("{field} is invalid: {reason}")]
    InvalidField { field: &'static str, reason: String },
    #[error("invalid volume ID {id:?}")]
    InvalidVolumeId {
        id: String,
        #[source]
        source: NameError,
    },
    #[error("unsupported volume capability: {0}")]
    UnsupportedCapability(String),
    #[error("publish_context lacks {0}")]
    MissingContext(&'static str),
    #[error(
        "volume {volume} requires NVMe in-band authentication (DH-HMAC-CHAP) and \
         NodeStageVolume carries no secret for this node (secrets key {key:?}): refusing to \
         connect without it (the target would refuse the host); check the PV's node-stage \
         Secret and that the controller created this node's credentials"
    )]
    MissingSecret { volume: String, key: &'static str },
    #[error(
        "volume {volume} requires NVMe in-band authentication (DH-HMAC-CHAP) and \
         NodeStageVolume carries no secret for this node (secrets key {key:?}), and the \
         controller's credentials endpoint did not deliver this node's pair: refusing to \
         connect without it"
    )]
    CredentialsNotDelivered {
        volume: String,
        key: &'static str,
        #[source]
        source: Box<crate::credentials_delivery::client::FetchError>,
    },
    #[error("NodeStageVolume secret {key:?} is not a DH-HMAC-CHAP secret: {reason}")]
    InvalidSecret { key: &'static str, reason: String },
    #[error("publish_context {key} = {value:?} is invalid: {reason}")]
    InvalidContext {
        key: &'static str,
        value: String,
        reason: String,
    },
    #[error("publish_context names subsystem {found}, but volume {volume} is subsystem {expected}")]
    NqnMismatch {
        volume: String,
        expected: String,
        found: String,
    },
    #[error(
        "read-only publication of raw block volume {volume} is refused: a read-only bind of a \
         device node does not stop writes to the device"
    )]
    ReadonlyBlock { volume: String },
    #[error(
        "volume is published read-only and {device} holds {found}, not {fs}: a read-only stage never formats"
    )]
    ReadOnlyWithoutFilesystem {
        device: PathBuf,
        fs: String,
        found: String,
    },
    #[error(
        "volume {volume} is published read-only, but its {fs} log needs recovery (a snapshot of \
         a mounted filesystem?): a read-only stage never replays the log (N5), and without the \
         replay the filesystem would show stale data. Stage it read-write once on one node so \
         the log is replayed (e.g. a ReadWriteOnce claim from the same snapshot, deleted or \
         unmounted before the read-only use), or snapshot a cleanly unmounted filesystem"
    )]
    LogNeedsRecovery { volume: String, fs: String },

    // ---- concurrency ----
    #[error("an operation on volume {0} is already in progress; retry later")]
    Busy(String),

    // ---- stage records ----
    #[error("reading the stage record of volume {volume} failed")]
    ReadRecord {
        volume: String,
        #[source]
        source: Box<HostError>,
    },
    #[error("writing the stage record of volume {volume} failed")]
    WriteRecord {
        volume: String,
        #[source]
        source: Box<HostError>,
    },
    #[error("removing the stage record of volume {volume} failed")]
    RemoveRecord {
        volume: String,
        #[source]
        source: Box<HostError>,
    },

    // ---- where the volume is ----
    #[error("volume {volume} is staged at {staged:?}; unstage it there first")]
    StagedElsewhere { volume: String, staged: PathBuf },
    #[error("volume {volume} is already staged at this path as {staged}, not as {requested}")]
    StagedIncompatibly {
        volume: String,
        staged: String,
        requested: String,
    },
    #[error(
        "staging path {path:?} already holds another mount (device {found}, expected {expected})"
    )]
    StagingPathBusy {
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error("volume {volume} is not staged at {staging:?} on this node")]
    NotStaged { volume: String, staging: PathBuf },
    #[error("volume {volume} is staged as {staged}, but the request asks for {requested}")]
    PublishModeMismatch {
        volume: String,
        staged: String,
        requested: String,
    },
    #[error("{path:?} is already published {found}; the request asks for {requested}")]
    PublishedIncompatibly {
        path: PathBuf,
        found: String,
        requested: String,
    },
    #[error(
        "volume {volume} is SINGLE_NODE_SINGLE_WRITER and already published at {other}; one \
         publication at a time"
    )]
    PublishedAtAnotherPath { volume: String, other: PathBuf },
    #[error("volume {volume} is not staged on this node")]
    NotStagedHere { volume: String },
    #[error("volume path {path:?} does not exist")]
    VolumePathMissing { path: PathBuf },
    #[error("inspecting volume path {path:?} failed")]
    VolumePath {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no filesystem of volume {volume} is mounted at {path:?}")]
    NotMounted { volume: String, path: PathBuf },
    #[error(
        "volume {volume} is mounted read-only at {path:?}: its filesystem cannot be grown here; \
         a read-write stage grows it"
    )]
    ExpandReadOnly { volume: String, path: PathBuf },
    #[error("volume {volume} is still mounted at {mounts:?}; unpublish it there first")]
    StillPublished {
        volume: String,
        mounts: Vec<PathBuf>,
    },

    // ---- attaching and detaching ----
    #[error("listing the NVMe controllers of subsystem {nqn} failed")]
    ListControllers {
        nqn: String,
        #[source]
        source: Box<HostError>,
    },
    #[error("connecting to subsystem {nqn} failed")]
    Connect {
        nqn: String,
        #[source]
        source: Box<HostError>,
    },
    #[error("the namespace of subsystem {nqn} did not become usable")]
    WaitNamespace {
        nqn: String,
        #[source]
        source: Box<HostError>,
    },
    #[error("no controller of subsystem {nqn} for this host became live within {waited:?}: {seen}")]
    ControllerNotLive {
        nqn: String,
        waited: Duration,
        seen: String,
    },
    #[error("the device of subsystem {nqn} is not volume {volume}'s namespace; it was not touched")]
    IdentityMismatch {
        volume: String,
        nqn: String,
        #[source]
        source: Box<HostError>,
    },
    #[error("finding the device of volume {volume} failed")]
    FindDevice {
        volume: String,
        #[source]
        source: Box<HostError>,
    },
    #[error("local device {path:?} cannot be used")]
    LocalDevice {
        path: PathBuf,
        #[source]
        source: Box<HostError>,
    },
    #[error("disconnecting the controllers of subsystem {nqn} for this host failed")]
    Disconnect {
        nqn: String,
        #[source]
        source: Box<HostError>,
    },

    // ---- NVMe reservations (W9) ----
    #[error("taking the NVMe Write Exclusive reservation of volume {volume} failed")]
    Reservation {
        volume: String,
        #[source]
        source: Box<pillar_host::resv::ResvError>,
    },

    // ---- filesystems and mounts ----
    #[error("preparing filesystem {fs} on {device:?} failed")]
    Format {
        device: PathBuf,
        fs: String,
        #[source]
        source: Box<HostError>,
    },
    #[error("checking whether the {fs} log on {device:?} needs recovery failed")]
    CheckLog {
        device: PathBuf,
        fs: String,
        #[source]
        source: Box<HostError>,
    },
    #[error("creating {path:?} failed")]
    PrepareTarget {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("checking the mounts at {path:?} failed")]
    CheckMount {
        path: PathBuf,
        #[source]
        source: Box<HostError>,
    },
    #[error("mounting at {target:?} failed")]
    Mount {
        target: PathBuf,
        #[source]
        source: Box<HostError>,
    },
    #[error("unmounting {target:?} failed")]
    Unmount {
        target: PathBuf,
        #[source]
        source: Box<HostError>,
    },
    #[error("removing {path:?} failed")]
    RemoveTarget {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    // ---- statistics and expansion ----
    #[error("reading the usage of {path:?} failed")]
    Stats {
        path: PathBuf,
        #[source]
        source: Box<HostError>,
    },
    #[error("reading the size of {device:?} failed")]
    DeviceSize {
        device: PathBuf,
        #[source]
        source: Box<HostError>,
    },
    #[error("rescanning NVMe controller {controller} failed")]
    Rescan {
        controller: String,
        #[source]
        source: Box<HostError>,
    },
    #[error("{device:?} is {found} bytes after {waited:?}; {wanted} bytes were asked for")]
    SizeNotReached {
        device: PathBuf,
        wanted: u64,
        found: u64,
        waited: Duration,
    },
    #[error("growing the filesystem on {device:?} failed")]
    Grow {
        device: PathBuf,
        #[source]
        source: Box<HostError>,
    },

    // ---- plumbing ----
    #[error("the blocking task of this call failed")]
    Task(#[source] tokio::task::JoinError),
}

/// The gRPC code of a host error, by its class.
fn class_code(class: ErrorClass) -> Code {
    match class {
        ErrorClass::InvalidInput => Code::InvalidArgument,
        ErrorClass::NotFound => Code::NotFound,
        ErrorClass::AlreadyExists => Code::AlreadyExists,
        ErrorClass::FailedPrecondition => Code::FailedPrecondition,
        ErrorClass::Unavailable => Code::Unavailable,
        ErrorClass::DeadlineExceeded => Code::DeadlineExceeded,
        ErrorClass::Internal => Code::Internal,
    }
}

/// The code of a failed reservation step (W9). The stage fails closed in every case; the code
/// only tells the CO whether a retry can help:
/// - the passthrough ioctl failed (errno: the transport to the target is down, the controller
///   is resetting): UNAVAILABLE, a retry after the reconnect may succeed;
/// - Reservation Conflict (0x83) or a holder still listed after the acquire: another host's
///   reservation operation raced this one; ABORTED, the CO retries and the controller's
///   publication records decide who may stage;
/// - the device cannot be opened or is not an NVMe namespace, any other NVMe status, a
///   malformed report: INTERNAL (the kernel or the target does not behave as the spec says).
fn reservation_code(err: &pillar_host::resv::ResvError) -> Code {
    use pillar_host::resv::{CommandError, ResvError as R};
    let command = match err {
        R::Report { source, .. }
        | R::Register { source, .. }
        | R::Acquire { source, .. }
        | R::Preempt { source, .. }
        | R::Release { source, .. }
        | R::Unregister { source, .. } => Some(source),
        R::Open { .. } | R::NamespaceId { .. } | R::DecodeReport { .. } | R::NotHeld { .. } => None,
    };
    match (err, command) {
        (R::NotHeld { .. }, _) => Code::Aborted,
        (_, Some(CommandError::Ioctl(_))) => Code::Unavailable,
        (_, Some(CommandError::Status(s))) if s.is_reservation_conflict() => Code::Aborted,
        _ => Code::Internal,
    }
}

/// The one table from node errors to gRPC codes.
pub fn code_of(err: &NodeError) -> Code {
    use NodeError as E;
    match err {
        E::MissingField(_)
        | E::RelativePath { .. }
        | E::InvalidField { .. }
        | E::InvalidVolumeId { .. }
        | E::UnsupportedCapability(_)
        | E::MissingContext(_)
        | E::InvalidSecret { .. }
        | E::InvalidContext { .. }
        | E::NqnMismatch { .. }
        | E::ReadonlyBlock { .. } => Code::InvalidArgument,
        // A read-only publication of a volume nobody formatted yet: the writer stages first.
        E::ReadOnlyWithoutFilesystem { .. } => Code::FailedPrecondition,
        // W10: without its secret the node cannot connect; the CO's retry helps once the
        // secret is there.
        E::MissingSecret { .. } => Code::FailedPrecondition,
        // The controller refused or is unreachable: its own code says whether a retry helps.
        E::CredentialsNotDelivered { source, .. } => source.code(),
        // A log only a read-write stage may replay (N5): the CO's retry cannot help until one
        // has; fail closed.
        E::LogNeedsRecovery { .. } => Code::FailedPrecondition,

        E::Busy(_) => Code::Aborted,

        // The CSI spec's code for "volume not found" in NodeExpandVolume and
        // NodeGetVolumeStats.
        E::NotStagedHere { .. } | E::VolumePathMissing { .. } | E::NotMounted { .. } => {
            Code::NotFound
        }
        // Same volume, same path, other capability: the spec's ALREADY_EXISTS.
        E::StagedIncompatibly { .. } | E::PublishedIncompatibly { .. } => Code::AlreadyExists,
        E::StagedElsewhere { .. }
        | E::StagingPathBusy { .. }
        | E::NotStaged { .. }
        | E::PublishModeMismatch { .. }
        | E::StillPublished { .. }
        | E::PublishedAtAnotherPath { .. } => Code::FailedPrecondition,
        // The spec's "volume in use" code; kubelet then marks the expansion done on this node
        // rather than failing the pod's mount.
        E::ExpandReadOnly { .. } => Code::FailedPrecondition,

        // Rule N1: the wrong device is never a retryable condition.
        E::IdentityMismatch { .. } => Code::FailedPrecondition,
        // The target did not answer in time: retrying may help (rule C5).
        E::ControllerNotLive { .. } | E::SizeNotReached { .. } => Code::Unavailable,
        E::WaitNamespace { source, .. } => match source.class() {
            ErrorClass::NotFound => Code::Unavailable,
            class => class_code(class),
        },

        E::Reservation { source, .. } => reservation_code(source),

        E::OpenStageStore { source, .. }
        | E::ReadRecord { source, .. }
        | E::WriteRecord { source, .. }
        | E::RemoveRecord { source, .. }
        | E::ListControllers { source, .. }
        | E::Connect { source, .. }
        | E::FindDevice { source, .. }
        | E::LocalDevice { source, .. }
        | E::Disconnect { source, .. }
        | E::Format { source, .. }
        | E::CheckLog { source, .. }
        | E::CheckMount { source, .. }
        | E::Mount { source, .. }
        | E::Unmount { source, .. }
        | E::Stats { source, .. }
        | E::DeviceSize { source, .. }
        | E::Rescan { source, .. }
        | E::Grow { source, .. } => class_code(source.class()),

        E::Config(_)
        | E::NodeId(_)
        | E::VolumePath { .. }
        | E::PrepareTarget { .. }
        | E::RemoveTarget { .. }
        | E::Task(_) => Code::Internal,
    }
}

/// The error with its chain of causes, as one line.
pub fn describe(err: &NodeError) -> String {
    crate::error_chain(err)
}

impl From<NodeError> for tonic::Status {
    fn from(err: NodeError) -> Self {
        tonic::Status::new(code_of(&err), describe(&err))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // proves W9 (a failed reservation step fails the stage with a code saying whether a retry
    // can help)
    #[test]
    fn reservation_failures_map_to_their_codes() {
        use pillar_host::resv::{CommandError, NvmeStatus, ResvError};
        let wrap = |source: ResvError| NodeError::Reservation {
            volume: "v".into(),
            source: Box::new(source),
        };
        let conflict = wrap(ResvError::Preempt {
            device: "/dev/nvme0n1".into(),
            holder_key: 7,
            source: CommandError::Status(NvmeStatus(0x4083)),
        });
        assert_eq!(code_of(&conflict), Code::Aborted);
        assert!(describe(&conflict).contains("reservation conflict"));
        let ioctl = wrap(ResvError::Acquire {
            device: "/dev/nvme0n1".into(),
            source: CommandError::Ioctl(io::Error::from_raw_os_error(libc::ENOTCONN)),
        });
        assert_eq!(code_of(&ioctl), Code::Unavailable);
        let held = wrap(ResvError::NotHeld {
            device: "/dev/nvme0n1".into(),
            found: "x".into(),
        });
        assert_eq!(code_of(&held), Code::Aborted);
        let other = wrap(ResvError::Register {
            device: "/dev/nvme0n1".into(),
            source: CommandError::Status(NvmeStatus(0x4006)),
        });
        assert_eq!(code_of(&other), Code::Internal);
        let open = wrap(ResvError::Open {
            device: "/dev/nvme0n1".into(),
            source: io::Error::from_raw_os_error(libc::ENOENT),
        });
        assert_eq!(code_of(&open), Code::Internal);
    }

    #[test]
    fn host_errors_map_by_class_and_waits_are_retryable() {
        let not_found = || HostError::NamespaceNotFound {
            nqn: "n".into(),
            host: None,
            waited: Duration::ZERO,
            seen: "none".into(),
        };
        assert_eq!(
            code_of(&NodeError::WaitNamespace {
                nqn: "n".into(),
                source: Box::new(not_found())
            }),
            Code::Unavailable
        );
        assert_eq!(
            code_of(&NodeError::FindDevice {
                volume: "v".into(),
                source: Box::new(not_found())
            }),
            Code::NotFound
        );
        let corrupt = NodeError::ReadRecord {
            volume: "v".into(),
            source: Box::new(HostError::CorruptStageRecord {
                path: "/s".into(),
                source: pillar_host::StageRecordError::Empty,
            }),
        };
        assert_eq!(code_of(&corrupt), Code::Internal);
        let text = describe(&corrupt);
        assert!(
            text.contains("stage record of volume v") && text.contains("empty"),
            "{text}"
        );
    }
}
