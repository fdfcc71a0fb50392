//! pillar's benchmark report: the engine against the disk's floor and simpler designs, the
//! agent end to end through gRPC, and the cost of density (the k-th export, a full resync),
//! side by side in one run. Prints tables and writes every figure as JSON.
//!
//! Usage: pillar-report [--dir DIR] [--json FILE] [--sections engine,e2e,density,startup]
//! [--marks N] [--quick]
//!
//! - engine: the fenced mark update (write temp, fsync, rename, fsync directory) at 1, 16, 64
//!   and 256 in flight: the floor (the same four syscalls, one thread, nothing else), one
//!   thread doing every caller's updates in turn, a thread per caller, tokio-uring with each
//!   step awaited in turn, pillar's synchronous engine and pillar's io_uring engine. CPU per update from getrusage; syscalls per update
//!   counted by the io_uring engine (every io_uring_enter and eventfd write) and by
//!   construction for the synchronous designs (2 openat, write, fsync, close, rename, openat
//!   of the directory kept open: see `sync_update`).
//! - e2e: Grant and Revoke through the agent's gRPC server on a unix socket (io_uring engine,
//!   marks on DIR, configfs double on tmpfs), 1, 16 and 64 callers on as many volumes.
//! - density: the cost of one more Export with k exports present, and a full resync of k
//!   exports onto an empty target (a storage reboot), configfs double on tmpfs.
//! - startup: the agent's real server started as a process of its own on a state directory with
//!   `--marks` fencing marks (100,000) and as many volumes in its pool: the time until it
//!   answers Health, and its resident memory then (and its peak).
//!
//! Instructions per fenced call, counted by callgrind, are the companion `pillar-callgrind`'s.

#![allow(clippy::print_stdout)] // a benchmark reports on stdout

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use pillar_agent::engine::sync::SyncEngine;
use pillar_agent::engine::uring::{UringConfig, UringEngine};
use pillar_agent::engine::{DurableDir, Engine};
use pillar_benches::{Latencies, MARK, agent, cpu_seconds, sync_update};
use serde_json::json;

mod startup;

#[derive(Parser, Debug)]
struct Args {
    /// Directory on the disk to measure (marks and engine files go here).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Where to write the JSON report.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Sections to run.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "engine,e2e,density,startup"
    )]
    sections: Vec<String>,
    /// Updates per configuration at the engine level.
    #[arg(long, default_value_t = 2048)]
    updates: usize,
    /// In-flight counts at the engine level.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    in_flight: Vec<usize>,
    /// Caller counts end to end.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    callers: Vec<usize>,
    /// Export counts at which the density section measures.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000,10000")]
    exports: Vec<usize>,
    /// Marks (and volumes in the pool) the startup section starts an agent on.
    #[arg(long, default_value_t = 100_000)]
    marks: usize,
    /// Small counts for a smoke run (CI): 64 updates, exports 10 and 100.
    #[arg(long)]
    quick: bool,
    /// Internal (the startup section's child): serve the agent with state, socket, configfs
    /// double and pool at these four paths until SIGTERM.
    #[arg(long, hide = true, num_args = 4)]
    serve_agent: Option<Vec<PathBuf>>,
}

const SYNC_SYSCALLS: f64 = 6.0;

/// A measured configuration.
struct Row {
    design: String,
    in_flight: usize,
    lat: Latencies,
    wall: Duration,
    cpu: f64,
    syscalls: Option<f64>,
    /// Directory fsyncs per update, where the design shares them (group commit).
    dir_fsyncs: Option<f64>,
}

impl Row {
    /// A row of a synchronous design measured from `t0` and `cpu0`.
    fn synchronous(design: &str, in_flight: usize, lat: Latencies, t0: Instant, cpu0: f64) -> Self {
        Self {
            design: design.into(),
            in_flight,
            lat,
            wall: t0.elapsed(),
            cpu: cpu_seconds() - cpu0,
            syscalls: Some(SYNC_SYSCALLS),
            dir_fsyncs: Some(1.0),
        }
    }

