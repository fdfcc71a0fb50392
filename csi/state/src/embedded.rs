//! [`EmbeddedStore`]: the [`StateStore`] semantics without Kubernetes, for single-machine mode.
//!
//! Layout of the state directory:
//!
//! ```text
//! <dir>/LOCK                 exclusive flock held while the store is open
//! <dir>/resource-version     the last resourceVersion handed out (decimal)
//! <dir>/volumes/<name>.json  one PillarVolumeState per file
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
//! - resourceVersions come from one counter, monotonically increasing across restarts: the new
//!   counter value is made durable before the object that carries it is written, so an object's
//!   resourceVersion never exceeds the counter and no value is handed out twice, even after a
//!   delete.
//! - Every write is durable and atomic: temporary file, fsync, rename over the old file, fsync of
//!   the directory. A crash leaves either the old or the new object, never a mix.
//! - An unreadable or corrupt file is an error ([`EmbeddedError::Corrupt`]); nothing substitutes
//!   a default. A missing counter next to existing records is an error too.
//! - Operations are serialised by one async mutex; file I/O runs on the blocking pool.
//! - Events ([`StateStore::record_volume_event`]) are kept in memory, the last
//!   [`EMBEDDED_EVENT_LIMIT`], and logged; [`EmbeddedStore::events`] reads them back. They are
//!   not part of the records and do not survive a restart, as Kubernetes Events expire too.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use tokio::sync::Mutex;

use crate::crd::{
    PillarAgent, PillarAgentSpec, PillarAgentStatus, PillarProtocol, PillarProtocolSpec,
    PillarSnapshotState, PillarSnapshotStateSpec, PillarSnapshotStateStatus, PillarVolumeState,
    PillarVolumeStateSpec, PillarVolumeStateStatus,
};
use crate::store::{PillarObject, Revision, StateStore, StoreError, VolumeEvent, validate_name};

const LOCK_FILE: &str = "LOCK";
const COUNTER_FILE: &str = "resource-version";

/// How many events the embedded store keeps (the oldest go first).
pub const EMBEDDED_EVENT_LIMIT: usize = 256;

