//! The `pillar-local` binary end to end: the single-machine mode on the configfs test double
//! runs its main job (create, publish, stage with mkfs and mount, publish, write and verify
//! data, stats, teardown) through the real CSI sockets, and says it runs on the double.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

/// `pillar-local --demo` on the test double in `dir`; fails unless it succeeds. Its stdout.
fn run_demo(dir: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_pillar-local"))
        .arg("--dir")
        .arg(dir)
        .args(["--test-double", "--demo", "--engine", "sync"])
        .output()
        .expect("pillar-local runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    stdout
}

#[test]
fn the_main_job_runs_through_the_binary_and_names_the_double() {
    let dir = tempfile::tempdir().unwrap();
    let stdout = run_demo(dir.path());
    assert!(stdout.contains("configfs TEST DOUBLE"), "{stdout}");
    assert!(stdout.contains("NodeStageVolume (mkfs, mount)"), "{stdout}");
    assert!(stdout.contains("main job: OK"), "{stdout}");
    assert!(stdout.contains("auth:       none"), "{stdout}");
    // Nothing is left mounted or attached under the directory.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&dir.path().display().to_string()),
        "a mount was left behind"
    );
}

/// A store an earlier run left with the default protocol (DH-HMAC-CHAP, for which no kubelet
/// here carries a node-stage secret: on a real kernel every stage was refused) gets `auth:
/// none`, keeping the rest of what it says (here a `ctrl_loss_tmo` of its own), and the main
/// job runs.
#[test]
fn an_earlier_runs_dhchap_protocol_is_replaced_by_auth_none() {
    use pillar_state::EmbeddedStore;
    use pillar_state::crd::{NvmeTcp, PillarProtocolSpec, ProtocolAuth};
    use pillar_state::store::StateStore;

    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store_dir = dir.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    rt.block_on(async {
        let store = EmbeddedStore::open(&store_dir).await.unwrap();
        let earlier = PillarProtocolSpec {
            nvme_tcp: NvmeTcp {
                acl: true,
                ctrl_loss_tmo: 77,
                ..NvmeTcp::default()
            },
        };
        assert_eq!(earlier.nvme_tcp.auth, ProtocolAuth::Dhchap);
        store.create_protocol("nvme-tcp", earlier).await.unwrap();
    });
    let stdout = run_demo(dir.path());
    assert!(stdout.contains("main job: OK"), "{stdout}");
    rt.block_on(async {
        let store = EmbeddedStore::open(&store_dir).await.unwrap();
        let now = store.get_protocol("nvme-tcp").await.unwrap().unwrap();
        assert_eq!(now.spec.nvme_tcp.auth, ProtocolAuth::None);
        assert!(now.spec.nvme_tcp.acl, "the ACL stays on");
        assert_eq!(now.spec.nvme_tcp.ctrl_loss_tmo, 77, "the rest is kept");
        let mut want = pillar_local::local_protocol();
        want.nvme_tcp.ctrl_loss_tmo = 77;
        assert_eq!(now.spec, want);
    });
}