    fn json(&mut self, section: &str) -> serde_json::Value {
        let n = self.lat.len().max(1);
        #[allow(clippy::cast_precision_loss)]
        let per_s = self.lat.len() as f64 / self.wall.as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let cpu_us = self.cpu * 1e6 / n as f64;
        json!({
            "section": section, "design": self.design, "in_flight": self.in_flight,
            "ops": self.lat.len(), "p50_us": self.lat.quantile_us(0.5), "p99_us": self.lat.quantile_us(0.99),
            "p999_us": self.lat.quantile_us(0.999), "ops_per_s": per_s, "cpu_us_per_op": cpu_us,
            "syscalls_per_op": self.syscalls, "dir_fsyncs_per_op": self.dir_fsyncs,
        })
    }
}

fn print_rows(title: &str, rows: &mut [Row], out: &mut Vec<serde_json::Value>, section: &str) {
    println!("\n{title}");
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>11} {:>10}",
        "design",
        "in flight",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "ops/s",
        "cpu us/op",
        "syscalls/op",
        "dirfsync/op"
    );
    for row in rows {
        let j = row.json(section);
        let f = |k: &str| j[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:<22} {:>9} {:>9.0} {:>9.0} {:>10.0} {:>10.0} {:>9.1} {:>11} {:>10}",
            row.design,
            row.in_flight,
            f("p50_us"),
            f("p99_us"),
            f("p999_us"),
            f("ops_per_s"),
            f("cpu_us_per_op"),
            j["syscalls_per_op"]
                .as_f64()
                .map_or_else(|| "-".to_owned(), |s| format!("{s:.2}")),
            j["dir_fsyncs_per_op"]
                .as_f64()
                .map_or_else(|| "-".to_owned(), |s| format!("{s:.2}")),
        );
        out.push(j);
    }
}

/// The floor: one thread, the four durable syscalls and nothing else, one file.
fn floor(dir: &Path, updates: usize) -> anyhow::Result<Row> {
    let d = dir.join("floor");
    std::fs::create_dir_all(&d)?;
    let dirfd = std::fs::File::open(&d)?;
    let mut lat = Latencies::default();
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    for _ in 0..updates {
        let t = Instant::now();
        sync_update(&d, &dirfd, "mark.json")?;
        lat.push(t.elapsed());
    }
    Ok(Row::synchronous("floor (1 thread)", 1, lat, t0, cpu0))
}

/// One thread serving `callers` callers' updates in turn (no concurrency at all).
fn one_thread(dir: &Path, callers: usize, updates: usize) -> anyhow::Result<Row> {
    let d = dir.join(format!("one-thread-{callers}"));
    std::fs::create_dir_all(&d)?;
    let dirfd = std::fs::File::open(&d)?;
    let mut lat = Latencies::default();
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    // A caller's latency includes the wait for the callers before it in the round.
    let rounds = updates.div_ceil(callers);
    for _ in 0..rounds {
        let round = Instant::now();
        for c in 0..callers {
            sync_update(&d, &dirfd, &format!("v{c}.json"))?;
            lat.push(round.elapsed());
        }
    }
    Ok(Row::synchronous(
        "one thread, in turn",
        callers,
        lat,
        t0,
        cpu0,
    ))
}

/// A thread per caller, each doing its own synchronous updates.
fn thread_per_caller(dir: &Path, callers: usize, updates: usize) -> anyhow::Result<Row> {
    let d = Arc::new(dir.join(format!("threads-{callers}")));
    std::fs::create_dir_all(&*d)?;
    let per = updates.div_ceil(callers);
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    let handles: Vec<_> = (0..callers)
        .map(|c| {
            let d = Arc::clone(&d);
            std::thread::spawn(move || -> std::io::Result<Latencies> {
                let dirfd = std::fs::File::open(&*d)?;
                let mut lat = Latencies::default();
                for _ in 0..per {
                    let t = Instant::now();
                    sync_update(&d, &dirfd, &format!("v{c}.json"))?;
                    lat.push(t.elapsed());
                }
                Ok(lat)
            })
        })
        .collect();
    let mut lat = Latencies::default();
    for h in handles {
        lat.extend(
            h.join()
                .map_err(|_| anyhow::anyhow!("a caller thread panicked"))??,
        );
    }
    Ok(Row::synchronous(
        "thread per caller",
        callers,
        lat,
        t0,
        cpu0,
    ))
}

