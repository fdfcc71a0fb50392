//! The real-kernel lane (issue 5): pillar's own binaries against a real Linux kernel. The agent
//! (`pillar-agent --target kernel`) drives configfs/nvmet, the node plugin (`pillar-csi node`)
//! connects with the kernel's NVMe/TCP host over loopback, the controller (`pillar-csi
//! controller`) keeps its records in the embedded store. The test drives the CSI calls the way
//! kubelet and the sidecars do and checks the kernel's side: its log (`/dev/kmsg`), configfs
//! (`/sys/kernel/config/nvmet`), sysfs (`/sys/class/nvme*`, `/sys/block/nvme*`) and I/O with
//! checksums.
//!
//! Where it runs: inside the VM of `tests/kernel-lane/run.sh` (guest script
//! `tests/kernel-lane/guest/pillar.sh`, which runs the binary with `--include-ignored` and sets
//! `PILLAR_KERNEL_LANE=1`). Two gates keep it off other machines: every scenario is `#[ignore]`d
//! (a plain `cargo test` lists them as ignored, never as passed), and without the variable a
//! scenario run with `--ignored` prints `SKIP: ...` and returns. The scenarios tear down ALL
//! nvmet state and delete every NVMe/TCP controller of the machine they run on, so they must
//! never run by accident, even on a machine that has nvmet. With the variable set and no nvmet
//! in the kernel, the scenario fails.
//!
//! Binaries: `pillar-csi` is this package's (`CARGO_BIN_EXE_pillar-csi`), `pillar-agent` is
//! looked up next to it (build it first: `cargo build -p pillar-agent`); `PILLAR_CSI_BIN` and
//! `PILLAR_AGENT_BIN` override both.
//!
//! Scenarios (one test each; run them with `--test-threads=1`):
//! 1. provision, publish, stage (mkfs, mount), publish to a pod path, checksummed I/O, teardown
//! 2. agent restart (SIGKILL) with its state kept: I/O goes on, identity unchanged
//! 3. storage-node reboot (port taken away, nvmet torn down, agent state wiped, agent refuses
//!    exports until the controller resyncs): the host reconnects by itself, data intact
//! 4. control: the same reboot with kernel-random identity breaks the filesystem
//! 5. one writer: a second host identity cannot connect while the volume is published RWO to
//!    the first (acl), and can after unpublish + publish
//! 6. a stale revoke (older generation after a newer grant) is rejected; the grant stays
//! 7. online expansion (host sees the new size, filesystem grows) and volume stats
//! 8. the LVM backends (linear and thin) on device-mapper: extent rounding, the `pillar` tag,
//!    export of the LV, I/O, online expansion, shrink refused, delete; foreign LVs untouched
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::v1::agent_client::AgentClient;
use pillar_csi::csi;
use pillar_csi::csi::controller_client::ControllerClient;
use pillar_csi::csi::node_client::NodeClient;
use pillar_csi::csi::volume_capability::access_mode::Mode;
use pillar_host::sysfs::{NamespaceDevice, controllers_for, namespaces_for_host};
use pillar_host::{ConnectOptions, HostPaths};
use pillar_nvmet::{
    HostNqn, NamespaceId, NamespaceIdentity, SubsystemNqn, VolumeId, derive_serial,
};
use pillar_state::EmbeddedStore;
use pillar_state::crd::{NvmeTcp, PillarAgentSpec, PillarProtocolSpec, PoolRef};
use pillar_state::store::StateStore;
use sha2::{Digest, Sha256};
use tokio::net::UnixStream;
use tonic::Code;
use tonic::transport::{Channel, Endpoint, Uri};

// ---------------------------------------------------------------------------------------------
// Settings

const NVMET: &str = "/sys/kernel/config/nvmet";
const AGENT_NAME: &str = "storage-1";
const POOL: &str = "pool";
const PROTOCOL: &str = "nvme-tcp";
const PORT: u16 = 4420;
const MIB: u64 = 1 << 20;
/// Seconds between the host's reconnect attempts: short, so reconnects are quick under TCG.
const RECONNECT_DELAY: u32 = 1;
/// Seconds the host keeps reconnecting: long enough for a whole emulated storage-node reboot.
const CTRL_LOSS_TMO: i32 = 120;
/// How long a started process has to open its socket (debug binaries under TCG start slowly).
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// The default node's identity: written by the guest script into /etc/nvme.
const ETC_HOSTNQN: &str = "/etc/nvme/hostnqn";
const ETC_HOSTID: &str = "/etc/nvme/hostid";
/// A second host identity in the same guest (scenario 5).
const SECOND_HOSTID: &str = "5c0ffee0-0000-4000-8000-0000000000b2";

// ---------------------------------------------------------------------------------------------
// Gate and results

/// Whether this process may run a scenario (see the module docs).
fn in_lane() -> bool {
    if std::env::var("PILLAR_KERNEL_LANE").as_deref() != Ok("1") {
        println!(
            "SKIP: PILLAR_KERNEL_LANE is not set: this scenario tears down all nvmet state and \
             runs only inside the kernel-lane VM (tests/kernel-lane/run.sh)"
        );
        return false;
    }
    assert!(
        Path::new(NVMET).is_dir() && Path::new("/dev/nvme-fabrics").exists(),
        "PILLAR_KERNEL_LANE=1 but this kernel has no nvmet ({NVMET}) or NVMe fabrics host"
    );
    true
}

fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "?".into(), |s| s.trim().to_owned())
}

/// Prints one result line when the scenario ends (after the lab's cleanup, which is declared
/// later and so dropped first). `run.sh` collects these lines.
struct Scenario {
    name: &'static str,
    t0: Instant,
}

impl Scenario {
    fn start(name: &'static str) -> Self {
        println!("=== scenario {name} on kernel {}", kernel_release());
        Self {
            name,
            t0: Instant::now(),
        }
    }

    fn step(&self, what: &str) {
        println!(
            "--- [{:>6.1}s] {}: {what}",
            self.t0.elapsed().as_secs_f64(),
            self.name
        );
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        let result = if std::thread::panicking() {
            "FAIL"
        } else {
            "PASS"
        };
        println!(
            "KERNEL-LANE-RESULT scenario={} result={result} seconds={:.1} kernel={}",
            self.name,
            self.t0.elapsed().as_secs_f64(),
            kernel_release()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The kernel log

/// Reads `/dev/kmsg` from the moment it was opened; every line read is kept and echoed.
struct Kmsg {
    file: File,
    lines: Vec<String>,
}

impl Kmsg {
    fn open() -> Self {
        let mut file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open("/dev/kmsg")
            .expect("open /dev/kmsg");
        file.seek(SeekFrom::End(0))
            .expect("seek /dev/kmsg to its end");
        Self {
            file,
            lines: Vec::new(),
        }
    }

    /// Reads every record logged since the last call.
    fn poll(&mut self) {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match self.file.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    let record = String::from_utf8_lossy(&buf[..n]);
                    // "<prio>,<seq>,<usec>,<flags>;<text>\n< continuation lines>"
                    let text = record.split_once(';').map_or(&*record, |(_, t)| t);
                    let text = text.lines().next().unwrap_or("").to_owned();
                    println!("    kmsg| {text}");
                    self.lines.push(text);
                }
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                    println!("    kmsg| (records overwritten before they were read)");
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => panic!("reading /dev/kmsg: {e}"),
            }
        }
    }

    /// The position after everything logged so far.
    fn mark(&mut self) -> usize {
        self.poll();
        self.lines.len()
    }

    /// The first line at or after `from` containing every one of `needles`.
    fn find(&mut self, from: usize, needles: &[&str]) -> Option<String> {
        self.poll();
        self.lines[from.min(self.lines.len())..]
            .iter()
            .find(|l| needles.iter().all(|n| l.contains(n)))
            .cloned()
    }

