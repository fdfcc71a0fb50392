//! Desired state of an export and observed state of an nvmet configfs tree.
//!
//! The observed state is read from a configfs root given as a parameter: the kernel's
//! `/sys/kernel/config/nvmet` or any directory laid out the same way (the test double). Names
//! found in the tree are kept as raw strings, since a tree may hold subsystems pillar did not
//! create; only desired state is typed.
//!
//! Symlinks are compared by their resolved target, never by the raw `readlink` text: configfs
//! returns relative `../../..` paths.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::{Component, Path, PathBuf};

use uuid::Uuid;

use crate::identity::{NamespaceIdentity, Nguid, Serial, parse_uuid};
use crate::names::{HostNqn, NamespaceId, PortId, SubsystemNqn};

/// Top-level directories of the nvmet configfs tree.
pub const SUBSYSTEMS: &str = "subsystems";
pub const PORTS: &str = "ports";
pub const HOSTS: &str = "hosts";

// A host entry's authentication attributes (W10; the rules on their values are `auth`'s).
// Here, with the tree's layout, so that the operation type (`plan`) can keep their values out
// of its `Debug` and `Display` without importing `auth`, which plans with operations.

/// Host-entry attribute: the secret the host proves.
pub const DHCHAP_KEY: &str = "dhchap_key";
/// Host-entry attribute: the secret the target proves (bidirectional authentication).
pub const DHCHAP_CTRL_KEY: &str = "dhchap_ctrl_key";
/// Host-entry attribute: the HMAC, `hmac(sha256)`, `hmac(sha384)` or `hmac(sha512)`.
pub const DHCHAP_HASH: &str = "dhchap_hash";
/// Host-entry attribute: the Diffie-Hellman group, `null` or `ffdhe2048` ... `ffdhe8192`.
pub const DHCHAP_DHGROUP: &str = "dhchap_dhgroup";

// A port's TLS attributes, with the tree's layout for the same reason (`tls` derives its keys
// from `auth`'s secrets, which plan with operations).

/// A port's secure channel attribute (`addr_tsas`).
pub const ADDR_TSAS: &str = "addr_tsas";
/// A port's transport requirements attribute (`addr_treq`).
pub const ADDR_TREQ: &str = "addr_treq";
/// `addr_tsas` of a port that speaks TLS 1.3.
pub const TSAS_TLS13: &str = "tls1.3";
/// `addr_treq` of a port that refuses hosts without TLS.
pub const TREQ_REQUIRED: &str = "required";

/// Whether a write to `path` carries a secret (a host entry's key attributes).
pub fn is_secret_attribute(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n == DHCHAP_KEY || n == DHCHAP_CTRL_KEY)
}

/// The NVMe-oF transport of a port. pillar only speaks TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    Tcp,
}

impl Transport {
    /// The value of `addr_trtype`.
    pub const fn as_configfs(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
        }
    }
}

/// A port as pillar wants it: transport, listen address, and whether hosts must speak TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PortSpec {
    pub transport: Transport,
    pub address: SocketAddr,
    /// TLS 1.3 required (`addr_tsas=tls1.3`, `addr_treq=required`): a host that does not start
    /// TLS with a PSK the target's keyring holds is refused (docs/rules.md K31).
    pub tls: bool,
}

impl PortSpec {
    /// A TCP port listening on `address`, without TLS.
    pub const fn tcp(address: SocketAddr) -> Self {
        Self {
            transport: Transport::Tcp,
            address,
            tls: false,
        }
    }

    /// This port with TLS 1.3 required.
    #[must_use]
    pub const fn with_tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// The `addr_*` attributes of this port, in the order they are written: `addr_trtype`
    /// first (writing it resets `addr_tsas`), the secure channel last (`addr_tsas` before
    /// `addr_treq`: the kernel refuses `not specified` with TLS, and `required` is what it sets).
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let family = match self.address.ip() {
            IpAddr::V4(_) => "ipv4",
            IpAddr::V6(_) => "ipv6",
        };
        let mut attrs = vec![
            ("addr_trtype", self.transport.as_configfs().to_owned()),
            ("addr_adrfam", family.to_owned()),
            ("addr_traddr", self.address.ip().to_string()),
            ("addr_trsvcid", self.address.port().to_string()),
        ];
        if self.tls {
            attrs.push((ADDR_TSAS, TSAS_TLS13.to_owned()));
            attrs.push((ADDR_TREQ, TREQ_REQUIRED.to_owned()));
        }
        attrs
    }

    /// How a conflict names this port: `tcp/ipv4 127.0.0.1:4420`, ` tls1.3` added with TLS.
    pub fn describe(&self) -> String {
        let a = self.attributes();
        let tls = if self.tls { " tls1.3" } else { "" };
        format!("{}/{} {}:{}{tls}", a[0].1, a[1].1, a[2].1, a[3].1)
    }
}

