//! pillar: NVMe/TCP host and filesystem operations on a node.
//!
//! The CSI node service builds on this crate; it holds no gRPC and no policy of its own.
//!
//! The face is the crate root, with two named rooms whose callers use them as namespaces:
//! [`resv`] and [`mountinfo`]; the rest is private behind the root's re-exports:
//! - `fabrics`: connect to an NVMe/TCP subsystem by writing one options line to
//!   `/dev/nvme-fabrics`.
//! - `sysfs`: find the controllers and namespace block devices of a subsystem, verify a
//!   namespace's identity (rule N1), disconnect exactly one subsystem's controllers (rule N4).
//! - `fs`: probe, format only blank devices (rule N3), mount, bind-mount, unmount, grow, stats.
//! - `journal`: whether a filesystem's log needs recovery, read without writing (rule N5).
//! - `stage`: durable, atomically replaced stage records (rules N2, C4).
//! - [`resv`]: NVMe reservations through the passthrough ioctl (rule W9).
//!
//! Every function takes its roots ([`HostPaths`], a state directory) explicitly: tests point them
//! at temporary trees, production passes [`HostPaths::system`]. Nothing reads the environment to
//! change a path.
//!
//! All calls block (syscalls, sysfs reads, child processes, sleeps while polling). An async caller
//! runs them on a blocking thread (`tokio::task::spawn_blocking`).

mod error;
mod fabrics;
mod fs;
mod journal;
pub mod mountinfo;
pub mod resv;
mod stage;
mod sysfs;

mod exec;
mod sys;

#[cfg(any(test, feature = "test-support"))]
pub mod fake;

use std::path::{Path, PathBuf};

pub use error::{ErrorClass, HostError, StageRecordError};
pub use fabrics::{ConnectAuth, ConnectOptions, Controller, connect, remove_psk};
pub use fs::{
    Formatted, FsType, Probe, Signature, VolumeStats, XFS_MIN_BYTES, bind_mount, block_device_size,
    find_mount, format_if_blank, grow_filesystem, is_mountpoint, mkfs, mount, probe, probe_blank,
    unmount, volume_stats,
};
pub use journal::{filesystem_bytes, log_needs_recovery};
pub use mountinfo::MountEntry;
/// The stage record's codec, for the fuzz targets only (`fuzz/`); not part of the crate's API.
#[doc(hidden)]
pub use stage::fuzzing as stage_fuzzing;
pub use stage::{StageMode, StagePhase, StageRecord, StageStore};

/// The parsers of kernel and tool output that have no public entry of their own, for the fuzz
/// targets only (`fuzz/`); not part of the crate's API.
#[doc(hidden)]
pub mod readers_fuzzing {
    /// `blkid -o export` output, as [`crate::probe`] reads it.
    pub fn blkid_export(out: &str) -> Option<crate::Signature> {
        crate::fs::parse_blkid_export(out)
    }

    /// An ext4 superblock's "needs recovery", as [`crate::log_needs_recovery`] reads it.
    pub fn ext4_needs_recovery(sb: &[u8; 1024]) -> Result<bool, String> {
        crate::journal::parse_ext4_superblock(sb)
    }

    /// `xfs_logprint -t`'s log state, as [`crate::log_needs_recovery`] reads it.
    pub fn xfs_log_dirty(stdout: &str) -> Option<bool> {
        crate::journal::parse_logprint_state(stdout)
    }

    /// A block device's `dev` attribute (`major:minor`).
    pub fn devnum(s: &str) -> Option<(u32, u32)> {
        crate::sysfs::parse_devnum(s)
    }

    /// The kernel's reply to a connect (`instance=N,cntlid=M`).
    pub use crate::fabrics::parse_reply;
    /// Every controller under `<sys>/class/nvme`.
    pub use crate::sysfs::all_controllers;
    /// Whether a disk name is a namespace's (`nvme<C>n<N>`).
    pub use crate::sysfs::is_namespace_name;
}
pub use sysfs::{
    ControllerInfo, ControllerState, NamespaceDevice, NamespaceParent, POLL_INTERVAL,
    controller_live, controllers_for, disconnect_subsystem, namespaces_for, namespaces_for_host,
    rescan_controller, verify_identity, wait_for_namespace,
};

/// The roots under which the kernel's device nodes and sysfs live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPaths {
    /// Where device nodes live (`/dev`): `nvme-fabrics`, `nvme0n1`, ...
    pub dev: PathBuf,
    /// Where sysfs is mounted (`/sys`).
    pub sys: PathBuf,
}

impl HostPaths {
    /// The running system's `/dev` and `/sys`.
    pub fn system() -> Self {
        Self {
            dev: PathBuf::from("/dev"),
            sys: PathBuf::from("/sys"),
        }
    }

    /// Roots under `root`: `<root>/dev` and `<root>/sys` (for tests and fakes).
    pub fn under(root: &Path) -> Self {
        Self {
            dev: root.join("dev"),
            sys: root.join("sys"),
        }
    }
}

pub type Result<T, E = HostError> = std::result::Result<T, E>;