    fn count(&mut self, from: usize, needle: &str) -> usize {
        self.poll();
        self.lines[from.min(self.lines.len())..]
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Waits for a line at or after `from` containing all `needles`; panics after `timeout`.
    fn expect(&mut self, from: usize, needles: &[&str], timeout: Duration) -> String {
        let start = Instant::now();
        loop {
            if let Some(line) = self.find(from, needles) {
                println!("  kernel log has {needles:?}: {line}");
                return line;
            }
            assert!(
                start.elapsed() < timeout,
                "no kernel log line with {needles:?} within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn expect_absent(&mut self, from: usize, needle: &str) {
        if let Some(line) = self.find(from, &[needle]) {
            panic!("kernel log has {needle:?}, which must not happen: {line}");
        }
        println!("  kernel log has no {needle:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Processes

fn csi_bin() -> PathBuf {
    std::env::var_os("PILLAR_CSI_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_pillar-csi")),
        PathBuf::from,
    )
}

fn agent_bin() -> PathBuf {
    let bin = std::env::var_os("PILLAR_AGENT_BIN")
        .map_or_else(|| csi_bin().with_file_name("pillar-agent"), PathBuf::from);
    assert!(
        bin.is_file(),
        "{} is missing: build it (cargo build -p pillar-agent) or set PILLAR_AGENT_BIN",
        bin.display()
    );
    bin
}

/// A running binary; its stdout and stderr go to `log`. Killed when dropped.
struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &str, program: &Path, args: &[String], log: &Path) -> Self {
        let mut out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("open process log");
        writeln!(out, "=== {name}: {} {}", program.display(), args.join(" ")).expect("write log");
        let err = out.try_clone().expect("clone log fd");
        let child = Command::new(program)
            .args(args)
            .env("NO_COLOR", "1")
            .env(
                "RUST_LOG",
                std::env::var("PILLAR_LANE_RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
        println!("  started {name} (pid {})", child.id());
        Self {
            name: name.to_owned(),
            child,
            log: log.to_owned(),
        }
    }

    fn pid(&self) -> libc::pid_t {
        libc::pid_t::try_from(self.child.id()).expect("pid fits pid_t")
    }

    /// SIGKILL, as a crash or power loss does.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let status = self.child.wait();
        println!("  killed {} (SIGKILL): {status:?}", self.name);
    }

    /// SIGTERM, then SIGKILL after 15 s.
    fn stop(&mut self) {
        // SAFETY: kill(2) on the pid of our own child, which has not been reaped yet.
        unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(15) {
            if let Ok(Some(status)) = self.child.try_wait() {
                println!("  stopped {} (SIGTERM): {status}", self.name);
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("  {} ignored SIGTERM for 15 s", self.name);
        self.kill();
    }

    fn tail(&self, lines: usize) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

async fn channel(socket: &Path) -> Channel {
    let start = Instant::now();
    loop {
        let s = socket.to_owned();
        let ch = Endpoint::from_static("http://lane.invalid")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let s = s.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(s).await?)) }
            }))
            .await;
        match ch {
            Ok(ch) => return ch,
            Err(e) if start.elapsed() > START_TIMEOUT => {
                panic!(
                    "nothing answers on {} after {START_TIMEOUT:?}: {e}",
                    socket.display()
                )
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Machine state: reset, storage-node teardown, host side

fn lane_root() -> PathBuf {
    std::env::var_os("PILLAR_LANE_DIR")
        .map_or_else(|| PathBuf::from("/tmp/pillar-lane"), PathBuf::from)
}

fn read_attr(path: &Path) -> String {
    fs::read_to_string(path).map_or_else(|e| format!("<{e}>"), |s| s.trim().to_owned())
}

fn write_attr(path: &Path, value: &str) -> std::io::Result<()> {
    OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(value.as_bytes())
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = match fs::read_dir(dir) {
        Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(_) => Vec::new(),
    };
    out.sort();
    out
}

fn names(dir: &Path) -> Vec<String> {
    entries(dir)
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect()
}

/// Unmounts everything mounted under `root`, deepest first (lazily: a dead device must not
/// keep the next scenario from starting).
fn unmount_under(root: &Path) {
    let Ok(mounts) = pillar_host::mountinfo::read(Path::new("/proc/self/mountinfo")) else {
        return;
    };
    let mut points: Vec<PathBuf> = mounts
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(root) && p != root)
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let status = Command::new("umount").arg("-l").arg(&p).status();
        println!("  cleanup: umount -l {}: {status:?}", p.display());
    }
}

/// The host side: deletes every NVMe over Fabrics controller.
fn disconnect_all_controllers() {
    let class = Path::new("/sys/class/nvme");
    for c in entries(class) {
        if fs::read_to_string(c.join("transport")).is_ok_and(|t| t.trim() == "tcp") {
            let r = write_attr(&c.join("delete_controller"), "1");
            println!("  cleanup: delete controller {}: {r:?}", c.display());
        }
    }
    let start = Instant::now();
    while entries(class).iter().any(|c| c.join("transport").exists())
        && start.elapsed() < Duration::from_secs(20)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Unlinks every subsystem from every port and removes the ports: the kernel deletes the
/// target controllers and their TCP connections drop ("take the port away").
fn take_ports_away() -> Result<(), String> {
    let root = Path::new(NVMET);
    for port in entries(&root.join("ports")) {
        for link in entries(&port.join("subsystems")) {
            fs::remove_file(&link).map_err(|e| format!("unlink {}: {e}", link.display()))?;
        }
        fs::remove_dir(&port).map_err(|e| format!("rmdir {}: {e}", port.display()))?;
    }
    Ok(())
}

/// Tears down all nvmet state, as a reboot of the storage node does: ports, namespaces,
/// host links, subsystems, hosts.
fn nvmet_teardown_all() -> Result<(), String> {
    take_ports_away()?;
    let root = Path::new(NVMET);
    for sub in entries(&root.join("subsystems")) {
        for ns in entries(&sub.join("namespaces")) {
            write_attr(&ns.join("enable"), "0")
                .map_err(|e| format!("disable {}: {e}", ns.display()))?;
            fs::remove_dir(&ns).map_err(|e| format!("rmdir {}: {e}", ns.display()))?;
        }
        for h in entries(&sub.join("allowed_hosts")) {
            fs::remove_file(&h).map_err(|e| format!("unlink {}: {e}", h.display()))?;
        }
        fs::remove_dir(&sub).map_err(|e| format!("rmdir {}: {e}", sub.display()))?;
    }
    for h in entries(&root.join("hosts")) {
        fs::remove_dir(&h).map_err(|e| format!("rmdir {}: {e}", h.display()))?;
    }
    Ok(())
}

fn nvmet_is_empty() -> bool {
    ["subsystems", "ports", "hosts"]
        .iter()
        .all(|d| entries(&Path::new(NVMET).join(d)).is_empty())
}

/// Detaches every loop device whose backing file is under `root`, as a reboot does.
fn detach_loops_under(root: &Path) -> usize {
    let mut n = 0;
    for dev in entries(Path::new("/sys/block")) {
        let backing = dev.join("loop/backing_file");
        let Ok(file) = fs::read_to_string(&backing) else {
            continue;
        };
        if Path::new(file.trim()).starts_with(root) {
            let name = dev.file_name().unwrap().to_string_lossy().into_owned();
            let status = Command::new("losetup")
                .arg("-d")
                .arg(format!("/dev/{name}"))
                .status();
            println!("  losetup -d /dev/{name} ({}): {status:?}", file.trim());
            n += 1;
        }
    }
    n
}

/// Brings the machine back to nothing: no mounts under the lane root, no NVMe/TCP controller,
/// no nvmet state, no loop device of the lane.
fn reset_machine() {
    let root = lane_root();
    unmount_under(&root);
    disconnect_all_controllers();
    if let Err(e) = nvmet_teardown_all() {
        println!("  cleanup: nvmet teardown: {e}");
    }
    let start = Instant::now();
    while detach_loops_under(&root) > 0 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn drop_caches() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    write_attr(Path::new("/proc/sys/vm/drop_caches"), "3").expect("drop caches");
}

// ---------------------------------------------------------------------------------------------
// Data with checksums

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Files written with their SHA-256.
#[derive(Clone, Debug, Default)]
struct DataSet {
    files: Vec<(PathBuf, [u8; 32])>,
}

impl DataSet {
    /// Writes `count` files of `size` bytes under `dir`, each fsynced, and the directory.
    fn write(dir: &Path, prefix: &str, count: usize, size: usize) -> Self {
        let mut files = Vec::new();
        for i in 0..count {
            let path = dir.join(format!("{prefix}-{i}.bin"));
            let seed = Sha256::digest(path.to_string_lossy().as_bytes())[0..8]
                .iter()
                .fold(0u64, |a, b| (a << 8) | u64::from(*b));
            let data = pattern(seed, size);
            let mut f =
                File::create(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
            f.write_all(&data)
                .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
            f.sync_all()
                .unwrap_or_else(|e| panic!("fsync {}: {e}", path.display()));
            files.push((path, Sha256::digest(&data).into()));
        }
        File::open(dir)
            .and_then(|d| d.sync_all())
            .expect("fsync directory");
        println!(
            "  wrote {count} x {} KiB under {} (fsynced)",
            size / 1024,
            dir.display()
        );
        Self { files }
    }

    /// Reads every file (after dropping the page cache, so the data comes from the target) and
    /// compares checksums. `base` re-roots the paths (another mount of the same filesystem).
    fn verify_at(&self, from: &Path, base: &Path) {
        drop_caches();
        for (path, sum) in &self.files {
            let path = base.join(path.strip_prefix(from).expect("data under its root"));
            let data = fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            let got: [u8; 32] = Sha256::digest(&data).into();
            assert_eq!(&got, sum, "checksum of {} differs", path.display());
        }
        println!(
            "  verified {} files (page cache dropped, SHA-256 equal)",
            self.files.len()
        );
    }

    fn verify(&self) {
        self.verify_at(Path::new("/"), Path::new("/"));
    }
}

/// Block `i` of a big file: one random MiB (made once) with the block number in front, so
/// every block differs. Big files are compared byte for byte (SHA-256 of tens of MiB in a debug
/// build under TCG would take minutes).
fn big_block(base: &[u8], i: usize) -> Vec<u8> {
    let mut b = base.to_vec();
    b[..8].copy_from_slice(&(i as u64).to_le_bytes());
    b
}

fn write_big_file(path: &Path, mib: usize) {
    let base = pattern(0xB16, 1024 * 1024);
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    for i in 0..mib {
        f.write_all(&big_block(&base, i))
            .unwrap_or_else(|e| panic!("write {} block {i}: {e}", path.display()));
    }
    f.sync_all()
        .unwrap_or_else(|e| panic!("fsync {}: {e}", path.display()));
    println!("  wrote {mib} MiB to {} (fsynced)", path.display());
}

fn verify_big_file(path: &Path, mib: usize) {
    drop_caches();
    let base = pattern(0xB16, 1024 * 1024);
    let mut f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut buf = vec![0u8; 1024 * 1024];
    for i in 0..mib {
        f.read_exact(&mut buf)
            .unwrap_or_else(|e| panic!("read {} block {i}: {e}", path.display()));
        assert!(
            buf == big_block(&base, i),
            "{} block {i} differs",
            path.display()
        );
    }
    println!(
        "  verified {mib} MiB of {} block by block (page cache dropped)",
        path.display()
    );
}

/// Appends checksummed chunks to one file with fsync after each, until stopped: I/O that goes on
/// while the storage side restarts.
struct Writer {
    stop: Arc<AtomicBool>,
    state: Arc<Mutex<WriterState>>,
    thread: Option<std::thread::JoinHandle<()>>,
    path: PathBuf,
}

#[derive(Debug, Default, Clone)]
struct WriterState {
    chunks: Vec<[u8; 32]>,
    errors: Vec<String>,
    max_latency: Duration,
    done: bool,
}

const CHUNK: usize = 128 * 1024;

impl Writer {
    fn start(path: &Path) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(Mutex::new(WriterState::default()));
        let (s, st, p) = (Arc::clone(&stop), Arc::clone(&state), path.to_owned());
        let thread = std::thread::spawn(move || {
            let mut f = match OpenOptions::new().create(true).append(true).open(&p) {
                Ok(f) => f,
                Err(e) => {
                    let mut g = st.lock().unwrap();
                    g.errors.push(format!("open: {e}"));
                    g.done = true;
                    return;
                }
            };
            let mut i = 0u64;
            while !s.load(Ordering::SeqCst) {
                let data = pattern(0x5EED_0000 + i, CHUNK);
                let t = Instant::now();
                let r = f.write_all(&data).and_then(|()| f.sync_data());
                let mut g = st.lock().unwrap();
                g.max_latency = g.max_latency.max(t.elapsed());
                match r {
                    Ok(()) => g.chunks.push(Sha256::digest(&data).into()),
                    Err(e) => {
                        g.errors.push(format!("chunk {i}: {e}"));
                        break;
                    }
                }
                drop(g);
                i += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            st.lock().unwrap().done = true;
        });
        println!("  writer started on {}", path.display());
        Self {
            stop,
            state,
            thread: Some(thread),
            path: path.to_owned(),
        }
    }

    fn snapshot(&self) -> WriterState {
        self.state.lock().unwrap().clone()
    }

    /// Stops the writer, waiting up to `timeout` for its last write to return.
    fn finish(&mut self, timeout: Duration) -> WriterState {
        self.stop.store(true, Ordering::SeqCst);
        let start = Instant::now();
        while !self.state.lock().unwrap().done && start.elapsed() < timeout {
            std::thread::sleep(Duration::from_millis(50));
        }
        let s = self.snapshot();
        if s.done
            && let Some(t) = self.thread.take()
        {
            let _ = t.join();
        }
        println!(
            "  writer: {} chunks of {} KiB acknowledged, max write+fsync latency {:.2}s, errors {:?}, {}",
            s.chunks.len(),
            CHUNK / 1024,
            s.max_latency.as_secs_f64(),
            s.errors,
            if s.done { "stopped" } else { "STILL BLOCKED" }
        );
        s
    }

    /// Every acknowledged chunk reads back with its checksum (page cache dropped).
    fn verify(&self, state: &WriterState) {
        drop_caches();
        let data =
            fs::read(&self.path).unwrap_or_else(|e| panic!("read {}: {e}", self.path.display()));
        assert!(
            data.len() >= state.chunks.len() * CHUNK,
            "writer file is shorter than the acknowledged chunks"
        );
        for (i, sum) in state.chunks.iter().enumerate() {
            let got: [u8; 32] = Sha256::digest(&data[i * CHUNK..(i + 1) * CHUNK]).into();
            assert_eq!(&got, sum, "writer chunk {i} differs");
        }
        println!(
            "  verified {} acknowledged writer chunks",
            state.chunks.len()
        );
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

// ---------------------------------------------------------------------------------------------
// The lab: one scenario's processes and directories

fn mount_cap(mode: Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode.into() }),
        access_type: Some(csi::volume_capability::AccessType::Mount(
            csi::volume_capability::MountVolume {
                fs_type: "ext4".into(),
                mount_flags: vec![],
                volume_mount_group: String::new(),
            },
        )),
    }
}

fn rwo() -> csi::VolumeCapability {
    mount_cap(Mode::SingleNodeWriter)
}

fn host_paths() -> HostPaths {
    HostPaths::system()
}

fn nqn_of(volume: &str) -> SubsystemNqn {
    VolumeId::parse(volume).expect("volume id").subsystem_nqn()
}

fn identity_of(volume: &str) -> NamespaceIdentity {
    NamespaceIdentity::derive(&nqn_of(volume), NamespaceId::VOLUME)
}

/// A node plugin: its client and identity.
struct NodePlugin {
    name: String,
    id: String,
    host_nqn: HostNqn,
    host_id: uuid::Uuid,
    client: NodeClient<Channel>,
    dir: PathBuf,
}

/// One volume staged and published on a node.
#[derive(Clone, Debug)]
struct Staged {
    volume: String,
    node_id: String,
    publish_context: HashMap<String, String>,
    staging: PathBuf,
    target: PathBuf,
    device: NamespaceDevice,
}

struct Lab {
    dir: PathBuf,
    kmsg: Kmsg,
    agent: Option<Proc>,
    controller: Option<Proc>,
    nodes: Vec<Proc>,
}

impl Lab {
    /// A clean machine and a fresh directory; the store holds the PillarAgent and the
    /// PillarProtocol (acl as given) before the controller starts.
    async fn new(name: &str, acl: bool) -> Self {
        reset_machine();
        assert!(
            nvmet_is_empty(),
            "nvmet state left over from an earlier scenario"
        );
        let dir = lane_root().join(name);
        let _ = fs::remove_dir_all(&dir);
        for sub in ["pool", "store", "logs"] {
            fs::create_dir_all(dir.join(sub)).unwrap();
        }
        {
            let store = EmbeddedStore::open(dir.join("store"))
                .await
                .expect("open embedded store");
            store
                .create_agent(
                    AGENT_NAME,
                    PillarAgentSpec {
                        node: AGENT_NAME.into(),
                        address: format!("unix://{}", dir.join("agent.sock").display()),
                        tls: None,
                        pools: vec![PoolRef {
                            name: POOL.into(),
                            kind: "file".into(),
                        }],
                        nvme_address: "127.0.0.1".into(),
                    },
                )
                .await
                .expect("create PillarAgent");
            store
                .create_protocol(
                    PROTOCOL,
                    PillarProtocolSpec {
                        nvme_tcp: NvmeTcp {
                            port: PORT,
                            acl,
                            ctrl_loss_tmo: CTRL_LOSS_TMO,
                            reconnect_delay: RECONNECT_DELAY,
                            ..NvmeTcp::default()
                        },
                    },
                )
                .await
                .expect("create PillarProtocol");
        }
        Self {
            dir,
            kmsg: Kmsg::open(),
            agent: None,
            controller: None,
            nodes: Vec::new(),
        }
    }

    fn agent_state(&self) -> PathBuf {
        self.dir.join("agent-state")
    }

    /// Starts the agent on the kernel target; returns its client once it answers.
    async fn start_agent(&mut self, extra: &[&str]) -> AgentClient<Channel> {
        let socket = self.dir.join("agent.sock");
        let _ = fs::remove_file(&socket);
        let engine = std::env::var("PILLAR_LANE_ENGINE").unwrap_or_else(|_| "io_uring".into());
        let mut args: Vec<String> = vec![
            "--state-dir".into(),
            self.agent_state().display().to_string(),
            "--listen".into(),
            format!("unix://{}", socket.display()),
            "--engine".into(),
            engine,
            "--target".into(),
            "kernel".into(),
            "--nvme-address".into(),
            "127.0.0.1".into(),
            "--pool".into(),
            format!("{POOL}=file:{}", self.dir.join("pool").display()),
            "--insecure-plaintext".into(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        self.agent = Some(Proc::spawn(
            "agent",
            &agent_bin(),
            &args,
            &self.dir.join("logs/agent.log"),
        ));
        AgentClient::new(channel(&socket).await)
    }

    async fn agent_client(&self) -> AgentClient<Channel> {
        AgentClient::new(channel(&self.dir.join("agent.sock")).await)
    }

    async fn start_controller(&mut self, resync_secs: u64) -> ControllerClient<Channel> {
        let socket = self.dir.join("controller.sock");
        let _ = fs::remove_file(&socket);
        let args: Vec<String> = vec![
            "controller".into(),
            "--endpoint".into(),
            format!("unix://{}", socket.display()),
            "--embedded-store".into(),
            self.dir.join("store").display().to_string(),
            "--resync-interval-secs".into(),
            resync_secs.to_string(),
        ];
        self.controller = Some(Proc::spawn(
            "controller",
            &csi_bin(),
            &args,
            &self.dir.join("logs/controller.log"),
        ));
        ControllerClient::new(channel(&socket).await)
    }

    /// Starts a node plugin with the host identity in the given files.
    async fn start_node(
        &mut self,
        name: &str,
        hostnqn_file: &Path,
        hostid_file: &Path,
    ) -> NodePlugin {
        let dir = self.dir.join(name);
        fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("csi.sock");
        let args: Vec<String> = vec![
            "node".into(),
            "--endpoint".into(),
            format!("unix://{}", socket.display()),
            "--node-name".into(),
            name.into(),
            "--state-dir".into(),
            dir.join("state").display().to_string(),
            "--hostnqn-file".into(),
            hostnqn_file.display().to_string(),
            "--hostid-file".into(),
            hostid_file.display().to_string(),
        ];
        self.nodes.push(Proc::spawn(
            name,
            &csi_bin(),
            &args,
            &self.dir.join(format!("logs/{name}.log")),
        ));
        let mut client = NodeClient::new(channel(&socket).await);
        let info = client
            .node_get_info(csi::NodeGetInfoRequest {})
            .await
            .expect("NodeGetInfo")
            .into_inner();
        let host_nqn: HostNqn = fs::read_to_string(hostnqn_file)
            .unwrap()
            .trim()
            .parse()
            .expect("host NQN");
        let host_id: uuid::Uuid = fs::read_to_string(hostid_file)
            .unwrap()
            .trim()
            .parse()
            .expect("host ID");
        assert_eq!(
            info.node_id,
            format!("{name}/{host_nqn}"),
            "node ID is <node-name>/<host-nqn>"
        );
        println!("  node {name}: node ID {}", info.node_id);
        NodePlugin {
            name: name.into(),
            id: info.node_id,
            host_nqn,
            host_id,
            client,
            dir,
        }
    }

    /// The default node: the guest's /etc/nvme identity.
    async fn start_default_node(&mut self) -> NodePlugin {
        self.start_node("node-a", Path::new(ETC_HOSTNQN), Path::new(ETC_HOSTID))
            .await
    }

    /// A node with a second host identity of this machine.
    async fn start_second_node(&mut self) -> NodePlugin {
        let nqn = self.dir.join("hostnqn-b");
        let id = self.dir.join("hostid-b");
        fs::write(
            &nqn,
            format!("nqn.2014-08.org.nvmexpress:uuid:{SECOND_HOSTID}\n"),
        )
        .unwrap();
        fs::write(&id, format!("{SECOND_HOSTID}\n")).unwrap();
        self.start_node("node-b", &nqn, &id).await
    }

    /// The lifecycle UID the controller recorded for `volume` (read from the store's file).
    fn volume_uid(&self, volume: &str) -> String {
        let path = self.dir.join(format!("store/volumes/{volume}.json"));
        let v: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        v["metadata"]["uid"].as_str().expect("uid").to_owned()
    }

    fn dump_logs(&self) {
        for p in self
            .agent
            .iter()
            .chain(self.controller.iter())
            .chain(self.nodes.iter())
        {
            println!(
                "----- last lines of {} ({}):\n{}",
                p.name,
                p.log.display(),
                p.tail(40)
            );
        }
    }

    // -- CSI flows ------------------------------------------------------------------------------

    async fn create_volume(
        &self,
        ctl: &mut ControllerClient<Channel>,
        volume: &str,
        size: u64,
    ) -> csi::Volume {
        let v = ctl
            .create_volume(csi::CreateVolumeRequest {
                name: volume.into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: i64::try_from(size).unwrap(),
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![rwo()],
                ..Default::default()
            })
            .await
            .expect("CreateVolume")
            .into_inner()
            .volume
            .expect("volume");
        assert_eq!(v.volume_id, volume);
        assert!(
            u64::try_from(v.capacity_bytes).unwrap() >= size,
            "capacity {} < {size}",
            v.capacity_bytes
        );
        println!(
            "  CreateVolume {volume}: {} bytes, context {:?}",
            v.capacity_bytes, v.volume_context
        );
        v
    }

    async fn publish(
        &self,
        ctl: &mut ControllerClient<Channel>,
        volume: &str,
        node: &NodePlugin,
    ) -> Result<HashMap<String, String>, tonic::Status> {
        let r = ctl
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: volume.into(),
                node_id: node.id.clone(),
                volume_capability: Some(rwo()),
                readonly: false,
                secrets: HashMap::new(),
                volume_context: HashMap::new(),
            })
            .await
            .map(|r| r.into_inner().publish_context);
        println!(
            "  ControllerPublishVolume {volume} -> {}: {}",
            node.name,
            r.as_ref().map_or_else(
                |s| format!("{:?} {}", s.code(), s.message()),
                |c| format!("{c:?}")
            )
        );
        r
    }

    async fn stage(
        &self,
        node: &mut NodePlugin,
        volume: &str,
        publish_context: &HashMap<String, String>,
    ) -> Result<PathBuf, tonic::Status> {
        let staging = node.dir.join(format!("staging/{volume}"));
        let t = Instant::now();
        let r = node
            .client
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: volume.into(),
                publish_context: publish_context.clone(),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(rwo()),
                secrets: HashMap::new(),
                volume_context: HashMap::new(),
            })
            .await;
        println!(
            "  NodeStageVolume {volume} on {} ({:.1}s): {}",
            node.name,
            t.elapsed().as_secs_f64(),
            r.as_ref().map_or_else(
                |s| format!("{:?} {}", s.code(), s.message()),
                |_| "ok".into()
            )
        );
        r.map(|_| staging)
    }

    async fn node_publish(
        &self,
        node: &mut NodePlugin,
        volume: &str,
        staging: &Path,
        publish_context: &HashMap<String, String>,
    ) -> PathBuf {
        let pod = node.dir.join(format!("pods/pod-{volume}/volumes/{volume}"));
        fs::create_dir_all(&pod).unwrap();
        let target = pod.join("mount");
        node.client
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: volume.into(),
                publish_context: publish_context.clone(),
                staging_target_path: staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(rwo()),
                readonly: false,
                secrets: HashMap::new(),
                volume_context: HashMap::new(),
            })
            .await
            .expect("NodePublishVolume");
        println!(
            "  NodePublishVolume {volume} on {} -> {}",
            node.name,
            target.display()
        );
        target
    }

    /// ControllerPublish -> NodeStage -> NodePublish, then the checks every staged volume must
    /// pass: one namespace of this host with the derived identity, the staging mount on it, the
    /// pod path mounted.
    async fn attach(
        &mut self,
        ctl: &mut ControllerClient<Channel>,
        node: &mut NodePlugin,
        volume: &str,
    ) -> Staged {
        let publish_context = self
            .publish(ctl, volume, node)
            .await
            .expect("ControllerPublishVolume");
        let staging = self
            .stage(node, volume, &publish_context)
            .await
            .expect("NodeStageVolume");
        let target = self
            .node_publish(node, volume, &staging, &publish_context)
            .await;
        let device = host_device(volume, &node.host_nqn);
        let staged_mount = pillar_host::find_mount(&staging)
            .unwrap()
            .expect("staging path is mounted");
        assert_eq!(
            staged_mount.source,
            device.dev_path.display().to_string(),
            "staging mount is on the volume's namespace"
        );
        assert_eq!(staged_mount.fs_type, "ext4");
        let pod_mount = pillar_host::find_mount(&target)
            .unwrap()
            .expect("pod path is mounted");
        assert_eq!(
            (pod_mount.major, pod_mount.minor),
            (staged_mount.major, staged_mount.minor),
            "pod path shows the staged filesystem"
        );
        Staged {
            volume: volume.into(),
            node_id: node.id.clone(),
            publish_context,
            staging,
            target,
            device,
        }
    }

    /// NodeUnpublish -> NodeUnstage (this host's controller of the subsystem goes) ->
    /// ControllerUnpublish.
    async fn detach(
        &mut self,
        ctl: &mut ControllerClient<Channel>,
        node: &mut NodePlugin,
        s: &Staged,
    ) {
        node.client
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: s.volume.clone(),
                target_path: s.target.display().to_string(),
            })
            .await
            .expect("NodeUnpublishVolume");
        assert!(
            pillar_host::find_mount(&s.target).unwrap().is_none(),
            "pod path still mounted after NodeUnpublishVolume"
        );
        node.client
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: s.volume.clone(),
                staging_target_path: s.staging.display().to_string(),
            })
            .await
            .expect("NodeUnstageVolume");
        assert!(
            pillar_host::find_mount(&s.staging).unwrap().is_none(),
            "staging path still mounted after NodeUnstageVolume"
        );
        assert!(
            host_controllers(&s.volume, &node.host_nqn).is_empty(),
            "a controller of {} is left after NodeUnstageVolume",
            node.name
        );
        ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: s.volume.clone(),
            node_id: s.node_id.clone(),
            secrets: HashMap::new(),
        })
        .await
        .expect("ControllerUnpublishVolume");
        let link = Path::new(NVMET)
            .join("subsystems")
            .join(nqn_of(&s.volume).as_str())
            .join("allowed_hosts")
            .join(node.host_nqn.as_str());
        assert!(
            !link.exists(),
            "{} still in allowed_hosts after ControllerUnpublishVolume",
            node.host_nqn
        );
        println!("  detached {} from {}", s.volume, node.name);
    }

    async fn delete_volume(&self, ctl: &mut ControllerClient<Channel>, volume: &str) {
        ctl.delete_volume(csi::DeleteVolumeRequest {
            volume_id: volume.into(),
            secrets: HashMap::new(),
        })
        .await
        .expect("DeleteVolume");
        let sub = Path::new(NVMET)
            .join("subsystems")
            .join(nqn_of(volume).as_str());
        assert!(
            !sub.exists(),
            "subsystem {} left after DeleteVolume",
            sub.display()
        );
        assert!(
            !self.dir.join(format!("pool/{volume}.img")).exists(),
            "backing file left after DeleteVolume"
        );
        println!("  DeleteVolume {volume}: subsystem and backing file gone");
    }

    async fn wait_agent_state(
        &self,
        want: agent_api::health_response::State,
        timeout: Duration,
    ) -> Duration {
        let start = Instant::now();
        let mut c = self.agent_client().await;
        loop {
            if let Ok(h) = c.health(agent_api::HealthRequest {}).await
                && h.get_ref().state() == want
            {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < timeout,
                "agent did not reach {want:?} within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_logs();
        }
        for n in &mut self.nodes {
            n.stop();
        }
        if let Some(c) = self.controller.as_mut() {
            c.stop();
        }
        if let Some(a) = self.agent.as_mut() {
            a.stop();
        }
        reset_machine();
    }
}

