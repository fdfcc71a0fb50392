//! [`MemoryStore`]: the store in memory, on the [`core`](crate::core) rules and its [`Memory`]
//! tables, for the simulation and tests.
//!
//! Records are kept as the JSON the Kubernetes API serves (the same tables the API server test
//! double keeps) and converted to and from their kind at each call. Every call takes one lock and
//! never awaits inside it, so each is atomic. Where UIDs and creation times come from is the
//! caller's: random and the wall clock by default, from a seed and a fixed instant in the
//! simulation ([`MemoryStore::deterministic`]), so one seed is one run.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::core::{self, Half, Memory, Object, Precondition};
use crate::object::{Kind, PillarObject};
use crate::store::{ObjectApi, Revision, StateStore, StoreError, VolumeEvent, validate_name};

type Uids = Box<dyn Fn() -> String + Send + Sync>;

/// See the module documentation.
pub struct MemoryStore {
    core: Mutex<Memory>,
    uids: Uids,
    /// The creation time stamped on new records; `None`: the wall clock.
    created_at: Option<Time>,
    /// Nodes' DH-HMAC-CHAP credentials (W10), made on first use as the embedded store does
    /// (the key bytes come from the OS: they steer nothing a seed replays).
    credentials: Mutex<BTreeMap<String, crate::credentials::NodeCredentials>>,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("last_version", &self.core().last_version())
            .finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

/// A record as JSON (what the core keeps).
fn to_object<K: PillarObject>(obj: &K) -> Result<Object, StoreError> {
    let json = |source| StoreError::Json {
        kind: K::KIND,
        source,
    };
    match serde_json::to_value(obj).map_err(json)? {
        serde_json::Value::Object(o) => Ok(o),
        _ => Err(json(serde::ser::Error::custom("not a JSON object"))),
    }
}

/// A record of the core as its kind.
fn from_object<K: PillarObject>(obj: Object) -> Result<K, StoreError> {
    serde_json::from_value(serde_json::Value::Object(obj)).map_err(|source| StoreError::Json {
        kind: K::KIND,
        source,
    })
}

impl MemoryStore {
    /// An empty store with random UIDs and wall-clock creation times.
    pub fn new() -> Self {
        Self {
            core: Mutex::new(Memory::default()),
            uids: Box::new(|| uuid::Uuid::new_v4().to_string()),
            created_at: None,
            credentials: Mutex::default(),
        }
    }

    /// An empty store whose UIDs come from `uids` and whose records are all created at the Unix
    /// epoch: nothing of the wall clock or the OS's randomness gets in.
    pub fn deterministic(uids: impl Fn() -> String + Send + Sync + 'static) -> Self {
        Self {
            core: Mutex::new(Memory::default()),
            uids: Box::new(uids),
            created_at: Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)),
            credentials: Mutex::default(),
        }
    }

    fn core(&self) -> MutexGuard<'_, Memory> {
        // A panic while holding the lock leaves plain data behind; keep using it.
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every record of kind `K` now, by name: one consistent view, no await.
    pub fn records<K: PillarObject>(&self) -> Result<BTreeMap<String, K>, StoreError> {
        let objects: Vec<Object> = self.core().records(K::PLURAL).cloned().collect();
        objects
            .into_iter()
            .map(|o| {
                let obj: K = from_object(o)?;
                Ok((obj.meta().name.clone().unwrap_or_default(), obj))
            })
            .collect()
    }

    fn creation_time(&self) -> Time {
        self.created_at.clone().unwrap_or_else(now_whole_seconds)
    }

    fn replace<K: PillarObject>(
        &self,
        name: &str,
        expected: &Revision,
        half: Half,
        change: impl FnOnce(&mut K),
    ) -> Result<K, StoreError> {
        validate_name(K::KIND, name)?;
        let mut failed = None;
        let candidate = |current: &Object| {
            let next = from_object::<K>(current.clone()).and_then(|mut obj| {
                change(&mut obj);
                to_object(&obj)
            });
            next.unwrap_or_else(|e| {
                failed = Some(e);
                current.clone()
            })
        };
        let written = core::replace(
            &mut *self.core(),
            Kind::of::<K>(),
            name,
            Precondition::from(expected),
            half,
            candidate,
            |_| Ok::<_, StoreError>(()),
        );
        if let Some(e) = failed {
            return Err(e);
        }
        from_object(written?)
    }
}

