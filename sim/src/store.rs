//! The shared state store: in memory, with the Kubernetes API server's compare-and-swap rules,
//! and each replica's view of it, where the simulation stalls and fails writes.
//!
//! [`SimStore`] follows what `pillar-state`'s stores (and the API server they model) do: one
//! global resourceVersion counter; create assigns a UID (from the seed) and answers
//! AlreadyExists for a taken name; a write names the revision it expects and is checked in the
//! API server's order: absent (NotFound), other lifecycle (UidMismatch), stale resourceVersion
//! (Conflict); a status write leaves the spec alone and the reverse; a write that changes
//! nothing keeps the resourceVersion. Everything happens under one lock, with no await, so
//! each call is atomic.
//!
//! [`ReplicaStore`] is one controller replica's client of that store. Before a volume write it
//! may stall (the replica paused between its read and its write: the other replica overtakes)
//! or fail with a conflict that did not happen (as an API server does under contention).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use pillar_state::crd::{
    PillarAgent, PillarAgentSpec, PillarAgentStatus, PillarProtocol, PillarProtocolSpec,
    PillarSnapshotState, PillarSnapshotStateSpec, PillarSnapshotStateStatus, PillarVolumeState,
    PillarVolumeStateSpec, PillarVolumeStateStatus,
};
use pillar_state::{PillarObject, Revision, StateStore, StoreError, VolumeEvent};

use crate::chaos::{Chaos, Fault};

#[derive(Debug, Default)]
struct Objects {
    last_rv: u64,
    volumes: BTreeMap<String, PillarVolumeState>,
    snapshots: BTreeMap<String, PillarSnapshotState>,
    agents: BTreeMap<String, PillarAgent>,
    protocols: BTreeMap<String, PillarProtocol>,
}

/// See the module documentation.
pub struct SimStore {
    objects: Mutex<Objects>,
    chaos: Chaos,
    /// Nodes' DH-HMAC-CHAP credentials (W10), made on first use as the embedded store does.
    credentials: std::sync::Mutex<BTreeMap<String, pillar_state::credentials::NodeCredentials>>,
}

impl fmt::Debug for SimStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimStore").finish_non_exhaustive()
    }
}

fn create<K: PillarObject>(
    map: &mut BTreeMap<String, K>,
    last_rv: &mut u64,
    uid: String,
    name: &str,
    spec: K::Spec,
) -> Result<K, StoreError> {
    pillar_state::validate_name(K::KIND, name)?;
    if map.contains_key(name) {
        return Err(StoreError::AlreadyExists {
            kind: K::KIND,
            name: name.to_owned(),
        });
    }
    let mut obj = K::build(name, spec);
    *last_rv += 1;
    let meta = obj.meta_mut();
    meta.uid = Some(uid);
    meta.resource_version = Some(last_rv.to_string());
    meta.generation = Some(1);
    map.insert(name.to_owned(), obj.clone());
    Ok(obj)
}

fn expected<'a, K: PillarObject>(
    map: &'a BTreeMap<String, K>,
    name: &str,
    expected: &Revision,
) -> Result<&'a K, StoreError> {
    let current = map.get(name).ok_or_else(|| StoreError::NotFound {
        kind: K::KIND,
        name: name.to_owned(),
    })?;
    let meta = current.meta();
    let uid = meta.uid.as_deref().unwrap_or_default();
    if uid != expected.uid {
        return Err(StoreError::UidMismatch {
            kind: K::KIND,
            name: name.to_owned(),
            expected: expected.uid.clone(),
            message: format!("the object's UID is {uid}"),
        });
    }
    let rv = meta.resource_version.as_deref().unwrap_or_default();
    if rv != expected.resource_version {
        return Err(StoreError::Conflict {
            kind: K::KIND,
            name: name.to_owned(),
            expected: expected.resource_version.clone(),
            message: format!("the object is at resourceVersion {rv}"),
        });
    }
    Ok(current)
}

fn replace<K: PillarObject>(
    map: &mut BTreeMap<String, K>,
    last_rv: &mut u64,
    name: &str,
    revision: &Revision,
    change: impl FnOnce(&mut K),
) -> Result<K, StoreError> {
    let current = expected(map, name, revision)?.clone();
    let mut next = current.clone();
    change(&mut next);
    if next == current {
        return Ok(current);
    }
    if next.spec() != current.spec() {
        let generation = current.meta().generation.unwrap_or(1);
        next.meta_mut().generation = Some(generation.saturating_add(1));
    }
    *last_rv += 1;
    next.meta_mut().resource_version = Some(last_rv.to_string());
    map.insert(name.to_owned(), next.clone());
    Ok(next)
}

