//! What the controller tells an operator about a volume: status conditions on its
//! PillarVolumeState and Kubernetes Events about it.
//!
//! - A condition is decided from the record inside a compare-and-swap (W8). `Revoking` rides the
//!   write that marks or removes a publication. `AclDisabled` says what the storage node
//!   enforces for a published volume: it is written after the agent confirmed an export with
//!   the protocol's `acl` (a publication whose target mode was not confirmed, a resync), so it
//!   never claims an ACL the target does not hold; it is cleared in the write that removes the
//!   last publication.
//! - An event reports a condition's transition, decided by the write that landed (one
//!   transition, one event, whatever the retries or the replicas). Recording it is
//!   best-effort: a failure is logged and the CSI call goes on.

use std::time::Duration;

use pillar_state::condition::{
    ACL_DISABLED, Condition, ConditionChange, ConditionStatus, REVOKING, find_condition, now,
    set_condition,
};
use pillar_state::crd::PillarVolumeStateStatus;
use pillar_state::store::{EventType, VolumeEvent};

use super::Controller;
use super::error::ControllerError;
use super::record::Write;

/// `AclDisabled` reason: the storage node confirmed an export with `acl: false`: its subsystem
/// admits any host.
pub const REASON_ACL_OFF: &str = "ProtocolAclOff";
/// `AclDisabled` reason: the storage node confirmed an export with `acl: true`: its subsystem
/// admits only the hosts of recorded publications.
pub const REASON_ACL_ON: &str = "ProtocolAclOn";
/// `AclDisabled` reason: no publication is recorded.
pub const REASON_NOT_PUBLISHED: &str = "NotPublished";

/// `Revoking` reason: a publication is marked revoking.
pub const REASON_REVOKE_NOT_CONFIRMED: &str = "RevokeNotConfirmed";
/// `Revoking` reason: no publication is marked revoking.
pub const REASON_NO_REVOKE: &str = "NoRevokePending";

/// Event reason: the storage node did not confirm a revoke.
pub const EVENT_REVOKE_FAILED: &str = "RevokeFailed";
/// Event reason: a CSI call was refused by a rule (FAILED_PRECONDITION).
pub const EVENT_REFUSED: &str = "Refused";
/// Event reason: the volume's PillarAgent does not exist.
pub const EVENT_AGENT_MISSING: &str = "AgentMissing";

/// The longest an event may hold up the call that reports it.
const EVENT_TIMEOUT: Duration = Duration::from_secs(5);

/// The message of `AclDisabled` = True (also the note of its event).
pub fn acl_off_message(protocol: &str) -> String {
    format!(
        "exported under PillarProtocol {protocol} with acl: false: the storage node admits any \
         host that reaches the NVMe/TCP port, and unpublishing cannot keep a lost node out \
         (docs/rules.md W6, W7; set acl: true; docs/runbook.md, \"AclDisabled\")"
    )
}

/// What the storage node was last confirmed to enforce for a published volume, from its
/// `AclDisabled` condition: `Some(true)` an ACL, `Some(false)` any host, `None` not known (no
/// publication since the condition was cleared, or never confirmed).
pub fn enforced_acl(status: &PillarVolumeStateStatus) -> Option<bool> {
    let c = find_condition(&status.conditions, ACL_DISABLED)?;
    match (c.status, c.reason.as_str()) {
        (ConditionStatus::False, REASON_ACL_ON) => Some(true),
        (ConditionStatus::True, REASON_ACL_OFF) => Some(false),
        _ => None,
    }
}

/// Sets `AclDisabled` in `status` to what the storage node enforces after it confirmed an
/// export of the volume with `acl` under `protocol` (W6, W7): True when it admits any host,
/// False when it admits only published hosts. Keeps the transition time unless the status
/// changes.
pub fn set_acl_condition(
    status: &mut PillarVolumeStateStatus,
    protocol: &str,
    acl: bool,
    generation: Option<i64>,
) -> ConditionChange {
    let condition = if acl {
        Condition::new(
            ACL_DISABLED,
            ConditionStatus::False,
            REASON_ACL_ON,
            format!(
                "exported under PillarProtocol {protocol} with acl: true: the storage node admits \
                 only the host NQNs of published nodes"
            ),
            generation,
            now(),
        )
    } else {
        Condition::new(
            ACL_DISABLED,
            ConditionStatus::True,
            REASON_ACL_OFF,
            acl_off_message(protocol),
            generation,
            now(),
        )
    };
    set_condition(&mut status.conditions, condition)
}

/// Clears `AclDisabled` (False) once `status` records no publication; a volume that never had
/// the condition gets none. Called in the write that removes a publication.
pub fn clear_acl_condition_if_unpublished(
    status: &mut PillarVolumeStateStatus,
    generation: Option<i64>,
) -> ConditionChange {
    if !status.published_nodes.is_empty()
        || find_condition(&status.conditions, ACL_DISABLED).is_none()
    {
        return ConditionChange::Unchanged;
    }
    set_condition(
        &mut status.conditions,
        Condition::new(
            ACL_DISABLED,
            ConditionStatus::False,
            REASON_NOT_PUBLISHED,
            "no publication is recorded",
            generation,
            now(),
        ),
    )
}

