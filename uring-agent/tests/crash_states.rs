//! Every state a power loss may leave of the agent's durable writes, under the crash model of
//! `pillar_durable::crash` (ext4 data=ordered and xfs): fencing marks and snapshot marks (F7,
//! F8), identity records (I4) and the state directory's identity (C6). Each path's real write
//! runs through the synchronous engine (or `StateIdentity`) against a recorder; each state of
//! every prefix of its operations is built on disk and read by the path's real reader, as a
//! restarted agent reads it.
//!
//! The io_uring engine issues the same operations in the same order (open O_EXCL, write,
//! fsync, close; rename, fsync of the directory): `uring_chains_are_the_recorded_operations`
//! checks its chain builders against the recording, so the states found here are its states.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;

use pillar_agent::Hooks;
use pillar_agent::engine::sync::SyncEngine;
use pillar_agent::engine::uring::replace_steps;
use pillar_agent::engine::{DurableStep, Engine};
use pillar_agent::fence::{Mark, MarkStore};
use pillar_agent::state::{Found, StateIdentity};
use pillar_agent::target::{IdentityRecord, Target, TargetConfig};
use pillar_durable::crash::{Model, Read, Report, check};
use pillar_durable::record::{FsOp, Recorder, Recording};
use pillar_nvmet::VolumeId;

fn volume() -> VolumeId {
    VolumeId::parse("pvc-crash").unwrap()
}

fn mark(owner: &str, generation: u64, ended: bool, retired: &[&str]) -> Mark {
    Mark {
        volume: volume().to_string(),
        owner_uid: owner.into(),
        generation,
        ended,
        retired_uids: retired.iter().map(|s| (*s).to_owned()).collect(),
    }
}

/// A lifecycle's marks as the agent moves them: created, bumped, ended, and a new lifecycle
/// retiring the old one.
fn marks() -> Vec<Mark> {
    let old = "0b0a4f3e-1c2d-4e5f-8a9b-0c1d2e3f4a5b";
    let new = "7d6c5b4a-3f2e-4d1c-9b0a-8f7e6d5c4b3a";
    vec![
        mark(old, 1, false, &[]),
        mark(old, 2, false, &[]),
        mark(old, 3, true, &[]),
        mark(new, 1, false, &[old]),
    ]
}

type Opener = fn(&Path) -> MarkStore;

fn open_volumes(state: &Path) -> MarkStore {
    MarkStore::open(state).unwrap()
}

fn open_snapshots(state: &Path) -> MarkStore {
    MarkStore::open_snapshots(state).unwrap()
}

/// The marks written one after the other through the real `MarkStore::write`, recorded from a
/// state directory the store opened (its directory is the durable baseline).
async fn record_marks(open: Opener) -> (Recording, Vec<Option<Mark>>) {
    let root = tempfile::tempdir().unwrap();
    let store = open(&root.path().join("state"));
    let recorder = Recorder::new(root.path()).unwrap();
    let engine = Engine::Sync(SyncEngine::with_fs(Arc::new(recorder.clone())));
    let mut values = vec![None];
    for mark in marks() {
        store.write(&engine, &volume(), &mark).await.unwrap();
        recorder.ack();
        values.push(Some(mark));
    }
    (recorder.recording(), values)
}

/// The restarted agent's mark loader; an error is a refusal (F8).
fn read_mark(open: Opener) -> impl FnMut(&Path) -> Read<Mark> {
    move |root| match open(&root.join("state")).read(&volume()) {
        Ok(Some(mark)) => Read::Value(mark),
        Ok(None) => Read::Absent,
        Err(e) => Read::Refused(e.to_string()),
    }
}

fn scratch_check<V: Clone + PartialEq + std::fmt::Debug>(
    recording: &Recording,
    model: Model,
    values: &[Option<V>],
    read: impl FnMut(&Path) -> Read<V>,
) -> Report<V> {
    let scratch = tempfile::tempdir().unwrap();
    check(recording, model, values, scratch.path(), read).unwrap()
}

fn assert_clean<V: std::fmt::Debug>(what: &str, recording: &Recording, report: &Report<V>) {
    eprintln!("{what}: {report}");
    assert!(
        report.violations.is_empty(),
        "{what}: {report}: {:#?}",
        report.violations
    );
    assert_eq!(report.checked, report.states);
    assert!(report.states > recording.ops.len(), "{what}: {report}");
}

