//! The plain-file backend: one sparse file `<dir>/<volume-id>.img` per volume, exported as it
//! is (nvmet serves a regular file as a namespace's `device_path`), with no loop device.
//!
//! It exists for the deterministic simulation (`pillar-sim`) and tests on machines without loop
//! devices; the agent's command line does not offer it. The file is the volume: its length is
//! the volume size. Unlike the `file` backend it does not fsync (a simulation has no power
//! loss), and it needs nothing from the kernel but a directory.
//!
//! Invariants it shares with every backend: sizes are checked and rounded (1 MiB); `create` and
//! `delete` are idempotent; `create` of an existing volume with another size is
//! [`BackendError::SizeMismatch`]; a volume never shrinks; only `<volume-id>.img` files are
//! listed or removed.

use std::fs::{self, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use pillar_nvmet::VolumeId;

use super::{
    BackendError, Capacity, ContentSource, CopyInto, CopyPolicy, MIB, SnapshotInfo, VolumeInfo,
    checked_size, copy,
};

/// Sparse files exported directly.
#[derive(Debug, Clone)]
pub struct PlainFileBackend {
    pool: String,
    dir: PathBuf,
}

/// Nominal capacity reported: the files are sparse and the simulation never fills them.
const CAPACITY: u64 = 1 << 40;

fn io_err(step: &'static str, path: &Path) -> impl FnOnce(io::Error) -> BackendError {
    let path = path.to_owned();
    move |source| BackendError::Io { step, path, source }
}

impl PlainFileBackend {
    /// A backend for the existing directory `dir`.
    pub fn new(pool: &str, dir: &Path) -> Result<Self, BackendError> {
        if !dir.is_dir() {
            return Err(BackendError::InvalidConfig {
                pool: pool.to_owned(),
                reason: format!("{} is not a directory", dir.display()),
            });
        }
        Ok(Self {
            pool: pool.to_owned(),
            dir: dir.to_owned(),
        })
    }

    /// Allocation granularity: 1 MiB.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn round_size(&self, size_bytes: u64) -> u64 {
        super::round_up(size_bytes, MIB)
    }

    fn path(&self, volume: &VolumeId) -> PathBuf {
        self.dir.join(format!("{volume}.img"))
    }

    async fn blocking<T, F>(&self, f: F) -> Result<T, BackendError>
    where
        T: Send + 'static,
        F: FnOnce(Self) -> Result<T, BackendError> + Send + 'static,
    {
        let me = self.clone();
        crate::blocking::spawn(move || f(me))
            .await
            .map_err(BackendError::Cancelled)?
    }

    fn info(&self, volume: &VolumeId) -> Result<Option<VolumeInfo>, BackendError> {
        let path = self.path(volume);
        match fs::metadata(&path) {
            Ok(m) => Ok(Some(VolumeInfo {
                volume: volume.clone(),
                size_bytes: m.len(),
                device_path: path,
            })),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("stat the volume file", &path)(e)),
        }
    }

    /// Whether a volume file can be reflinked to where a copy `into` goes (probed each time:
    /// a directory can be remounted, and `.snapshots` may be another file system).
    pub async fn copies_at_once(&self, into: CopyInto) -> Result<bool, BackendError> {
        self.blocking(move |me| {
            let to = match into {
                CopyInto::Volume => me.dir.clone(),
                CopyInto::Snapshot => copy::ensure_snapshot_dir(&me.dir)?,
            };
            Ok(copy::reflink_supported_between(&me.dir, &to)?)
        })
        .await
    }

    pub async fn create_snapshot(
        &self,
        source: &VolumeId,
        snapshot: &VolumeId,
        policy: CopyPolicy,
    ) -> Result<SnapshotInfo, BackendError> {
        let (source, snapshot) = (source.clone(), snapshot.clone());
        self.blocking(move |me| {
            copy::cut_snapshot(&me.dir, &source, &me.path(&source), &snapshot, policy)
        })
        .await
    }

    pub async fn lookup_snapshot(
        &self,
        snapshot: &VolumeId,
    ) -> Result<Option<SnapshotInfo>, BackendError> {
        let snapshot = snapshot.clone();
        self.blocking(move |me| copy::find_snapshot(&me.dir, &snapshot))
            .await
    }

    pub async fn delete_snapshot(&self, snapshot: &VolumeId) -> Result<(), BackendError> {
        let snapshot = snapshot.clone();
        self.blocking(move |me| copy::remove_snapshot(&me.dir, &snapshot))
            .await
    }

    /// Fills the volume file from `source`, then [`create`](Self::create).
    pub async fn create_from(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
        source: &ContentSource,
        policy: CopyPolicy,
    ) -> Result<VolumeInfo, BackendError> {
        let size = checked_size(size_bytes, MIB)?;
        let (v, source) = (volume.clone(), source.clone());
        self.blocking(move |me| copy::fill_from(&me.dir, &v, &me.path(&v), size, &source, policy))
            .await?;
        self.create(volume, size).await
    }

    /// Creates `volume` or returns it when it exists with that (rounded) size.
    pub async fn create(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
    ) -> Result<VolumeInfo, BackendError> {
        let size = checked_size(size_bytes, MIB)?;
        let volume = volume.clone();
        self.blocking(move |me| {
            if let Some(info) = me.info(&volume)? {
                if info.size_bytes != size {
                    return Err(BackendError::SizeMismatch {
                        volume,
                        existing: info.size_bytes,
                        requested: size,
                    });
                }
                return Ok(info);
            }
            let path = me.path(&volume);
            let file = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(io_err("create the volume file", &path))?;
            file.set_len(size)
                .map_err(io_err("size the volume file", &path))?;
            Ok(VolumeInfo {
                volume,
                size_bytes: size,
                device_path: path,
            })
        })
        .await
    }

    /// Grows `volume`; equal is a no-op, smaller is refused.
    pub async fn expand(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
    ) -> Result<VolumeInfo, BackendError> {
        let size = checked_size(size_bytes, MIB)?;
        let volume = volume.clone();
        self.blocking(move |me| {
            let Some(mut info) = me.info(&volume)? else {
                return Err(BackendError::NotFound { volume });
            };
            if size < info.size_bytes {
                return Err(BackendError::ShrinkRefused {
                    volume,
                    current: info.size_bytes,
                    requested: size,
                });
            }
            let path = me.path(&volume);
            OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_len(size))
                .map_err(io_err("grow the volume file", &path))?;
            info.size_bytes = size;
            Ok(info)
        })
        .await
    }

    /// Removes `volume`; `Ok` when it does not exist.
    pub async fn delete(&self, volume: &VolumeId) -> Result<(), BackendError> {
        let path = self.path(volume);
        self.blocking(move |_| match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("remove the volume file", &path)(e)),
        })
        .await
    }

    /// The volume, or `None`.
    pub async fn lookup(&self, volume: &VolumeId) -> Result<Option<VolumeInfo>, BackendError> {
        let volume = volume.clone();
        self.blocking(move |me| me.info(&volume)).await
    }

    /// Every volume, sorted by ID.
    pub async fn list(&self) -> Result<Vec<VolumeInfo>, BackendError> {
        self.blocking(|me| {
            let mut out = Vec::new();
            for volume in me.names()? {
                out.extend(me.info(&volume)?);
            }
            out.sort_by(|a, b| a.volume.cmp(&b.volume));
            Ok(out)
        })
        .await
    }

    /// The volumes of the pool by name: what [`list`](Self::list) names, from one listing of
    /// the directory without a `stat` of each file.
    pub async fn held(&self) -> Result<Vec<VolumeId>, BackendError> {
        self.blocking(|me| me.names()).await
    }

    /// The names `<volume>.img` in the pool directory, in no order.
    fn names(&self) -> Result<Vec<VolumeId>, BackendError> {
        let entries = fs::read_dir(&self.dir).map_err(io_err("list the pool", &self.dir))?;
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err("list the pool", &self.dir))?;
            out.extend(
                entry
                    .file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".img"))
                    .and_then(|n| VolumeId::parse(n).ok()),
            );
        }
        Ok(out)
    }

    /// A nominal capacity (see [`CAPACITY`]).
    pub async fn capacity(&self) -> Result<Capacity, BackendError> {
        if !self.dir.is_dir() {
            return Err(BackendError::PoolMissing {
                pool: self.pool.clone(),
                what: self.dir.display().to_string(),
            });
        }
        Ok(Capacity {
            total_bytes: CAPACITY,
            available_bytes: CAPACITY,
        })
    }
}
