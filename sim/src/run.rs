//! One seed's run: the world built, the drawn operations started as tasks between the faults,
//! the invariants checked after every step, then the drain. Here, not in `world`, so that the
//! world knows nothing of the operations drawn on it (`ops` reads the world; this drives both).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pillar_agent::blocking::Deferral;

use crate::chaos::{Chaos, Fault};
use crate::error::SimError;
use crate::invariants::Violation;
use crate::ops::{self, Draw};
use crate::world::{Config, SeedOutcome, World, temp_root};

/// Runs seed `seed` to its end or its first violation.
pub fn run_seed(seed: u64, config: &Config) -> Result<SeedOutcome, SimError> {
    let chaos = Chaos::new(seed, config.knobs);
    let deferral = {
        let chaos = chaos.clone();
        move || {
            let k = chaos.knobs;
            let mut d = Deferral::default();
            if chaos.strikes(Fault::WorkDeferred, k.defer_work, "blocking work deferred") {
                d.yields = u32::try_from(1 + chaos.below(16)).unwrap_or(1);
            }
            if chaos.strikes(Fault::WorkSlow, k.slow_work, "blocking work slow") {
                d.delay = chaos.pause(300);
            }
            d
        }
    };
    let _claim = pillar_agent::blocking::claim_thread(deferral);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    let dir = temp_root()?;
    let result = runtime.block_on(async { world(seed, config, &chaos, dir.path()).await });
    // Background tasks (channels, servers) die with the runtime.
    runtime.shutdown_background();
    let (violation, ok) = result?;
    Ok(SeedOutcome {
        seed,
        violation,
        counts: chaos.counts(),
        trace: chaos.trace_lines(),
        ok,
    })
}

/// Starts `op` as a task that traces its result.
fn spawn(
    chaos: &Chaos,
    ok: &Arc<AtomicUsize>,
    step: usize,
    label: String,
    op: ops::Op,
) -> tokio::task::JoinHandle<()> {
    let cancel_after = if chaos.enabled() && chaos.below(1000) < chaos.knobs.cancel {
        Some(chaos.pause(250))
    } else {
        None
    };
    chaos.trace(format!("step {step}: {label} (deadline {cancel_after:?})"));
    let (c, ok) = (chaos.clone(), Arc::clone(ok));
    tokio::spawn(async move {
        let limit = cancel_after.unwrap_or(Duration::from_secs(600));
        let line = match tokio::time::timeout(limit, op).await {
            Ok(Ok(())) => {
                ok.fetch_add(1, Ordering::Relaxed);
                "ok".to_owned()
            }
            Ok(Err(e)) => e,
            Err(_) => {
                c.count(
                    Fault::Cancelled,
                    &format!("step {step} dropped at an await point"),
                );
                "cancelled".to_owned()
            }
        };
        c.trace(format!("  step {step} ({label}) -> {line}"));
    })
}

async fn world(
    seed: u64,
    config: &Config,
    chaos: &Chaos,
    dir: &std::path::Path,
) -> Result<(Option<Violation>, usize), SimError> {
    let mut w = World::build(config, chaos, dir).await?;
    chaos.trace(format!("seed {seed}: {config:?}"));
    w.replicas[0].resync_waiting_agents().await;
    let ok = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    let mut violation = None;
    for step in 0..config.steps {
        match ops::draw(&w, step) {
            Draw::Crash => w.crash(step).await?,
            Draw::Skip(why) => chaos.trace(format!("step {step}: {why}")),
            Draw::Task(label, op) => {
                tasks.push(spawn(chaos, &ok, step, label, op));
                w.run_for(chaos.pause(40)).await;
            }
        }
        w.settle_power_loss(step, false).await?;
        violation = w.check()?;
        if violation.is_some() {
            break;
        }
    }
    if violation.is_none() {
        violation = drain(&mut w, tasks).await?;
    }
    if let Some(v) = &violation {
        chaos.trace(format!("VIOLATION {v}"));
    }
    Ok((violation, ok.load(Ordering::Relaxed)))
}

/// The drain: no new faults; everything in flight lands or times out, agents are resynced. A
/// power loss still armed stays armed while the work in flight lands (the replies and resyncs
/// of the drain are where most fenced writes of a seed happen), then is cut; the agent is
/// resynced once more before the last check.
async fn drain(
    w: &mut World,
    tasks: Vec<tokio::task::JoinHandle<()>>,
) -> Result<Option<Violation>, SimError> {
    let chaos = w.chaos.clone();
    chaos.disable();
    chaos.trace("drain".into());
    for t in tasks {
        let _ = t.await;
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
    w.replicas[0].resync_waiting_agents().await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    if w.armed.is_some() {
        w.settle_power_loss(w.config.steps, true).await?;
        if let Some(v) = w.check()? {
            return Ok(Some(v));
        }
        w.replicas[0].resync_waiting_agents().await;
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    w.check()
}