/// tokio-uring, each step awaited in turn (open temp, write, fsync, close, rename, open the
/// directory, fsync it, close it): io_uring without chains or group commit. On its own
/// single-threaded runtime, in a thread of its own.
fn tokio_uring_row(dir: &Path, callers: usize, updates: usize) -> anyhow::Result<Row> {
    async fn update(dir: &Path, name: &str) -> std::io::Result<()> {
        let tmp = dir.join(format!(".{name}.tmp"));
        let file = tokio_uring::fs::File::create(&tmp).await?;
        let (written, _) = file.write_at(MARK.to_vec(), 0).submit().await;
        if written? != MARK.len() {
            return Err(std::io::Error::other("short write"));
        }
        file.sync_all().await?;
        file.close().await?;
        tokio_uring::fs::rename(&tmp, dir.join(name)).await?;
        let d = tokio_uring::fs::File::open(dir).await?;
        d.sync_all().await?;
        d.close().await
    }
    let d = dir.join(format!("tokio-uring-{callers}"));
    std::fs::create_dir_all(&d)?;
    let per = updates.div_ceil(callers);
    let handle = std::thread::spawn(move || {
        tokio_uring::start(async move {
            let run = |n: usize| {
                let tasks: Vec<_> = (0..callers)
                    .map(|c| {
                        let d = d.clone();
                        tokio_uring::spawn(async move {
                            let mut lat = Latencies::default();
                            for _ in 0..n {
                                let t = Instant::now();
                                update(&d, &format!("v{c}.json")).await?;
                                lat.push(t.elapsed());
                            }
                            std::io::Result::Ok(lat)
                        })
                    })
                    .collect();
                async move {
                    let mut all = Latencies::default();
                    for t in tasks {
                        all.extend(t.await.map_err(std::io::Error::other)??);
                    }
                    std::io::Result::Ok(all)
                }
            };
            run(2).await?;
            let (cpu0, t0) = (cpu_seconds(), Instant::now());
            let lat = run(per).await?;
            std::io::Result::Ok((lat, t0.elapsed(), cpu_seconds() - cpu0))
        })
    });
    let (lat, wall, cpu) = handle
        .join()
        .map_err(|_| anyhow::anyhow!("the tokio-uring thread panicked"))??;
    Ok(Row {
        design: "tokio-uring, awaited".into(),
        in_flight: callers,
        lat,
        wall,
        cpu,
        // Its io_uring_enter calls are its runtime's, not counted here.
        syscalls: None,
        dir_fsyncs: Some(1.0),
    })
}

/// pillar's engine (io_uring or sync) with `callers` concurrent tasks.
async fn engine_row(
    engine: Arc<Engine>,
    dir: &Path,
    callers: usize,
    updates: usize,
) -> anyhow::Result<Row> {
    let name = engine.name();
    let dir = DurableDir::open(dir.join(format!("{name}-{callers}")))?;
    let per = updates.div_ceil(callers);
    let run = |n: usize| {
        let (engine, dir) = (Arc::clone(&engine), Arc::clone(&dir));
        async move {
            let tasks: Vec<_> = (0..callers)
                .map(|c| {
                    let (engine, dir) = (Arc::clone(&engine), Arc::clone(&dir));
                    tokio::spawn(async move {
                        let mut lat = Latencies::default();
                        for _ in 0..n {
                            let t = Instant::now();
                            engine
                                .replace_file(&dir, &format!("v{c}.json"), MARK.to_vec())
                                .await?;
                            lat.push(t.elapsed());
                        }
                        anyhow::Ok(lat)
                    })
                })
                .collect();
            let mut all = Latencies::default();
            for t in tasks {
                all.extend(t.await??);
            }
            anyhow::Ok(all)
        }
    };
    run(2).await?;
    let (enters0, wakes0) = engine.stats().syscalls();
    let before = engine.stats().snapshot();
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    let lat = run(per).await?;
    let (wall, cpu) = (t0.elapsed(), cpu_seconds() - cpu0);
    let (enters, wakes) = engine.stats().syscalls();
    let after = engine.stats().snapshot();
    #[allow(clippy::cast_precision_loss)]
    let dir_fsyncs = Some((after[3] - before[3]) as f64 / (after[2] - before[2]).max(1) as f64);
    #[allow(clippy::cast_precision_loss)]
    let syscalls = match &*engine {
        Engine::Uring(_) => Some((enters - enters0 + wakes - wakes0) as f64 / lat.len() as f64),
        Engine::Sync(_) => Some(SYNC_SYSCALLS + 2.0),
    };
    Ok(Row {
        design: format!("pillar {name}"),
        in_flight: callers,
        lat,
        wall,
        cpu,
        syscalls,
        dir_fsyncs,
    })
}

