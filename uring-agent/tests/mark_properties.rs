//! Fencing marks on disk (F7, F8, C4): whatever bytes a mark file holds, reading it never
//! panics and gives either a mark or the typed corruption error, never a guessed value; every
//! mark round-trips through its encoding; and damage to an encoded mark is caught.
//!
//! Bounded for CI: 256 cases of arbitrary bytes, 256 round trips, and every single-bit flip of
//! 24 encoded marks (about 60 000 decodes).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pillar_agent::fence::{Mark, MarkError, MarkStore, decode, encode};
use pillar_nvmet::VolumeId;
use proptest::prelude::*;

fn volume() -> VolumeId {
    VolumeId::parse("vol-p").unwrap()
}

/// Lifecycle UIDs as Kubernetes issues them (UUIDs).
fn k8s_uid() -> impl Strategy<Value = String> + Clone {
    any::<u128>().prop_map(|u| uuid::Uuid::from_u128(u).hyphenated().to_string())
}

/// A mark with Kubernetes-shaped UIDs: what the agent writes in practice.
fn mark_with(uid: impl Strategy<Value = String> + Clone) -> impl Strategy<Value = Mark> + Clone {
    (
        uid.clone(),
        any::<u64>(),
        any::<bool>(),
        prop::collection::vec(uid, 0..4),
    )
        .prop_map(|(owner_uid, generation, ended, retired_uids)| Mark {
            volume: volume().to_string(),
            owner_uid,
            generation,
            ended,
            retired_uids,
        })
}

/// Any non-empty UID at all, control characters and non-ASCII included: the mark format must not
/// depend on what the controller sends.
fn any_uid() -> impl Strategy<Value = String> + Clone {
    prop_oneof![
        k8s_uid(),
        "\\PC{1,12}",
        any::<String>().prop_filter("non-empty", |s| !s.is_empty())
    ]
}

/// Encoded marks and near-marks, so arbitrary input also reaches the checksum and field checks.
fn mark_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..400),
        mark_with(any_uid()).prop_flat_map(|m| {
            let bytes = encode(&m).unwrap();
            let len = bytes.len();
            (Just(bytes), 0..len, any::<u8>()).prop_map(|(mut b, i, v)| {
                b[i] = v;
                b
            })
        }),
        mark_with(any_uid()).prop_flat_map(|m| {
            let bytes = encode(&m).unwrap();
            let len = bytes.len();
            (Just(bytes), 0..=len).prop_map(|(b, cut)| b[..cut].to_vec())
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    // proves F8, C4: arbitrary bytes in a mark file never panic the reader; they give a mark
    // that verifies (it belongs to this volume and has an owner) or MarkError::Corrupt.
    #[test]
    fn any_bytes_decode_to_a_verified_mark_or_a_corruption_error(bytes in mark_bytes()) {
        let dir = tempfile::tempdir().unwrap();
        let store = MarkStore::open(dir.path()).unwrap();
        std::fs::write(dir.path().join("generations").join("vol-p.json"), &bytes).unwrap();
        match store.read(&volume()) {
            Ok(Some(mark)) => {
                prop_assert_eq!(mark.volume.as_str(), "vol-p");
                prop_assert!(!mark.owner_uid.is_empty());
                // Only the canonical content verifies: re-encoding gives the same value back.
                prop_assert_eq!(decode(&volume(), &encode(&mark).unwrap()).unwrap(), mark);
            }
            Ok(None) => prop_assert!(false, "a mark file that exists is never 'no mark'"),
            Err(MarkError::Corrupt { reason, .. }) => prop_assert!(!reason.is_empty()),
            Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
        }
    }

    // proves F7 (what is written is what is read back): encode -> decode is the identity, for
    // any UID text.
    #[test]
    fn encode_decode_round_trips(mark in mark_with(any_uid())) {
        let bytes = encode(&mark).unwrap();
        prop_assert_eq!(decode(&volume(), &bytes).unwrap(), mark);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    // proves F8: every single-bit flip anywhere in an encoded mark (as the agent writes it, with
    // Kubernetes UIDs) is detected: the mark is refused, never read as another value.
    #[test]
    fn every_single_bit_flip_is_detected(mark in mark_with(k8s_uid())) {
        let bytes = encode(&mark).unwrap();
        for bit in 0..bytes.len() * 8 {
            let mut damaged = bytes.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(
                decode(&volume(), &damaged).is_err(),
                "flip of bit {} (byte {:?}) went unnoticed",
                bit,
                bytes[bit / 8] as char
            );
        }
    }

    // proves F8 for arbitrary UID text: a flip may land where JSON has two spellings of one
    // value (the case of a hex digit in a \u escape), which the value checksum cannot see; such
    // a flip must still decode to exactly the same mark. No flip ever yields another value.
    #[test]
    fn no_single_bit_flip_changes_the_value(mark in mark_with(any_uid())) {
        let bytes = encode(&mark).unwrap();
        for bit in 0..bytes.len() * 8 {
            let mut damaged = bytes.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            if let Ok(read) = decode(&volume(), &damaged) {
                prop_assert_eq!(&read, &mark, "flip of bit {} changed the mark", bit);
            }
        }
    }
}
