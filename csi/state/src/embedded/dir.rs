//! The state directory under the [`EmbeddedStore`](super::EmbeddedStore): its lock, its
//! resourceVersion counter, one JSON file a record, atomic durable writes (see the parent
//! module's documentation for the layout and rules).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::core::Backing;
use crate::embedded_error::EmbeddedError;
use crate::object::{KINDS, Kind, PillarObject};
use crate::store::StoreError;

const LOCK_FILE: &str = "LOCK";
const COUNTER_FILE: &str = "resource-version";

/// The state directory, open and locked: where the embedded store's records live.
#[derive(Debug)]
pub(super) struct Dir {
    root: PathBuf,
    /// Held for the flock; closing it releases the lock.
    _lock: File,
    /// The last resourceVersion handed out (durable in `resource-version`).
    last_rv: u64,
}

/// A kind's directory: its plural without the `pillar` prefix and the `state` of the record
/// kinds, as the layout has always named them.
const fn kind_dir(plural: &'static str) -> &'static str {
    match plural.as_bytes() {
        b"pillarvolumestates" => "volumes",
        b"pillarsnapshotstates" => "snapshots",
        b"pillaragents" => "agents",
        b"pillarprotocols" => "protocols",
        _ => plural,
    }
}

/// The directories of every kind.
const KIND_DIRS: [&str; 4] = [
    kind_dir(KINDS[0].plural),
    kind_dir(KINDS[1].plural),
    kind_dir(KINDS[2].plural),
    kind_dir(KINDS[3].plural),
];

impl Dir {
    pub(super) fn open(root: PathBuf) -> Result<Self, StoreError> {
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

    /// The last resourceVersion handed out.
    pub(super) fn last_version(&self) -> u64 {
        self.last_rv
    }

    fn path<K: PillarObject>(&self, name: &str) -> PathBuf {
        self.root
            .join(kind_dir(K::PLURAL))
            .join(format!("{name}.json"))
    }

    pub(super) fn read<K: PillarObject>(&self, name: &str) -> Result<Option<K>, EmbeddedError> {
        let path = self.path::<K>(name);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(EmbeddedError::Read { path, source }),
        };
        parse_record::<K>(&path, name, &bytes).map(Some)
    }

    pub(super) fn list<K: PillarObject>(&self) -> Result<Vec<K>, EmbeddedError> {
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

/// The [`core`] rules run on the directory: records are read from disk at every call (so a
/// corrupt file is found when it is used), written atomically, and the counter is durable
/// before the record that carries its value.
impl<K: PillarObject> Backing<K> for Dir {
    type Error = EmbeddedError;
    fn read(&self, _: Kind, name: &str) -> Result<Option<K>, EmbeddedError> {
        Dir::read(self, name)
    }
    fn list(&self, _: Kind) -> Result<Vec<K>, EmbeddedError> {
        Dir::list(self)
    }
    fn write(&mut self, _: Kind, name: &str, obj: &K) -> Result<(), EmbeddedError> {
        Dir::write(self, name, obj)
    }
    fn remove(&mut self, _: Kind, name: &str) -> Result<(), EmbeddedError> {
        let dir = self.root.join(kind_dir(K::PLURAL));
        let path = dir.join(format!("{name}.json"));
        fs::remove_file(&path).map_err(|source| EmbeddedError::Remove { path, source })?;
        sync_dir(&dir)
    }
    fn next_version(&mut self) -> Result<u64, EmbeddedError> {
        let next = self
            .last_rv
            .checked_add(1)
            .ok_or(EmbeddedError::CounterExhausted)?;
        write_atomic(&self.root, COUNTER_FILE, next.to_string().as_bytes())?;
        self.last_rv = next;
        Ok(next)
    }
}
