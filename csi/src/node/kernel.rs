//! The node's kernel: every action of the node engine that reaches past its own stage records
//! (NVMe/TCP connect and disconnect, the sysfs views of controllers and namespaces, block
//! devices and filesystems, mounts and the mount table, NVMe reservations), behind one trait.
//!
//! [`HostKernel`], the default, is the running system: each method is one `pillar_host` call,
//! exactly what the engine called before the seam. Another implementation exists only where the
//! real kernel cannot run: the simulation's host double (`sim/`), which must enforce the
//! kernel's rules (a mount needs the device, a device needs a live controller, a controller
//! needs the target's admission), so the engine's decisions are judged against them.
//!
//! Invariant: the engine reaches the kernel only through [`Kernel`]; the rules that decide (N1's
//! identity check, N3's format-only-if-blank, N5's read-only stage) stay in the engine and in
//! `pillar_host`'s pure functions, so the double never re-implements them.

use std::fmt::Debug;
use std::path::Path;
use std::time::Duration;

use pillar_host::resv::{self, Held, ResvError};
use pillar_host::{
    ConnectOptions, Controller, ControllerInfo, Formatted, FsType, HostError, HostPaths,
    MountEntry, NamespaceDevice, Probe, VolumeStats,
};
use pillar_nvmet::{HostNqn, SubsystemNqn};
use uuid::Uuid;

/// The node's kernel-facing actions.
pub trait Kernel: Debug + Send + Sync {
    /// Every controller of subsystem `nqn` on this machine, of any host, in any state.
    fn controllers(&self, nqn: &SubsystemNqn) -> Result<Vec<ControllerInfo>, HostError>;
    /// Connects to the subsystem `opts` names (`/dev/nvme-fabrics`).
    fn connect(&self, opts: &ConnectOptions) -> Result<Controller, HostError>;
    /// Deletes `hostnqn`'s controllers of `nqn` (every host's with `None`); their names.
    fn disconnect(
        &self,
        nqn: &SubsystemNqn,
        hostnqn: Option<&HostNqn>,
    ) -> Result<Vec<String>, HostError>;
    /// Waits up to `timeout` for a namespace block device of `nqn` reached by `hostnqn`.
    fn wait_for_namespace(
        &self,
        nqn: &SubsystemNqn,
        hostnqn: Option<&HostNqn>,
        timeout: Duration,
    ) -> Result<NamespaceDevice, HostError>;
    /// The namespace block devices of `nqn` reached by `hostnqn`, now.
    fn namespaces(
        &self,
        nqn: &SubsystemNqn,
        hostnqn: Option<&HostNqn>,
    ) -> Result<Vec<NamespaceDevice>, HostError>;
    /// Rescans controller `name` so a grown namespace shows its size.
    fn rescan(&self, name: &str) -> Result<(), HostError>;

    /// The size of the block device at `dev`.
    fn device_size(&self, dev: &Path) -> Result<u64, HostError>;
    /// `(major, minor)` of the device node at `dev`.
    fn device_number(&self, dev: &Path) -> std::io::Result<(u32, u32)>;
    /// What signature `dev` holds.
    fn probe(&self, dev: &Path) -> Result<Probe, HostError>;
    /// Formats `dev` with `fs` only if it is blank (N3).
    fn format_if_blank(
        &self,
        dev: &Path,
        fs: FsType,
        options: &[String],
    ) -> Result<Formatted, HostError>;
    /// Whether `dev`'s filesystem log needs a replay.
    fn log_needs_recovery(&self, dev: &Path, fs: FsType) -> Result<bool, HostError>;
    /// The size `dev`'s filesystem says it has.
    fn filesystem_bytes(&self, dev: &Path, fs: FsType) -> Result<u64, HostError>;
    /// Grows the filesystem of `dev`, mounted at `mount_path`, to the device.
    fn grow_filesystem(&self, dev: &Path, mount_path: &Path, fs: FsType) -> Result<(), HostError>;

    /// Every mount (`/proc/self/mountinfo`).
    fn mount_table(&self) -> Result<Vec<MountEntry>, HostError>;
    /// The mount at exactly `path`, if any.
    fn find_mount(&self, path: &Path) -> Result<Option<MountEntry>, HostError>;
    /// Whether something is mounted at `path`.
    fn is_mountpoint(&self, path: &Path) -> Result<bool, HostError>;
    /// Mounts `dev`'s `fs` at `target`.
    fn mount(
        &self,
        dev: &Path,
        target: &Path,
        fs: FsType,
        readonly: bool,
        options: &[String],
    ) -> Result<(), HostError>;
    /// Bind-mounts `src` at `target`.
    fn bind_mount(&self, src: &Path, target: &Path, readonly: bool) -> Result<(), HostError>;
    /// Unmounts `target` (nothing mounted there is not an error).
    fn unmount(&self, target: &Path) -> Result<(), HostError>;
    /// The usage of the filesystem mounted at `path`.
    fn volume_stats(&self, path: &Path) -> Result<VolumeStats, HostError>;

