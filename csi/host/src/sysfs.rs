//! Finding a subsystem's controllers and namespace block devices in sysfs, verifying a
//! namespace's identity, and deleting exactly one subsystem's controllers.
//!
//! The layout this reads (drivers/nvme/host/core.c, sysfs.c, multipath.c; fabrics controllers):
//! - `/sys/class/nvme/nvmeC` -> `/sys/devices/virtual/nvme-fabrics/ctl/nvmeC`: one directory per
//!   controller with `subsysnqn`, `state` (`new`, `live`, `resetting`, `connecting`, `deleting`,
//!   `deleting (no IO)`, `dead`), `transport`, `address` (`traddr=..,trsvcid=..[,src_addr=..]`),
//!   `hostnqn`, `hostid`, `cntlid`, and the write-only `delete_controller` and
//!   `rescan_controller`.
//! - `/sys/class/nvme-subsystem/nvme-subsysS` -> `/sys/devices/virtual/nvme-subsystem/nvme-subsysS`
//!   with `subsysnqn` and one symlink per controller (`nvmeC`).
//! - Namespaces, multipath on (`nvme_core.multipath=Y`, Debian's default): the visible disk is
//!   `nvmeSnH` (S = subsystem instance, H = namespace head instance), a child of the subsystem
//!   device; each controller also has a hidden per-path disk `nvmeScCnH` (`hidden` = 1, no device
//!   node).
//! - Namespaces, multipath off: the disk is `nvmeCnH` (C = controller instance), a child of the
//!   controller device.
//! - Every disk is linked from `/sys/block/<disk>`, and its `device` link points at its parent
//!   (the subsystem or the controller), which has `subsysnqn` in both cases. Its `uuid`, `nguid`
//!   (both `%pU`: 8-4-4-4-12 lowercase), `nsid`, `dev` (`major:minor`) and `size` (512-byte
//!   sectors) are attributes of the disk. `uuid` is absent when neither a UUID nor an NGUID is
//!   set, and shows the NGUID when only the NGUID is set; `nguid` is absent when it is zero.
//!
//! No udev is assumed: nothing here reads `/dev/disk/by-*`.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use pillar_nvmet::{HostNqn, NamespaceIdentity, Nguid, SubsystemNqn};
use uuid::Uuid;

use crate::{HostError, HostPaths};

/// How often [`wait_for_namespace`] looks again.
pub const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// A controller's `state` attribute.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControllerState {
    New,
    Live,
    Resetting,
    Connecting,
    Deleting,
    DeletingNoIo,
    Dead,
    /// Anything else the kernel prints (`unknown state`, or a state newer than this code).
    Other(String),
}

impl ControllerState {
    /// Parses the text of the `state` attribute (without its newline).
    pub fn parse(s: &str) -> Self {
        match s {
            "new" => Self::New,
            "live" => Self::Live,
            "resetting" => Self::Resetting,
            "connecting" => Self::Connecting,
            "deleting" => Self::Deleting,
            "deleting (no IO)" => Self::DeletingNoIo,
            "dead" => Self::Dead,
            other => Self::Other(other.to_owned()),
        }
    }

    /// The kernel's text for this state.
    pub fn as_str(&self) -> &str {
        match self {
            Self::New => "new",
            Self::Live => "live",
            Self::Resetting => "resetting",
            Self::Connecting => "connecting",
            Self::Deleting => "deleting",
            Self::DeletingNoIo => "deleting (no IO)",
            Self::Dead => "dead",
            Self::Other(s) => s,
        }
    }
}

/// One NVMe controller as sysfs shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerInfo {
    /// `nvmeC`.
    pub name: String,
    /// C.
    pub instance: u32,
    pub subsysnqn: String,
    pub state: ControllerState,
    /// `tcp`, `rdma`, `fc`, `loop`, `pcie`; absent on very old kernels.
    pub transport: Option<String>,
    /// Absent for controllers that are not fabrics controllers.
    pub hostnqn: Option<String>,
    pub hostid: Option<String>,
    /// The raw `address` attribute, e.g. `traddr=192.0.2.10,trsvcid=4420,src_addr=192.0.2.1`.
    pub address: Option<String>,
}

impl ControllerInfo {
    /// One `key=value` field of [`Self::address`] (`traddr`, `trsvcid`, `src_addr`, ...).
    pub fn address_field(&self, key: &str) -> Option<&str> {
        self.address
            .as_deref()?
            .split(',')
            .filter_map(|f| f.split_once('='))
            .find_map(|(k, v)| (k == key).then_some(v))
    }
}

/// Which device a namespace disk hangs under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NamespaceParent {
    /// Multipath on: the disk is the subsystem's (`nvme-subsysS`).
    Subsystem(String),
    /// Multipath off: the disk is one controller's (`nvmeC`).
    Controller(String),
}

