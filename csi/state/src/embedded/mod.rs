//! [`EmbeddedStore`]: the [`StateStore`] semantics without Kubernetes, for single-machine mode.
//!
//! Layout of the state directory:
//!
//! ```text
//! <dir>/LOCK                 exclusive flock held while the store is open
//! <dir>/resource-version     the last resourceVersion handed out (decimal)
//! <dir>/volumes/<name>.json  one PillarVolumeState per file
//! <dir>/snapshots/<name>.json
//! <dir>/agents/<name>.json   one PillarAgent per file
//! <dir>/protocols/<name>.json
//! ```
//!
//! Each file holds the object exactly as the Kubernetes API would serve it (apiVersion, kind,
//! metadata with uid and resourceVersion, spec, status).
//!
//! Rules:
//! - Only one process may open a directory: [`EmbeddedStore::open`] takes an exclusive `flock` on
//!   `LOCK` and fails with [`EmbeddedError::Locked`] when another holder has it. Two stores on one
//!   directory in one process are refused the same way.
//! - The compare-and-swap rules are [`core`](crate::core)'s, run on the directory
//!   ([`dir`]'s `Backing`): records are read from disk at every call.
//! - resourceVersions come from one counter, monotonically increasing across restarts: the new
//!   counter value is made durable before the object that carries it is written, so an object's
//!   resourceVersion never exceeds the counter and no value is handed out twice, even after a
//!   delete (which takes a value too, as on the API server).
//! - Every write is durable and atomic: temporary file, fsync, rename over the old file, fsync of
//!   the directory. A crash leaves either the old or the new object, never a mix.
//! - An unreadable or corrupt file is an error ([`EmbeddedError::Corrupt`]); nothing substitutes
//!   a default. A missing counter next to existing records is an error too.
//! - Operations are serialised by one async mutex; file I/O runs on the blocking pool.
//! - Events ([`StateStore::record_volume_event`]) are kept in memory, the last
//!   [`EMBEDDED_EVENT_LIMIT`], and logged; [`EmbeddedStore::events`] reads them back. They are
//!   not part of the records and do not survive a restart, as Kubernetes Events expire too.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::Mutex;

use crate::core::{self, Half, Precondition};
use crate::memory::now_whole_seconds;
use crate::object::{Kind, PillarObject};
use crate::store::{ObjectApi, Revision, StateStore, StoreError, VolumeEvent, validate_name};

mod dir;

pub use crate::embedded_error::EmbeddedError;
use dir::Dir;

/// How many events the embedded store keeps (the oldest go first).
pub const EMBEDDED_EVENT_LIMIT: usize = 256;

/// Under the store's directory: the nodes' DH-HMAC-CHAP credentials, one file each (mode 0600).
pub const CREDENTIALS_DIR: &str = "dhchap";

/// The store on a local directory. See the module documentation for the layout and
/// rules.
#[derive(Debug, Clone)]
pub struct EmbeddedStore {
    root: PathBuf,
    dir: Arc<Mutex<Dir>>,
    events: Arc<std::sync::Mutex<VecDeque<VolumeEvent>>>,
}

impl EmbeddedStore {
    /// Opens (creating if needed) the state directory and takes its exclusive lock.
    pub async fn open(root: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let root = root.into();
        let dir = {
            let root = root.clone();
            tokio::task::spawn_blocking(move || Dir::open(root))
                .await
                .map_err(EmbeddedError::Task)??
        };
        tracing::debug!(dir = %root.display(), last_rv = dir.last_version(), "opened embedded state store");
        Ok(Self {
            root,
            dir: Arc::new(Mutex::new(dir)),
            events: Arc::default(),
        })
    }

    /// The events recorded since the store was opened (at most the last
    /// [`EMBEDDED_EVENT_LIMIT`]), oldest first.
    pub fn events(&self) -> Vec<VolumeEvent> {
        self.event_log().iter().cloned().collect()
    }

    fn event_log(&self) -> std::sync::MutexGuard<'_, VecDeque<VolumeEvent>> {
        // A panic while holding the lock leaves a plain list behind; keep using it.
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The state directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    async fn run<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Dir) -> Result<T, StoreError> + Send + 'static,
    {
        let mut guard = Arc::clone(&self.dir).lock_owned().await;
        tokio::task::spawn_blocking(move || f(&mut guard))
            .await
            .map_err(EmbeddedError::Task)?
    }
}

