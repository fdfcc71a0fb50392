//! Every state a power loss may leave of the node plugin's stage records (N2, C4), under the
//! crash model of `pillar_durable::crash` (ext4 data=ordered and xfs): the real
//! `StageStore::write` and `remove` run against a recorder, and a restarted plugin's
//! `StageStore::open` + `read` runs on every state of every prefix of their operations.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pillar_durable::crash::{Model, Read, Report, check};
use pillar_durable::record::{FsOp, Recorder, Recording};
use pillar_host::{FsType, StageMode, StagePhase, StageRecord, StageStore};
use pillar_nvmet::{HostNqn, VolumeId};

fn volume() -> VolumeId {
    VolumeId::parse("pvc-crash").unwrap()
}

fn record(phase: StagePhase) -> StageRecord {
    let volume = volume();
    StageRecord {
        nqn: volume.subsystem_nqn(),
        volume,
        hostnqn: HostNqn::parse(
            "nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6",
        )
        .unwrap(),
        traddr: "192.0.2.10".parse().unwrap(),
        trsvcid: 4420,
        device: (phase != StagePhase::Connecting).then(|| "nvme0n1".to_owned()),
        staging_path: PathBuf::from("/var/lib/kubelet/plugins/kubernetes.io/csi/pillar/g/mount"),
        mode: StageMode::Filesystem {
            fs_type: FsType::Xfs,
        },
        phase,
        reservation: true,
    }
}

const PHASES: [StagePhase; 4] = [
    StagePhase::Connecting,
    StagePhase::Connected,
    StagePhase::Formatted,
    StagePhase::Mounted,
];

/// A stage through every phase and the unstage's removal, as the node plugin writes them,
/// recorded from an empty state directory; and the value each acknowledged write left.
fn stage_and_unstage() -> (Recording, Vec<Option<StageRecord>>) {
    let root = tempfile::tempdir().unwrap();
    let recorder = Recorder::new(root.path()).unwrap();
    let store =
        StageStore::open_with(&root.path().join("state"), Arc::new(recorder.clone())).unwrap();
    let mut values = vec![None];
    for phase in PHASES {
        store.write(&record(phase)).unwrap();
        recorder.ack();
        values.push(Some(record(phase)));
    }
    store.remove(&volume()).unwrap();
    recorder.ack();
    values.push(None);
    (recorder.recording(), values)
}

/// A restarted node plugin: opens the store (removing a crash's temp files) and reads the
/// volume's record; an error is a refusal (C4).
fn restart_and_read(root: &Path) -> Read<StageRecord> {
    let store = match StageStore::open(&root.join("state")) {
        Ok(store) => store,
        Err(e) => return Read::Refused(e.to_string()),
    };
    match store.read(&volume()) {
        Ok(Some(record)) => Read::Value(record),
        Ok(None) => Read::Absent,
        Err(e) => Read::Refused(e.to_string()),
    }
}

fn run(recording: &Recording, values: &[Option<StageRecord>], model: Model) -> Report<StageRecord> {
    let scratch = tempfile::tempdir().unwrap();
    check(recording, model, values, scratch.path(), restart_and_read).unwrap()
}

// proves N2: after a crash at any point of a stage or an unstage, a restarted plugin reads the
// last acknowledged record or the one being written, never a torn or an older one.
#[test]
fn every_crash_state_of_the_stage_records_reads_as_the_old_or_the_new_record() {
    let (recording, values) = stage_and_unstage();
    let report = run(&recording, &values, Model::SECTOR);
    eprintln!("stage records: {report}");
    assert!(
        report.violations.is_empty(),
        "{report}: {:#?}",
        report.violations
    );
    assert_eq!(report.checked, report.states);
    assert!(report.states > recording.ops.len());
}

// proves C4: the stage records written without the fsync of the temp file leave torn records
// (the model catches the broken order), and every one the plugin refuses: no torn record is
// ever read as a value, in 64-byte steps.
#[test]
fn a_stage_record_renamed_before_its_fsync_is_caught_and_every_torn_record_is_refused() {
    let (recording, values) = stage_and_unstage();
    let broken = recording.without(|op| matches!(op, FsOp::Fsync { .. }));
    let report = run(&broken, &values, Model::FINE);
    eprintln!("stage records without the file fsync: {report}");
    assert!(
        !report.violations.is_empty(),
        "the broken order must be caught"
    );
    for violation in &report.violations {
        assert!(
            matches!(violation.read, Read::Refused(_)),
            "a torn record was read as a value: {violation:#?}"
        );
    }
}

// The broken order the other way: without the directory fsync an acknowledged phase can be
// lost (the plugin would unstage from an older phase).
#[test]
fn a_stage_record_without_its_directory_fsync_is_caught() {
    let (recording, values) = stage_and_unstage();
    let broken =
        recording.without(|op| matches!(op, FsOp::FsyncDir { path } if path.ends_with("staged")));
    let report = run(&broken, &values, Model::SECTOR);
    // A violation reads neither the acknowledged record nor the next one.
    assert!(
        report.violations.iter().any(|v| v.acked > 0),
        "an acknowledged record must be losable without the directory fsync: {report}"
    );
}
