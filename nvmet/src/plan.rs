//! The planner: turns the difference between desired and observed state into an ordered list of
//! primitive configfs operations.
//!
//! A plan is data (paths relative to the nvmet root), so an executor can run it synchronously or
//! submit it to io_uring in batches. Every plan obeys the kernel's rules (`docs/rules.md` K2-K16):
//! - identity (`attr_serial`, `device_uuid`, `device_nguid`) and `device_path` are written before
//!   a namespace is enabled, and before the subsystem is first linked to a port;
//! - the identity of an enabled namespace and the serial of a subsystem a host may have
//!   identified (any but one exactly as its mkdir left it: `serial_may_be_frozen`) are never
//!   rewritten: a live export with other identity is adopted, and the plan says so;
//! - port attributes are written only on a port the plan creates (ports are shared);
//! - ACL mode changes in the legal order: `allow_any_host=0` before linking hosts, hosts unlinked
//!   before `allow_any_host=1`;
//! - removal runs in reverse: unlink from ports, disable and remove namespaces, unlink hosts,
//!   remove the subsystem, then hosts no subsystem references and ports left empty;
//! - a namespace grows through `revalidate_size`, never disable/enable;
//! - a namespace is enabled only while its subsystem admits a host (W7): enabled before the
//!   first host is linked, disabled after the last is unlinked. The kernel keeps the identity
//!   and device of a disabled namespace, and returns from `enable=0` only once no command is in
//!   flight on it, so a revoke that leaves nobody admitted is drained. A disabled namespace
//!   shows no host its identity, so only the caller knows whether an identity it holds was
//!   adopted: after an adoption, plan with [`ExportPlan::effective`] (the agent records it).
//! - `resv_enable=1` is written before `enable` where the namespace directory has the attribute
//!   (probed, never guessed from a kernel version), never on an enabled namespace (W9, K6).
//!
//! Only subsystems with pillar's NQN prefix are ever planned for.
//!
//! `export` holds the plan of one export ([`plan_export`]), step by step; this file the
//! operations, the ACL, link, cut, unexport, revalidate and release plans, and the steps
//! they share with it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::identity::NamespaceIdentity;
use crate::model::{
    ExportSpec, HOSTS, HostAccess, PORTS, PortSpec, PortState, SUBSYSTEMS, TargetState,
};
use crate::names::{NamespaceId, PortId, SubsystemNqn};

mod export;

pub use export::plan_export;

/// One primitive configfs operation. Paths are relative to the nvmet root. `Debug` and
/// `Display` show no secret: a write to a host entry's key attribute prints `<redacted>`.
#[derive(Clone, PartialEq, Eq)]
pub enum Op {
    Mkdir {
        path: PathBuf,
    },
    /// Write `value` to an existing attribute file (no create, no truncate: configfs semantics).
    Write {
        path: PathBuf,
        value: String,
    },
    /// Create `link` pointing at the item `target`.
    Symlink {
        target: PathBuf,
        link: PathBuf,
    },
    Unlink {
        path: PathBuf,
    },
    Rmdir {
        path: PathBuf,
    },
}

impl Op {
    /// The path the operation acts on.
    pub fn path(&self) -> &Path {
        match self {
            Self::Mkdir { path }
            | Self::Write { path, .. }
            | Self::Unlink { path }
            | Self::Rmdir { path } => path,
            Self::Symlink { link, .. } => link,
        }
    }
}

