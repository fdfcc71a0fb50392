//! The crate's error type: one variant per step that can fail, each carrying its source.
//!
//! [`HostError::class`] sorts them into the few kinds a gRPC edge needs (invalid input, not
//! found, failed precondition, ...); the mapping to status codes is the caller's.

use std::io;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use pillar_nvmet::{NameError, Nguid};
use uuid::Uuid;

use crate::fs::{FsType, Signature};

/// What kind of failure an error is, for mapping to a gRPC status at the edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// The caller passed something malformed (an option, a path, a parameter).
    InvalidInput,
    /// Something the call needs does not exist (a device, a path, a namespace that never came).
    NotFound,
    /// The object exists already in a form the call cannot reconcile (already connected).
    AlreadyExists,
    /// The system is not in a state where the call may proceed, and retrying will not help until
    /// someone changes it (a device with another filesystem, a namespace with the wrong
    /// identity).
    FailedPrecondition,
    /// A remote or kernel service could not be reached right now; retrying may help.
    Unavailable,
    /// A child process ran out of time.
    DeadlineExceeded,
    /// Anything else: I/O errors, unexpected kernel output, bugs.
    Internal,
}

/// Every way a host operation can fail.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    // ---- invalid input ----
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidArgument {
        what: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("mkfs option {value:?} is refused: {reason}")]
    MkfsOption { value: String, reason: String },
    #[error("path {path:?} contains a NUL byte")]
    PathHasNul { path: PathBuf },

    // ---- fabrics ----
    #[error("cannot open {path:?} (is the nvme-fabrics module loaded?)")]
    OpenFabrics { path: PathBuf, source: io::Error },
    #[error("cannot {what} the kernel's .nvme keyring")]
    Keyring {
        what: &'static str,
        source: io::Error,
    },
    #[error(
        "the kernel has no .nvme keyring, so it has no TLS for NVMe/TCP (CONFIG_NVME_TCP_TLS not \
         set, or the nvme-keyring module not loaded)"
    )]
    NoKeyring,
    #[error("subsystem {nqn} at {traddr}:{trsvcid} is already connected with these options")]
    AlreadyConnected {
        nqn: String,
        traddr: IpAddr,
        trsvcid: u16,
        source: io::Error,
    },
    #[error("connecting to subsystem {nqn} at {traddr}:{trsvcid} failed")]
    Connect {
        nqn: String,
        traddr: IpAddr,
        trsvcid: u16,
        source: io::Error,
    },
    #[error("the kernel accepted only {written} of {len} bytes of the connect options")]
    ShortConnectWrite { written: usize, len: usize },
    #[error("reading the connect reply from {path:?} failed")]
    ReadConnectReply { path: PathBuf, source: io::Error },
    #[error("unexpected connect reply {reply:?} (expected \"instance=N,cntlid=M\")")]
    ConnectReply { reply: String },

    // ---- sysfs ----
    #[error("reading {path:?} failed")]
    ReadSysfs { path: PathBuf, source: io::Error },
    #[error("unexpected content {value:?} in {path:?}: {reason}")]
    ParseSysfs {
        path: PathBuf,
        value: String,
        reason: String,
    },
    #[error(
        "no namespace of subsystem {nqn} appeared within {waited:?}{}; controllers seen: {seen}",
        host.as_ref().map(|h| format!(" for host {h}")).unwrap_or_default()
    )]
    NamespaceNotFound {
        nqn: String,
        host: Option<String>,
        waited: Duration,
        seen: String,
    },
    #[error("subsystem {nqn} has several namespace devices {devices:?}; refusing to guess")]
    AmbiguousNamespace { nqn: String, devices: Vec<String> },
    #[error(
        "device {device} is not the expected namespace: uuid {found_uuid:?} (expected \
         {expected_uuid}), nguid {found_nguid:?} (expected {expected_nguid})"
    )]
    IdentityMismatch {
        device: String,
        expected_uuid: Uuid,
        found_uuid: Option<Uuid>,
        expected_nguid: Nguid,
        found_nguid: Option<Nguid>,
    },
    #[error("device node {path:?} is {found} but sysfs says {device} is {expected}")]
    StaleDeviceNode {
        path: PathBuf,
        device: String,
        expected: String,
        found: String,
    },
    #[error("deleting controller {controller} through {path:?} failed")]
    DeleteController {
        controller: String,
        path: PathBuf,
        source: io::Error,
    },
    #[error("rescanning controller {controller} through {path:?} failed")]
    RescanController {
        controller: String,
        path: PathBuf,
        source: io::Error,
    },

    // ---- child processes ----
    #[error("starting {program} failed")]
    Spawn { program: String, source: io::Error },
    #[error("waiting for {program} failed")]
    Wait { program: String, source: io::Error },
    #[error("{program} did not finish within {timeout:?} and was killed")]
    CommandTimedOut { program: String, timeout: Duration },
    #[error("{program} {args:?} failed ({status}): {stderr}")]
    CommandFailed {
        program: String,
        args: Vec<String>,
        status: String,
        stderr: String,
    },

    // ---- block devices and filesystems ----
    #[error("device {path:?} cannot be used")]
    Device { path: PathBuf, source: io::Error },
    #[error("{path:?} is not a block device")]
    NotBlockDevice { path: PathBuf },
    #[error("blkid gave an unusable answer for {device:?}: {detail}")]
    Probe { device: PathBuf, detail: String },
    #[error("device {device:?} holds {found}; refusing to format it as {requested}")]
    ExistingSignature {
        device: PathBuf,
        found: Signature,
        requested: FsType,
    },
    #[error("cannot tell whether the {fs} log on {device:?} needs recovery: {detail}")]
    LogState {
        device: PathBuf,
        fs: FsType,
        detail: String,
    },
    #[error("cannot read the size of the {fs} filesystem on {device:?}: {detail}")]
    Superblock {
        device: PathBuf,
        fs: FsType,
        detail: String,
    },
    #[error("after mkfs, {device:?} holds {found:?} instead of {requested}")]
    FormatNotVisible {
        device: PathBuf,
        found: Option<Signature>,
        requested: FsType,
    },
    #[error("mounting {source_path:?} on {target:?} ({fs}) failed")]
    Mount {
        source_path: PathBuf,
        target: PathBuf,
        fs: String,
        source: io::Error,
    },
    #[error("remounting bind mount {target:?} read-only failed (the bind was undone)")]
    ReadonlyRemount { target: PathBuf, source: io::Error },
    #[error("unmounting {target:?} failed")]
    Unmount { target: PathBuf, source: io::Error },
    #[error("{target:?} is still a mount point after {attempts} unmounts")]
    StillMounted { target: PathBuf, attempts: u32 },
    #[error("reading the mount table {path:?} failed")]
    ReadMountInfo { path: PathBuf, source: io::Error },
    #[error("line {line_no} of the mount table is malformed: {line:?}")]
    ParseMountInfo { line_no: usize, line: String },
    #[error("resolving {path:?} failed")]
    ResolvePath { path: PathBuf, source: io::Error },
    #[error("statvfs({path:?}) failed")]
    Statvfs { path: PathBuf, source: io::Error },
    #[error("reading the size of {path:?} failed")]
    DeviceSize { path: PathBuf, source: io::Error },

    // ---- stage records ----
    #[error("stage record I/O on {path:?} failed")]
    StageIo { path: PathBuf, source: io::Error },
    #[error("stage record {path:?} is corrupt")]
    CorruptStageRecord {
        path: PathBuf,
        source: StageRecordError,
    },
    #[error("encoding the stage record of volume {volume} failed")]
    EncodeStageRecord {
        volume: String,
        source: serde_json::Error,
    },
}

