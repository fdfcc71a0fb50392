//! Criterion benches of the agent's hot paths, for tracking one design between commits:
//! `cargo bench -p pillar-benches` (`PILLAR_BENCH_DIR` picks the disk for the mark updates;
//! the system's temporary directory otherwise).
//!
//! The side-by-side report (ratios against the floor and simpler designs, CPU and syscalls per
//! operation, many callers) is `pillar-report`; these run one caller at a time and let
//! criterion's statistics say whether a change moved a path.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use pillar_agent::engine::sync::SyncEngine;
use pillar_agent::engine::uring::{UringConfig, UringEngine};
use pillar_agent::engine::{DurableDir, Engine};
use pillar_benches::{MARK, agent, sync_update};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime of two workers starts on any machine this bench runs on")
}

fn bench_dir() -> tempfile::TempDir {
    let base = std::env::var_os("PILLAR_BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from);
    tempfile::tempdir_in(base).expect("the bench directory is writable")
}

/// A fenced mark update at one in flight: the disk's floor, then pillar's two engines.
fn mark_update(c: &mut Criterion) {
    let rt = runtime();
    let dir = bench_dir();
    let mut group = c.benchmark_group("mark_update");

    let floor = dir.path().join("floor");
    std::fs::create_dir_all(&floor).expect("create the floor's directory");
    let floor_fd = std::fs::File::open(&floor).expect("open the floor's directory");
    group.bench_function("floor", |b| {
        b.iter(|| sync_update(&floor, &floor_fd, "mark.json").expect("a durable replace"));
    });

    let engines = [
        Engine::Uring(UringEngine::start(UringConfig::default()).expect("an io_uring engine")),
        Engine::Sync(SyncEngine::new()),
    ];
    for engine in engines {
        let name = engine.name();
        let durable = DurableDir::open(dir.path().join(name)).expect("open the engine's directory");
        group.bench_function(BenchmarkId::new("pillar", name), |b| {
            b.iter(|| {
                rt.block_on(engine.replace_file(&durable, "mark.json", MARK.to_vec()))
                    .expect("a durable replace");
            });
        });
    }
    group.finish();
}

/// Grant and revoke of one host through the agent's gRPC on a unix socket (configfs double on
/// tmpfs, marks on the bench directory): the whole fenced path of one call.
fn grant_revoke(c: &mut Criterion) {
    let rt = runtime();
    let dir = bench_dir();
    let volume = agent::volume(1);
    let (node, mut client) = rt
        .block_on(async {
            let node = agent::Node::start(dir.path(), "grant-revoke").await?;
            let mut client = node.client().await?;
            node.create(&mut client, &volume).await?;
            node.export(&mut client, &volume, &[]).await?;
            anyhow::Ok((node, client))
        })
        .expect("an agent with one exported volume");
    // Tokens above the export's; every call takes a newer one, as the controller's would.
    let mut generation = 10;
    c.bench_function("grant_then_revoke", |b| {
        b.iter(|| {
            rt.block_on(async {
                generation += 1;
                agent::grant_or_revoke(&mut client, &volume, generation, true).await?;
                generation += 1;
                agent::grant_or_revoke(&mut client, &volume, generation, false).await
            })
            .expect("grant and revoke succeed");
        });
    });
    rt.block_on(node.stop());
}

/// One more Export with k exports present (only the Export is timed; its create before and
/// its unexport and delete after are not): the cost must not grow with k.
fn kth_export(c: &mut Criterion) {
    let rt = runtime();
    let dir = bench_dir();
    let mut group = c.benchmark_group("kth_export");
    group.sample_size(20);
    let node = rt
        .block_on(agent::Node::start(dir.path(), "kth-export"))
        .expect("an agent");
    let mut client = rt.block_on(node.client()).expect("a client");
    let hosts = [agent::host(1)];
    let mut present = 0;
    let mut probe = 0_u64;
    for k in [10, 1000] {
        rt.block_on(async {
            while present < k {
                present += 1;
                let v = agent::volume(present);
                node.create(&mut client, &v).await?;
                node.export(&mut client, &v, &hosts).await?;
            }
            anyhow::Ok(())
        })
        .expect("k exports");
        group.bench_with_input(BenchmarkId::from_parameter(k), &k, |b, _| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        // Its own name: a deleted volume's lifecycle is over for good (F6).
                        probe += 1;
                        let v = format!("pvc-probe-{probe}");
                        node.create(&mut client, &v).await?;
                        let t = Instant::now();
                        node.export(&mut client, &v, &hosts).await?;
                        spent += t.elapsed();
                        node.unexport_and_delete(&mut client, &v).await?;
                    }
                    anyhow::Ok(spent)
                })
                .expect("a probe export")
            });
        });
    }
    group.finish();
    rt.block_on(node.stop());
}

criterion_group!(benches, mark_update, grant_revoke, kth_export);
criterion_main!(benches);