/// A visible namespace block device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceDevice {
    /// `nvme0n1`.
    pub name: String,
    /// `<dev>/nvme0n1`.
    pub dev_path: PathBuf,
    /// The namespace UUID; `None` when the kernel has none (see the module docs on the NGUID
    /// fallback: a `uuid` attribute equal to `nguid` is the kernel's fallback, not a UUID).
    pub uuid: Option<Uuid>,
    /// The namespace NGUID; `None` when the kernel shows none.
    pub nguid: Option<Nguid>,
    pub size_bytes: u64,
    pub nsid: Option<u32>,
    /// `(major, minor)` from the `dev` attribute.
    pub devnum: Option<(u32, u32)>,
    pub parent: NamespaceParent,
}

/// Whether `s` is a controller name, `nvme<digits>`.
pub fn is_controller_name(s: &str) -> bool {
    s.strip_prefix("nvme").is_some_and(is_digits)
}

/// Whether `s` is a visible namespace disk name, `nvme<digits>n<digits>` (not a hidden per-path
/// disk `nvmeXcYnZ`, not a partition `nvmeXnYpZ`).
pub fn is_namespace_name(s: &str) -> bool {
    s.strip_prefix("nvme")
        .and_then(|rest| rest.split_once('n'))
        .is_some_and(|(a, b)| is_digits(a) && is_digits(b))
}

fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit())
}

/// Reads a sysfs attribute without its trailing newline; `None` if it does not exist (the object
/// went away, or the kernel hides the attribute).
fn read_attr(path: &Path) -> Result<Option<String>, HostError> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s.trim_end_matches('\n').to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(HostError::ReadSysfs {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Directory entries of `dir` whose names satisfy `keep`, sorted; an absent directory is empty
/// (the nvme modules are not loaded, or nothing was ever connected).
fn entries(dir: &Path, keep: fn(&str) -> bool) -> Result<Vec<String>, HostError> {
    let iter = match fs::read_dir(dir) {
        Ok(iter) => iter,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(HostError::ReadSysfs {
                path: dir.to_path_buf(),
                source,
            });
        }
    };
    let mut names = Vec::new();
    for entry in iter {
        let entry = entry.map_err(|source| HostError::ReadSysfs {
            path: dir.to_path_buf(),
            source,
        })?;
        if let Some(name) = entry.file_name().to_str()
            && keep(name)
        {
            names.push(name.to_owned());
        }
    }
    names.sort_by_key(|n| natural_key(n));
    Ok(names)
}

/// Sorts `nvme10` after `nvme9`.
fn natural_key(s: &str) -> (usize, String) {
    (s.len(), s.to_owned())
}

fn class_nvme(paths: &HostPaths) -> PathBuf {
    paths.sys.join("class").join("nvme")
}

/// Reads one controller; `None` if it vanished while being read.
pub fn read_controller(paths: &HostPaths, name: &str) -> Result<Option<ControllerInfo>, HostError> {
    if !is_controller_name(name) {
        return Err(HostError::InvalidArgument {
            what: "controller name",
            value: name.to_owned(),
            reason: "expected nvme<number>",
        });
    }
    let dir = class_nvme(paths).join(name);
    let Some(subsysnqn) = read_attr(&dir.join("subsysnqn"))? else {
        return Ok(None);
    };
    let Some(state) = read_attr(&dir.join("state"))? else {
        return Ok(None);
    };
    let instance = name["nvme".len()..]
        .parse()
        .map_err(|_| HostError::ParseSysfs {
            path: dir.clone(),
            value: name.to_owned(),
            reason: "controller instance out of range".into(),
        })?;
    Ok(Some(ControllerInfo {
        name: name.to_owned(),
        instance,
        subsysnqn: subsysnqn.trim_end().to_owned(),
        state: ControllerState::parse(&state),
        transport: read_attr(&dir.join("transport"))?,
        hostnqn: read_attr(&dir.join("hostnqn"))?,
        hostid: read_attr(&dir.join("hostid"))?,
        address: read_attr(&dir.join("address"))?,
    }))
}

/// Every controller of every subsystem.
pub fn all_controllers(paths: &HostPaths) -> Result<Vec<ControllerInfo>, HostError> {
    let mut out = Vec::new();
    for name in entries(&class_nvme(paths), is_controller_name)? {
        if let Some(ctrl) = read_controller(paths, &name)? {
            out.push(ctrl);
        }
    }
    Ok(out)
}

/// The controllers connected to subsystem `nqn`, in any state, from any host NQN.
pub fn controllers_for(
    paths: &HostPaths,
    nqn: &SubsystemNqn,
) -> Result<Vec<ControllerInfo>, HostError> {
    Ok(all_controllers(paths)?
        .into_iter()
        .filter(|c| c.subsysnqn == nqn.as_str())
        .collect())
}

/// Whether controller `name` exists and its state is `live`.
pub fn controller_live(paths: &HostPaths, name: &str) -> Result<bool, HostError> {
    Ok(read_controller(paths, name)?.is_some_and(|c| c.state == ControllerState::Live))
}

/// The visible namespace disks of subsystem `nqn`.
pub fn namespaces_for(
    paths: &HostPaths,
    nqn: &SubsystemNqn,
) -> Result<Vec<NamespaceDevice>, HostError> {
    namespaces_for_host(paths, nqn, None)
}

/// The visible namespace disks of subsystem `nqn` reachable through a controller of host
/// `hostnqn` (all of them when `hostnqn` is `None`).
pub fn namespaces_for_host(
    paths: &HostPaths,
    nqn: &SubsystemNqn,
    hostnqn: Option<&HostNqn>,
) -> Result<Vec<NamespaceDevice>, HostError> {
    let block = paths.sys.join("block");
    let mut out = Vec::new();
    for name in entries(&block, is_namespace_name)? {
        let disk = block.join(&name);
        if read_attr(&disk.join("hidden"))?.as_deref() == Some("1") {
            continue;
        }
        let parent_dir = match fs::canonicalize(disk.join("device")) {
            Ok(p) => p,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                tracing::debug!(disk = %name, "namespace disk without a device link; skipped");
                continue;
            }
            Err(source) => {
                return Err(HostError::ReadSysfs {
                    path: disk.join("device"),
                    source,
                });
            }
        };
        let Some(parent_name) = parent_dir.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let parent = if parent_name.starts_with("nvme-subsys") {
            NamespaceParent::Subsystem(parent_name.to_owned())
        } else if is_controller_name(parent_name) {
            NamespaceParent::Controller(parent_name.to_owned())
        } else {
            continue;
        };
        let Some(subsysnqn) = read_attr(&parent_dir.join("subsysnqn"))? else {
            continue;
        };
        if subsysnqn.trim_end() != nqn.as_str() {
            continue;
        }
        if let Some(host) = hostnqn
            && !reachable_from_host(&parent_dir, &parent, host)?
        {
            continue;
        }
        if let Some(dev) = read_namespace(paths, &disk, &name, parent)? {
            out.push(dev);
        }
    }
    Ok(out)
}