/// Which hosts may connect to a subsystem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostAccess {
    /// `attr_allow_any_host=1`: any host that reaches the port (PillarProtocol `acl: false`).
    AnyHost,
    /// `attr_allow_any_host=0` and exactly these hosts linked in `allowed_hosts/`. An empty set
    /// admits nobody (exported, not granted).
    Only(BTreeSet<HostNqn>),
}

impl HostAccess {
    /// Whether any host may connect: any host, or at least one listed host. A subsystem that
    /// admits nobody keeps its namespaces disabled (W7: a disabled namespace has no command in
    /// flight and takes none).
    pub fn admits_a_host(&self) -> bool {
        match self {
            Self::AnyHost => true,
            Self::Only(hosts) => !hosts.is_empty(),
        }
    }
}

/// One namespace as pillar wants it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceSpec {
    pub device_path: PathBuf,
    pub identity: NamespaceIdentity,
}

/// The complete desired state of one export: a subsystem, its namespaces, its ACL and the ports
/// it is reachable on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSpec {
    pub nqn: SubsystemNqn,
    pub serial: Serial,
    pub namespaces: BTreeMap<NamespaceId, NamespaceSpec>,
    pub access: HostAccess,
    pub ports: BTreeMap<PortId, PortSpec>,
}

/// An observed namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceState {
    pub device_path: Option<PathBuf>,
    pub uuid: Option<Uuid>,
    pub nguid: Option<Nguid>,
    pub enabled: bool,
    /// `resv_enable` (NVMe reservations, Linux >= 6.13): `None` when the namespace directory has
    /// no such attribute, i.e. the kernel has no reservations (docs/rules.md K21).
    pub resv_enable: Option<bool>,
}

impl NamespaceState {
    /// The identity the namespace shows, when both parts are set (a zero NGUID means unset).
    pub fn identity(&self) -> Option<NamespaceIdentity> {
        match (self.uuid, self.nguid) {
            (Some(uuid), Some(nguid)) if !nguid.is_zero() && !uuid.is_nil() => {
                Some(NamespaceIdentity { uuid, nguid })
            }
            _ => None,
        }
    }

    /// The identity hosts see on this namespace: its UUID and its NGUID, a zero NGUID included.
    /// A namespace enabled without explicit identity shows the kernel's random UUID and an
    /// all-zero NGUID (docs/rules.md K16), and a
    /// connected host keys on exactly that pair, so adopting it keeps the zero. `None` only when
    /// the namespace shows no UUID at all.
    pub fn shown_identity(&self) -> Option<NamespaceIdentity> {
        Some(NamespaceIdentity {
            uuid: self.uuid?,
            nguid: self.nguid.unwrap_or(Nguid::ZERO),
        })
    }
}

/// An observed subsystem.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SubsystemState {
    pub allow_any_host: bool,
    pub serial: String,
    pub allowed_hosts: BTreeSet<String>,
    pub namespaces: BTreeMap<NamespaceId, NamespaceState>,
}

/// An observed port.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PortState {
    pub trtype: String,
    pub adrfam: String,
    pub traddr: String,
    pub trsvcid: String,
    /// `addr_tsas`: `None` when the port has no such attribute (a kernel without TLS for the
    /// NVMe/TCP target, like Debian's 6.1).
    pub tsas: Option<String>,
    /// `addr_treq`.
    pub treq: Option<String>,
    pub subsystems: BTreeSet<String>,
    /// Entries under `referrals/`: a port with referrals is never removed.
    pub referrals: usize,
}

impl PortState {
    /// Whether the port's address attributes equal `spec`.
    pub fn matches(&self, spec: &PortSpec) -> bool {
        let attrs = spec.attributes();
        self.trtype == attrs[0].1
            && self.adrfam == attrs[1].1
            && normalize_addr(&self.traddr) == normalize_addr(&attrs[2].1)
            && self.trsvcid == attrs[3].1
            && self.tls() == spec.tls
    }