// ---------------------------------------------------------------------------------------------
// Kernel-side checks

/// This host's controllers of `volume`'s subsystem.
fn host_controllers(volume: &str, host: &HostNqn) -> Vec<pillar_host::ControllerInfo> {
    controllers_for(&host_paths(), &nqn_of(volume))
        .unwrap()
        .into_iter()
        .filter(|c| c.hostnqn.as_deref() == Some(host.as_str()))
        .collect()
}

/// The one namespace disk of `volume` this host sees (waiting up to 10 s for it to appear after
/// a connect), with the derived identity.
fn host_device(volume: &str, host: &HostNqn) -> NamespaceDevice {
    let start = Instant::now();
    let mut devs = loop {
        let devs = namespaces_for_host(&host_paths(), &nqn_of(volume), Some(host)).unwrap();
        let ready = !devs.is_empty() && devs.iter().all(|d| d.dev_path.exists());
        if ready || start.elapsed() > Duration::from_secs(10) {
            break devs;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if devs.is_empty() {
        let block: Vec<String> = names(Path::new("/sys/block"));
        println!("  /sys/block: {block:?}");
        for b in block.iter().filter(|b| b.starts_with("nvme")) {
            let d = Path::new("/sys/block").join(b);
            println!(
                "  {b}: device -> {:?}, hidden {}, uuid {}",
                fs::canonicalize(d.join("device")),
                read_attr(&d.join("hidden")),
                read_attr(&d.join("uuid"))
            );
        }
    }
    assert_eq!(
        devs.len(),
        1,
        "host {host} sees {} namespaces of {volume}: {devs:?}",
        devs.len()
    );
    let dev = devs.remove(0);
    let want = identity_of(volume);
    assert_eq!(dev.uuid, Some(want.uuid), "namespace UUID in sysfs");
    assert_eq!(dev.nguid, Some(want.nguid), "namespace NGUID in sysfs");
    dev
}

/// Waits until one of this host's controllers of `volume` is in `state` (sysfs `state`).
fn wait_controller_state(
    volume: &str,
    host: &HostNqn,
    pred: impl Fn(&str) -> bool,
    what: &str,
    timeout: Duration,
) -> Duration {
    let start = Instant::now();
    loop {
        let ctrls = host_controllers(volume, host);
        if ctrls.iter().any(|c| pred(c.state.as_str())) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < timeout,
            "no controller of {volume} for {host} became {what} within {timeout:?}: {ctrls:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The identity configfs holds for `volume`: (device_uuid, device_nguid, attr_serial).
fn configfs_identity(volume: &str) -> (String, String, String) {
    let sub = Path::new(NVMET)
        .join("subsystems")
        .join(nqn_of(volume).as_str());
    (
        read_attr(&sub.join("namespaces/1/device_uuid")),
        read_attr(&sub.join("namespaces/1/device_nguid")),
        read_attr(&sub.join("attr_serial")),
    )
}

/// The configfs export of `volume` as pillar promises it: derived identity and serial, enabled,
/// linked to the TCP port on 127.0.0.1, allowed hosts exactly `hosts` (acl).
fn check_configfs_export(volume: &str, hosts: &[&HostNqn]) {
    let nqn = nqn_of(volume);
    let sub = Path::new(NVMET).join("subsystems").join(nqn.as_str());
    assert!(sub.is_dir(), "no subsystem {}", sub.display());
    let want = identity_of(volume);
    let (uuid, nguid, serial) = configfs_identity(volume);
    assert_eq!(uuid, want.uuid.to_string(), "configfs device_uuid");
    assert_eq!(nguid, want.nguid.to_string(), "configfs device_nguid");
    assert_eq!(
        serial,
        derive_serial(&nqn).to_string(),
        "configfs attr_serial"
    );
    assert_eq!(
        read_attr(&sub.join("namespaces/1/enable")),
        "1",
        "namespace enabled"
    );
    assert_eq!(
        read_attr(&sub.join("attr_allow_any_host")),
        "0",
        "acl: allow_any_host is 0"
    );
    let mut want_hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
    want_hosts.sort();
    assert_eq!(
        names(&sub.join("allowed_hosts")),
        want_hosts,
        "allowed_hosts"
    );
    let port = Path::new(NVMET).join(format!("ports/{PORT}"));
    assert_eq!(read_attr(&port.join("addr_trtype")), "tcp");
    assert_eq!(read_attr(&port.join("addr_traddr")), "127.0.0.1");
    assert_eq!(read_attr(&port.join("addr_trsvcid")), PORT.to_string());
    assert!(
        port.join("subsystems").join(nqn.as_str()).exists(),
        "subsystem not linked to port {PORT}"
    );
    println!(
        "  configfs: {} enabled, uuid {uuid}, nguid {nguid}, serial {serial}, allowed_hosts {want_hosts:?}, port {PORT}",
        nqn
    );
}

/// NodeGetVolumeStats of a staged volume, with a 20 s limit (a hang is an error too).
async fn volume_stats(
    node: &mut NodePlugin,
    staged: &Staged,
) -> Result<csi::NodeGetVolumeStatsResponse, String> {
    let call = node
        .client
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: staged.volume.clone(),
            volume_path: staged.target.display().to_string(),
            staging_target_path: staged.staging.display().to_string(),
        });
    match tokio::time::timeout(Duration::from_secs(20), call).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(status)) => Err(format!("{:?}: {}", status.code(), status.message())),
        Err(_) => Err("no answer within 20 s".into()),
    }
}

