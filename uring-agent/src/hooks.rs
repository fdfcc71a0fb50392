//! Test hooks: named points in the middle of a request where a test can stall the agent or
//! slow it down, to prove what holds when a request is overtaken, cancelled or raced.
//!
//! Hooks can be armed only in builds with the `fault-injection` feature; in any other build
//! every point is a check of one atomic flag and nothing more.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

/// Where a hook can act.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HookPoint {
    /// Before a configfs plan goes to the engine: a stand-in for a configfs write the kernel is
    /// slow to answer (a frozen filesystem).
    ConfigfsApply,
    /// Between a request's fence check and the commit of its mark.
    BetweenCheckAndCommit,
    /// The write of a fencing mark (armed with [`Hooks::fail`]: the write fails).
    MarkWrite,
}

// Only the `fault-injection` feature arms hooks; without it the variants are never built.
#[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
#[derive(Debug)]
enum Action {
    Stall(Arc<Gate>),
    Delay(Duration),
    Fail,
}

/// See the module documentation. Clones share the same points.
#[derive(Clone, Debug, Default)]
pub struct Hooks {
    any_armed: Arc<AtomicBool>,
    armed: Arc<Mutex<HashMap<HookPoint, Action>>>,
    /// Whether request tasks are tracked ([`Hooks::track_requests`]).
    tracking: Arc<AtomicBool>,
    /// The request tasks tracked, so a test can abort them all as a crash of the process would.
    requests: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

/// A stall a test holds: requests reaching the point wait until [`Gate::release`].
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    reached: usize,
    released: bool,
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn pass(&self) {
        let mut state = self.lock();
        state.reached += 1;
        self.changed.notify_all();
        while !state.released {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Blocks until `n` requests reached the point, or `timeout` passed; whether they did.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn wait_reached(&self, n: usize, timeout: Duration) -> bool {
        let state = self.lock();
        let (state, _) = self
            .changed
            .wait_timeout_while(state, timeout, |s| s.reached < n)
            .unwrap_or_else(PoisonError::into_inner);
        state.reached >= n
    }

    /// Lets every waiting and later request through.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn release(&self) {
        self.lock().released = true;
        self.changed.notify_all();
    }
}

impl Hooks {
    fn action(&self, point: HookPoint) -> Option<Action> {
        if !self.any_armed.load(Ordering::Acquire) {
            return None;
        }
        let armed = self.armed.lock().unwrap_or_else(PoisonError::into_inner);
        armed.get(&point).map(|a| match a {
            Action::Stall(g) => Action::Stall(Arc::clone(g)),
            Action::Delay(d) => Action::Delay(*d),
            Action::Fail => Action::Fail,
        })
    }

    /// In async code: stalls (on a blocking thread) or sleeps as armed for `point`.
    pub(crate) async fn pass(&self, point: HookPoint) {
        match self.action(point) {
            Some(Action::Stall(gate)) => {
                let _ = tokio::task::spawn_blocking(move || gate.pass()).await;
            }
            Some(Action::Delay(delay)) => tokio::time::sleep(delay).await,
            None | Some(Action::Fail) => {}
        }
    }

    /// Whether the step at `point` must fail (armed with [`Hooks::fail`]).
    pub(crate) fn fails(&self, point: HookPoint) -> bool {
        matches!(self.action(point), Some(Action::Fail))
    }

    /// Records a request's task (the gRPC edge's `to_the_end`) while tracking is on; nothing
    /// otherwise.
    pub(crate) fn track<T>(&self, task: &tokio::task::JoinHandle<T>) {
        if !self.tracking.load(Ordering::Acquire) {
            return;
        }
        let mut requests = self.requests.lock().unwrap_or_else(PoisonError::into_inner);
        requests.retain(|r| !r.is_finished());
        requests.push(task.abort_handle());
    }

    /// From now on, every request task of the agents sharing these hooks is tracked, so that
    /// [`abort_requests`](Self::abort_requests) can simulate a crash of the agent's process.
    #[cfg(feature = "fault-injection")]
    pub fn track_requests(&self) {
        self.tracking.store(true, Ordering::Release);
    }

    /// Aborts every tracked request task still running (a crash: the work stops at whatever
    /// await point it reached); how many were running.
    #[cfg(feature = "fault-injection")]
    pub fn abort_requests(&self) -> usize {
        let requests =
            std::mem::take(&mut *self.requests.lock().unwrap_or_else(PoisonError::into_inner));
        let running = requests.iter().filter(|r| !r.is_finished()).count();
        for r in requests {
            r.abort();
        }
        running
    }

    #[cfg(feature = "fault-injection")]
    fn arm(&self, point: HookPoint, action: Action) {
        self.armed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(point, action);
        self.any_armed.store(true, Ordering::Release);
    }

    /// Requests reaching `point` wait until the returned gate is released.
    #[cfg(feature = "fault-injection")]
    pub fn stall(&self, point: HookPoint) -> Arc<Gate> {
        let gate = Arc::new(Gate::default());
        self.arm(point, Action::Stall(Arc::clone(&gate)));
        gate
    }

    /// Requests reaching `point` sleep for `delay`.
    #[cfg(feature = "fault-injection")]
    pub fn delay(&self, point: HookPoint, delay: Duration) {
        self.arm(point, Action::Delay(delay));
    }

    /// The step at `point` fails until disarmed.
    #[cfg(feature = "fault-injection")]
    pub fn fail(&self, point: HookPoint) {
        self.arm(point, Action::Fail);
    }

    /// Disarms `point`.
    #[cfg(feature = "fault-injection")]
    pub fn clear(&self, point: HookPoint) {
        self.armed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&point);
    }
}