impl fmt::Debug for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Mkdir { path } => f.debug_struct("Mkdir").field("path", path).finish(),
            Self::Write { path, value } => {
                let mut d = f.debug_struct("Write");
                d.field("path", path);
                if crate::model::is_secret_attribute(path) && !value.is_empty() {
                    d.field("value", &format_args!("<redacted>"));
                } else {
                    d.field("value", value);
                }
                d.finish()
            }
            Self::Symlink { target, link } => f
                .debug_struct("Symlink")
                .field("target", target)
                .field("link", link)
                .finish(),
            Self::Unlink { path } => f.debug_struct("Unlink").field("path", path).finish(),
            Self::Rmdir { path } => f.debug_struct("Rmdir").field("path", path).finish(),
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Mkdir { path } => write!(f, "mkdir {}", path.display()),
            Self::Write { path, value }
                if crate::model::is_secret_attribute(path) && !value.is_empty() =>
            {
                write!(f, "write {}=<redacted>", path.display())
            }
            Self::Write { path, value } => write!(f, "write {}={value:?}", path.display()),
            Self::Symlink { target, link } => {
                write!(f, "symlink {} -> {}", link.display(), target.display())
            }
            Self::Unlink { path } => write!(f, "unlink {}", path.display()),
            Self::Rmdir { path } => write!(f, "rmdir {}", path.display()),
        }
    }
}

/// A live identity the planner kept instead of the desired one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// An enabled namespace shows another UUID/NGUID: kept (hosts cached it).
    Namespace {
        nsid: NamespaceId,
        live: NamespaceIdentity,
        desired: NamespaceIdentity,
    },
    /// A subsystem a host may have identified shows another serial: kept (the kernel refuses a
    /// new one after Identify).
    Serial { live: String, desired: String },
}

/// The plan for one export, with what it adopted and the state it converges to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportPlan {
    pub ops: Vec<Op>,
    pub adoptions: Vec<Adoption>,
    /// The desired state with adopted identities substituted: what the read-back must find.
    pub effective: ExportSpec,
    /// Set when the plan creates a namespace while the observed tree holds no namespace to probe
    /// for `resv_enable`: apply `ops[..=i]` (up to the first namespace `mkdir`), observe again and
    /// plan again, so the new namespace's attributes show whether the kernel has reservations
    /// before it is enabled (W9). An executor that applies the whole plan instead gets a correct
    /// export without reservations.
    pub replan_after: Option<usize>,
    /// Enabled namespaces that have `resv_enable` off: they keep running without reservations,
    /// since the attribute cannot be written on an enabled namespace (K6); the caller logs it.
    pub live_without_reservations: Vec<NamespaceId>,
}

/// Why no safe plan exists.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("subsystem {nqn} was not created by pillar; refusing to change it")]
    ForeignSubsystem { nqn: String },
    #[error(
        "namespace {nsid} of {nqn} is enabled on device {live}, not {desired}; changing the device \
         of a live namespace would swap data under connected hosts"
    )]
    LiveDeviceConflict {
        nqn: String,
        nsid: NamespaceId,
        live: String,
        desired: String,
    },
    #[error(
        "port {port} exists as {found}, not {wanted}; ports are shared and their address is \
         never rewritten"
    )]
    PortConflict {
        port: PortId,
        found: String,
        wanted: String,
    },
    #[error("namespace {nsid} of {nqn} is not enabled; it cannot be resized")]
    NotEnabled { nqn: String, nsid: NamespaceId },
    #[error("subsystem {nqn} has no namespace {nsid}")]
    NoNamespace { nqn: String, nsid: NamespaceId },
    #[error("subsystem {nqn} does not exist")]
    NoSubsystem { nqn: String },
    #[error(
        "namespace {nsid} of {nqn} is disabled without a device or without the expected \
         identity; it is not enabled for a host (an export repairs it)"
    )]
    NamespaceNotReady { nqn: String, nsid: NamespaceId },
}

fn subsys_dir(nqn: &str) -> PathBuf {
    Path::new(SUBSYSTEMS).join(nqn)
}

fn ns_dir(nqn: &str, nsid: NamespaceId) -> PathBuf {
    subsys_dir(nqn).join("namespaces").join(nsid.to_string())
}

fn port_dir(port: PortId) -> PathBuf {
    Path::new(PORTS).join(port.to_string())
}

fn write(path: PathBuf, value: impl Into<String>) -> Op {
    Op::Write {
        path,
        value: value.into(),
    }
}

fn describe_port(p: &PortState) -> String {
    let tls = if p.tls() { " tls1.3" } else { "" };
    format!("{}/{} {}:{}{tls}", p.trtype, p.adrfam, p.traddr, p.trsvcid)
}

