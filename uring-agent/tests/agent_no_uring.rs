//! Where io_uring is unavailable, as under a container runtime's default seccomp profile, the
//! agent refuses to start with the io_uring engine and says what to do; with `--engine sync` it
//! serves. The profile is reproduced with a seccomp filter that fails `io_uring_setup` with
//! EPERM in the agent process only.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter};
use support::{Dirs, connect};

fn no_io_uring_filter() -> BpfProgram {
    let rules = BTreeMap::from([(libc::SYS_io_uring_setup, vec![])]);
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(u32::try_from(libc::EPERM).unwrap()),
        std::env::consts::ARCH.try_into().unwrap(),
    )
    .unwrap();
    filter.try_into().unwrap()
}

fn agent(dirs: &Dirs, engine: &str) -> Command {
    let filter = no_io_uring_filter();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pillar-agent"));
    cmd.args(["--state-dir", dirs.state().to_str().unwrap()])
        .args(["--listen", &format!("unix://{}", dirs.socket().display())])
        .args([
            "--engine",
            engine,
            "--target",
            "test-double",
            "--insecure-plaintext",
        ])
        .args(["--pool", &format!("p1=file:{}", dirs.pool().display())])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: runs in the forked child before exec; it only makes the prctl/seccomp syscalls on
    // a filter built before the fork, allocating nothing.
    unsafe {
        cmd.pre_exec(move || seccompiler::apply_filter(&filter).map_err(std::io::Error::other));
    }
    cmd
}

#[tokio::test]
async fn without_io_uring_the_agent_says_so_and_the_sync_engine_serves() {
    let dirs = Dirs::new();
    let out = agent(&dirs, "io_uring").output().unwrap();
    assert!(
        !out.status.success(),
        "the agent must not start without io_uring"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("io_uring is unavailable"), "{stderr}");
    assert!(
        stderr.contains("--engine sync"),
        "the error names the way out: {stderr}"
    );

    let mut child = agent(&dirs, "sync").spawn().unwrap();
    let mut client = tokio::time::timeout(Duration::from_secs(20), connect(&dirs.socket()))
        .await
        .expect("the sync engine serves");
    let caps = client
        .get_capabilities(pillar_agent_api::v1::GetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.engine, "sync");
    let _ = child.kill();
    let _ = child.wait();
}
