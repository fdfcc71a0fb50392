//! Scenario 14: every crash state of the agent's durable writes on the real kernel, replayed
//! from a `dm-log-writes` log; and its control, the same with the temp file's fsync left out.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use pillar_agent::fence::{Mark, decode};
use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::v1::agent_client::AgentClient;
use pillar_agent_api::v1::health_response::State;
use pillar_agent_api::{ErrorReason, reason_of};
use pillar_durable::logwrites::{Log, Replay};
use pillar_nvmet::VolumeId;
use sha2::{Digest, Sha256};
use tonic::Code;
use tonic::transport::Channel;

use crate::harness::checks::token;
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::lab::Lab;
use crate::harness::process::channel;
use crate::harness::{ETC_HOSTNQN, MIB, POOL, PORT, START_TIMEOUT};
use crate::logwrites::{FS_TYPE, LogWrites, Mounted};

const VOL_A: &str = "kl-s14-a";
const VOL_B: &str = "kl-s14-b";
const SNAP: &str = "kl-s14-snap";
const UID_A: &str = "5a1e0001-kernel-lane-s14-a";
const UID_B: &str = "5a1e0002-kernel-lane-s14-b";
const UID_S: &str = "5a1e0003-kernel-lane-s14-snap";
/// The mark each acknowledged operation is followed by in the log.
const ACK: &str = "ack-";
/// The test build's switch that leaves out the temp file's fsync of every durable replace
/// (`FaultInjection::SKIP_FSYNC_ENV`).
const SKIP_FSYNC_ENV: &str = "PILLAR_AGENT_TEST_SKIP_FSYNC";

/// A durable record of the state directory, as a restarted agent reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Record {
    StateId,
    Mark(&'static str),
    SnapshotMark(&'static str),
}

const RECORDS: [Record; 4] = [
    Record::StateId,
    Record::Mark(VOL_A),
    Record::Mark(VOL_B),
    Record::SnapshotMark(SNAP),
];

/// What a reader made of a record.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Read {
    Absent,
    Id(String),
    Mark(Mark),
    /// Refused by the agent's own reader (a torn or corrupt record).
    Refused(String),
}

type Snapshot = BTreeMap<Record, Read>;

/// Reads `record` under `state` as the agent reads it at start: the state identity as
/// `StateIdentity::open` parses it (without writing a fresh one), marks with the agent's
/// `fence::decode` (what `MarkStore::read` runs, without creating its directory).
fn read_record(state: &Path, record: Record) -> Read {
    let (path, volume) = match record {
        Record::StateId => (state.join("state-id"), None),
        Record::Mark(v) => (state.join(format!("generations/{v}.json")), Some(v)),
        Record::SnapshotMark(s) => (
            state.join(format!("snapshot-generations/{s}.json")),
            Some(s),
        ),
    };
    let bytes = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Read::Absent,
        Err(e) => return Read::Refused(format!("unreadable: {e}")),
    };
    match volume {
        None => match std::str::from_utf8(&bytes).map(|t| uuid::Uuid::parse_str(t.trim())) {
            Ok(Ok(id)) => Read::Id(id.to_string()),
            _ => Read::Refused(format!("state-id of {} bytes is not a UUID", bytes.len())),
        },
        Some(v) => match decode(&VolumeId::parse(v).unwrap(), &bytes) {
            Ok(mark) => Read::Mark(mark),
            Err(reason) => Read::Refused(format!("{} bytes: {reason}", bytes.len())),
        },
    }
}

fn read_all(state: &Path) -> Snapshot {
    RECORDS
        .iter()
        .map(|&r| (r, read_record(state, r)))
        .collect()
}

