//! The `pillar-local` binary end to end: the single-machine mode on the configfs test double
//! runs its main job (create, publish, stage with mkfs and mount, publish, write and verify
//! data, stats, teardown) through the real CSI sockets, and says it runs on the double.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

#[test]
fn the_main_job_runs_through_the_binary_and_names_the_double() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pillar-local"))
        .arg("--dir")
        .arg(dir.path())
        .args(["--test-double", "--demo", "--engine", "sync"])
        .output()
        .expect("pillar-local runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("configfs TEST DOUBLE"), "{stdout}");
    assert!(stdout.contains("NodeStageVolume (mkfs, mount)"), "{stdout}");
    assert!(stdout.contains("main job: OK"), "{stdout}");
    // Nothing is left mounted or attached under the directory.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&dir.path().display().to_string()),
        "a mount was left behind"
    );
}
