//! Runs the simulation over a range of seeds and fails on the first that breaks an invariant.
//!
//! - `PILLAR_SIM_START` (default 0), `PILLAR_SIM_SEEDS` (default 300): the seeds run.
//! - `PILLAR_SIM_KEEP_GOING=1`: run every seed and count the violating ones instead of
//!   stopping at the first.
//! - `PILLAR_SIM_STATE_LOSS=<per mille>`: how many agent crashes also lose the state directory
//!   (default 1000: see `sim/README.md`).
//! - `PILLAR_SIM_PAUSE_AFTER_WRITE=<per mille>`: replicas stalled after a token write (default 0).
//! - `PILLAR_SIM_POWER_LOSS=<per mille>`: how many agent crashes are a power loss (default 300).
//! - `PILLAR_SIM_TRACE=1`: print the trace of every seed, not only of a violating one.
//! - `PILLAR_SIM_PROGRESS=<n>`: every `n` seeds, print one line with the seeds done, the
//!   violating seeds so far, the faults injected by kind so far and the wall time, so a long
//!   run that is cut short keeps its totals (default 0: off).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use pillar_sim::{Config, FaultCounts, run_seed};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// proves W8, W4, W5, F5, F11, F3, N5, W7, C6 (the simulation's invariants 1-9 over two
// replicas, three agents, six hosts, agent crashes and power losses, cancellations and a hostile
// network; see sim/src/invariants.rs)
#[test]
fn no_seed_breaks_an_invariant() {
    let start = env("PILLAR_SIM_START", 0);
    let seeds = env("PILLAR_SIM_SEEDS", 300);
    let keep_going = env("PILLAR_SIM_KEEP_GOING", 0) == 1;
    let print_traces = env("PILLAR_SIM_TRACE", 0) == 1;
    let progress = env("PILLAR_SIM_PROGRESS", 0);
    let mut config = Config::default();
    // C6: every crash loses the state directory unless told otherwise.
    config.knobs.state_loss = env("PILLAR_SIM_STATE_LOSS", 1000);
    config.knobs.power_loss = env("PILLAR_SIM_POWER_LOSS", config.knobs.power_loss);
    config.knobs.pause_after_write = env(
        "PILLAR_SIM_PAUSE_AFTER_WRITE",
        config.knobs.pause_after_write,
    );
    let mut totals = FaultCounts::default();
    let mut violating = Vec::new();
    let mut ok_ops = 0;
    let started = std::time::Instant::now();
    for seed in start..start + seeds {
        let outcome = run_seed(seed, &config).expect("the simulation runs");
        totals.add(&outcome.counts);
        ok_ops += outcome.ok;
        if print_traces {
            println!("{}", outcome.trace.join("\n"));
        }
        if let Some(v) = &outcome.violation {
            println!("seed {seed} breaks {v}");
            if !print_traces {
                println!("trace of seed {seed}:\n{}", outcome.trace.join("\n"));
            }
            violating.push((seed, v.invariant));
            if !keep_going {
                break;
            }
        }
        let done = seed - start + 1;
        if progress > 0 && done.is_multiple_of(progress) {
            println!(
                "progress: {done} seeds ({start}..={seed}), {} violating {:?}, {:.1?}, faults: {}",
                violating.len(),
                violating,
                started.elapsed(),
                totals.one_line()
            );
        }
    }
    let run = violating
        .last()
        .filter(|_| !keep_going)
        .map_or(seeds, |(s, _)| s - start + 1);
    println!(
        "seeds {start}..{}: {run} run, {} violating, {ok_ops} operations succeeded, {:.1?}",
        start + run,
        violating.len(),
        started.elapsed()
    );
    let elapsed = started.elapsed();
    println!(
        "{} ms a seed, {} seeds a minute",
        elapsed.as_millis() / u128::from(run.max(1)),
        u128::from(run) * 60_000 / elapsed.as_millis().max(1)
    );
    println!("violating seeds: {violating:?}");
    println!("{totals}");
    assert!(
        violating.is_empty(),
        "seeds breaking an invariant: {violating:?} (rerun one with PILLAR_SIM_START=<seed> PILLAR_SIM_SEEDS=1)"
    );
}
