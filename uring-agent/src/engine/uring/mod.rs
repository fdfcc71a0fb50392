//! The io_uring engine: one ring, owned by one thread, fed by every concurrent request.
//!
//! Requests arrive on a channel; an eventfd read kept armed in the ring wakes the thread, so it
//! waits in exactly one place (`io_uring_enter`) for both new work and completions. Everything
//! queued since the last wake-up goes into the next submission. A request writes the eventfd
//! only when the thread is about to block or blocked ([`Sleep`]); an awake thread finds it on
//! the channel before it blocks, so a busy engine makes no wake-up syscalls.
//!
//! - A durable replace is two linked chains on a direct descriptor: `openat (its own temp file)
//!   -> write -> fsync -> close`, then, once all of that succeeded, `renameat -> fsync(dir)`. A
//!   failure anywhere stops it before the rename (a short write counts as a failure), so the
//!   rename never installs an incomplete or unsynced file; the temp file is then removed. Two
//!   chains because the kernel does not cancel linked entries after a failed fsync (see
//!   `chain`).
//! - Group commit: when several replaces/removals for one directory arrive in one round, each
//!   gets its chains without the directory fsync, and one fsync of the directory follows once all
//!   of them completed. Every request is answered only after a directory fsync that started after
//!   its own rename completed.
//! - A configfs plan runs as linked chains (attribute writes are `openat -> write -> close` on a
//!   direct descriptor) of at most [`MAX_OPS_PER_CHAIN`] operations, each ending after its first
//!   mkdir, symlink, unlink or rmdir, so the plan stops at its first failure. On a double's tree
//!   ([`ConfigfsRoot::ruled`]) each operation is a chain of its own: the ring thread has the
//!   rules admit it before its chain is pushed (a refusal ends the plan there, as the kernel's
//!   errno on that syscall would) and complete it once its chain succeeded.
//! - A push the kernel refuses is never dropped: a busy queue (`EBUSY`/`EAGAIN`) waits for the
//!   next round, any other error answers the request with [`EngineError::Submit`].
//! - Bounded: the engine holds at most [`MAX_QUEUED`] requests (sent and not yet answered,
//!   counted by each request's `admission::Permit`, which goes with its reply); one more is
//!   refused at once with [`EngineError::QueueFull`], before anything of it is sent.
//!
//! The modules, by concept:
//! - `probe`: the ring is created disabled, its opcodes probed, then restricted to exactly the
//!   opcodes and SQE flags the engine uses, and enabled.
//! - `job`: requests as the ring thread receives them (durable and configfs are separate types).
//! - `chain`: pure chain builders (entries, their steps, link flags), and which opcodes' failures
//!   cancel a chain.
//! - `flight`: pure bookkeeping (user data, chain completions, slots); `group`: group commit.
//! - `admission`: the bound on the requests held.
//! - `queue`: pushes and submits, and the eventfd. With one push in `ring`, the only `unsafe`.
//! - `ring`: the ring thread's loop.

mod admission;
mod chain;
mod flight;
mod group;
mod job;
mod probe;
mod queue;
mod ring;

use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use pillar_nvmet::Op;
use tokio::sync::oneshot;

#[cfg(any(test, feature = "test-seams"))]
pub use chain::MAX_OPS_PER_CHAIN;
#[cfg(any(test, feature = "test-seams"))]
pub use chain::replace_steps;

use super::{BatchObserver, ConfigfsRoot, DurableDir, EngineError, EngineStats, FaultInjection};
use admission::Admission;
use chain::ChainOptions;
use flight::SlotPool;
use job::{ConfigfsJob, DurableJob, DurableKind, Job, Reply, prepare_plan};
use queue::{EventFd, Queue};
use ring::RingThread;

/// Submission queue size.
const RING_ENTRIES: u32 = 256;
/// Direct-descriptor slots: one per request in flight that opens a file.
const FILE_SLOTS: u32 = 64;
/// How many requests the engine holds at once by default (sent to the ring thread and not yet
/// answered); one more is refused with [`EngineError::QueueFull`]. Far above what the agent
/// sends in normal work (a resync applies 64 exports at once, each request waits for its own
/// answer before its next), so only an overload meets it; each held request is a few hundred
/// bytes to a few KiB (paths, a mark, a configfs plan).
pub const MAX_QUEUED: usize = 4096;

