//! `pillar-local`: the agent, the CSI controller and the node plugin on this machine, without
//! Kubernetes, each on its own unix socket; with `--demo`, the main job once through them.
//! Thin: parses flags and runs the library.

// The single-machine mode reports its sockets and the main job's steps on stdout.
#![allow(clippy::print_stdout)]

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use pillar_agent::EngineKind;
use pillar_local::{LocalConfig, start};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "pillar on one machine: agent, CSI controller and node plugin, without Kubernetes"
)]
struct Args {
    /// Working directory: sockets, state, pool files.
    #[arg(long, default_value = "/var/lib/pillar/local")]
    dir: PathBuf,
    #[arg(long, value_enum, default_value = "io_uring")]
    engine: EngineKind,
    /// Use the configfs test double even where the kernel has nvmet.
    #[arg(long)]
    test_double: bool,
    /// Run the main job once through the CSI sockets, then stop.
    #[arg(long)]
    demo: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    pillar_csi::init_tracing();
    let Args {
        dir,
        engine,
        test_double,
        demo,
    } = Args::parse();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let sockets = start(
        LocalConfig {
            dir: dir.clone(),
            engine,
            force_double: test_double,
        },
        stopped,
    )
    .await
    .context("single-machine mode")?;
    let engine_name = match engine {
        EngineKind::Uring => "io_uring",
        EngineKind::Sync => "sync",
    };
    println!("pillar single-machine mode (agent engine: {engine_name})");
    if sockets.target == "kernel" {
        println!(
            "  target:     Linux kernel nvmet (configfs); node attaches over NVMe/TCP on 127.0.0.1"
        );
    } else {
        println!(
            "  target:     configfs TEST DOUBLE - this kernel has no nvmet/NVMe-TCP host (or --test-double);"
        );
        println!(
            "              no NVMe/TCP connection is made: the node plugin uses the local loop device"
        );
    }
    println!(
        "  auth:       none - host and target are this machine, on 127.0.0.1 (no DH-HMAC-CHAP)"
    );
    println!("  agent:      unix://{}", sockets.agent.display());
    println!("  controller: unix://{}", sockets.controller.display());
    println!("  node:       unix://{}", sockets.node.display());
    if demo {
        println!("main job: one volume through the CSI calls kubelet and the sidecars make");
        let work = dir.join("demo");
        let result = pillar_local::demo::run(
            &sockets.controller,
            &sockets.node,
            &work,
            "demo-volume",
            64 << 20,
        )
        .await;
        let _ = stop.send(true);
        result.context("main job")?;
        println!(
            "main job: OK (data written through the filesystem and read back with a matching SHA-256)"
        );
        return Ok(());
    }
    pillar_csi::until_signal().await;
    let _ = stop.send(true);
    Ok(())
}
