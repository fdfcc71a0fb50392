//! `pillar-agent`: the storage-node agent. Thin: parses flags and runs `pillar_agent::server`.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use pillar_agent::backend::{PoolConfig, PoolKind};
use pillar_agent::server::{EngineKind, Listen, ServerConfig, TlsFiles, serve};
use pillar_agent::service::AgentSettings;
use pillar_agent::target::TargetConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TargetKind {
    /// The kernel's nvmet configfs tree.
    Kernel,
    /// The configfs test double, for machines without nvmet (never for production).
    TestDouble,
}

/// pillar's storage-node agent: fenced volume, export and ACL operations on the Linux NVMe-oF
/// target.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Durable state: fencing marks (generations/) and adopted identities (nvmet-identity/).
    #[arg(long, default_value = "/var/lib/pillar/agent")]
    state_dir: PathBuf,
    /// gRPC listen address: unix:///path/to.sock or tcp://host:port.
    #[arg(long, default_value = "tcp://0.0.0.0:9500")]
    listen: Listen,
    /// I/O engine. Use `sync` where io_uring is disabled or blocked by seccomp.
    #[arg(long, value_enum, default_value = "io_uring")]
    engine: EngineKind,
    /// Which configfs to drive.
    #[arg(long, value_enum, default_value = "kernel")]
    target: TargetKind,
    /// Root of the nvmet tree (default: /sys/kernel/config/nvmet for the kernel,
    /// <state-dir>/configfs-double for the test double).
    #[arg(long)]
    configfs_root: Option<PathBuf>,
    /// Address hosts connect to (the traddr of every port the agent creates).
    #[arg(long, default_value = "0.0.0.0")]
    nvme_address: IpAddr,
    /// A pool: NAME=file:/dir, NAME=lvm:VG, NAME=lvm-thin:VG/THINPOOL or NAME=zfs:PARENT. Repeatable.
    #[arg(long = "pool", value_parser = parse_pool)]
    pools: Vec<PoolConfig>,
    /// Server certificate (PEM).
    #[arg(long, requires_all = ["tls_key", "tls_client_ca", "authorized_client"])]
    tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// CA that signs controller client certificates (PEM).
    #[arg(long)]
    tls_client_ca: Option<PathBuf>,
    /// The controller identity (DNS/URI SAN or CN of its client certificate) allowed to call.
    #[arg(long)]
    authorized_client: Option<String>,
    /// Serve gRPC without TLS. Only for a unix socket on a trusted host, or tests.
    #[arg(long, conflicts_with = "tls_cert")]
    insecure_plaintext: bool,
    /// Serve Prometheus metrics on this address (path /metrics).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Timeout for external commands (lvm, zfs), in seconds.
    #[arg(long, default_value_t = 60)]
    command_timeout_secs: u64,
    /// TEST ONLY: leave namespace UUID/NGUID and serial to the kernel (random). Shows what stable
    /// identity prevents; never use it for real volumes.
    #[arg(long, hide = true)]
    unsafe_kernel_random_identity: bool,
    /// TEST ONLY: a revoke only removes the host from the ACL, without draining the namespace or
    /// cutting live connections. Shows what a fenced revoke prevents; never use it for real volumes.
    #[arg(long, hide = true)]
    unsafe_revoke_acl_only: bool,
}

fn parse_pool(s: &str) -> Result<PoolConfig, String> {
    let (name, spec) = s.split_once('=').ok_or("expected NAME=KIND:ARG")?;
    let (kind, arg) = spec.split_once(':').ok_or("expected NAME=KIND:ARG")?;
    let kind = match kind {
        "file" => PoolKind::File { dir: arg.into() },
        "lvm" => PoolKind::LvmLinear { vg: arg.into() },
        "lvm-thin" => {
            let (vg, pool) = arg.split_once('/').ok_or("lvm-thin needs VG/THINPOOL")?;
            PoolKind::LvmThin {
                vg: vg.into(),
                thin_pool: pool.into(),
            }
        }
        "zfs" => PoolKind::Zfs { parent: arg.into() },
        other => return Err(format!("unknown pool kind {other:?}")),
    };
    Ok(PoolConfig {
        name: name.into(),
        kind,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        // Colour only on a terminal: logs collected by kubelet or CI stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let args = Args::parse();
    let target = match args.target {
        TargetKind::Kernel => TargetConfig::Kernel {
            root: args
                .configfs_root
                .clone()
                .unwrap_or_else(|| pillar_nvmet::KERNEL_NVMET_ROOT.into()),
        },
        TargetKind::TestDouble => {
            let root = args
                .configfs_root
                .clone()
                .unwrap_or_else(|| args.state_dir.join("configfs-double"));
            tracing::warn!(root = %root.display(), "target is the configfs TEST DOUBLE, not the kernel: no host can connect to these exports");
            TargetConfig::Double { root }
        }
    };
    let tls = match (
        args.tls_cert,
        args.tls_key,
        args.tls_client_ca,
        args.authorized_client,
    ) {
        (Some(cert), Some(key), Some(client_ca), Some(authorized_client)) => Some(TlsFiles {
            cert,
            key,
            client_ca,
            authorized_client,
        }),
        _ => None,
    };
    let config = ServerConfig {
        state_dir: args.state_dir,
        listen: args.listen,
        engine: args.engine,
        target,
        pools: args.pools,
        settings: AgentSettings {
            nvme_address: args.nvme_address,
            kernel_random_identity: args.unsafe_kernel_random_identity,
            unsafe_revoke_acl_only: args.unsafe_revoke_acl_only,
            hooks: Default::default(),
        },
        tls,
        insecure_plaintext: args.insecure_plaintext,
        metrics_listen: args.metrics_listen,
        command_timeout: Duration::from_secs(args.command_timeout_secs),
    };
    let shutdown = async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = async { if let Some(t) = term.as_mut() { t.recv().await; } else { std::future::pending::<()>().await } } => {}
        }
        tracing::info!("shutting down");
    };
    serve(config, shutdown).await.context("pillar-agent failed")
}