/// Starts a 4 KiB write + fsync on `dev` in a thread and reports what happened within
/// `timeout`: "SUCCEEDED", "FAILED: <error>" or "BLOCKED" (still waiting; the thread is left to
/// finish when the controller is deleted at cleanup).
fn blocked_write_probe(dev: &Path, timeout: Duration) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    let dev = dev.to_owned();
    std::thread::spawn(move || {
        let r = OpenOptions::new()
            .write(true)
            .open(&dev)
            .and_then(|mut f| f.write_all(&pattern(99, 4096)).and_then(|()| f.sync_all()));
        let _ = tx.send(r);
    });
    match rx.recv_timeout(timeout) {
        Ok(Ok(())) => "SUCCEEDED".into(),
        Ok(Err(e)) => format!("FAILED: {e}"),
        Err(_) => format!("BLOCKED for {timeout:?}"),
    }
}

fn check_configfs_export_exists(volume: &str) {
    let sub = Path::new(NVMET)
        .join("subsystems")
        .join(nqn_of(volume).as_str());
    assert_eq!(
        read_attr(&sub.join("namespaces/1/enable")),
        "1",
        "no enabled export of {volume} in configfs"
    );
}

fn statvfs_total(path: &Path) -> u64 {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: an all-zero statvfs is a valid value to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid, writable statvfs.
    let r = unsafe { libc::statvfs(c.as_ptr(), &raw mut st) };
    assert_eq!(r, 0, "statvfs {}", path.display());
    st.f_blocks * st.f_frsize
}

fn connect_opts(volume: &str, host: &HostNqn, host_id: uuid::Uuid) -> ConnectOptions {
    ConnectOptions {
        traddr: "127.0.0.1".parse().unwrap(),
        trsvcid: PORT,
        nqn: nqn_of(volume),
        hostnqn: host.clone(),
        hostid: host_id,
        ctrl_loss_tmo: CTRL_LOSS_TMO,
        reconnect_delay: RECONNECT_DELAY,
    }
}

fn token(uid: &str, generation: u64) -> Option<agent_api::FencingToken> {
    Some(agent_api::FencingToken {
        lifecycle_uid: uid.into(),
        generation,
    })
}

// ---------------------------------------------------------------------------------------------
// Scenarios

/// Scenario 1: provision, publish, stage (mkfs, mount), publish to a pod path, write data with
/// checksums, read back; then the way back, a second stage that finds the data (no mkfs of a
/// non-blank device), and delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s1_provision_publish_stage_io() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s1_provision_publish_stage_io");
    let mut lab = Lab::new("s1", true).await;
    let k0 = lab.kmsg.mark();
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut node = lab.start_default_node().await;
    lab.wait_agent_state(
        agent_api::health_response::State::Serving,
        Duration::from_secs(30),
    )
    .await;
    sc.step("agent serving after the controller's resync");

    let vol = "kl-s1";
    let nqn = nqn_of(vol);
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    check_configfs_export(vol, &[]);
    sc.step("CreateVolume: exported with no host admitted");

    let s = lab.attach(&mut ctl, &mut node, vol).await;
    sc.step("ControllerPublish + NodeStage + NodePublish");
    check_configfs_export(vol, &[&node.host_nqn]);
    let ctrls = host_controllers(vol, &node.host_nqn);
    assert_eq!(ctrls.len(), 1, "one controller: {ctrls:?}");
    let c = Path::new("/sys/class/nvme").join(&ctrls[0].name);
    assert_eq!(read_attr(&c.join("state")), "live");
    assert_eq!(read_attr(&c.join("transport")), "tcp");
    assert_eq!(
        read_attr(&c.join("serial")),
        derive_serial(&nqn).to_string(),
        "controller serial seen by the host"
    );
    assert_eq!(read_attr(&c.join("hostnqn")), node.host_nqn.to_string());
    assert_eq!(read_attr(&c.join("hostid")), node.host_id.to_string());
    assert!(
        read_attr(&c.join("address")).contains("traddr=127.0.0.1,trsvcid=4420"),
        "address {}",
        read_attr(&c.join("address"))
    );
    println!(
        "  host: controller {} live, device {} ({} bytes), uuid {:?}",
        ctrls[0].name, s.device.name, s.device.size_bytes, s.device.uuid
    );
    // 6.1: "nvmet: creating nvm controller 1 for subsystem <nqn> for NQN <host>."; 7.x:
    // "nvmet: Created nvm controller ...".
    lab.kmsg.expect(
        k0,
        &[
            "nvmet: ",
            "nvm controller",
            nqn.as_str(),
            "for NQN",
            node.host_nqn.as_str(),
        ],
        Duration::from_secs(5),
    );
    lab.kmsg.expect(
        k0,
        &["new ctrl: NQN \"", nqn.as_str(), "127.0.0.1:4420"],
        Duration::from_secs(5),
    );
    lab.kmsg.expect(
        k0,
        &["EXT4-fs (", s.device.name.as_str(), "mounted filesystem"],
        Duration::from_secs(5),
    );

    let data = DataSet::write(&s.target, "s1", 8, 512 * 1024);
    data.verify();
    sc.step("8 files written through the pod path, read back with equal SHA-256");

    // The way back, and a second stage of the same volume: the data is still there.
    let k1 = lab.kmsg.mark();
    let ctrl_name = ctrls[0].name.clone();
    lab.detach(&mut ctl, &mut node, &s).await;
    lab.kmsg.expect(
        k1,
        &[&format!("{ctrl_name}: Removing ctrl: NQN \"{nqn}\"")],
        Duration::from_secs(10),
    );
    check_configfs_export(vol, &[]);
    sc.step("NodeUnpublish + NodeUnstage (disconnect) + ControllerUnpublish (ACL emptied)");

    let s2 = lab.attach(&mut ctl, &mut node, vol).await;
    data.verify_at(&s.target, &s2.target);
    sc.step("staged again: not reformatted, data intact");
    lab.detach(&mut ctl, &mut node, &s2).await;
    lab.delete_volume(&mut ctl, vol).await;
    assert!(
        entries(&Path::new(NVMET).join("subsystems")).is_empty(),
        "subsystems left"
    );
    assert!(
        entries(&Path::new(NVMET).join("ports")).is_empty(),
        "an unreferenced port is left"
    );
    lab.kmsg.expect_absent(k0, "identifiers changed");
    sc.step("DeleteVolume: configfs empty");
}

/// Scenario 2: the agent is killed (SIGKILL) and restarted with its state directory kept.
/// nvmet keeps the export, so the host's I/O never stops; the restarted agent waits for the
/// controller's resync (the controller's loop sends it), and the identity is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s2_agent_restart_keeps_identity() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s2_agent_restart_keeps_identity");
    let mut lab = Lab::new("s2", true).await;
    let k0 = lab.kmsg.mark();
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut node = lab.start_default_node().await;
    let vol = "kl-s2";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let s = lab.attach(&mut ctl, &mut node, vol).await;
    let data = DataSet::write(&s.target, "before", 4, 256 * 1024);
    let identity_before = configfs_identity(vol);
    let ctrl_before = host_controllers(vol, &node.host_nqn);
    let mark = lab.agent_state().join(format!("generations/{vol}.json"));
    let mark_before = fs::read(&mark).expect("fencing mark exists");
    sc.step("volume staged, data written");

    let mut writer = Writer::start(&s.target.join("stream.bin"));
    std::thread::sleep(Duration::from_secs(2));
    let k1 = lab.kmsg.mark();
    lab.agent.as_mut().unwrap().kill();
    sc.step("agent killed (SIGKILL)");
    std::thread::sleep(Duration::from_secs(2));
    check_configfs_export(vol, &[&node.host_nqn]);
    let during = writer.snapshot();
    assert!(
        during.errors.is_empty(),
        "I/O failed while the agent was down: {:?}",
        during.errors
    );
    lab.start_agent(&[]).await;
    sc.step("agent restarted with the same state directory");
    let waited = lab
        .wait_agent_state(
            agent_api::health_response::State::Serving,
            Duration::from_secs(30),
        )
        .await;
    sc.step(&format!(
        "agent serving {:.1}s after its restart (the controller's resync loop)",
        waited.as_secs_f64()
    ));
    lab.kmsg.poll();
    std::thread::sleep(Duration::from_secs(2));
    let w = writer.finish(Duration::from_secs(30));
    assert!(
        w.errors.is_empty(),
        "I/O failed across the agent restart: {:?}",
        w.errors
    );
    assert!(w.done, "the writer is blocked");
    assert!(
        w.chunks.len() >= 10,
        "too little I/O went on: {} chunks",
        w.chunks.len()
    );
    assert!(
        w.max_latency < Duration::from_secs(5),
        "a write+fsync took {:?}",
        w.max_latency
    );
    writer.verify(&w);
    data.verify();
    sc.step("I/O went on throughout; all data verified");

    assert_eq!(
        configfs_identity(vol),
        identity_before,
        "configfs identity changed across the agent restart"
    );
    check_configfs_export(vol, &[&node.host_nqn]);
    let ctrl_after = host_controllers(vol, &node.host_nqn);
    assert_eq!(
        ctrl_after.iter().map(|c| &c.name).collect::<Vec<_>>(),
        ctrl_before.iter().map(|c| &c.name).collect::<Vec<_>>(),
        "same controller"
    );
    assert_eq!(ctrl_after[0].state.as_str(), "live");
    let dev = host_device(vol, &node.host_nqn);
    assert_eq!(
        (dev.name.as_str(), dev.devnum),
        (s.device.name.as_str(), s.device.devnum),
        "same block device"
    );
    lab.kmsg.expect_absent(k0, "identifiers changed");
    lab.kmsg.expect_absent(k1, "Reconnecting");
    lab.kmsg.expect_absent(k1, "Removing ctrl");
    let mark_after = fs::read(&mark).expect("fencing mark kept");
    assert_ne!(
        mark_after, mark_before,
        "the resync's token moved the mark forward"
    );
    sc.step("identity, controller and device unchanged; the connection never dropped");

    lab.detach(&mut ctl, &mut node, &s).await;
    lab.delete_volume(&mut ctl, vol).await;
    sc.step("the restarted agent serves the teardown");
}

/// What a storage-node reboot leaves behind, for scenarios 3 and 4.
struct Reboot {
    /// kmsg position at the cut.
    cut: usize,
    /// Seconds from the cut until the export was back in configfs.
    export_back: f64,
}

/// A storage-node reboot: the agent dies, the port is taken away (the TCP connections drop),
/// all nvmet state is torn down, loop devices go, the agent's state directory is wiped; the
/// agent restarts and refuses exports until the controller resyncs (the controller is down
/// during the reboot, so the refusal is observed before any resync; its resync loop sends the
/// resync once it is back).
async fn storage_reboot(
    lab: &mut Lab,
    sc: &Scenario,
    node: &mut NodePlugin,
    staged: &Staged,
    agent_args: &[&str],
) -> Reboot {
    let volume = staged.volume.as_str();
    let host = &node.host_nqn.clone();
    let ctrl = host_controllers(volume, host).remove(0).name;
    lab.controller.as_mut().unwrap().stop();
    let cut = lab.kmsg.mark();
    let t_cut = Instant::now();
    lab.agent.as_mut().unwrap().kill();
    take_ports_away().expect("take the port away");
    sc.step("storage node down: agent killed, subsystem unlinked and port removed");
    lab.kmsg.expect(
        cut,
        &[&format!("{ctrl}: starting error recovery")],
        Duration::from_secs(10),
    );
    let lost = wait_controller_state(
        volume,
        host,
        |s| s != "live",
        "not live",
        Duration::from_secs(20),
    );
    println!(
        "  host noticed the loss after {:.1}s: {:?}",
        lost.as_secs_f64(),
        host_controllers(volume, host)
            .iter()
            .map(|c| (c.name.clone(), c.state.as_str().to_owned()))
            .collect::<Vec<_>>()
    );
    nvmet_teardown_all().expect("tear down nvmet");
    assert!(nvmet_is_empty(), "nvmet state left after the teardown");
    let loops = detach_loops_under(&lab.dir.join("pool"));
    assert!(loops >= 1, "the volume's loop device was not found");
    fs::remove_dir_all(lab.agent_state()).expect("wipe the agent's state directory");
    sc.step("all nvmet state torn down, loop devices detached, agent state directory wiped");
    // Nothing listens any more: the host's reconnects are refused at the TCP level.
    lab.kmsg.expect(
        cut,
        &[&format!("{ctrl}: failed to connect socket: -111")],
        Duration::from_secs(10),
    );

    let mut agent = lab.start_agent(agent_args).await;
    let h = agent
        .health(agent_api::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        h.state(),
        agent_api::health_response::State::WaitingForResync,
        "a restarted agent waits for the resync"
    );
    let uid = lab.volume_uid(volume);
    let refused = agent
        .export(agent_api::ExportRequest {
            token: token(&uid, u64::MAX / 2),
            volume_id: volume.into(),
            pool: POOL.into(),
            protocol: Some(agent_api::ExportProtocol {
                service: u32::from(PORT),
                acl: true,
            }),
            allowed_host_nqns: vec![host.to_string()],
        })
        .await
        .expect_err("an export before the resync must be refused");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("resync"), "{refused:?}");
    let refused = agent
        .grant_initiator(agent_api::GrantInitiatorRequest {
            token: token(&uid, u64::MAX / 2),
            volume_id: volume.into(),
            host_nqn: host.to_string(),
        })
        .await
        .expect_err("a grant before the resync must be refused");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        !lab.agent_state()
            .join(format!("generations/{volume}.json"))
            .exists(),
        "a refused request left a fencing mark"
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        nvmet_is_empty(),
        "the agent created nvmet state before the resync"
    );
    assert!(
        host_controllers(volume, host)
            .iter()
            .all(|c| c.state.as_str() != "live"),
        "host live without an export"
    );
    sc.step("agent restarted: WAITING_FOR_RESYNC, Export and GrantInitiator refused (UNAVAILABLE), nvmet still empty after 3 s");
    // C5: the outage is visible to the CO, and asking does not hang.
    let stats = volume_stats(node, staged).await;
    println!("  NodeGetVolumeStats during the outage: {stats:?}");
    let condition = stats
        .expect("NodeGetVolumeStats answers during the outage")
        .volume_condition
        .expect("condition");
    assert!(
        condition.abnormal,
        "volume condition normal while the storage node is down: {condition:?}"
    );
    sc.step(&format!(
        "NodeGetVolumeStats during the outage: abnormal ({})",
        condition.message
    ));

    lab.start_controller(1).await;
    lab.wait_agent_state(
        agent_api::health_response::State::Serving,
        Duration::from_secs(30),
    )
    .await;
    let start = Instant::now();
    while !Path::new(NVMET)
        .join("subsystems")
        .join(nqn_of(volume).as_str())
        .join("namespaces/1/enable")
        .exists()
        && start.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    check_configfs_export_exists(volume);
    let export_back = t_cut.elapsed().as_secs_f64();
    sc.step(&format!(
        "controller back: its resync loop re-created the export ({export_back:.1}s after the cut)"
    ));
    Reboot { cut, export_back }
}