fn delete<K: PillarObject>(
    map: &mut BTreeMap<String, K>,
    last_rv: &mut u64,
    name: &str,
    revision: &Revision,
) -> Result<(), StoreError> {
    expected(map, name, revision)?;
    *last_rv += 1;
    map.remove(name);
    Ok(())
}

impl SimStore {
    /// An empty store whose UIDs come from `chaos`.
    pub fn new(chaos: Chaos) -> Arc<Self> {
        Arc::new(Self {
            objects: Mutex::new(Objects::default()),
            chaos,
            credentials: std::sync::Mutex::new(BTreeMap::new()),
        })
    }

    fn objects(&self) -> MutexGuard<'_, Objects> {
        self.objects.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every volume now (for the invariants: no await, so a consistent snapshot).
    pub fn volumes_now(&self) -> BTreeMap<String, PillarVolumeState> {
        self.objects().volumes.clone()
    }
}

#[async_trait]
impl StateStore for SimStore {
    async fn get_volume(&self, name: &str) -> Result<Option<PillarVolumeState>, StoreError> {
        Ok(self.objects().volumes.get(name).cloned())
    }
    async fn list_volumes(&self) -> Result<Vec<PillarVolumeState>, StoreError> {
        Ok(self.objects().volumes.values().cloned().collect())
    }
    async fn create_volume(
        &self,
        name: &str,
        spec: PillarVolumeStateSpec,
    ) -> Result<PillarVolumeState, StoreError> {
        let uid = self.chaos.uuid();
        let o = &mut *self.objects();
        create(&mut o.volumes, &mut o.last_rv, uid, name, spec)
    }
    async fn replace_volume_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarVolumeStateStatus,
    ) -> Result<PillarVolumeState, StoreError> {
        let o = &mut *self.objects();
        replace(&mut o.volumes, &mut o.last_rv, name, expected, |v| {
            v.status = Some(status);
        })
    }
    async fn replace_volume_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarVolumeStateSpec,
    ) -> Result<PillarVolumeState, StoreError> {
        let o = &mut *self.objects();
        replace(&mut o.volumes, &mut o.last_rv, name, expected, |v| {
            v.spec = spec;
        })
    }
    async fn delete_volume(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        let o = &mut *self.objects();
        delete(&mut o.volumes, &mut o.last_rv, name, expected)
    }
    async fn get_snapshot(&self, name: &str) -> Result<Option<PillarSnapshotState>, StoreError> {
        Ok(self.objects().snapshots.get(name).cloned())
    }
    async fn list_snapshots(&self) -> Result<Vec<PillarSnapshotState>, StoreError> {
        Ok(self.objects().snapshots.values().cloned().collect())
    }
    async fn create_snapshot(
        &self,
        name: &str,
        spec: PillarSnapshotStateSpec,
    ) -> Result<PillarSnapshotState, StoreError> {
        let uid = self.chaos.uuid();
        let o = &mut *self.objects();
        create(&mut o.snapshots, &mut o.last_rv, uid, name, spec)
    }
    async fn replace_snapshot_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarSnapshotStateStatus,
    ) -> Result<PillarSnapshotState, StoreError> {
        let o = &mut *self.objects();
        replace(&mut o.snapshots, &mut o.last_rv, name, expected, |v| {
            v.status = Some(status);
        })
    }
    async fn delete_snapshot(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        let o = &mut *self.objects();
        delete(&mut o.snapshots, &mut o.last_rv, name, expected)
    }
    async fn get_agent(&self, name: &str) -> Result<Option<PillarAgent>, StoreError> {
        Ok(self.objects().agents.get(name).cloned())
    }
    async fn list_agents(&self) -> Result<Vec<PillarAgent>, StoreError> {
        Ok(self.objects().agents.values().cloned().collect())
    }
    async fn create_agent(
        &self,
        name: &str,
        spec: PillarAgentSpec,
    ) -> Result<PillarAgent, StoreError> {
        let uid = self.chaos.uuid();
        let o = &mut *self.objects();
        create(&mut o.agents, &mut o.last_rv, uid, name, spec)
    }
    async fn replace_agent_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarAgentSpec,
    ) -> Result<PillarAgent, StoreError> {
        let o = &mut *self.objects();
        replace(&mut o.agents, &mut o.last_rv, name, expected, |a| {
            a.spec = spec;
        })
    }
    async fn replace_agent_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarAgentStatus,
    ) -> Result<PillarAgent, StoreError> {
        let o = &mut *self.objects();
        replace(&mut o.agents, &mut o.last_rv, name, expected, |a| {
            a.status = Some(status);
        })
    }
    async fn delete_agent(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        let o = &mut *self.objects();
        delete(&mut o.agents, &mut o.last_rv, name, expected)
    }
    async fn get_protocol(&self, name: &str) -> Result<Option<PillarProtocol>, StoreError> {
        Ok(self.objects().protocols.get(name).cloned())
    }
    async fn list_protocols(&self) -> Result<Vec<PillarProtocol>, StoreError> {
        Ok(self.objects().protocols.values().cloned().collect())
    }
    async fn create_protocol(
        &self,
        name: &str,
        spec: PillarProtocolSpec,
    ) -> Result<PillarProtocol, StoreError> {
        let uid = self.chaos.uuid();
        let o = &mut *self.objects();
        create(&mut o.protocols, &mut o.last_rv, uid, name, spec)
    }
    async fn replace_protocol_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarProtocolSpec,
    ) -> Result<PillarProtocol, StoreError> {
        let o = &mut *self.objects();
        replace(&mut o.protocols, &mut o.last_rv, name, expected, |p| {
            p.spec = spec;
        })
    }
    async fn delete_protocol(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        let o = &mut *self.objects();
        delete(&mut o.protocols, &mut o.last_rv, name, expected)
    }
    // Events are not part of the records the invariants read; the simulation takes them and
    // keeps none.
    async fn record_volume_event(&self, _event: &VolumeEvent) -> Result<(), StoreError> {
        Ok(())
    }

    async fn node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<pillar_state::credentials::NodeCredentials, StoreError> {
        let mut map = self
            .credentials
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(c) = map.get(node).filter(|c| c.host_nqn == host_nqn) {
            return Ok(c.clone());
        }
        let c =
            pillar_state::credentials::NodeCredentials::generate(node, host_nqn).map_err(|e| {
                StoreError::Embedded(pillar_state::embedded::EmbeddedError::Credentials(e))
            })?;
        map.insert(node.to_owned(), c.clone());
        Ok(c)
    }
}