    /// Makes this host the Write Exclusive holder of the namespace at `dev` (W9).
    fn hold_write_exclusive(
        &self,
        dev: &Path,
        host_id: &Uuid,
        key: u64,
        preempt: bool,
    ) -> Result<Held, ResvError>;
    /// Releases this host's reservation and unregisters its key; whether there was one.
    fn release_and_unregister(&self, dev: &Path, host_id: &Uuid) -> Result<bool, ResvError>;
}

/// The running system's kernel, under `paths` (`/dev`, `/sys`; a fake sysfs in unit tests).
#[derive(Clone, Debug)]
pub struct HostKernel {
    pub paths: HostPaths,
}

impl Kernel for HostKernel {
    fn controllers(&self, nqn: &SubsystemNqn) -> Result<Vec<ControllerInfo>, HostError> {
        pillar_host::controllers_for(&self.paths, nqn)
    }

    fn connect(&self, opts: &ConnectOptions) -> Result<Controller, HostError> {
        pillar_host::connect(&self.paths, opts)
    }

    fn disconnect(
        &self,
        nqn: &SubsystemNqn,
        hostnqn: Option<&HostNqn>,
    ) -> Result<Vec<String>, HostError> {
        let gone = pillar_host::disconnect_subsystem(&self.paths, nqn, hostnqn)?;
        if let Some(host) = hostnqn {
            // This host's TLS PSK for the subsystem, if a connect put one in the keyring: of no
            // use once its controllers are gone, and secret material. A failure leaves a key
            // the target no longer admits once revoked; it does not fail the disconnect.
            if let Err(e) = pillar_host::remove_psk(&pillar_nvmet::psk_identity(host, nqn)) {
                tracing::warn!(%nqn, error = %e, "cannot remove the TLS PSK of a disconnected subsystem");
            }
        }
        Ok(gone)
    }

    fn wait_for_namespace(
        &self,
        nqn: &SubsystemNqn,
        hostnqn: Option<&HostNqn>,
        timeout: Duration,
    ) -> Result<NamespaceDevice, HostError> {
        pillar_host::wait_for_namespace(&self.paths, nqn, hostnqn, timeout)
    }

    fn namespaces(
        &self,
        nqn: &SubsystemNqn,
        hostnqn: Option<&HostNqn>,
    ) -> Result<Vec<NamespaceDevice>, HostError> {
        pillar_host::namespaces_for_host(&self.paths, nqn, hostnqn)
    }

    fn rescan(&self, name: &str) -> Result<(), HostError> {
        pillar_host::rescan_controller(&self.paths, name)
    }

    fn device_size(&self, dev: &Path) -> Result<u64, HostError> {
        pillar_host::block_device_size(dev)
    }

    fn device_number(&self, dev: &Path) -> std::io::Result<(u32, u32)> {
        use std::os::unix::fs::MetadataExt;
        let rdev = std::fs::metadata(dev)?.rdev();
        Ok((libc::major(rdev), libc::minor(rdev)))
    }

    fn probe(&self, dev: &Path) -> Result<Probe, HostError> {
        pillar_host::probe(dev)
    }

    fn format_if_blank(
        &self,
        dev: &Path,
        fs: FsType,
        options: &[String],
    ) -> Result<Formatted, HostError> {
        pillar_host::format_if_blank(dev, fs, options)
    }

    fn log_needs_recovery(&self, dev: &Path, fs: FsType) -> Result<bool, HostError> {
        pillar_host::log_needs_recovery(dev, fs)
    }

    fn filesystem_bytes(&self, dev: &Path, fs: FsType) -> Result<u64, HostError> {
        pillar_host::filesystem_bytes(dev, fs)
    }

    fn grow_filesystem(&self, dev: &Path, mount_path: &Path, fs: FsType) -> Result<(), HostError> {
        pillar_host::grow_filesystem(dev, mount_path, fs)
    }

    fn mount_table(&self) -> Result<Vec<MountEntry>, HostError> {
        pillar_host::mountinfo::read(Path::new(pillar_host::mountinfo::SELF_MOUNTINFO))
    }

    fn find_mount(&self, path: &Path) -> Result<Option<MountEntry>, HostError> {
        pillar_host::find_mount(path)
    }

    fn is_mountpoint(&self, path: &Path) -> Result<bool, HostError> {
        pillar_host::is_mountpoint(path)
    }

    fn mount(
        &self,
        dev: &Path,
        target: &Path,
        fs: FsType,
        readonly: bool,
        options: &[String],
    ) -> Result<(), HostError> {
        pillar_host::mount(dev, target, fs, readonly, options)
    }

    fn bind_mount(&self, src: &Path, target: &Path, readonly: bool) -> Result<(), HostError> {
        pillar_host::bind_mount(src, target, readonly)
    }

    fn unmount(&self, target: &Path) -> Result<(), HostError> {
        pillar_host::unmount(target)
    }

    fn volume_stats(&self, path: &Path) -> Result<VolumeStats, HostError> {
        pillar_host::volume_stats(path)
    }

    fn hold_write_exclusive(
        &self,
        dev: &Path,
        host_id: &Uuid,
        key: u64,
        preempt: bool,
    ) -> Result<Held, ResvError> {
        resv::hold_write_exclusive(dev, host_id, key, preempt)
    }

    fn release_and_unregister(&self, dev: &Path, host_id: &Uuid) -> Result<bool, ResvError> {
        resv::release_and_unregister(dev, host_id)
    }
}
