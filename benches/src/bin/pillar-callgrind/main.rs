//! pillar-callgrind: instructions per fenced call, counted by valgrind's callgrind (a count that
//! does not depend on what else the machine runs), by layer; the companion of `pillar-report`.
//!
//! Usage: pillar-callgrind [--dir DIR] [--calls N] [--json FILE] [--keep]
//!
//! - calls: the agent's real gRPC server (`pillar_agent::serve_with_limits`: the bounds, the
//!   accept loop and the authority rewriter of every unix-socket connection, tracing at `info`
//!   as the binary logs) runs as `pillar-callgrind agent` under callgrind: the synchronous
//!   engine (valgrind 3.19 hangs in the io_uring engine's `io_uring_enter`), marks on DIR, the
//!   configfs double and a plain-file pool on tmpfs, an anchor volume keeping host 1's entry
//!   in use. This process is the client, outside valgrind. After a warm-up it
//!   grants host 1 on N volumes, revokes it on them, then does the same on 2N volumes; a
//!   GetCapabilities call between the phases makes callgrind dump and zero its counts
//!   (`--dump-before` its handler), so every window holds its calls and one marker call's
//!   halves, and the difference of the 2N and N windows divided by N is one call, without them.
//! - mark: one fencing mark update alone (`MarkStore::write` on the same engine: encode,
//!   checksum, write temp, fsync, rename, fsync directory), run as `pillar-callgrind mark`
//!   under callgrind and windowed the same way, by a marker function.
//!
//! Callgrind counts the instructions of user space (every thread of the process), not the
//! kernel's: the syscalls' own work (fsync, configfs) is not in these figures. The dumps are
//! read from callgrind's own format ([`profile`]). An instruction is in the row of the innermost
//! layer (`LAYERS`: the functions that start each) on the stack when it ran, so the rows add up
//! to the call's total; what no layer claims is the gRPC/HTTP/2 stack (the rewriter has its own
//! row), tokio and the rest.

#![allow(clippy::print_stdout)] // a benchmark reports on stdout

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use pillar_benches::agent;
use serde_json::json;

use crate::profile::Profile;

mod profile;

#[derive(Parser, Debug)]
struct Args {
    #[command(subcommand)]
    mode: Option<Mode>,
    /// Directory on the disk for the marks.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Calls per window (the larger window has twice as many).
    #[arg(long, default_value_t = 100)]
    calls: usize,
    /// Where to write the JSON report.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Keep the callgrind files (their directory is printed).
    #[arg(long)]
    keep: bool,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// The agent's server, as the counted process (run by the report under valgrind).
    Agent {
        #[arg(long)]
        state: PathBuf,
        #[arg(long)]
        socket: PathBuf,
        #[arg(long)]
        configfs: PathBuf,
        #[arg(long)]
        pool: PathBuf,
    },
    /// Mark updates alone, windowed by `callgrind_window` (run by the report under valgrind).
    Mark {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        calls: usize,
    },
}

/// The function whose entry makes callgrind dump in the agent: the GetCapabilities handler.
const AGENT_MARKER: &str = "*AgentService*as*Agent>::get_capabilities";
/// The same in `mark` mode.
const MARK_MARKER: &str = "*callgrind_window";

/// Each layer and the functions that start it (matched as suffixes of the demangled name). A
/// layer's function called inside another layer's is counted in its own layer, not twice.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "authority rewriter (HTTP/2 header blocks)",
        &["pillar_grpc_unix::rewrite::Rewriter::feed"],
    ),
    (
        "request parsing (proto decode, typed fields)",
        &[
            "pillar_agent::grpc::volume_id",
            "pillar_agent::grpc::host_nqn",
            "pillar_agent::grpc::token",
            "<tonic::codec::prost::ProstDecoder<U> as tonic::codec::Decoder>::decode",
        ],
    ),
    (
        "fence check (read, decode, decide)",
        &[
            "pillar_agent::fence::MarkStore::read",
            "pillar_agent::fence::decide",
        ],
    ),
    // The mark's encoding and submission (`MarkStore::write`'s future) is inlined into
    // `change_acl`'s and counted in the rest.
    (
        "mark write (durable replace, blocking thread)",
        &["pillar_agent::engine::sync::replace_blocking"],
    ),
    (
        "planning (model view, plan, identity)",
        &[
            "pillar_agent::service::acl::<impl pillar_agent::service::Agent>::plan_acl_change",
            "pillar_nvmet::plan::plan_links",
            "pillar_nvmet::plan::plan_cut_connections",
            "pillar_nvmet::target_model::TargetModel::view_with_hosts",
            "pillar_nvmet::target_model::TargetModel::refresh",
            "pillar_nvmet::plan::Released::by",
        ],
    ),
    (
        "configfs reads (scoped read + read-back)",
        &["pillar_nvmet::model::observe_scope"],
    ),
    ("configfs writes (double)", &["pillar_nvmet::exec::apply"]),
    (
        "read-back check",
        &[
            "pillar_nvmet::exec::verify_acl",
            "pillar_nvmet::exec::verify_links",
        ],
    ),
    (
        "tracing (spans, log lines)",
        &["tracing_core::event::Event::dispatch"],
    ),
];

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match args.mode {
        Some(Mode::Agent {
            state,
            socket,
            configfs,
            pool,
        }) => rt.block_on(serve_agent(state, socket, configfs, pool)),
        Some(Mode::Mark { dir, calls }) => rt.block_on(mark_mode(&dir, calls)),
        None => rt.block_on(report(&args)),
    }
}

