//! The io_uring engine: one ring, owned by one thread, fed by every concurrent request.
//!
//! Requests arrive on a channel; an eventfd read kept armed in the ring wakes the thread, so it
//! waits in exactly one place (`io_uring_enter`) for both new work and completions. Everything
//! queued since the last wake-up goes into the next submission.
//!
//! - A durable replace is the linked chain `openat (direct descriptor) -> write -> fsync ->
//!   close -> renameat -> fsync(dir)`. A failure anywhere cancels the rest (a short write counts
//!   as a failure), so the rename never installs an incomplete file.
//! - Group commit: when several replaces/removals for one directory arrive in one round, each
//!   gets its chain without the directory fsync, and one fsync of the directory follows once all
//!   chains completed. Every request is answered only after a directory fsync that started after
//!   its own rename completed.
//! - A configfs plan is one linked chain (attribute writes are `openat -> write -> close` on a
//!   direct descriptor), in segments of at most [`MAX_OPS_PER_CHAIN`] operations.
//!
//! All `unsafe` of the engine lives in this module: pushing entries whose pointers must stay
//! valid until completion, and the eventfd syscalls.

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use io_uring::squeue::{Entry, Flags};
use io_uring::types::{DestinationSlot, Fd, Fixed};
use io_uring::{IoUring, opcode};
use pillar_nvmet::{ApplyError, Op};
use tokio::sync::oneshot;

use super::{
    BatchObserver, DurableDir, DurableStep, EngineError, EngineStats, FaultInjection, c_path,
    temp_name,
};

/// Submission queue size.
const RING_ENTRIES: u32 = 256;
/// Direct-descriptor slots: one per request in flight that opens a file.
const FILE_SLOTS: u32 = 64;
/// configfs operations per linked chain (an attribute write takes three entries).
pub const MAX_OPS_PER_CHAIN: usize = 64;
/// user_data of the eventfd read.
const WAKE: u64 = u64::MAX;

/// Options of the io_uring engine.
#[derive(Clone, Default)]
pub struct UringConfig {
    fault: FaultInjection,
    batch_observer: Option<BatchObserver>,
}

impl UringConfig {
    /// Reports each submission's size to `observer`.
    #[must_use]
    pub fn with_batch_observer(mut self, observer: BatchObserver) -> Self {
        self.batch_observer = Some(observer);
        self
    }

    /// Fails one step of every durable operation (crash-safety tests).
    #[cfg(feature = "fault-injection")]
    #[must_use]
    pub fn with_fault(mut self, fault: FaultInjection) -> Self {
        self.fault = fault;
        self
    }
}

