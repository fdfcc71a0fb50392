//! What the controller tells an operator about a volume: status conditions on its
//! PillarVolumeState and Kubernetes Events about it.
//!
//! - A condition is decided from the record inside a compare-and-swap (W8). `Revoking` rides the
//!   write that marks or removes a publication. `AclDisabled` says what the storage node
//!   enforces for a published volume: it is written after the agent confirmed an export with
//!   the protocol's `acl` (a publication whose target mode was not confirmed, a resync), so it
//!   never claims an ACL the target does not hold; it is cleared in the write that removes the
//!   last publication. `AuthDisabled` (W10) is written with it, in the same write, from the same
//!   confirmed export: False only once the agent set and read back the DH-HMAC-CHAP keys of
//!   every host the export admits; True when the export required no authentication (`auth:
//!   none`, or `acl: false`, where the kernel authenticates nobody).
//! - An event reports a condition's transition, decided by the write that landed (one
//!   transition, one event, whatever the retries or the replicas). Recording it is
//!   best-effort: a failure is logged and the CSI call goes on.

use std::time::Duration;

use pillar_state::condition::{
    ACL_DISABLED, AUTH_DISABLED, Condition, ConditionChange, ConditionStatus, REVOKING,
    find_condition, set_condition,
};
use pillar_state::crd::{PillarProtocol, PillarVolumeStateStatus};
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
/// `AuthDisabled` reason: the storage node confirmed an export with `auth: dhchap` (and an
/// ACL): it set every admitted host's keys.
pub const REASON_AUTH_DHCHAP: &str = "ProtocolAuthDhchap";
/// `AuthDisabled` reason: the storage node confirmed an export with `auth: none`.
pub const REASON_AUTH_NONE: &str = "ProtocolAuthNone";
/// `AclDisabled` and `AuthDisabled` reason: no publication is recorded.
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

/// What a storage node enforces for a volume's subsystem: its admission policy (W6) and
/// whether an admitted host must prove its node's DH-HMAC-CHAP secret (W10).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Enforced {
    /// Only the host NQNs of recorded publications are admitted.
    pub acl: bool,
    /// An admitted host must authenticate (never without `acl`: the kernel authenticates nobody
    /// on a subsystem that admits any host).
    pub auth: bool,
}

impl Enforced {
    /// What an export with `protocol` makes the target enforce.
    pub fn of(protocol: &PillarProtocol) -> Self {
        Self {
            acl: protocol.spec.nvme_tcp.acl,
            auth: super::agent::requires_auth(protocol),
        }
    }
}

/// What the storage node was last confirmed to enforce for a published volume, from its
/// `AclDisabled` and `AuthDisabled` conditions; `None` when either is not known (no publication
/// since they were cleared, never confirmed, or a record from before `AuthDisabled`).
pub fn enforced(status: &PillarVolumeStateStatus) -> Option<Enforced> {
    let acl = find_condition(&status.conditions, ACL_DISABLED)?;
    let acl = match (acl.status, acl.reason.as_str()) {
        (ConditionStatus::False, REASON_ACL_ON) => true,
        (ConditionStatus::True, REASON_ACL_OFF) => false,
        _ => return None,
    };
    let auth = find_condition(&status.conditions, AUTH_DISABLED)?;
    let auth = match (auth.status, auth.reason.as_str()) {
        (ConditionStatus::False, REASON_AUTH_DHCHAP) if acl => true,
        (ConditionStatus::True, REASON_AUTH_NONE) if acl => false,
        (ConditionStatus::True, REASON_ACL_OFF) if !acl => false,
        _ => return None,
    };
    Some(Enforced { acl, auth })
}

/// The message of `AuthDisabled` = True under `auth: none` (also the note of its event).
pub fn auth_none_message(protocol: &str) -> String {
    format!(
        "exported under PillarProtocol {protocol} with auth: none: the storage node admits any \
         host presenting a published node's host NQN, without proving a secret (docs/rules.md \
         W10; set auth: dhchap; docs/runbook.md, \"AuthDisabled\")"
    )
}

/// The message of `AuthDisabled` = True under `acl: false` (also the note of its event).
pub fn auth_acl_off_message(protocol: &str) -> String {
    format!(
        "exported under PillarProtocol {protocol} with acl: false: the subsystem admits any \
         host and the kernel authenticates none, whatever the protocol's auth (docs/rules.md \
         W6, W10; set acl: true; docs/runbook.md, \"AuthDisabled\")"
    )
}

/// Sets `AclDisabled` and `AuthDisabled` in `status` to what the storage node enforces after
/// it confirmed an export of the volume with `mode` under `protocol` (W6, W7, W10). Keeps each
/// transition time unless its status changes. Returns the change of each, in that order.
pub fn set_enforced_conditions(
    status: &mut PillarVolumeStateStatus,
    protocol: &str,
    mode: Enforced,
    generation: Option<i64>,
    at: &str,
) -> (ConditionChange, ConditionChange) {
    let acl = set_acl_condition(status, protocol, mode.acl, generation, at);
    let auth = set_auth_condition(status, protocol, mode, generation, at);
    (acl, auth)
}