    /// Whether the port requires TLS 1.3: a port that speaks it but also takes plain hosts
    /// (`addr_treq` not `required`) does not.
    pub fn tls(&self) -> bool {
        self.tsas.as_deref() == Some(TSAS_TLS13) && self.treq.as_deref() == Some(TREQ_REQUIRED)
    }
}

fn normalize_addr(a: &str) -> String {
    a.parse::<IpAddr>()
        .map_or_else(|_| a.to_owned(), |ip| ip.to_string())
}

/// Everything found under an nvmet configfs root.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TargetState {
    pub subsystems: BTreeMap<String, SubsystemState>,
    pub ports: BTreeMap<PortId, PortState>,
    pub hosts: BTreeSet<String>,
}

impl TargetState {
    /// The subsystem named `nqn`, if present.
    pub fn subsystem(&self, nqn: &SubsystemNqn) -> Option<&SubsystemState> {
        self.subsystems.get(nqn.as_str())
    }

    /// Ports that link `nqn`.
    pub fn ports_linking<'a>(&'a self, nqn: &'a str) -> impl Iterator<Item = PortId> + 'a {
        self.ports
            .iter()
            .filter(move |(_, p)| p.subsystems.contains(nqn))
            .map(|(id, _)| *id)
    }

    /// Whether this kernel has NVMe reservations, probed from the attributes of a namespace
    /// directory (every namespace of one kernel has the same attributes): `None` when the tree
    /// holds no namespace to look at. Never decided from a kernel version (docs/rules.md K21).
    pub fn reservations(&self) -> Option<bool> {
        self.subsystems
            .values()
            .flat_map(|s| s.namespaces.values())
            .next()
            .map(|ns| ns.resv_enable.is_some())
    }

    /// Whether any subsystem other than `except` lists `host` in `allowed_hosts`.
    pub fn host_referenced_elsewhere(&self, host: &str, except: &str) -> bool {
        self.subsystems
            .iter()
            .any(|(name, s)| name != except && s.allowed_hosts.contains(host))
    }
}

/// Why the configfs tree could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    #[error("cannot list {path}")]
    ListDir { path: PathBuf, source: io::Error },
    #[error("cannot read attribute {path}")]
    ReadAttribute { path: PathBuf, source: io::Error },
    #[error("cannot read symlink {path}")]
    ReadLink { path: PathBuf, source: io::Error },
    #[error("symlink {path} points to {target}, outside the expected {expected}/ directory")]
    LinkTarget {
        path: PathBuf,
        target: PathBuf,
        expected: &'static str,
    },
    #[error("attribute {path} holds {value:?}, which is not a valid {what}")]
    BadValue {
        path: PathBuf,
        value: String,
        what: &'static str,
    },
    #[error("unexpected entry {path} in the nvmet tree")]
    UnexpectedEntry { path: PathBuf },
}

/// Reads the whole nvmet tree under `root` (for the kernel: `/sys/kernel/config/nvmet`).
pub fn observe(root: &Path) -> Result<TargetState, ObserveError> {
    let mut state = TargetState::default();
    for name in list_dir(&root.join(HOSTS))? {
        state.hosts.insert(name);
    }
    for name in list_dir(&root.join(SUBSYSTEMS))? {
        let dir = root.join(SUBSYSTEMS).join(&name);
        state
            .subsystems
            .insert(name, observe_subsystem(root, &dir)?);
    }
    for name in list_dir(&root.join(PORTS))? {
        let dir = root.join(PORTS).join(&name);
        let id = PortId::parse(&name)
            .map_err(|_| ObserveError::UnexpectedEntry { path: dir.clone() })?;
        state.ports.insert(id, observe_port(root, &dir)?);
    }
    Ok(state)
}