/// The agent's real server on `socket` until SIGTERM, logging at `info` as the binary does.
async fn serve_agent(
    state: PathBuf,
    socket: PathBuf,
    configfs: PathBuf,
    pool: PathBuf,
) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .with_ansi(false)
        .init();
    agent::serve_until_sigterm(
        pillar_agent::EngineKind::Sync,
        state,
        socket,
        configfs,
        pool,
    )
    .await
}

/// Where callgrind's window ends and the next begins (`--dump-before` this function).
#[inline(never)]
fn callgrind_window() {
    std::hint::black_box(());
}

/// Mark updates on one volume through the synchronous engine, `calls` then `2 * calls`, each
/// window closed by [`callgrind_window`].
async fn mark_mode(dir: &Path, calls: usize) -> anyhow::Result<()> {
    use pillar_agent::engine::Engine;
    use pillar_agent::engine::sync::SyncEngine;
    use pillar_agent::fence::{Mark, MarkStore};
    let engine = Engine::Sync(SyncEngine::new());
    let marks = MarkStore::open(dir)?;
    let volume = pillar_nvmet::VolumeId::parse(&agent::volume(1))?;
    let mut generation = 0;
    let mark = |generation: u64| Mark {
        volume: volume.to_string(),
        owner_uid: format!("uid-{volume}"),
        generation,
        ended: false,
        retired_uids: Vec::new(),
    };
    for n in [calls, calls, 2 * calls] {
        callgrind_window();
        for _ in 0..n {
            generation += 1;
            marks.write(&engine, &volume, &mark(generation)).await?;
        }
    }
    callgrind_window();
    Ok(())
}

/// The temporary places of one run.
struct Places {
    base: tempfile::TempDir,
    shm: tempfile::TempDir,
}

impl Places {
    fn new(dir: Option<&Path>) -> anyhow::Result<Self> {
        let base = tempfile::tempdir_in(dir.unwrap_or(Path::new(".")))?;
        let shm = tempfile::tempdir_in("/dev/shm")?;
        std::fs::create_dir_all(shm.path().join("pool"))?;
        Ok(Self { base, shm })
    }

    fn out(&self, name: &str) -> PathBuf {
        self.base.path().join(format!("{name}.cg"))
    }
}

/// `self_exe mode_args` under callgrind, dumping before `marker`, its output files `out`.*.
fn under_callgrind(out: &Path, marker: &str, mode_args: &[&str]) -> anyhow::Result<Child> {
    let exe = std::env::current_exe()?;
    let log = std::fs::File::create(out.with_extension("log"))?;
    Ok(Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(format!("--dump-before={marker}"))
        .arg(exe)
        .args(mode_args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?)
}

async fn report(args: &Args) -> anyhow::Result<()> {
    let places = Places::new(args.dir.as_deref())?;
    let n = args.calls;
    println!("pillar-callgrind: {n} and {} calls per window", 2 * n);
    let calls = count_calls(&places, n).await?;
    let mark = count_marks(&places, n)?;
    let mut out = Vec::new();
    print_layers(&calls, mark, n, &mut out);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
        println!("\nJSON written to {}", path.display());
    }
    if args.keep {
        let kept = places.base.keep();
        println!("callgrind files kept in {}", kept.display());
    }
    Ok(())
}

/// Counts of one grant and one revoke: per layer (the last row: no layer), per function
/// (inclusive, largest first), and in all.
struct CallCounts {
    grant: PerCall,
    revoke: PerCall,
}

