//! The nine safety invariants, checked after every step of a seed and once more after the
//! final drain (when every message still in flight has landed or died).
//!
//! 1. At the target at most one host is admitted to a single-writer volume (and never any host,
//!    `allow_any_host`, under `acl: true`).
//! 2. No agent applies a change with a generation below its mark: a volume's (or snapshot's)
//!    mark never moves back within one lifecycle.
//! 3. A volume (or snapshot) deleted and re-created under one name is never touched by the old
//!    lifecycle: once a mark moved on from a UID, that UID never owns it again.
//! 4. A publication record is removed only after its revoke is confirmed: every host admitted at
//!    a target has a publication record (possibly being revoked) of that volume, on that agent.
//! 5. A published volume is never deleted: once a lifecycle's backend volume existed, it exists
//!    as long as that lifecycle has a publication record.
//! 6. Two hosts never write one volume (N5): at most one host is live on a volume (staged and
//!    holding a controller at its target, `crate::host`) with a read-write stage.
//! 7. A host is live on a volume only while the volume's publication record names it (node and
//!    host NQN, on that agent, possibly being revoked): no stage on a host the record does not
//!    name can reach the data.
//! 8. An acknowledged expansion is never lost: once ControllerExpandVolume answered a size for a
//!    lifecycle, that lifecycle's record and its backend volume are at least that large for as
//!    long as the lifecycle lives (and is not being deleted).
//! 9. An acknowledged node expansion is never lost, and never more than the device holds: once
//!    NodeExpandVolume answered a capacity for a lifecycle staged on a host, the filesystem on
//!    that lifecycle's disk holds at least that many bytes for as long as that stage stands
//!    (the same mount at the staging path), across agent crashes and power losses; and the
//!    capacity answered was no more than the target's namespace held at the answer.
//!
//! Invariant 1 allows several hosts at the target only when every publication naming them is
//! read-only (ROX, or readonly): a read-only publication is shared.
//!
//! Marks are read from the agents' state directories, the ACLs from the configfs doubles, the
//! backends from the pool directories and the records from the shared store, all without an
//! await in between, so the snapshot is consistent.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

use pillar_nvmet::{SubsystemNqn, VolumeId};
use pillar_state::crd::{AccessMode, PillarVolumeState, PublishedNode};

use crate::host::{SharedHost, Targets};
use crate::node::SimAgent;

mod hosts;

/// Which invariant broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Invariant {
    OneWriterAtTarget = 1,
    MarkNeverMovesBack = 2,
    OldLifecycleNeverTouchesNew = 3,
    RecordOutlivesAccess = 4,
    PublishedNeverDeleted = 5,
    OneWriterAtHosts = 6,
    StageNamedByRecord = 7,
    ExpansionKept = 8,
    NodeExpansionKept = 9,
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            Self::OneWriterAtTarget => "1 (at most one host admitted to a single-writer volume)",
            Self::MarkNeverMovesBack => "2 (no change below the mark's generation)",
            Self::OldLifecycleNeverTouchesNew => "3 (an old lifecycle never touches a new one)",
            Self::RecordOutlivesAccess => {
                "4 (a record is removed only after its revoke is confirmed)"
            }
            Self::PublishedNeverDeleted => "5 (a published volume is never deleted)",
            Self::OneWriterAtHosts => "6 (two hosts never write one volume, N5)",
            Self::StageNamedByRecord => {
                "7 (a host reaches a volume only while its record names the host)"
            }
            Self::ExpansionKept => "8 (an acknowledged expansion is never lost)",
            Self::NodeExpansionKept => {
                "9 (an acknowledged node expansion is never lost, nor more than the device holds)"
            }
        };
        f.write_str(text)
    }
}

/// A broken invariant and what showed it.
#[derive(Clone, Debug)]
pub struct Violation {
    pub invariant: Invariant,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invariant {}: {}", self.invariant, self.detail)
    }
}

/// What the checker remembers between checks.
#[derive(Debug, Default)]
pub struct Checker {
    /// Last mark seen per (agent, volume): owner UID and generation.
    marks: BTreeMap<(String, String), (String, u64)>,
    /// UIDs a mark moved on from, per (agent, volume).
    superseded: BTreeMap<(String, String), BTreeSet<String>>,
    /// Mark files as last read: (agent, directory, file) to the file's identity when read
    /// (inode, size, modification time). A file unchanged since gives the same mark, already
    /// checked and recorded: it is not read again (a mark is replaced by a rename, so a new
    /// mark is a new inode).
    seen: BTreeMap<(String, String, String), FileStamp>,
    /// (agent, volume, UID) whose backend volume was seen.
    backends: BTreeSet<(String, String, String)>,
}