/// Why a stage record on disk could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StageRecordError {
    #[error("the file is empty")]
    Empty,
    #[error("the file is not a valid stage record")]
    Json(#[from] serde_json::Error),
    #[error("record version {found} is not supported (this build reads version {supported})")]
    UnsupportedVersion { found: u32, supported: u32 },
    #[error("the record holds an invalid name")]
    Name(#[from] NameError),
    #[error("the file is named for volume {file} but the record is for volume {record}")]
    VolumeMismatch { file: String, record: String },
}

impl HostError {
    /// The kind of failure, for the gRPC edge.
    pub fn class(&self) -> ErrorClass {
        use ErrorClass as C;
        match self {
            Self::InvalidArgument { .. } | Self::MkfsOption { .. } | Self::PathHasNul { .. } => {
                C::InvalidInput
            }
            Self::AlreadyConnected { .. } => C::AlreadyExists,
            Self::NoKeyring => C::FailedPrecondition,
            Self::Keyring { .. } => C::Internal,
            Self::OpenFabrics { source, .. } => {
                if source.kind() == io::ErrorKind::NotFound {
                    C::Unavailable
                } else {
                    C::Internal
                }
            }
            Self::Connect { source, .. } => match source.raw_os_error() {
                Some(libc::EINVAL) => C::InvalidInput,
                _ => C::Unavailable,
            },
            Self::NamespaceNotFound { .. } => C::NotFound,
            Self::AmbiguousNamespace { .. }
            | Self::IdentityMismatch { .. }
            | Self::StaleDeviceNode { .. }
            | Self::ExistingSignature { .. }
            | Self::NotBlockDevice { .. }
            | Self::StillMounted { .. } => C::FailedPrecondition,
            Self::CommandTimedOut { .. } => C::DeadlineExceeded,
            Self::Device { source, .. }
            | Self::Statvfs { source, .. }
            | Self::DeviceSize { source, .. }
            | Self::ResolvePath { source, .. }
            | Self::Mount { source, .. } => {
                if source.kind() == io::ErrorKind::NotFound {
                    C::NotFound
                } else {
                    C::Internal
                }
            }
            Self::Unmount { source, .. } => {
                if source.raw_os_error() == Some(libc::EBUSY) {
                    C::FailedPrecondition
                } else {
                    C::Internal
                }
            }
            Self::ShortConnectWrite { .. }
            | Self::ReadConnectReply { .. }
            | Self::ConnectReply { .. }
            | Self::ReadSysfs { .. }
            | Self::ParseSysfs { .. }
            | Self::DeleteController { .. }
            | Self::RescanController { .. }
            | Self::Spawn { .. }
            | Self::Wait { .. }
            | Self::CommandFailed { .. }
            | Self::Probe { .. }
            | Self::FormatNotVisible { .. }
            | Self::LogState { .. }
            | Self::Superblock { .. }
            | Self::ReadonlyRemount { .. }
            | Self::ReadMountInfo { .. }
            | Self::ParseMountInfo { .. }
            | Self::StageIo { .. }
            | Self::CorruptStageRecord { .. }
            | Self::EncodeStageRecord { .. } => C::Internal,
        }
    }

    /// The OS error number behind this error, if there is one.
    pub fn errno(&self) -> Option<i32> {
        let source: &io::Error = match self {
            Self::OpenFabrics { source, .. }
            | Self::AlreadyConnected { source, .. }
            | Self::Connect { source, .. }
            | Self::ReadConnectReply { source, .. }
            | Self::ReadSysfs { source, .. }
            | Self::DeleteController { source, .. }
            | Self::RescanController { source, .. }
            | Self::Spawn { source, .. }
            | Self::Wait { source, .. }
            | Self::Device { source, .. }
            | Self::Mount { source, .. }
            | Self::ReadonlyRemount { source, .. }
            | Self::Unmount { source, .. }
            | Self::ReadMountInfo { source, .. }
            | Self::ResolvePath { source, .. }
            | Self::Statvfs { source, .. }
            | Self::DeviceSize { source, .. }
            | Self::StageIo { source, .. } => source,
            _ => return None,
        };
        source.raw_os_error()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_separate_the_kinds_the_edge_needs() {
        let enoent = || io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(
            HostError::InvalidArgument {
                what: "x",
                value: String::new(),
                reason: "y"
            }
            .class(),
            ErrorClass::InvalidInput
        );
        assert_eq!(
            HostError::Statvfs {
                path: "/x".into(),
                source: enoent()
            }
            .class(),
            ErrorClass::NotFound
        );
        assert_eq!(
            HostError::Statvfs {
                path: "/x".into(),
                source: io::Error::from_raw_os_error(libc::EIO)
            }
            .class(),
            ErrorClass::Internal
        );
        assert_eq!(
            HostError::AlreadyConnected {
                nqn: "n".into(),
                traddr: IpAddr::from([127, 0, 0, 1]),
                trsvcid: 4420,
                source: io::Error::from_raw_os_error(libc::EALREADY)
            }
            .class(),
            ErrorClass::AlreadyExists
        );
        let corrupt = HostError::CorruptStageRecord {
            path: "/s".into(),
            source: StageRecordError::Empty,
        };
        assert_eq!(corrupt.class(), ErrorClass::Internal);
        assert_eq!(corrupt.errno(), None);
        assert_eq!(
            HostError::Unmount {
                target: "/t".into(),
                source: io::Error::from_raw_os_error(libc::EBUSY)
            }
            .errno(),
            Some(libc::EBUSY)
        );
    }
}