struct PerCall {
    layers: Vec<f64>,
    top: Vec<(String, i64)>,
    top_own: Vec<(String, i64)>,
    total: f64,
}

impl PerCall {
    /// One call: the difference of the window with 2N calls and the window with N, over N.
    #[allow(clippy::cast_precision_loss)]
    fn of(big: &Profile, small: &Profile, n: usize) -> Self {
        let layers = layer_rows(big)
            .iter()
            .zip(layer_rows(small))
            .map(|(b, s)| (b - s) / n as f64)
            .collect();
        Self {
            layers,
            top: per_call(&big.inclusive(), &small.inclusive(), n),
            top_own: per_call(&big.own(), &small.own(), n),
            total: (big.total as f64 - small.total as f64) / n as f64,
        }
    }
}

/// glibc's allocator and Rust's shims over it.
fn is_allocator(name: &str) -> bool {
    matches!(
        name,
        "malloc" | "free" | "realloc" | "calloc" | "malloc_consolidate" | "cfree"
    ) || name.starts_with("_int_")
        || name.starts_with("unlink_chunk")
        || name.starts_with("__rustc::__rdl_")
        || name.starts_with("__rustc::__rust_")
        || name.starts_with("__rdl_")
        || name.starts_with("__rust_alloc")
        || name.starts_with("__rust_dealloc")
        || name.starts_with("__rust_realloc")
}

fn layer_rows(p: &Profile) -> Vec<f64> {
    p.by_layer(LAYERS.len(), |name| {
        LAYERS
            .iter()
            .position(|(_, functions)| functions.iter().any(|f| name.ends_with(f)))
    })
}

async fn count_calls(places: &Places, n: usize) -> anyhow::Result<CallCounts> {
    let out = places.out("agent");
    let socket = places.base.path().join("agent.sock");
    let paths = [
        places.base.path().join("state"),
        places.shm.path().join("configfs"),
        places.shm.path().join("pool"),
    ];
    let mut child = under_callgrind(
        &out,
        AGENT_MARKER,
        &[
            "agent",
            "--state",
            &paths[0].to_string_lossy(),
            "--socket",
            &socket.to_string_lossy(),
            "--configfs",
            &paths[1].to_string_lossy(),
            "--pool",
            &paths[2].to_string_lossy(),
        ],
    )?;
    let driven = drive_agent(&socket, n).await;
    // SIGTERM: the agent shuts down and callgrind writes its last dump.
    let pid = libc::pid_t::try_from(child.id())?;
    // SAFETY: kill with a PID this process spawned and has not reaped, and a valid signal.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    child.wait()?;
    driven?;
    // Dumps: 1 before the warm-up's end, then N grants, N revokes, 2N grants, 2N revokes.
    let dumps = (1..=5)
        .map(|k| Profile::read(&out.with_extension(format!("cg.{k}"))))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(CallCounts {
        grant: PerCall::of(&dumps[3], &dumps[1], n),
        revoke: PerCall::of(&dumps[4], &dumps[2], n),
    })
}

