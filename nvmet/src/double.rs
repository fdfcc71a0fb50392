//! A configfs test double: a plain directory tree laid out like `/sys/kernel/config/nvmet`, and an
//! executor that refuses, with the kernel's errno, everything the kernel refuses.
//!
//! It stands in for the kernel only where configfs cannot run (unit tests, the single-machine
//! mode on a kernel without nvmet); it is always named as a double, and the real kernel checks
//! the same plans in the kernel lane. Invariants it keeps, each taken from the kernel source
//! (drivers/nvme/target/configfs.c, fs/configfs) and listed in `docs/rules.md` (K2-K9):
//! - `device_path`, `device_uuid`, `device_nguid` on an enabled namespace: EBUSY;
//!   `resv_enable`, `buffered_io` on an enabled namespace: EINVAL;
//! - a port's `addr_*` while any subsystem is linked to it: EACCES;
//! - linking into `allowed_hosts` while `attr_allow_any_host=1`, or setting it to 1 while hosts
//!   are linked: EINVAL;
//! - `attr_serial` / `attr_model` after a host identified the subsystem: EINVAL (until the
//!   subsystem is removed: a subsystem made again under its name takes them);
//! - `enable` without `device_path`: EINVAL, with a missing device: ENOENT;
//! - `revalidate_size` on a disabled namespace: EINVAL;
//! - rmdir of a link target: EBUSY; of an item with child items or links: ENOTEMPTY; of a
//!   default group: EPERM; mkdir where configfs has no group: EPERM;
//! - links are stored relative (`readlink` gives `../../../...`), as configfs returns them;
//! - new namespaces get a random UUID and a zero NGUID, new subsystems a random serial, like the
//!   kernel, so a plan that forgets identity is caught;
//! - host entries of a kernel with authentication (the default; [`ConfigfsDouble::without_auth`]
//!   models one without, like Debian's 6.1) have `dhchap_key`, `dhchap_ctrl_key`,
//!   `dhchap_hash` (`hmac(sha256)`) and `dhchap_dhgroup` (`null`); a key must start
//!   `DHHC-1:<0-3>:` or be empty (clears it), a hash or group one the kernel names: EINVAL
//!   otherwise (the key's body is checked only when a host authenticates, as on 7.2). Without authentication the attributes do not exist: a write is ENOENT. A host
//!   whose entry has a key connects only presenting it (EACCES otherwise; with a controller
//!   key the host must also check the target's, which the double takes as given).
//!
//! It also models host controllers, the part of the kernel a tree cannot show: a host connects
//! through a port only while the subsystem is linked to it and the host is admitted; unlinking
//! the subsystem from a port deletes its controllers there, while removing a host from
//! `allowed_hosts` deletes none (docs/rules.md, fencing at the target). And it can record every
//! operation it applied, in order, so a test can assert the exact configfs sequence of a plan
//! run by code it cannot reach (the agent): [`ConfigfsDouble::record_ops`].

use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Component, Path, PathBuf};

use crate::exec::Executor;
use crate::model::{HOSTS, PORTS, SUBSYSTEMS, normalize, read_attr};
use crate::names::DISCOVERY_NQN;
use crate::plan::Op;

/// Where the double keeps state the real kernel keeps in memory (which subsystems a host has
/// identified, until the subsystem is removed). Outside the three nvmet directories, so readers
/// never see it.
const PRIVATE_DIR: &str = ".double";

/// Under [`PRIVATE_DIR`]: the record of applied operations, present only while recording. On
/// disk, so every handle on the same root (the agent clones its double per plan) records.
const OPS_LOG: &str = "ops.log";

/// Under [`PRIVATE_DIR`]: present when the double models a kernel with NVMe reservations.
const RESERVATIONS: &str = "reservations";

/// Under [`PRIVATE_DIR`]: present when the double models a kernel without NVMe in-band
/// authentication (no `dhchap_*` attributes on host entries).
const NO_AUTH: &str = "no-auth";

/// Under [`PRIVATE_DIR`]: live host controllers, as `controllers/<port>/<subsystem>/<host>`.
const CONTROLLERS: &str = "controllers";

/// Under [`PRIVATE_DIR`]: which subsystems each port links, as `port-links/<port>/<subsystem>`,
/// so the double finds a duplicate link (EEXIST, whatever its name) without reading every link
/// of the port: the kernel walks its in-memory list, a directory walk would make the double's
/// cost grow with the port's links.
const PORT_LINKS: &str = "port-links";

/// The nvmet configfs test double rooted at a directory.
#[derive(Debug, Clone)]
pub struct ConfigfsDouble {
    root: PathBuf,
    reservations: bool,
    auth: bool,
}

fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