fn violation(invariant: Invariant, detail: String) -> Option<Violation> {
    Some(Violation { invariant, detail })
}

/// What the checker looks at: the world at one instant.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    pub agents: &'a [SimAgent],
    pub hosts: &'a [SharedHost],
    pub targets: &'a Targets,
    /// Publication records, by volume ID.
    pub volumes: &'a BTreeMap<String, PillarVolumeState>,
    /// Acknowledged expansions: (volume ID, lifecycle UID) to the largest size answered.
    pub expansions: &'a BTreeMap<(String, String), u64>,
    /// Acknowledged node expansions, by the stage they were answered on.
    pub node_expansions: &'a BTreeMap<StageKey, NodeAck>,
}

/// A stage a NodeExpandVolume answered on (invariant 9): the host's index, the volume ID, the
/// lifecycle UID the record held at the answer, the staging mount's ID.
pub type StageKey = (usize, String, String, u64);

/// What NodeExpandVolume answered on one stage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeAck {
    /// The largest capacity answered.
    pub bytes: u64,
    /// The first answer larger than the target's namespace held at that moment: (answered,
    /// held).
    pub overclaim: Option<(u64, u64)>,
}

/// Whether a publication gives read access only (the checker's own reading of N5).
fn read_only(p: &PublishedNode) -> bool {
    p.readonly
        || matches!(
            p.access_mode,
            AccessMode::MultiNodeReaderOnly | AccessMode::SingleNodeReaderOnly
        )
}

impl Checker {
    /// Checks every invariant against the world.
    pub fn check(&mut self, view: View<'_>) -> Option<Violation> {
        if let Some(v) = hosts::check(view) {
            return Some(v);
        }
        for agent in view.agents {
            if let Some(v) = self.check_agent(agent, view.volumes) {
                return Some(v);
            }
        }
        hosts::check_expansions(view).or_else(|| hosts::check_node_expansions(view))
    }

    fn check_agent(
        &mut self,
        agent: &SimAgent,
        volumes: &BTreeMap<String, PillarVolumeState>,
    ) -> Option<Violation> {
        let subsystems = match acls(&agent.configfs) {
            Ok(t) => t,
            Err(e) => {
                return violation(
                    Invariant::OneWriterAtTarget,
                    format!("{}: the target cannot be read: {e}", agent.name),
                );
            }
        };
        for (nqn, acl) in &subsystems {
            if let Some(v) = check_acl(agent, nqn, acl, volumes) {
                return Some(v);
            }
        }
        // Volumes' marks, and snapshots' (a lifecycle of their own, in their own directory).
        for (dir, kind) in [("generations", ""), ("snapshot-generations", "snapshot ")] {
            if let Some(v) = self.check_marks(agent, dir, kind) {
                return Some(v);
            }
        }
        self.check_backends(agent, volumes)
    }

    /// Invariant 5: a published volume's backend is never gone.
    fn check_backends(
        &mut self,
        agent: &SimAgent,
        volumes: &BTreeMap<String, PillarVolumeState>,
    ) -> Option<Violation> {
        for (name, v) in volumes.iter().filter(|(_, v)| v.spec.agent == agent.name) {
            let uid = v.metadata.uid.clone().unwrap_or_default();
            let key = (agent.name.clone(), name.clone(), uid.clone());
            if agent.pool.join(format!("{name}.img")).exists() {
                self.backends.insert(key);
            } else if self.backends.contains(&key)
                && !v.status_or_default().published_nodes.is_empty()
            {
                return violation(
                    Invariant::PublishedNeverDeleted,
                    format!(
                        "{}: the backend of {name} (lifecycle {uid}) is gone while it is published to {:?}",
                        agent.name,
                        v.status_or_default().published_nodes
                    ),
                );
            }
        }
        None
    }