/// Links `nqn` to `port` unless `linked` holds it; with `want`, creates the port with its
/// attributes when it is gone, and refuses one that exists with another address (ports are
/// shared: their attributes are written only on a port the plan creates).
fn push_port_link(
    observed: &TargetState,
    nqn: &str,
    port: PortId,
    want: Option<&PortSpec>,
    linked: &BTreeSet<PortId>,
    ops: &mut Vec<Op>,
) -> Result<(), PlanError> {
    let pdir = port_dir(port);
    match (observed.ports.get(&port), want) {
        (Some(found), Some(want)) if !found.matches(want) => {
            return Err(PlanError::PortConflict {
                port,
                found: describe_port(found),
                wanted: want.describe(),
            });
        }
        (None, Some(want)) => {
            ops.push(Op::Mkdir { path: pdir.clone() });
            for (attr, value) in want.attributes() {
                ops.push(write(pdir.join(attr), value));
            }
        }
        _ => {}
    }
    if !linked.contains(&port) {
        ops.push(Op::Symlink {
            target: subsys_dir(nqn),
            link: pdir.join(SUBSYSTEMS).join(nqn),
        });
    }
    Ok(())
}

/// Plans the links of the live subsystem `nqn` to each port of `ports` it is not linked to,
/// creating a port that is gone: what a grant makes sure of, so an export a failed cut left on
/// no port is reachable again. Links to other ports are left alone. Empty when the subsystem
/// does not exist (only an export creates it).
pub fn plan_links(
    observed: &TargetState,
    nqn: &SubsystemNqn,
    ports: &BTreeMap<PortId, PortSpec>,
) -> Result<Vec<Op>, PlanError> {
    let name = nqn.as_str();
    if observed.subsystem(nqn).is_none() {
        return Ok(Vec::new());
    }
    let linked: BTreeSet<PortId> = observed.ports_linking(name).collect();
    let mut ops = Vec::new();
    for (port, want) in ports {
        push_port_link(observed, name, *port, Some(want), &linked, &mut ops)?;
    }
    Ok(ops)
}

/// Plans a change of the ACL of the live subsystem `nqn` to `access`.
///
/// The operations touch the subsystem's `attr_allow_any_host` and `allowed_hosts/`, host
/// entries under `hosts/`, and the `enable` of its namespaces: when the change admits a host
/// and nobody was, each disabled namespace is enabled first (so the host finds it at connect);
/// when it leaves nobody admitted, each enabled namespace is disabled last (W7: the kernel
/// returns from that write only once no command is in flight on it, and takes no new one); a
/// namespace it enables gets `resv_enable=1` first where the kernel has it off (W9).
/// Identity, device, serial and ports are never written: whatever they hold (a kernel-random
/// identity, a zero NGUID, a port pillar did not expect) stays. A disabled namespace is enabled
/// only when it has a device and shows exactly the identity `expected` names for it; otherwise
/// the plan is refused (an export repairs it).
pub fn plan_acl(
    observed: &TargetState,
    nqn: &SubsystemNqn,
    access: &HostAccess,
    expected: &BTreeMap<NamespaceId, NamespaceIdentity>,
) -> Result<Vec<Op>, PlanError> {
    if !nqn.is_pillar() {
        return Err(PlanError::ForeignSubsystem {
            nqn: nqn.to_string(),
        });
    }
    let current = observed
        .subsystem(nqn)
        .ok_or_else(|| PlanError::NoSubsystem {
            nqn: nqn.to_string(),
        })?;
    let name = nqn.as_str();
    let admitted = access.admits_a_host();
    let mut ops = Vec::new();
    for (nsid, ns) in &current.namespaces {
        if admitted && !ns.enabled {
            let shown = ns.shown_identity();
            if ns.device_path.is_none() || shown.is_none() || shown != expected.get(nsid).copied() {
                return Err(PlanError::NamespaceNotReady {
                    nqn: name.to_owned(),
                    nsid: *nsid,
                });
            }
            // W9: reservations on before enable, where the kernel has them and they are off.
            if ns.resv_enable == Some(false) {
                ops.push(write(ns_dir(name, *nsid).join("resv_enable"), "1"));
            }
            ops.push(write(ns_dir(name, *nsid).join("enable"), "1"));
        }
    }
    ops.extend(plan_access(
        observed,
        name,
        current.allow_any_host,
        &current.allowed_hosts,
        access,
    ));
    push_host_cleanup(observed, name, &current.allowed_hosts, access, &mut ops);
    if !admitted {
        ops.extend(
            current
                .namespaces
                .iter()
                .filter(|(_, ns)| ns.enabled)
                .map(|(nsid, _)| write(ns_dir(name, *nsid).join("enable"), "0")),
        );
    }
    Ok(ops)
}