/// Sets `Revoking` from `status`'s publications, in the write that marks one revoking or
/// removes one (W3, W4): True naming the nodes while any is revoking; False once none is (a
/// volume that never had the condition gets none).
pub fn set_revoking_condition(
    status: &mut PillarVolumeStateStatus,
    generation: Option<i64>,
) -> ConditionChange {
    let nodes: Vec<&str> = status
        .published_nodes
        .iter()
        .filter(|p| p.revoking)
        .map(|p| p.node.as_str())
        .collect();
    let condition = if nodes.is_empty() {
        if find_condition(&status.conditions, REVOKING).is_none() {
            return ConditionChange::Unchanged;
        }
        Condition::new(
            REVOKING,
            ConditionStatus::False,
            REASON_NO_REVOKE,
            "no unpublish waits for a revoke",
            generation,
            now(),
        )
    } else {
        Condition::new(
            REVOKING,
            ConditionStatus::True,
            REASON_REVOKE_NOT_CONFIRMED,
            format!(
                "unpublish from node {} started: the publication stays recorded and the volume \
                 goes to no other node until the storage node confirms the revoke (docs/runbook.md, \
                 \"A pod stuck in ContainerCreating\")",
                nodes.join(", ")
            ),
            generation,
            now(),
        )
    };
    set_condition(&mut status.conditions, condition)
}

