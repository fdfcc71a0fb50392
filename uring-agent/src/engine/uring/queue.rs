//! The ring's submission and completion queues, and the eventfd that wakes the ring thread.
//!
//! With the one chain push in `ring.rs`, this is where all of the engine's `unsafe` lives:
//! entries pushed here carry pointers the kernel follows until their completions, and the
//! eventfd is two raw syscalls.
//!
//! A push that finds the submission queue full submits what is queued to make room. When that
//! submit fails, the push fails and hands the error back: [`PushError::Busy`] (the kernel asks to
//! reap completions first: retry next round) or [`PushError::Failed`]; the entries were not
//! queued, so the kernel never saw them.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use io_uring::squeue::Entry;
use io_uring::types::{Fd, Fixed};
use io_uring::{IoUring, opcode};

use super::flight::{Slot, WAKE};
use crate::engine::{BatchObserver, EngineStats};

/// The eventfd whose armed read wakes the ring thread.
#[derive(Debug)]
pub(super) struct EventFd(OwnedFd);

impl EventFd {
    pub(super) fn new() -> io::Result<Self> {
        // SAFETY: eventfd(2) with valid flags returns a new descriptor or -1; it touches no
        // memory of ours.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(raw) }))
    }

    /// Wakes the ring thread. A failed write (counter overflow) still leaves it woken.
    pub(super) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes the 8 bytes of a live u64 to a descriptor this value owns.
        unsafe { libc::write(self.0.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// An entry that names only descriptors and points into no memory, so it can be pushed without
/// a promise about memory. Only the constructors below make one.
#[derive(Debug)]
pub(super) struct FdOnly(Entry);

impl FdOnly {
    /// fsync of `fd`.
    pub(super) fn fsync(fd: RawFd) -> Self {
        Self(opcode::Fsync::new(Fd(fd)).build())
    }

    /// Close of the direct descriptor in `slot`.
    pub(super) fn close_slot(slot: &Slot) -> Self {
        Self(opcode::Close::new(Fixed(slot.index())).build())
    }

    /// An entry that always fails (close of descriptor -1: EBADF); fault injection puts it in
    /// place of the step it fails.
    pub(super) fn failing() -> Self {
        Self(opcode::Close::new(Fd(-1)).build())
    }

    #[must_use]
    pub(super) fn user_data(self, user_data: u64) -> Self {
        Self(self.0.user_data(user_data))
    }

    pub(super) fn into_entry(self) -> Entry {
        self.0
    }
}

/// Why a push failed. The entries were not queued.
#[derive(Debug)]
pub(super) enum PushError {
    /// The queue was full and the kernel could not take more yet (`EBUSY`/`EAGAIN`): reap
    /// completions, then push again.
    Busy,
    /// The queue was full and submitting failed otherwise.
    Failed(io::Error),
}

impl PushError {
    fn from_submit(e: io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::EBUSY | libc::EAGAIN) => Self::Busy,
            _ => Self::Failed(e),
        }
    }
}

/// Test hook (`fault-injection` feature): the next `times` pushes fail as if the queue were
/// full and the submit that makes room failed with `errno`.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug)]
pub(super) struct SubmitFailures {
    pub errno: i32,
    pub times: u32,
}

/// The ring, with the wake-up read and the submission counters.
pub(super) struct Queue {
    ring: IoUring,
    wake: Arc<EventFd>,
    /// Where the armed eventfd read writes. `None` only after it was leaked (see `Drop`).
    wake_buf: Option<Box<u64>>,
    wake_armed: bool,
    stats: Arc<EngineStats>,
    observer: Option<BatchObserver>,
    #[cfg(feature = "fault-injection")]
    submit_failures: Option<SubmitFailures>,
}

impl Queue {
    pub(super) fn new(
        ring: IoUring,
        wake: Arc<EventFd>,
        stats: Arc<EngineStats>,
        observer: Option<BatchObserver>,
    ) -> Self {
        Self {
            ring,
            wake,
            wake_buf: Some(Box::new(0)),
            wake_armed: false,
            stats,
            observer,
            #[cfg(feature = "fault-injection")]
            submit_failures: None,
        }
    }

    /// Makes the next pushes fail (tests).
    #[cfg(feature = "fault-injection")]
    pub(super) fn with_submit_failures(mut self, failures: Option<SubmitFailures>) -> Self {
        self.submit_failures = failures;
        self
    }

    #[cfg(feature = "fault-injection")]
    fn injected_failure(&mut self) -> Option<io::Error> {
        let failures = self.submit_failures.as_mut()?;
        failures.times = failures.times.checked_sub(1)?;
        Some(io::Error::from_raw_os_error(failures.errno))
    }