/// Sets `AuthDisabled` in `status` after the storage node confirmed an export with `mode`.
fn set_auth_condition(
    status: &mut PillarVolumeStateStatus,
    protocol: &str,
    mode: Enforced,
    generation: Option<i64>,
    at: &str,
) -> ConditionChange {
    let (state, reason, message) = match (mode.acl, mode.auth) {
        (true, true) => (
            ConditionStatus::False,
            REASON_AUTH_DHCHAP,
            format!(
                "exported under PillarProtocol {protocol} with auth: dhchap: the storage node \
                 admits a published node's host only once it proved that node's DH-HMAC-CHAP \
                 secret, and proves its controller secret back"
            ),
        ),
        (true, false) => (
            ConditionStatus::True,
            REASON_AUTH_NONE,
            auth_none_message(protocol),
        ),
        (false, _) => (
            ConditionStatus::True,
            REASON_ACL_OFF,
            auth_acl_off_message(protocol),
        ),
    };
    set_condition(
        &mut status.conditions,
        Condition::new(AUTH_DISABLED, state, reason, message, generation, at),
    )
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
    at: &str,
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
            at,
        )
    } else {
        Condition::new(
            ACL_DISABLED,
            ConditionStatus::True,
            REASON_ACL_OFF,
            acl_off_message(protocol),
            generation,
            at,
        )
    };
    set_condition(&mut status.conditions, condition)
}

/// Clears `AclDisabled` and `AuthDisabled` (False) once `status` records no publication; a
/// volume that never had one gets none. Called in the write that removes a publication.
/// Returns the change of `AclDisabled` (the one the callers report on).
pub fn clear_acl_condition_if_unpublished(
    status: &mut PillarVolumeStateStatus,
    generation: Option<i64>,
    at: &str,
) -> ConditionChange {
    let acl = clear_if_unpublished(status, ACL_DISABLED, generation, at);
    clear_if_unpublished(status, AUTH_DISABLED, generation, at);
    acl
}

fn clear_if_unpublished(
    status: &mut PillarVolumeStateStatus,
    type_: &str,
    generation: Option<i64>,
    at: &str,
) -> ConditionChange {
    if !status.published_nodes.is_empty() || find_condition(&status.conditions, type_).is_none() {
        return ConditionChange::Unchanged;
    }
    set_condition(
        &mut status.conditions,
        Condition::new(
            type_,
            ConditionStatus::False,
            REASON_NOT_PUBLISHED,
            "no publication is recorded",
            generation,
            at,
        ),
    )
}