impl Controller {
    /// Records `event`, best-effort: a failure or a slow API server is logged (volume, reason
    /// and the store's error, never the request) and the caller goes on.
    pub(super) async fn record_event(&self, event: VolumeEvent) {
        match tokio::time::timeout(EVENT_TIMEOUT, self.store.record_volume_event(&event)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(volume = %event.volume, reason = %event.reason, error = %e, "recording the event failed")
            }
            Err(_) => {
                tracing::warn!(volume = %event.volume, reason = %event.reason, "recording the event timed out")
            }
        }
    }

    /// The Warning event for a revoke the storage node did not confirm (the publication stays,
    /// W4).
    pub(super) async fn warn_revoke_failed(
        &self,
        volume: &str,
        uid: &str,
        pv: Option<String>,
        node: &str,
        error: &str,
    ) {
        self.record_event(VolumeEvent {
            volume: volume.to_owned(),
            uid: uid.to_owned(),
            pv,
            type_: EventType::Warning,
            reason: EVENT_REVOKE_FAILED.to_owned(),
            action: "Unpublish".to_owned(),
            note: format!(
                "revoke of node {node} not confirmed, the publication stays recorded: {error}"
            ),
        })
        .await;
    }

    /// The Warning event for a volume whose PillarAgent does not exist: pillar refuses to act
    /// without its storage node (C1, W4).
    pub(super) async fn warn_agent_missing(
        &self,
        volume: &str,
        uid: &str,
        pv: Option<String>,
        agent: &str,
    ) {
        self.record_event(VolumeEvent {
            volume: volume.to_owned(),
            uid: uid.to_owned(),
            pv,
            type_: EventType::Warning,
            reason: EVENT_AGENT_MISSING.to_owned(),
            action: "ReachStorageNode".to_owned(),
            note: format!(
                "PillarAgent {agent} does not exist: pillar refuses to change the volume without \
                 its storage node (docs/runbook.md, \"A storage node that will not come back\")"
            ),
        })
        .await;
    }

    /// The Warning event for a CSI call on `volume` refused by a rule; nothing when there is
    /// no record to attach it to (the refusal then is about the request, not a volume).
    pub(super) async fn warn_refused(&self, method: &'static str, volume: &str, message: &str) {
        let Ok(Some(state)) = self.store.get_volume(volume).await else {
            return;
        };
        self.record_event(VolumeEvent {
            volume: volume.to_owned(),
            uid: state.metadata.uid.clone().unwrap_or_default(),
            pv: super::agent::pv_of(&state),
            type_: EventType::Warning,
            reason: EVENT_REFUSED.to_owned(),
            action: method.to_owned(),
            note: message.to_owned(),
        })
        .await;
    }

    /// Records in `AclDisabled` that the storage node enforces `acl` (under `protocol`) for
    /// `volume` (lifecycle `uid`, PersistentVolume `pv`), after the agent confirmed an export with it (W6, W7). One
    /// compare-and-swap, only when the condition changes and a publication is recorded (the
    /// write removing the last one clears it); a transition to True records one Warning. A
    /// failed write fails the caller, which is retried: the export is then sent again.
    pub(super) async fn record_enforced_acl(
        &self,
        volume: &str,
        uid: &str,
        pv: Option<String>,
        protocol: &str,
        acl: bool,
    ) -> Result<(), ControllerError> {
        let (_, change) = self
            .compare_and_swap(volume, uid, |current| {
                let mut status = current.status_or_default();
                if status.published_nodes.is_empty() {
                    return Ok((Write::Nothing, ConditionChange::Unchanged));
                }
                let change =
                    set_acl_condition(&mut status, protocol, acl, current.metadata.generation);
                if change == ConditionChange::Unchanged {
                    return Ok((Write::Nothing, change));
                }
                Ok((Write::Status(status), change))
            })
            .await?;
        if !acl && change.is_transition() {
            // One event per transition to True: whoever finds the condition True already
            // records none.
            self.warn_acl_disabled(volume, uid, pv, protocol).await;
        }
        Ok(())
    }

    /// The Warning event for a CSI call on snapshot `snapshot` refused by a rule: about the
    /// snapshot's source volume (the lifecycle the snapshot was cut from), naming the snapshot.
    /// Nothing when the snapshot or that lifecycle of its source is gone: a snapshot ID never
    /// names a volume, even one whose ID is the same string.
    pub(super) async fn warn_snapshot_refused(
        &self,
        method: &'static str,
        snapshot: &str,
        message: &str,
    ) {
        let Ok(Some(s)) = self.store.get_snapshot(snapshot).await else {
            return;
        };
        let source = &s.spec.source_volume_id;
        let Ok(Some(volume)) = self.store.get_volume(source).await else {
            return;
        };
        if volume.metadata.uid.as_deref() != Some(s.spec.source_uid.as_str()) {
            return;
        }
        self.record_event(VolumeEvent {
            volume: source.clone(),
            uid: s.spec.source_uid.clone(),
            pv: super::agent::pv_of(&volume),
            type_: EventType::Warning,
            reason: EVENT_REFUSED.to_owned(),
            action: method.to_owned(),
            note: format!("snapshot {snapshot}: {message}"),
        })
        .await;
    }

    /// The Warning event for `AclDisabled` turning True on `volume` (lifecycle `uid`).
    pub(super) async fn warn_acl_disabled(
        &self,
        volume: &str,
        uid: &str,
        pv: Option<String>,
        protocol: &str,
    ) {
        self.record_event(VolumeEvent {
            volume: volume.to_owned(),
            uid: uid.to_owned(),
            pv,
            type_: EventType::Warning,
            reason: ACL_DISABLED.to_owned(),
            action: "Publish".to_owned(),
            note: acl_off_message(protocol),
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use pillar_state::condition::is_condition_true;
    use pillar_state::crd::{AccessMode, PublishedNode};

    use super::*;

    fn published() -> PillarVolumeStateStatus {
        PillarVolumeStateStatus {
            published_nodes: vec![PublishedNode {
                node: "a".into(),
                host_nqn: "nqn.a".into(),
                access_mode: AccessMode::SingleNodeWriter,
                readonly: false,
                revoking: false,
                recorded_generation: 1,
            }],
            publication_generation: 1,
            ..Default::default()
        }
    }

    // proves W6, W7: acl off is True, acl on is False; the same again is no transition.
    #[test]
    fn acl_condition_follows_the_protocol() {
        let mut s = published();
        let change = set_acl_condition(&mut s, "nvme-tcp", false, Some(1));
        assert!(change.is_transition());
        assert!(is_condition_true(&s.conditions, ACL_DISABLED));
        let c = &s.conditions[0];
        assert_eq!(c.reason, REASON_ACL_OFF);
        assert!(
            c.message
                .contains("unpublishing cannot keep a lost node out")
        );
        assert!(c.message.contains("docs/rules.md"));
        assert_eq!(c.observed_generation, Some(1));
        let first = c.last_transition_time.clone();
        assert_eq!(
            set_acl_condition(&mut s, "nvme-tcp", false, Some(1)),
            ConditionChange::Unchanged
        );
        assert_eq!(s.conditions[0].last_transition_time, first);
        assert_eq!(
            set_acl_condition(&mut s, "nvme-tcp", true, Some(1)),
            ConditionChange::Transitioned
        );
        assert!(!is_condition_true(&s.conditions, ACL_DISABLED));
        assert_eq!(s.conditions[0].reason, REASON_ACL_ON);
        assert_eq!(s.conditions.len(), 1);
    }

    // proves W6, W7: cleared only when the last publication is gone, and only where it was set.
    #[test]
    fn acl_condition_clears_with_the_last_publication() {
        let mut s = published();
        set_acl_condition(&mut s, "nvme-tcp", false, None);
        assert_eq!(
            clear_acl_condition_if_unpublished(&mut s, None),
            ConditionChange::Unchanged
        );
        assert!(is_condition_true(&s.conditions, ACL_DISABLED));
        s.published_nodes.clear();
        assert_eq!(
            clear_acl_condition_if_unpublished(&mut s, None),
            ConditionChange::Transitioned
        );
        assert_eq!(s.conditions[0].status, ConditionStatus::False);
        assert_eq!(s.conditions[0].reason, REASON_NOT_PUBLISHED);
        let mut never = PillarVolumeStateStatus::default();
        assert_eq!(
            clear_acl_condition_if_unpublished(&mut never, None),
            ConditionChange::Unchanged
        );
        assert!(never.conditions.is_empty());
    }
}