/// Options of the io_uring engine.
#[derive(Clone)]
pub struct UringConfig {
    fault: FaultInjection,
    batch_observer: Option<BatchObserver>,
    queue_limit: usize,
    intake: Option<Arc<IntakeGate>>,
    #[cfg(feature = "fault-injection")]
    submit_failures: Option<queue::SubmitFailures>,
}

impl Default for UringConfig {
    fn default() -> Self {
        Self {
            fault: FaultInjection::default(),
            batch_observer: None,
            queue_limit: MAX_QUEUED,
            intake: None,
            #[cfg(feature = "fault-injection")]
            submit_failures: None,
        }
    }
}

/// A gate the ring thread waits at before it takes its first request, until opened: a test
/// fills the engine's queue while nothing drains it.
#[derive(Debug, Default)]
pub struct IntakeGate {
    open: Mutex<bool>,
    changed: Condvar,
}

impl IntakeGate {
    /// Lets the ring thread go on.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn open(&self) {
        *self.open.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.changed.notify_all();
    }

    fn wait(&self) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        while !*open {
            open = self
                .changed
                .wait(open)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl UringConfig {
    /// Holds at most `limit` requests at once (at least 1); [`MAX_QUEUED`] by default.
    #[must_use]
    #[cfg(any(test, feature = "test-seams"))]
    pub fn with_queue_limit(mut self, limit: usize) -> Self {
        self.queue_limit = limit.max(1);
        self
    }

    /// The ring thread takes no request until `gate` is opened (tests of the bound).
    #[cfg(feature = "fault-injection")]
    #[must_use]
    pub fn with_intake_gate(mut self, gate: Arc<IntakeGate>) -> Self {
        self.intake = Some(gate);
        self
    }

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

    /// Makes the next `times` pushes of entries fail as if the submission queue were full and
    /// the submit that makes room failed with `errno` (tests of the push error path: `EBUSY`
    /// and `EAGAIN` are retried after reaping, any other errno is the caller's error).
    #[cfg(feature = "fault-injection")]
    #[must_use]
    pub fn with_failing_submits(mut self, errno: i32, times: u32) -> Self {
        self.submit_failures = Some(queue::SubmitFailures { errno, times });
        self
    }
}

impl std::fmt::Debug for UringConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringConfig")
            .field("fault", &self.fault)
            .field("queue_limit", &self.queue_limit)
            .finish_non_exhaustive()
    }
}

/// Whether the ring thread may block in `io_uring_enter` without looking at the channel again.
///
/// The handshake (a store, a full fence, then a load, on both sides) makes a lost wake-up
/// impossible: the ring thread sets the flag, fences, and looks at the channel once more before
/// it blocks; a request is sent on the channel, fenced, and the flag read (and cleared). Of two
/// such sequences at least one sees the other's store: either the thread finds the request,
/// or the request finds the flag set and writes the eventfd.
#[derive(Debug, Default)]
pub(super) struct Sleep(AtomicBool);