impl std::fmt::Debug for UringConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringConfig")
            .field("fault", &self.fault)
            .finish_non_exhaustive()
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct UringEngine {
    tx: Mutex<Option<Sender<Job>>>,
    wake: Arc<OwnedFd>,
    stats: Arc<EngineStats>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

enum Work {
    Replace {
        dir: Arc<DurableDir>,
        tmp: CString,
        name: CString,
        data: Vec<u8>,
        path: PathBuf,
    },
    Remove {
        dir: Arc<DurableDir>,
        name: CString,
        path: PathBuf,
    },
    Configfs {
        root: Arc<DurableDir>,
        ops: Vec<Op>,
        paths: Vec<CString>,
        targets: Vec<Option<CString>>,
        next: usize,
    },
}

struct Job {
    work: Work,
    reply: oneshot::Sender<Result<(), EngineError>>,
}

mod probe;

impl UringEngine {
    /// Creates the restricted ring (see [`probe`]: opcodes probed, direct-descriptor table
    /// registered, only the engine's opcodes and flags allowed) and starts the ring thread. A clear [`EngineError::Unavailable`] when io_uring cannot be used.
    pub fn start(config: UringConfig) -> Result<Self, EngineError> {
        let probe::RingSetup { ring, skip_success } =
            probe::restricted_ring(RING_ENTRIES, FILE_SLOTS)?;
        // SAFETY: eventfd(2) with valid flags returns a new descriptor or -1; nothing else is
        // touched.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(probe::unavailable("eventfd", &io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let stats = Arc::new(EngineStats::default());
        let (tx, rx) = mpsc::channel();
        let mut thread = RingThread {
            ring,
            rx,
            wake_fd: Arc::clone(&wake),
            wake_buf: Box::new(0),
            wake_armed: false,
            disconnected: false,
            free_slots: (0..FILE_SLOTS).rev().collect(),
            waiting: VecDeque::new(),
            flights: HashMap::new(),
            groups: HashMap::new(),
            cleanups: HashMap::new(),
            pending_replies: HashMap::new(),
            next_id: 1,
            stats: Arc::clone(&stats),
            config,
            skip_success,
        };
        let handle = std::thread::Builder::new()
            .name("pillar-uring".into())
            .spawn(move || thread.run())
            .map_err(|e| probe::unavailable("spawning the ring thread", &e))?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            wake,
            stats,
            thread: Mutex::new(Some(handle)),
        })
    }

    pub(super) fn stats(&self) -> &EngineStats {
        &self.stats
    }

    async fn submit(&self, work: Work) -> Result<(), EngineError> {
        let (reply, rx) = oneshot::channel();
        {
            let guard = self.tx.lock().map_err(|_| EngineError::Stopped)?;
            let tx = guard.as_ref().ok_or(EngineError::Stopped)?;
            tx.send(Job { work, reply })
                .map_err(|_| EngineError::Stopped)?;
        }
        wake(self.wake.as_raw_fd());
        rx.await.map_err(|_| EngineError::Stopped)?
    }

    pub(super) async fn replace_file(
        &self,
        dir: &Arc<DurableDir>,
        name: &str,
        data: Vec<u8>,
    ) -> Result<(), EngineError> {
        let path = dir.path().join(name);
        if u32::try_from(data.len()).is_err() {
            return Err(EngineError::Step {
                step: DurableStep::Write,
                path,
                source: io::Error::from_raw_os_error(libc::EFBIG),
            });
        }
        let work = Work::Replace {
            dir: Arc::clone(dir),
            tmp: c_path(temp_name(name).as_ref())?,
            name: c_path(name.as_ref())?,
            data,
            path,
        };
        self.submit(work).await
    }

    pub(super) async fn remove_file(
        &self,
        dir: &Arc<DurableDir>,
        name: &str,
    ) -> Result<(), EngineError> {
        let work = Work::Remove {
            dir: Arc::clone(dir),
            name: c_path(name.as_ref())?,
            path: dir.path().join(name),
        };
        self.submit(work).await
    }

    pub(super) async fn apply_configfs(
        &self,
        root: &Arc<DurableDir>,
        ops: Vec<Op>,
    ) -> Result<(), EngineError> {
        let paths = ops
            .iter()
            .map(|op| c_path(op.path()))
            .collect::<Result<Vec<_>, _>>()?;
        let targets = ops
            .iter()
            .map(|op| match op {
                // Absolute: the kernel resolves configfs link targets itself.
                Op::Symlink { target, .. } => c_path(&root.path().join(target)).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.submit(Work::Configfs {
            root: Arc::clone(root),
            ops,
            paths,
            targets,
            next: 0,
        })
        .await
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        wake(self.wake.as_raw_fd());
        if let Some(handle) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = handle.join();
        }
    }
}

