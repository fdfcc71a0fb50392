//! Benchmark 1 (issue 26 goal 5): the attach path a pod waits for, on the real kernel.
//!
//! For each of N volumes (`PILLAR_LANE_ATTACH_VOLUMES`, default 50): CreateVolume,
//! ControllerPublishVolume, NodeStageVolume (NVMe/TCP connect, device wait, mkfs ext4, mount),
//! NodePublishVolume, each timed by the caller. NodeStage is broken down from the node plugin's
//! own log: it logs, with microsecond timestamps and the volume in its span, `connecting`,
//! `connected`, `namespace identity verified`, `formatting`, `formatted a blank device`,
//! `mounting` and `staged`. What lies between those events and is not the kernel's or a tool's
//! (request checks, the durable stage record, the reservation, the reply) is pillar's own work,
//! as are CreateVolume, ControllerPublish and NodePublish (the agent's backing file, loop
//! device, configfs writes and marks included: they are what pillar does, not what a pod's
//! attach must do anyway).
//!
//! It asserts only that every attach worked and that every phase was found in the log; the
//! figures are printed (`ATTACH-PATH` lines) for the report, never judged here: under TCG they
//! say where the time goes, not how fast real hardware is. Not part of the lane's default run
//! (tests/kernel-lane/run.sh leaves `b1_` out unless asked: `run.sh b1_`).

use std::collections::HashMap;
use std::fs;
use std::time::{Duration, Instant, SystemTime};

use pillar_agent_api::v1 as agent_api;

use crate::harness::MIB;
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::lab::{Lab, Staged};

/// The node plugin's log events that open each phase of a stage, in order.
const EVENTS: [&str; 7] = [
    "connecting",
    "connected",
    "namespace identity verified",
    "formatting",
    "formatted a blank device",
    "mounting",
    "staged",
];

/// The phases: (name, whose work, index of the event that opens it in `EVENTS` or `None` for the
/// call's start, index of the event that closes it or `None` for the call's reply).
const STAGE_PHASES: [(&str, Whose, Option<usize>, Option<usize>); 8] = [
    (
        "stage: checks and stage record",
        Whose::Pillar,
        None,
        Some(0),
    ),
    ("stage: NVMe/TCP connect", Whose::Kernel, Some(0), Some(1)),
    (
        "stage: device wait + identity",
        Whose::Kernel,
        Some(1),
        Some(2),
    ),
    (
        "stage: record, reservation",
        Whose::Pillar,
        Some(2),
        Some(3),
    ),
    ("stage: probe + mkfs", Whose::Kernel, Some(3), Some(4)),
    ("stage: record", Whose::Pillar, Some(4), Some(5)),
    ("stage: mount + record", Whose::Kernel, Some(5), Some(6)),
    ("stage: reply", Whose::Pillar, Some(6), None),
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Whose {
    Pillar,
    Kernel,
}

/// One volume's timings, in seconds.
struct Timing {
    create: f64,
    publish: f64,
    stage_sent: SystemTime,
    stage_done: SystemTime,
    node_publish: f64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh b1_)"]
async fn b1_attach_path() {
    if !in_lane() {
        return;
    }
    let n: usize = std::env::var("PILLAR_LANE_ATTACH_VOLUMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let sc = Scenario::start("b1_attach_path");
    let mut lab = Lab::new("b1", true).await;
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut node = lab.start_default_node().await;
    lab.wait_agent_state(
        agent_api::health_response::State::Serving,
        Duration::from_secs(30),
    )
    .await;
    let mut timings = Vec::with_capacity(n);
    let mut staged = Vec::with_capacity(n);
    for i in 0..n {
        let vol = format!("kl-b1-{i:03}");
        let t = Instant::now();
        lab.create_volume(&mut ctl, &vol, 32 * MIB).await;
        let create = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let context = lab.publish(&mut ctl, &vol, &node).await.unwrap();
        let publish = t.elapsed().as_secs_f64();
        let stage_sent = SystemTime::now();
        let staging = lab.stage(&mut node, &vol, &context).await.unwrap();
        let stage_done = SystemTime::now();
        let t = Instant::now();
        let target = lab.node_publish(&mut node, &vol, &staging, &context).await;
        let node_publish = t.elapsed().as_secs_f64();
        timings.push(Timing {
            create,
            publish,
            stage_sent,
            stage_done,
            node_publish,
        });
        staged.push((vol, context, staging, target));
    }
    sc.step(&format!(
        "{n} volumes created, published, staged and published"
    ));

    let log = fs::read_to_string(lab.dir.join("logs/node-a.log")).unwrap();
    let events = stage_events(&log);
    report(&timings, &staged, &events);
    sc.step("phases read from the node plugin's log");

    for (vol, publish_context, staging, target) in staged {
        let s = Staged::on(&node, &vol, publish_context, staging, target);
        lab.detach(&mut ctl, &mut node, &s).await;
        lab.delete_volume(&mut ctl, &vol).await;
    }
    sc.step("every volume detached and deleted");
}

/// The wall-clock time of each `EVENTS` line of each volume's NodeStageVolume span.
fn stage_events(log: &str) -> HashMap<String, [Option<SystemTime>; EVENTS.len()]> {
    let mut out: HashMap<String, [Option<SystemTime>; EVENTS.len()]> = HashMap::new();
    for line in log.lines() {
        let Some(rest) = line
            .split_once("NodeStageVolume{volume_id=")
            .map(|(_, r)| r)
        else {
            continue;
        };
        let Some((volume, message)) = rest.split_once('}') else {
            continue;
        };
        let Some(at) = line.split_whitespace().next().and_then(parse_rfc3339_utc) else {
            continue;
        };
        // "}: <target>: <message> key=value ...": the message is what follows the target.
        let message = message.trim_start_matches(": ");
        let message = message.split_once(": ").map_or(message, |(_, m)| m);
        if let Some(i) = EVENTS
            .iter()
            .position(|e| message == *e || message.starts_with(&format!("{e} ")))
        {
            out.entry(volume.to_owned()).or_default()[i].get_or_insert(at);
        }
    }
    out
}

/// `2026-12-04T11:58:40.161801Z` (tracing's default, UTC).
fn parse_rfc3339_utc(s: &str) -> Option<SystemTime> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|p| p.parse::<i64>().ok());
    let (hh, mm, ss) = (t.next()??, t.next()??, t.next()??);
    let nanos: u32 = format!("{frac:0<9}")[..9].parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = u64::try_from(days * 86_400 + hh * 3600 + mm * 60 + ss).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::new(secs, nanos))
}

