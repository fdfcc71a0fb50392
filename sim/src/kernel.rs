//! One host's kernel, a double of the node plugin's [`Kernel`]: the real node engine
//! (`pillar_csi::node`) runs over it, and it enforces the rules the real kernel would.
//!
//! - **NVMe/TCP.** A connect is the target double's `host_connects_with_secret` (the subsystem
//!   linked to the port, the host admitted by the ACL, the DH-HMAC-CHAP secret right); the
//!   controller is this host's until it disconnects. It is live while the target still holds
//!   it; a controller the target cut (W7) reconnects, as the kernel does on its own until
//!   `ctrl_loss_tmo`, only if the target admits the host again. The namespace device
//!   (`nvme<instance>n1`, multipath off) lives as long as its controller, and shows the
//!   identity the target's namespace has and the size the host last scanned: at the connect
//!   (or the namespace's first sight), at a reconnect, and at a rescan of the controller
//!   (`rescan_controller`); a namespace gone from the target is forgotten. A namespace the
//!   target grew keeps its old size here until one of those: the ns-changed event nvmet sends
//!   at `revalidate_size` is not modelled, which is the case of it lost (a controller that was
//!   resetting), the one only the node plugin's rescan covers.
//! - **The disk.** What a filesystem tool writes is a small header at the start of the
//!   namespace's backing file (the agent's pool file): the filesystem type, its size, and
//!   whether its log needs a replay. Writing needs a live controller and, when another host
//!   holds the namespace's Write Exclusive reservation, fails (a reservation conflict). A
//!   read-write mount dirties the log until its clean unmount; a read-only mount that may
//!   replay the log (no `noload` / `norecovery`) writes too. Growing a filesystem (resize2fs,
//!   xfs_growfs) needs a read-write mount of the device at the path given (EROFS otherwise)
//!   and grows it to the device's size as scanned, not the target's.
//! - **Mounts.** A table like `/proc/self/mountinfo`. A device is mounted at most once (one
//!   superblock, so never two read-write mounts of one volume on a host, N5); a mount needs the
//!   device, an existing directory, the filesystem its header names, and nothing mounted there
//!   yet; binds copy their source's device; unmounting what is not mounted succeeds.
//! - **Reservations.** [`Reservations`], shared by every host: one Write Exclusive holder per
//!   namespace, preempted only on request, lost with the target's memory.
//!
//! Not modelled: multipath, partitions, block volumes (the simulation stages filesystems),
//! and time (the engine's waits are given no time: the connect timeout is zero, so the namespace
//! is there at once or not at all).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use pillar_csi::node::Kernel;
use pillar_host::resv::{Held, ResvError};
use pillar_host::{
    ConnectOptions, Controller, ControllerInfo, ControllerState, Formatted, FsType, HostError,
    MountEntry, NamespaceDevice, NamespaceParent, Probe, Signature, VolumeStats,
};
use pillar_nvmet::{ConfigfsDouble, HostNqn, Nguid, SubsystemNqn, parse_uuid};

use crate::targets::{Reservations, Targets};

mod disk;
mod mounts;

pub use disk::filesystem_bytes_in;
use disk::{Fs, file_len};

/// The major number of NVMe namespace devices.
const NVME_MAJOR: u32 = 259;

/// One of this host's controllers.
#[derive(Clone, Debug)]
struct Ctrl {
    instance: u32,
    nqn: String,
    agent: String,
    root: PathBuf,
    traddr: IpAddr,
    trsvcid: u16,
    port: u16,
    secret: Option<String>,
    /// The namespace's size as this host last scanned it (the block device's capacity).
    size: Option<u64>,
}

#[derive(Debug, Default)]
struct State {
    next_instance: u32,
    next_mount: u64,
    ctrls: Vec<Ctrl>,
    mounts: Vec<MountEntry>,
}

/// A kernel that breaks a promise NodeExpandVolume relies on, for the tests that prove
/// invariant 9 catches it. Never set in a seed's run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Broken {
    /// Keeps every promise.
    #[default]
    No,
    /// A filesystem grow that answers success and grows nothing.
    GrowIsNoop,
    /// A device that shows 1 MiB more than its namespace holds.
    SizeOverstated,
}

/// One host's kernel.
#[derive(Debug)]
pub struct SimKernel {
    host_nqn: String,
    key: u64,
    dev: PathBuf,
    targets: Targets,
    reservations: Arc<Reservations>,
    state: Mutex<State>,
    broken: Mutex<Broken>,
}