/// Why the embedded store failed on disk.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EmbeddedError {
    /// A node's DH-HMAC-CHAP credentials (under `dhchap/`) could not be read or made.
    #[error(transparent)]
    Credentials(crate::credentials::CredentialsError),
    /// Creating the state directory or one of its subdirectories failed.
    #[error("create state directory {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Opening the lock file failed.
    #[error("open lock file {path}")]
    OpenLock {
        /// The lock file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Another process (or another store in this process) has the directory open.
    #[error("state directory {path} is in use: another process holds the lock on {path}/LOCK")]
    Locked {
        /// The state directory.
        path: PathBuf,
    },
    /// Taking the lock failed for a reason other than contention.
    #[error("lock {path}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Reading a file or directory failed.
    #[error("read {path}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A record does not parse as its kind.
    #[error("{path} is not a valid {kind} record")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The expected kind.
        kind: &'static str,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A record parses but contradicts its file name or lacks store-assigned metadata.
    #[error("{path} is not a valid {kind} record: {reason}")]
    Inconsistent {
        /// The file.
        path: PathBuf,
        /// The expected kind.
        kind: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The resourceVersion counter file does not hold a decimal number.
    #[error("{path} holds {found:?}, not a resourceVersion")]
    CorruptCounter {
        /// The counter file.
        path: PathBuf,
        /// What it holds.
        found: String,
    },
    /// Records exist but the counter file does not: the next resourceVersion cannot be proven
    /// higher than every one handed out before.
    #[error("{path} is missing although the state directory holds records")]
    MissingCounter {
        /// The counter file.
        path: PathBuf,
    },
    /// The counter reached `u64::MAX`.
    #[error("the resourceVersion counter is exhausted")]
    CounterExhausted,
    /// Serialising an object failed.
    #[error("encode {kind} {name:?}")]
    Encode {
        /// Kind.
        kind: &'static str,
        /// Name.
        name: String,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// Writing or fsyncing a temporary file failed.
    #[error("write {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Renaming a temporary file over its target failed.
    #[error("rename {from} to {to}")]
    Rename {
        /// The temporary file.
        from: PathBuf,
        /// The target.
        to: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Removing a record failed.
    #[error("remove {path}")]
    Remove {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Fsyncing a directory failed.
    #[error("fsync directory {path}")]
    SyncDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The blocking task running the file operations panicked or was cancelled.
    #[error("the state directory task failed")]
    Task(#[source] tokio::task::JoinError),
}

/// The [`StateStore`] on a local directory. See the module documentation for the layout and
/// rules.
#[derive(Debug, Clone)]
pub struct EmbeddedStore {
    root: PathBuf,
    dir: Arc<Mutex<Dir>>,
    events: Arc<std::sync::Mutex<VecDeque<VolumeEvent>>>,
}

#[derive(Debug)]
struct Dir {
    root: PathBuf,
    /// Held for the flock; closing it releases the lock.
    _lock: File,
    /// The last resourceVersion handed out (durable in `resource-version`).
    last_rv: u64,
}

/// Under the store's directory: the nodes' DH-HMAC-CHAP credentials, one file each (mode 0600).
pub const CREDENTIALS_DIR: &str = "dhchap";

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
        tracing::debug!(dir = %root.display(), last_rv = dir.last_rv, "opened embedded state store");
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

    async fn get<K: PillarObject>(&self, name: &str) -> Result<Option<K>, StoreError> {
        validate_name(K::KIND, name)?;
        let name = name.to_owned();
        self.run(move |d| Ok(d.read::<K>(&name)?)).await
    }

    async fn list<K: PillarObject>(&self) -> Result<Vec<K>, StoreError> {
        self.run(|d| Ok(d.list::<K>()?)).await
    }

    async fn create<K: PillarObject>(&self, name: &str, spec: K::Spec) -> Result<K, StoreError> {
        validate_name(K::KIND, name)?;
        let name = name.to_owned();
        self.run(move |d| d.create::<K>(&name, spec)).await
    }

    async fn replace<K, F>(
        &self,
        name: &str,
        expected: &Revision,
        change: F,
    ) -> Result<K, StoreError>
    where
        K: PillarObject,
        F: FnOnce(&mut K) + Send + 'static,
    {
        validate_name(K::KIND, name)?;
        let name = name.to_owned();
        let expected = expected.clone();
        self.run(move |d| d.replace::<K, F>(&name, &expected, change))
            .await
    }

    async fn delete<K: PillarObject>(
        &self,
        name: &str,
        expected: &Revision,
    ) -> Result<(), StoreError> {
        validate_name(K::KIND, name)?;
        let name = name.to_owned();
        let expected = expected.clone();
        self.run(move |d| d.delete::<K>(&name, &expected)).await
    }
}

fn kind_dir(plural: &'static str) -> &'static str {
    match plural {
        "pillarvolumestates" => "volumes",
        "pillarsnapshotstates" => "snapshots",
        "pillaragents" => "agents",
        "pillarprotocols" => "protocols",
        other => other,
    }
}

const KIND_DIRS: [&str; 4] = ["volumes", "snapshots", "agents", "protocols"];

impl Dir {
    fn open(root: PathBuf) -> Result<Self, StoreError> {
        fs::create_dir_all(&root).map_err(|source| EmbeddedError::CreateDir {
            path: root.clone(),
            source,
        })?;
        let lock_path = root.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|source| EmbeddedError::OpenLock {
                path: lock_path.clone(),
                source,
            })?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(EmbeddedError::Locked { path: root }.into());
            }
            Err(fs::TryLockError::Error(source)) => {
                return Err(EmbeddedError::Lock {
                    path: lock_path,
                    source,
                }
                .into());
            }
        }
        let mut created = false;
        for sub in KIND_DIRS {
            let path = root.join(sub);
            if !path.is_dir() {
                fs::create_dir(&path).map_err(|source| EmbeddedError::CreateDir {
                    path: path.clone(),
                    source,
                })?;
                created = true;
            }
        }
        if created {
            sync_dir(&root)?;
        }
        let counter = root.join(COUNTER_FILE);
        let last_rv = match fs::read_to_string(&counter) {
            Ok(text) => text
                .trim()
                .parse::<u64>()
                .map_err(|_| EmbeddedError::CorruptCounter {
                    path: counter.clone(),
                    found: text.clone(),
                })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                for sub in KIND_DIRS {
                    if !record_files(&root.join(sub))?.is_empty() {
                        return Err(EmbeddedError::MissingCounter { path: counter }.into());
                    }
                }
                0
            }
            Err(source) => {
                return Err(EmbeddedError::Read {
                    path: counter,
                    source,
                }
                .into());
            }
        };
        Ok(Self {
            root,
            _lock: lock,
            last_rv,
        })
    }

    fn path<K: PillarObject>(&self, name: &str) -> PathBuf {
        self.root
            .join(kind_dir(K::PLURAL))
            .join(format!("{name}.json"))
    }

    fn read<K: PillarObject>(&self, name: &str) -> Result<Option<K>, EmbeddedError> {
        let path = self.path::<K>(name);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(EmbeddedError::Read { path, source }),
        };
        parse_record::<K>(&path, name, &bytes).map(Some)
    }

    fn list<K: PillarObject>(&self) -> Result<Vec<K>, EmbeddedError> {
        let dir = self.root.join(kind_dir(K::PLURAL));
        let mut out = Vec::new();
        for name in record_files(&dir)? {
            // A file may not vanish under us: the lock serialises every writer.
            let path = dir.join(format!("{name}.json"));
            let bytes = fs::read(&path).map_err(|source| EmbeddedError::Read {
                path: path.clone(),
                source,
            })?;
            out.push(parse_record::<K>(&path, &name, &bytes)?);
        }
        Ok(out)
    }

    fn next_rv(&mut self) -> Result<String, EmbeddedError> {
        let next = self
            .last_rv
            .checked_add(1)
            .ok_or(EmbeddedError::CounterExhausted)?;
        write_atomic(&self.root, COUNTER_FILE, next.to_string().as_bytes())?;
        self.last_rv = next;
        Ok(next.to_string())
    }

    fn write<K: PillarObject>(&self, name: &str, obj: &K) -> Result<(), EmbeddedError> {
        let bytes = serde_json::to_vec_pretty(obj).map_err(|source| EmbeddedError::Encode {
            kind: K::KIND,
            name: name.to_owned(),
            source,
        })?;
        write_atomic(
            &self.root.join(kind_dir(K::PLURAL)),
            &format!("{name}.json"),
            &bytes,
        )
    }

    fn create<K: PillarObject>(&mut self, name: &str, spec: K::Spec) -> Result<K, StoreError> {
        if self.read::<K>(name)?.is_some() {
            return Err(StoreError::AlreadyExists {
                kind: K::KIND,
                name: name.to_owned(),
            });
        }
        let mut obj = K::build(name, spec);
        let rv = self.next_rv()?;
        let meta = obj.meta_mut();
        meta.uid = Some(uuid::Uuid::new_v4().to_string());
        meta.resource_version = Some(rv);
        meta.generation = Some(1);
        meta.creation_timestamp = Some(now_whole_seconds());
        self.write(name, &obj)?;
        Ok(obj)
    }

    /// Fetches `name` and checks it is still `expected`, in the API server's order: absent, then
    /// UID, then resourceVersion.
    fn fetch_expected<K: PillarObject>(
        &self,
        name: &str,
        expected: &Revision,
    ) -> Result<K, StoreError> {
        let current = self.read::<K>(name)?.ok_or_else(|| StoreError::NotFound {
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

    fn replace<K, F>(&mut self, name: &str, expected: &Revision, change: F) -> Result<K, StoreError>
    where
        K: PillarObject,
        F: FnOnce(&mut K),
    {
        let current = self.fetch_expected::<K>(name, expected)?;
        let mut next = current.clone();
        change(&mut next);
        if next == current {
            // As the API server: a write that changes nothing keeps the resourceVersion.
            return Ok(current);
        }
        if next.spec() != current.spec() {
            let generation = current.meta().generation.unwrap_or(1);
            next.meta_mut().generation = Some(generation.saturating_add(1));
        }
        next.meta_mut().resource_version = Some(self.next_rv()?);
        self.write(name, &next)?;
        Ok(next)
    }

    fn delete<K: PillarObject>(
        &mut self,
        name: &str,
        expected: &Revision,
    ) -> Result<(), StoreError> {
        self.fetch_expected::<K>(name, expected)?;
        let dir = self.root.join(kind_dir(K::PLURAL));
        let path = dir.join(format!("{name}.json"));
        fs::remove_file(&path).map_err(|source| EmbeddedError::Remove { path, source })?;
        sync_dir(&dir)?;
        Ok(())
    }
}

/// Now, at the one-second precision the API's `Time` is serialised with, so that the object
/// returned by create equals the one read back.
fn now_whole_seconds() -> Time {
    use k8s_openapi::jiff::Timestamp;
    let now = Timestamp::now();
    Time(Timestamp::from_second(now.as_second()).unwrap_or(now))
}

/// Names of the records in one kind directory, sorted; temporary files (dot files) are skipped.
fn record_files(dir: &Path) -> Result<Vec<String>, EmbeddedError> {
    let entries = fs::read_dir(dir).map_err(|source| EmbeddedError::Read {
        path: dir.to_owned(),
        source,
    })?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| EmbeddedError::Read {
            path: dir.to_owned(),
            source,
        })?;
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        if file_name.starts_with('.') {
            continue;
        }
        if let Some(name) = file_name.strip_suffix(".json") {
            names.push(name.to_owned());
        }
    }
    names.sort();
    Ok(names)
}

fn parse_record<K: PillarObject>(
    path: &Path,
    name: &str,
    bytes: &[u8],
) -> Result<K, EmbeddedError> {
    let obj: K = serde_json::from_slice(bytes).map_err(|source| EmbeddedError::Corrupt {
        path: path.to_owned(),
        kind: K::KIND,
        source,
    })?;
    let inconsistent = |reason: String| EmbeddedError::Inconsistent {
        path: path.to_owned(),
        kind: K::KIND,
        reason,
    };
    let meta = obj.meta();
    if meta.name.as_deref() != Some(name) {
        return Err(inconsistent(format!(
            "metadata.name is {:?}, the file is named for {name:?}",
            meta.name
        )));
    }
    if meta.uid.as_deref().is_none_or(str::is_empty) {
        return Err(inconsistent("metadata.uid is missing".into()));
    }
    if meta
        .resource_version
        .as_deref()
        .is_none_or(|rv| rv.parse::<u64>().is_err())
    {
        return Err(inconsistent(format!(
            "metadata.resourceVersion {:?} is not a resourceVersion",
            meta.resource_version
        )));
    }
    Ok(obj)
}

/// Writes `dir/file` atomically and durably: `dir/.file.tmp`, fsync, rename, fsync `dir`.
fn write_atomic(dir: &Path, file: &str, bytes: &[u8]) -> Result<(), EmbeddedError> {
    let tmp = dir.join(format!(".{file}.tmp"));
    let target = dir.join(file);
    let write = |path: &Path| -> io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    write(&tmp).map_err(|source| EmbeddedError::Write {
        path: tmp.clone(),
        source,
    })?;
    fs::rename(&tmp, &target).map_err(|source| EmbeddedError::Rename {
        from: tmp,
        to: target,
        source,
    })?;
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<(), EmbeddedError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| EmbeddedError::SyncDir {
            path: dir.to_owned(),
            source,
        })
}