impl Sleep {
    /// The ring thread, before its last look at the channel.
    pub(super) fn about_to_block(&self) {
        self.0.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// The ring thread, awake again.
    pub(super) fn awake(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    /// A requesting thread, after sending: whether it must wake the ring thread.
    fn must_wake(&self) -> bool {
        fence(Ordering::SeqCst);
        self.0.swap(false, Ordering::SeqCst)
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct UringEngine {
    tx: Mutex<Option<Sender<Job>>>,
    admission: Arc<Admission>,
    wake: Arc<EventFd>,
    sleep: Arc<Sleep>,
    stats: Arc<EngineStats>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl UringEngine {
    /// Creates the restricted ring (see `probe`: opcodes probed, direct-descriptor table
    /// registered, only the engine's opcodes and flags allowed) and starts the ring thread. A
    /// clear [`EngineError::Unavailable`] when io_uring cannot be used.
    pub fn start(config: UringConfig) -> Result<Self, EngineError> {
        let setup = probe::restricted_ring(RING_ENTRIES, FILE_SLOTS)?;
        let wake = Arc::new(EventFd::new().map_err(|e| probe::unavailable("eventfd", &e))?);
        let stats = Arc::new(EngineStats::default());
        let queue = Queue::new(
            setup.ring,
            Arc::clone(&wake),
            Arc::clone(&stats),
            config.batch_observer,
        );
        #[cfg(feature = "fault-injection")]
        let queue = queue.with_submit_failures(config.submit_failures);
        let options = ChainOptions {
            skip_success: setup.skip_success,
            fault: config.fault,
        };
        let (tx, rx) = mpsc::channel();
        let sleep = Arc::new(Sleep::default());
        let thread = RingThread::new(
            queue,
            rx,
            Arc::clone(&sleep),
            SlotPool::new(FILE_SLOTS),
            options,
            Arc::clone(&stats),
        );
        let intake = config.intake;
        let handle = std::thread::Builder::new()
            .name("pillar-uring".into())
            .spawn(move || {
                if let Some(gate) = intake {
                    gate.wait();
                }
                thread.run();
            })
            .map_err(|e| probe::unavailable("spawning the ring thread", &e))?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            admission: Admission::new(config.queue_limit),
            wake,
            sleep,
            stats,
            thread: Mutex::new(Some(handle)),
        })
    }

    #[cfg(any(test, feature = "test-seams"))]
    pub(super) fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Requests the engine holds now (sent to the ring thread and not yet answered).
    #[cfg(any(test, feature = "test-seams"))]
    pub fn queued(&self) -> usize {
        self.admission.held()
    }

    /// Hands the request `job(reply)` to the ring thread and waits for its answer; refused at
    /// once, with nothing sent, when the engine already holds as many requests as its bound.
    async fn submit(&self, job: impl FnOnce(Reply) -> Job) -> Result<(), EngineError> {
        let permit = self.admission.admit()?;
        let (tx, rx) = oneshot::channel();
        let reply = Reply::new(tx, permit);
        {
            let guard = self.tx.lock().map_err(|_| EngineError::Stopped)?;
            let tx = guard.as_ref().ok_or(EngineError::Stopped)?;
            tx.send(job(reply)).map_err(|_| EngineError::Stopped)?;
        }
        if self.sleep.must_wake() {
            EngineStats::add(&self.stats.wakes, 1);
            self.wake.signal();
        }
        rx.await.map_err(|_| EngineError::Stopped)?
    }

    pub(super) async fn replace_file(
        &self,
        dir: &Arc<DurableDir>,
        name: &str,
        data: Vec<u8>,
    ) -> Result<(), EngineError> {
        let path = dir.path().join(name);
        let kind = DurableKind::replace(name, data, &path)?;
        self.submit_durable(dir, path, kind).await
    }

    pub(super) async fn remove_file(
        &self,
        dir: &Arc<DurableDir>,
        name: &str,
    ) -> Result<(), EngineError> {
        let kind = DurableKind::remove(name)?;
        self.submit_durable(dir, dir.path().join(name), kind).await
    }

    async fn submit_durable(
        &self,
        dir: &Arc<DurableDir>,
        path: std::path::PathBuf,
        kind: DurableKind,
    ) -> Result<(), EngineError> {
        self.submit(|reply| {
            Job::Durable(DurableJob {
                dir: Arc::clone(dir),
                path,
                kind,
                reply,
            })
        })
        .await
    }

    pub(super) async fn apply_configfs(
        &self,
        root: &ConfigfsRoot,
        ops: Vec<Op>,
    ) -> Result<(), EngineError> {
        if ops.is_empty() {
            return Ok(());
        }
        let prepared = prepare_plan(&ops, root.dir().path())?;
        self.submit(|reply| {
            Job::Configfs(ConfigfsJob {
                root: Arc::clone(root.dir()),
                rules: root.rules().cloned(),
                admitted: None,
                ops,
                prepared,
                next: 0,
                reply,
            })
        })
        .await
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        self.wake.signal();
        if let Some(handle) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = handle.join();
        }
    }
}
