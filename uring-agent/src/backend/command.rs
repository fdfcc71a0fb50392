//! Running external storage tools (`lvm`, `zfs`) by argv, never through a shell, with a
//! timeout, and reporting failures with their stderr.

#[cfg(any(test, feature = "test-seams"))]
use std::collections::VecDeque;
use std::fmt;
use std::process::Stdio;
#[cfg(any(test, feature = "test-seams"))]
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures::future::BoxFuture;

/// Longest stderr excerpt kept in a [`CommandError`], in bytes.
pub const STDERR_LIMIT: usize = 4096;

/// What a successful command printed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Why a command did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("could not start {program}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} did not finish within {after:?} and was killed")]
    Timeout { program: String, after: Duration },
    #[error("{program} failed ({status}): {stderr}")]
    Failed {
        program: String,
        /// How it ended, e.g. `exit status: 5`.
        status: String,
        /// Its stderr, trimmed and cut to [`STDERR_LIMIT`] bytes.
        stderr: String,
    },
}

/// Runs a program with arguments. Implementations must not involve a shell.
pub trait CommandRunner: Send + Sync + fmt::Debug {
    /// Runs `program` with `args`; a non-zero exit is a [`CommandError::Failed`].
    fn run<'a>(
        &'a self,
        program: &'a str,
        args: &'a [String],
    ) -> BoxFuture<'a, Result<CommandOutput, CommandError>>;
}

/// Runs commands on this machine with `tokio::process`, killing them after a timeout.
///
/// The child gets no stdin, `LC_ALL=C` (stable messages in errors and logs) and is killed
/// (SIGKILL) when the timeout expires or the calling future is dropped.
#[derive(Debug, Clone)]
pub struct SystemRunner {
    timeout: Duration,
}

impl SystemRunner {
    /// The default timeout: LVM and ZFS commands normally take well under a second, but can
    /// wait for a lock or a udev settle for a while.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// A runner that kills commands running longer than `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self { timeout }
    }

    /// The timeout of this runner.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl Default for SystemRunner {
    fn default() -> Self {
        Self::new(Self::DEFAULT_TIMEOUT)
    }
}

impl CommandRunner for SystemRunner {
    fn run<'a>(
        &'a self,
        program: &'a str,
        args: &'a [String],
    ) -> BoxFuture<'a, Result<CommandOutput, CommandError>> {
        Box::pin(async move {
            tracing::debug!(program, ?args, "running");
            let child = tokio::process::Command::new(program)
                .args(args)
                .env("LC_ALL", "C")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .map_err(|source| CommandError::Spawn {
                    program: program.to_owned(),
                    source,
                })?;
            // On timeout the wait future, and with it the child, is dropped: kill_on_drop
            // sends SIGKILL and tokio reaps the process in the background.
            let output = tokio::time::timeout(self.timeout, child.wait_with_output())
                .await
                .map_err(|_| CommandError::Timeout {
                    program: program.to_owned(),
                    after: self.timeout,
                })?
                .map_err(|source| CommandError::Spawn {
                    program: program.to_owned(),
                    source,
                })?;
            if !output.status.success() {
                let err = CommandError::Failed {
                    program: program.to_owned(),
                    status: output.status.to_string(),
                    stderr: bounded_stderr(&output.stderr),
                };
                tracing::warn!(program, ?args, error = %err, "command failed");
                return Err(err);
            }
            Ok(CommandOutput {
                stdout: output.stdout,
                stderr: output.stderr,
            })
        })
    }
}

/// What a [`ScriptedRunner`] answers to one expected call.
#[derive(Debug, Clone)]
#[cfg(any(test, feature = "test-seams"))]
pub enum Reply {
    /// Success with this stdout.
    Stdout(String),
    /// A non-zero exit with this code and stderr (reported as [`SystemRunner`] would).
    Fail { code: i32, stderr: String },
    /// A [`CommandError::Timeout`] after this long (reported at once).
    Timeout(Duration),
}

/// A test double for [`CommandRunner`]: answers a fixed script of expected calls in order and
/// panics on any call that differs from the next expectation (program and exact argv), so a
/// test proves the commands a backend runs, not just its results.
#[derive(Debug, Default)]
#[cfg(any(test, feature = "test-seams"))]
pub struct ScriptedRunner {
    script: Mutex<VecDeque<(String, Vec<String>, Reply)>>,
}

#[cfg(any(test, feature = "test-seams"))]
impl ScriptedRunner {
    /// A runner with an empty script: any call panics.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends an expected call and its reply.
    pub fn expect(&self, program: &str, args: &[&str], reply: Reply) -> &Self {
        self.lock().push_back((
            program.to_owned(),
            args.iter().map(|a| (*a).to_owned()).collect(),
            reply,
        ));
        self
    }

    /// How many expected calls have not happened yet.
    pub fn remaining(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(String, Vec<String>, Reply)>> {
        self.script.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(any(test, feature = "test-seams"))]
impl CommandRunner for ScriptedRunner {
    fn run<'a>(
        &'a self,
        program: &'a str,
        args: &'a [String],
    ) -> BoxFuture<'a, Result<CommandOutput, CommandError>> {
        let next = self.lock().pop_front();
        Box::pin(async move {
            let Some((want_program, want_args, reply)) = next else {
                panic!("unexpected call, script is empty: {program} {args:?}");
            };
            assert_eq!(
                (program, args),
                (want_program.as_str(), want_args.as_slice()),
                "call differs from the script"
            );
            match reply {
                Reply::Stdout(stdout) => Ok(CommandOutput {
                    stdout: stdout.into_bytes(),
                    stderr: Vec::new(),
                }),
                Reply::Fail { code, stderr } => Err(CommandError::Failed {
                    program: program.to_owned(),
                    status: format!("exit status: {code}"),
                    stderr: bounded_stderr(stderr.as_bytes()),
                }),
                Reply::Timeout(after) => Err(CommandError::Timeout {
                    program: program.to_owned(),
                    after,
                }),
            }
        })
    }
}

/// `stderr` as text, trimmed and cut to at most [`STDERR_LIMIT`] bytes on a character
/// boundary (a cut is marked with `...`).
pub fn bounded_stderr(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let text = text.trim();
    if text.len() <= STDERR_LIMIT {
        return text.to_owned();
    }
    let mut end = STDERR_LIMIT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_is_trimmed_and_bounded() {
        assert_eq!(bounded_stderr(b"  oops\n"), "oops");
        let long = "é".repeat(STDERR_LIMIT);
        let cut = bounded_stderr(long.as_bytes());
        assert!(cut.len() <= STDERR_LIMIT + 3, "{}", cut.len());
        assert!(cut.ends_with("..."));
        assert!(cut.trim_end_matches("...").chars().all(|c| c == 'é'));
    }
}