/// Sets up volumes, warms up, and runs the windows (a GetCapabilities call between each).
async fn drive_agent(socket: &Path, n: usize) -> anyhow::Result<()> {
    let start = Instant::now();
    while !socket.exists() {
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(300),
            "the agent under valgrind did not start"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut client = agent::connect(socket).await?;
    client
        .resync_exports(pillar_agent_api::v1::ResyncExportsRequest::default())
        .await?;
    let anchor = agent::volume(0);
    agent::create(&mut client, &anchor).await?;
    agent::export(&mut client, &anchor, &[agent::host(1)]).await?;
    for v in 1..=2 * n {
        agent::create(&mut client, &agent::volume(v)).await?;
        agent::export(&mut client, &agent::volume(v), &[]).await?;
    }
    let mut generation = 3;
    // Warm-up: every volume granted and revoked once.
    generation = phase(&mut client, 2 * n, generation, true).await?;
    generation = phase(&mut client, 2 * n, generation, false).await?;
    marker(&mut client).await?;
    for count in [n, 2 * n] {
        generation = phase(&mut client, count, generation, true).await?;
        marker(&mut client).await?;
        generation = phase(&mut client, count, generation, false).await?;
        marker(&mut client).await?;
    }
    Ok(())
}

/// Grants (or revokes) host 1 on volumes 1..=count, one call at a time.
async fn phase(
    client: &mut agent::Client,
    count: usize,
    generation: u64,
    grant: bool,
) -> anyhow::Result<u64> {
    for v in 1..=count {
        agent::grant_or_revoke(client, &agent::volume(v), generation, grant).await?;
    }
    Ok(generation + 1)
}

async fn marker(client: &mut agent::Client) -> anyhow::Result<()> {
    client
        .get_capabilities(pillar_agent_api::v1::GetCapabilitiesRequest::default())
        .await?;
    Ok(())
}

/// One mark update alone, in instructions.
fn count_marks(places: &Places, n: usize) -> anyhow::Result<f64> {
    let out = places.out("mark");
    let dir = places.base.path().join("marks");
    std::fs::create_dir_all(&dir)?;
    let calls = n.to_string();
    let status = under_callgrind(
        &out,
        MARK_MARKER,
        &["mark", "--dir", &dir.to_string_lossy(), "--calls", &calls],
    )?
    .wait()?;
    anyhow::ensure!(status.success(), "the mark run failed: {status}");
    let small = Profile::read(&out.with_extension("cg.3"))?;
    let big = Profile::read(&out.with_extension("cg.4"))?;
    #[allow(clippy::cast_precision_loss)]
    Ok((big.total as f64 - small.total as f64) / n as f64)
}

/// Per-function counts of one call: (big - small) / n, largest first.
fn per_call(big: &HashMap<&str, u64>, small: &HashMap<&str, u64>, n: usize) -> Vec<(String, i64)> {
    let mut out: Vec<(String, i64)> = big
        .iter()
        .map(|(&name, &ir)| {
            let was = small.get(name).copied().unwrap_or(0);
            #[allow(clippy::cast_possible_wrap, clippy::cast_possible_truncation)]
            let per = (ir as i64 - was as i64) / n as i64;
            (name.to_owned(), per)
        })
        .collect();
    out.sort_by_key(|b| std::cmp::Reverse(b.1));
    out
}

#[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
fn print_layers(calls: &CallCounts, mark: f64, n: usize, out: &mut Vec<serde_json::Value>) {
    let (g, r) = (&calls.grant, &calls.revoke);
    println!("\ninstructions per call (user space, all threads of the agent; callgrind)");
    println!("{:<48} {:>12} {:>12}", "layer", "grant", "revoke");
    let names = LAYERS
        .iter()
        .map(|(layer, _)| *layer)
        .chain(["gRPC/HTTP/2, tokio and the rest"]);
    for (row, layer) in names.enumerate() {
        let (gi, ri) = (g.layers[row], r.layers[row]);
        println!("{layer:<48} {gi:>12.0} {ri:>12.0}");
        out.push(json!({"section": "callgrind", "layer": layer, "grant_ir": gi.round(), "revoke_ir": ri.round()}));
    }
    println!(
        "{:<48} {:>12.0} {:>12.0}",
        "total per call", g.total, r.total
    );
    // The rows hold the functions' own counts; callgrind's summary should be the same sum.
    for (what, per) in [("grant", g), ("revoke", r)] {
        let rows: f64 = per.layers.iter().sum();
        if (rows - per.total).abs() > 0.005 * per.total {
            println!(
                "  ({what}: the rows add up to {rows:.0}, not the total: the dump's functions do not hold all of it)"
            );
        }
    }
    println!("{:<48} {mark:>12.0}", "one mark update alone");
    println!(
        "{:<48} {:>12.2} {:>12.2}",
        "call over mark update",
        g.total / mark,
        r.total / mark
    );
    out.push(json!({"section": "callgrind", "calls_per_window": n,
        "grant_ir": g.total, "revoke_ir": r.total, "mark_update_ir": mark,
        "grant_over_mark": g.total / mark, "revoke_over_mark": r.total / mark}));
    for (what, per) in [("grant", g), ("revoke", r)] {
        #[allow(clippy::cast_precision_loss)]
        let alloc = per
            .top_own
            .iter()
            .filter(|(name, _)| is_allocator(name))
            .map(|(_, ir)| *ir as f64)
            .sum::<f64>();
        println!(
            "\nper {what}, the memory allocator's own instructions (malloc, free, realloc, their internals): {alloc:.0} ({:.0}% of the call)",
            100.0 * alloc / per.total
        );
        out.push(json!({"section": "callgrind", "call": what, "allocator_ir": alloc.round()}));
        println!("top functions per {what} (own instructions)");
        for (name, ir) in per.top_own.iter().take(30) {
            println!("{ir:>12} {name}");
        }
        println!("\ntop functions per {what} (inclusive)");
        for (name, ir) in per.top.iter().take(60) {
            println!("{ir:>12} {name}");
        }
    }
}
