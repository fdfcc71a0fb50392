//! One store wrapper that injects faults into writes, for tests of what callers do under
//! contention and for the simulation's replicas (feature `faults`).
//!
//! [`FaultyStore`] wraps any [`StateStore`] and hands each write, of any kind, to a [`Faults`]
//! policy before it reaches the inner store (the policy may fail it there: nothing is written)
//! and after the inner store answered. Reads and events go straight through. The write's
//! `ObjectApi<K>` is written once for every kind.
//!
//! [`Armed`], the default policy, is the tests': a volume write armed with
//! [`Armed::conflict`] fails with [`StoreError::Conflict`], exactly as a write would whose object
//! another writer changed in between; one armed with [`Armed::pause_next`] waits until the test
//! releases it, then goes to the inner store with the revision it was given: a controller
//! replica stalled between its read and its write. Every volume write is counted.

use std::collections::HashMap;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;

use crate::crd::PillarVolumeState;
use crate::object::PillarObject;
use crate::store::{ObjectApi, Revision, StateStore, StoreError, VolumeEvent};

/// Which write a [`Faults`] policy is asked about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// A create.
    Create,
    /// A spec write.
    Spec,
    /// A status write.
    Status,
    /// A delete.
    Delete,
}

/// One write on its way to the inner store.
#[derive(Clone, Copy, Debug)]
pub struct Write<'a> {
    /// The record's kind.
    pub kind: &'static str,
    /// What is written.
    pub op: Op,
    /// The record's name.
    pub name: &'a str,
    /// The revision it expects (none for a create).
    pub expected: Option<&'a Revision>,
}

impl Write<'_> {
    /// The conflict an API server answers when another writer came first.
    pub fn conflict(&self, message: &str) -> StoreError {
        StoreError::Conflict {
            kind: self.kind,
            name: self.name.to_owned(),
            expected: self
                .expected
                .map(|r| r.resource_version.clone())
                .unwrap_or_default(),
            message: message.to_owned(),
        }
    }
}

/// What a [`FaultyStore`] does to writes.
#[async_trait]
pub trait Faults: Send + Sync + fmt::Debug {
    /// Before `write` reaches the inner store: an error fails it there, and nothing is written.
    async fn before(&self, write: &Write<'_>) -> Result<(), StoreError>;
    /// After the inner store answered `write` (`Err`: it refused).
    async fn after(&self, write: &Write<'_>, answer: Result<(), &StoreError>);
}

/// The volume writes [`Armed`] can make conflict or wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VolumeWrite {
    Status,
    Spec,
    Delete,
}

impl VolumeWrite {
    /// The volume write `write` is, if it is one.
    fn of(write: &Write<'_>) -> Option<Self> {
        if write.kind != PillarVolumeState::KIND {
            return None;
        }
        match write.op {
            Op::Status => Some(Self::Status),
            Op::Spec => Some(Self::Spec),
            Op::Delete => Some(Self::Delete),
            Op::Create => None,
        }
    }
}

/// A write held by [`Armed::pause_next`].
#[derive(Debug, Default)]
pub struct Pause {
    reached: tokio::sync::Notify,
    is_reached: std::sync::atomic::AtomicBool,
    release: tokio::sync::Notify,
    is_released: std::sync::atomic::AtomicBool,
}

impl Pause {
    /// Waits until the paused write arrived.
    pub async fn reached(&self) {
        while !self.is_reached.load(std::sync::atomic::Ordering::Acquire) {
            let notified = self.reached.notified();
            if self.is_reached.load(std::sync::atomic::Ordering::Acquire) {
                break;
            }
            notified.await;
        }
    }

    /// Lets the paused write go on.
    pub fn release(&self) {
        self.is_released
            .store(true, std::sync::atomic::Ordering::Release);
        self.release.notify_waiters();
    }

