//! Where the agent runs blocking work (file writes and fsyncs of the synchronous engine, the
//! configfs test double, the plain-file backend): tokio's blocking pool, or, on a thread that a
//! deterministic simulation claimed, a task of the current runtime.
//!
//! Production never claims a thread, so [`spawn`] is exactly `tokio::task::spawn_blocking`.
//! A simulation (the `pillar-sim` crate) runs everything on one current-thread runtime with
//! paused time and needs every interleaving to come from its own seeded decisions. Work on the
//! blocking pool runs on other OS threads and finishes whenever the OS says, which no seed can
//! reproduce. [`claim_thread`] makes [`spawn`] on this thread run the closure on an ordinary
//! task instead, after a number of yields and a (paused-clock) delay the simulation picks:
//! blocking work then completes inline, deferred, slowly or out of order, as the seed decides.
//! A slow piece of work models a configfs write the kernel is slow to answer: like work on the
//! real blocking pool, it runs to its end even when the future that waited for it is dropped.
//!
//! Invariant: the closure runs exactly once, or not at all when its task is aborted before it
//! starts (as a crash of the process would drop it); it never runs partly.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use tokio::task::JoinHandle;

/// How a piece of blocking work is held back on a claimed thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Deferral {
    /// Times the task yields to other ready tasks first.
    pub yields: u32,
    /// Then how long it waits (on the runtime's clock).
    pub delay: Duration,
}

type Decide = Rc<dyn Fn() -> Deferral>;

thread_local! {
    static CLAIMED: RefCell<Option<Decide>> = const { RefCell::new(None) };
    static PENDING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Releases the thread when dropped.
#[derive(Debug)]
#[cfg(any(test, feature = "test-seams"))]
pub struct Claim {
    _not_send: std::marker::PhantomData<Rc<()>>,
}

#[cfg(any(test, feature = "test-seams"))]
impl Drop for Claim {
    fn drop(&mut self) {
        CLAIMED.with(|c| c.borrow_mut().take());
    }
}

/// Claims the current thread for a simulation: [`spawn`] on it runs work on a task of the
/// current (current-thread) runtime, held back as `deferral()` decides. Only for simulations
/// and tests.
#[cfg(any(test, feature = "test-seams"))]
pub fn claim_thread(deferral: impl Fn() -> Deferral + 'static) -> Claim {
    CLAIMED.with(|c| *c.borrow_mut() = Some(Rc::new(deferral)));
    Claim {
        _not_send: std::marker::PhantomData,
    }
}

/// Blocking work spawned on a claimed thread that has not run yet.
#[cfg(any(test, feature = "test-seams"))]
pub fn pending() -> usize {
    PENDING.with(std::cell::Cell::get)
}

/// Runs `f` where blocking work runs (see the module documentation).
pub fn spawn<F, T>(f: F) -> JoinHandle<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let deferral = CLAIMED.with(|c| c.borrow().as_ref().map(|d| d()));
    let Some(Deferral { yields, delay }) = deferral else {
        return tokio::task::spawn_blocking(f);
    };
    PENDING.with(|p| p.set(p.get() + 1));
    let done = PendingGuard;
    tokio::spawn(async move {
        for _ in 0..yields {
            tokio::task::yield_now().await;
        }
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        drop(done);
        f()
    })
}

/// Counts a deferred piece of work as pending until it runs or its task is dropped.
struct PendingGuard;

impl Drop for PendingGuard {
    fn drop(&mut self) {
        PENDING.with(|p| p.set(p.get().saturating_sub(1)));
    }
}
