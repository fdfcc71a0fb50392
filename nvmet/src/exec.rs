//! Running plans and checking what the kernel holds afterwards.
//!
//! [`KernelExecutor`] is the plain synchronous executor: one syscall per operation, in plan
//! order, stopping at the first failure. The agent's io_uring engine runs the same plans in
//! batches. [`verify`] reads back and compares with the effective desired state; any difference
//! is an error, never a warning.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use crate::model::{ExportSpec, HostAccess, PortSpec, SubsystemState, TargetState};
use crate::names::{PortId, SubsystemNqn};
use crate::plan::Op;

/// Something that can perform one configfs operation.
pub trait Executor {
    /// Performs `op`; `op`'s paths are relative to the executor's nvmet root.
    fn execute(&mut self, op: &Op) -> io::Result<()>;
}

/// A plan step that failed; the steps before it were applied, the ones after were not.
#[derive(Debug, thiserror::Error)]
#[error("configfs step {index} ({op}) failed")]
pub struct ApplyError {
    pub index: usize,
    pub op: Op,
    #[source]
    pub source: io::Error,
}

/// Runs `ops` in order through `exec`, stopping at the first failure.
pub fn apply(exec: &mut dyn Executor, ops: &[Op]) -> Result<(), ApplyError> {
    for (index, op) in ops.iter().enumerate() {
        tracing::debug!(%op, "configfs");
        exec.execute(op).map_err(|source| ApplyError {
            index,
            op: op.clone(),
            source,
        })?;
    }
    Ok(())
}

/// Executes operations with plain syscalls against a real configfs root.
#[derive(Debug, Clone)]
pub struct KernelExecutor {
    root: PathBuf,
}

impl KernelExecutor {
    /// An executor for the nvmet tree at `root` (normally `/sys/kernel/config/nvmet`).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The nvmet root this executor works on.
    pub fn root(&self) -> &Path {
        &self.root
    }
}

/// Writes `value` to an existing configfs attribute in exactly one `write(2)`: configfs treats
/// each write as one store, so a split write would store a truncated value.
pub fn write_attribute(path: &Path, value: &str) -> io::Result<()> {
    let mut file = OpenOptions::new().write(true).open(path)?;
    let written = file.write(value.as_bytes())?;
    if written != value.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!(
                "short write to {}: {written} of {} bytes",
                path.display(),
                value.len()
            ),
        ));
    }
    Ok(())
}

impl Executor for KernelExecutor {
    fn execute(&mut self, op: &Op) -> io::Result<()> {
        let at = |p: &Path| self.root.join(p);
        match op {
            Op::Mkdir { path } => std::fs::create_dir(at(path)),
            Op::Write { path, value } => write_attribute(&at(path), value),
            Op::Symlink { target, link } => std::os::unix::fs::symlink(at(target), at(link)),
            Op::Unlink { path } => std::fs::remove_file(at(path)),
            Op::Rmdir { path } => std::fs::remove_dir(at(path)),
        }
    }
}

/// One difference between what the kernel holds and what was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    pub what: String,
    pub expected: String,
    pub found: String,
}

/// The read-back found differences.
#[derive(Debug, thiserror::Error)]
#[error("read-back of {nqn} differs from the request: {}", describe(.mismatches))]
pub struct VerifyError {
    pub nqn: String,
    pub mismatches: Vec<Mismatch>,
}