/// Scenario 3: a storage-node reboot with stable identity. The host reconnects by itself, the
/// kernel logs no `identifiers changed`, the same block device keeps working, data verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s3_storage_reboot_recovers() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s3_storage_reboot_recovers");
    let mut lab = Lab::new("s3", true).await;
    let k0 = lab.kmsg.mark();
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut node = lab.start_default_node().await;
    let vol = "kl-s3";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let s = lab.attach(&mut ctl, &mut node, vol).await;
    let data = DataSet::write(&s.target, "before", 4, 256 * 1024);
    let identity_before = configfs_identity(vol);
    let ctrl = host_controllers(vol, &node.host_nqn).remove(0).name;
    sc.step("volume staged, data written");

    let mut writer = Writer::start(&s.target.join("stream.bin"));
    std::thread::sleep(Duration::from_secs(2));
    let r = storage_reboot(&mut lab, &sc, &mut node, &s, &[]).await;
    let back = wait_controller_state(
        vol,
        &node.host_nqn,
        |s| s == "live",
        "live",
        Duration::from_secs(60),
    );
    let line = lab.kmsg.expect(
        r.cut,
        &[&format!("{ctrl}: Successfully reconnected")],
        Duration::from_secs(10),
    );
    lab.kmsg.expect(
        r.cut,
        &[
            "nvmet: ",
            "nvm controller",
            nqn_of(vol).as_str(),
            "for NQN",
            node.host_nqn.as_str(),
        ],
        Duration::from_secs(5),
    );
    sc.step(&format!("host reconnected by itself ({:.1}s after the export came back, {:.1}s after the cut): {line}", back.as_secs_f64(), r.export_back + back.as_secs_f64()));
    std::thread::sleep(Duration::from_secs(2));
    let w = writer.finish(Duration::from_secs(60));
    assert!(
        w.errors.is_empty(),
        "I/O failed across the reboot: {:?}",
        w.errors
    );
    assert!(w.done, "the writer is still blocked after the reconnect");
    writer.verify(&w);
    data.verify();
    let after = DataSet::write(&s.target, "after", 4, 256 * 1024);
    after.verify();
    sc.step(&format!(
        "I/O waited (max write+fsync {:.1}s) and went on; all data verified; new writes work",
        w.max_latency.as_secs_f64()
    ));

    lab.kmsg.expect_absent(k0, "identifiers changed");
    lab.kmsg.expect_absent(k0, "EXT4-fs error");
    assert_eq!(
        configfs_identity(vol),
        identity_before,
        "configfs identity after the reboot"
    );
    check_configfs_export(vol, &[&node.host_nqn]);
    let dev = host_device(vol, &node.host_nqn);
    assert_eq!(
        (dev.name.as_str(), dev.devnum),
        (s.device.name.as_str(), s.device.devnum),
        "the same block device"
    );
    let m = pillar_host::find_mount(&s.staging)
        .unwrap()
        .expect("still mounted");
    assert_eq!(m.source, s.device.dev_path.display().to_string());
    assert_eq!(
        host_controllers(vol, &node.host_nqn).remove(0).name,
        ctrl,
        "the same controller reconnected"
    );
    assert!(
        lab.agent_state()
            .join(format!("generations/{vol}.json"))
            .exists(),
        "the resync wrote a new fencing mark"
    );
    sc.step("no `identifiers changed`; same controller, same device, same identity");

    let stats = volume_stats(&mut node, &s)
        .await
        .expect("NodeGetVolumeStats");
    let condition = stats.volume_condition.expect("condition");
    assert!(
        !condition.abnormal,
        "volume still abnormal after the reconnect: {condition:?}"
    );
    sc.step(&format!(
        "NodeGetVolumeStats after the reconnect: normal ({})",
        condition.message
    ));

    lab.detach(&mut ctl, &mut node, &s).await;
    lab.delete_volume(&mut ctl, vol).await;
}

/// Scenario 4 (control): the same reboot, but the restarted agent leaves identity to the
/// kernel (test-only switch). The host logs `identifiers changed for nsid`, drops the namespace
/// and the filesystem fails: this proves scenario 3 can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s4_control_random_identity_breaks_fs() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s4_control_random_identity_breaks_fs");
    let mut lab = Lab::new("s4", true).await;
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut node = lab.start_default_node().await;
    let vol = "kl-s4";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let s = lab.attach(&mut ctl, &mut node, vol).await;
    let data = DataSet::write(&s.target, "before", 4, 256 * 1024);
    let identity_before = configfs_identity(vol);
    sc.step("volume staged (stable identity), data written");

    let mut writer = Writer::start(&s.target.join("stream.bin"));
    std::thread::sleep(Duration::from_secs(2));
    let r = storage_reboot(
        &mut lab,
        &sc,
        &mut node,
        &s,
        &["--unsafe-kernel-random-identity"],
    )
    .await;
    let (uuid, nguid, serial) = configfs_identity(vol);
    println!(
        "  configfs identity now: uuid {uuid}, nguid {nguid}, serial {serial} (before: {identity_before:?})"
    );
    assert_ne!(
        uuid, identity_before.0,
        "the kernel-random switch must leave a new UUID"
    );
    let line = lab.kmsg.expect(
        r.cut,
        &["identifiers changed for nsid"],
        Duration::from_secs(60),
    );
    sc.step(&format!("kernel: {line}"));

    let w = writer.finish(Duration::from_secs(30));
    // The filesystem must fail: the writer's fsync, a new file, or reading the old data.
    let mut failures: Vec<String> = w.errors.clone();
    let probe = s.target.join("after.bin");
    if let Err(e) = File::create(&probe).and_then(|mut f| {
        f.write_all(&pattern(7, 64 * 1024))
            .and_then(|()| f.sync_all())
    }) {
        failures.push(format!("write+fsync of a new file: {e}"));
    }
    drop_caches();
    for (p, _) in &data.files {
        if let Err(e) = fs::read(p) {
            failures.push(format!("read {}: {e}", p.display()));
            break;
        }
    }
    println!("  I/O failures observed: {failures:?}");
    assert!(
        !failures.is_empty(),
        "the control scenario expected the filesystem to fail, but all I/O succeeded"
    );
    let gone = namespaces_for_host(&host_paths(), &nqn_of(vol), Some(&node.host_nqn)).unwrap();
    assert!(
        gone.iter()
            .all(|d| d.name != s.device.name || d.uuid != Some(identity_of(vol).uuid)),
        "the old namespace is still there: {gone:?}"
    );
    let fs_line = lab
        .kmsg
        .find(r.cut, &["EXT4-fs", s.device.name.as_str()])
        .or_else(|| lab.kmsg.find(r.cut, &["I/O error", s.device.name.as_str()]));
    println!("  kernel log on the filesystem: {fs_line:?}");
    assert!(
        fs_line.is_some(),
        "no ext4 or I/O error line for {} in the kernel log",
        s.device.name
    );
    sc.step("as expected: identifiers changed, namespace dropped, the filesystem fails");
    drop(writer);

    // What the node plugin says about the broken volume, and whether kubelet's teardown works.
    let stats = volume_stats(&mut node, &s)
        .await
        .expect("NodeGetVolumeStats answers");
    let condition = stats.volume_condition.expect("condition");
    println!("  NodeGetVolumeStats after the identity change: {condition:?}");
    assert!(
        condition.abnormal,
        "volume condition normal after `identifiers changed`: {condition:?}"
    );
    sc.step(&format!(
        "NodeGetVolumeStats: abnormal ({})",
        condition.message
    ));
    node.client
        .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: vol.into(),
            target_path: s.target.display().to_string(),
        })
        .await
        .expect("NodeUnpublishVolume of the broken volume");
    node.client
        .node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: vol.into(),
            staging_target_path: s.staging.display().to_string(),
        })
        .await
        .expect("NodeUnstageVolume of the broken volume");
    assert!(pillar_host::find_mount(&s.target).unwrap().is_none());
    assert!(pillar_host::find_mount(&s.staging).unwrap().is_none());
    assert!(
        host_controllers(vol, &node.host_nqn).is_empty(),
        "NodeUnstageVolume left a controller"
    );
    sc.step("kubelet's teardown of the broken volume works: unmounted, disconnected");
}

/// Scenario 5: one writer. With `acl: true` a second host identity in the same guest cannot
/// publish or connect while the volume is published RWO to the first; after unpublish from the
/// first and publish to the second, the second connects and sees the data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s5_one_writer() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s5_one_writer");
    let mut lab = Lab::new("s5", true).await;
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut a = lab.start_default_node().await;
    let mut b = lab.start_second_node().await;
    assert_ne!(a.host_nqn, b.host_nqn);
    let vol = "kl-s5";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let sa = lab.attach(&mut ctl, &mut a, vol).await;
    let data = DataSet::write(&sa.target, "from-a", 4, 256 * 1024);
    check_configfs_export(vol, &[&a.host_nqn]);
    sc.step("published RWO to node-a, data written");

    let err = lab
        .publish(&mut ctl, vol, &b)
        .await
        .expect_err("a second RWO publish must be refused");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("node-a"),
        "the refusal names the node holding the volume: {}",
        err.message()
    );
    check_configfs_export(vol, &[&a.host_nqn]);
    sc.step("ControllerPublish to node-b: FAILED_PRECONDITION naming node-a; ACL unchanged");

    let k1 = lab.kmsg.mark();
    let direct = pillar_host::connect(&host_paths(), &connect_opts(vol, &b.host_nqn, b.host_id));
    println!("  host B connects on its own: {direct:?}");
    assert!(
        direct.is_err(),
        "host B connected to a volume published RWO to node-a"
    );
    lab.kmsg.expect(
        k1,
        &["connect by host", b.host_nqn.as_str(), "not allowed"],
        Duration::from_secs(5),
    );
    let staged_b = lab.stage(&mut b, vol, &sa.publish_context).await;
    assert!(
        staged_b.is_err(),
        "node-b staged a volume it was not published to"
    );
    assert!(
        host_controllers(vol, &b.host_nqn).is_empty(),
        "host B has a controller of the volume"
    );
    assert!(
        pillar_host::find_mount(&b.dir.join(format!("staging/{vol}")))
            .unwrap()
            .is_none()
    );
    assert!(
        lab.kmsg.count(k1, "not allowed") >= 2,
        "the target refused both connects"
    );
    sc.step(
        "host B (second hostnqn/hostid) refused by the target: direct connect and NodeStage fail",
    );

    lab.detach(&mut ctl, &mut a, &sa).await;
    check_configfs_export(vol, &[]);
    sc.step("unpublished from node-a");
    let sb = lab.attach(&mut ctl, &mut b, vol).await;
    check_configfs_export(vol, &[&b.host_nqn]);
    data.verify_at(&sa.target, &sb.target);
    let k2 = lab.kmsg.mark();
    let direct = pillar_host::connect(&host_paths(), &connect_opts(vol, &a.host_nqn, a.host_id));
    assert!(
        direct.is_err(),
        "host A connected after its unpublish: {direct:?}"
    );
    lab.kmsg.expect(
        k2,
        &["connect by host", a.host_nqn.as_str(), "not allowed"],
        Duration::from_secs(5),
    );
    sc.step("published to node-b: it connects and reads node-a's data; host A is now refused");
    lab.detach(&mut ctl, &mut b, &sb).await;
    lab.delete_volume(&mut ctl, vol).await;
}