/// Sets `Revoking` from `status`'s publications, in the write that marks one revoking or
/// removes one (W3, W4): True naming the nodes while any is revoking; False once none is (a
/// volume that never had the condition gets none).
pub fn set_revoking_condition(
    status: &mut PillarVolumeStateStatus,
    generation: Option<i64>,
    at: &str,
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
            at,
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
            at,
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

    /// Records in `AclDisabled` and `AuthDisabled` what the storage node enforces (`mode`,
    /// under `protocol`) for `volume` (lifecycle `uid`, PersistentVolume `pv`), after the agent
    /// confirmed an export with it (W6, W7, W10). One compare-and-swap, only when a condition
    /// changes and a publication is recorded (the write removing the last one clears them); a
    /// transition to True records one Warning (`AuthDisabled` only under an ACL: with `acl:
    /// false` the `AclDisabled` warning says it). A failed write fails the caller,
    /// which is retried: the export is then sent again.
    pub(super) async fn record_enforced(
        &self,
        volume: &str,
        uid: &str,
        pv: Option<String>,
        protocol: &str,
        mode: Enforced,
    ) -> Result<(), ControllerError> {
        let unchanged = (ConditionChange::Unchanged, ConditionChange::Unchanged);
        let at = self.condition_time();
        let (_, (acl, auth)) = self
            .compare_and_swap(volume, uid, |current| {
                let mut status = current.status_or_default();
                if status.published_nodes.is_empty() {
                    return Ok((Write::Nothing, unchanged));
                }
                let changes = set_enforced_conditions(
                    &mut status,
                    protocol,
                    mode,
                    current.metadata.generation,
                    &at,
                );
                if changes == unchanged {
                    return Ok((Write::Nothing, changes));
                }
                Ok((Write::Status(status), changes))
            })
            .await?;
        // One event per transition to True: whoever finds a condition True already records
        // none.
        if !mode.acl && acl.is_transition() {
            self.warn_disabled(
                volume,
                uid,
                pv.clone(),
                ACL_DISABLED,
                acl_off_message(protocol),
            )
            .await;
        }
        // Under acl: false the AclDisabled warning says it already (any host connects): one
        // operator decision, one warning.
        if mode.acl && !mode.auth && auth.is_transition() {
            self.warn_disabled(volume, uid, pv, AUTH_DISABLED, auth_none_message(protocol))
                .await;
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

    /// The Warning event for condition `reason` (`AclDisabled` or `AuthDisabled`) turning True
    /// on `volume` (lifecycle `uid`).
    async fn warn_disabled(
        &self,
        volume: &str,
        uid: &str,
        pv: Option<String>,
        reason: &str,
        note: String,
    ) {
        self.record_event(VolumeEvent {
            volume: volume.to_owned(),
            uid: uid.to_owned(),
            pv,
            type_: EventType::Warning,
            reason: reason.to_owned(),
            action: "Publish".to_owned(),
            note,
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use pillar_state::condition::is_condition_true;
    use pillar_state::crd::{AccessMode, PublishedNode};

    use super::*;

    const T: &str = "2026-01-01T00:00:00Z";

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
        let change = set_acl_condition(&mut s, "nvme-tcp", false, Some(1), T);
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
            set_acl_condition(&mut s, "nvme-tcp", false, Some(1), T),
            ConditionChange::Unchanged
        );
        assert_eq!(s.conditions[0].last_transition_time, first);
        assert_eq!(
            set_acl_condition(&mut s, "nvme-tcp", true, Some(1), T),
            ConditionChange::Transitioned
        );
        assert!(!is_condition_true(&s.conditions, ACL_DISABLED));
        assert_eq!(s.conditions[0].reason, REASON_ACL_ON);
        assert_eq!(s.conditions.len(), 1);
    }

    fn mode(acl: bool, auth: bool) -> Enforced {
        Enforced { acl, auth }
    }

    // proves W10 (visible auth: none): AuthDisabled follows the confirmed mode: False only with
    // an ACL and authentication, True under auth: none (its message says any host presenting a
    // published node's NQN is admitted) and under acl: false (the kernel authenticates none);
    // `enforced` reads back exactly the mode that was set, and nothing from a half-written pair.
    #[test]
    fn auth_condition_says_what_the_target_enforces() {
        let mut s = published();
        assert_eq!(enforced(&s), None);
        let (_, auth) = set_enforced_conditions(&mut s, "p", mode(true, false), Some(1), T);
        assert!(auth.is_transition());
        let c = find_condition(&s.conditions, AUTH_DISABLED).unwrap();
        assert_eq!(
            (c.status, c.reason.as_str()),
            (ConditionStatus::True, REASON_AUTH_NONE)
        );
        assert!(
            c.message
                .contains("any host presenting a published node's host NQN")
        );
        assert!(c.message.contains("W10"));
        assert_eq!(enforced(&s), Some(mode(true, false)));
        let (acl, auth) = set_enforced_conditions(&mut s, "p", mode(true, true), Some(1), T);
        assert_eq!(
            (acl, auth),
            (ConditionChange::Unchanged, ConditionChange::Transitioned)
        );
        let c = find_condition(&s.conditions, AUTH_DISABLED).unwrap();
        assert_eq!(
            (c.status, c.reason.as_str()),
            (ConditionStatus::False, REASON_AUTH_DHCHAP)
        );
        assert_eq!(enforced(&s), Some(mode(true, true)));
        set_enforced_conditions(&mut s, "p", mode(false, false), Some(1), T);
        let c = find_condition(&s.conditions, AUTH_DISABLED).unwrap();
        assert_eq!(
            (c.status, c.reason.as_str()),
            (ConditionStatus::True, REASON_ACL_OFF)
        );
        assert!(c.message.contains("authenticates none"));
        assert_eq!(enforced(&s), Some(mode(false, false)));
        // A record from before AuthDisabled (AclDisabled alone) is not known: exported again.
        let mut old = published();
        set_acl_condition(&mut old, "p", true, None, T);
        assert_eq!(enforced(&old), None);
        // Cleared with the last publication, both of them.
        s.published_nodes.clear();
        clear_acl_condition_if_unpublished(&mut s, None, T);
        for t in [ACL_DISABLED, AUTH_DISABLED] {
            let c = find_condition(&s.conditions, t).unwrap();
            assert_eq!(
                (c.status, c.reason.as_str()),
                (ConditionStatus::False, REASON_NOT_PUBLISHED)
            );
        }
        assert_eq!(enforced(&s), None);
    }

    // proves W6, W7: cleared only when the last publication is gone, and only where it was set.
    #[test]
    fn acl_condition_clears_with_the_last_publication() {
        let mut s = published();
        set_acl_condition(&mut s, "nvme-tcp", false, None, T);
        assert_eq!(
            clear_acl_condition_if_unpublished(&mut s, None, T),
            ConditionChange::Unchanged
        );
        assert!(is_condition_true(&s.conditions, ACL_DISABLED));
        s.published_nodes.clear();
        assert_eq!(
            clear_acl_condition_if_unpublished(&mut s, None, T),
            ConditionChange::Transitioned
        );
        assert_eq!(s.conditions[0].status, ConditionStatus::False);
        assert_eq!(s.conditions[0].reason, REASON_NOT_PUBLISHED);
        let mut never = PillarVolumeStateStatus::default();
        assert_eq!(
            clear_acl_condition_if_unpublished(&mut never, None, T),
            ConditionChange::Unchanged
        );
        assert!(never.conditions.is_empty());
    }
}