/// One replica's client of the shared store (see the module documentation).
pub struct ReplicaStore {
    inner: Arc<SimStore>,
    chaos: Chaos,
    replica: usize,
}

impl fmt::Debug for ReplicaStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplicaStore")
            .field("replica", &self.replica)
            .finish_non_exhaustive()
    }
}

impl ReplicaStore {
    /// Replica `replica`'s view of `inner`.
    pub fn new(inner: Arc<SimStore>, chaos: Chaos, replica: usize) -> Arc<Self> {
        Arc::new(Self {
            inner,
            chaos,
            replica,
        })
    }

    /// Before a volume write: maybe stall (others overtake), maybe fail with a conflict.
    async fn before_write(&self, what: &str, name: &str, rv: &Revision) -> Result<(), StoreError> {
        let k = &self.chaos.knobs;
        if self.chaos.strikes(
            Fault::ReplicaPaused,
            k.pause,
            &format!("replica {} stalls before {what} {name}", self.replica),
        ) {
            tokio::time::sleep(self.chaos.pause(300)).await;
        }
        if self.chaos.strikes(
            Fault::StoreConflict,
            k.conflict,
            &format!("replica {}: {what} {name} conflicts", self.replica),
        ) {
            return Err(StoreError::Conflict {
                kind: "PillarVolumeState",
                name: name.to_owned(),
                expected: rv.resource_version.clone(),
                message: "injected conflict".into(),
            });
        }
        Ok(())
    }

    /// After a write landed: maybe stall before the replica acts on it (a token taken, its agent
    /// call not yet sent), long enough for an agent to crash and restart in between.
    async fn after_write(&self, what: &str, name: &str) {
        if self.chaos.strikes(
            Fault::ReplicaPausedAfterWrite,
            self.chaos.knobs.pause_after_write,
            &format!("replica {} stalls after {what} {name}", self.replica),
        ) {
            tokio::time::sleep(self.chaos.pause(2_000)).await;
        }
    }
}

#[async_trait]
impl StateStore for ReplicaStore {
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
        self.before_write("status write", name, expected).await?;
        let written = self
            .inner
            .replace_volume_status(name, expected, status)
            .await?;
        self.after_write("status write", name).await;
        Ok(written)
    }
    async fn replace_volume_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarVolumeStateSpec,
    ) -> Result<PillarVolumeState, StoreError> {
        self.before_write("spec write", name, expected).await?;
        self.inner.replace_volume_spec(name, expected, spec).await
    }
    async fn delete_volume(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        self.before_write("delete", name, expected).await?;
        self.inner.delete_volume(name, expected).await
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
        self.before_write("snapshot status write", name, expected)
            .await?;
        let written = self
            .inner
            .replace_snapshot_status(name, expected, status)
            .await?;
        self.after_write("snapshot status write", name).await;
        Ok(written)
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
    ) -> Result<pillar_state::credentials::NodeCredentials, StoreError> {
        self.inner.node_credentials(node, host_nqn).await
    }
}