/// Reads what an operation on the subsystem `nqn` touches, at a cost independent of how many
/// other subsystems the tree holds: the subsystem itself (absent if it does not exist), every
/// port's attributes and referrals with its link to `nqn` and at most one other of its links (a
/// witness that the port is shared), and the names of the host entries.
///
/// The port links are found by their names, as pillar makes them (the link to `nqn` is named
/// `nqn` and its target is checked); a link made by hand under another name shows only as a
/// witness. [`observe`] reads everything.
pub fn observe_scope(root: &Path, nqn: &str) -> Result<TargetState, ObserveError> {
    let mut state = TargetState::default();
    for name in list_dir(&root.join(HOSTS))? {
        state.hosts.insert(name);
    }
    let dir = root.join(SUBSYSTEMS).join(nqn);
    match std::fs::symlink_metadata(&dir) {
        Ok(_) => {
            state
                .subsystems
                .insert(nqn.to_owned(), observe_subsystem(root, &dir)?);
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(ObserveError::ListDir { path: dir, source }),
    }
    for name in list_dir(&root.join(PORTS))? {
        let dir = root.join(PORTS).join(&name);
        let id = PortId::parse(&name)
            .map_err(|_| ObserveError::UnexpectedEntry { path: dir.clone() })?;
        state.ports.insert(id, observe_port_scope(root, &dir, nqn)?);
    }
    Ok(state)
}

fn observe_port_scope(root: &Path, dir: &Path, nqn: &str) -> Result<PortState, ObserveError> {
    let mut port = observe_port_attributes(dir)?;
    let subs_dir = dir.join(SUBSYSTEMS);
    let own = subs_dir.join(nqn);
    match std::fs::symlink_metadata(&own) {
        Ok(_) => {
            port.subsystems
                .insert(link_target_name(root, &own, SUBSYSTEMS)?);
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(ObserveError::ReadLink { path: own, source }),
    }
    // One other link is enough to know the port is shared; stop reading there.
    if let Some(other) =
        first_entry_except(&subs_dir, Some(nqn)).map_err(|source| ObserveError::ListDir {
            path: subs_dir.clone(),
            source,
        })?
    {
        port.subsystems.insert(other);
    }
    Ok(port)
}

/// The first entry of `dir` other than `.`, `..` and `except`, reading a few entries at a time:
/// `std::fs::read_dir` asks for a 32 KiB buffer full, and tmpfs and configfs do work for every
/// entry they return, so its cost grows with the directory. `None` when there is no other entry.
pub fn first_entry_except(dir: &Path, except: Option<&str>) -> io::Result<Option<String>> {
    use rustix::fs::{Mode, OFlags, RawDir};
    let fd = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    // Room for a few entries of the longest names configfs holds (an NQN is at most 223 bytes).
    let mut buf = [std::mem::MaybeUninit::uninit(); 2048];
    let mut entries = RawDir::new(&fd, &mut buf);
    while let Some(entry) = entries.next() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." || except.is_some_and(|e| name == e.as_bytes()) {
            continue;
        }
        return std::str::from_utf8(name)
            .map(|n| Some(n.to_owned()))
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a name that is not UTF-8"));
    }
    Ok(None)
}

fn observe_subsystem(root: &Path, dir: &Path) -> Result<SubsystemState, ObserveError> {
    let allow = read_attr(&dir.join("attr_allow_any_host"))?;
    let mut sub = SubsystemState {
        allow_any_host: parse_bool(&dir.join("attr_allow_any_host"), &allow)?,
        // The kernel pads a short serial with spaces to 20 characters.
        serial: read_attr(&dir.join("attr_serial"))?
            .trim_end_matches(' ')
            .to_owned(),
        ..SubsystemState::default()
    };
    let hosts_dir = dir.join("allowed_hosts");
    for name in list_dir(&hosts_dir)? {
        let link = hosts_dir.join(&name);
        sub.allowed_hosts
            .insert(link_target_name(root, &link, HOSTS)?);
    }
    let ns_dir = dir.join("namespaces");
    for name in list_dir(&ns_dir)? {
        let path = ns_dir.join(&name);
        let nsid = NamespaceId::parse(&name)
            .map_err(|_| ObserveError::UnexpectedEntry { path: path.clone() })?;
        sub.namespaces.insert(nsid, observe_namespace(&path)?);
    }
    Ok(sub)
}

fn observe_namespace(dir: &Path) -> Result<NamespaceState, ObserveError> {
    let device_path = read_attr(&dir.join("device_path"))?;
    let uuid_path = dir.join("device_uuid");
    let uuid = read_attr(&uuid_path)?;
    let nguid_path = dir.join("device_nguid");
    let nguid = read_attr(&nguid_path)?;
    let enable_path = dir.join("enable");
    let enable = read_attr(&enable_path)?;
    let resv_path = dir.join("resv_enable");
    let resv = match std::fs::symlink_metadata(&resv_path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        _ => Some(read_attr(&resv_path)?),
    };
    let bad = |path: &Path, value: &str, what| ObserveError::BadValue {
        path: path.to_owned(),
        value: value.to_owned(),
        what,
    };
    Ok(NamespaceState {
        // An unset device_path reads "(null)" on the kernel (sprintf of a NULL string).
        device_path: (!device_path.is_empty() && device_path != "(null)")
            .then(|| PathBuf::from(device_path)),
        uuid: if uuid.is_empty() {
            None
        } else {
            Some(parse_uuid(&uuid).map_err(|_| bad(&uuid_path, &uuid, "UUID"))?)
        },
        nguid: if nguid.is_empty() {
            None
        } else {
            Some(Nguid::parse(&nguid).map_err(|_| bad(&nguid_path, &nguid, "NGUID"))?)
        },
        enabled: parse_bool(&enable_path, &enable)?,
        resv_enable: resv.map(|v| parse_bool(&resv_path, &v)).transpose()?,
    })
}

