//! The startup section: the agent's real server, started as a process of its own (this binary
//! with `--serve-agent`), on a state directory holding `marks` fencing marks and a pool holding
//! as many volumes (so its scan for volumes without a mark reads every one): the time from the
//! spawn until it answers Health, and its resident memory then (VmRSS) and at its peak (VmHWM).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pillar_agent::fence::{Mark, encode};
use pillar_benches::agent;
use serde_json::json;

/// Starts measured (after one start that is not).
const ROUNDS: usize = 3;

pub async fn section(
    marks: usize,
    dir: &Path,
    out: &mut Vec<serde_json::Value>,
) -> anyhow::Result<()> {
    let state = dir.join("startup-state");
    let shm = tempfile::tempdir_in("/dev/shm")?;
    let (configfs, pool) = (shm.path().join("configfs"), shm.path().join("pool"));
    let t = Instant::now();
    populate(&state, &pool, marks)?;
    println!(
        "\nstartup: {marks} marks and {marks} volumes in the pool (written in {:.1} s); \
         spawn until Health answers",
        t.elapsed().as_secs_f64()
    );
    println!(
        "{:>7} {:>10} {:>12} {:>12}",
        "round", "ready ms", "VmRSS MiB", "VmHWM MiB"
    );
    let paths = [state, dir.join("startup.sock"), configfs, pool];
    start_once(&paths).await?;
    for round in 1..=ROUNDS {
        let (ready, rss, hwm) = start_once(&paths).await?;
        let ready_ms = ready.as_secs_f64() * 1e3;
        println!("{round:>7} {ready_ms:>10.1} {rss:>12.1} {hwm:>12.1}");
        out.push(json!({"section": "startup", "marks": marks, "round": round,
            "ready_ms": ready_ms, "rss_mib": rss, "peak_rss_mib": hwm}));
    }
    Ok(())
}

/// `marks` marks (`<state>/generations/<volume>.json`, as the agent writes them, without the
/// fsyncs) and as many sparse 1 MiB volumes in the plain-file pool.
fn populate(state: &Path, pool: &Path, marks: usize) -> anyhow::Result<()> {
    let generations = state.join("generations");
    std::fs::create_dir_all(&generations)?;
    std::fs::create_dir_all(pool)?;
    for n in 1..=marks {
        let volume = agent::volume(n);
        let mark = Mark {
            volume: volume.clone(),
            owner_uid: format!("uid-{volume}"),
            generation: 2,
            ended: false,
            retired_uids: Vec::new(),
        };
        std::fs::write(generations.join(format!("{volume}.json")), encode(&mark)?)?;
        std::fs::File::create(pool.join(format!("{volume}.img")))?.set_len(1 << 20)?;
    }
    Ok(())
}

/// One start: the time until Health answers, and VmRSS and VmHWM (MiB) then.
async fn start_once(paths: &[PathBuf; 4]) -> anyhow::Result<(Duration, f64, f64)> {
    let _ = std::fs::remove_file(&paths[1]);
    let t = Instant::now();
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--serve-agent")
        .args(paths)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let ready = loop {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(600),
            "the agent did not answer Health"
        );
        if let Ok(mut client) = agent::connect(&paths[1]).await
            && client
                .health(pillar_agent_api::v1::HealthRequest::default())
                .await
                .is_ok()
        {
            break t.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id()))?;
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    let (rss, hwm) = (kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0);
    let pid = libc::pid_t::try_from(child.id())?;
    // SAFETY: a signal to the child this process spawned and has not reaped yet.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    child.wait()?;
    Ok((ready, rss, hwm))
}
