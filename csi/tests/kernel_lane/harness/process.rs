//! Processes: the binaries under test, a running process ([`Proc`]) and gRPC channels over
//! unix sockets.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::harness::START_TIMEOUT;

pub(crate) fn csi_bin() -> PathBuf {
    std::env::var_os("PILLAR_CSI_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_pillar-csi")),
        PathBuf::from,
    )
}

pub(crate) fn agent_bin() -> PathBuf {
    let bin = std::env::var_os("PILLAR_AGENT_BIN")
        .map_or_else(|| csi_bin().with_file_name("pillar-agent"), PathBuf::from);
    assert!(
        bin.is_file(),
        "{} is missing: build it (cargo build -p pillar-agent) or set PILLAR_AGENT_BIN",
        bin.display()
    );
    bin
}

/// A running binary; its stdout and stderr go to `log`. Killed when dropped.
pub(crate) struct Proc {
    pub(crate) name: String,
    child: Child,
    pub(crate) log: PathBuf,
}

impl Proc {
    pub(crate) fn spawn(name: &str, program: &Path, args: &[String], log: &Path) -> Self {
        Self::spawn_env(name, program, args, log, &[])
    }

    /// [`spawn`](Self::spawn) with extra environment variables.
    pub(crate) fn spawn_env(
        name: &str,
        program: &Path,
        args: &[String],
        log: &Path,
        env: &[(&str, &str)],
    ) -> Self {
        let mut out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("open process log");
        writeln!(out, "=== {name}: {} {}", program.display(), args.join(" ")).expect("write log");
        let err = out.try_clone().expect("clone log fd");
        let child = Command::new(program)
            .args(args)
            .env("NO_COLOR", "1")
            .env(
                "RUST_LOG",
                std::env::var("PILLAR_LANE_RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
        println!("  started {name} (pid {})", child.id());
        Self {
            name: name.to_owned(),
            child,
            log: log.to_owned(),
        }
    }

    pub(crate) fn pid(&self) -> libc::pid_t {
        libc::pid_t::try_from(self.child.id()).expect("pid fits pid_t")
    }

    /// SIGKILL, as a crash or power loss does.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let status = self.child.wait();
        println!("  killed {} (SIGKILL): {status:?}", self.name);
    }

    /// SIGTERM, then SIGKILL after 15 s.
    pub(crate) fn stop(&mut self) {
        // Reaped already (killed earlier): its pid may belong to another process by now.
        if let Ok(Some(status)) = self.child.try_wait() {
            println!("  {} had exited: {status}", self.name);
            return;
        }
        // SAFETY: kill(2) on the pid of our own child, which has not been reaped yet.
        unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(15) {
            if let Ok(Some(status)) = self.child.try_wait() {
                println!("  stopped {} (SIGTERM): {status}", self.name);
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("  {} ignored SIGTERM for 15 s", self.name);
        self.kill();
    }

    /// Whether the process has ended (and its status).
    pub(crate) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub(crate) fn tail(&self, lines: usize) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub(crate) async fn channel(socket: &Path) -> Channel {
    let start = Instant::now();
    loop {
        let s = socket.to_owned();
        let ch = Endpoint::from_static("http://lane.invalid")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let s = s.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(s).await?)) }
            }))
            .await;
        match ch {
            Ok(ch) => return ch,
            Err(e) if start.elapsed() > START_TIMEOUT => {
                panic!(
                    "nothing answers on {} after {START_TIMEOUT:?}: {e}",
                    socket.display()
                )
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
