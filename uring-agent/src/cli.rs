//! The agent's command line, in the library so that a test parses the deploy manifests' `args`
//! with the parser the binary uses (a renamed flag fails that test).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::Parser;

use crate::backend::{PoolConfig, PoolKind};
use crate::server::{EngineKind, Listen};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TargetKind {
    /// The kernel's nvmet configfs tree.
    Kernel,
    /// The configfs test double, for machines without nvmet (never for production).
    TestDouble,
}

/// pillar's storage-node agent: fenced volume, export and ACL operations on the Linux NVMe-oF
/// target.
#[derive(Debug, Parser)]
#[command(version)]
pub struct Args {
    /// Durable state: fencing marks (generations/) and adopted identities (nvmet-identity/).
    #[arg(long, default_value = "/var/lib/pillar/agent")]
    pub state_dir: PathBuf,
    /// gRPC listen address: unix:///path/to.sock or tcp://host:port.
    #[arg(long, default_value = "tcp://0.0.0.0:9500")]
    pub listen: Listen,
    /// I/O engine. Use `sync` where io_uring is disabled or blocked by seccomp.
    #[arg(long, value_enum, default_value = "io_uring")]
    pub engine: EngineKind,
    /// Which configfs to drive.
    #[arg(long, value_enum, default_value = "kernel")]
    pub target: TargetKind,
    /// Root of the nvmet tree (default: /sys/kernel/config/nvmet for the kernel,
    /// <state-dir>/configfs-double for the test double).
    #[arg(long)]
    pub configfs_root: Option<PathBuf>,
    /// Address hosts connect to (the traddr of every port the agent creates).
    #[arg(long, default_value = "0.0.0.0")]
    pub nvme_address: IpAddr,
    /// A pool: NAME=file:/dir, NAME=lvm:VG, NAME=lvm-thin:VG/THINPOOL or NAME=zfs:PARENT. Repeatable.
    #[arg(long = "pool", value_parser = parse_pool)]
    pub pools: Vec<PoolConfig>,
    /// Server certificate (PEM).
    #[arg(long, requires_all = ["tls_key", "tls_client_ca", "authorized_client"])]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// CA that signs controller client certificates (PEM).
    #[arg(long)]
    pub tls_client_ca: Option<PathBuf>,
    /// The controller identity (DNS/URI SAN or CN of its client certificate) allowed to call.
    #[arg(long)]
    pub authorized_client: Option<String>,
    /// Serve gRPC without TLS. Only for a unix socket on a trusted host, or tests.
    #[arg(long, conflicts_with = "tls_cert")]
    pub insecure_plaintext: bool,
    /// Serve Prometheus metrics on this address (path /metrics).
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Timeout for external commands (lvm, zfs), in seconds.
    #[arg(long, default_value_t = 60)]
    pub command_timeout_secs: u64,
    /// Bounds of the gRPC server.
    #[command(flatten)]
    pub grpc: pillar_grpc_unix::Limits,
    /// TEST ONLY: leave namespace UUID/NGUID and serial to the kernel (random). Shows what stable
    /// identity prevents; never use it for real volumes.
    #[arg(long, hide = true)]
    pub unsafe_kernel_random_identity: bool,
    /// TEST ONLY: a revoke only removes the host from the ACL, without draining the namespace or
    /// cutting live connections. Shows what a fenced revoke prevents; never use it for real volumes.
    #[arg(long, hide = true)]
    pub unsafe_revoke_acl_only: bool,
}

pub fn parse_pool(s: &str) -> Result<PoolConfig, String> {
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