/// Removes the host entries that `nqn` stops referencing and no other subsystem references.
fn push_host_cleanup(
    observed: &TargetState,
    nqn: &str,
    linked: &BTreeSet<String>,
    access: &HostAccess,
    ops: &mut Vec<Op>,
) {
    for host in linked {
        let still_wanted =
            matches!(access, HostAccess::Only(h) if h.iter().any(|x| x.as_str() == host));
        if !still_wanted && !observed.host_referenced_elsewhere(host, nqn) {
            ops.push(Op::Rmdir {
                path: Path::new(HOSTS).join(host),
            });
        }
    }
}

fn plan_access(
    observed: &TargetState,
    nqn: &str,
    allow_any: bool,
    linked: &BTreeSet<String>,
    want: &HostAccess,
) -> Vec<Op> {
    let sdir = subsys_dir(nqn);
    let mut ops = Vec::new();
    match want {
        HostAccess::AnyHost => {
            for host in linked {
                ops.push(Op::Unlink {
                    path: sdir.join("allowed_hosts").join(host),
                });
            }
            if !allow_any {
                ops.push(write(sdir.join("attr_allow_any_host"), "1"));
            }
        }
        HostAccess::Only(hosts) => {
            if allow_any {
                ops.push(write(sdir.join("attr_allow_any_host"), "0"));
            }
            for host in hosts.iter().map(|h| h.as_str()) {
                if linked.contains(host) {
                    continue;
                }
                let hdir = Path::new(HOSTS).join(host);
                if !observed.hosts.contains(host) {
                    ops.push(Op::Mkdir { path: hdir.clone() });
                }
                ops.push(Op::Symlink {
                    target: hdir,
                    link: sdir.join("allowed_hosts").join(host),
                });
            }
            for host in linked {
                if !hosts.iter().any(|h| h.as_str() == host) {
                    ops.push(Op::Unlink {
                        path: sdir.join("allowed_hosts").join(host),
                    });
                }
            }
        }
    }
    ops
}

/// Removes the port after `nqn` is unlinked from it, if nothing else uses it.
fn push_port_cleanup(observed: &TargetState, port: PortId, nqn: &str, ops: &mut Vec<Op>) {
    if let Some(p) = observed.ports.get(&port) {
        let others = p.subsystems.iter().any(|s| s != nqn);
        if !others && p.referrals == 0 {
            ops.push(Op::Rmdir {
                path: port_dir(port),
            });
        }
    }
}