/// Whether some controller behind `parent` was connected with host NQN `host`.
fn reachable_from_host(
    parent_dir: &Path,
    parent: &NamespaceParent,
    host: &HostNqn,
) -> Result<bool, HostError> {
    let ctrl_dirs: Vec<PathBuf> = match parent {
        NamespaceParent::Controller(_) => vec![parent_dir.to_path_buf()],
        NamespaceParent::Subsystem(_) => entries(parent_dir, is_controller_name)?
            .into_iter()
            .map(|c| parent_dir.join(c))
            .collect(),
    };
    for dir in ctrl_dirs {
        if read_attr(&dir.join("hostnqn"))?.as_deref() == Some(host.as_str()) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Reads a disk's identity and size; `None` if it vanished while being read.
fn read_namespace(
    paths: &HostPaths,
    disk: &Path,
    name: &str,
    parent: NamespaceParent,
) -> Result<Option<NamespaceDevice>, HostError> {
    let parse_err = |attr: &str, value: &str, reason: String| HostError::ParseSysfs {
        path: disk.join(attr),
        value: value.to_owned(),
        reason,
    };
    let Some(size) = read_attr(&disk.join("size"))? else {
        return Ok(None);
    };
    let sectors: u64 = size
        .parse()
        .map_err(|e| parse_err("size", &size, format!("{e}")))?;
    let size_bytes = sectors
        .checked_mul(512)
        .ok_or_else(|| parse_err("size", &size, "size overflows u64 bytes".into()))?;
    let nguid_text = read_attr(&disk.join("nguid"))?;
    let nguid = match &nguid_text {
        Some(t) => Some(Nguid::parse(t).map_err(|e| parse_err("nguid", t, e.to_string()))?),
        None => None,
    }
    .filter(|n| !n.is_zero());
    let uuid_text = read_attr(&disk.join("uuid"))?;
    let uuid = match &uuid_text {
        // The kernel prints the NGUID here when there is no UUID (uuid_show): that is no UUID.
        Some(t) if Some(t) == nguid_text.as_ref() => None,
        Some(t) => Some(Uuid::parse_str(t).map_err(|e| parse_err("uuid", t, e.to_string()))?),
        None => None,
    }
    .filter(|u| !u.is_nil());
    let nsid = match read_attr(&disk.join("nsid"))? {
        Some(t) => Some(
            t.parse::<u32>()
                .map_err(|e| parse_err("nsid", &t, e.to_string()))?,
        ),
        None => None,
    };
    let devnum = match read_attr(&disk.join("dev"))? {
        Some(t) => Some(
            parse_devnum(&t).ok_or_else(|| parse_err("dev", &t, "expected major:minor".into()))?,
        ),
        None => None,
    };
    Ok(Some(NamespaceDevice {
        name: name.to_owned(),
        dev_path: paths.dev.join(name),
        uuid,
        nguid,
        size_bytes,
        nsid,
        devnum,
        parent,
    }))
}

fn parse_devnum(s: &str) -> Option<(u32, u32)> {
    let (major, minor) = s.split_once(':')?;
    if !is_digits(major) || !is_digits(minor) {
        return None;
    }
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// Rule N1: `dev` is the namespace `expected` names. Both the UUID and the NGUID must be present
/// and equal; anything missing is a mismatch.
pub fn verify_identity(
    dev: &NamespaceDevice,
    expected: &NamespaceIdentity,
) -> Result<(), HostError> {
    if dev.uuid == Some(expected.uuid) && dev.nguid == Some(expected.nguid) {
        return Ok(());
    }
    tracing::warn!(
        device = %dev.name, found_uuid = ?dev.uuid, found_nguid = ?dev.nguid,
        expected_uuid = %expected.uuid, expected_nguid = %expected.nguid,
        "namespace identity mismatch"
    );
    Err(HostError::IdentityMismatch {
        device: dev.name.clone(),
        expected_uuid: expected.uuid,
        found_uuid: dev.uuid,
        expected_nguid: expected.nguid,
        found_nguid: dev.nguid,
    })
}

/// Whether the device node of `dev` exists and is the disk sysfs describes.
fn device_node_ready(dev: &NamespaceDevice) -> Result<bool, HostError> {
    let meta = match fs::metadata(&dev.dev_path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(source) => {
            return Err(HostError::Device {
                path: dev.dev_path.clone(),
                source,
            });
        }
    };
    if !meta.file_type().is_block_device() {
        return Err(HostError::NotBlockDevice {
            path: dev.dev_path.clone(),
        });
    }
    if let Some((major, minor)) = dev.devnum {
        let rdev = meta.rdev();
        let found = (libc::major(rdev), libc::minor(rdev));
        if found != (major, minor) {
            return Err(HostError::StaleDeviceNode {
                path: dev.dev_path.clone(),
                device: dev.name.clone(),
                expected: format!("{major}:{minor}"),
                found: format!("{}:{}", found.0, found.1),
            });
        }
    }
    Ok(true)
}

/// Polls until exactly one namespace disk of subsystem `nqn` (reachable from `hostnqn` when
/// given) is in sysfs and its device node exists, for at most `timeout`.
///
/// Errors: [`HostError::NamespaceNotFound`] (naming the controllers seen and their states) when
/// the time runs out, [`HostError::AmbiguousNamespace`] when several disks match.
/// The identity is not checked here: call [`verify_identity`] on the result.
pub fn wait_for_namespace(
    paths: &HostPaths,
    nqn: &SubsystemNqn,
    hostnqn: Option<&HostNqn>,
    timeout: Duration,
) -> Result<NamespaceDevice, HostError> {
    let start = Instant::now();
    loop {
        let mut found = namespaces_for_host(paths, nqn, hostnqn)?;
        if found.len() > 1 {
            return Err(HostError::AmbiguousNamespace {
                nqn: nqn.to_string(),
                devices: found.into_iter().map(|d| d.name).collect(),
            });
        }
        if let Some(dev) = found.pop()
            && device_node_ready(&dev)?
        {
            tracing::debug!(nqn = %nqn, device = %dev.name, waited = ?start.elapsed(), "namespace found");
            return Ok(dev);
        }
        let elapsed = start.elapsed();
        if elapsed >= timeout {
            return Err(HostError::NamespaceNotFound {
                nqn: nqn.to_string(),
                host: hostnqn.map(ToString::to_string),
                waited: elapsed,
                seen: describe_controllers(paths, nqn),
            });
        }
        thread::sleep(POLL_INTERVAL.min(timeout - elapsed));
    }
}

fn describe_controllers(paths: &HostPaths, nqn: &SubsystemNqn) -> String {
    match controllers_for(paths, nqn) {
        Ok(ctrls) if ctrls.is_empty() => "none".into(),
        Ok(ctrls) => ctrls
            .iter()
            .map(|c| {
                format!(
                    "{} ({}, host {})",
                    c.name,
                    c.state.as_str(),
                    c.hostnqn.as_deref().unwrap_or("?")
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        Err(e) => format!("unknown ({e})"),
    }
}

/// Writes `1` to an existing write-only controller attribute. Never creates a file.
fn poke(path: &Path) -> io::Result<()> {
    let mut f = OpenOptions::new().write(true).open(path)?;
    f.write_all(b"1")
}

/// Rule N4: deletes every controller of subsystem `nqn` (only those of host `hostnqn` when
/// given) and no other, by writing `1` to its `delete_controller`. Returns the names of the
/// controllers deleted. A controller that vanishes meanwhile counts as deleted by someone else
/// and is left out; an empty result means there was nothing to do. All matching controllers
/// are tried before the first failure is returned.
pub fn disconnect_subsystem(
    paths: &HostPaths,
    nqn: &SubsystemNqn,
    hostnqn: Option<&HostNqn>,
) -> Result<Vec<String>, HostError> {
    let targets: Vec<ControllerInfo> = controllers_for(paths, nqn)?
        .into_iter()
        .filter(|c| hostnqn.is_none_or(|h| c.hostnqn.as_deref() == Some(h.as_str())))
        .collect();
    let mut deleted = Vec::new();
    let mut first_err = None;
    for ctrl in targets {
        let path = class_nvme(paths).join(&ctrl.name).join("delete_controller");
        match poke(&path) {
            Ok(()) => {
                tracing::info!(controller = %ctrl.name, nqn = %nqn, "controller deleted");
                deleted.push(ctrl.name);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                tracing::debug!(controller = %ctrl.name, "controller vanished before deletion");
            }
            Err(source) => {
                tracing::warn!(controller = %ctrl.name, error = %source, "deleting controller failed");
                first_err.get_or_insert(HostError::DeleteController {
                    controller: ctrl.name,
                    path,
                    source,
                });
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(deleted),
    }
}

/// Asks controller `name` to rescan its namespaces (after the target grew one, before growing
/// the filesystem), by writing `1` to its `rescan_controller`.
pub fn rescan_controller(paths: &HostPaths, name: &str) -> Result<(), HostError> {
    if !is_controller_name(name) {
        return Err(HostError::InvalidArgument {
            what: "controller name",
            value: name.to_owned(),
            reason: "expected nvme<number>",
        });
    }
    let path = class_nvme(paths).join(name).join("rescan_controller");
    poke(&path).map_err(|source| HostError::RescanController {
        controller: name.to_owned(),
        path,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{FakeController, FakeNamespace, FakeSysfs};
    use pillar_nvmet::{NamespaceId, VolumeId};

    const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:0a0a0a0a-0000-4000-8000-00000000000a";
    const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:0b0b0b0b-0000-4000-8000-00000000000b";

    fn nqn(v: &str) -> SubsystemNqn {
        VolumeId::parse(v).unwrap().subsystem_nqn()
    }

    fn identity(v: &str) -> NamespaceIdentity {
        NamespaceIdentity::derive(&nqn(v), NamespaceId::VOLUME)
    }

    fn ctrl(instance: u32, subsys: u32, host: &str) -> FakeController {
        FakeController {
            instance,
            subsys_instance: subsys,
            hostnqn: host.into(),
            traddr: "192.0.2.10".into(),
            trsvcid: 4420,
            state: "live".into(),
        }
    }

    fn ns(
        subsys: u32,
        ctrls: &[u32],
        multipath: bool,
        id: Option<NamespaceIdentity>,
    ) -> FakeNamespace {
        FakeNamespace {
            subsys_instance: subsys,
            head_instance: 1,
            nsid: 1,
            multipath,
            ctrl_instances: ctrls.to_vec(),
            uuid: id.map(|i| i.uuid),
            nguid: id.map(|i| i.nguid),
            size_sectors: 2 * 1024 * 1024,
        }
    }

    /// Two pillar volumes and one foreign subsystem, multipath on.
    fn two_volumes(root: &Path) -> FakeSysfs {
        let mut f = FakeSysfs::new(root).unwrap();
        f.add_subsystem(0, nqn("vol-a").as_str()).unwrap();
        f.add_subsystem(1, nqn("vol-b").as_str()).unwrap();
        f.add_subsystem(2, "nqn.2014-08.com.example:other").unwrap();
        f.add_controller(&ctrl(0, 0, HOST_A)).unwrap();
        f.add_controller(&ctrl(1, 1, HOST_A)).unwrap();
        f.add_controller(&ctrl(2, 2, HOST_A)).unwrap();
        f.add_namespace(&ns(0, &[0], true, Some(identity("vol-a"))))
            .unwrap();
        f.add_namespace(&ns(1, &[1], true, Some(identity("vol-b"))))
            .unwrap();
        f.add_namespace(&ns(2, &[2], true, Some(identity("vol-x"))))
            .unwrap();
        f
    }

    #[test]
    fn names() {
        for ok in ["nvme0", "nvme12"] {
            assert!(is_controller_name(ok), "{ok}");
        }
        for bad in [
            "nvme",
            "nvme0n1",
            "nvme-subsys0",
            "nvme-fabrics",
            "nvmex",
            "ng0n1",
        ] {
            assert!(!is_controller_name(bad), "{bad}");
        }
        for ok in ["nvme0n1", "nvme10n12"] {
            assert!(is_namespace_name(ok), "{ok}");
        }
        for bad in ["nvme0c0n1", "nvme0n1p1", "nvme0n", "nvme0", "nvmen1", "sda"] {
            assert!(!is_namespace_name(bad), "{bad}");
        }
    }

    #[test]
    fn controllers_of_one_subsystem_only() {
        let dir = tempfile::tempdir().unwrap();
        let f = two_volumes(dir.path());
        let ctrls = controllers_for(f.paths(), &nqn("vol-b")).unwrap();
        assert_eq!(ctrls.len(), 1);
        let c = &ctrls[0];
        assert_eq!(c.name, "nvme1");
        assert_eq!(c.instance, 1);
        assert_eq!(c.state, ControllerState::Live);
        assert_eq!(c.hostnqn.as_deref(), Some(HOST_A));
        assert_eq!(c.transport.as_deref(), Some("tcp"));
        assert_eq!(c.address_field("traddr"), Some("192.0.2.10"));
        assert_eq!(c.address_field("trsvcid"), Some("4420"));
        assert_eq!(c.address_field("nope"), None);
        assert!(controller_live(f.paths(), "nvme1").unwrap());
        f.set_state(1, "connecting").unwrap();
        assert!(!controller_live(f.paths(), "nvme1").unwrap());
        assert!(!controller_live(f.paths(), "nvme9").unwrap());
        assert!(
            controllers_for(f.paths(), &nqn("vol-none"))
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn no_nvme_modules_means_nothing_found() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::under(dir.path());
        assert!(controllers_for(&paths, &nqn("vol-a")).unwrap().is_empty());
        assert!(namespaces_for(&paths, &nqn("vol-a")).unwrap().is_empty());
        assert!(
            disconnect_subsystem(&paths, &nqn("vol-a"), None)
                .unwrap()
                .is_empty()
        );
    }

    // proves N1 (finding by subsystem NQN): multipath on, the disk hangs under the subsystem and
    // the hidden per-path disk is not offered.
    #[test]
    fn multipath_namespace_is_found_by_nqn() {
        let dir = tempfile::tempdir().unwrap();
        let f = two_volumes(dir.path());
        assert!(f.paths().sys.join("block/nvme0c0n1").exists());
        let found = namespaces_for(f.paths(), &nqn("vol-b")).unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        let d = &found[0];
        assert_eq!(d.name, "nvme1n1");
        assert_eq!(d.dev_path, f.paths().dev.join("nvme1n1"));
        assert_eq!(d.parent, NamespaceParent::Subsystem("nvme-subsys1".into()));
        assert_eq!(d.uuid, Some(identity("vol-b").uuid));
        assert_eq!(d.nguid, Some(identity("vol-b").nguid));
        assert_eq!(d.size_bytes, 1024 * 1024 * 1024);
        assert_eq!(d.nsid, Some(1));
        verify_identity(d, &identity("vol-b")).unwrap();
    }

    // proves N1 with multipath off: the disk is named after the controller and hangs under it.
    #[test]
    fn non_multipath_namespace_is_found_under_its_controller() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = FakeSysfs::new(dir.path()).unwrap();
        f.add_subsystem(0, nqn("vol-a").as_str()).unwrap();
        f.add_subsystem(1, nqn("vol-b").as_str()).unwrap();
        f.add_controller(&ctrl(0, 0, HOST_A)).unwrap();
        f.add_controller(&ctrl(3, 1, HOST_A)).unwrap();
        f.add_controller(&ctrl(4, 1, HOST_B)).unwrap();
        f.add_namespace(&ns(0, &[0], false, Some(identity("vol-a"))))
            .unwrap();
        f.add_namespace(&ns(1, &[3, 4], false, Some(identity("vol-b"))))
            .unwrap();

        let all = namespaces_for(f.paths(), &nqn("vol-b")).unwrap();
        let names: Vec<_> = all.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["nvme3n1", "nvme4n1"]);
        let host_b = HostNqn::parse(HOST_B).unwrap();
        let mine = namespaces_for_host(f.paths(), &nqn("vol-b"), Some(&host_b)).unwrap();
        assert_eq!(mine.len(), 1);
        assert_eq!(mine[0].name, "nvme4n1");
        assert_eq!(mine[0].parent, NamespaceParent::Controller("nvme4".into()));
        verify_identity(&mine[0], &identity("vol-b")).unwrap();
        // Without a host filter two disks match: waiting refuses to guess.
        let err = wait_for_namespace(f.paths(), &nqn("vol-b"), None, Duration::ZERO).unwrap_err();
        assert!(
            matches!(err, HostError::AmbiguousNamespace { .. }),
            "{err:?}"
        );
        let dev =
            wait_for_namespace(f.paths(), &nqn("vol-b"), Some(&host_b), Duration::ZERO).unwrap();
        assert_eq!(dev.name, "nvme4n1");
    }

    #[test]
    fn host_filter_applies_to_multipath_disks() {
        let dir = tempfile::tempdir().unwrap();
        let f = two_volumes(dir.path());
        let host_a = HostNqn::parse(HOST_A).unwrap();
        let host_b = HostNqn::parse(HOST_B).unwrap();
        assert_eq!(
            namespaces_for_host(f.paths(), &nqn("vol-a"), Some(&host_a))
                .unwrap()
                .len(),
            1
        );
        assert!(
            namespaces_for_host(f.paths(), &nqn("vol-a"), Some(&host_b))
                .unwrap()
                .is_empty()
        );
    }

    // proves N1: another volume's device, a device without a UUID or NGUID, and the kernel's
    // NGUID-in-the-uuid-file fallback are all refused.
    #[test]
    fn identity_mismatches_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = FakeSysfs::new(dir.path()).unwrap();
        let id = identity("vol-a");
        let cases: [(Option<Uuid>, Option<Nguid>); 4] = [
            (Some(identity("vol-b").uuid), Some(id.nguid)),
            (Some(id.uuid), Some(identity("vol-b").nguid)),
            (None, Some(id.nguid)),
            (None, None),
        ];
        for (i, (uuid, nguid)) in cases.into_iter().enumerate() {
            let i = u32::try_from(i).unwrap();
            let v = format!("vol-{i}");
            f.add_subsystem(i, nqn(&v).as_str()).unwrap();
            f.add_controller(&ctrl(i, i, HOST_A)).unwrap();
            let mut n = ns(i, &[i], true, None);
            n.uuid = uuid;
            n.nguid = nguid;
            f.add_namespace(&n).unwrap();
            let found = namespaces_for(f.paths(), &nqn(&v)).unwrap();
            assert_eq!(found.len(), 1);
            let err = verify_identity(&found[0], &id).unwrap_err();
            assert!(matches!(err, HostError::IdentityMismatch { .. }), "{err:?}");
            assert_eq!(err.class(), crate::ErrorClass::FailedPrecondition);
        }
        // The fallback case: the kernel shows the NGUID in `uuid`; that is not a UUID.
        let fallback = namespaces_for(f.paths(), &nqn("vol-2")).unwrap();
        let uuid_file = fs::read_to_string(f.paths().sys.join("block/nvme2n1/uuid")).unwrap();
        assert_eq!(uuid_file, format!("{}\n", id.nguid));
        assert_eq!(fallback[0].uuid, None);
        let none = namespaces_for(f.paths(), &nqn("vol-3")).unwrap();
        assert_eq!((none[0].uuid, none[0].nguid), (None, None));
    }

    #[test]
    fn malformed_identity_is_an_error_not_a_match() {
        let dir = tempfile::tempdir().unwrap();
        let f = two_volumes(dir.path());
        fs::write(f.paths().sys.join("block/nvme0n1/nguid"), "zz\n").unwrap();
        let err = namespaces_for(f.paths(), &nqn("vol-a")).unwrap_err();
        assert!(matches!(err, HostError::ParseSysfs { .. }), "{err:?}");
    }

    #[test]
    fn wait_times_out_naming_what_it_saw() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = FakeSysfs::new(dir.path()).unwrap();
        f.add_subsystem(0, nqn("vol-a").as_str()).unwrap();
        let mut c = ctrl(0, 0, HOST_A);
        c.state = "connecting".into();
        f.add_controller(&c).unwrap();
        let start = Instant::now();
        let err = wait_for_namespace(f.paths(), &nqn("vol-a"), None, Duration::from_millis(300))
            .unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(300));
        match &err {
            HostError::NamespaceNotFound { seen, .. } => {
                assert!(seen.contains("nvme0 (connecting"), "{seen}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(err.class(), crate::ErrorClass::NotFound);
    }

    #[test]
    fn wait_sees_a_namespace_that_appears_later() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = FakeSysfs::new(dir.path()).unwrap();
        f.add_subsystem(0, nqn("vol-a").as_str()).unwrap();
        f.add_controller(&ctrl(0, 0, HOST_A)).unwrap();
        let paths = f.paths().clone();
        let adder = thread::spawn(move || {
            thread::sleep(Duration::from_millis(250));
            f.add_namespace(&ns(0, &[0], true, Some(identity("vol-a"))))
                .unwrap();
        });
        let start = Instant::now();
        let dev = wait_for_namespace(&paths, &nqn("vol-a"), None, Duration::from_secs(10)).unwrap();
        adder.join().unwrap();
        assert!(start.elapsed() >= Duration::from_millis(250));
        assert_eq!(dev.name, "nvme0n1");
        verify_identity(&dev, &identity("vol-a")).unwrap();
    }

    #[test]
    fn wait_needs_the_device_node() {
        let dir = tempfile::tempdir().unwrap();
        let f = two_volumes(dir.path());
        fs::remove_file(f.paths().dev.join("nvme0n1")).unwrap();
        let err = wait_for_namespace(f.paths(), &nqn("vol-a"), None, Duration::from_millis(150))
            .unwrap_err();
        assert!(
            matches!(err, HostError::NamespaceNotFound { .. }),
            "{err:?}"
        );
        // A node that is not a block device, or another block device, is refused outright.
        fs::write(f.paths().dev.join("nvme0n1"), "").unwrap();
        let err = wait_for_namespace(f.paths(), &nqn("vol-a"), None, Duration::ZERO).unwrap_err();
        assert!(matches!(err, HostError::NotBlockDevice { .. }), "{err:?}");
        fs::remove_file(f.paths().dev.join("nvme0n1")).unwrap();
        crate::sys::mknod_block(&f.paths().dev.join("nvme0n1"), 1, 3).unwrap();
        let err = wait_for_namespace(f.paths(), &nqn("vol-a"), None, Duration::ZERO).unwrap_err();
        assert!(matches!(err, HostError::StaleDeviceNode { .. }), "{err:?}");
    }

    // proves N4: only the named subsystem's controllers are deleted, and with a host NQN only
    // that host's.
    #[test]
    fn disconnect_touches_only_that_subsystem() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = two_volumes(dir.path());
        f.add_controller(&ctrl(3, 1, HOST_B)).unwrap();
        let host_b = HostNqn::parse(HOST_B).unwrap();

        let deleted = disconnect_subsystem(f.paths(), &nqn("vol-b"), Some(&host_b)).unwrap();
        assert_eq!(deleted, ["nvme3"]);
        assert_eq!(f.deletes_requested(), [3]);

        let deleted = disconnect_subsystem(f.paths(), &nqn("vol-b"), None).unwrap();
        assert_eq!(deleted, ["nvme1", "nvme3"]);
        assert_eq!(f.deletes_requested(), [1, 3]);
        // vol-a (nvme0) and the foreign subsystem (nvme2) were never touched.
        assert!(
            disconnect_subsystem(f.paths(), &nqn("vol-none"), None)
                .unwrap()
                .is_empty()
        );
        assert_eq!(f.deletes_requested(), [1, 3]);
    }

    #[test]
    fn disconnect_skips_a_controller_that_vanished() {
        let dir = tempfile::tempdir().unwrap();
        let f = two_volumes(dir.path());
        let attr = f.paths().sys.join("class/nvme/nvme0/delete_controller");
        fs::remove_file(&attr).unwrap();
        assert!(
            disconnect_subsystem(f.paths(), &nqn("vol-a"), None)
                .unwrap()
                .is_empty()
        );
        // And it never creates the attribute.
        assert!(!attr.exists());
    }

    #[test]
    fn disconnect_failure_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let f = two_volumes(dir.path());
        let attr = f.paths().sys.join("class/nvme/nvme0/delete_controller");
        fs::remove_file(&attr).unwrap();
        fs::create_dir(&attr).unwrap(); // opening a directory for writing fails with EISDIR
        let err = disconnect_subsystem(f.paths(), &nqn("vol-a"), None).unwrap_err();
        assert!(matches!(err, HostError::DeleteController { .. }), "{err:?}");
    }

    #[test]
    fn rescan_writes_the_attribute() {
        let dir = tempfile::tempdir().unwrap();
        let f = two_volumes(dir.path());
        rescan_controller(f.paths(), "nvme1").unwrap();
        let attr = f.paths().sys.join("class/nvme/nvme1/rescan_controller");
        assert_eq!(fs::read_to_string(attr).unwrap(), "1");
        assert!(rescan_controller(f.paths(), "../x").is_err());
        assert!(matches!(
            rescan_controller(f.paths(), "nvme7"),
            Err(HostError::RescanController { .. })
        ));
    }
}
