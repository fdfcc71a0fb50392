//! The crash model on hand-made runs: a correct replace has no violating state, and each
//! dropped fsync is caught.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write as _;
use std::path::Path;

use pillar_durable::DurableFs;
use pillar_durable::crash::{Model, Read, check};
use pillar_durable::record::{FsOp, Recorder};

/// temp, write, fsync, rename, fsync dir: the order every pillar path follows.
fn replace(fs: &dyn DurableFs, dir: &Path, name: &str, bytes: &[u8]) {
    let temp = dir.join(format!(".{name}.tmp"));
    let mut file = fs.create_new(&temp, 0o600).unwrap();
    file.write_all(bytes).unwrap();
    file.sync_all().unwrap();
    drop(file);
    fs.rename(&temp, &dir.join(name)).unwrap();
    fs.sync_dir(dir).unwrap();
}

/// Reads `dir/rec` as a value; anything but a whole "value-N" line is refused.
fn reader(root: &Path) -> Read<String> {
    match std::fs::read_to_string(root.join("dir/rec")) {
        Ok(text) if text.starts_with("value-") && text.ends_with('\n') => {
            Read::Value(text.trim().to_owned())
        }
        Ok(text) => Read::Refused(format!("torn: {text:?}")),
        Err(_) => Read::Absent,
    }
}

fn run() -> (tempfile::TempDir, pillar_durable::record::Recording) {
    let root = tempfile::tempdir().unwrap();
    let recorder = Recorder::new(root.path()).unwrap();
    let dir = root.path().join("dir");
    recorder.create_dir_all(&dir).unwrap();
    recorder.sync_dir(root.path()).unwrap();
    for n in 1..=3 {
        // Long enough to be torn at sector granularity.
        let body = format!("value-{n}{}\n", "x".repeat(1200));
        replace(&recorder, &dir, "rec", body.as_bytes());
        recorder.ack();
    }
    (root, recorder.recording())
}

fn values() -> Vec<Option<String>> {
    let mut out = vec![None];
    for n in 1..=3 {
        out.push(Some(format!("value-{n}{}", "x".repeat(1200))));
    }
    out
}

#[test]
fn a_correct_replace_leaves_only_the_old_or_the_new_value() {
    let (_root, recording) = run();
    let scratch = tempfile::tempdir().unwrap();
    let report = check(&recording, Model::SECTOR, &values(), scratch.path(), reader).unwrap();
    assert!(
        report.violations.is_empty(),
        "{report}: {:?}",
        report.violations
    );
    assert_eq!(report.ops, 2 + 3 * 5);
    assert!(report.states > report.ops, "{report}");
    assert_eq!(report.checked, report.states);
}

#[test]
fn a_replace_without_its_directory_fsync_can_lose_an_acknowledged_value() {
    let (_root, recording) = run();
    let broken =
        recording.without(|op| matches!(op, FsOp::FsyncDir { path } if path.ends_with("dir")));
    let scratch = tempfile::tempdir().unwrap();
    let report = check(&broken, Model::SECTOR, &values(), scratch.path(), reader).unwrap();
    let behind = report.violations.iter().find(|v| {
        v.acked > 0 && v.read != Read::Value(values()[v.acked].clone().unwrap_or_default())
    });
    assert!(behind.is_some(), "{report}");
}

#[test]
fn a_replace_without_its_file_fsync_can_install_a_torn_file() {
    let (_root, recording) = run();
    let broken = recording.without(|op| matches!(op, FsOp::Fsync { .. }));
    let scratch = tempfile::tempdir().unwrap();
    let report = check(&broken, Model::SECTOR, &values(), scratch.path(), reader).unwrap();
    assert!(
        report
            .violations
            .iter()
            .any(|v| matches!(&v.read, Read::Refused(why) if why.starts_with("torn"))),
        "{report}"
    );
}

#[test]
fn a_state_without_fsyncs_may_be_the_baseline_and_with_them_must_not() {
    let (_root, recording) = run();
    let first_ack = recording.acks[0];
    let early = recording.states_after(first_ack - 1, Model::SECTOR);
    assert!(
        early
            .iter()
            .any(|s| !s.files.contains_key(Path::new("dir/rec")))
    );
    let acked = recording.states_after(first_ack, Model::SECTOR);
    assert!(
        acked
            .iter()
            .all(|s| s.files.contains_key(Path::new("dir/rec")))
    );
}