/// Plans the complete removal of subsystem `nqn`, in reverse order of creation. Empty when the
/// subsystem is already gone.
pub fn plan_unexport(observed: &TargetState, nqn: &SubsystemNqn) -> Result<Vec<Op>, PlanError> {
    if !nqn.is_pillar() {
        return Err(PlanError::ForeignSubsystem {
            nqn: nqn.to_string(),
        });
    }
    let name = nqn.as_str();
    let mut ops = Vec::new();
    let ports: Vec<PortId> = observed.ports_linking(name).collect();
    for port in &ports {
        ops.push(Op::Unlink {
            path: port_dir(*port).join(SUBSYSTEMS).join(name),
        });
    }
    let Some(current) = observed.subsystem(nqn) else {
        for port in &ports {
            push_port_cleanup(observed, *port, name, &mut ops);
        }
        return Ok(ops);
    };
    let sdir = subsys_dir(name);
    for (nsid, ns) in &current.namespaces {
        let dir = ns_dir(name, *nsid);
        if ns.enabled {
            ops.push(write(dir.join("enable"), "0"));
        }
        ops.push(Op::Rmdir { path: dir });
    }
    for host in &current.allowed_hosts {
        ops.push(Op::Unlink {
            path: sdir.join("allowed_hosts").join(host),
        });
    }
    ops.push(Op::Rmdir { path: sdir });
    for host in &current.allowed_hosts {
        if !observed.host_referenced_elsewhere(host, name) {
            ops.push(Op::Rmdir {
                path: Path::new(HOSTS).join(host),
            });
        }
    }
    for port in &ports {
        push_port_cleanup(observed, *port, name, &mut ops);
    }
    Ok(ops)
}

/// Plans the growth of a live namespace after its device grew: one `revalidate_size` write.
pub fn plan_revalidate(
    observed: &TargetState,
    nqn: &SubsystemNqn,
    nsid: NamespaceId,
) -> Result<Vec<Op>, PlanError> {
    let sub = observed
        .subsystem(nqn)
        .ok_or_else(|| PlanError::NoSubsystem {
            nqn: nqn.to_string(),
        })?;
    let ns = sub
        .namespaces
        .get(&nsid)
        .ok_or_else(|| PlanError::NoNamespace {
            nqn: nqn.to_string(),
            nsid,
        })?;
    if !ns.enabled {
        return Err(PlanError::NotEnabled {
            nqn: nqn.to_string(),
            nsid,
        });
    }
    Ok(vec![write(
        ns_dir(nqn.as_str(), nsid).join("revalidate_size"),
        "1",
    )])
}

/// Plans a cut of every live connection to `nqn`: unlink it from each port it is linked to, then
/// link it back to those ports and to each port of `ports` (the ports its export belongs on),
/// creating one that is gone. Unlinking deletes the subsystem's controllers on that port; hosts
/// still allowed reconnect by themselves, hosts no longer allowed are refused (removing a host
/// from `allowed_hosts` alone leaves its live controllers working). Planning the links back
/// from `ports`, not only from the links seen now, makes a retry after a cut that failed between
/// its unlink and its link finish the cut instead of leaving the export on no port. Empty when
/// the subsystem does not exist.
pub fn plan_cut_connections(
    observed: &TargetState,
    nqn: &SubsystemNqn,
    ports: &BTreeMap<PortId, PortSpec>,
) -> Result<Vec<Op>, PlanError> {
    let name = nqn.as_str();
    if observed.subsystem(nqn).is_none() {
        return Ok(Vec::new());
    }
    let linked: BTreeSet<PortId> = observed.ports_linking(name).collect();
    let mut ops: Vec<Op> = linked
        .iter()
        .map(|p| Op::Unlink {
            path: port_dir(*p).join(SUBSYSTEMS).join(name),
        })
        .collect();
    let back: BTreeSet<PortId> = linked.iter().chain(ports.keys()).copied().collect();
    for port in back {
        push_port_link(
            observed,
            name,
            port,
            ports.get(&port),
            &BTreeSet::new(),
            &mut ops,
        )?;
    }
    Ok(ops)
}

/// The shared entries a plan lets go of: ports it unlinks the subsystem from and does not link it
/// back to, host entries it unlinks from the subsystem's `allowed_hosts` and does not link back,
/// each unless the plan removes it itself. A plan made while other subsystems change beside it
/// may keep such an entry because another subsystem still used it when it looked; whoever lets
/// go of it last must remove it ([`plan_release`], planned again once nothing else changes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Released {
    pub ports: BTreeSet<PortId>,
    pub hosts: BTreeSet<String>,
}

