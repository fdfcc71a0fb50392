//! A store that makes chosen compare-and-swap writes conflict or wait, for tests of what
//! callers do under contention (feature `test-double`).
//!
//! [`FaultyStore`] wraps any [`StateStore`]. A write armed with [`FaultyStore::conflict`] fails
//! with [`StoreError::Conflict`] before reaching the inner store, exactly as a write would whose
//! object another writer changed in between; nothing is written. A write armed with
//! [`FaultyStore::pause_next`] waits until the test releases it, then goes to the inner store
//! with the revision it was given: a controller replica stalled between its read and its write.
//! Reads and every other write go through unchanged, and every volume write is counted.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;

use crate::crd::{
    PillarAgent, PillarAgentSpec, PillarAgentStatus, PillarProtocol, PillarProtocolSpec,
    PillarSnapshotState, PillarSnapshotStateSpec, PillarSnapshotStateStatus, PillarVolumeState,
    PillarVolumeStateSpec, PillarVolumeStateStatus,
};
use crate::store::{Revision, StateStore, StoreError, VolumeEvent};

/// The volume writes a [`FaultyStore`] can make conflict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VolumeWrite {
    Status,
    Spec,
    Delete,
}

/// A write held by [`FaultyStore::pause_next`].
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

/// See the module documentation.
pub struct FaultyStore {
    inner: Arc<dyn StateStore>,
    counters: Mutex<Counters>,
}

impl fmt::Debug for FaultyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyStore")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl FaultyStore {
    /// Wraps `inner`; nothing is armed.
    pub fn new(inner: Arc<dyn StateStore>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            counters: Mutex::new(Counters::default()),
        })
    }

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

    fn observe<T>(&self, write: VolumeWrite, result: &Result<T, StoreError>) {
        if matches!(result, Err(e) if e.is_conflict()) {
            *self.counters().conflicts.entry(write).or_default() += 1;
        }
    }

    /// Conflicts injected into `write` so far.
    pub fn injected(&self, write: VolumeWrite) -> usize {
        self.counters().injected.get(&write).copied().unwrap_or(0)
    }

    /// Counts the call, holds it if paused, and decides whether it conflicts.
    async fn check(
        &self,
        write: VolumeWrite,
        name: &str,
        expected: &Revision,
    ) -> Result<(), StoreError> {
        let pause = self.counters().paused.remove(&write);
        if let Some(pause) = pause {
            pause.hold().await;
        }
        let mut c = self.counters();
        *c.calls.entry(write).or_default() += 1;
        let armed = c.armed.entry(write).or_default();
        if *armed == 0 {
            return Ok(());
        }
        if *armed != usize::MAX {
            *armed -= 1;
        }
        *c.injected.entry(write).or_default() += 1;
        Err(StoreError::Conflict {
            kind: "PillarVolumeState",
            name: name.to_owned(),
            expected: expected.resource_version.clone(),
            message: "injected conflict".into(),
        })
    }
}

#[async_trait]
impl StateStore for FaultyStore {
    async fn get_volume(&self, name: &str) -> Result<Option<PillarVolumeState>, StoreError> {
        self.inner.get_volume(name).await
    }
    async fn list_volumes(&self) -> Result<Vec<PillarVolumeState>, StoreError> {
        self.inner.list_volumes().await
    }
    async fn create_volume(
        &self,
        name: &str,
        spec: PillarVolumeStateSpec,
    ) -> Result<PillarVolumeState, StoreError> {
        self.inner.create_volume(name, spec).await
    }
    async fn replace_volume_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarVolumeStateStatus,
    ) -> Result<PillarVolumeState, StoreError> {
        self.check(VolumeWrite::Status, name, expected).await?;
        let result = self
            .inner
            .replace_volume_status(name, expected, status)
            .await;
        self.observe(VolumeWrite::Status, &result);
        result
    }
    async fn replace_volume_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarVolumeStateSpec,
    ) -> Result<PillarVolumeState, StoreError> {
        self.check(VolumeWrite::Spec, name, expected).await?;
        let result = self.inner.replace_volume_spec(name, expected, spec).await;
        self.observe(VolumeWrite::Spec, &result);
        result
    }
    async fn delete_volume(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        self.check(VolumeWrite::Delete, name, expected).await?;
        let result = self.inner.delete_volume(name, expected).await;
        self.observe(VolumeWrite::Delete, &result);
        result
    }
    async fn get_snapshot(&self, name: &str) -> Result<Option<PillarSnapshotState>, StoreError> {
        self.inner.get_snapshot(name).await
    }
    async fn list_snapshots(&self) -> Result<Vec<PillarSnapshotState>, StoreError> {
        self.inner.list_snapshots().await
    }
    async fn create_snapshot(
        &self,
        name: &str,
        spec: PillarSnapshotStateSpec,
    ) -> Result<PillarSnapshotState, StoreError> {
        self.inner.create_snapshot(name, spec).await
    }
    async fn replace_snapshot_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarSnapshotStateStatus,
    ) -> Result<PillarSnapshotState, StoreError> {
        self.inner
            .replace_snapshot_status(name, expected, status)
            .await
    }
    async fn delete_snapshot(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        self.inner.delete_snapshot(name, expected).await
    }
    async fn get_agent(&self, name: &str) -> Result<Option<PillarAgent>, StoreError> {
        self.inner.get_agent(name).await
    }
    async fn list_agents(&self) -> Result<Vec<PillarAgent>, StoreError> {
        self.inner.list_agents().await
    }
    async fn create_agent(
        &self,
        name: &str,
        spec: PillarAgentSpec,
    ) -> Result<PillarAgent, StoreError> {
        self.inner.create_agent(name, spec).await
    }
    async fn replace_agent_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarAgentSpec,
    ) -> Result<PillarAgent, StoreError> {
        self.inner.replace_agent_spec(name, expected, spec).await
    }
    async fn replace_agent_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarAgentStatus,
    ) -> Result<PillarAgent, StoreError> {
        self.inner
            .replace_agent_status(name, expected, status)
            .await
    }
    async fn delete_agent(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        self.inner.delete_agent(name, expected).await
    }
    async fn get_protocol(&self, name: &str) -> Result<Option<PillarProtocol>, StoreError> {
        self.inner.get_protocol(name).await
    }
    async fn list_protocols(&self) -> Result<Vec<PillarProtocol>, StoreError> {
        self.inner.list_protocols().await
    }
    async fn create_protocol(
        &self,
        name: &str,
        spec: PillarProtocolSpec,
    ) -> Result<PillarProtocol, StoreError> {
        self.inner.create_protocol(name, spec).await
    }
    async fn replace_protocol_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarProtocolSpec,
    ) -> Result<PillarProtocol, StoreError> {
        self.inner.replace_protocol_spec(name, expected, spec).await
    }
    async fn delete_protocol(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        self.inner.delete_protocol(name, expected).await
    }
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
}