/// Now, at the one-second precision the API's `Time` is serialised with, so that the object
/// returned by create equals the one read back.
pub(crate) fn now_whole_seconds() -> Time {
    use k8s_openapi::jiff::Timestamp;
    let now = Timestamp::now();
    Time(Timestamp::from_second(now.as_second()).unwrap_or(now))
}

#[async_trait]
impl<K: PillarObject> ObjectApi<K> for MemoryStore {
    async fn get(&self, name: &str) -> Result<Option<K>, StoreError> {
        validate_name(K::KIND, name)?;
        let obj = self.core().get(K::PLURAL, name).cloned();
        obj.map(from_object).transpose()
    }

    async fn list(&self) -> Result<Vec<K>, StoreError> {
        let objects: Vec<Object> = self.core().records(K::PLURAL).cloned().collect();
        objects.into_iter().map(from_object).collect()
    }

    async fn create(&self, name: &str, spec: K::Spec) -> Result<K, StoreError> {
        // The UID is drawn first, whatever the outcome: a seeded generator then draws the same
        // sequence whichever calls fail.
        let uid = (self.uids)();
        validate_name(K::KIND, name)?;
        let mut obj = K::build(name, spec);
        obj.meta_mut().creation_timestamp = Some(self.creation_time());
        let obj = to_object(&obj)?;
        let created = core::create(&mut *self.core(), Kind::of::<K>(), name, obj, uid, |_| {
            Ok::<_, StoreError>(())
        })?;
        from_object(created)
    }

    async fn replace_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: K::Spec,
    ) -> Result<K, StoreError> {
        self.replace(name, expected, Half::Spec, |obj: &mut K| obj.set_spec(spec))
    }

    async fn replace_status(
        &self,
        name: &str,
        expected: &Revision,
        status: K::Status,
    ) -> Result<K, StoreError> {
        self.replace(name, expected, Half::Status, |obj: &mut K| {
            obj.set_status(Some(status));
        })
    }

    async fn delete(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        validate_name(K::KIND, name)?;
        core::delete::<Object, _, StoreError>(
            &mut *self.core(),
            Kind::of::<K>(),
            name,
            Precondition::from(expected),
        )?;
        Ok(())
    }
}

// Events are not records: the memory store checks the name and keeps none.
#[async_trait]
impl StateStore for MemoryStore {
    async fn record_volume_event(&self, event: &VolumeEvent) -> Result<(), StoreError> {
        validate_name(crate::crd::PillarVolumeState::KIND, &event.volume)?;
        tracing::debug!(volume = %event.volume, reason = %event.reason, "event (not kept)");
        Ok(())
    }

    async fn node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<crate::credentials::NodeCredentials, StoreError> {
        let mut map = self
            .credentials
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = map.get(node).filter(|c| c.host_nqn == host_nqn) {
            return Ok(c.clone());
        }
        let c = crate::credentials::NodeCredentials::generate(node, host_nqn)?;
        map.insert(node.to_owned(), c.clone());
        Ok(c)
    }

    async fn stored_node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<Option<crate::credentials::NodeCredentials>, StoreError> {
        let map = self
            .credentials
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Ok(map.get(node).filter(|c| c.host_nqn == host_nqn).cloned())
    }

    async fn rotate_node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<crate::credentials::NodeCredentials, StoreError> {
        let c = crate::credentials::NodeCredentials::generate(node, host_nqn)?;
        let mut map = self
            .credentials
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        map.insert(node.to_owned(), c.clone());
        Ok(c)
    }
}
