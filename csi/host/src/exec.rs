//! Runs a tool (blkid, mkfs, resize2fs, xfs_growfs) with an argv, no shell, a closed stdin, a
//! fixed C locale, and a deadline after which the child is killed.

use std::ffi::OsStr;
use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::HostError;

/// What a finished child left behind.
#[derive(Debug)]
pub(crate) struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Longest stderr kept in an error message.
const STDERR_KEEP: usize = 4096;
/// Most stderr read from a child (bounded memory whatever the tool prints).
const STDERR_READ: u64 = 1 << 20;

/// Runs `program args...` and waits at most `timeout`. A non-zero exit is not an error here:
/// callers that care use [`run_ok`] or look at the status themselves.
pub(crate) fn run(program: &str, args: &[&OsStr], timeout: Duration) -> Result<Output, HostError> {
    run_capped(program, args, timeout, u64::MAX)
}

/// Like [`run`], but keeps at most `stdout_cap` bytes of stdout and then closes the pipe: a tool
/// whose answer comes first and whose output can be as large as the device (a log dump) is
/// ended by SIGPIPE instead of filling memory. Its exit status then says so; the caller decides
/// from what it kept.
pub(crate) fn run_capped(
    program: &str,
    args: &[&OsStr],
    timeout: Duration,
    stdout_cap: u64,
) -> Result<Output, HostError> {
    tracing::debug!(program, ?args, "running");
    let mut child = Command::new(program)
        .args(args)
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| HostError::Spawn {
            program: program.to_owned(),
            source,
        })?;
    // Drain both pipes on their own threads so a chatty child never blocks on a full pipe.
    let stdout = drain(child.stdout.take(), stdout_cap);
    let stderr = drain(child.stderr.take(), STDERR_READ);
    let status = wait_with_deadline(&mut child, program, timeout)?;
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

/// Like [`run`], but a non-zero exit is [`HostError::CommandFailed`] carrying stderr.
pub(crate) fn run_ok(
    program: &str,
    args: &[&OsStr],
    timeout: Duration,
) -> Result<Output, HostError> {
    let out = run(program, args, timeout)?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(failed(program, args, &out))
    }
}

/// The error for a child that exited unsuccessfully.
pub(crate) fn failed(program: &str, args: &[&OsStr], out: &Output) -> HostError {
    let mut stderr = out.stderr.trim().to_owned();
    if stderr.is_empty() {
        stderr = out.stdout.trim().to_owned();
    }
    if stderr.len() > STDERR_KEEP {
        let mut cut = STDERR_KEEP;
        while !stderr.is_char_boundary(cut) {
            cut -= 1;
        }
        stderr.truncate(cut);
        stderr.push_str("...");
    }
    HostError::CommandFailed {
        program: program.to_owned(),
        args: args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
        status: out.status.to_string(),
        stderr,
    }
}

/// Reads at most `cap` bytes of `pipe`, then drops it (the child's next write fails with EPIPE).
/// Most lines of a tool's own error kept by [`failed_briefly`].
const BRIEF_LINES: usize = 3;

/// Like [`failed`], but keeps only the tool's first error lines: those before its usage text
/// (mkfs.xfs prints one line of error and then 28 lines of usage), at most [`BRIEF_LINES`],
/// joined on one line. The whole text stays in the debug log.
pub(crate) fn failed_briefly(program: &str, args: &[&OsStr], out: &Output) -> HostError {
    let mut err = failed(program, args, out);
    if let HostError::CommandFailed { stderr, .. } = &mut err {
        tracing::debug!(program, output = %stderr, "tool failed");
        *stderr = first_error_lines(stderr);
    }
    err
}

/// The non-empty lines before a line starting `Usage:`, at most [`BRIEF_LINES`], joined by
/// "; "; the first line when the text starts with the usage.
fn first_error_lines(text: &str) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:"))
        .filter(|l| !l.is_empty())
        .take(BRIEF_LINES)
        .collect();
    if lines.is_empty() {
        text.lines().next().unwrap_or_default().trim().to_owned()
    } else {
        lines.join("; ")
    }
}

fn drain<R: Read + Send + 'static>(pipe: Option<R>, cap: u64) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(pipe) = pipe {
            // A read error only loses diagnostics; the exit status still decides.
            let _ = pipe.take(cap).read_to_end(&mut buf);
        }
        String::from_utf8_lossy(&buf).into_owned()
    })
}

fn wait_with_deadline(
    child: &mut Child,
    program: &str,
    timeout: Duration,
) -> Result<ExitStatus, HostError> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(2);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status),
            Ok(None) => {}
            Err(source) => {
                return Err(HostError::Wait {
                    program: program.to_owned(),
                    source,
                });
            }
        }
        let now = Instant::now();
        if now >= deadline {
            tracing::warn!(program, ?timeout, "child timed out; killing it");
            // The child may have exited between try_wait and kill; either way reap it.
            let _ = child.kill();
            let _ = child.wait();
            return Err(HostError::CommandTimedOut {
                program: program.to_owned(),
                timeout,
            });
        }
        thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captures_output_and_status() {
        let out = run(
            "sh",
            &[
                OsStr::new("-c"),
                OsStr::new("echo out; echo err >&2; exit 3"),
            ],
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(out.stdout, "out\n");
        assert_eq!(out.stderr, "err\n");
    }

    #[test]
    fn failure_reports_stderr() {
        let err = run_ok(
            "sh",
            &[OsStr::new("-c"), OsStr::new("echo boom >&2; exit 1")],
            Duration::from_secs(10),
        )
        .unwrap_err();
        match err {
            HostError::CommandFailed { stderr, .. } => assert_eq!(stderr, "boom"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn brief_errors_stop_before_the_usage() {
        let mkfs_xfs = "Filesystem must be larger than 300MB.\nUsage: mkfs.xfs\n/* blocksize */\t\t[-b size=num]\n";
        assert_eq!(
            first_error_lines(mkfs_xfs),
            "Filesystem must be larger than 300MB."
        );
        assert_eq!(first_error_lines("a\n\nb\nc\nd\ne"), "a; b; c");
        assert_eq!(first_error_lines("Usage: x\n-y"), "Usage: x");
        assert_eq!(first_error_lines(""), "");
    }

    #[test]
    fn deadline_kills_the_child() {
        let start = Instant::now();
        let err = run("sleep", &[OsStr::new("30")], Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, HostError::CommandTimedOut { .. }), "{err:?}");
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn missing_program_is_a_spawn_error() {
        let err = run("pillar-no-such-tool", &[], Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, HostError::Spawn { .. }), "{err:?}");
    }
}
