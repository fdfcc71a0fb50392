//! Kubernetes-style status conditions (the JSON shape of `metav1.Condition`) and the one helper
//! that sets them.
//!
//! A condition is written by the controller inside the compare-and-swap that changes what it
//! describes, so it never disagrees with the record it sits in. [`set_condition`] replaces the
//! condition of one type and keeps `lastTransitionTime` unless the status changed, which is what
//! `meta.SetStatusCondition` in apimachinery does.
//!
//! Condition types pillar writes:
//! - [`ACL_DISABLED`]: the volume holds a publication under a `PillarProtocol` with `acl: false`
//!   (W6, W7): any host that reaches the port can connect, and no unpublish keeps a node out.
//! - [`AUTH_DISABLED`]: the volume's storage node was confirmed to export it without requiring
//!   DH-HMAC-CHAP (W10): `auth: none`, or `acl: false` (the kernel authenticates nobody then), so
//!   a host is admitted on the host NQN it presents.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Condition type: a publication is recorded under a protocol with `acl: false`.
pub const ACL_DISABLED: &str = "AclDisabled";

/// Condition type: a publication is recorded and its storage node admits hosts without making
/// them prove a DH-HMAC-CHAP secret (W10).
pub const AUTH_DISABLED: &str = "AuthDisabled";

/// Condition type: an unpublish started and the storage node has not confirmed its revoke.
pub const REVOKING: &str = "Revoking";

/// One condition, with the fields and JSON names of `metav1.Condition`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Type of condition, in CamelCase (for example `AclDisabled`). Unique within the list.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: ConditionStatus,
    /// The `metadata.generation` the condition was set from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// When the status last changed (RFC 3339, seconds, UTC).
    #[schemars(extend("format" = "date-time"))]
    pub last_transition_time: String,
    /// Why, in CamelCase, machine-readable.
    pub reason: String,
    /// Why, for humans. May be empty.
    #[serde(default)]
    pub message: String,
}

/// The status of a condition.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum ConditionStatus {
    /// The condition holds.
    True,
    /// The condition does not hold.
    False,
    /// It is not known whether the condition holds.
    Unknown,
}

/// What [`set_condition`] did to the list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConditionChange {
    /// No condition of the type was there: it was added.
    Added,
    /// The status changed: `lastTransitionTime` was set to the new condition's.
    Transitioned,
    /// Same status; reason, message or observed generation changed, the transition time kept.
    Updated,
    /// Nothing changed.
    Unchanged,
}

impl ConditionChange {
    /// Whether the condition's status is new: added, or changed from another status.
    pub fn is_transition(self) -> bool {
        matches!(self, Self::Added | Self::Transitioned)
    }
}

impl Condition {
    /// A condition of `type_` with `status`, stamped `now` (see [`now`]).
    pub fn new(
        type_: &str,
        status: ConditionStatus,
        reason: &str,
        message: impl Into<String>,
        observed_generation: Option<i64>,
        now: impl Into<String>,
    ) -> Self {
        Self {
            type_: type_.to_owned(),
            status,
            observed_generation,
            last_transition_time: now.into(),
            reason: reason.to_owned(),
            message: message.into(),
        }
    }
}

/// Sets `new` in `conditions`, replacing the condition of the same type. The transition time
/// of `new` is used only when the type was absent or its status changed; otherwise the stored
/// one is kept. Several conditions of one type (which no writer produces) collapse into one.
pub fn set_condition(conditions: &mut Vec<Condition>, new: Condition) -> ConditionChange {
    let Some(at) = conditions.iter().position(|c| c.type_ == new.type_) else {
        conditions.push(new);
        return ConditionChange::Added;
    };
    let mut i = at + 1;
    while i < conditions.len() {
        if conditions[i].type_ == new.type_ {
            conditions.remove(i);
        } else {
            i += 1;
        }
    }
    let old = &mut conditions[at];
    if old.status != new.status {
        *old = new;
        return ConditionChange::Transitioned;
    }
    let updated = Condition {
        last_transition_time: old.last_transition_time.clone(),
        ..new
    };
    if *old == updated {
        return ConditionChange::Unchanged;
    }
    *old = updated;
    ConditionChange::Updated
}

/// The condition of `type_`, if any.
pub fn find_condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of `type_` is there with status `True`.
pub fn is_condition_true(conditions: &[Condition], type_: &str) -> bool {
    find_condition(conditions, type_).is_some_and(|c| c.status == ConditionStatus::True)
}