/// Scenario 6: a revoke carrying an older generation, sent after a newer grant, is rejected
/// (FAILED_PRECONDITION) and the grant stays in configfs: the host still connects and does I/O.
/// Then the current revoke cuts the host off (W7). The agent alone, driven with its own tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s6_stale_revoke_rejected() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s6_stale_revoke_rejected");
    let mut lab = Lab::new("s6", true).await;
    let k0 = lab.kmsg.mark();
    let mut agent = lab.start_agent(&[]).await;
    agent
        .resync_exports(agent_api::ResyncExportsRequest { exports: vec![] })
        .await
        .expect("resync");
    let vol = "kl-s6";
    let uid = "0b9d6b1e-kernel-lane-s6";
    let host: HostNqn = fs::read_to_string(ETC_HOSTNQN)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let host_id: uuid::Uuid = fs::read_to_string(ETC_HOSTID)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    agent
        .create_volume(agent_api::CreateVolumeRequest {
            token: token(uid, 1),
            volume_id: vol.into(),
            pool: POOL.into(),
            size_bytes: 64 * MIB,
        })
        .await
        .expect("CreateVolume");
    agent
        .export(agent_api::ExportRequest {
            token: token(uid, 2),
            volume_id: vol.into(),
            pool: POOL.into(),
            protocol: Some(agent_api::ExportProtocol {
                service: u32::from(PORT),
                acl: true,
            }),
            allowed_host_nqns: vec![],
        })
        .await
        .expect("Export");
    check_configfs_export(vol, &[]);
    agent
        .grant_initiator(agent_api::GrantInitiatorRequest {
            token: token(uid, 4),
            volume_id: vol.into(),
            host_nqn: host.to_string(),
        })
        .await
        .expect("GrantInitiator");
    check_configfs_export(vol, &[&host]);
    sc.step("created, exported (acl), granted at generation 4");

    let stale = agent
        .revoke_initiator(agent_api::RevokeInitiatorRequest {
            token: token(uid, 3),
            volume_id: vol.into(),
            host_nqn: host.to_string(),
        })
        .await
        .expect_err("a revoke at generation 3 after the grant at 4 must be rejected");
    println!("  stale revoke: {:?} {}", stale.code(), stale.message());
    assert_eq!(stale.code(), Code::FailedPrecondition);
    let foreign = agent
        .revoke_initiator(agent_api::RevokeInitiatorRequest {
            token: token("another-lifecycle", 9),
            volume_id: vol.into(),
            host_nqn: host.to_string(),
        })
        .await
        .expect_err("a revoke from another lifecycle must be rejected");
    assert_eq!(foreign.code(), Code::FailedPrecondition);
    let none = agent
        .revoke_initiator(agent_api::RevokeInitiatorRequest {
            token: None,
            volume_id: vol.into(),
            host_nqn: host.to_string(),
        })
        .await
        .expect_err("a revoke without a token must be rejected");
    assert_eq!(none.code(), Code::FailedPrecondition);
    check_configfs_export(vol, &[&host]);
    let mark: serde_json::Value = serde_json::from_slice(
        &fs::read(lab.agent_state().join(format!("generations/{vol}.json"))).unwrap(),
    )
    .unwrap();
    println!("  fencing mark: {mark}");
    assert_eq!(
        mark["mark"]["generation"], 4,
        "the mark stays at the grant's generation"
    );
    sc.step("stale, foreign and token-less revokes rejected (FAILED_PRECONDITION); grant and port link still in configfs");

    let ctrl = pillar_host::connect(&host_paths(), &connect_opts(vol, &host, host_id))
        .expect("the granted host connects");
    let dev = host_device(vol, &host);
    let payload = pattern(66, 1024 * 1024);
    {
        let mut f = OpenOptions::new().write(true).open(&dev.dev_path).unwrap();
        f.write_all(&payload).unwrap();
        f.sync_all().unwrap();
    }
    drop_caches();
    let mut back = vec![0u8; payload.len()];
    File::open(&dev.dev_path)
        .unwrap()
        .read_exact(&mut back)
        .unwrap();
    assert_eq!(Sha256::digest(&back), Sha256::digest(&payload));
    lab.kmsg.expect(
        k0,
        &["new ctrl: NQN \"", nqn_of(vol).as_str()],
        Duration::from_secs(5),
    );
    sc.step(&format!(
        "granted host connected ({}), 1 MiB written to /dev/{} and read back",
        ctrl.name, dev.name
    ));

    let k1 = lab.kmsg.mark();
    agent
        .revoke_initiator(agent_api::RevokeInitiatorRequest {
            token: token(uid, 5),
            volume_id: vol.into(),
            host_nqn: host.to_string(),
        })
        .await
        .expect("the current revoke");
    check_configfs_export(vol, &[]);
    let start = Instant::now();
    lab.kmsg.expect(
        k1,
        &[
            "connect by host",
            host.as_str(),
            "for subsystem",
            nqn_of(vol).as_str(),
            "not allowed",
        ],
        Duration::from_secs(10),
    );
    let refused = start.elapsed();
    let ctrls = host_controllers(vol, &host);
    assert!(
        ctrls.iter().all(|c| c.state.as_str() != "live"),
        "the revoked host still has a live controller: {ctrls:?}"
    );
    // W7: the revoked host can no longer do I/O. Kernels with the do-not-retry short cut
    // (measured on 6.12 and 7.2) delete the controller after the first refused reconnect; 6.1
    // keeps reconnecting (refused each time) until ctrl_loss_tmo, holding the I/O back.
    let probe = blocked_write_probe(&dev.dev_path, Duration::from_secs(5));
    println!("  write by the revoked host: {probe}");
    assert!(
        !probe.starts_with("SUCCEEDED"),
        "the revoked host wrote: {probe}"
    );
    let ctrls = host_controllers(vol, &host);
    println!(
        "  revoked host's controllers: {:?}",
        ctrls
            .iter()
            .map(|c| (c.name.clone(), c.state.as_str().to_owned()))
            .collect::<Vec<_>>()
    );
    sc.step(&format!(
        "revoke at generation 5: host removed from the ACL, its connection cut and its reconnect \
         refused ({:.1}s); its writes do not reach the target",
        refused.as_secs_f64()
    ));

    agent
        .unexport(agent_api::UnexportRequest {
            token: token(uid, 6),
            volume_id: vol.into(),
        })
        .await
        .expect("Unexport");
    agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: token(uid, 7),
            volume_id: vol.into(),
            pool: POOL.into(),
        })
        .await
        .expect("DeleteVolume");
    assert!(nvmet_is_empty(), "nvmet state left after unexport");
    lab.kmsg.expect_absent(k0, "identifiers changed");
}

/// Scenario 7: online expansion (the host sees the new size, the filesystem grows while
/// mounted) and volume stats before and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s7_online_expansion_and_stats() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s7_online_expansion_and_stats");
    let mut lab = Lab::new("s7", true).await;
    let k0 = lab.kmsg.mark();
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut node = lab.start_default_node().await;
    let vol = "kl-s7";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let s = lab.attach(&mut ctl, &mut node, vol).await;
    let data = DataSet::write(&s.target, "before", 4, 256 * 1024);
    assert_eq!(s.device.size_bytes, 64 * MIB);

    let stats = |u: &csi::NodeGetVolumeStatsResponse, unit: csi::volume_usage::Unit| {
        u.usage
            .iter()
            .find(|x| x.unit() == unit)
            .cloned()
            .expect("usage unit")
    };
    let before = node
        .client
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: vol.into(),
            volume_path: s.target.display().to_string(),
            staging_target_path: s.staging.display().to_string(),
        })
        .await
        .expect("NodeGetVolumeStats")
        .into_inner();
    let b = stats(&before, csi::volume_usage::Unit::Bytes);
    let i = stats(&before, csi::volume_usage::Unit::Inodes);
    println!(
        "  stats before: {:?}, condition {:?}",
        before.usage, before.volume_condition
    );
    assert!(
        b.total > 0 && b.used >= 1024 * 1024 && b.available > 0 && b.used + b.available <= b.total,
        "bytes {b:?}"
    );
    assert!(i.total > 0 && i.used >= 4, "inodes {i:?}");
    assert_eq!(
        i64::try_from(statvfs_total(&s.target)).unwrap(),
        b.total,
        "stats total equals statvfs"
    );
    assert!(
        !before
            .volume_condition
            .as_ref()
            .expect("condition")
            .abnormal
    );
    sc.step("NodeGetVolumeStats: bytes and inodes, condition normal");

    let k1 = lab.kmsg.mark();
    let grown = ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: vol.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: i64::try_from(128 * MIB).unwrap(),
                limit_bytes: 0,
            }),
            secrets: HashMap::new(),
            volume_capability: Some(rwo()),
        })
        .await
        .expect("ControllerExpandVolume")
        .into_inner();
    println!("  ControllerExpandVolume: {grown:?}");
    assert!(grown.capacity_bytes >= i64::try_from(128 * MIB).unwrap());
    assert!(grown.node_expansion_required);
    assert_eq!(
        fs::metadata(lab.dir.join(format!("pool/{vol}.img")))
            .unwrap()
            .len(),
        128 * MIB,
        "backing file grown"
    );
    check_configfs_export(vol, &[&node.host_nqn]);
    let start = Instant::now();
    let size = |d: &str| {
        read_attr(&Path::new("/sys/block").join(d).join("size"))
            .parse::<u64>()
            .unwrap_or(0)
            * 512
    };
    while size(&s.device.name) != 128 * MIB && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        size(&s.device.name),
        128 * MIB,
        "the host did not see the new size"
    );
    lab.kmsg.expect(
        k1,
        &[s.device.name.as_str(), "detected capacity change"],
        Duration::from_secs(5),
    );
    sc.step(&format!(
        "host sees 128 MiB on {} ({:.1}s after the expand) without any node call",
        s.device.name,
        start.elapsed().as_secs_f64()
    ));

    let fs_before = statvfs_total(&s.target);
    let expanded = node
        .client
        .node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: vol.into(),
            volume_path: s.target.display().to_string(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: i64::try_from(128 * MIB).unwrap(),
                limit_bytes: 0,
            }),
            staging_target_path: s.staging.display().to_string(),
            volume_capability: Some(rwo()),
            secrets: HashMap::new(),
        })
        .await
        .expect("NodeExpandVolume")
        .into_inner();
    let fs_after = statvfs_total(&s.target);
    println!("  NodeExpandVolume: {expanded:?}; filesystem {fs_before} -> {fs_after} bytes");
    assert!(expanded.capacity_bytes >= i64::try_from(128 * MIB).unwrap());
    assert!(
        fs_after > fs_before + 48 * MIB,
        "the filesystem did not grow"
    );
    lab.kmsg.expect(
        k1,
        &["EXT4-fs (", s.device.name.as_str(), "resiz"],
        Duration::from_secs(5),
    );
    sc.step("NodeExpandVolume: filesystem grown online");

    // Data that did not fit before fits now.
    let big_mib = usize::try_from(b.available).unwrap() / (1024 * 1024) + 8;
    write_big_file(&s.target.join("big.bin"), big_mib);
    verify_big_file(&s.target.join("big.bin"), big_mib);
    data.verify();
    let after = node
        .client
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: vol.into(),
            volume_path: s.target.display().to_string(),
            staging_target_path: s.staging.display().to_string(),
        })
        .await
        .expect("NodeGetVolumeStats")
        .into_inner();
    let a = stats(&after, csi::volume_usage::Unit::Bytes);
    println!("  stats after: {:?}", after.usage);
    assert!(
        a.total > b.total + i64::try_from(48 * MIB).unwrap(),
        "stats total did not grow: {b:?} -> {a:?}"
    );
    assert!(a.used > b.available, "stats used shows the big file");
    assert_eq!(host_device(vol, &node.host_nqn).name, s.device.name);
    lab.kmsg.expect_absent(k0, "identifiers changed");
    sc.step("a file larger than the old free space written and verified; stats show the growth");

    lab.detach(&mut ctl, &mut node, &s).await;
    lab.delete_volume(&mut ctl, vol).await;
}

// ---------------------------------------------------------------------------------------------
// LVM (scenario 8)

/// Scenario 8's scratch volume group, on a loop device over a sparse file in guest RAM.
const S8_VG: &str = "pillar-s8";
/// Its thin pool.
const S8_THIN_POOL: &str = "tp";
/// Its extent size: 8 MiB, not LVM's default 4 MiB, so a backend that rounded to the default
/// instead of the VG's extent size would show.
const S8_EXTENT: u64 = 8 * MIB;

/// Runs `lvm ARGS` by argv (as the agent does) without udev: the guest has no udevd, and with
/// `DM_DISABLE_UDEV` libdevmapper and LVM create `/dev/mapper/*` and `/dev/<vg>/<lv>`
/// themselves (without it `lvcreate` fails: "/dev/<vg>/<lv>: not found: device not cleared").
fn lvm(args: &[&str]) -> Result<String, String> {
    let out = Command::new("lvm")
        .args(args)
        .env("LC_ALL", "C")
        .env("DM_DISABLE_UDEV", "1")
        .env("LVM_SUPPRESS_FD_WARNINGS", "1")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("spawn lvm: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "lvm {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn lvm_ok(args: &[&str]) -> String {
    let out = lvm(args).unwrap_or_else(|e| panic!("{e}"));
    println!("  lvm {}", args.join(" "));
    out
}

/// One LV as `lvs --reportformat json --units b --nosuffix` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Lv {
    name: String,
    path: String,
    size: u64,
    tags: Vec<String>,
    attr: String,
    pool_lv: String,
    data_percent: String,
    /// `major:minor` of its device-mapper device (`-1:-1` when inactive).
    devnum: String,
}

fn report_rows(json: &str, section: &str) -> Vec<serde_json::Value> {
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("lvm JSON report: {e}: {json}"));
    v["report"]
        .as_array()
        .expect("report array")
        .iter()
        .flat_map(|s| s[section].as_array().cloned().unwrap_or_default())
        .collect()
}

fn field(row: &serde_json::Value, name: &str) -> String {
    row[name]
        .as_str()
        .unwrap_or_else(|| panic!("lvm report row without {name}: {row}"))
        .to_owned()
}

/// Every (visible) LV of `vg`.
fn lvs(vg: &str) -> Vec<Lv> {
    let json = lvm(&[
        "lvs",
        "--reportformat",
        "json",
        "--units",
        "b",
        "--nosuffix",
        "-o",
        "lv_name,lv_path,lv_size,lv_tags,lv_attr,pool_lv,data_percent,lv_kernel_major,lv_kernel_minor",
        vg,
    ])
    .unwrap_or_else(|e| panic!("{e}"));
    report_rows(&json, "lv")
        .iter()
        .map(|r| Lv {
            name: field(r, "lv_name"),
            path: field(r, "lv_path"),
            size: field(r, "lv_size").parse().expect("lv_size in bytes"),
            tags: field(r, "lv_tags")
                .split(',')
                .filter(|t| !t.is_empty())
                .map(str::to_owned)
                .collect(),
            attr: field(r, "lv_attr"),
            pool_lv: field(r, "pool_lv"),
            data_percent: field(r, "data_percent"),
            devnum: format!(
                "{}:{}",
                field(r, "lv_kernel_major"),
                field(r, "lv_kernel_minor")
            ),
        })
        .collect()
}

fn find_lv(vg: &str, name: &str) -> Option<Lv> {
    lvs(vg).into_iter().find(|l| l.name == name)
}

/// (extent size, size, free) of `vg`, in bytes.
fn vgs(vg: &str) -> (u64, u64, u64) {
    let json = lvm(&[
        "vgs",
        "--reportformat",
        "json",
        "--units",
        "b",
        "--nosuffix",
        "-o",
        "vg_name,vg_extent_size,vg_size,vg_free",
        vg,
    ])
    .unwrap_or_else(|e| panic!("{e}"));
    let rows = report_rows(&json, "vg");
    let row = rows
        .iter()
        .find(|r| field(r, "vg_name") == vg)
        .unwrap_or_else(|| panic!("vgs has no {vg}: {json}"));
    let n = |f: &str| field(row, f).parse::<u64>().expect("bytes");
    (n("vg_extent_size"), n("vg_size"), n("vg_free"))
}

/// The most a thin pool of `total` bytes with `data_percent` (e.g. "1.23", rounded by LVM to
/// the nearest 0.01 %) can use: half a unit more, rounded up, capped at the whole.
fn percent_used(total: u64, percent: &str) -> u64 {
    let (int, frac) = percent.split_once('.').unwrap_or((percent, ""));
    let scale = 10u128.pow(u32::try_from(frac.len()).unwrap());
    let frac: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().expect("data_percent")
    };
    let scaled = int.parse::<u128>().expect("data_percent") * scale + frac;
    let used = (u128::from(total) * (2 * scaled + 1)).div_ceil(200 * scale);
    u64::try_from(used.min(u128::from(total))).unwrap()
}