fn errno(e: i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(e)
}

fn device_err(path: &Path, e: i32) -> HostError {
    HostError::Device {
        path: path.to_path_buf(),
        source: errno(e),
    }
}

fn mount_err(source_path: &Path, target: &Path, fs: &str, e: i32) -> HostError {
    HostError::Mount {
        source_path: source_path.to_path_buf(),
        target: target.to_path_buf(),
        fs: fs.to_owned(),
        source: errno(e),
    }
}

/// The target port listening on `traddr:trsvcid` under `root`.
fn port_of(root: &Path, traddr: IpAddr, trsvcid: u16) -> Option<u16> {
    let ports = std::fs::read_dir(root.join("ports")).ok()?;
    for port in ports.flatten() {
        let attr = |name: &str| {
            std::fs::read_to_string(port.path().join(name))
                .map(|s| s.trim().to_owned())
                .unwrap_or_default()
        };
        if attr("addr_traddr") == traddr.to_string() && attr("addr_trsvcid") == trsvcid.to_string()
        {
            return port.file_name().to_str()?.parse().ok();
        }
    }
    None
}

/// The target's namespace 1 of `nqn`: its backing file, UUID and NGUID, if enabled.
fn target_namespace(root: &Path, nqn: &str) -> Option<(PathBuf, uuid::Uuid, Nguid)> {
    let dir = root
        .join("subsystems")
        .join(nqn)
        .join("namespaces")
        .join("1");
    let attr = |name: &str| {
        std::fs::read_to_string(dir.join(name))
            .ok()
            .map(|s| s.trim().to_owned())
    };
    if attr("enable")? != "1" {
        return None;
    }
    let uuid = parse_uuid(&attr("device_uuid")?).ok()?;
    let nguid = Nguid::parse(&attr("device_nguid")?).ok()?;
    Some((PathBuf::from(attr("device_path")?), uuid, nguid))
}

impl SimKernel {
    /// The kernel of host `host_nqn` (host ID `host_id`), its device names under `dev`.
    pub fn new(
        host_nqn: &str,
        host_id: &uuid::Uuid,
        dev: PathBuf,
        targets: Targets,
        reservations: Arc<Reservations>,
    ) -> Self {
        Self {
            host_nqn: host_nqn.to_owned(),
            key: pillar_host::resv::key_for_host(host_id),
            dev,
            targets,
            reservations,
            state: Mutex::default(),
            broken: Mutex::default(),
        }
    }

    /// Breaks this kernel the way `broken` says (the tests of invariant 9).
    pub fn set_broken(&self, broken: Broken) {
        *self.broken.lock().unwrap_or_else(PoisonError::into_inner) = broken;
    }