/// Removes the condition of `type_`; whether one was there.
pub fn remove_condition(conditions: &mut Vec<Condition>, type_: &str) -> bool {
    let before = conditions.len();
    conditions.retain(|c| c.type_ != type_);
    conditions.len() != before
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: &str = "2026-01-01T00:00:00Z";
    const T1: &str = "2026-01-01T00:01:00Z";

    fn c(type_: &str, status: ConditionStatus, reason: &str, at: &str) -> Condition {
        Condition::new(
            type_,
            status,
            reason,
            format!("{reason} message"),
            Some(1),
            at,
        )
    }

    #[test]
    fn a_new_type_is_added_with_its_time() {
        let mut list = Vec::new();
        let change = set_condition(&mut list, c("A", ConditionStatus::True, "R", T0));
        assert_eq!(change, ConditionChange::Added);
        assert!(change.is_transition());
        assert_eq!(list, vec![c("A", ConditionStatus::True, "R", T0)]);
    }

    #[test]
    fn the_same_condition_again_changes_nothing_and_keeps_the_time() {
        let mut list = vec![c("A", ConditionStatus::True, "R", T0)];
        let change = set_condition(&mut list, c("A", ConditionStatus::True, "R", T1));
        assert_eq!(change, ConditionChange::Unchanged);
        assert!(!change.is_transition());
        assert_eq!(list, vec![c("A", ConditionStatus::True, "R", T0)]);
    }

    #[test]
    fn a_new_reason_with_the_same_status_keeps_the_transition_time() {
        let mut list = vec![c("A", ConditionStatus::True, "R", T0)];
        let mut newer = c("A", ConditionStatus::True, "Other", T1);
        newer.observed_generation = Some(2);
        assert_eq!(set_condition(&mut list, newer), ConditionChange::Updated);
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].reason, "Other");
        assert_eq!(list[0].message, "Other message");
        assert_eq!(list[0].observed_generation, Some(2));
        assert_eq!(list[0].last_transition_time, T0);
    }

    #[test]
    fn a_status_change_is_a_transition_with_the_new_time() {
        let mut list = vec![c("A", ConditionStatus::True, "R", T0)];
        let change = set_condition(&mut list, c("A", ConditionStatus::False, "Off", T1));
        assert_eq!(change, ConditionChange::Transitioned);
        assert!(change.is_transition());
        assert_eq!(list, vec![c("A", ConditionStatus::False, "Off", T1)]);
    }

    #[test]
    fn other_types_are_left_alone_and_in_place() {
        let mut list = vec![
            c("A", ConditionStatus::True, "R", T0),
            c("B", ConditionStatus::False, "R", T0),
            c("C", ConditionStatus::Unknown, "R", T0),
        ];
        set_condition(&mut list, c("B", ConditionStatus::True, "Now", T1));
        assert_eq!(
            list,
            vec![
                c("A", ConditionStatus::True, "R", T0),
                c("B", ConditionStatus::True, "Now", T1),
                c("C", ConditionStatus::Unknown, "R", T0),
            ]
        );
        assert!(is_condition_true(&list, "B"));
        assert!(!is_condition_true(&list, "C"));
        assert!(!is_condition_true(&list, "D"));
        assert!(remove_condition(&mut list, "A"));
        assert!(!remove_condition(&mut list, "A"));
        assert_eq!(
            find_condition(&list, "C").map(|c| c.status),
            Some(ConditionStatus::Unknown)
        );
    }

    #[test]
    fn duplicates_of_a_type_collapse_into_one() {
        let mut list = vec![
            c("A", ConditionStatus::True, "R", T0),
            c("B", ConditionStatus::True, "R", T0),
            c("A", ConditionStatus::False, "R", T0),
        ];
        assert_eq!(
            set_condition(&mut list, c("A", ConditionStatus::True, "R", T1)),
            ConditionChange::Unchanged
        );
        assert_eq!(
            list,
            vec![
                c("A", ConditionStatus::True, "R", T0),
                c("B", ConditionStatus::True, "R", T0)
            ]
        );
    }

    #[test]
    fn the_json_shape_is_metav1_condition() {
        let json = serde_json::to_value(c("AclDisabled", ConditionStatus::True, "R", T0)).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "type": "AclDisabled",
                "status": "True",
                "observedGeneration": 1,
                "lastTransitionTime": T0,
                "reason": "R",
                "message": "R message",
            })
        );
        let mut no_generation = c("A", ConditionStatus::False, "R", T0);
        no_generation.observed_generation = None;
        let json = serde_json::to_value(&no_generation).unwrap();
        assert!(json.get("observedGeneration").is_none());
        let back: Condition = serde_json::from_value(json).unwrap();
        assert_eq!(back, no_generation);
    }
}