    /// Queues `entries` (a whole chain, or nothing), submitting what is queued first if they do
    /// not fit.
    ///
    /// # Safety
    ///
    /// Every pointer in `entries` must stay valid until the completion of every entry was
    /// reaped (or the chain was cancelled and its completions skipped), unless this returns an
    /// error: then the kernel never saw them.
    pub(super) unsafe fn push(&mut self, entries: &[Entry]) -> Result<(), PushError> {
        #[cfg(feature = "fault-injection")]
        if let Some(e) = self.injected_failure() {
            return Err(PushError::from_submit(e));
        }
        if entries.len() > self.ring.submission().capacity() {
            let msg = "a chain longer than the submission queue";
            return Err(PushError::Failed(io::Error::new(
                io::ErrorKind::InvalidInput,
                msg,
            )));
        }
        loop {
            // SAFETY: the caller keeps every pointer valid until completion (the contract of
            // this function).
            if unsafe { self.ring.submission().push_multiple(entries) }.is_ok() {
                EngineStats::add(&self.stats.sqes, entries.len() as u64);
                return Ok(());
            }
            if self.submit_queued()? == 0 {
                // Nothing left the queue: the kernel takes no more for now.
                return Err(PushError::Busy);
            }
        }
    }

    /// Queues one entry that points into no memory.
    pub(super) fn push_fd_only(&mut self, entry: FdOnly) -> Result<(), PushError> {
        // SAFETY: an `FdOnly` entry carries no pointer (its constructors build only fsync and
        // close entries on descriptors), so there is nothing to keep valid.
        unsafe { self.push(std::slice::from_ref(&entry.0)) }
    }

    /// Submits what is queued, without waiting; how many entries the kernel took.
    fn submit_queued(&mut self) -> Result<usize, PushError> {
        loop {
            EngineStats::add(&self.stats.enters, 1);
            match self.ring.submit() {
                Ok(n) => {
                    self.observe_batch(n);
                    return Ok(n);
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(PushError::from_submit(e)),
            }
        }
    }

    /// Keeps a read of the eventfd queued, so a new request wakes `submit_and_wait`. When the
    /// queue is full the read waits for the next round (the full queue completes meanwhile).
    pub(super) fn arm_wake(&mut self) {
        if self.wake_armed {
            return;
        }
        let Some(buf) = self.wake_buf.as_mut() else {
            return;
        };
        let ptr: *mut u64 = &raw mut **buf;
        let entry = opcode::Read::new(Fd(self.wake.raw()), ptr.cast(), 8)
            .build()
            .user_data(WAKE);
        // SAFETY: `wake_buf` is a Box owned by this queue, at most one read into it is in
        // flight (`wake_armed`), and it is freed only when no read is armed (`Drop` leaks it
        // otherwise). The read holds its own reference to the eventfd.
        if unsafe { self.ring.submission().push(&entry) }.is_ok() {
            self.wake_armed = true;
        }
    }

    /// Completes the armed wake-up read (by signalling the eventfd), so nothing in the ring
    /// points into the wake buffer any more. For a clean shutdown.
    pub(super) fn disarm_wake(&mut self) -> io::Result<()> {
        if self.wake_armed {
            self.wake.signal();
        }
        while self.wake_armed {
            self.submit_and_wait(1)?;
            let stray = self.completions();
            if !stray.is_empty() {
                tracing::warn!(
                    count = stray.len(),
                    "completions after the engine went idle"
                );
            }
        }
        Ok(())
    }

    /// Submits what is queued and waits for `want` completions. A full completion queue
    /// (`EBUSY`) returns at once, to reap first.
    pub(super) fn submit_and_wait(&mut self, want: usize) -> io::Result<()> {
        loop {
            EngineStats::add(&self.stats.enters, 1);
            match self.ring.submit_and_wait(want) {
                Ok(n) => {
                    self.observe_batch(n);
                    return Ok(());
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// The completions posted so far, as (user data, result); the wake-up read's is consumed
    /// here.
    pub(super) fn completions(&mut self) -> Vec<(u64, i32)> {
        let all: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        let before = all.len();
        let rest: Vec<(u64, i32)> = all.into_iter().filter(|(data, _)| *data != WAKE).collect();
        if rest.len() < before {
            self.wake_armed = false;
        }
        rest
    }

    fn observe_batch(&self, submitted: usize) {
        if submitted > 0 {
            EngineStats::add(&self.stats.submissions, 1);
            if let Some(observer) = &self.observer {
                observer(submitted as u64);
            }
        }
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        // A read still armed (the ring failed before it could be completed) may yet write into
        // the buffer: leave those 8 bytes allocated rather than free them under the kernel.
        if self.wake_armed
            && let Some(buf) = self.wake_buf.take()
        {
            std::mem::forget(buf);
        }
    }
}
