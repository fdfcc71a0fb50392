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

/// Whether `s` is a controller name, `nvme<number>`.
pub fn is_controller_name(s: &str) -> bool {
    s.strip_prefix("nvme").is_some_and(is_number)
}

/// Whether `s` is a visible namespace disk name, `nvme<number>n<number>` (not a hidden per-path
/// disk `nvmeXcYnZ`, not a partition `nvmeXnYpZ`).
pub fn is_namespace_name(s: &str) -> bool {
    s.strip_prefix("nvme")
        .and_then(|rest| rest.split_once('n'))
        .is_some_and(|(a, b)| is_number(a) && is_number(b))
}

/// A number as the kernel prints one into a device name (`%d`): digits, no leading zero but
/// for `0` itself. `nvme00` is not `nvme0`'s other spelling: a name the kernel never makes is
/// no controller, or two entries would read as one instance (the fuzzer's `host_readers`
/// found `nvme00` read as instance 0).
fn is_number(s: &str) -> bool {
    is_digits(s) && (s == "0" || !s.starts_with('0'))
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

pub(crate) fn parse_devnum(s: &str) -> Option<(u32, u32)> {
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
mod tests;