/// Where a path lies in the nvmet tree.
#[derive(Debug, PartialEq, Eq)]
enum Place<'a> {
    TopGroup,
    Subsystem(&'a str),
    SubsystemAttr(&'a str, &'a str),
    SubsystemDefaultGroup,
    Namespace(&'a str, &'a str),
    NamespaceAttr(&'a str, &'a str, &'a str),
    AllowedHostLink(&'a str, &'a str),
    Port(&'a str),
    PortAttr(&'a str, &'a str),
    PortDefaultGroup,
    PortSubsystemLink(&'a str, &'a str),
    PortChild,
    Host(&'a str),
    HostAttr(&'a str, &'a str),
    Other,
}

fn classify(path: &Path) -> Place<'_> {
    let parts: Vec<&str> = path
        .components()
        .map(|c| match c {
            Component::Normal(s) => s.to_str().unwrap_or("\u{0}"),
            _ => "\u{0}",
        })
        .collect();
    match parts.as_slice() {
        [SUBSYSTEMS] | [PORTS] | [HOSTS] => Place::TopGroup,
        [SUBSYSTEMS, s] => Place::Subsystem(s),
        [SUBSYSTEMS, _, "namespaces" | "allowed_hosts" | "passthru"] => {
            Place::SubsystemDefaultGroup
        }
        [SUBSYSTEMS, s, a] => Place::SubsystemAttr(s, a),
        [SUBSYSTEMS, s, "namespaces", n] => Place::Namespace(s, n),
        [SUBSYSTEMS, s, "namespaces", n, a] => Place::NamespaceAttr(s, n, a),
        [SUBSYSTEMS, s, "allowed_hosts", h] => Place::AllowedHostLink(s, h),
        [PORTS, p] => Place::Port(p),
        [PORTS, _, "subsystems" | "referrals" | "ana_groups"] => Place::PortDefaultGroup,
        [PORTS, p, a] => Place::PortAttr(p, a),
        [PORTS, p, "subsystems", s] => Place::PortSubsystemLink(p, s),
        [PORTS, _, "ana_groups", "1"] => Place::PortDefaultGroup,
        [PORTS, ..] => Place::PortChild,
        [HOSTS, h] => Place::Host(h),
        [HOSTS, h, a] => Place::HostAttr(h, a),
        _ => Place::Other,
    }
}

/// The kernel's kstrtobool: the first character decides; anything else is EINVAL.
fn kstrtobool(value: &str) -> io::Result<bool> {
    match value.as_bytes().first() {
        Some(b'1' | b'y' | b'Y' | b't' | b'T') => Ok(true),
        Some(b'0' | b'n' | b'N' | b'f' | b'F') => Ok(false),
        Some(b'o' | b'O') => match value.as_bytes().get(1) {
            Some(b'n' | b'N') => Ok(true),
            Some(b'f' | b'F') => Ok(false),
            _ => Err(errno(libc::EINVAL)),
        },
        _ => Err(errno(libc::EINVAL)),
    }
}

/// kstrtou32/kstrtou16 with base 0: decimal, `0x` hex or leading-`0` octal.
fn kstrtou(value: &str, max: u64) -> io::Result<u64> {
    let v = value.strip_suffix('\n').unwrap_or(value);
    let parsed = if let Some(hex) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        u64::from_str_radix(hex, 16)
    } else if v.len() > 1 && v.starts_with('0') {
        u64::from_str_radix(&v[1..], 8)
    } else {
        v.parse::<u64>()
    };
    match parsed {
        Ok(n) if n <= max => Ok(n),
        Ok(_) => Err(errno(libc::ERANGE)),
        Err(_) => Err(errno(libc::EINVAL)),
    }
}

/// The kernel's uuid_is_valid: only the first 36 characters count.
fn kernel_uuid(value: &str) -> io::Result<String> {
    let head = value.get(..36).ok_or_else(|| errno(libc::EINVAL))?;
    let ok = head.bytes().enumerate().all(|(i, c)| match i {
        8 | 13 | 18 | 23 => c == b'-',
        _ => c.is_ascii_hexdigit(),
    });
    if ok {
        Ok(head.to_ascii_lowercase())
    } else {
        Err(errno(libc::EINVAL))
    }
}

/// The kernel's NGUID parser: 16 hex pairs, each optionally followed by one '-' or ':'.
fn kernel_nguid(value: &str) -> io::Result<String> {
    let b = value.as_bytes();
    let mut p = 0;
    let mut out = [0u8; 16];
    for byte in &mut out {
        if p + 2 > b.len() || !b[p].is_ascii_hexdigit() || !b[p + 1].is_ascii_hexdigit() {
            return Err(errno(libc::EINVAL));
        }
        let hex = std::str::from_utf8(&b[p..p + 2]).map_err(|_| errno(libc::EINVAL))?;
        *byte = u8::from_str_radix(hex, 16).map_err(|_| errno(libc::EINVAL))?;
        p += 2;
        if matches!(b.get(p), Some(b'-' | b':')) {
            p += 1;
        }
    }
    Ok(uuid::Uuid::from_bytes(out).hyphenated().to_string())
}

fn first_line(value: &str) -> &str {
    value.split('\n').next().unwrap_or("")
}

fn first_token(value: &str) -> &str {
    value.split_whitespace().next().unwrap_or("")
}

impl ConfigfsDouble {
    /// Creates an empty nvmet tree at `root` (or opens one the double made before), modelling a
    /// kernel without NVMe reservations (Linux < 6.13, like Debian bookworm's 6.1).
    pub fn create(root: impl Into<PathBuf>) -> io::Result<Self> {
        let root = root.into();
        for dir in [SUBSYSTEMS, PORTS, HOSTS] {
            fs::create_dir_all(root.join(dir))?;
        }
        fs::create_dir_all(root.join(PRIVATE_DIR).join("discovered"))?;
        let reservations = root.join(PRIVATE_DIR).join(RESERVATIONS).exists();
        let auth = !root.join(PRIVATE_DIR).join(NO_AUTH).exists();
        Ok(Self {
            root,
            reservations,
            auth,
        })
    }

    /// Models a kernel without NVMe in-band authentication (`CONFIG_NVME_TARGET_AUTH` not set,
    /// like Debian bookworm's 6.1): host entries have no `dhchap_*` attributes. Kept on disk for
    /// every handle on the same root, like [`Self::with_reservations`].
    #[must_use]
    pub fn without_auth(mut self) -> Self {
        self.auth = false;
        let _ = fs::write(self.root.join(PRIVATE_DIR).join(NO_AUTH), b"");
        self
    }

    fn auth_modelled(&self) -> bool {
        self.auth && !self.root.join(PRIVATE_DIR).join(NO_AUTH).exists()
    }

    /// Models a kernel with NVMe reservations (`resv_enable` on namespaces, Linux >= 6.13), for
    /// this handle and every other handle on the same root (kept on disk, like the operation
    /// record, so a test can turn it on for an agent's double).
    #[must_use]
    pub fn with_reservations(mut self) -> Self {
        self.reservations = true;
        // A handle that cannot persist the marker still models reservations itself; handles
        // opened later would not, which a test relying on them notices.
        let _ = fs::write(self.root.join(PRIVATE_DIR).join(RESERVATIONS), b"");
        self
    }

    /// The root of the tree, to read with [`crate::observe`].
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Simulates a host sending Identify Controller to `nqn`: from now on its serial and model
    /// are fixed, as in the kernel (`subsys_discovered`).
    pub fn host_identifies(&self, nqn: &str) -> io::Result<()> {
        if !self.root.join(SUBSYSTEMS).join(nqn).is_dir() {
            return Err(errno(libc::ENOENT));
        }
        fs::write(self.discovered_marker(nqn), b"")
    }

    /// Starts recording the operations applied to this tree (by any handle on it), dropping
    /// what was recorded before.
    pub fn record_ops(&self) -> io::Result<()> {
        fs::write(self.root.join(PRIVATE_DIR).join(OPS_LOG), b"")
    }

    /// The operations applied since [`Self::record_ops`], in order; only those that succeeded.
    pub fn recorded_ops(&self) -> io::Result<Vec<Op>> {
        let text = fs::read_to_string(self.root.join(PRIVATE_DIR).join(OPS_LOG))?;
        text.lines().map(decode_op).collect()
    }

    fn record(&self, op: &Op) -> io::Result<()> {
        let log = self.root.join(PRIVATE_DIR).join(OPS_LOG);
        if !log.exists() {
            return Ok(());
        }
        let mut file = fs::OpenOptions::new().append(true).open(log)?;
        io::Write::write_all(&mut file, format!("{}\n", encode_op(op)).as_bytes())
    }

    /// Simulates `host` connecting to `nqn` through port `port`, as the kernel's fabrics connect
    /// decides it: the subsystem must be linked to the port (else ENOENT) and the host admitted
    /// by `allow_any_host` or `allowed_hosts` (else EACCES, the kernel's "invalid host"). A
    /// connected host has identified the subsystem.
    pub fn host_connects(&self, nqn: &str, host: &str, port: u16) -> io::Result<()> {
        self.host_connects_with_secret(nqn, host, port, None)
    }

    /// [`Self::host_connects`] by a host presenting `secret` (the fabrics option
    /// `dhchap_secret`): where the host entry has a `dhchap_key`, the connect succeeds only when
    /// the host presents exactly that secret (EACCES otherwise: the kernel's failed
    /// authentication); where it has none, any host the ACL admits connects.
    pub fn host_connects_with_secret(
        &self,
        nqn: &str,
        host: &str,
        port: u16,
        secret: Option<&str>,
    ) -> io::Result<()> {
        let port = port.to_string();
        let linked = self
            .root
            .join(PORTS)
            .join(&port)
            .join(SUBSYSTEMS)
            .join(nqn)
            .symlink_metadata()
            .is_ok();
        if !linked {
            return Err(errno(libc::ENOENT));
        }
        let sub = self.root.join(SUBSYSTEMS).join(nqn);
        let any = self.attr(&sub.join("attr_allow_any_host"))? == "1";
        let allowed = sub
            .join("allowed_hosts")
            .join(host)
            .symlink_metadata()
            .is_ok();
        if !any && !allowed {
            return Err(errno(libc::EACCES));
        }
        // The kernel looks up the host entry's key only for a subsystem with an ACL
        // (`nvmet_setup_auth` skips `allow_any_host` subsystems).
        if !any {
            let key = self
                .root
                .join(HOSTS)
                .join(host)
                .join(crate::auth::DHCHAP_KEY);
            if let Ok(shown) = read_attr(&key) {
                let presented = secret.map(|s| s.trim_end_matches(['\n', ':']));
                // A key the store took but that is no well-formed secret authenticates nobody.
                let usable = crate::auth::DhchapSecret::parse(&shown).is_ok();
                if !shown.is_empty() && (!usable || presented != Some(shown.trim_end_matches(':')))
                {
                    return Err(errno(libc::EACCES));
                }
            }
        }
        let dir = self.controllers_dir().join(&port).join(nqn);
        fs::create_dir_all(&dir)?;
        fs::write(dir.join(host), b"")?;
        self.host_identifies(nqn)
    }

    /// Simulates `host` disconnecting from `nqn` (`nvme disconnect` of that subsystem): its
    /// controllers on every port end. Disconnecting a host that has none is not an error.
    pub fn host_disconnects(&self, nqn: &str, host: &str) -> io::Result<()> {
        let dir = self.controllers_dir();
        if !dir.is_dir() {
            return Ok(());
        }
        for port in Self::dir_entries(&dir)? {
            match fs::remove_file(dir.join(port).join(nqn).join(host)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// The live controllers of `nqn`: (port, host NQN) pairs, sorted.
    pub fn controllers(&self, nqn: &str) -> io::Result<Vec<(u16, String)>> {
        let mut out = Vec::new();
        let dir = self.controllers_dir();
        if !dir.is_dir() {
            return Ok(out);
        }
        for port in Self::dir_entries(&dir)? {
            let hosts = dir.join(&port).join(nqn);
            if !hosts.is_dir() {
                continue;
            }
            let id = port.parse::<u16>().map_err(|_| errno(libc::EINVAL))?;
            for host in Self::dir_entries(&hosts)? {
                out.push((id, host));
            }
        }
        out.sort();
        Ok(out)
    }

    fn controllers_dir(&self) -> PathBuf {
        self.root.join(PRIVATE_DIR).join(CONTROLLERS)
    }

    fn discovered_marker(&self, nqn: &str) -> PathBuf {
        self.root.join(PRIVATE_DIR).join("discovered").join(nqn)
    }

    fn discovered(&self, nqn: &str) -> bool {
        self.discovered_marker(nqn).exists()
    }

    fn at(&self, rel: &Path) -> io::Result<PathBuf> {
        // Plans are relative; anything escaping the root is not the nvmet tree.
        if rel.is_absolute() || rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(errno(libc::EPERM));
        }
        Ok(self.root.join(rel))
    }

    fn attr(&self, path: &Path) -> io::Result<String> {
        read_attr(path).map_err(|_| errno(libc::ENOENT))
    }

    fn set(&self, path: &Path, value: &str) -> io::Result<()> {
        fs::write(path, format!("{value}\n"))
    }

    fn ns_enabled(&self, ns_dir: &Path) -> io::Result<bool> {
        Ok(self.attr(&ns_dir.join("enable"))? == "1")
    }

    fn dir_entries(path: &Path) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in fs::read_dir(path)? {
            out.push(e?.file_name().to_string_lossy().into_owned());
        }
        Ok(out)
    }

    fn port_linked(&self, port: &str) -> io::Result<bool> {
        Self::non_empty(&self.root.join(PORTS).join(port).join("subsystems"))
    }

    /// Whether `dir` has an entry, reading only the first few.
    fn non_empty(dir: &Path) -> io::Result<bool> {
        Ok(crate::model::first_entry_except(dir, None)?.is_some())
    }

    fn port_link_marker(&self, port: &str, nqn: &str) -> PathBuf {
        self.root
            .join(PRIVATE_DIR)
            .join(PORT_LINKS)
            .join(port)
            .join(nqn)
    }

    /// Names of items that symlinks anywhere in the tree point to, as tree-relative paths.
    /// Links that vanish while this reads (another writer unlinking or removing its own
    /// subsystem, as the agent's concurrent changes of other volumes do) are skipped.
    fn link_targets(&self) -> io::Result<Vec<PathBuf>> {
        let gone = |e: &io::Error| e.kind() == io::ErrorKind::NotFound;
        let mut targets = Vec::new();
        let mut read = |dir: PathBuf| -> io::Result<()> {
            let links = match Self::dir_entries(&dir) {
                Err(e) if gone(&e) => return Ok(()),
                other => other?,
            };
            for link in links {
                match self.resolve_link(&dir.join(link)) {
                    Ok(t) => targets.push(t),
                    Err(e) if gone(&e) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        };
        for sub in Self::dir_entries(&self.root.join(SUBSYSTEMS))? {
            read(self.root.join(SUBSYSTEMS).join(&sub).join("allowed_hosts"))?;
        }
        for port in Self::dir_entries(&self.root.join(PORTS))? {
            read(self.root.join(PORTS).join(&port).join("subsystems"))?;
        }
        Ok(targets)
    }

    fn resolve_link(&self, link: &Path) -> io::Result<PathBuf> {
        let raw = fs::read_link(link)?;
        let abs = normalize(&link.parent().unwrap_or(Path::new("/")).join(raw));
        abs.strip_prefix(normalize(&self.root))
            .map(Path::to_path_buf)
            .map_err(|_| errno(libc::EPERM))
    }

    fn mkdir(&self, rel: &Path) -> io::Result<()> {
        let path = self.at(rel)?;
        let parent_exists = path.parent().is_some_and(Path::is_dir);
        if !parent_exists {
            return Err(errno(libc::ENOENT));
        }
        if path.exists() {
            return Err(errno(libc::EEXIST));
        }
        match classify(rel) {
            Place::Subsystem(name) => {
                if name == DISCOVERY_NQN {
                    return Err(errno(libc::EINVAL));
                }
                if name.len() > 255 {
                    return Err(errno(libc::ENAMETOOLONG));
                }
                fs::create_dir(&path)?;
                fs::create_dir(path.join("namespaces"))?;
                fs::create_dir(path.join("allowed_hosts"))?;
                let serial: String = uuid::Uuid::new_v4().simple().to_string()[..20].to_owned();
                for (attr, value) in [
                    ("attr_allow_any_host", "0"),
                    ("attr_serial", serial.as_str()),
                    ("attr_model", "Linux"),
                    ("attr_version", "1.3"),
                    ("attr_cntlid_min", "1"),
                    ("attr_cntlid_max", "65519"),
                    ("attr_qid_max", "128"),
                ] {
                    self.set(&path.join(attr), value)?;
                }
                Ok(())
            }
            Place::Namespace(_, n) => {
                let nsid = kstrtou(n, u64::from(u32::MAX))?;
                if nsid == 0 || nsid == u64::from(u32::MAX) {
                    return Err(errno(libc::EINVAL));
                }
                fs::create_dir(&path)?;
                let uuid = uuid::Uuid::new_v4().hyphenated().to_string();
                let mut attrs = vec![
                    ("device_path", "(null)"),
                    ("device_uuid", uuid.as_str()),
                    ("device_nguid", "00000000-0000-0000-0000-000000000000"),
                    ("enable", "0"),
                    ("ana_grpid", "1"),
                    ("buffered_io", "0"),
                    ("revalidate_size", ""),
                ];
                if self.reservations || self.root.join(PRIVATE_DIR).join(RESERVATIONS).exists() {
                    attrs.push(("resv_enable", "0"));
                }
                for (attr, value) in attrs {
                    self.set(&path.join(attr), value)?;
                }
                Ok(())
            }
            Place::Port(p) => {
                kstrtou(p, u64::from(u16::MAX)).map_err(|_| errno(libc::EINVAL))?;
                fs::create_dir(&path)?;
                for group in ["subsystems", "referrals", "ana_groups", "ana_groups/1"] {
                    fs::create_dir(path.join(group))?;
                }
                self.set(&path.join("ana_groups/1/ana_state"), "optimized")?;
                for (attr, value) in [
                    ("addr_trtype", ""),
                    ("addr_adrfam", ""),
                    ("addr_traddr", ""),
                    ("addr_trsvcid", ""),
                    ("addr_treq", "not specified"),
                    ("param_inline_data_size", "-1"),
                ] {
                    self.set(&path.join(attr), value)?;
                }
                Ok(())
            }
            Place::Host(_) => {
                fs::create_dir(&path)?;
                if self.auth_modelled() {
                    for (attr, value) in [
                        (crate::auth::DHCHAP_KEY, ""),
                        (crate::auth::DHCHAP_CTRL_KEY, ""),
                        (crate::auth::DHCHAP_HASH, "hmac(sha256)"),
                        (crate::auth::DHCHAP_DHGROUP, "null"),
                    ] {
                        self.set(&path.join(attr), value)?;
                    }
                }
                Ok(())
            }
            // Configfs has no make_group there: "Lack-of-mkdir returns -EPERM".
            _ => Err(errno(libc::EPERM)),
        }
    }

    fn write(&self, rel: &Path, value: &str) -> io::Result<()> {
        let path = self.at(rel)?;
        if path.is_dir() {
            return Err(errno(libc::EISDIR));
        }
        if matches!(classify(rel), Place::HostAttr(..)) && !path.is_file() {
            // The attribute does not exist (a kernel without authentication): opening it for
            // writing without O_CREAT fails.
            return Err(errno(libc::ENOENT));
        }
        if !path.is_file() {
            // configfs directories have no ->create: opening a new file fails.
            return Err(if path.parent().is_some_and(Path::is_dir) {
                errno(libc::EACCES)
            } else {
                errno(libc::ENOENT)
            });
        }
        match classify(rel) {
            Place::NamespaceAttr(_, _, attr) => {
                let ns_dir = path.parent().ok_or_else(|| errno(libc::EINVAL))?;
                let enabled = self.ns_enabled(ns_dir)?;
                match attr {
                    "device_path" => {
                        if enabled {
                            return Err(errno(libc::EBUSY));
                        }
                        let v = first_line(value);
                        if v.is_empty() {
                            return Err(errno(libc::EINVAL));
                        }
                        self.set(&path, v)
                    }
                    "device_uuid" => {
                        if enabled {
                            return Err(errno(libc::EBUSY));
                        }
                        self.set(&path, &kernel_uuid(value)?)
                    }
                    "device_nguid" => {
                        if enabled {
                            return Err(errno(libc::EBUSY));
                        }
                        self.set(&path, &kernel_nguid(value)?)
                    }
                    "enable" => {
                        let on = kstrtobool(value)?;
                        if on && !enabled {
                            let device = self.attr(&ns_dir.join("device_path"))?;
                            if device.is_empty() || device == "(null)" {
                                return Err(errno(libc::EINVAL));
                            }
                            if !Path::new(&device).exists() {
                                return Err(errno(libc::ENOENT));
                            }
                        }
                        self.set(&path, if on { "1" } else { "0" })
                    }
                    "revalidate_size" => {
                        if !kstrtobool(value)? || !enabled {
                            return Err(errno(libc::EINVAL));
                        }
                        Ok(())
                    }
                    "resv_enable" | "buffered_io" => {
                        let on = kstrtobool(value)?;
                        if enabled {
                            return Err(errno(libc::EINVAL));
                        }
                        self.set(&path, if on { "1" } else { "0" })
                    }
                    "ana_grpid" => {
                        let g = kstrtou(value, u64::from(u32::MAX))?;
                        if !(1..=128).contains(&g) {
                            return Err(errno(libc::EINVAL));
                        }
                        self.set(&path, &g.to_string())
                    }
                    _ => Err(errno(libc::EACCES)),
                }
            }
            Place::SubsystemAttr(nqn, attr) => match attr {
                "attr_allow_any_host" => {
                    let on = kstrtobool(value)?;
                    let hosts_dir = self.root.join(SUBSYSTEMS).join(nqn).join("allowed_hosts");
                    if on && !Self::dir_entries(&hosts_dir)?.is_empty() {
                        return Err(errno(libc::EINVAL));
                    }
                    self.set(&path, if on { "1" } else { "0" })
                }
                "attr_serial" => {
                    let v = first_line(value);
                    if self.discovered(nqn)
                        || v.is_empty()
                        || v.len() > 20
                        || !v.bytes().all(|c| (0x20..=0x7e).contains(&c))
                    {
                        return Err(errno(libc::EINVAL));
                    }
                    // The kernel pads the serial with spaces to the full 20 characters.
                    self.set(&path, &format!("{v:<20}"))
                }
                "attr_model" => {
                    let v = first_line(value);
                    if self.discovered(nqn)
                        || v.is_empty()
                        || v.len() > 40
                        || !v.bytes().all(|c| (0x20..=0x7e).contains(&c))
                    {
                        return Err(errno(libc::EINVAL));
                    }
                    self.set(&path, v)
                }
                _ => Err(errno(libc::EACCES)),
            },
            Place::HostAttr(_, attr) => self.write_host_attr(&path, attr, value),
            Place::PortAttr(port, attr) => {
                if self.port_linked(port)? {
                    return Err(errno(libc::EACCES));
                }
                let v = match attr {
                    "addr_trtype" => {
                        let v = first_line(value);
                        if !matches!(v, "rdma" | "fc" | "tcp" | "loop") {
                            return Err(errno(libc::EINVAL));
                        }
                        v
                    }
                    "addr_adrfam" => {
                        let v = first_line(value);
                        if !matches!(v, "ipv4" | "ipv6" | "ib" | "fc" | "loop") {
                            return Err(errno(libc::EINVAL));
                        }
                        v
                    }
                    "addr_traddr" | "addr_trsvcid" => {
                        let limit = if attr == "addr_traddr" { 256 } else { 32 };
                        let v = first_token(value);
                        if value.len() > limit || v.is_empty() {
                            return Err(errno(libc::EINVAL));
                        }
                        v
                    }
                    _ => return Err(errno(libc::EACCES)),
                };
                self.set(&path, v)
            }
            _ => Err(errno(libc::EACCES)),
        }
    }

    /// A host entry's authentication attribute, as `nvmet_auth_set_key`,
    /// `nvmet_host_dhchap_hash_store` and `nvmet_host_dhchap_dhgroup_store` take it.
    fn write_host_attr(&self, path: &Path, attr: &str, value: &str) -> io::Result<()> {
        use crate::auth::{DHCHAP_CTRL_KEY, DHCHAP_DHGROUP, DHCHAP_HASH, DHCHAP_KEY};
        let v = value.strip_suffix('\n').unwrap_or(value);
        match attr {
            DHCHAP_KEY | DHCHAP_CTRL_KEY => {
                if v.is_empty() {
                    return self.set(path, "");
                }
                // What the store checks on the lane's 7.2 (`s15_dhchap`): the prefix and a
                // transform of 0-3 (`sscanf("DHHC-1:%hhd:%*s")`); the key itself (base64,
                // length, CRC) only when a host authenticates, so a malformed one is taken here
                // and fails every connect (`host_connects_with_secret`).
                let rest = v
                    .strip_prefix("DHHC-1:")
                    .ok_or_else(|| errno(libc::EINVAL))?;
                let (hh, body) = rest.split_once(':').ok_or_else(|| errno(libc::EINVAL))?;
                let transform: u8 = hh.parse().map_err(|_| errno(libc::EINVAL))?;
                if transform > 3 || body.trim().is_empty() {
                    return Err(errno(libc::EINVAL));
                }
                self.set(path, v)
            }
            DHCHAP_HASH => {
                let hash = crate::auth::DhchapHash::parse(v).map_err(|_| errno(libc::EINVAL))?;
                if !v.starts_with("hmac(") {
                    return Err(errno(libc::EINVAL));
                }
                self.set(path, hash.kernel_name())
            }
            DHCHAP_DHGROUP => {
                let group = crate::auth::DhGroup::parse(v).map_err(|_| errno(libc::EINVAL))?;
                self.set(path, group.kernel_name())
            }
            _ => Err(errno(libc::EACCES)),
        }
    }

    /// What the kernel checks when the first subsystem is linked to a port (nvmet_enable_port
    /// and the TCP transport's add_port), including a clash with another enabled port.
    fn enable_port(&self, port: &str) -> io::Result<()> {
        let dir = self.root.join(PORTS).join(port);
        let trtype = self.attr(&dir.join("addr_trtype"))?;
        match trtype.as_str() {
            "loop" => return Ok(()),
            "tcp" => {}
            _ => return Err(errno(libc::EINVAL)),
        }
        let adrfam = self.attr(&dir.join("addr_adrfam"))?;
        let traddr = self.attr(&dir.join("addr_traddr"))?;
        let trsvcid = self.attr(&dir.join("addr_trsvcid"))?;
        let ip: IpAddr = traddr.parse().map_err(|_| errno(libc::EINVAL))?;
        let family_ok = matches!(
            (adrfam.as_str(), ip),
            ("ipv4", IpAddr::V4(_)) | ("ipv6", IpAddr::V6(_))
        );
        if !family_ok || trsvcid.parse::<u16>().is_err() {
            return Err(errno(libc::EINVAL));
        }
        for other in Self::dir_entries(&self.root.join(PORTS))? {
            if other == port || !self.port_linked(&other)? {
                continue;
            }
            let o = self.root.join(PORTS).join(&other);
            if self.attr(&o.join("addr_traddr"))? == traddr
                && self.attr(&o.join("addr_trsvcid"))? == trsvcid
            {
                return Err(errno(libc::EADDRINUSE));
            }
        }
        Ok(())
    }

    fn symlink(&self, target_rel: &Path, link_rel: &Path) -> io::Result<()> {
        let link = self.at(link_rel)?;
        let target = self.at(target_rel)?;
        let place = classify(link_rel);
        if !matches!(
            place,
            Place::AllowedHostLink(..) | Place::PortSubsystemLink(..)
        ) {
            return Err(errno(libc::EPERM));
        }
        if !link.parent().is_some_and(Path::is_dir) {
            return Err(errno(libc::ENOENT));
        }
        if !target.exists() {
            return Err(errno(libc::ENOENT));
        }
        if !target.is_dir() {
            return Err(errno(libc::ENOTDIR));
        }
        if link.symlink_metadata().is_ok() {
            return Err(errno(libc::EEXIST));
        }
        let link_dir = link.parent().ok_or_else(|| errno(libc::EPERM))?;
        let mut marker = None;
        match (place, classify(target_rel)) {
            (Place::AllowedHostLink(nqn, _), Place::Host(_)) => {
                if self.attr(
                    &self
                        .root
                        .join(SUBSYSTEMS)
                        .join(nqn)
                        .join("attr_allow_any_host"),
                )? == "1"
                {
                    return Err(errno(libc::EINVAL));
                }
                // A subsystem has few host links: read them all.
                for l in Self::dir_entries(link_dir)? {
                    if self.resolve_link(&link_dir.join(l))? == target_rel {
                        return Err(errno(libc::EEXIST));
                    }
                }
            }
            (Place::PortSubsystemLink(port, _), Place::Subsystem(target)) => {
                let m = self.port_link_marker(port, target);
                if m.exists() {
                    return Err(errno(libc::EEXIST));
                }
                if !Self::non_empty(link_dir)? {
                    self.enable_port(port)?;
                }
                marker = Some(m);
            }
            _ => return Err(errno(libc::EINVAL)),
        }
        // Relative, like configfs: from <root>/<a>/<b>/<c>/link, three levels up is the root.
        let depth = link_rel.components().count() - 1;
        let relative = Path::new(&"../".repeat(depth)).join(target_rel);
        std::os::unix::fs::symlink(relative, &link)?;
        if let Some(m) = marker {
            if let Some(parent) = m.parent() {
                fs::create_dir_all(parent)?;
            }
            fs::write(m, b"")?;
        }
        Ok(())
    }

    fn unlink(&self, rel: &Path) -> io::Result<()> {
        let path = self.at(rel)?;
        let meta = path.symlink_metadata().map_err(|_| errno(libc::ENOENT))?;
        if meta.is_dir() {
            return Err(errno(libc::EISDIR));
        }
        if !meta.file_type().is_symlink() {
            return Err(errno(libc::EPERM));
        }
        let target = self.resolve_link(&path)?;
        fs::remove_file(path)?;
        // Unlinking a subsystem from a port deletes every controller of it on that port
        // (nvmet_port_subsys_drop_link); dropping an allowed_hosts link deletes none.
        if let Place::PortSubsystemLink(port, nqn) = classify(rel) {
            if let Place::Subsystem(linked) = classify(&target) {
                let m = self.port_link_marker(port, linked);
                if m.exists() {
                    fs::remove_file(m)?;
                }
            }
            let dir = self.controllers_dir().join(port).join(nqn);
            if dir.is_dir() {
                fs::remove_dir_all(dir)?;
            }
        }
        Ok(())
    }

    fn rmdir(&self, rel: &Path) -> io::Result<()> {
        let path = self.at(rel)?;
        let meta = path.symlink_metadata().map_err(|_| errno(libc::ENOENT))?;
        if !meta.is_dir() {
            return Err(errno(libc::ENOTDIR));
        }
        let linked = || -> io::Result<bool> { Ok(self.link_targets()?.iter().any(|t| t == rel)) };
        match classify(rel) {
            Place::Subsystem(nqn) => {
                // Linked from a port: the port-link markers say so without reading every link.
                let ports = self.root.join(PRIVATE_DIR).join(PORT_LINKS);
                let on_a_port = match fs::read_dir(&ports) {
                    Ok(entries) => entries
                        .map(|e| e.map(|e| e.path().join(nqn).exists()))
                        .collect::<io::Result<Vec<_>>>()?
                        .contains(&true),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => false,
                    Err(e) => return Err(e),
                };
                if on_a_port {
                    return Err(errno(libc::EBUSY));
                }
                if !Self::dir_entries(&path.join("namespaces"))?.is_empty()
                    || !Self::dir_entries(&path.join("allowed_hosts"))?.is_empty()
                {
                    return Err(errno(libc::ENOTEMPTY));
                }
            }
            Place::Namespace(..) => {} // the kernel disables an enabled namespace on release
            Place::Port(_) => {
                let extra_ana = Self::dir_entries(&path.join("ana_groups"))?
                    .iter()
                    .any(|g| g != "1");
                if !Self::dir_entries(&path.join("subsystems"))?.is_empty()
                    || !Self::dir_entries(&path.join("referrals"))?.is_empty()
                    || extra_ana
                {
                    return Err(errno(libc::ENOTEMPTY));
                }
            }
            Place::Host(_) => {
                if linked()? {
                    return Err(errno(libc::EBUSY));
                }
            }
            _ => return Err(errno(libc::EPERM)),
        }
        fs::remove_dir_all(path)?;
        if let Place::Subsystem(nqn) = classify(rel) {
            // The kernel keeps "a host identified it" in the subsystem itself
            // (`subsys_discovered`), so it goes with it: a subsystem made again under the same
            // name takes a serial and a model again.
            match fs::remove_file(self.discovered_marker(nqn)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }
}

impl Executor for ConfigfsDouble {
    fn execute(&mut self, op: &Op) -> io::Result<()> {
        match op {
            Op::Mkdir { path } => self.mkdir(path),
            Op::Write { path, value } => self.write(path, value),
            Op::Symlink { target, link } => self.symlink(target, link),
            Op::Unlink { path } => self.unlink(path),
            Op::Rmdir { path } => self.rmdir(path),
        }?;
        self.record(op)
    }
}

/// One recorded operation per line: a verb and tab-separated fields, with `\`, tab and newline
/// escaped so any value survives.
fn encode_op(op: &Op) -> String {
    fn esc(s: &str) -> String {
        s.replace('\\', "\\\\")
            .replace('\t', "\\t")
            .replace('\n', "\\n")
    }
    let p = |path: &Path| esc(&path.to_string_lossy());
    match op {
        Op::Mkdir { path } => format!("mkdir\t{}", p(path)),
        Op::Write { path, value } => format!("write\t{}\t{}", p(path), esc(value)),
        Op::Symlink { target, link } => format!("symlink\t{}\t{}", p(target), p(link)),
        Op::Unlink { path } => format!("unlink\t{}", p(path)),
        Op::Rmdir { path } => format!("rmdir\t{}", p(path)),
    }
}

fn decode_op(line: &str) -> io::Result<Op> {
    fn unesc(s: &str) -> String {
        let mut out = String::with_capacity(s.len());
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            if c == '\\' {
                match chars.next() {
                    Some('t') => out.push('\t'),
                    Some('n') => out.push('\n'),
                    Some(other) => out.push(other),
                    None => out.push('\\'),
                }
            } else {
                out.push(c);
            }
        }
        out
    }
    let fields: Vec<String> = line.split('\t').map(unesc).collect();
    let path = |i: usize| fields.get(i).map(PathBuf::from);
    let op = match fields.first().map(String::as_str) {
        Some("mkdir") => path(1).map(|path| Op::Mkdir { path }),
        Some("write") => path(1).zip(fields.get(2)).map(|(path, value)| Op::Write {
            path,
            value: value.clone(),
        }),
        Some("symlink") => path(1)
            .zip(path(2))
            .map(|(target, link)| Op::Symlink { target, link }),
        Some("unlink") => path(1).map(|path| Op::Unlink { path }),
        Some("rmdir") => path(1).map(|path| Op::Rmdir { path }),
        _ => None,
    };
    op.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad op record {line:?}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_paths() {
        assert_eq!(classify(Path::new("subsystems/x")), Place::Subsystem("x"));
        assert_eq!(
            classify(Path::new("subsystems/x/namespaces/1/enable")),
            Place::NamespaceAttr("x", "1", "enable")
        );
        assert_eq!(
            classify(Path::new("ports/1/subsystems/x")),
            Place::PortSubsystemLink("1", "x")
        );
        assert_eq!(
            classify(Path::new("ports/1/subsystems")),
            Place::PortDefaultGroup
        );
        assert_eq!(classify(Path::new("hosts/h")), Place::Host("h"));
        assert_eq!(classify(Path::new("elsewhere")), Place::Other);
    }

    #[test]
    fn recorded_ops_round_trip_any_value() {
        for op in [
            Op::Mkdir {
                path: "subsystems/x".into(),
            },
            Op::Write {
                path: "a/b".into(),
                value: "tab\there\nnew\\line\\t".into(),
            },
            Op::Symlink {
                target: "hosts/h".into(),
                link: "subsystems/x/allowed_hosts/h".into(),
            },
            Op::Unlink { path: "p".into() },
            Op::Rmdir { path: "q".into() },
        ] {
            assert_eq!(decode_op(&encode_op(&op)).unwrap(), op);
        }
    }

    #[test]
    fn kernel_parsers() {
        assert!(kstrtobool("1\n").unwrap());
        assert!(!kstrtobool("0").unwrap());
        assert!(kstrtobool("").is_err());
        assert!(kstrtobool("2").is_err());
        assert_eq!(kstrtou("0x10", 1000).unwrap(), 16);
        assert_eq!(kstrtou("010", 1000).unwrap(), 8);
        assert!(kstrtou("x", 1000).is_err());
        assert_eq!(
            kernel_nguid("00:11:22:33:44:55:66:77:88:99:aa:bb:cc:dd:ee:ff").unwrap(),
            "00112233-4455-6677-8899-aabbccddeeff"
        );
        assert!(kernel_nguid("0011").is_err());
        assert_eq!(
            kernel_uuid("6A1F3C2E-1B7D-4D2A-9C3E-0F1E2D3C4B5A\n").unwrap(),
            "6a1f3c2e-1b7d-4d2a-9c3e-0f1e2d3c4b5a"
        );
        assert!(kernel_uuid("6a1f3c2e1b7d4d2a9c3e0f1e2d3c4b5a").is_err());
    }
}