async fn engine_section(
    args: &Args,
    dir: &Path,
    out: &mut Vec<serde_json::Value>,
) -> anyhow::Result<()> {
    let uring = Arc::new(Engine::Uring(UringEngine::start(UringConfig::default())?));
    let sync = Arc::new(Engine::Sync(SyncEngine::new()));
    let mut rows = vec![floor(dir, args.updates)?];
    for &n in &args.in_flight {
        rows.push(one_thread(dir, n, args.updates)?);
        rows.push(thread_per_caller(dir, n, args.updates)?);
        rows.push(tokio_uring_row(dir, n, args.updates)?);
        rows.push(engine_row(Arc::clone(&sync), dir, n, args.updates).await?);
        rows.push(engine_row(Arc::clone(&uring), dir, n, args.updates).await?);
    }
    print_rows(
        "engine: fenced mark update (write, fsync, rename, fsync dir)",
        &mut rows,
        out,
        "engine",
    );
    Ok(())
}

async fn e2e_section(
    args: &Args,
    dir: &Path,
    out: &mut Vec<serde_json::Value>,
) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for &callers in &args.callers {
        let node = agent::Node::start(dir, &format!("e2e-{callers}")).await?;
        let mut client = node.client().await?;
        // An anchor volume keeps host 1's entry in use, so grants and revokes change only
        // their own volume's ACL (as on a node serving many volumes to one host).
        let anchor = agent::volume(0);
        node.create(&mut client, &anchor).await?;
        node.export(&mut client, &anchor, &[agent::host(1)]).await?;
        for c in 1..=callers {
            let v = agent::volume(c);
            node.create(&mut client, &v).await?;
            node.export(&mut client, &v, &[]).await?;
        }
        let per = (args.updates / 4).div_ceil(callers).max(8);
        let (enters0, wakes0) = node.syscalls();
        let (cpu0, t0) = (cpu_seconds(), Instant::now());
        let tasks: Vec<_> = (1..=callers)
            .map(|c| {
                let mut client = client.clone();
                tokio::spawn(async move {
                    let v = agent::volume(c);
                    let mut lat = Latencies::default();
                    for i in 0..per {
                        let t = Instant::now();
                        agent::grant_or_revoke(&mut client, &v, 3 + i as u64, i % 2 == 0).await?;
                        lat.push(t.elapsed());
                    }
                    anyhow::Ok(lat)
                })
            })
            .collect();
        let mut lat = Latencies::default();
        for t in tasks {
            lat.extend(t.await??);
        }
        let (wall, cpu) = (t0.elapsed(), cpu_seconds() - cpu0);
        let (enters, wakes) = node.syscalls();
        #[allow(clippy::cast_precision_loss)]
        let syscalls = Some((enters - enters0 + wakes - wakes0) as f64 / lat.len() as f64);
        rows.push(Row {
            design: "grant/revoke via gRPC".into(),
            in_flight: callers,
            lat,
            wall,
            cpu,
            syscalls,
            dir_fsyncs: None,
        });
        node.stop().await;
    }
    print_rows(
        "end to end: GrantInitiator/RevokeInitiator through gRPC (io_uring engine; syscalls = the engine's only)",
        &mut rows,
        out,
        "e2e",
    );
    Ok(())
}

