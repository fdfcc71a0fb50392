//! Records pillar reads back from its own disk, where a crash, a full disk or an operator can
//! leave any bytes: the agent's fencing mark (`pillar_agent::fence`, also the format of the
//! snapshots' marks), the agent's identity record (`IdentityRecord`) and the node plugin's
//! stage record (`pillar_host`).
//!
//! The first input byte chooses the record; the rest is the file. Properties:
//! - Decoding arbitrary bytes never panics; a value it yields is valid (the fencing mark
//!   belongs to the volume asked for and has an owner; the identity's parts parse; the stage
//!   record's names re-parse to themselves), re-encodes within a bound of the input, and the
//!   re-encoded form decodes equal.
//! - Fencing mark and identity record: a value built from the input (any strings) encodes to a
//!   form that decodes equal (the mark), or decodes exactly when the value is valid (identity).

use pillar_agent::fence::{self, Mark};
use pillar_agent::target::IdentityRecord;
use pillar_host::stage_fuzzing as stage;
use pillar_nvmet::{HostNqn, Serial, SubsystemNqn, VolumeId};

/// The volume the fencing marks are read for.
pub const MARK_VOLUME: &str = "pvc-1";

pub fn check(data: &[u8]) {
    let Some((&which, file)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => fencing_mark(file),
        1 => identity_record(file),
        _ => stage_record(file),
    }
}

fn fencing_mark(file: &[u8]) {
    let volume = VolumeId::parse(MARK_VOLUME).expect("a valid volume ID");
    if let Ok(mark) = fence::decode(&volume, file) {
        assert_eq!(
            mark.volume, MARK_VOLUME,
            "a mark of another volume accepted"
        );
        assert!(!mark.owner_uid.is_empty(), "a mark without owner accepted");
        let again = fence::encode(&mark).expect("a decoded mark encodes");
        assert!(
            again.len() <= crate::bound(file.len()),
            "{} bytes",
            again.len()
        );
        assert_eq!(fence::decode(&volume, &again).as_ref(), Ok(&mark));
    }
    // Any strings round-trip through the checksummed form.
    let text = String::from_utf8_lossy(file);
    let mut parts = text.split('\u{1}');
    let owner = parts.next().unwrap_or_default();
    let generation = file
        .iter()
        .fold(0u64, |g, b| g.rotate_left(8) ^ u64::from(*b));
    let built = Mark {
        volume: MARK_VOLUME.to_owned(),
        owner_uid: if owner.is_empty() { "o" } else { owner }.to_owned(),
        generation,
        ended: generation & 1 == 1,
        retired_uids: parts.map(str::to_owned).collect(),
    };
    let bytes = fence::encode(&built).expect("a mark encodes");
    assert_eq!(fence::decode(&volume, &bytes), Ok(built));
}

fn identity_record(file: &[u8]) {
    if let Ok(record) = IdentityRecord::decode(file) {
        assert!(record.namespace().is_ok(), "{record:?}");
        assert!(Serial::parse(&record.serial).is_ok(), "{record:?}");
        let again = record.encode().expect("a decoded record encodes");
        assert!(
            again.len() <= crate::bound(file.len()),
            "{} bytes",
            again.len()
        );
        assert_eq!(IdentityRecord::decode(&again).as_ref(), Ok(&record));
    }
    let text = String::from_utf8_lossy(file);
    let mut parts = text.split('\u{1}').map(str::to_owned);
    let built = IdentityRecord {
        uuid: parts.next().unwrap_or_default(),
        nguid: parts.next().unwrap_or_default(),
        serial: parts.next().unwrap_or_default(),
    };
    let valid = built.namespace().is_ok() && Serial::parse(&built.serial).is_ok();
    let bytes = built.encode().expect("a record encodes");
    match IdentityRecord::decode(&bytes) {
        Ok(decoded) => {
            assert!(valid, "an invalid record read back: {built:?}");
            assert_eq!(decoded, built);
        }
        Err(reason) => assert!(!valid, "a valid record {built:?} refused: {reason}"),
    }
}

fn stage_record(file: &[u8]) {
    let Ok(record) = stage::decode(file) else {
        return;
    };
    assert_eq!(
        VolumeId::parse(record.volume.as_str()).as_ref(),
        Ok(&record.volume)
    );
    assert_eq!(
        SubsystemNqn::parse(record.nqn.as_str()).as_ref(),
        Ok(&record.nqn)
    );
    assert_eq!(
        HostNqn::parse(record.hostnqn.as_str()).as_ref(),
        Ok(&record.hostnqn)
    );
    let again = stage::encode(&record).expect("a decoded record encodes");
    assert!(
        again.len() <= crate::bound(file.len()),
        "{} bytes",
        again.len()
    );
    let decoded = stage::decode(&again).expect("a re-encoded record decodes");
    assert_eq!(decoded, record);
}
