//! `pillar-agent`: the storage-node agent. Thin: parses flags and runs `pillar_agent::server`.

use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use pillar_agent::AgentSettings;
use pillar_agent::TargetConfig;
use pillar_agent::cli::{Args, TargetKind};
use pillar_agent::{ServerConfig, TlsFiles, serve_with_limits};

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
    serve_with_limits(config, args.grpc, shutdown)
        .await
        .context("pillar-agent failed")
}