fn observe_port(root: &Path, dir: &Path) -> Result<PortState, ObserveError> {
    let mut port = observe_port_attributes(dir)?;
    let subs_dir = dir.join(SUBSYSTEMS);
    for name in list_dir(&subs_dir)? {
        let link = subs_dir.join(&name);
        port.subsystems
            .insert(link_target_name(root, &link, SUBSYSTEMS)?);
    }
    Ok(port)
}

/// A port's address attributes and referral count, without its links.
fn observe_port_attributes(dir: &Path) -> Result<PortState, ObserveError> {
    Ok(PortState {
        trtype: read_attr(&dir.join("addr_trtype"))?,
        adrfam: read_attr(&dir.join("addr_adrfam"))?,
        traddr: read_attr(&dir.join("addr_traddr"))?,
        trsvcid: read_attr(&dir.join("addr_trsvcid"))?,
        tsas: read_optional_attr(&dir.join(ADDR_TSAS))?,
        treq: read_optional_attr(&dir.join(ADDR_TREQ))?,
        subsystems: BTreeSet::new(),
        referrals: list_dir(&dir.join("referrals"))
            .map(|r| r.len())
            .unwrap_or(0),
    })
}

fn list_dir(path: &Path) -> Result<Vec<String>, ObserveError> {
    let list_err = |source| ObserveError::ListDir {
        path: path.to_owned(),
        source,
    };
    let mut names = Vec::new();
    for entry in std::fs::read_dir(path).map_err(list_err)? {
        let entry = entry.map_err(list_err)?;
        let name = entry.file_name();
        let name = name
            .to_str()
            .ok_or_else(|| ObserveError::UnexpectedEntry { path: entry.path() })?;
        names.push(name.to_owned());
    }
    names.sort();
    Ok(names)
}

/// Reads an attribute the kernel may not have: `None` when it does not exist.
pub fn read_optional_attr(path: &Path) -> Result<Option<String>, ObserveError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        _ => read_attr(path).map(Some),
    }
}

/// Reads an attribute, without the trailing newline configfs adds.
pub fn read_attr(path: &Path) -> Result<String, ObserveError> {
    let text = std::fs::read_to_string(path).map_err(|source| ObserveError::ReadAttribute {
        path: path.to_owned(),
        source,
    })?;
    Ok(text.trim_end_matches(['\n', '\0']).to_owned())
}

fn parse_bool(path: &Path, value: &str) -> Result<bool, ObserveError> {
    match value {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(ObserveError::BadValue {
            path: path.to_owned(),
            value: value.to_owned(),
            what: "0/1 flag",
        }),
    }
}

/// Resolves the configfs symlink `link` and returns the name of the entry it points to under
/// `<root>/<expected>/`. `readlink` gives a relative path; resolve it lexically against the
/// link's directory (configfs has no symlinked directories, so this equals the kernel's view).
fn link_target_name(
    root: &Path,
    link: &Path,
    expected: &'static str,
) -> Result<String, ObserveError> {
    let raw = std::fs::read_link(link).map_err(|source| ObserveError::ReadLink {
        path: link.to_owned(),
        source,
    })?;
    let joined = if raw.is_absolute() {
        raw.clone()
    } else {
        link.parent().unwrap_or(Path::new("/")).join(&raw)
    };
    let resolved = normalize(&joined);
    let outside = || ObserveError::LinkTarget {
        path: link.to_owned(),
        target: raw.clone(),
        expected,
    };
    let rel = resolved
        .strip_prefix(normalize(&root.join(expected)))
        .map_err(|_| outside())?;
    let mut parts = rel.components();
    match (parts.next(), parts.next()) {
        (Some(Component::Normal(name)), None) => {
            name.to_str().map(str::to_owned).ok_or_else(outside)
        }
        _ => Err(outside()),
    }
}

/// Lexical normalisation: drops `.` and folds `..` (no filesystem access).
pub fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}