// proves F7: after a crash at any point of a mark update, the restarted agent reads the mark
// acknowledged last or the one being written: never torn, never behind an acknowledged mark
// (the change a mark permits runs only after its write was acknowledged).
#[tokio::test]
async fn every_crash_state_of_a_fencing_mark_reads_as_the_old_or_the_new_mark() {
    for (what, open) in [
        ("volume marks", open_volumes as Opener),
        ("snapshot marks", open_snapshots as Opener),
    ] {
        let (recording, values) = record_marks(open).await;
        let report = scratch_check(&recording, Model::SECTOR, &values, read_mark(open));
        assert_clean(what, &recording, &report);
    }
}

// proves F8: marks renamed into place without the fsync of their temp file leave torn marks
// (the model catches the broken order), and the agent refuses every one of them, in 64-byte steps:
// no torn mark is ever read as a value.
#[tokio::test]
async fn a_mark_renamed_before_its_fsync_is_caught_and_every_torn_mark_is_refused() {
    let (recording, values) = record_marks(open_volumes).await;
    let broken = recording.without(|op| matches!(op, FsOp::Fsync { .. }));
    let report = scratch_check(&broken, Model::FINE, &values, read_mark(open_volumes));
    eprintln!("marks without the file fsync: {report}");
    assert!(
        !report.violations.is_empty(),
        "the broken order must be caught"
    );
    for violation in &report.violations {
        assert!(
            matches!(violation.read, Read::Refused(_)),
            "a torn mark was read as a value: {violation:#?}"
        );
    }
}

// The broken order the other way: without the directory fsync an acknowledged mark can be
// lost, and a delayed request below it would pass the fence.
#[tokio::test]
async fn a_mark_without_its_directory_fsync_is_caught() {
    let (recording, values) = record_marks(open_volumes).await;
    let broken = recording.without(|op| matches!(op, FsOp::FsyncDir { .. }));
    let report = scratch_check(&broken, Model::SECTOR, &values, read_mark(open_volumes));
    assert!(
        report.violations.iter().any(|v| v.acked > 0),
        "an acknowledged mark must be losable without the directory fsync: {report}"
    );
}

fn identity(n: u8) -> IdentityRecord {
    IdentityRecord {
        uuid: format!("{n:08x}-1c2d-4e5f-8a9b-0c1d2e3f4a5b"),
        nguid: "00000000000000000000000000000000".into(),
        serial: format!("kernel-random-{n}"),
    }
}

fn open_target(state: &Path, double: &Path) -> Target {
    let config = TargetConfig::Double {
        root: double.to_path_buf(),
    };
    Target::open(
        &config,
        Arc::new(Engine::Sync(SyncEngine::new())),
        state,
        Hooks::default(),
    )
    .unwrap()
}

// proves I4: after a crash at any point of recording, replacing or forgetting an adopted
// identity, the restarted agent reads the record acknowledged last or the one being written;
// never a torn one.
#[tokio::test]
async fn every_crash_state_of_an_identity_record_reads_as_the_old_or_the_new_record() {
    let root = tempfile::tempdir().unwrap();
    let double = tempfile::tempdir().unwrap();
    open_target(&root.path().join("state"), double.path());
    let recorder = Recorder::new(root.path()).unwrap();
    let engine = Engine::Sync(SyncEngine::with_fs(Arc::new(recorder.clone())));
    let target = Target::open(
        &TargetConfig::Double {
            root: double.path().to_path_buf(),
        },
        Arc::new(engine),
        &root.path().join("state"),
        Hooks::default(),
    )
    .unwrap();
    let mut values = vec![None];
    for n in [1, 2] {
        target
            .record_identity(&volume(), &identity(n))
            .await
            .unwrap();
        recorder.ack();
        values.push(Some(identity(n)));
    }
    target.forget_identity(&volume()).await.unwrap();
    recorder.ack();
    values.push(None);
    let recording = recorder.recording();
    let report = scratch_check(&recording, Model::SECTOR, &values, |state_root| {
        let target = open_target(&state_root.join("state"), double.path());
        match target.identity_record(&volume()) {
            Ok(Some(record)) => Read::Value(record),
            Ok(None) => Read::Absent,
            Err(e) => Read::Refused(e.to_string()),
        }
    });
    assert_clean("identity records", &recording, &report);
}

