//! Latency of the agent's fenced mark update (a durable small-file replace) under concurrency,
//! with the io_uring engine (linked chain + group commit) and the synchronous engine, against
//! the physical floor of the disk (one small write + fsync, measured the same way).
//!
//! Usage: fence-latency [--dir DIR] [--ops N] [--clients 1,8,32]
//! Prints a table and, with --json, one JSON object per configuration.

#![allow(clippy::print_stdout)] // a benchmark reports on stdout

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use pillar_agent::engine::sync::SyncEngine;
use pillar_agent::engine::uring::{UringConfig, UringEngine};
use pillar_agent::engine::{DurableDir, Engine};
use pillar_benches::Latencies;

#[derive(Parser, Debug)]
struct Args {
    /// Directory on the disk to measure (default: a temp dir under the current directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Operations per client.
    #[arg(long, default_value_t = 400)]
    ops: usize,
    /// Client counts to run.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    clients: Vec<usize>,
    /// Engines to run.
    #[arg(long, value_delimiter = ',', default_value = "io_uring,sync")]
    engines: Vec<String>,
    /// Skip the disk floor measurement.
    #[arg(long)]
    no_floor: bool,
    /// Print JSON lines as well.
    #[arg(long)]
    json: bool,
}

const MARK: &[u8] = br#"{"format":1,"mark":{"volume":"pvc-00000000-0000-0000-0000-000000000000","owner_uid":"6f1c0b1e-93c5-4c43-9d1a-0d1c6b7f2a10","generation":12345,"ended":false,"retired_uids":[]},"sha256":"0000000000000000000000000000000000000000000000000000000000000000"}"#;

fn floor(dir: &std::path::Path, ops: usize) -> anyhow::Result<Latencies> {
    let mut l = Latencies::default();
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(dir.join("floor"))?;
    for _ in 0..ops {
        let t = Instant::now();
        f.write_all(&MARK[..256.min(MARK.len())])?;
        f.sync_data()?;
        l.push(t.elapsed());
    }
    Ok(l)
}

async fn run(
    engine: Arc<Engine>,
    dir: Arc<DurableDir>,
    clients: usize,
    ops: usize,
) -> anyhow::Result<(Latencies, Duration)> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (engine, dir) = (Arc::clone(&engine), Arc::clone(&dir));
        tasks.push(tokio::spawn(async move {
            let mut l = Latencies::default();
            for _ in 0..ops {
                let t = Instant::now();
                engine
                    .replace_file(&dir, &format!("vol-{c}.json"), MARK.to_vec())
                    .await?;
                l.push(t.elapsed());
            }
            anyhow::Ok(l)
        }));
    }
    let mut all = Latencies::default();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok((all, started.elapsed()))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let base = match &args.dir {
        Some(d) => tempfile::tempdir_in(d)?,
        None => tempfile::tempdir_in(".")?,
    };
    let mut floor_l = if args.no_floor {
        Latencies::default()
    } else {
        floor(base.path(), args.ops)?
    };
    let (f50, f99, f999) = (
        floor_l.quantile_us(0.5),
        floor_l.quantile_us(0.99),
        floor_l.quantile_us(0.999),
    );
    println!(
        "disk floor (256-byte write + fdatasync, 1 thread): p50 {f50:.0} us  p99 {f99:.0} us  p99.9 {f999:.0} us"
    );
    println!(
        "{:<9} {:>7} {:>9} {:>9} {:>9} {:>10} {:>12} {:>12}",
        "engine", "clients", "p50 us", "p99 us", "p99.9 us", "ops/s", "dirfsync/op", "enters/op"
    );
    for &clients in &args.clients {
        for name in args.engines.iter().map(String::as_str) {
            let engine = Arc::new(match name {
                "io_uring" => Engine::Uring(UringEngine::start(UringConfig::default())?),
                _ => Engine::Sync(SyncEngine::new()),
            });
            let dir = DurableDir::open(base.path().join(format!("{name}-{clients}")))?;
            // Warm-up: create the files once.
            run(Arc::clone(&engine), Arc::clone(&dir), clients, 5).await?;
            let before = engine.stats().snapshot();
            let (mut l, wall) =
                run(Arc::clone(&engine), Arc::clone(&dir), clients, args.ops).await?;
            let after = engine.stats().snapshot();
            let ops = after[2] - before[2];
            #[allow(clippy::cast_precision_loss)]
            let per_op = |i: usize| (after[i] - before[i]) as f64 / ops.max(1) as f64;
            #[allow(clippy::cast_precision_loss)]
            let rate = l.len() as f64 / wall.as_secs_f64();
            let (p50, p99, p999) = (
                l.quantile_us(0.5),
                l.quantile_us(0.99),
                l.quantile_us(0.999),
            );
            println!(
                "{name:<9} {clients:>7} {p50:>9.0} {p99:>9.0} {p999:>9.0} {rate:>10.0} {:>12.2} {:>12.2}",
                per_op(3),
                per_op(0)
            );
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"engine": name, "clients": clients, "ops": l.len(), "p50_us": p50, "p99_us": p99, "p999_us": p999,
                        "ops_per_s": rate, "dir_fsyncs_per_op": per_op(3), "submissions_per_op": per_op(0),
                        "floor_p50_us": f50, "floor_p99_us": f99, "floor_p999_us": f999})
                );
            }
        }
    }
    Ok(())
}