/// The state directory's names and contents, hashed: two crash states with the same digest
/// are the same to a restarted agent.
fn digest(dir: &Path) -> String {
    let mut hasher = Sha256::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        let mut entries: Vec<_> = fs::read_dir(&d).unwrap().flatten().collect();
        entries.sort_by_key(fs::DirEntry::file_name);
        for e in entries {
            let path = e.path();
            hasher.update(path.strip_prefix(dir).unwrap().to_string_lossy().as_bytes());
            if e.file_type().unwrap().is_dir() {
                hasher.update(b"/");
                stack.push(path);
            } else {
                hasher.update(fs::read(&path).unwrap_or_default());
            }
            hasher.update(b"\0");
        }
    }
    hex(&hasher.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn generation(read: &Read) -> Option<u64> {
    match read {
        Read::Mark(m) => Some(m.generation),
        _ => None,
    }
}

/// Waits until the agent answers Health, or has exited.
async fn agent_health(lab: &mut Lab) -> Result<(AgentClient<Channel>, State), String> {
    let socket = lab.dir.join("agent.sock");
    let start = Instant::now();
    loop {
        if let Some(status) = lab.agent.as_mut().and_then(|a| a.exited()) {
            return Err(format!("the agent exited at start: {status}"));
        }
        if socket.exists() {
            let mut client = AgentClient::new(channel(&socket).await);
            if let Ok(h) = client.health(agent_api::HealthRequest {}).await {
                let state = h.get_ref().state();
                return Ok((client, state));
            }
        }
        assert!(start.elapsed() < START_TIMEOUT, "the agent did not answer");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn stop_agent(lab: &mut Lab) {
    if let Some(mut agent) = lab.agent.take() {
        agent.stop();
    }
}

/// The fenced operations, each acknowledged and then marked in the log; returns what each
/// acknowledged operation left in the state directory (`[0]`: before the first).
async fn operations(
    lab: &mut Lab,
    lw: &LogWrites,
    env: &[(&str, &str)],
    short: bool,
) -> Vec<Snapshot> {
    let host = fs::read_to_string(ETC_HOSTNQN).unwrap().trim().to_owned();
    let mut values = vec![read_all(&lw.state())];
    let acked = |what: &str, values: &mut Vec<Snapshot>| {
        lw.mark(&format!("{ACK}{}", values.len()));
        values.push(read_all(&lw.state()));
        println!("  acknowledged {}: {what}", values.len() - 1);
    };
    lab.spawn_agent(&lw.state(), &[], env);
    let (mut agent, state) = agent_health(lab).await.expect("the agent starts");
    assert_eq!(
        state,
        State::WaitingForResync,
        "a first start on an empty node"
    );
    acked("first start (state identity)", &mut values);
    agent
        .resync_exports(agent_api::ResyncExportsRequest::default())
        .await
        .expect("resync");
    acked("resync (nothing exported)", &mut values);
    let create = |volume: &str, uid: &str| agent_api::CreateVolumeRequest {
        token: token(uid, 1),
        volume_id: volume.into(),
        pool: POOL.into(),
        size_bytes: 4 * MIB,
        source: None,
    };
    agent
        .create_volume(create(VOL_A, UID_A))
        .await
        .expect("CreateVolume a");
    acked("CreateVolume a (generation 1)", &mut values);
    agent
        .create_snapshot(agent_api::CreateSnapshotRequest {
            token: token(UID_S, 1),
            snapshot_id: SNAP.into(),
            pool: POOL.into(),
            source_volume_id: VOL_A.into(),
            source_lifecycle_uid: UID_A.into(),
        })
        .await
        .expect("CreateSnapshot");
    acked("CreateSnapshot of a", &mut values);
    agent
        .export(agent_api::ExportRequest {
            token: token(UID_A, 2),
            volume_id: VOL_A.into(),
            pool: POOL.into(),
            protocol: Some(agent_api::ExportProtocol {
                service: u32::from(PORT),
                acl: true,
                // The crash states of the marks, not authentication: the same on both kernels.
                auth_none: true,
                tls: false,
            }),
            allowed_host_nqns: vec![],
            credentials: vec![],
        })
        .await
        .expect("Export a");
    acked("Export a (generation 2)", &mut values);
    if short {
        // The control: a first write of a mark and a replacement are enough to catch a
        // missing fsync.
        stop_agent(lab);
        return values;
    }
    let acl = |generation| agent_api::GrantInitiatorRequest {
        token: token(UID_A, generation),
        volume_id: VOL_A.into(),
        host_nqn: host.clone(),
        credentials: None,
    };
    agent.grant_initiator(acl(3)).await.expect("GrantInitiator");
    acked("GrantInitiator a (generation 3)", &mut values);
    let revoke = agent_api::RevokeInitiatorRequest {
        token: token(UID_A, 4),
        volume_id: VOL_A.into(),
        host_nqn: host.clone(),
    };
    agent
        .revoke_initiator(revoke)
        .await
        .expect("RevokeInitiator");
    acked("RevokeInitiator a (generation 4)", &mut values);
    agent
        .unexport(agent_api::UnexportRequest {
            token: token(UID_A, 5),
            volume_id: VOL_A.into(),
        })
        .await
        .expect("Unexport a");
    acked("Unexport a (generation 5)", &mut values);
    agent
        .create_volume(create(VOL_B, UID_B))
        .await
        .expect("CreateVolume b");
    acked("CreateVolume b (generation 1)", &mut values);
    agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: token(UID_B, 2),
            volume_id: VOL_B.into(),
            pool: POOL.into(),
        })
        .await
        .expect("DeleteVolume b");
    acked("DeleteVolume b (generation 2, ended)", &mut values);
    stop_agent(lab);
    values
}

/// What a run found.
#[derive(Debug, Default)]
struct Counts {
    entries: usize,
    writes: usize,
    flushes: usize,
    marks: usize,
    states: usize,
    checked: usize,
    distinct: usize,
    restarts: usize,
    violations: Vec<String>,
}

/// Runs the operations on a logged file system, then replays every point of the log and checks
/// the state there (see the scenario's documentation). The control (`skip_fsync`) runs the
/// first five operations and only the record checks, which are what catch it: restarting the
/// agent on its states costs most of the time.
async fn run(lab: &mut Lab, skip_fsync: bool) -> Counts {
    let env: &[(&str, &str)] = if skip_fsync {
        &[(SKIP_FSYNC_ENV, "1")]
    } else {
        &[]
    };
    let t = Instant::now();
    let (mut lw, base) = LogWrites::create(&lab.dir.join("logwrites"), "pillar-s14");
    let values = operations(lab, &lw, env, skip_fsync).await;
    let log = lw.finish();
    drop(lw);
    println!("  operations and log: {:.1}s", t.elapsed().as_secs_f64());
    check_log(lab, log, base, &values, !skip_fsync).await
}

async fn check_log(
    lab: &mut Lab,
    log: Log,
    base: Vec<u8>,
    values: &[Snapshot],
    restart: bool,
) -> Counts {
    let t = Instant::now();
    let (entries, writes, flushes, marks) = log.counts();
    let mut counts = Counts {
        entries,
        writes,
        flushes,
        marks,
        ..Counts::default()
    };
    // The acknowledged operations before each entry.
    let mut acked_at = Vec::with_capacity(log.entries.len());
    let mut acked = 0;
    for e in &log.entries {
        if e.mark.as_deref().is_some_and(|m| m.starts_with(ACK)) {
            acked += 1;
        }
        acked_at.push(acked);
    }
    assert_eq!(
        acked,
        values.len() - 1,
        "one mark per acknowledged operation"
    );
    let mut replay = Replay::new(log, base);
    let mut restarted = HashSet::new();
    let mut seen = HashSet::new();
    let scratch = lab.dir.join("replay");
    for point in replay.points() {
        replay.advance_to(point).expect("the log replays");
        let acked = acked_at[point];
        counts.states += 1;
        let mounted = match Mounted::mount(&replay, &scratch) {
            Ok(m) => m,
            Err(e) => {
                counts
                    .violations
                    .push(format!("entry {point}: {FS_TYPE} does not mount: {e}"));
                continue;
            }
        };
        let got = read_all(&mounted.state());
        let mut bad = check_records(&got, values, acked);
        let key = digest(&mounted.state());
        seen.insert(key.clone());
        // The mark of `a` the acknowledged operations had reached: a stale call below it must
        // be refused by the restarted agent.
        let floor = generation(&values[acked][&Record::Mark(VOL_A)]);
        if restart && restarted.insert((key, floor)) {
            counts.restarts += 1;
            bad.extend(restart_and_probe(lab, &mounted.state(), &got, floor).await);
        }
        counts.checked += 1;
        for b in bad {
            counts
                .violations
                .push(format!("entry {point} (after {acked} acknowledged): {b}"));
        }
    }
    counts.distinct = seen.len();
    println!(
        "  replay: {} states, {} distinct, {} agent restarts: {:.1}s",
        counts.states,
        counts.distinct,
        counts.restarts,
        t.elapsed().as_secs_f64()
    );
    counts
}

/// Each record must read as its value after the acknowledged operations or after the one in
/// flight: never torn, never behind what was acknowledged.
fn check_records(got: &Snapshot, values: &[Snapshot], acked: usize) -> Vec<String> {
    let mut bad = Vec::new();
    for record in RECORDS {
        let allowed: Vec<&Read> = [values.get(acked), values.get(acked + 1)]
            .into_iter()
            .flatten()
            .map(|s| &s[&record])
            .collect();
        if !allowed.contains(&&got[&record]) {
            bad.push(format!(
                "{record:?} reads {:?}, allowed {allowed:?}",
                got[&record]
            ));
        }
    }
    bad
}

/// Restarts the real agent on the state and checks that it fails closed: a lost mark of a
/// volume the pool holds (or a corrupt state identity) makes it STATE_LOST, and a revoke
/// below the acknowledged mark of `a` is refused.
async fn restart_and_probe(
    lab: &mut Lab,
    state: &Path,
    got: &Snapshot,
    floor: Option<u64>,
) -> Vec<String> {
    let mut bad = Vec::new();
    lab.spawn_agent(state, &[], &[]);
    let health = agent_health(lab).await;
    let lost = got[&Record::Mark(VOL_A)] == Read::Absent
        || matches!(got[&Record::StateId], Read::Refused(_));
    match health {
        Err(e) => {
            if !got.values().any(|r| matches!(r, Read::Refused(_))) {
                bad.push(format!(
                    "the restarted agent did not serve a readable state: {e}"
                ));
            }
        }
        Ok((mut agent, health)) => {
            let want = if lost {
                State::Lost
            } else {
                State::WaitingForResync
            };
            if health != want {
                bad.push(format!("restarted agent is {health:?}, expected {want:?}"));
            }
            let probe = floor
                .filter(|g| *g >= 2)
                .map(|g| g - 1)
                .or(lost.then_some(1));
            if let Some(generation) = probe {
                let r = agent
                    .revoke_initiator(agent_api::RevokeInitiatorRequest {
                        token: token(UID_A, generation),
                        volume_id: VOL_A.into(),
                        host_nqn: fs::read_to_string(ETC_HOSTNQN).unwrap().trim().to_owned(),
                    })
                    .await;
                let refused = match &r {
                    Err(s) if lost => reason_of(s) == ErrorReason::StateLost,
                    // Below the mark (FAILED_PRECONDITION), or a corrupt mark refused
                    // (DATA_LOSS, MARK_CORRUPT): both fail closed.
                    Err(s) => matches!(s.code(), Code::FailedPrecondition | Code::DataLoss),
                    Ok(_) => false,
                };
                if !refused {
                    bad.push(format!(
                        "a revoke at generation {generation} (below the acknowledged mark) was not refused: {:?}",
                        r.map(|_| ()).map_err(|s| (s.code(), s.message().to_owned()))
                    ));
                }
            }
        }
    }
    stop_agent(lab);
    bad
}

fn report(kind: &str, c: &Counts) {
    println!(
        "  CRASH-STATES {kind} kernel={} fs={FS_TYPE}: log entries {}, writes {}, flush/FUA {}, \
         marks {}, states replayed {}, checked {}, distinct state directories {}, agent \
         restarts {}, violations {}",
        crate::harness::gate::kernel_release(),
        c.entries,
        c.writes,
        c.flushes,
        c.marks,
        c.states,
        c.checked,
        c.distinct,
        c.restarts,
        c.violations.len()
    );
    for v in c.violations.iter().take(20) {
        println!("    {v}");
    }
}

/// Scenario 14: the agent's state directory on ext4 on a `dm-log-writes` device; a first start,
/// a resync, CreateVolume, CreateSnapshot, Export, GrantInitiator, RevokeInitiator, Unexport,
/// CreateVolume and DeleteVolume, each acknowledged and marked in the log. Every FLUSH, FUA and
/// mark entry of the log is replayed onto a fresh device and mounted: each record (the state
/// identity, the volumes' marks, the snapshot's mark) reads as its value after the acknowledged
/// operations or the one in flight, and the real agent restarted on each distinct state fails
/// closed (STATE_LOST when the pool holds a volume whose mark is missing) and refuses a revoke
/// below the acknowledged mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s14_crash_states() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s14_crash_states");
    let mut lab = Lab::new("s14", true).await;
    let counts = run(&mut lab, false).await;
    report("replay", &counts);
    // proves F7, C6 on the real kernel: no crash state of the log is torn, behind an
    // acknowledged mark, or served without its mark.
    assert!(counts.states > counts.marks, "{counts:?}");
    assert_eq!(counts.checked, counts.states, "every state checked");
    assert!(counts.violations.is_empty(), "{:#?}", counts.violations);
    sc.step("every flush, FUA and mark point replayed and checked");
}

/// Control of scenario 14: the same with the agent's temp-file fsync left out (the test
/// build's `PILLAR_AGENT_TEST_SKIP_FSYNC`), through Export only and without the agent
/// restarts: the replay must find a crash state where an acknowledged mark is not there (its
/// reader refuses what is there instead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s14_control_skipped_fsync_caught() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s14_control_skipped_fsync_caught");
    let mut lab = Lab::new("s14c", true).await;
    let counts = run(&mut lab, true).await;
    report("control-skipped-fsync", &counts);
    let log = fs::read_to_string(lab.dir.join("logs/agent.log")).unwrap();
    assert!(
        log.contains(SKIP_FSYNC_ENV),
        "the agent did not run with its fsync left out (not a fault-injection build?)"
    );
    assert_eq!(counts.checked, counts.states, "every state checked");
    assert!(
        !counts.violations.is_empty(),
        "the broken write order must be caught: {counts:?}"
    );
    sc.step("the skipped fsync is caught");
}