/// The state identity's loader as the agent runs it at start: a present identity is its
/// value; an absent one is no identity (the scan of what the node holds decides); a corrupt
/// one is a lost state (C6: the agent refuses until a resync).
fn read_state_id(root: &Path) -> Read<String> {
    let state = root.join("state");
    match StateIdentity::open(&state) {
        Ok((_, Found::Present)) => {
            let text = std::fs::read_to_string(state.join("state-id")).unwrap();
            Read::Value(text.trim().to_owned())
        }
        Ok((_, Found::Absent)) => Read::Absent,
        Ok((_, Found::Corrupt)) => Read::Refused("corrupt: the state counts as lost".into()),
        Err(e) => Read::Refused(e.to_string()),
    }
}

async fn record_state_ids() -> (Recording, Vec<Option<String>>) {
    let root = tempfile::tempdir().unwrap();
    let state = root.path().join("state");
    let recorder = Recorder::new(root.path()).unwrap();
    let current = || {
        Some(
            std::fs::read_to_string(state.join("state-id"))
                .unwrap()
                .trim()
                .to_owned(),
        )
    };
    let (identity, _) = StateIdentity::open_with(&state, Arc::new(recorder.clone())).unwrap();
    recorder.ack();
    let mut values = vec![None, current()];
    for _ in 0..2 {
        identity.renew().unwrap();
        recorder.ack();
        values.push(current());
    }
    (recorder.recording(), values)
}

// proves C6: after a crash at any point of writing the state identity (the first start, and
// the renewals after a loss), the restarted agent reads the identity acknowledged last or the
// one being written; a torn identity is never taken for an intact one.
#[tokio::test]
async fn every_crash_state_of_the_state_identity_reads_as_the_old_or_the_new_identity() {
    let (recording, values) = record_state_ids().await;
    let report = scratch_check(&recording, Model::SECTOR, &values, read_state_id);
    assert_clean("state identity", &recording, &report);
    let broken = recording.without(|op| matches!(op, FsOp::Fsync { .. }));
    let report = scratch_check(&broken, Model::FINE, &values, read_state_id);
    assert!(
        !report.violations.is_empty(),
        "the broken order must be caught"
    );
    for violation in &report.violations {
        assert!(
            matches!(violation.read, Read::Refused(_)),
            "a torn identity was read as a value: {violation:#?}"
        );
    }
}

/// The engine step a recorded operation is (closing is not recorded: it changes nothing on
/// disk).
fn step_of(op: &FsOp) -> Option<DurableStep> {
    match op {
        FsOp::Create { .. } => Some(DurableStep::Open),
        FsOp::Write { .. } => Some(DurableStep::Write),
        FsOp::Fsync { .. } => Some(DurableStep::Fsync),
        FsOp::Rename { .. } => Some(DurableStep::Rename),
        FsOp::FsyncDir { .. } => Some(DurableStep::FsyncDir),
        FsOp::Unlink { .. } => Some(DurableStep::Unlink),
        FsOp::Mkdir { .. } | FsOp::Truncate { .. } => None,
    }
}

// The io_uring engine chains a replace as the synchronous engine issues it, so the crash
// states above are its states too. A grouped replace leaves out its directory fsync; its
// group's one fsync follows every member's rename before any member is answered (engine.rs
// proves the answer waits), which is the recorded order for each member.
#[tokio::test]
async fn uring_chains_are_the_recorded_operations() {
    let (recording, _) = record_marks(open_volumes).await;
    let first = &recording.ops[..recording.acks[0]];
    let recorded: Vec<DurableStep> = first.iter().filter_map(step_of).collect();
    let chained: Vec<DurableStep> = replace_steps(false)
        .into_iter()
        .filter(|s| *s != DurableStep::Close)
        .collect();
    assert_eq!(recorded, chained);
    assert_eq!(
        replace_steps(true),
        DurableStep::REPLACE[..5],
        "a grouped replace ends at its rename"
    );
}