/// `major:minor` of a device node.
fn devnum_of(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let rdev = fs::metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .rdev();
    let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff);
    let minor = (rdev & 0xff) | ((rdev >> 12) & !0xff);
    format!("{major}:{minor}")
}

/// Size in bytes of the block device `major:minor`, from sysfs.
fn sysfs_dev_size(devnum: &str) -> u64 {
    read_attr(&Path::new("/sys/dev/block").join(devnum).join("size"))
        .parse::<u64>()
        .unwrap_or(0)
        * 512
}

fn write_at(dev: &Path, offset: u64, data: &[u8]) {
    let f = OpenOptions::new()
        .write(true)
        .open(dev)
        .unwrap_or_else(|e| panic!("open {}: {e}", dev.display()));
    f.write_all_at(data, offset)
        .unwrap_or_else(|e| panic!("write {} at {offset}: {e}", dev.display()));
    f.sync_all()
        .unwrap_or_else(|e| panic!("fsync {}: {e}", dev.display()));
}

fn read_at(dev: &Path, offset: u64, len: usize) -> Vec<u8> {
    let f = File::open(dev).unwrap_or_else(|e| panic!("open {}: {e}", dev.display()));
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset)
        .unwrap_or_else(|e| panic!("read {} at {offset}: {e}", dev.display()));
    buf
}

/// A volume group with a thin pool on a loop device over a sparse file. Removed (VG, PV, loop
/// device, file) by [`teardown`](Self::teardown), or when dropped after a failure (then the
/// NVMe/TCP controllers and nvmet state go first, so nothing holds an LV open).
struct ScratchVg {
    vg: String,
    file: PathBuf,
    loop_dev: Option<String>,
    done: bool,
}

impl ScratchVg {
    fn create(file: &Path, vg: &str, size: u64, thin_pool: &str, thin_pool_size: u64) -> Self {
        if lvm(&["vgs", vg]).is_ok() {
            println!("  a volume group {vg} is left over: removing it");
            let _ = lvm(&["vgremove", "-ff", "-y", vg]);
        }
        File::create(file)
            .and_then(|f| f.set_len(size))
            .unwrap_or_else(|e| panic!("sparse file {}: {e}", file.display()));
        let mut me = Self {
            vg: vg.to_owned(),
            file: file.to_owned(),
            loop_dev: None,
            done: false,
        };
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(file)
            .output()
            .expect("run losetup");
        assert!(
            out.status.success(),
            "losetup --find --show {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        println!(
            "  {dev} over {} ({} MiB, sparse)",
            file.display(),
            size / MIB
        );
        me.loop_dev = Some(dev.clone());
        lvm_ok(&["pvcreate", "-y", &dev]);
        lvm_ok(&["vgcreate", "-s", &format!("{}M", S8_EXTENT / MIB), vg, &dev]);
        lvm_ok(&[
            "lvcreate",
            "--type",
            "thin-pool",
            "-L",
            &format!("{}M", thin_pool_size / MIB),
            "-n",
            thin_pool,
            "--yes",
            vg,
        ]);
        me
    }

    /// Removes the VG (all its LVs), the PV label, the loop device and the file.
    fn teardown(&mut self) -> Result<(), String> {
        self.done = true;
        let mut errors = Vec::new();
        if let Err(e) = lvm(&["vgremove", "-ff", "-y", &self.vg]) {
            errors.push(e);
        }
        if let Some(dev) = self.loop_dev.take() {
            if let Err(e) = lvm(&["pvremove", "-y", &dev]) {
                errors.push(e);
            }
            let status = Command::new("losetup").arg("-d").arg(&dev).status();
            if !matches!(&status, Ok(s) if s.success()) {
                errors.push(format!("losetup -d {dev}: {status:?}"));
            }
            let backing = Path::new("/sys/block")
                .join(dev.trim_start_matches("/dev/"))
                .join("loop/backing_file");
            let start = Instant::now();
            while backing.exists() && start.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(100));
            }
            if backing.exists() {
                errors.push(format!("{dev} is still bound to {}", read_attr(&backing)));
            }
        }
        if let Err(e) = fs::remove_file(&self.file) {
            errors.push(format!("rm {}: {e}", self.file.display()));
        }
        println!(
            "  removed volume group {}, its PV, loop device and file: errors {errors:?}",
            self.vg
        );
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }
}

impl Drop for ScratchVg {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        disconnect_all_controllers();
        if let Err(e) = nvmet_teardown_all() {
            println!("  cleanup: nvmet teardown: {e}");
        }
        if let Err(e) = self.teardown() {
            println!("  cleanup: {e}");
        }
    }
}

/// One lifecycle's fencing tokens: every call at the next generation.
struct Lifecycle {
    uid: String,
    generation: u64,
}

impl Lifecycle {
    fn new(uid: &str) -> Self {
        Self {
            uid: uid.to_owned(),
            generation: 0,
        }
    }

    fn next(&mut self) -> Option<agent_api::FencingToken> {
        self.generation += 1;
        token(&self.uid, self.generation)
    }

    /// The last token again: a retry.
    fn again(&self) -> Option<agent_api::FencingToken> {
        token(&self.uid, self.generation)
    }
}

/// The export of an LV in configfs: its device path, the LV's device-mapper device behind it,
/// the derived identity, enabled, any host (no ACL), linked to the port.
fn check_lvm_export(volume: &str, lv: &Lv) {
    let nqn = nqn_of(volume);
    let sub = Path::new(NVMET).join("subsystems").join(nqn.as_str());
    let ns = sub.join("namespaces/1");
    let device_path = read_attr(&ns.join("device_path"));
    assert_eq!(
        device_path, lv.path,
        "configfs device_path is the LV's device"
    );
    assert_eq!(
        devnum_of(Path::new(&device_path)),
        lv.devnum,
        "{device_path} is the LV's device-mapper device"
    );
    let want = identity_of(volume);
    let (uuid, nguid, serial) = configfs_identity(volume);
    assert_eq!(uuid, want.uuid.to_string(), "configfs device_uuid");
    assert_eq!(nguid, want.nguid.to_string(), "configfs device_nguid");
    assert_eq!(
        serial,
        derive_serial(&nqn).to_string(),
        "configfs attr_serial"
    );
    assert_eq!(read_attr(&ns.join("enable")), "1", "namespace enabled");
    assert_eq!(
        read_attr(&sub.join("attr_allow_any_host")),
        "1",
        "acl false: allow_any_host is 1"
    );
    assert!(
        names(&sub.join("allowed_hosts")).is_empty(),
        "no allowed_hosts"
    );
    let port = Path::new(NVMET).join(format!("ports/{PORT}"));
    assert_eq!(read_attr(&port.join("addr_traddr")), "127.0.0.1");
    assert!(
        port.join("subsystems").join(nqn.as_str()).exists(),
        "subsystem not linked to port {PORT}"
    );
    println!(
        "  configfs: {nqn} device_path {device_path} ({} = dm {}), uuid {uuid}, nguid {nguid}, serial {serial}, any host, port {PORT}",
        fs::canonicalize(&device_path).map_or_else(|e| e.to_string(), |p| p.display().to_string()),
        lv.devnum
    );
}

/// GetCapacity of both LVM pools against LVM's own reports: linear is the VG's size and free
/// space, thin the thin pool's data size less what `data_percent` says is used. Returns the thin
/// pool's (total, available) bytes.
async fn check_lvm_capacity(agent: &mut AgentClient<Channel>) -> (u64, u64) {
    let cap = |pool: &str| agent_api::GetCapacityRequest { pool: pool.into() };
    let lin = agent
        .get_capacity(cap("lin"))
        .await
        .expect("GetCapacity lin")
        .into_inner();
    let (_, vg_size, vg_free) = vgs(S8_VG);
    assert_eq!(
        (lin.total_bytes, lin.available_bytes),
        (vg_size, vg_free),
        "lin capacity is the VG's size and free space"
    );
    assert!(lin.available_bytes < lin.total_bytes);
    let thin = agent
        .get_capacity(cap("thin"))
        .await
        .expect("GetCapacity thin")
        .into_inner();
    let tp = find_lv(S8_VG, S8_THIN_POOL).expect("thin pool");
    let used = percent_used(tp.size, &tp.data_percent);
    assert_eq!(
        (thin.total_bytes, thin.available_bytes),
        (tp.size, tp.size - used),
        "thin capacity is the pool's data size less data_percent ({}%)",
        tp.data_percent
    );
    println!(
        "  GetCapacity: lin {} of {} bytes free (vgs), thin {} of {} bytes free (data_percent {}%)",
        lin.available_bytes,
        lin.total_bytes,
        thin.available_bytes,
        thin.total_bytes,
        tp.data_percent
    );
    (thin.total_bytes, thin.available_bytes)
}

/// ListVolumes of `pool` ("" for all) as (volume, pool, size, device path).
async fn listed(
    agent: &mut AgentClient<Channel>,
    pool: &str,
) -> Vec<(String, String, u64, String)> {
    let mut v: Vec<_> = agent
        .list_volumes(agent_api::ListVolumesRequest { pool: pool.into() })
        .await
        .expect("ListVolumes")
        .into_inner()
        .volumes
        .into_iter()
        .map(|v| (v.volume_id, v.pool, v.size_bytes, v.device_path))
        .collect();
    v.sort();
    v
}

/// Scenario 8, one volume of one LVM pool from export to delete: export (no ACL), the host
/// connects, I/O at both ends checked on the host and in the LV, online expansion seen by the
/// host, shrink refused, the way back, delete.
#[allow(clippy::too_many_lines)]
async fn s8_volume(
    sc: &Scenario,
    lab: &mut Lab,
    agent: &mut AgentClient<Channel>,
    pool: &str,
    vol: &str,
    life: &mut Lifecycle,
) {
    let thin = pool == "thin";
    let host: HostNqn = fs::read_to_string(ETC_HOSTNQN)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let host_id: uuid::Uuid = fs::read_to_string(ETC_HOSTID)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let nqn = nqn_of(vol);
    let lv = find_lv(S8_VG, vol).expect("the LV exists");
    let (_, thin_free_before) = check_lvm_capacity(agent).await;

    let k1 = lab.kmsg.mark();
    let exported = agent
        .export(agent_api::ExportRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: pool.into(),
            protocol: Some(agent_api::ExportProtocol {
                service: u32::from(PORT),
                acl: false,
            }),
            allowed_host_nqns: vec![],
        })
        .await
        .expect("Export")
        .into_inner();
    assert_eq!(exported.subsystem_nqn, nqn.to_string());
    assert_eq!(
        (exported.target_address.as_str(), exported.target_service),
        ("127.0.0.1", u32::from(PORT))
    );
    assert!(!exported.identity_adopted);
    check_lvm_export(vol, &lv);
    sc.step(&format!("{pool}: {vol} exported from {} (no ACL)", lv.path));

    let ctrl = pillar_host::connect(&host_paths(), &connect_opts(vol, &host, host_id))
        .expect("the host connects");
    let dev = host_device(vol, &host);
    assert_eq!(dev.size_bytes, lv.size, "the host sees the LV's size");
    lab.kmsg.expect(
        k1,
        &["new ctrl: NQN \"", nqn.as_str(), "127.0.0.1:4420"],
        Duration::from_secs(5),
    );
    let old_size = lv.size;
    let seed = if thin { 800 } else { 700 };
    let mib = usize::try_from(MIB).unwrap();
    let head = pattern(seed, mib);
    let old_tail = pattern(seed + 1, mib);
    write_at(&dev.dev_path, 0, &head);
    write_at(&dev.dev_path, old_size - MIB, &old_tail);
    drop_caches();
    // Compared byte for byte: SHA-256 of MiBs in a debug build under TCG takes seconds.
    let same = |a: &[u8], b: &[u8]| a == b;
    let lv_path = Path::new(&lv.path);
    for (what, path) in [("host", dev.dev_path.as_path()), ("LV", lv_path)] {
        assert!(
            same(&read_at(path, 0, head.len()), &head),
            "{what}: first MiB differs"
        );
        assert!(
            same(&read_at(path, old_size - MIB, old_tail.len()), &old_tail),
            "{what}: last MiB differs"
        );
    }
    sc.step(&format!(
        "{pool}: host connected ({} -> /dev/{}, {} bytes); first and last MiB written, read back \
         through the host and from {} (page cache dropped, bytes equal)",
        ctrl.name, dev.name, dev.size_bytes, lv.path
    ));

    // Online expansion: 90 MiB + 1 byte is 96 MiB in 8 MiB extents (92 MiB in LVM's default 4).
    let k2 = lab.kmsg.mark();
    let new_size = 96 * MIB;
    let grown = agent
        .expand_volume(agent_api::ExpandVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: pool.into(),
            size_bytes: 90 * MIB + 1,
        })
        .await
        .expect("ExpandVolume")
        .into_inner();
    assert_eq!(
        grown.size_bytes, new_size,
        "expanded size rounded to the extent size"
    );
    let lv_grown = find_lv(S8_VG, vol).expect("LV");
    assert_eq!(lv_grown.size, new_size, "lvs shows the new size");
    assert_eq!(lv_grown.devnum, lv.devnum, "same device-mapper device");
    assert_eq!(
        sysfs_dev_size(&lv.devnum),
        new_size,
        "the dm device has grown"
    );
    let host_size = |d: &str| {
        read_attr(&Path::new("/sys/block").join(d).join("size"))
            .parse::<u64>()
            .unwrap_or(0)
            * 512
    };
    let start = Instant::now();
    while host_size(&dev.name) != new_size && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        host_size(&dev.name),
        new_size,
        "the host did not see the new size"
    );
    lab.kmsg.expect(
        k2,
        &[dev.name.as_str(), "detected capacity change"],
        Duration::from_secs(5),
    );
    sc.step(&format!(
        "{pool}: ExpandVolume 90 MiB + 1 -> {} bytes; lvs and the dm device show it; the host \
         sees it by itself ({:.1}s)",
        new_size,
        start.elapsed().as_secs_f64()
    ));

    let equal = agent
        .expand_volume(agent_api::ExpandVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: pool.into(),
            size_bytes: new_size - 1,
        })
        .await
        .expect("ExpandVolume to the same size after rounding")
        .into_inner();
    assert_eq!(equal.size_bytes, new_size);
    let shrink = agent
        .expand_volume(agent_api::ExpandVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: pool.into(),
            size_bytes: old_size,
        })
        .await
        .expect_err("a shrink must be refused");
    println!("  shrink: {:?} {}", shrink.code(), shrink.message());
    assert_eq!(shrink.code(), Code::OutOfRange);
    assert_eq!(find_lv(S8_VG, vol).unwrap().size, new_size, "LV not shrunk");
    assert_eq!(host_size(&dev.name), new_size);

    let new_tail = pattern(seed + 2, mib);
    write_at(&dev.dev_path, new_size - MIB, &new_tail);
    drop_caches();
    for (what, path) in [("host", dev.dev_path.as_path()), ("LV", lv_path)] {
        assert!(
            same(&read_at(path, 0, head.len()), &head),
            "{what}: first MiB differs"
        );
        assert!(
            same(&read_at(path, old_size - MIB, old_tail.len()), &old_tail),
            "{what}: old last MiB differs"
        );
        assert!(
            same(&read_at(path, new_size - MIB, new_tail.len()), &new_tail),
            "{what}: new last MiB differs"
        );
    }
    sc.step(&format!(
        "{pool}: a request equal after rounding is a no-op; shrink refused (OUT_OF_RANGE); the new \
         last MiB written, all data read back through the host and from the LV"
    ));

    let (thin_total, thin_free_after) = check_lvm_capacity(agent).await;
    if thin {
        // Three 1 MiB writes provision 3 MiB of 64 KiB chunks. LVM rounds data_percent to the
        // nearest 0.01 %, so the pool's reported use may be up to 0.005 % of its size short.
        let used = thin_free_before - thin_free_after;
        assert!(
            used + thin_total / 20_000 >= 3 * MIB,
            "3 MiB written to a thin volume: the thin pool's free space {thin_free_before} -> \
             {thin_free_after}"
        );
        println!(
            "  thin pool: {used} bytes more in use after 3 MiB of writes ({} bytes less than \
             provisioned: LVM's rounding of data_percent)",
            (3 * MIB).saturating_sub(used)
        );
    }

    let k3 = lab.kmsg.mark();
    write_attr(
        &Path::new("/sys/class/nvme")
            .join(&ctrl.name)
            .join("delete_controller"),
        "1",
    )
    .expect("disconnect");
    let start = Instant::now();
    while !host_controllers(vol, &host).is_empty() && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(host_controllers(vol, &host).is_empty(), "controller left");
    lab.kmsg.expect(
        k3,
        &[&format!("{}: Removing ctrl: NQN \"{nqn}\"", ctrl.name)],
        Duration::from_secs(10),
    );
    agent
        .unexport(agent_api::UnexportRequest {
            token: life.next(),
            volume_id: vol.into(),
        })
        .await
        .expect("Unexport");
    assert!(
        !Path::new(NVMET)
            .join("subsystems")
            .join(nqn.as_str())
            .exists(),
        "subsystem left after Unexport"
    );

    // The other LVM pool does not own this LV (linear vs thin layout) and leaves it alone.
    let other = if thin { "lin" } else { "thin" };
    let wrong = agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: other.into(),
        })
        .await
        .expect_err("DeleteVolume in the other LVM pool must be refused");
    println!(
        "  DeleteVolume in pool {other}: {:?} {}",
        wrong.code(),
        wrong.message()
    );
    assert_eq!(wrong.code(), Code::FailedPrecondition);
    assert!(
        find_lv(S8_VG, vol).is_some(),
        "LV removed through the wrong pool"
    );

    agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: pool.into(),
        })
        .await
        .expect("DeleteVolume");
    assert!(find_lv(S8_VG, vol).is_none(), "LV left after DeleteVolume");
    assert!(!lv_path.exists(), "{} left after DeleteVolume", lv.path);
    agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: life.again(),
            volume_id: vol.into(),
            pool: pool.into(),
        })
        .await
        .expect("DeleteVolume retried");
    sc.step(&format!(
        "{pool}: disconnected, unexported; DeleteVolume in pool {other} refused \
         (FAILED_PRECONDITION), in {pool} the LV is gone from lvs and /dev; a retry is Ok"
    ));
}