#[async_trait]
impl<K: PillarObject> ObjectApi<K> for EmbeddedStore {
    async fn get(&self, name: &str) -> Result<Option<K>, StoreError> {
        validate_name(K::KIND, name)?;
        let name = name.to_owned();
        self.run(move |d| Ok(d.read::<K>(&name)?)).await
    }

    async fn list(&self) -> Result<Vec<K>, StoreError> {
        self.run(|d| Ok(d.list::<K>()?)).await
    }

    async fn create(&self, name: &str, spec: K::Spec) -> Result<K, StoreError> {
        validate_name(K::KIND, name)?;
        let name = name.to_owned();
        let mut obj = K::build(&name, spec);
        obj.meta_mut().creation_timestamp = Some(now_whole_seconds());
        let uid = uuid::Uuid::new_v4().to_string();
        self.run(move |d| core::create(d, Kind::of::<K>(), &name, obj, uid, |_| Ok(())))
            .await
    }

    async fn replace_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: K::Spec,
    ) -> Result<K, StoreError> {
        self.replace(name, expected, Half::Spec, move |k: &mut K| {
            k.set_spec(spec)
        })
        .await
    }

    async fn replace_status(
        &self,
        name: &str,
        expected: &Revision,
        status: K::Status,
    ) -> Result<K, StoreError> {
        self.replace(name, expected, Half::Status, move |k: &mut K| {
            k.set_status(Some(status));
        })
        .await
    }

    async fn delete(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        validate_name(K::KIND, name)?;
        let name = name.to_owned();
        let expected = expected.clone();
        self.run(move |d| {
            core::delete::<K, _, StoreError>(d, Kind::of::<K>(), &name, (&expected).into())?;
            Ok(())
        })
        .await
    }
}

impl EmbeddedStore {
    async fn replace<K: PillarObject>(
        &self,
        name: &str,
        expected: &Revision,
        half: Half,
        change: impl FnOnce(&mut K) + Send + 'static,
    ) -> Result<K, StoreError> {
        validate_name(K::KIND, name)?;
        let name = name.to_owned();
        let expected = expected.clone();
        self.run(move |d| {
            let candidate = |current: &K| {
                let mut next = current.clone();
                change(&mut next);
                next
            };
            let pre = Precondition::from(&expected);
            core::replace(d, Kind::of::<K>(), &name, pre, half, candidate, |_| Ok(()))
        })
        .await
    }
}

#[async_trait]
impl StateStore for EmbeddedStore {
    async fn record_volume_event(&self, event: &VolumeEvent) -> Result<(), StoreError> {
        validate_name(crate::crd::PillarVolumeState::KIND, &event.volume)?;
        tracing::info!(volume = %event.volume, event_type = event.type_.as_str(), reason = %event.reason, action = %event.action, note = %event.bounded_note(), "event");
        let mut log = self.event_log();
        if log.len() >= EMBEDDED_EVENT_LIMIT {
            log.pop_front();
        }
        log.push_back(VolumeEvent {
            note: event.bounded_note().to_owned(),
            ..event.clone()
        });
        Ok(())
    }

    async fn node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<crate::credentials::NodeCredentials, StoreError> {
        let (node, host_nqn) = (node.to_owned(), host_nqn.to_owned());
        let dir = self.root.join(CREDENTIALS_DIR);
        // Under the store's lock: two publications of one node make one pair.
        self.run(move |_| Ok(crate::credentials::get_or_create(&dir, &node, &host_nqn)?))
            .await
    }

    async fn stored_node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<Option<crate::credentials::NodeCredentials>, StoreError> {
        let (node, host_nqn) = (node.to_owned(), host_nqn.to_owned());
        let dir = self.root.join(CREDENTIALS_DIR);
        self.run(move |_| {
            let stored = crate::credentials::read(&dir, &node)?;
            Ok(stored.filter(|c| c.host_nqn == host_nqn))
        })
        .await
    }

    async fn rotate_node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<crate::credentials::NodeCredentials, StoreError> {
        let (node, host_nqn) = (node.to_owned(), host_nqn.to_owned());
        let dir = self.root.join(CREDENTIALS_DIR);
        self.run(move |_| {
            let fresh = crate::credentials::NodeCredentials::generate(&node, &host_nqn)?;
            crate::credentials::write(&dir, &fresh)?;
            Ok(fresh)
        })
        .await
    }
}