    fn broken(&self) -> Broken {
        *self.broken.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Scans the namespace of controller `instance` now: its size becomes what the target's
    /// namespace holds (unknown while the target has none).
    fn scan(&self, instance: u32) {
        let mut state = self.lock();
        if let Some(c) = state.ctrls.iter_mut().find(|c| c.instance == instance) {
            c.size = target_namespace(&c.root, &c.nqn).map(|(file, _, _)| file_len(&file));
        }
    }

    /// The size controller `c`'s namespace shows: as last scanned, or scanned now at its first
    /// sight.
    fn scanned_size(&self, c: &Ctrl) -> u64 {
        let known = self
            .lock()
            .ctrls
            .iter()
            .find(|x| x.instance == c.instance)
            .and_then(|x| x.size);
        let size = match known {
            Some(size) => size,
            None => {
                self.scan(c.instance);
                self.lock()
                    .ctrls
                    .iter()
                    .find(|x| x.instance == c.instance)
                    .and_then(|x| x.size)
                    .unwrap_or(0)
            }
        };
        match self.broken() {
            Broken::SizeOverstated => size + (1 << 20),
            _ => size,
        }
    }

    /// Forgets the scanned size of controller `instance`: its namespace is gone from the
    /// target, and the kernel drops the device; one that comes back is scanned anew.
    fn forget_size(&self, instance: u32) {
        if let Some(c) = self
            .lock()
            .ctrls
            .iter_mut()
            .find(|c| c.instance == instance)
        {
            c.size = None;
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn device_path(&self, instance: u32) -> PathBuf {
        self.dev.join(format!("nvme{instance}n1"))
    }

    /// Whether the target still holds `c`; a cut controller reconnects if the target admits
    /// the host again (the kernel's own reconnect).
    fn live(&self, c: &Ctrl) -> bool {
        let Ok(double) = ConfigfsDouble::create(c.root.clone()) else {
            return false;
        };
        if double
            .controllers(&c.nqn)
            .is_ok_and(|l| l.contains(&(c.port, self.host_nqn.clone())))
        {
            return true;
        }
        let back = double
            .host_connects_with_secret(&c.nqn, &self.host_nqn, c.port, c.secret.as_deref())
            .is_ok();
        if back {
            // The kernel scans the namespaces of a controller that reconnected.
            self.scan(c.instance);
        }
        back
    }

    /// The controller behind the device at `dev`.
    fn ctrl_of(&self, dev: &Path) -> Option<Ctrl> {
        self.lock()
            .ctrls
            .iter()
            .find(|c| self.device_path(c.instance) == dev)
            .cloned()
    }

    /// The backing file of the device at `dev`, for I/O: the device must exist, its controller
    /// be live, and the target's namespace be there.
    fn backing(&self, dev: &Path) -> Result<(Ctrl, PathBuf), HostError> {
        let c = self
            .ctrl_of(dev)
            .ok_or_else(|| device_err(dev, libc::ENXIO))?;
        if !self.live(&c) {
            return Err(device_err(dev, libc::EIO));
        }
        let Some((file, _, _)) = target_namespace(&c.root, &c.nqn) else {
            self.forget_size(c.instance);
            return Err(device_err(dev, libc::EIO));
        };
        Ok((c, file))
    }

    fn info(&self, c: &Ctrl) -> ControllerInfo {
        ControllerInfo {
            name: format!("nvme{}", c.instance),
            instance: c.instance,
            subsysnqn: c.nqn.clone(),
            state: if self.live(c) {
                ControllerState::Live
            } else {
                ControllerState::Connecting
            },
            transport: Some("tcp".into()),
            hostnqn: Some(self.host_nqn.clone()),
            hostid: None,
            address: Some(format!("traddr={},trsvcid={}", c.traddr, c.trsvcid)),
        }
    }

    fn device(&self, c: &Ctrl) -> Option<NamespaceDevice> {
        let Some((_, uuid, nguid)) = target_namespace(&c.root, &c.nqn) else {
            self.forget_size(c.instance);
            return None;
        };
        let size_bytes = self.scanned_size(c);
        Some(NamespaceDevice {
            name: format!("nvme{}n1", c.instance),
            dev_path: self.device_path(c.instance),
            uuid: Some(uuid),
            nguid: Some(nguid),
            size_bytes,
            nsid: Some(1),
            devnum: Some((NVME_MAJOR, c.instance)),
            parent: NamespaceParent::Controller(format!("nvme{}", c.instance)),
        })
    }

    /// This host's devices of `nqn` whose controller is live.
    fn devices(&self, nqn: &SubsystemNqn) -> Vec<NamespaceDevice> {
        let ctrls: Vec<Ctrl> = self
            .lock()
            .ctrls
            .iter()
            .filter(|c| c.nqn == nqn.as_str())
            .cloned()
            .collect();
        ctrls
            .iter()
            .filter(|c| self.live(c))
            .filter_map(|c| self.device(c))
            .collect()
    }

    /// The mounts of this host: `(volume's subsystem NQN, agent, port, mount)` of every mount
    /// of a device this host holds, binds included. For the invariants.
    pub fn mounts(&self) -> Vec<(String, String, u16, MountEntry)> {
        let state = self.lock();
        state
            .mounts
            .iter()
            .filter_map(|m| {
                let c = state
                    .ctrls
                    .iter()
                    .find(|c| (NVME_MAJOR, c.instance) == (m.major, m.minor))?;
                Some((c.nqn.clone(), c.agent.clone(), c.port, m.clone()))
            })
            .collect()
    }

    /// What the target's namespace of `nqn` holds, in bytes, as this host reaches it (its
    /// backing file's length, not the size the host scanned): for invariant 9.
    pub fn namespace_bytes(&self, nqn: &str) -> Option<u64> {
        let root = self
            .lock()
            .ctrls
            .iter()
            .find(|c| c.nqn == nqn)?
            .root
            .clone();
        target_namespace(&root, nqn).map(|(file, _, _)| file_len(&file))
    }

    /// Whether the target holds this host's controller of `nqn` through `port` at `agent`.
    pub fn reaches(&self, agent: &str, nqn: &str, port: u16) -> bool {
        let Some((_, root)) = self.targets.values().find(|(a, _)| a == agent) else {
            return false;
        };
        ConfigfsDouble::create(root.clone())
            .and_then(|d| d.controllers(nqn))
            .is_ok_and(|c| c.contains(&(port, self.host_nqn.clone())))
    }
}

impl Kernel for SimKernel {
    fn controllers(&self, nqn: &SubsystemNqn) -> Result<Vec<ControllerInfo>, HostError> {
        let ctrls: Vec<Ctrl> = self
            .lock()
            .ctrls
            .iter()
            .filter(|c| c.nqn == nqn.as_str())
            .cloned()
            .collect();
        Ok(ctrls.iter().map(|c| self.info(c)).collect())
    }

    fn connect(&self, opts: &ConnectOptions) -> Result<Controller, HostError> {
        let nqn = opts.nqn.as_str().to_owned();
        let fail = |e| HostError::Connect {
            nqn: nqn.clone(),
            traddr: opts.traddr,
            trsvcid: opts.trsvcid,
            source: errno(e),
        };
        if opts.hostnqn.as_str() != self.host_nqn {
            return Err(fail(libc::EINVAL));
        }
        if self
            .lock()
            .ctrls
            .iter()
            .any(|c| c.nqn == nqn && c.traddr == opts.traddr && c.trsvcid == opts.trsvcid)
        {
            return Err(HostError::AlreadyConnected {
                nqn,
                traddr: opts.traddr,
                trsvcid: opts.trsvcid,
                source: errno(libc::EALREADY),
            });
        }
        let (agent, root) = self
            .targets
            .get(&opts.traddr)
            .cloned()
            .ok_or_else(|| fail(libc::ECONNREFUSED))?;
        let port =
            port_of(&root, opts.traddr, opts.trsvcid).ok_or_else(|| fail(libc::ECONNREFUSED))?;
        let secret = opts.auth.as_ref().map(|a| a.secret.expose().to_owned());
        ConfigfsDouble::create(root.clone())
            .and_then(|d| {
                d.host_connects_with_secret(&nqn, &self.host_nqn, port, secret.as_deref())
            })
            .map_err(|e| fail(e.raw_os_error().unwrap_or(libc::EIO)))?;
        let mut state = self.lock();
        let instance = state.next_instance;
        state.next_instance += 1;
        state.ctrls.push(Ctrl {
            instance,
            nqn,
            agent,
            root,
            traddr: opts.traddr,
            trsvcid: opts.trsvcid,
            port,
            secret,
            size: None,
        });
        drop(state);
        // The connect scans the namespaces the controller has.
        self.scan(instance);
        Ok(Controller {
            name: format!("nvme{instance}"),
            instance,
            cntlid: u16::try_from(instance).unwrap_or(0),
        })
    }

    fn disconnect(
        &self,
        nqn: &SubsystemNqn,
        hostnqn: Option<&HostNqn>,
    ) -> Result<Vec<String>, HostError> {
        if hostnqn.is_some_and(|h| h.as_str() != self.host_nqn) {
            return Ok(Vec::new());
        }
        let gone: Vec<Ctrl> = {
            let mut state = self.lock();
            let (gone, kept) = state.ctrls.drain(..).partition(|c| c.nqn == nqn.as_str());
            state.ctrls = kept;
            gone
        };
        for c in &gone {
            ConfigfsDouble::create(c.root.clone())
                .and_then(|d| d.host_disconnects(&c.nqn, &self.host_nqn))
                .map_err(|source| HostError::DeleteController {
                    controller: format!("nvme{}", c.instance),
                    path: c.root.clone(),
                    source,
                })?;
        }
        Ok(gone.iter().map(|c| format!("nvme{}", c.instance)).collect())
    }

    fn wait_for_namespace(
        &self,
        nqn: &SubsystemNqn,
        hostnqn: Option<&HostNqn>,
        _timeout: Duration,
    ) -> Result<NamespaceDevice, HostError> {
        let mut found = self.namespaces(nqn, hostnqn)?;
        match found.len() {
            1 => Ok(found.remove(0)),
            0 => Err(HostError::NamespaceNotFound {
                nqn: nqn.to_string(),
                host: Some(self.host_nqn.clone()),
                waited: Duration::ZERO,
                seen: "no namespace device of a live controller".into(),
            }),
            _ => Err(HostError::AmbiguousNamespace {
                nqn: nqn.to_string(),
                devices: found.into_iter().map(|d| d.name).collect(),
            }),
        }
    }

    fn namespaces(
        &self,
        nqn: &SubsystemNqn,
        hostnqn: Option<&HostNqn>,
    ) -> Result<Vec<NamespaceDevice>, HostError> {
        if hostnqn.is_some_and(|h| h.as_str() != self.host_nqn) {
            return Ok(Vec::new());
        }
        Ok(self.devices(nqn))
    }

    fn rescan(&self, name: &str) -> Result<(), HostError> {
        let found = name
            .strip_prefix("nvme")
            .and_then(|n| n.parse::<u32>().ok())
            .and_then(|i| self.lock().ctrls.iter().find(|c| c.instance == i).cloned());
        // No such controller: `/sys/class/nvme/<name>/rescan_controller` is not there.
        let c = found.ok_or_else(|| HostError::RescanController {
            controller: name.to_owned(),
            path: self.dev.join(name),
            source: errno(libc::ENOENT),
        })?;
        // A controller that is not live queues no scan: the reconnect scans.
        if self.live(&c) {
            self.scan(c.instance);
        }
        Ok(())
    }

    fn device_size(&self, dev: &Path) -> Result<u64, HostError> {
        let (c, _) = self.backing(dev)?;
        Ok(self.scanned_size(&c))
    }

    fn device_number(&self, dev: &Path) -> std::io::Result<(u32, u32)> {
        self.ctrl_of(dev)
            .map(|c| (NVME_MAJOR, c.instance))
            .ok_or_else(|| errno(libc::ENOENT))
    }

    fn probe(&self, dev: &Path) -> Result<Probe, HostError> {
        Ok(match self.read_fs(dev)? {
            None => Probe::Blank,
            Some(f) => Probe::Found(Signature {
                fs_type: Some(f.fs.as_str().into()),
                pt_type: None,
                usage: Some("filesystem".into()),
            }),
        })
    }

    fn format_if_blank(
        &self,
        dev: &Path,
        fs: FsType,
        _options: &[String],
    ) -> Result<Formatted, HostError> {
        match self.read_fs(dev)? {
            None => {
                let bytes = self.device_size(dev)?;
                self.write_fs(
                    dev,
                    Fs {
                        fs,
                        bytes,
                        dirty: false,
                    },
                )?;
                Ok(Formatted::Formatted)
            }
            Some(f) if f.fs == fs => Ok(Formatted::AlreadyHad(fs)),
            Some(f) => Err(HostError::ExistingSignature {
                device: dev.to_path_buf(),
                found: Signature {
                    fs_type: Some(f.fs.as_str().into()),
                    ..Signature::default()
                },
                requested: fs,
            }),
        }
    }

    fn log_needs_recovery(&self, dev: &Path, fs: FsType) -> Result<bool, HostError> {
        match self.read_fs(dev)? {
            Some(f) if f.fs == fs => Ok(f.dirty),
            _ => Err(HostError::LogState {
                fs,
                device: dev.to_path_buf(),
                detail: "no such filesystem".into(),
            }),
        }
    }

    fn filesystem_bytes(&self, dev: &Path, fs: FsType) -> Result<u64, HostError> {
        match self.read_fs(dev)? {
            Some(f) if f.fs == fs => Ok(f.bytes),
            _ => Err(HostError::Superblock {
                fs,
                device: dev.to_path_buf(),
                detail: "no such filesystem".into(),
            }),
        }
    }

    fn grow_filesystem(&self, dev: &Path, mount_path: &Path, fs: FsType) -> Result<(), HostError> {
        let writable = self.lock().mounts.iter().any(|m| {
            m.mount_point == mount_path && !m.is_readonly() && m.source == dev.display().to_string()
        });
        if !writable {
            return Err(mount_err(dev, mount_path, fs.as_str(), libc::EROFS));
        }
        let mut f = self
            .read_fs(dev)?
            .ok_or_else(|| device_err(dev, libc::EINVAL))?;
        if self.broken() == Broken::GrowIsNoop {
            return Ok(());
        }
        // resize2fs and xfs_growfs grow to the block device's size, as the kernel shows it.
        f.bytes = self.device_size(dev)?;
        self.write_fs(dev, f)
    }

    fn mount_table(&self) -> Result<Vec<MountEntry>, HostError> {
        Ok(self.lock().mounts.clone())
    }

    fn find_mount(&self, path: &Path) -> Result<Option<MountEntry>, HostError> {
        Ok(self
            .lock()
            .mounts
            .iter()
            .rev()
            .find(|m| m.mount_point == path)
            .cloned())
    }

    fn is_mountpoint(&self, path: &Path) -> Result<bool, HostError> {
        Ok(self.find_mount(path)?.is_some())
    }

    fn mount(
        &self,
        dev: &Path,
        target: &Path,
        fs: FsType,
        readonly: bool,
        options: &[String],
    ) -> Result<(), HostError> {
        let m = self.mount_fs(dev, target, fs, readonly, options)?;
        self.add_mount(m);
        Ok(())
    }

    fn bind_mount(&self, src: &Path, target: &Path, readonly: bool) -> Result<(), HostError> {
        let fail = |e| mount_err(src, target, "bind", e);
        if !target.exists() {
            return Err(fail(libc::ENOENT));
        }
        let Some(source) = self.find_mount(src)? else {
            // Block volumes are not simulated: a bind of anything but a mount is refused.
            return Err(fail(libc::EINVAL));
        };
        if self.is_mountpoint(target)? {
            return Err(fail(libc::EBUSY));
        }
        let access = if readonly || source.is_readonly() {
            "ro"
        } else {
            "rw"
        };
        self.add_mount(MountEntry {
            mount_point: target.to_path_buf(),
            mount_options: access.into(),
            ..source
        });
        Ok(())
    }

    fn unmount(&self, target: &Path) -> Result<(), HostError> {
        let Some(gone) = ({
            let mut state = self.lock();
            let at = state.mounts.iter().rposition(|m| m.mount_point == target);
            at.map(|i| state.mounts.remove(i))
        }) else {
            return Ok(());
        };
        let last = !self
            .lock()
            .mounts
            .iter()
            .any(|m| (m.major, m.minor) == (gone.major, gone.minor));
        if last && gone.super_options == "rw" {
            // The clean unmount writes the log closed, if the device can still be written.
            let dev = PathBuf::from(&gone.source);
            if let Ok(Some(mut f)) = self.read_fs(&dev) {
                f.dirty = false;
                let _ = self.write_fs(&dev, f);
            }
        }
        Ok(())
    }

    fn volume_stats(&self, path: &Path) -> Result<VolumeStats, HostError> {
        let m = self.find_mount(path)?.ok_or_else(|| HostError::Statvfs {
            path: path.to_path_buf(),
            source: errno(libc::ENOENT),
        })?;
        let bytes_total = self.read_fs(Path::new(&m.source))?.map_or(0, |f| f.bytes);
        Ok(VolumeStats {
            bytes_total,
            bytes_available: bytes_total,
            bytes_used: 0,
            inodes_total: 0,
            inodes_free: 0,
            inodes_used: 0,
        })
    }

    fn hold_write_exclusive(
        &self,
        dev: &Path,
        _host_id: &uuid::Uuid,
        key: u64,
        preempt: bool,
    ) -> Result<Held, ResvError> {
        let c = self
            .ctrl_of(dev)
            .filter(|c| self.live(c))
            .ok_or_else(|| ResvError::Open {
                device: dev.to_path_buf(),
                source: errno(libc::ENXIO),
            })?;
        let holder = self.reservations.holder(&c.agent, &c.nqn);
        match holder {
            Some(k) if k == key => Ok(Held::AlreadyHeld),
            Some(k) if !preempt => Err(ResvError::NotHeld {
                device: dev.to_path_buf(),
                found: format!("Write Exclusive held by {k:#018x}"),
            }),
            other => {
                self.reservations.set(&c.agent, &c.nqn, key);
                Ok(Held::Acquired { preempted: other })
            }
        }
    }

    fn release_and_unregister(&self, dev: &Path, _host_id: &uuid::Uuid) -> Result<bool, ResvError> {
        let Some(c) = self.ctrl_of(dev).filter(|c| self.live(c)) else {
            return Err(ResvError::Open {
                device: dev.to_path_buf(),
                source: errno(libc::ENXIO),
            });
        };
        Ok(self.reservations.release(&c.agent, &c.nqn, self.key))
    }
}
