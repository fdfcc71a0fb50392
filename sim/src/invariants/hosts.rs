//! Invariants 6, 7 (the hosts), 8 and 9 (acknowledged expansions); see the parent module.

use std::collections::BTreeMap;

use super::{Invariant, View, Violation, violation};
use crate::host::{lock_host, volume_of};
use crate::kernel::filesystem_bytes_in;

/// Invariants 6 and 7.
pub(super) fn check(view: View<'_>) -> Option<Violation> {
    // Per volume: the hosts live on it with a read-write stage.
    let mut writers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for host in view.hosts {
        let h = lock_host(host);
        for staged in h.staged().values() {
            if !h.live(staged) {
                continue;
            }
            let volume = volume_of(&staged.nqn);
            let named = view.volumes.get(&volume).is_some_and(|v| {
                v.spec.agent == staged.agent
                    && v.status_or_default()
                        .published_nodes
                        .iter()
                        .any(|p| p.node == h.node && p.host_nqn == h.host_nqn)
            });
            if !named {
                return violation(
                    Invariant::StageNamedByRecord,
                    format!(
                        "{} ({}) is live on {volume} at {}, which no publication record names (records: {:?})",
                        h.node,
                        h.host_nqn,
                        staged.agent,
                        view.volumes
                            .get(&volume)
                            .map(|v| v.status_or_default().published_nodes)
                    ),
                );
            }
            if !staged.read_only {
                writers
                    .entry(volume)
                    .or_default()
                    .push(format!("{} ({})", h.node, h.host_nqn));
            }
        }
    }
    writers
        .into_iter()
        .find(|(_, w)| w.len() > 1)
        .and_then(|(volume, w)| {
            violation(
                Invariant::OneWriterAtHosts,
                format!("{volume} is staged read-write and reachable on {w:?}"),
            )
        })
}

/// Invariant 8.
pub(super) fn check_expansions(view: View<'_>) -> Option<Violation> {
    for ((volume, uid), size) in view.expansions {
        let Some(record) = view.volumes.get(volume) else {
            continue;
        };
        if record.metadata.uid.as_deref() != Some(uid.as_str())
            || record.status_or_default().deleting
        {
            continue;
        }
        if record.spec.size_bytes < *size {
            return violation(
                Invariant::ExpansionKept,
                format!(
                    "{volume} (lifecycle {uid}) was expanded to {size} bytes, its record says {}",
                    record.spec.size_bytes
                ),
            );
        }
        let Some(agent) = view.agents.iter().find(|a| a.name == record.spec.agent) else {
            continue;
        };
        let backend = agent.pool.join(format!("{volume}.img"));
        if let Ok(meta) = std::fs::metadata(&backend)
            && meta.len() < *size
        {
            return violation(
                Invariant::ExpansionKept,
                format!(
                    "{volume} (lifecycle {uid}) was expanded to {size} bytes, its backend at {} holds {}",
                    agent.name,
                    meta.len()
                ),
            );
        }
    }
    None
}

/// Invariant 9. The filesystem is read from the lifecycle's disk (its pool file), not through
/// the host: the host may be cut off from the target (a crash, a power loss, a revoke) while
/// its stage stands, and the filesystem it grew must still be there when it comes back.
pub(super) fn check_node_expansions(view: View<'_>) -> Option<Violation> {
    for ((index, volume, uid, mount_id), ack) in view.node_expansions {
        if let Some((answered, held)) = ack.overclaim {
            return violation(
                Invariant::NodeExpansionKept,
                format!(
                    "host {index}: NodeExpandVolume of {volume} (lifecycle {uid}) answered {answered} bytes; its namespace held {held}"
                ),
            );
        }
        let Some(host) = view.hosts.get(*index) else {
            continue;
        };
        let staged = lock_host(host).staged().remove(volume);
        // Only while the stage the answer was given on stands.
        let Some(staged) = staged.filter(|s| s.mount_id == *mount_id) else {
            continue;
        };
        let Some(record) = view.volumes.get(volume) else {
            continue;
        };
        if record.metadata.uid.as_deref() != Some(uid.as_str())
            || record.status_or_default().deleting
            || record.spec.agent != staged.agent
        {
            continue;
        }
        let Some(agent) = view.agents.iter().find(|a| a.name == staged.agent) else {
            continue;
        };
        let disk = agent.pool.join(format!("{volume}.img"));
        // A lifecycle's disk gone while it is published is invariant 5's to report.
        let Ok(found) = filesystem_bytes_in(&disk) else {
            continue;
        };
        if found.is_none_or(|bytes| bytes < ack.bytes) {
            return violation(
                Invariant::NodeExpansionKept,
                format!(
                    "host {index} ({}): NodeExpandVolume of {volume} (lifecycle {uid}) answered {} bytes; the filesystem on its disk at {} holds {found:?}",
                    lock_host(host).host_nqn,
                    ack.bytes,
                    agent.name
                ),
            );
        }
    }
    None
}