    async fn hold(&self) {
        self.is_reached
            .store(true, std::sync::atomic::Ordering::Release);
        self.reached.notify_waiters();
        while !self.is_released.load(std::sync::atomic::Ordering::Acquire) {
            let notified = self.release.notified();
            if self.is_released.load(std::sync::atomic::Ordering::Acquire) {
                break;
            }
            notified.await;
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    /// Conflicts still to inject, per write kind (`usize::MAX`: always).
    armed: HashMap<VolumeWrite, usize>,
    /// Calls seen, per write kind.
    calls: HashMap<VolumeWrite, usize>,
    /// Conflicts injected, per write kind.
    injected: HashMap<VolumeWrite, usize>,
    /// Conflicts the inner store answered (not injected), per write kind.
    conflicts: HashMap<VolumeWrite, usize>,
    /// The next write of a kind waits on this.
    paused: HashMap<VolumeWrite, Arc<Pause>>,
}

/// The tests' policy (see the module documentation). Nothing is armed at first.
#[derive(Debug, Default)]
pub struct Armed {
    counters: Mutex<Counters>,
}

impl Armed {
    fn counters(&self) -> std::sync::MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next `times` writes of kind `write` conflict (`usize::MAX`: every one).
    pub fn conflict(&self, write: VolumeWrite, times: usize) {
        self.counters().armed.insert(write, times);
    }

    /// The next write of kind `write` waits until the returned pause is released.
    pub fn pause_next(&self, write: VolumeWrite) -> Arc<Pause> {
        let pause = Arc::new(Pause::default());
        self.counters().paused.insert(write, Arc::clone(&pause));
        pause
    }

    /// Calls of `write` seen so far.
    pub fn calls(&self, write: VolumeWrite) -> usize {
        self.counters().calls.get(&write).copied().unwrap_or(0)
    }

    /// Conflicts the inner store answered to `write` so far (real contention, not injected).
    pub fn conflicts(&self, write: VolumeWrite) -> usize {
        self.counters().conflicts.get(&write).copied().unwrap_or(0)
    }

    /// Conflicts injected into `write` so far.
    pub fn injected(&self, write: VolumeWrite) -> usize {
        self.counters().injected.get(&write).copied().unwrap_or(0)
    }
}

#[async_trait]
impl Faults for Armed {
    /// Holds the write if paused, counts it, and decides whether it conflicts.
    async fn before(&self, write: &Write<'_>) -> Result<(), StoreError> {
        let Some(kind) = VolumeWrite::of(write) else {
            return Ok(());
        };
        let pause = self.counters().paused.remove(&kind);
        if let Some(pause) = pause {
            pause.hold().await;
        }
        let mut c = self.counters();
        *c.calls.entry(kind).or_default() += 1;
        let armed = c.armed.entry(kind).or_default();
        if *armed == 0 {
            return Ok(());
        }
        if *armed != usize::MAX {
            *armed -= 1;
        }
        *c.injected.entry(kind).or_default() += 1;
        Err(write.conflict("injected conflict"))
    }

    async fn after(&self, write: &Write<'_>, answer: Result<(), &StoreError>) {
        if let (Some(kind), Err(e)) = (VolumeWrite::of(write), answer)
            && e.is_conflict()
        {
            *self.counters().conflicts.entry(kind).or_default() += 1;
        }
    }
}

/// See the module documentation. It dereferences to its policy.
pub struct FaultyStore<F = Armed> {
    inner: Arc<dyn StateStore>,
    faults: F,
}

impl<F: fmt::Debug> fmt::Debug for FaultyStore<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyStore")
            .field("inner", &self.inner)
            .field("faults", &self.faults)
            .finish()
    }
}

impl FaultyStore<Armed> {
    /// Wraps `inner` with the tests' policy; nothing is armed.
    pub fn new(inner: Arc<dyn StateStore>) -> Arc<Self> {
        Self::with_faults(inner, Armed::default())
    }
}

impl<F: Faults> FaultyStore<F> {
    /// Wraps `inner` with `faults`.
    pub fn with_faults(inner: Arc<dyn StateStore>, faults: F) -> Arc<Self> {
        Arc::new(Self { inner, faults })
    }

    /// Runs `call` on the inner store between the policy's `before` and `after`.
    async fn write<T>(
        &self,
        write: Write<'_>,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.faults.before(&write).await?;
        let answer = call.await;
        self.faults.after(&write, answer.as_ref().map(|_| ())).await;
        answer
    }
}

impl<F> Deref for FaultyStore<F> {
    type Target = F;
    fn deref(&self) -> &F {
        &self.faults
    }
}

fn write_of<'a, K: PillarObject>(
    op: Op,
    name: &'a str,
    expected: Option<&'a Revision>,
) -> Write<'a> {
    Write {
        kind: K::KIND,
        op,
        name,
        expected,
    }
}

#[async_trait]
impl<K: PillarObject, F: Faults> ObjectApi<K> for FaultyStore<F>
where
    dyn StateStore: ObjectApi<K>,
{
    async fn get(&self, name: &str) -> Result<Option<K>, StoreError> {
        ObjectApi::<K>::get(&*self.inner, name).await
    }
    async fn list(&self) -> Result<Vec<K>, StoreError> {
        ObjectApi::<K>::list(&*self.inner).await
    }
    async fn create(&self, name: &str, spec: K::Spec) -> Result<K, StoreError> {
        let call = ObjectApi::<K>::create(&*self.inner, name, spec);
        self.write(write_of::<K>(Op::Create, name, None), call)
            .await
    }
    async fn replace_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: K::Spec,
    ) -> Result<K, StoreError> {
        let call = ObjectApi::<K>::replace_spec(&*self.inner, name, expected, spec);
        self.write(write_of::<K>(Op::Spec, name, Some(expected)), call)
            .await
    }
    async fn replace_status(
        &self,
        name: &str,
        expected: &Revision,
        status: K::Status,
    ) -> Result<K, StoreError> {
        let call = ObjectApi::<K>::replace_status(&*self.inner, name, expected, status);
        self.write(write_of::<K>(Op::Status, name, Some(expected)), call)
            .await
    }
    async fn delete(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        let call = ObjectApi::<K>::delete(&*self.inner, name, expected);
        self.write(write_of::<K>(Op::Delete, name, Some(expected)), call)
            .await
    }
}

#[async_trait]
impl<F: Faults> StateStore for FaultyStore<F> {
    async fn record_volume_event(&self, event: &VolumeEvent) -> Result<(), StoreError> {
        self.inner.record_volume_event(event).await
    }

    async fn node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<crate::credentials::NodeCredentials, StoreError> {
        self.inner.node_credentials(node, host_nqn).await
    }

    async fn rotate_node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<crate::credentials::NodeCredentials, StoreError> {
        self.inner.rotate_node_credentials(node, host_nqn).await
    }

    async fn stored_node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<Option<crate::credentials::NodeCredentials>, StoreError> {
        self.inner.stored_node_credentials(node, host_nqn).await
    }
}