fn secs(from: SystemTime, to: SystemTime) -> f64 {
    to.duration_since(from)
        .map_or_else(|e| -e.duration().as_secs_f64(), |d| d.as_secs_f64())
}

/// p50 and p99 (nearest rank) of `v`.
fn percentiles(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let rank = |percent: usize| v[(percent * v.len()).div_ceil(100).clamp(1, v.len()) - 1];
    (rank(50), rank(99))
}

type Row = (&'static str, Whose, Vec<f64>);

fn report(
    timings: &[Timing],
    staged: &[(
        String,
        HashMap<String, String>,
        std::path::PathBuf,
        std::path::PathBuf,
    )],
    events: &HashMap<String, [Option<SystemTime>; EVENTS.len()]>,
) {
    let mut rows: Vec<Row> = vec![
        ("CreateVolume", Whose::Pillar, vec![]),
        ("ControllerPublishVolume", Whose::Pillar, vec![]),
    ];
    rows.extend(
        STAGE_PHASES
            .iter()
            .map(|(name, whose, ..)| (*name, *whose, vec![])),
    );
    rows.push(("NodePublishVolume", Whose::Pillar, vec![]));
    let mut totals = Vec::new();
    for (t, (vol, ..)) in timings.iter().zip(staged) {
        let ev = events
            .get(vol)
            .unwrap_or_else(|| panic!("no stage events of {vol} in the node plugin's log"));
        rows[0].2.push(t.create);
        rows[1].2.push(t.publish);
        for (k, (name, _, from, to)) in STAGE_PHASES.iter().enumerate() {
            let at = |i: Option<usize>, call: SystemTime| {
                i.map_or(Some(call), |i| ev[i])
                    .unwrap_or_else(|| panic!("{vol}: no '{}' event ({name})", EVENTS[i.unwrap()]))
            };
            rows[2 + k]
                .2
                .push(secs(at(*from, t.stage_sent), at(*to, t.stage_done)));
        }
        rows[2 + STAGE_PHASES.len()].2.push(t.node_publish);
        totals.push(t.create + t.publish + secs(t.stage_sent, t.stage_done) + t.node_publish);
    }
    let total: f64 = totals.iter().sum();
    let mut pillar = 0.0;
    println!(
        "ATTACH-PATH volumes={} (seconds; share of the summed attach time)",
        timings.len()
    );
    for (name, whose, mut v) in rows {
        let sum: f64 = v.iter().sum();
        if whose == Whose::Pillar {
            pillar += sum;
        }
        let (p50, p99) = percentiles(&mut v);
        let who = if whose == Whose::Pillar {
            "pillar"
        } else {
            "kernel/tool"
        };
        println!(
            "ATTACH-PATH phase={name:?} whose={who} p50={p50:.3} p99={p99:.3} share={:.3}",
            sum / total
        );
    }
    let (p50, p99) = percentiles(&mut totals);
    println!(
        "ATTACH-PATH total p50={p50:.3} p99={p99:.3} pillar_share={:.3}",
        pillar / total
    );
}
