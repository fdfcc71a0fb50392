//! NQN, volume ID, port and namespace ID parsing on arbitrary input: nothing panics, and every
//! accepted value satisfies the rules written in `names.rs` (length, characters, form), so the
//! types can be trusted wherever they flow (configfs paths, `/dev/nvme-fabrics` option lines,
//! file names under the agent's state directory).
//!
//! The unit tests in `names.rs` check the volume -> NQN map on well-formed IDs; here the input is
//! anything a gRPC or CSI caller could send. Bounded for CI: 512 cases per property.
#![allow(clippy::unwrap_used)]

use pillar_nvmet::{
    DISCOVERY_NQN, NQN_MAX_LEN, PILLAR_NQN_PREFIX, UUID_NQN_PREFIX, VOLUME_ID_MAX_LEN,
};
use pillar_nvmet::{HostNqn, NamespaceId, Nqn, PortId, SubsystemNqn, VolumeId};
use proptest::prelude::*;

/// Strings that are mostly almost-NQNs, so the deeper branches of the parser are reached, plus
/// arbitrary Unicode.
fn nqn_like() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "nqn\\.[0-9]{4}-[0-9]{2}\\.[a-z0-9.-]{0,12}:[ -~]{0,40}",
        "nqn\\.2014-08\\.org\\.nvmexpress:uuid:[0-9a-fA-F-]{30,40}",
        "nqn\\.[0-9]{4}-[0-9]{2}\\.[a-z0-9.-]{0,12}:\\PC{0,230}",
        "[ -~]{0,240}",
    ]
}

fn volume_like() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[ -~]{0,140}",
        "[a-zA-Z0-9._-]{0,140}",
        "\\PC{0,20}",
    ]
}

/// The rules of the module documentation, checked on an accepted NQN.
fn nqn_rules_hold(s: &str) -> Result<(), TestCaseError> {
    prop_assert!(
        !s.is_empty() && s.len() <= NQN_MAX_LEN,
        "length {}",
        s.len()
    );
    prop_assert!(
        !s.chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '/' || c == ','),
        "{s:?} holds a character that breaks a path or an options line"
    );
    prop_assert!(s.starts_with("nqn."));
    if let Some(uuid) = s.strip_prefix(UUID_NQN_PREFIX) {
        prop_assert!(
            uuid::Uuid::parse_str(uuid).is_ok() && uuid.len() == 36,
            "{s:?}"
        );
    } else {
        let rest = &s[4..];
        let date = &rest[..7];
        prop_assert!(
            date.as_bytes()[4] == b'-' && rest.as_bytes()[7] == b'.',
            "{s:?}"
        );
        let month: u32 = date[5..].parse().unwrap();
        prop_assert!((1..=12).contains(&month), "{s:?}");
        let (domain, suffix) = rest[8..].split_once(':').unwrap();
        prop_assert!(
            domain.split('.').count() >= 2 && !suffix.is_empty(),
            "{s:?}"
        );
    }
    Ok(())
}

fn volume_rules_hold(s: &str) -> Result<(), TestCaseError> {
    prop_assert!(!s.is_empty() && s.len() <= VOLUME_ID_MAX_LEN);
    prop_assert!(s.as_bytes()[0].is_ascii_alphanumeric(), "{s:?}");
    prop_assert!(
        s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.')),
        "{s:?}"
    );
    // Safe as one path component: no separator, never "." or "..".
    prop_assert!(s != "." && s != ".." && !s.contains('/'));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    // proves I1 (names the identity is derived from are well formed): every accepted NQN obeys
    // the documented rules; nothing panics.
    #[test]
    fn accepted_nqns_obey_the_rules(s in nqn_like()) {
        if let Ok(nqn) = Nqn::parse(&s) {
            prop_assert_eq!(nqn.as_str(), s.as_str());
            nqn_rules_hold(&s)?;
        }
        match SubsystemNqn::parse(&s) {
            Ok(sub) => {
                prop_assert!(s != DISCOVERY_NQN);
                nqn_rules_hold(sub.as_str())?;
                // Only pillar's own NQNs are ever changed, and they map back to their volume.
                if let Ok(volume) = sub.volume_id() {
                    prop_assert!(sub.is_pillar());
                    prop_assert_eq!(volume.subsystem_nqn(), sub);
                } else {
                    prop_assert!(!sub.is_pillar());
                }
            }
            Err(_) => prop_assert!(s == DISCOVERY_NQN || Nqn::parse(&s).is_err()),
        }
        match HostNqn::parse(&s) {
            Ok(h) => nqn_rules_hold(h.as_str())?,
            Err(_) => prop_assert!(s == DISCOVERY_NQN || Nqn::parse(&s).is_err()),
        }
    }

    // proves I1: volume ID -> NQN -> volume ID round-trips, every accepted ID obeys the rules,
    // and its NQN is a valid subsystem NQN that pillar owns.
    #[test]
    fn accepted_volume_ids_obey_the_rules_and_round_trip(s in volume_like()) {
        if let Ok(volume) = VolumeId::parse(&s) {
            prop_assert_eq!(volume.as_str(), s.as_str());
            volume_rules_hold(&s)?;
            let nqn = volume.subsystem_nqn();
            prop_assert_eq!(nqn.as_str(), format!("{PILLAR_NQN_PREFIX}{s}"));
            let reparsed = SubsystemNqn::parse(nqn.as_str()).unwrap();
            prop_assert!(reparsed.is_pillar());
            prop_assert_eq!(reparsed.volume_id().unwrap(), volume);
            nqn_rules_hold(nqn.as_str())?;
        }
        // A subsystem NQN with pillar's prefix and this tail is pillar's exactly when the tail
        // is a volume ID: a foreign or malformed tail is never treated as pillar's.
        if let Ok(sub) = SubsystemNqn::parse(&format!("{PILLAR_NQN_PREFIX}{s}")) {
            prop_assert_eq!(sub.is_pillar(), VolumeId::parse(&s).is_ok());
        }
    }

    // proves I1: distinct volume IDs give distinct NQNs (so distinct identities), including IDs
    // that differ only in case or in a trailing character.
    #[test]
    fn distinct_volume_ids_give_distinct_nqns(
        a in "[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}",
        b in "[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}",
        tweak in 0usize..3,
    ) {
        let b = match tweak {
            0 => b,
            1 => a.to_ascii_uppercase(),
            _ => format!("{}x", &a[..a.len().min(VOLUME_ID_MAX_LEN - 1)]),
        };
        let (Ok(va), Ok(vb)) = (VolumeId::parse(&a), VolumeId::parse(&b)) else {
            return Err(TestCaseError::fail("generated IDs must be valid"));
        };
        prop_assert_eq!(a == b, va.subsystem_nqn() == vb.subsystem_nqn());
    }

    // Port and namespace IDs: accepted only in canonical decimal, in range, and printing back
    // to the input (a configfs directory name is never aliased by "01" or "+1").
    #[test]
    fn numeric_ids_are_canonical(s in prop_oneof!["[0-9+x -]{0,12}", any::<String>()]) {
        if let Ok(p) = PortId::parse(&s) {
            prop_assert_eq!(p.to_string(), s.clone());
        }
        if let Ok(n) = NamespaceId::parse(&s) {
            prop_assert_eq!(n.to_string(), s.clone());
            prop_assert!(n.get() != 0 && n.get() != u32::MAX);
        }
    }
}
