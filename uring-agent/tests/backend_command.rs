//! SystemRunner against real processes.
//!
//! Requirement (issue 3 item 6): external commands time out, and their failures are reported
//! with their stderr.

#![allow(clippy::unwrap_used)]

use std::error::Error as _;
use std::time::{Duration, Instant};

use pillar_agent::backend::command::STDERR_LIMIT;
use pillar_agent::backend::{CommandError, CommandRunner, SystemRunner};

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| (*s).to_owned()).collect()
}

/// State letter of a process from /proc/<pid>/stat, or None if it no longer exists.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

// Requirement: a command that runs too long is reported as a timeout, promptly, and killed.
#[tokio::test]
async fn a_slow_command_times_out_and_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    let script = format!("echo $$ > {}; exec sleep 5", pid_file.display());
    let runner = SystemRunner::new(Duration::from_millis(100));
    let started = Instant::now();
    let err = runner.run("sh", &args(&["-c", &script])).await.unwrap_err();
    let elapsed = started.elapsed();
    assert!(
        matches!(&err, CommandError::Timeout { program, after }
            if program == "sh" && *after == Duration::from_millis(100)),
        "{err:?}"
    );
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
    assert!(err.to_string().contains("100ms"), "{err}");

    let pid: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match process_state(pid) {
            None | Some('Z') => break,
            Some(state) if Instant::now() >= deadline => {
                panic!("timed-out command {pid} still running (state {state})")
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

// Requirement: a failing command's error carries its exit status and its (trimmed) stderr.
#[tokio::test]
async fn a_failing_command_reports_its_stderr() {
    let runner = SystemRunner::default();
    let err = runner
        .run(
            "sh",
            &args(&[
                "-c",
                "echo ignored; echo '  Volume group \"vg0\" not found' >&2; exit 5",
            ]),
        )
        .await
        .unwrap_err();
    match &err {
        CommandError::Failed {
            program,
            status,
            stderr,
        } => {
            assert_eq!(program, "sh");
            assert_eq!(status, "exit status: 5");
            assert_eq!(stderr, "Volume group \"vg0\" not found");
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("Volume group \"vg0\" not found"));
}

// Requirement: stderr in errors is bounded to a few KB.
#[tokio::test]
async fn a_huge_stderr_is_cut() {
    let runner = SystemRunner::default();
    let err = runner
        .run(
            "sh",
            &args(&["-c", "head -c 100000 /dev/zero | tr '\\0' x >&2; exit 1"]),
        )
        .await
        .unwrap_err();
    let CommandError::Failed { stderr, .. } = err else {
        panic!("{err:?}");
    };
    assert!(stderr.len() <= STDERR_LIMIT + 3, "{}", stderr.len());
    assert!(stderr.starts_with("xxxx") && stderr.ends_with("..."));
}

#[tokio::test]
async fn success_returns_stdout() {
    let runner = SystemRunner::default();
    let out = runner.run("printf", &args(&["a\\tb\\n"])).await.unwrap();
    assert_eq!(out.stdout, b"a\tb\n");
}

// Arguments reach the program as they are: no shell interprets them.
#[tokio::test]
async fn arguments_are_not_interpreted_by_a_shell() {
    let runner = SystemRunner::default();
    let tricky = "$(echo pwned); `id` > /tmp/x * 'q'";
    let out = runner.run("printf", &args(&["%s", tricky])).await.unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), tricky);
}

#[tokio::test]
async fn a_missing_program_is_a_spawn_error() {
    let runner = SystemRunner::default();
    let err = runner
        .run("/nonexistent/pillar-lvm", &[])
        .await
        .unwrap_err();
    assert!(
        matches!(&err, CommandError::Spawn { program, .. } if program == "/nonexistent/pillar-lvm"),
        "{err:?}"
    );
    assert!(err.source().is_some());
}

#[tokio::test]
async fn commands_run_in_the_c_locale_without_stdin() {
    let runner = SystemRunner::default();
    let out = runner
        .run("sh", &args(&["-c", "printf %s \"$LC_ALL\"; cat"]))
        .await
        .unwrap();
    // `cat` read an empty stdin (/dev/null) instead of waiting for input.
    assert_eq!(out.stdout, b"C");
}