/// Scenario 8 (issue 3 item 6 on a real kernel): the LVM backends on device-mapper. A VG with
/// 8 MiB extents and a thin pool on a loop device; the agent with a linear and a thin pool. For
/// each: CreateVolume rounds to the extent size and tags the LV, Export puts the LV's device in
/// configfs, the host does I/O on it, ExpandVolume grows it online, a shrink is refused, the way
/// back and DeleteVolume remove it; ListVolumes and GetCapacity agree with LVM's own reports.
/// LVs without the `pillar` tag are never listed, grown, exported or removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
#[allow(clippy::too_many_lines)]
async fn s8_lvm_backends() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s8_lvm_backends");
    assert_eq!(
        std::env::var("DM_DISABLE_UDEV").as_deref(),
        Ok("1"),
        "the guest has no udevd: the agent's lvm commands need DM_DISABLE_UDEV=1 \
         (tests/kernel-lane/guest/pillar.sh exports it)"
    );
    let mut lab = Lab::new("s8", false).await;
    let k0 = lab.kmsg.mark();
    // Declared after the lab, so dropped before it: after a failure the VG and its loop device
    // go before the lab's own cleanup (which would otherwise wait for the busy loop device).
    let mut vg = ScratchVg::create(
        &lab.dir.join("pv.img"),
        S8_VG,
        1 << 30,
        S8_THIN_POOL,
        256 * MIB,
    );
    let (extent, _, _) = vgs(S8_VG);
    assert_eq!(extent, S8_EXTENT);
    lvm_ok(&["lvcreate", "-L", "8M", "-n", "foreign-lin", "--yes", S8_VG]);
    lvm_ok(&[
        "lvcreate",
        "-V",
        "16M",
        "--thinpool",
        S8_THIN_POOL,
        "-n",
        "foreign-thin",
        "--addtag",
        "other",
        "--yes",
        S8_VG,
    ]);
    let foreign = |lvs: Vec<Lv>| -> Vec<Lv> {
        let mut v: Vec<Lv> = lvs
            .into_iter()
            .filter(|l| l.name.starts_with("foreign-"))
            .map(|l| Lv {
                data_percent: String::new(),
                ..l
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    };
    let foreign_before = foreign(lvs(S8_VG));
    assert_eq!(foreign_before.len(), 2, "{foreign_before:?}");
    sc.step(&format!(
        "loop device, PV, VG {S8_VG} (8 MiB extents), thin pool {S8_THIN_POOL}; LVs without \
         pillar's tag: foreign-lin (linear), foreign-thin (thin, tag other)"
    ));

    let lin_pool = format!("lin=lvm:{S8_VG}");
    let thin_pool = format!("thin=lvm-thin:{S8_VG}/{S8_THIN_POOL}");
    let mut agent = lab
        .start_agent(&["--pool", &lin_pool, "--pool", &thin_pool])
        .await;
    agent
        .resync_exports(agent_api::ResyncExportsRequest { exports: vec![] })
        .await
        .expect("resync");
    let caps = agent
        .get_capabilities(agent_api::GetCapabilitiesRequest {})
        .await
        .expect("GetCapabilities")
        .into_inner();
    let kinds: HashMap<String, String> = caps
        .pools
        .iter()
        .map(|p| (p.name.clone(), p.kind.clone()))
        .collect();
    assert_eq!(kinds.get("lin").map(String::as_str), Some("lvm-linear"));
    assert_eq!(kinds.get("thin").map(String::as_str), Some("lvm-thin"));
    assert_eq!(caps.target, "kernel");
    sc.step("agent serving (empty resync) with pools lin (lvm-linear) and thin (lvm-thin)");

    // 40 MiB + 1 byte: 48 MiB in 8 MiB extents (44 MiB if rounded to LVM's default 4 MiB).
    let asked = 40 * MIB + 1;
    let want = 48 * MIB;
    let vols = [("lin", "kl-s8-lin"), ("thin", "kl-s8-thin")];
    let mut lives = [
        Lifecycle::new("0b9d6b1e-kernel-lane-s8-lin"),
        Lifecycle::new("0b9d6b1e-kernel-lane-s8-thin"),
    ];
    for ((pool, vol), life) in vols.iter().zip(lives.iter_mut()) {
        let created = agent
            .create_volume(agent_api::CreateVolumeRequest {
                token: life.next(),
                volume_id: (*vol).into(),
                pool: (*pool).into(),
                size_bytes: asked,
            })
            .await
            .expect("CreateVolume")
            .into_inner();
        assert_eq!(
            created.size_bytes, want,
            "{asked} bytes rounded up to the VG's 8 MiB extents"
        );
        let lv = find_lv(S8_VG, vol).expect("LV created");
        println!("  lvs: {lv:?}");
        assert_eq!(lv.size, want, "lvs size");
        assert_eq!(
            lv.tags,
            vec!["pillar".to_owned()],
            "the LV carries pillar's tag"
        );
        assert_eq!(lv.path, format!("/dev/{S8_VG}/{vol}"));
        assert!(Path::new(&lv.path).exists(), "{} exists", lv.path);
        assert_eq!(lv.attr.chars().nth(4), Some('a'), "LV active: {}", lv.attr);
        assert_eq!(sysfs_dev_size(&lv.devnum), want, "dm device size");
        if *pool == "thin" {
            assert_eq!(lv.pool_lv, S8_THIN_POOL, "a thin volume of the thin pool");
            assert!(lv.attr.starts_with('V'), "thin volume attr {}", lv.attr);
        } else {
            assert_eq!(lv.pool_lv, "", "a linear LV");
            assert!(lv.attr.starts_with('-'), "linear LV attr {}", lv.attr);
        }
        let retry = agent
            .create_volume(agent_api::CreateVolumeRequest {
                token: life.again(),
                volume_id: (*vol).into(),
                pool: (*pool).into(),
                size_bytes: asked,
            })
            .await
            .expect("CreateVolume retried")
            .into_inner();
        assert_eq!(retry.size_bytes, want);
        let other_size = agent
            .create_volume(agent_api::CreateVolumeRequest {
                token: life.next(),
                volume_id: (*vol).into(),
                pool: (*pool).into(),
                size_bytes: 64 * MIB,
            })
            .await
            .expect_err("CreateVolume of an existing volume with another size");
        assert_eq!(other_size.code(), Code::AlreadyExists);
        assert_eq!(find_lv(S8_VG, vol).unwrap().size, want, "not resized");
        sc.step(&format!(
            "{pool}: CreateVolume {asked} bytes -> {want} (VG extent size), LV {} tagged pillar; \
             a retry is the same volume, another size ALREADY_EXISTS",
            lv.path
        ));
    }

    let path = |vol: &str| format!("/dev/{S8_VG}/{vol}");
    let lin_row = (
        "kl-s8-lin".to_owned(),
        "lin".to_owned(),
        want,
        path("kl-s8-lin"),
    );
    let thin_row = (
        "kl-s8-thin".to_owned(),
        "thin".to_owned(),
        want,
        path("kl-s8-thin"),
    );
    assert_eq!(listed(&mut agent, "lin").await, vec![lin_row.clone()]);
    assert_eq!(listed(&mut agent, "thin").await, vec![thin_row.clone()]);
    assert_eq!(listed(&mut agent, "").await, vec![lin_row, thin_row]);
    check_lvm_capacity(&mut agent).await;
    sc.step("ListVolumes: each pool lists its own LV only (not the foreign LVs, not the thin pool); GetCapacity agrees with vgs/lvs");

    for ((pool, vol), life) in vols.iter().zip(lives.iter_mut()) {
        s8_volume(&sc, &mut lab, &mut agent, pool, vol, life).await;
    }

    // LVs without the tag: never created over, grown, exported or removed.
    for (pool, vol) in [("lin", "foreign-lin"), ("thin", "foreign-thin")] {
        let mut life = Lifecycle::new(&format!("0b9d6b1e-kernel-lane-s8-{vol}"));
        let create = agent
            .create_volume(agent_api::CreateVolumeRequest {
                token: life.next(),
                volume_id: vol.into(),
                pool: pool.into(),
                size_bytes: 8 * MIB,
            })
            .await
            .expect_err("CreateVolume over a foreign LV");
        println!(
            "  CreateVolume {vol}: {:?} {}",
            create.code(),
            create.message()
        );
        assert_eq!(create.code(), Code::FailedPrecondition);
        assert!(
            create.message().contains("pillar did not create it"),
            "{}",
            create.message()
        );
        let expand = agent
            .expand_volume(agent_api::ExpandVolumeRequest {
                token: life.next(),
                volume_id: vol.into(),
                pool: pool.into(),
                size_bytes: 32 * MIB,
            })
            .await
            .expect_err("ExpandVolume of a foreign LV");
        assert_eq!(
            expand.code(),
            Code::FailedPrecondition,
            "{}",
            expand.message()
        );
        let export = agent
            .export(agent_api::ExportRequest {
                token: life.next(),
                volume_id: vol.into(),
                pool: pool.into(),
                protocol: Some(agent_api::ExportProtocol {
                    service: u32::from(PORT),
                    acl: false,
                }),
                allowed_host_nqns: vec![],
            })
            .await
            .expect_err("Export of a foreign LV");
        assert_eq!(export.code(), Code::NotFound, "{}", export.message());
        assert!(nvmet_is_empty(), "a foreign LV was exported");
        let delete = agent
            .delete_volume(agent_api::DeleteVolumeRequest {
                token: life.next(),
                volume_id: vol.into(),
                pool: pool.into(),
            })
            .await
            .expect_err("DeleteVolume of a foreign LV");
        assert_eq!(
            delete.code(),
            Code::FailedPrecondition,
            "{}",
            delete.message()
        );
    }
    assert_eq!(
        foreign(lvs(S8_VG)),
        foreign_before,
        "the foreign LVs are unchanged (size, tags, layout, device)"
    );
    assert!(
        listed(&mut agent, "").await.is_empty(),
        "ListVolumes after the deletes"
    );
    check_lvm_capacity(&mut agent).await;
    assert!(nvmet_is_empty(), "nvmet state left");
    sc.step(
        "foreign LVs: CreateVolume and ExpandVolume FAILED_PRECONDITION (not pillar's), Export \
         NOT_FOUND, DeleteVolume FAILED_PRECONDITION; both LVs unchanged; ListVolumes empty",
    );

    lab.kmsg.expect_absent(k0, "identifiers changed");
    lab.agent.as_mut().unwrap().stop();
    vg.teardown()
        .expect("remove the volume group and its loop device");
    assert!(lvm(&["vgs", S8_VG]).is_err(), "volume group {S8_VG} left");
    sc.step("agent stopped; volume group, PV and loop device removed");
}