fn describe(m: &[Mismatch]) -> String {
    m.iter()
        .map(|m| format!("{}: expected {}, found {}", m.what, m.expected, m.found))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Compares the observed tree with `spec` (the effective state of an [`crate::ExportPlan`]):
/// serial, ACL, each namespace's device path, identity and enable (enabled exactly while the
/// ACL admits a host), and each port link.
pub fn verify(observed: &TargetState, spec: &ExportSpec) -> Result<(), VerifyError> {
    let nqn = spec.nqn.as_str();
    let mut out = Vec::new();
    let mut diff = |what: String, expected: String, found: String| {
        if expected != found {
            out.push(Mismatch {
                what,
                expected,
                found,
            });
        }
    };
    let Some(sub) = observed.subsystem(&spec.nqn) else {
        return Err(VerifyError {
            nqn: nqn.to_owned(),
            mismatches: vec![Mismatch {
                what: "subsystem".into(),
                expected: "present".into(),
                found: "absent".into(),
            }],
        });
    };
    diff(
        "attr_serial".into(),
        spec.serial.to_string(),
        sub.serial.clone(),
    );
    diff_access(sub, &spec.access, &mut diff);
    diff_namespaces(sub, spec, &mut diff);
    diff_ports(observed, nqn, &spec.ports, &mut diff);
    let stray: Vec<String> = observed
        .ports_linking(nqn)
        .filter(|p| !spec.ports.contains_key(p))
        .map(|p| p.to_string())
        .collect();
    diff(
        "links on other ports".into(),
        String::new(),
        stray.join(","),
    );
    if out.is_empty() {
        Ok(())
    } else {
        Err(VerifyError {
            nqn: nqn.to_owned(),
            mismatches: out,
        })
    }
}

/// Compares only the ACL of `nqn` with `access`: what an ACL change must leave behind.
pub fn verify_acl(
    observed: &TargetState,
    nqn: &SubsystemNqn,
    access: &HostAccess,
) -> Result<(), VerifyError> {
    let mut out = Vec::new();
    match observed.subsystem(nqn) {
        None => out.push(Mismatch {
            what: "subsystem".into(),
            expected: "present".into(),
            found: "absent".into(),
        }),
        Some(sub) => diff_access(sub, access, &mut |what, expected, found| {
            if expected != found {
                out.push(Mismatch {
                    what,
                    expected,
                    found,
                });
            }
        }),
    }
    if out.is_empty() {
        Ok(())
    } else {
        Err(VerifyError {
            nqn: nqn.to_string(),
            mismatches: out,
        })
    }
}

/// Compares only the port links of `nqn` with `ports`: each port present with its address and
/// linking the subsystem (links on other ports are not checked). What a grant or a cut must
/// leave behind.
pub fn verify_links(
    observed: &TargetState,
    nqn: &SubsystemNqn,
    ports: &BTreeMap<PortId, PortSpec>,
) -> Result<(), VerifyError> {
    let mut out = Vec::new();
    diff_ports(
        observed,
        nqn.as_str(),
        ports,
        &mut |what, expected, found| {
            if expected != found {
                out.push(Mismatch {
                    what,
                    expected,
                    found,
                });
            }
        },
    );
    if out.is_empty() {
        Ok(())
    } else {
        Err(VerifyError {
            nqn: nqn.to_string(),
            mismatches: out,
        })
    }
}

/// Each namespace of `spec` against `sub`: present, device path, identity, and enabled exactly
/// while the ACL admits a host; and no namespace `spec` does not name.
fn diff_namespaces(
    sub: &SubsystemState,
    spec: &ExportSpec,
    diff: &mut dyn FnMut(String, String, String),
) {
    for (nsid, want) in &spec.namespaces {
        let Some(ns) = sub.namespaces.get(nsid) else {
            diff(
                format!("namespace {nsid}"),
                "present".into(),
                "absent".into(),
            );
            continue;
        };
        let show = |o: Option<String>| o.unwrap_or_else(|| "unset".into());
        diff(
            format!("namespace {nsid} device_path"),
            want.device_path.display().to_string(),
            show(ns.device_path.as_ref().map(|p| p.display().to_string())),
        );
        diff(
            format!("namespace {nsid} device_uuid"),
            want.identity.uuid.to_string(),
            show(ns.uuid.map(|u| u.to_string())),
        );
        diff(
            format!("namespace {nsid} device_nguid"),
            want.identity.nguid.to_string(),
            show(ns.nguid.map(|u| u.to_string())),
        );
        diff(
            format!("namespace {nsid} enable"),
            u8::from(spec.access.admits_a_host()).to_string(),
            u8::from(ns.enabled).to_string(),
        );
    }
    let extra: Vec<String> = sub
        .namespaces
        .keys()
        .filter(|n| !spec.namespaces.contains_key(n))
        .map(ToString::to_string)
        .collect();
    diff("extra namespaces".into(), String::new(), extra.join(","));
}

fn diff_ports(
    observed: &TargetState,
    nqn: &str,
    ports: &BTreeMap<PortId, PortSpec>,
    diff: &mut dyn FnMut(String, String, String),
) {
    for (port, want) in ports {
        match observed.ports.get(port) {
            None => diff(format!("port {port}"), "present".into(), "absent".into()),
            Some(p) => {
                diff(
                    format!("port {port} address"),
                    "matching".into(),
                    if p.matches(want) {
                        "matching"
                    } else {
                        "different"
                    }
                    .into(),
                );
                diff(
                    format!("port {port} link"),
                    "linked".into(),
                    if p.subsystems.contains(nqn) {
                        "linked"
                    } else {
                        "unlinked"
                    }
                    .into(),
                );
            }
        }
    }
}

fn diff_access(
    sub: &SubsystemState,
    access: &HostAccess,
    diff: &mut dyn FnMut(String, String, String),
) {
    match access {
        HostAccess::AnyHost => {
            diff(
                "attr_allow_any_host".into(),
                "1".into(),
                u8::from(sub.allow_any_host).to_string(),
            );
            diff(
                "allowed_hosts".into(),
                String::new(),
                join(sub.allowed_hosts.iter().map(String::as_str)),
            );
        }
        HostAccess::Only(hosts) => {
            diff(
                "attr_allow_any_host".into(),
                "0".into(),
                u8::from(sub.allow_any_host).to_string(),
            );
            diff(
                "allowed_hosts".into(),
                join(hosts.iter().map(|h| h.as_str())),
                join(sub.allowed_hosts.iter().map(String::as_str)),
            );
        }
    }
}

fn join<'a>(items: impl Iterator<Item = &'a str>) -> String {
    items.collect::<Vec<_>>().join(",")
}