#[async_trait]
impl StateStore for EmbeddedStore {
    async fn get_volume(&self, name: &str) -> Result<Option<PillarVolumeState>, StoreError> {
        self.get(name).await
    }
    async fn list_volumes(&self) -> Result<Vec<PillarVolumeState>, StoreError> {
        self.list().await
    }
    async fn create_volume(
        &self,
        name: &str,
        spec: PillarVolumeStateSpec,
    ) -> Result<PillarVolumeState, StoreError> {
        self.create::<PillarVolumeState>(name, spec).await
    }
    async fn replace_volume_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarVolumeStateStatus,
    ) -> Result<PillarVolumeState, StoreError> {
        self.replace(name, expected, move |v: &mut PillarVolumeState| {
            v.status = Some(status);
        })
        .await
    }
    async fn replace_volume_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarVolumeStateSpec,
    ) -> Result<PillarVolumeState, StoreError> {
        self.replace(name, expected, move |v: &mut PillarVolumeState| {
            v.spec = spec
        })
        .await
    }
    async fn delete_volume(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        self.delete::<PillarVolumeState>(name, expected).await
    }

    async fn get_snapshot(&self, name: &str) -> Result<Option<PillarSnapshotState>, StoreError> {
        self.get(name).await
    }
    async fn list_snapshots(&self) -> Result<Vec<PillarSnapshotState>, StoreError> {
        self.list().await
    }
    async fn create_snapshot(
        &self,
        name: &str,
        spec: PillarSnapshotStateSpec,
    ) -> Result<PillarSnapshotState, StoreError> {
        self.create::<PillarSnapshotState>(name, spec).await
    }
    async fn replace_snapshot_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarSnapshotStateStatus,
    ) -> Result<PillarSnapshotState, StoreError> {
        self.replace(name, expected, move |v: &mut PillarSnapshotState| {
            v.status = Some(status);
        })
        .await
    }
    async fn delete_snapshot(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        self.delete::<PillarSnapshotState>(name, expected).await
    }

    async fn get_agent(&self, name: &str) -> Result<Option<PillarAgent>, StoreError> {
        self.get(name).await
    }
    async fn list_agents(&self) -> Result<Vec<PillarAgent>, StoreError> {
        self.list().await
    }
    async fn create_agent(
        &self,
        name: &str,
        spec: PillarAgentSpec,
    ) -> Result<PillarAgent, StoreError> {
        self.create::<PillarAgent>(name, spec).await
    }
    async fn replace_agent_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarAgentSpec,
    ) -> Result<PillarAgent, StoreError> {
        self.replace(name, expected, move |a: &mut PillarAgent| a.spec = spec)
            .await
    }
    async fn replace_agent_status(
        &self,
        name: &str,
        expected: &Revision,
        status: PillarAgentStatus,
    ) -> Result<PillarAgent, StoreError> {
        self.replace(name, expected, move |a: &mut PillarAgent| {
            a.status = Some(status);
        })
        .await
    }
    async fn delete_agent(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        self.delete::<PillarAgent>(name, expected).await
    }

    async fn get_protocol(&self, name: &str) -> Result<Option<PillarProtocol>, StoreError> {
        self.get(name).await
    }
    async fn list_protocols(&self) -> Result<Vec<PillarProtocol>, StoreError> {
        self.list().await
    }
    async fn create_protocol(
        &self,
        name: &str,
        spec: PillarProtocolSpec,
    ) -> Result<PillarProtocol, StoreError> {
        self.create::<PillarProtocol>(name, spec).await
    }
    async fn replace_protocol_spec(
        &self,
        name: &str,
        expected: &Revision,
        spec: PillarProtocolSpec,
    ) -> Result<PillarProtocol, StoreError> {
        self.replace(name, expected, move |p: &mut PillarProtocol| p.spec = spec)
            .await
    }
    async fn delete_protocol(&self, name: &str, expected: &Revision) -> Result<(), StoreError> {
        self.delete::<PillarProtocol>(name, expected).await
    }

    async fn record_volume_event(&self, event: &VolumeEvent) -> Result<(), StoreError> {
        validate_name(<PillarVolumeState as PillarObject>::KIND, &event.volume)?;
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
        self.run(move |d| {
            crate::credentials::get_or_create(&d.root.join(CREDENTIALS_DIR), &node, &host_nqn)
                .map_err(|e| StoreError::Embedded(EmbeddedError::Credentials(e)))
        })
        .await
    }

    async fn rotate_node_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<crate::credentials::NodeCredentials, StoreError> {
        let (node, host_nqn) = (node.to_owned(), host_nqn.to_owned());
        self.run(move |d| {
            let fresh =
                crate::credentials::NodeCredentials::generate(&node, &host_nqn).and_then(|c| {
                    crate::credentials::write(&d.root.join(CREDENTIALS_DIR), &c).map(|()| c)
                });
            fresh.map_err(|e| StoreError::Embedded(EmbeddedError::Credentials(e)))
        })
        .await
    }
}
