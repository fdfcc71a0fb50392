//! Fault decisions, their counts, and the trace of one seed.
//!
//! Every decision that changes an interleaving (which operation, which replica, how long a
//! message waits, whether a write conflicts, when a request is cancelled) is drawn here from the
//! seed's one generator, in the order the single simulation thread asks. Same seed, same
//! decisions, same run.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::rng::SimRng;

/// Every kind of fault the simulation injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// A CSI request dropped at an await point (its deadline fired).
    Cancelled,
    /// A replica stalled between its store read and its write; the other may overtake.
    ReplicaPaused,
    /// A replica stalled after a write landed (a token taken), before it acts on it: its agent
    /// call goes out late, possibly to an agent that crashed and restarted meanwhile.
    ReplicaPausedAfterWrite,
    /// A store write answered with a conflict it did not really have.
    StoreConflict,
    /// An agent process crashed (its request tasks die where they are) and restarted.
    AgentCrash,
    /// A crash that also lost the agent's state directory.
    AgentStateLost,
    /// An agent's node lost power: un-fsynced writes of its state directory may be gone (one
    /// crash state of `pillar_durable::crash`), and the target's memory is.
    PowerLoss,
    /// A power loss whose crash state lost writes the directory held before it.
    PowerLossLostWrites,
    /// A request to an agent lost before it arrived.
    RequestDropped,
    /// A request to an agent held back.
    RequestDelayed,
    /// A request delivered after one sent later.
    Reordered,
    /// A request delivered twice.
    Duplicated,
    /// An agent's reply lost after the work was done.
    ReplyDropped,
    /// An agent's reply held back.
    ReplyDelayed,
    /// Blocking work of an agent deferred (completes out of order with other work).
    WorkDeferred,
    /// Blocking work of an agent slow (a configfs write the kernel is slow to answer).
    WorkSlow,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// How often each fault strikes, per mille of the chances it has.
#[derive(Clone, Copy, Debug)]
pub struct Knobs {
    pub cancel: u64,
    pub pause: u64,
    pub pause_after_write: u64,
    pub conflict: u64,
    pub crash: u64,
    pub state_loss: u64,
    /// Per mille of agent crash chances that are a power loss instead.
    pub power_loss: u64,
    pub drop_request: u64,
    pub delay_request: u64,
    pub duplicate: u64,
    pub drop_reply: u64,
    pub delay_reply: u64,
    pub defer_work: u64,
    pub slow_work: u64,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            cancel: 150,
            pause: 150,
            pause_after_write: 0,
            conflict: 60,
            crash: 30,
            state_loss: 0,
            power_loss: 300,
            drop_request: 40,
            delay_request: 200,
            duplicate: 60,
            drop_reply: 50,
            delay_reply: 150,
            defer_work: 300,
            slow_work: 50,
        }
    }
}

/// Counts of faults injected, by kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts(pub BTreeMap<Fault, u64>);

impl FaultCounts {
    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &Self) {
        for (k, v) in &other.0 {
            *self.0.entry(*k).or_default() += v;
        }
    }

    /// `Kind=n` for every kind, on one line (the progress line of a long run).
    pub fn one_line(&self) -> String {
        let parts: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        parts.join(" ")
    }
}

impl fmt::Display for FaultCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:<16} {:>10}", "fault", "count")?;
        for (k, v) in &self.0 {
            writeln!(f, "{:<16} {v:>10}", k.to_string())?;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Inner {
    rng: SimRng,
    counts: FaultCounts,
    trace: Vec<String>,
}

/// The seed's decisions, shared by every simulated part (cheap to clone).
#[derive(Clone, Debug)]
pub struct Chaos {
    inner: Arc<Mutex<Inner>>,
    enabled: Arc<AtomicBool>,
    pub knobs: Knobs,
}

impl Chaos {
    /// Decisions for `seed`.
    pub fn new(seed: u64, knobs: Knobs) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                rng: SimRng::new(seed),
                counts: FaultCounts::default(),
                trace: Vec::new(),
            })),
            enabled: Arc::new(AtomicBool::new(true)),
            knobs,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops injecting faults (the final drain); plain choices still come from the seed.
    pub fn disable(&self) {
        self.enabled.store(false, Ordering::Release);
    }

    /// Whether faults are injected.
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// A value in `0..n`.
    pub fn below(&self, n: u64) -> u64 {
        self.lock().rng.below(n)
    }

    /// A fresh identifier from the seed (UIDs), formatted as a UUID.
    pub fn uuid(&self) -> String {
        let mut inner = self.lock();
        let (a, b) = (inner.rng.next_u64(), inner.rng.next_u64());
        uuid::Uuid::from_u64_pair(a, b).to_string()
    }

    /// Whether `fault` strikes now (never once disabled); counted and traced when it does.
    pub fn strikes(&self, fault: Fault, per_mille: u64, what: &str) -> bool {
        if !self.enabled() {
            return false;
        }
        let mut inner = self.lock();
        if !inner.rng.chance(per_mille) {
            return false;
        }
        *inner.counts.0.entry(fault).or_default() += 1;
        inner.trace.push(format!("  fault {fault}: {what}"));
        true
    }

    /// Counts a fault decided elsewhere (a reorder seen at delivery).
    pub fn count(&self, fault: Fault, what: &str) {
        let mut inner = self.lock();
        *inner.counts.0.entry(fault).or_default() += 1;
        inner.trace.push(format!("  fault {fault}: {what}"));
    }

    /// A random pause of up to `max_ms` milliseconds (at least 1).
    pub fn pause(&self, max_ms: u64) -> Duration {
        Duration::from_millis(1 + self.below(max_ms))
    }

    /// Adds a line to the trace.
    pub fn trace(&self, line: String) {
        self.lock().trace.push(line);
    }

    /// The trace so far.
    pub fn trace_lines(&self) -> Vec<String> {
        self.lock().trace.clone()
    }

    /// The faults injected so far.
    pub fn counts(&self) -> FaultCounts {
        self.lock().counts.clone()
    }
}