    fn check_marks(&mut self, agent: &SimAgent, dir: &str, kind: &str) -> Option<Violation> {
        let dir = agent.state.join(dir);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return None;
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| !n.starts_with('.'))
            .collect();
        names.sort();
        for file in names {
            let Some(volume) = file
                .strip_suffix(".json")
                .and_then(|v| VolumeId::parse(v).ok())
            else {
                continue;
            };
            let path = dir.join(&file);
            let seen_key = (agent.name.clone(), kind.to_owned(), file.clone());
            let stamp = std::fs::symlink_metadata(&path)
                .ok()
                .map(|m| FileStamp::of(&m));
            if stamp.is_some() && self.seen.get(&seen_key) == stamp.as_ref() {
                continue;
            }
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            if let Some(stamp) = stamp {
                self.seen.insert(seen_key, stamp);
            }
            let mark = match pillar_agent::fence::decode(&volume, &bytes) {
                Ok(m) => m,
                Err(e) => {
                    return violation(
                        Invariant::MarkNeverMovesBack,
                        format!("{}: the mark of {kind}{volume} is corrupt: {e}", agent.name),
                    );
                }
            };
            let key = (agent.name.clone(), format!("{kind}{volume}"));
            if let Some((uid, generation)) = self.marks.get(&key).cloned() {
                if mark.owner_uid == uid && mark.generation < generation {
                    return violation(
                        Invariant::MarkNeverMovesBack,
                        format!(
                            "{}: the mark of {kind}{volume} moved back from generation {generation} to {} (lifecycle {uid})",
                            agent.name, mark.generation
                        ),
                    );
                }
                if mark.owner_uid != uid {
                    let gone = self.superseded.entry(key.clone()).or_default();
                    if gone.contains(&mark.owner_uid) {
                        return violation(
                            Invariant::OldLifecycleNeverTouchesNew,
                            format!(
                                "{}: the mark of {kind}{volume} went back from lifecycle {uid} to the earlier {}",
                                agent.name, mark.owner_uid
                            ),
                        );
                    }
                    gone.insert(uid);
                }
            }
            self.marks
                .insert(key, (mark.owner_uid.clone(), mark.generation));
        }
        None
    }
}

/// A file's identity for [`Checker`]'s cache of marks read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    inode: u64,
    len: u64,
    modified: (i64, i64),
}

impl FileStamp {
    fn of(m: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            inode: m.ino(),
            len: m.len(),
            modified: (m.mtime(), m.mtime_nsec()),
        }
    }
}

/// What invariants 1 and 4 read of one subsystem of a target.
#[derive(Debug, Default)]
struct Acl {
    allow_any_host: bool,
    allowed_hosts: BTreeSet<String>,
}

/// The ACL of every subsystem under the configfs tree at `root`: only what the invariants read
/// (`pillar_nvmet::observe` reads the whole tree, ports, namespaces and hosts too, which cost
/// most of a seed when read after every step).
fn acls(root: &Path) -> std::io::Result<BTreeMap<String, Acl>> {
    let mut out = BTreeMap::new();
    let subsystems = match std::fs::read_dir(root.join("subsystems")) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for sub in subsystems {
        let sub = sub?;
        let Ok(nqn) = sub.file_name().into_string() else {
            continue;
        };
        let any = std::fs::read_to_string(sub.path().join("attr_allow_any_host"))?;
        let mut allowed_hosts = BTreeSet::new();
        for host in std::fs::read_dir(sub.path().join("allowed_hosts"))? {
            if let Ok(name) = host?.file_name().into_string() {
                allowed_hosts.insert(name);
            }
        }
        out.insert(
            nqn,
            Acl {
                allow_any_host: any.trim() == "1",
                allowed_hosts,
            },
        );
    }
    Ok(out)
}

/// Invariants 1 (one writer at the target) and 4 (a record outlives the access) on one
/// subsystem's ACL.
fn check_acl(
    agent: &SimAgent,
    nqn: &str,
    acl: &Acl,
    volumes: &BTreeMap<String, PillarVolumeState>,
) -> Option<Violation> {
    let volume = SubsystemNqn::parse(nqn)
        .ok()
        .and_then(|n| n.volume_id().ok())
        .map(|v| v.to_string())
        .unwrap_or_default();
    let record = volumes.get(&volume);
    let shared = acl.allowed_hosts.iter().all(|h| {
        record.is_some_and(|v| {
            v.status_or_default()
                .published_nodes
                .iter()
                .filter(|p| p.host_nqn == *h)
                .all(read_only)
        })
    });
    if acl.allow_any_host || (acl.allowed_hosts.len() > 1 && !shared) {
        return violation(
            Invariant::OneWriterAtTarget,
            format!(
                "{}: {volume} admits {:?} (allow_any_host {})",
                agent.name, acl.allowed_hosts, acl.allow_any_host
            ),
        );
    }
    for host in &acl.allowed_hosts {
        let recorded = record.is_some_and(|v| {
            v.spec.agent == agent.name
                && v.status_or_default()
                    .published_nodes
                    .iter()
                    .any(|p| p.host_nqn == *host)
        });
        if !recorded {
            return violation(
                Invariant::RecordOutlivesAccess,
                format!(
                    "{}: {volume} admits {host}, which no publication record of the volume names (records: {:?})",
                    agent.name,
                    record.map(|v| v.status_or_default().published_nodes)
                ),
            );
        }
    }
    None
}