fn wake(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64 to an eventfd we own; a failure (counter
    // overflow) still leaves the ring thread woken.
    unsafe { libc::write(fd, (&raw const one).cast(), 8) };
}

/// What one entry of a flight's current chain does.
#[derive(Clone, Copy, Debug)]
enum Step {
    Durable(DurableStep),
    /// Part of configfs operation `op` (index into the job's ops); `part` distinguishes the
    /// open/write/close of an attribute write.
    Cfg {
        op: usize,
        part: CfgPart,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CfgPart {
    Open,
    Write,
    Close,
    Single,
}

struct Flight {
    job: Job,
    steps: Vec<Step>,
    results: Vec<Option<i32>>,
    /// Expected byte counts of write steps, by step index.
    write_len: Vec<Option<u32>>,
    /// Whether the chain's last entry has completed.
    last_done: bool,
    /// Steps hard-linked to the next one (a failure there does not cancel the rest).
    hard: Vec<bool>,
    slot: Option<u32>,
    group: Option<u64>,
}

struct Group {
    dir: Arc<DurableDir>,
    members: Vec<u64>,
    /// Members whose chains completed: their result so far.
    finished: Vec<(u64, Result<(), EngineError>)>,
}

struct RingThread {
    ring: IoUring,
    rx: Receiver<Job>,
    wake_fd: Arc<OwnedFd>,
    wake_buf: Box<u64>,
    wake_armed: bool,
    disconnected: bool,
    free_slots: Vec<u32>,
    waiting: VecDeque<Job>,
    flights: HashMap<u64, Flight>,
    groups: HashMap<u64, Group>,
    /// Close entries for direct descriptors left open by a failed chain: id -> slot.
    cleanups: HashMap<u64, u32>,
    /// Replies of group members whose chains completed, held until the shared fsync completes.
    pending_replies: HashMap<u64, Job>,
    next_id: u64,
    stats: Arc<EngineStats>,
    config: UringConfig,
    /// The kernel can skip completions of successful entries (Linux 5.17+).
    skip_success: bool,
}

fn user_data(id: u64, step: usize) -> u64 {
    (id << 16) | (step as u64 & 0xFFFF)
}

fn cqe_errno(res: i32) -> io::Error {
    io::Error::from_raw_os_error(-res)
}

impl RingThread {
    fn run(&mut self) {
        loop {
            self.take_new_jobs();
            self.start_waiting_jobs();
            let idle = self.flights.is_empty()
                && self.groups.is_empty()
                && self.cleanups.is_empty()
                && self.waiting.is_empty();
            if self.disconnected && idle {
                return;
            }
            if !self.disconnected && !self.wake_armed {
                self.arm_wake();
            }
            if let Err(e) = self.submit_and_wait() {
                tracing::error!(error = %e, "io_uring_enter failed; failing every request in flight");
                self.fail_everything(&e);
                return;
            }
            self.reap();
        }
    }

    fn take_new_jobs(&mut self) {
        loop {
            match self.rx.try_recv() {
                Ok(job) => self.waiting.push_back(job),
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    self.disconnected = true;
                    return;
                }
            }
        }
    }

    fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id = (self.next_id + 1) & 0x0000_FFFF_FFFF_FFFF;
        if self.next_id == 0 {
            self.next_id = 1;
        }
        id
    }

    /// Starts every waiting job that can get a descriptor slot. Durable jobs started in this
    /// round for the same directory form one group-commit group.
    fn start_waiting_jobs(&mut self) {
        let mut durable: HashMap<RawFd, Vec<Job>> = HashMap::new();
        let mut still_waiting = VecDeque::new();
        while let Some(job) = self.waiting.pop_front() {
            match &job.work {
                Work::Replace { dir, .. } | Work::Remove { dir, .. } => {
                    durable.entry(dir.raw_fd()).or_default().push(job)
                }
                Work::Configfs { .. } => {
                    if let Some(slot) = self.free_slots.pop() {
                        let id = self.next_id();
                        self.start_configfs_segment(id, job, slot);
                    } else {
                        still_waiting.push_back(job);
                    }
                }
            }
        }
        for (_, jobs) in durable {
            let solo = jobs.len() == 1;
            let group_id = (!solo).then(|| self.next_id());
            let mut members = Vec::new();
            let mut dir = None;
            for job in jobs {
                let needs_slot = matches!(job.work, Work::Replace { .. });
                let slot = if needs_slot {
                    match self.free_slots.pop() {
                        Some(s) => Some(s),
                        None => {
                            still_waiting.push_back(job);
                            continue;
                        }
                    }
                } else {
                    None
                };
                if let Work::Replace { dir: d, .. } | Work::Remove { dir: d, .. } = &job.work {
                    dir = Some(Arc::clone(d));
                }
                let id = self.next_id();
                members.push(id);
                self.start_durable(id, job, slot, group_id);
            }
            if let (Some(gid), Some(dir)) = (group_id, dir) {
                if members.is_empty() {
                    continue;
                }
                self.groups.insert(
                    gid,
                    Group {
                        dir,
                        members,
                        finished: Vec::new(),
                    },
                );
            }
        }
        self.waiting = still_waiting;
    }

    /// Sets user data and links on a chain: every entry but the last is linked to the next one
    /// (`links[i]`) and, where the kernel supports it, posts no completion on success, so a
    /// successful chain wakes the ring thread once.
    fn seal_chain(&self, id: u64, entries: Vec<Entry>, links: &[Flags]) -> Vec<Entry> {
        let n = entries.len();
        entries
            .into_iter()
            .enumerate()
            .map(|(i, e)| {
                let e = e.user_data(user_data(id, i));
                if i + 1 < n {
                    let skip = if self.skip_success {
                        Flags::SKIP_SUCCESS
                    } else {
                        Flags::empty()
                    };
                    e.flags(links.get(i).copied().unwrap_or(Flags::IO_LINK) | skip)
                } else {
                    e
                }
            })
            .collect()
    }

    fn fail_step(&self, step: DurableStep, entry: Entry) -> Entry {
        if self.config.fault.fail_at == Some(step) {
            // An always-failing entry (EBADF) in place of the real one: the chain behaves as if
            // this step failed.
            opcode::Close::new(Fd(-1)).build()
        } else {
            entry
        }
    }

    fn start_durable(&mut self, id: u64, job: Job, slot: Option<u32>, group: Option<u64>) {
        let mut entries = Vec::with_capacity(6);
        let mut steps = Vec::with_capacity(6);
        let mut write_len = Vec::with_capacity(6);
        // How each entry is linked to the next one (ignored for the last).
        let mut links = Vec::with_capacity(6);
        match &job.work {
            Work::Replace {
                dir,
                tmp,
                name,
                data,
                ..
            } => {
                let Some(slot) = slot else { return };
                let Ok(dest) = DestinationSlot::try_from_slot_target(slot) else {
                    return;
                };
                // replace_file refuses data over 4 GiB, so this never saturates.
                let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
                let dirfd = Fd(dir.raw_fd());
                // No O_CLOEXEC: the kernel refuses it for direct descriptors (they are never
                // in the process's fd table, so there is nothing to leak across exec).
                let chain = [
                    (
                        DurableStep::Open,
                        opcode::OpenAt::new(dirfd, tmp.as_ptr())
                            .flags(libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC)
                            .mode(0o600)
                            .file_index(Some(dest))
                            .build(),
                    ),
                    (
                        DurableStep::Write,
                        opcode::Write::new(Fixed(slot), data.as_ptr(), len)
                            .offset(0)
                            .build(),
                    ),
                    (DurableStep::Fsync, opcode::Fsync::new(Fixed(slot)).build()),
                    (DurableStep::Close, opcode::Close::new(Fixed(slot)).build()),
                    (
                        DurableStep::Rename,
                        opcode::RenameAt::new(dirfd, tmp.as_ptr(), dirfd, name.as_ptr()).build(),
                    ),
                ];
                for (step, entry) in chain {
                    entries.push(self.fail_step(step, entry));
                    links.push(Flags::IO_LINK);
                    steps.push(Step::Durable(step));
                    write_len.push((step == DurableStep::Write).then_some(len));
                }
                if group.is_none() {
                    entries.push(
                        self.fail_step(DurableStep::FsyncDir, opcode::Fsync::new(dirfd).build()),
                    );
                    links.push(Flags::empty());
                    steps.push(Step::Durable(DurableStep::FsyncDir));
                    write_len.push(None);
                }
            }
            Work::Remove { dir, name, .. } => {
                let dirfd = Fd(dir.raw_fd());
                // Hard link: the directory fsync runs even when the file was already gone, so a
                // removal that an earlier crash left non-durable becomes durable.
                entries.push(opcode::UnlinkAt::new(dirfd, name.as_ptr()).build());
                links.push(Flags::IO_HARDLINK);
                steps.push(Step::Durable(DurableStep::Unlink));
                write_len.push(None);
                if group.is_none() {
                    entries.push(
                        self.fail_step(DurableStep::FsyncDir, opcode::Fsync::new(dirfd).build()),
                    );
                    links.push(Flags::empty());
                    steps.push(Step::Durable(DurableStep::FsyncDir));
                    write_len.push(None);
                }
            }
            Work::Configfs { .. } => return,
        }
        let hard: Vec<bool> = links
            .iter()
            .map(|l| l.contains(Flags::IO_HARDLINK))
            .collect();
        let entries = self.seal_chain(id, entries, &links);
        let n = entries.len();
        self.flights.insert(
            id,
            Flight {
                job,
                steps,
                results: vec![None; n],
                write_len,
                last_done: false,
                hard,
                slot,
                group,
            },
        );
        self.push(&entries);
    }

    fn start_configfs_segment(&mut self, id: u64, job: Job, slot: u32) {
        let Work::Configfs {
            root,
            ops,
            paths,
            targets,
            next,
        } = &job.work
        else {
            return;
        };
        let Ok(dest) = DestinationSlot::try_from_slot_target(slot) else {
            return;
        };
        let rootfd = Fd(root.raw_fd());
        let end = (*next + MAX_OPS_PER_CHAIN).min(ops.len());
        let mut entries = Vec::new();
        let mut steps = Vec::new();
        let mut write_len = Vec::new();
        for i in *next..end {
            let path = paths[i].as_ptr();
            match &ops[i] {
                Op::Mkdir { .. } => {
                    entries.push(opcode::MkDirAt::new(rootfd, path).mode(0o755).build());
                    steps.push(Step::Cfg {
                        op: i,
                        part: CfgPart::Single,
                    });
                    write_len.push(None);
                }
                Op::Write { value, .. } => {
                    let len = u32::try_from(value.len()).unwrap_or(u32::MAX);
                    entries.push(
                        opcode::OpenAt::new(rootfd, path)
                            .flags(libc::O_WRONLY)
                            .file_index(Some(dest))
                            .build(),
                    );
                    entries.push(
                        opcode::Write::new(Fixed(slot), value.as_ptr(), len)
                            .offset(0)
                            .build(),
                    );
                    entries.push(opcode::Close::new(Fixed(slot)).build());
                    for (part, wl) in [
                        (CfgPart::Open, None),
                        (CfgPart::Write, Some(len)),
                        (CfgPart::Close, None),
                    ] {
                        steps.push(Step::Cfg { op: i, part });
                        write_len.push(wl);
                    }
                }
                Op::Symlink { .. } => {
                    let target = targets[i].as_ref().map_or(std::ptr::null(), |t| t.as_ptr());
                    entries.push(opcode::SymlinkAt::new(rootfd, target, path).build());
                    steps.push(Step::Cfg {
                        op: i,
                        part: CfgPart::Single,
                    });
                    write_len.push(None);
                }
                Op::Unlink { .. } => {
                    entries.push(opcode::UnlinkAt::new(rootfd, path).build());
                    steps.push(Step::Cfg {
                        op: i,
                        part: CfgPart::Single,
                    });
                    write_len.push(None);
                }
                Op::Rmdir { .. } => {
                    entries.push(
                        opcode::UnlinkAt::new(rootfd, path)
                            .flags(libc::AT_REMOVEDIR)
                            .build(),
                    );
                    steps.push(Step::Cfg {
                        op: i,
                        part: CfgPart::Single,
                    });
                    write_len.push(None);
                }
            }
        }
        let links = vec![Flags::IO_LINK; entries.len()];
        let hard: Vec<bool> = links
            .iter()
            .map(|l| l.contains(Flags::IO_HARDLINK))
            .collect();
        let entries = self.seal_chain(id, entries, &links);
        let n = entries.len();
        self.flights.insert(
            id,
            Flight {
                job,
                steps,
                results: vec![None; n],
                write_len,
                last_done: false,
                hard,
                slot: Some(slot),
                group: None,
            },
        );
        self.push(&entries);
    }

    /// Pushes a whole chain, flushing the submission queue first if it is full.
    fn push(&mut self, entries: &[Entry]) {
        loop {
            // SAFETY: every pointer in `entries` (paths, data, the eventfd buffer) points into a
            // heap allocation owned by a job stored in `self.flights` (or `self.wake_buf`), which
            // is neither moved nor dropped until all of that job's completions were reaped.
            let pushed = unsafe { self.ring.submission().push_multiple(entries) };
            if pushed.is_ok() {
                EngineStats::add(&self.stats.sqes, entries.len() as u64);
                return;
            }
            if let Err(e) = self.submit_only() {
                tracing::error!(error = %e, "io_uring submit failed while the queue was full");
                return;
            }
        }
    }

    fn arm_wake(&mut self) {
        let buf: *mut u64 = &raw mut *self.wake_buf;
        let entry = opcode::Read::new(Fd(self.wake_fd.as_raw_fd()), buf.cast(), 8)
            .build()
            .user_data(WAKE);
        // SAFETY: `wake_buf` is a Box owned by this thread for its whole life, and at most one
        // read into it is in flight (`wake_armed`).
        if unsafe { self.ring.submission().push(&entry) }.is_ok() {
            self.wake_armed = true;
        }
    }

    fn observe_batch(&self, submitted: usize) {
        if submitted > 0 {
            EngineStats::add(&self.stats.submissions, 1);
            if let Some(observer) = &self.config.batch_observer {
                observer(submitted as u64);
            }
        }
    }

    fn submit_only(&mut self) -> io::Result<()> {
        let n = self.ring.submit()?;
        self.observe_batch(n);
        Ok(())
    }

    fn submit_and_wait(&mut self) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(n) => {
                    self.observe_batch(n);
                    return Ok(());
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // The completion queue is full: reap, then try again.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    fn reap(&mut self) {
        let completions: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (data, res) in completions {
            if data == WAKE {
                self.wake_armed = false;
                continue;
            }
            let id = data >> 16;
            let step = usize::try_from(data & 0xFFFF).unwrap_or(usize::MAX);
            if let Some(slot) = self.cleanups.remove(&id) {
                self.free_slots.push(slot);
                continue;
            }
            if let Some(group) = self.groups.remove(&id) {
                self.finish_group(group, res);
                continue;
            }
            let done = match self.flights.get_mut(&id) {
                Some(f) => {
                    if let Some(r) = f.results.get_mut(step) {
                        *r = Some(res);
                    }
                    if step + 1 == f.results.len() {
                        f.last_done = true;
                    }
                    Self::finished(f, self.skip_success)
                }
                None => false,
            };
            if done && let Some(flight) = self.flights.remove(&id) {
                self.finish_flight(id, flight);
            }
        }
    }

    /// The first failed step of a chain: its index and error. A step without a completion
    /// succeeded (its completion was skipped) or was cancelled after this failure.
    fn first_failure(flight: &Flight) -> Option<(usize, io::Error)> {
        for (i, res) in flight.results.iter().enumerate() {
            let Some(res) = *res else { continue };
            if res == -libc::ECANCELED {
                continue;
            }
            if res < 0 {
                return Some((i, cqe_errno(res)));
            }
            if let Some(Some(len)) = flight.write_len.get(i)
                && u32::try_from(res).ok() != Some(*len)
            {
                let msg = format!("short write: {res} of {len} bytes");
                return Some((i, io::Error::new(io::ErrorKind::WriteZero, msg)));
            }
        }
        None
    }

    /// Whether a chain is complete. Its last entry always completes unless an earlier entry
    /// failed: with skipped success completions, the kernel then also skips the cancellations of
    /// the entries after it (`REQ_F_SKIP_LINK_CQES`), so the failure itself ends the chain
    /// (unless it was hard-linked, when the rest still runs).
    fn finished(flight: &Flight, skip_success: bool) -> bool {
        if flight.last_done {
            let last = flight.results.last().copied().flatten();
            // A cancelled last entry means an earlier failure; wait to have seen it.
            return last != Some(-libc::ECANCELED) || Self::first_failure(flight).is_some();
        }
        skip_success
            && Self::first_failure(flight)
                .is_some_and(|(i, _)| !flight.hard.get(i).copied().unwrap_or(false))
    }

    /// Whether the chain left the direct descriptor installed (opened, never closed). Steps
    /// before the first failure succeeded; the failed one and those after it did not run.
    fn slot_left_open(flight: &Flight) -> bool {
        let failed_at = Self::first_failure(flight).map_or(usize::MAX, |(i, _)| i);
        let mut open = false;
        for (i, (step, res)) in flight.steps.iter().zip(&flight.results).enumerate() {
            let ok = i < failed_at && res.is_none_or(|r| r >= 0);
            match step {
                Step::Durable(DurableStep::Open)
                | Step::Cfg {
                    part: CfgPart::Open,
                    ..
                } if ok => open = true,
                Step::Durable(DurableStep::Close)
                | Step::Cfg {
                    part: CfgPart::Close,
                    ..
                } if ok => open = false,
                _ => {}
            }
        }
        open
    }

    fn release_slot(&mut self, flight: &Flight) {
        let Some(slot) = flight.slot else { return };
        if Self::slot_left_open(flight) {
            let id = self.next_id();
            self.cleanups.insert(id, slot);
            let entry = opcode::Close::new(Fixed(slot))
                .build()
                .user_data(user_data(id, 0));
            self.push(&[entry]);
        } else {
            self.free_slots.push(slot);
        }
    }

    fn finish_flight(&mut self, id: u64, mut flight: Flight) {
        let failure = Self::first_failure(&flight);
        match &mut flight.job.work {
            Work::Configfs { ops, next, .. } => {
                let result = match failure {
                    Some((i, source)) => {
                        let Step::Cfg { op, .. } = flight.steps[i] else {
                            return;
                        };
                        Err(EngineError::Configfs(ApplyError {
                            index: op,
                            op: ops[op].clone(),
                            source,
                        }))
                    }
                    None => Ok(()),
                };
                let end = (*next + MAX_OPS_PER_CHAIN).min(ops.len());
                if result.is_ok() && end < ops.len() {
                    // Next segment: same job, same slot (the chain closed it).
                    *next = end;
                    let slot = flight.slot;
                    if let Some(slot) = slot
                        && !Self::slot_left_open(&flight)
                    {
                        self.start_configfs_segment(id, flight.job, slot);
                        return;
                    }
                }
                self.release_slot(&flight);
                if result.is_ok() {
                    EngineStats::add(&self.stats.configfs_plans, 1);
                }
                let _ = flight.job.reply.send(result);
            }
            Work::Replace { path, .. } | Work::Remove { path, .. } => {
                let path = path.clone();
                let unlink_absent = |f: &Flight| {
                    matches!(f.steps.first(), Some(Step::Durable(DurableStep::Unlink)))
                        && f.results.first().copied().flatten() == Some(-libc::ENOENT)
                };
                let result = match failure {
                    None => Ok(()),
                    // Removing a file that is already gone is success once the directory is
                    // synced (the hard-linked fsync still ran).
                    Some((0, _)) if unlink_absent(&flight) => {
                        match flight.results.get(1).copied().flatten() {
                            Some(r) if r < 0 => Err(EngineError::Step {
                                step: DurableStep::FsyncDir,
                                path: path.clone(),
                                source: cqe_errno(r),
                            }),
                            _ => Ok(()),
                        }
                    }
                    Some((i, source)) => {
                        let Step::Durable(step) = flight.steps[i] else {
                            return;
                        };
                        Err(EngineError::Step {
                            step,
                            path: path.clone(),
                            source,
                        })
                    }
                };
                self.release_slot(&flight);
                match flight.group {
                    None => {
                        if result.is_ok() {
                            EngineStats::add(&self.stats.durable_ops, 1);
                            EngineStats::add(&self.stats.dir_fsyncs, 1);
                        }
                        let _ = flight.job.reply.send(result);
                    }
                    Some(gid) => self.member_done(gid, id, flight.job, result),
                }
            }
        }
    }

    fn member_done(&mut self, gid: u64, id: u64, job: Job, result: Result<(), EngineError>) {
        // Keep the reply channel with the group until the shared fsync completes.
        self.pending_replies.insert(id, job);
        let ready = match self.groups.get_mut(&gid) {
            Some(group) => {
                group.finished.push((id, result));
                group.finished.len() == group.members.len()
            }
            None => false,
        };
        if ready && let Some(group) = self.groups.get(&gid) {
            let fsync = opcode::Fsync::new(Fd(group.dir.raw_fd())).build();
            let entry = self
                .fail_step(DurableStep::FsyncDir, fsync)
                .user_data(user_data(gid, 0));
            self.push(&[entry]);
        }
    }

    fn finish_group(&mut self, group: Group, res: i32) {
        EngineStats::add(&self.stats.dir_fsyncs, 1);
        for (id, result) in group.finished {
            let Some(job) = self.pending_replies.remove(&id) else {
                continue;
            };
            let path = match &job.work {
                Work::Replace { path, .. } | Work::Remove { path, .. } => path.clone(),
                Work::Configfs { .. } => PathBuf::new(),
            };
            let result = result.and_then(|()| {
                if res < 0 {
                    Err(EngineError::Step {
                        step: DurableStep::FsyncDir,
                        path,
                        source: cqe_errno(res),
                    })
                } else {
                    Ok(())
                }
            });
            if result.is_ok() {
                EngineStats::add(&self.stats.durable_ops, 1);
            }
            let _ = job.reply.send(result);
        }
    }

    fn fail_everything(&mut self, e: &io::Error) {
        let reason = format!("io_uring_enter failed: {e}");
        let jobs: Vec<Job> = self
            .flights
            .drain()
            .map(|(_, f)| f.job)
            .chain(self.pending_replies.drain().map(|(_, j)| j))
            .chain(self.waiting.drain(..))
            .collect();
        for job in jobs {
            let _ = job.reply.send(Err(EngineError::Unavailable {
                reason: reason.clone(),
            }));
        }
    }
}