async fn density_section(
    args: &Args,
    dir: &Path,
    out: &mut Vec<serde_json::Value>,
) -> anyhow::Result<()> {
    const PROBES: usize = 20;
    println!(
        "\ndensity: one more Export with k exports present; full resync of k exports onto an empty target"
    );
    println!(
        "{:>7} {:>16} {:>16} {:>14} {:>12}",
        "k", "export p50 ms", "export max ms", "resync s", "resync /s"
    );
    let mut node = agent::Node::start(dir, "density").await?;
    let mut client = node.client().await?;
    let mut present = 0;
    let mut targets = args.exports.clone();
    targets.sort_unstable();
    let mut measured = BTreeMap::new();
    for &k in &targets {
        while present < k {
            present += 1;
            let v = agent::volume(present);
            node.create(&mut client, &v).await?;
            node.export(&mut client, &v, &[agent::host(1)]).await?;
        }
        let mut lat = Latencies::default();
        for p in 0..PROBES {
            // Its own name: a deleted volume's lifecycle is over for good (F6).
            let v = format!("pvc-probe-{k}-{p}");
            node.create(&mut client, &v).await?;
            let t = Instant::now();
            node.export(&mut client, &v, &[agent::host(1)]).await?;
            lat.push(t.elapsed());
            node.unexport_and_delete(&mut client, &v).await?;
        }
        // A storage reboot: the target is empty, the marks survive; the controller resyncs.
        node = node.restart_with_empty_target().await?;
        client = node.client().await?;
        let t = Instant::now();
        let failed = node.resync(&mut client, present, &[agent::host(1)]).await?;
        let resync = t.elapsed();
        anyhow::ensure!(failed == 0, "{failed} exports failed to resync at k={k}");
        let p50 = lat.quantile_us(0.5) / 1000.0;
        let max = lat.quantile_us(1.0) / 1000.0;
        #[allow(clippy::cast_precision_loss)]
        let rate = present as f64 / resync.as_secs_f64();
        println!(
            "{k:>7} {p50:>16.2} {max:>16.2} {:>14.2} {rate:>12.0}",
            resync.as_secs_f64()
        );
        measured.insert(k, p50);
        out.push(
            json!({"section": "density", "k": k, "export_p50_ms": p50, "export_max_ms": max,
            "resync_s": resync.as_secs_f64(), "resync_per_s": rate}),
        );
    }
    node.stop().await;
    if let (Some((lo_k, lo)), Some((hi_k, hi))) =
        (measured.first_key_value(), measured.last_key_value())
    {
        println!("export cost at k={hi_k} over k={lo_k}: {:.2}x", hi / lo);
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if let Some(paths) = args.serve_agent.take() {
        let [state, socket, configfs, pool]: [PathBuf; 4] = paths
            .try_into()
            .map_err(|_| anyhow::anyhow!("--serve-agent takes four paths"))?;
        return agent::serve_until_sigterm(
            pillar_agent::EngineKind::Uring,
            state,
            socket,
            configfs,
            pool,
        )
        .await;
    }
    if args.quick {
        args.updates = 64;
        args.exports = vec![10, 100];
        args.in_flight = vec![1, 16];
        args.callers = vec![1, 16];
        args.marks = 1_000;
    }
    let base = match &args.dir {
        Some(d) => tempfile::tempdir_in(d)?,
        None => tempfile::tempdir_in(".")?,
    };
    println!(
        "pillar-report: {} updates per configuration, disk under {}",
        args.updates,
        args.dir.as_deref().unwrap_or(Path::new(".")).display()
    );
    let mut out = Vec::new();
    for section in &args.sections {
        match section.as_str() {
            "engine" => engine_section(&args, base.path(), &mut out).await?,
            "e2e" => e2e_section(&args, base.path(), &mut out).await?,
            "density" => density_section(&args, base.path(), &mut out).await?,
            "startup" => startup::section(args.marks, base.path(), &mut out).await?,
            other => anyhow::bail!("unknown section {other:?} (engine, e2e, density, startup)"),
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
        println!("\nJSON written to {}", path.display());
    }
    Ok(())
}