impl Released {
    /// What `ops`, a plan for `nqn`, lets go of.
    pub fn by(ops: &[Op], nqn: &SubsystemNqn) -> Self {
        let mut out = Self::default();
        for op in ops {
            let parts: Vec<&str> = op.path().iter().filter_map(|c| c.to_str()).collect();
            let port = |p: &str| PortId::parse(p).ok();
            match (op, parts.as_slice()) {
                (Op::Unlink { .. }, [PORTS, p, SUBSYSTEMS, s]) if *s == nqn.as_str() => {
                    out.ports.extend(port(p));
                }
                (Op::Symlink { .. }, [PORTS, p, SUBSYSTEMS, s]) if *s == nqn.as_str() => {
                    if let Some(p) = port(p) {
                        out.ports.remove(&p);
                    }
                }
                (Op::Rmdir { .. }, [PORTS, p]) => {
                    if let Some(p) = port(p) {
                        out.ports.remove(&p);
                    }
                }
                (Op::Unlink { .. }, [SUBSYSTEMS, s, "allowed_hosts", h]) if *s == nqn.as_str() => {
                    out.hosts.insert((*h).to_owned());
                }
                (Op::Symlink { .. }, [SUBSYSTEMS, s, "allowed_hosts", h]) if *s == nqn.as_str() => {
                    out.hosts.remove(*h);
                }
                (Op::Rmdir { .. }, [HOSTS, h]) => {
                    out.hosts.remove(*h);
                }
                _ => {}
            }
        }
        out
    }

    /// Whether nothing was let go of.
    pub fn is_empty(&self) -> bool {
        self.ports.is_empty() && self.hosts.is_empty()
    }
}

/// Removes the entries of `released` that nothing uses in `observed`: a port no subsystem is
/// linked to and with no referral, a host entry no subsystem's `allowed_hosts` links. Plan it
/// while no other change runs, from a state that shows every subsystem linking a released host
/// (the agent's exclusive target lock and `TargetModel::view_with_hosts`).
pub fn plan_release(observed: &TargetState, released: &Released) -> Vec<Op> {
    let mut ops = Vec::new();
    for port in &released.ports {
        if let Some(p) = observed.ports.get(port)
            && p.subsystems.is_empty()
            && p.referrals == 0
        {
            ops.push(Op::Rmdir {
                path: port_dir(*port),
            });
        }
    }
    for host in &released.hosts {
        let used = observed
            .subsystems
            .values()
            .any(|s| s.allowed_hosts.contains(host));
        if observed.hosts.contains(host) && !used {
            ops.push(Op::Rmdir {
                path: Path::new(HOSTS).join(host),
            });
        }
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nqn() -> SubsystemNqn {
        crate::VolumeId::parse("v1").unwrap().subsystem_nqn()
    }

    #[test]
    fn released_is_what_a_plan_unlinks_and_neither_links_back_nor_removes() {
        let n = nqn();
        let link = |port: &str| PathBuf::from(format!("ports/{port}/subsystems/{n}"));
        let host = |h: &str| PathBuf::from(format!("subsystems/{n}/allowed_hosts/{h}"));
        let ops = vec![
            // A cut: unlinked and linked back, nothing let go of.
            Op::Unlink { path: link("1") },
            Op::Symlink {
                target: subsys_dir(n.as_str()),
                link: link("1"),
            },
            // Unlinked and removed by the plan itself.
            Op::Unlink { path: link("2") },
            Op::Rmdir {
                path: "ports/2".into(),
            },
            Op::Unlink { path: link("3") },
            Op::Unlink { path: host("h1") },
            Op::Unlink { path: host("h2") },
            Op::Rmdir {
                path: "hosts/h2".into(),
            },
            // Another subsystem's link is not this plan's.
            Op::Unlink {
                path: "ports/4/subsystems/other".into(),
            },
        ];
        let released = Released::by(&ops, &n);
        assert_eq!(released.ports, [PortId::new(3)].into_iter().collect());
        assert_eq!(released.hosts, ["h1".to_owned()].into_iter().collect());
        assert!(Released::by(&ops[..2], &n).is_empty());
    }
}
