//! The file backend: one sparse file `<dir>/<volume-id>.img` per volume, bound to a loop
//! device.
//!
//! - The file is the volume: its length is the volume size, and it is created, grown and
//!   removed with `fsync` of the file and the directory, so a volume reported as created
//!   survives a power loss.
//! - A loop device is bound with `LOOP_CONFIGURE` (512-byte logical blocks, always, confirmed
//!   in sysfs: the LBA size the volume is exported with; direct I/O when the kernel accepts it
//!   at that size; never auto-clear), found again through sysfs and confirmed by device and inode number.
//!   After a reboot no loop device exists; `lookup` and `list` bind one again.
//! - A zero-length file is an interrupted create (the length is set right after the file is
//!   made), so `create` finishes it instead of reporting a size mismatch.
//!
//! Every operation runs on tokio's blocking pool (ioctls and `fsync` block), and the loop
//! bookkeeping (find or bind, unbind) runs under one mutex per backend.
//!
//! Finding a volume's loop device costs the same however many loop devices the node has: the
//! backend remembers the device it found or bound for each backing file, and trusts it only
//! after `LOOP_GET_STATUS64` shows the file's device and inode; sysfs is scanned (every
//! `/sys/block/loopN`) once after start, again only when a remembered device turns out unbound
//! or rebound by someone else, and by `delete`, which must find every device bound to the path,
//! an unlinked earlier file's included. Between scans a file the backend has no device for is
//! unbound (loop devices of the pool's files are bound by this backend only).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use pillar_nvmet::VolumeId;

use super::loopdev::{self, Binding, Detach};
use super::{
    BackendError, Capacity, ContentSource, CopyInto, CopyPolicy, MIB, SnapshotInfo, VolumeInfo,
    checked_size, copy,
};

/// File name extension of backing files.
pub const EXTENSION: &str = "img";

/// How long `delete` waits for the kernel to finish unbinding a loop device.
const DETACH_WAIT: Duration = Duration::from_secs(2);

/// Sparse files on loop devices. Cheap to clone; clones share the loop bookkeeping lock.
#[derive(Debug, Clone)]
pub struct FileBackend {
    inner: Arc<Inner>,
}

/// The loop device last found or bound for each backing file: hints, each confirmed by device
/// and inode before use. `complete` while every binding of the pool's files is in `devices`:
/// set by a full scan, kept by this backend's own binds and unbinds, cleared when a hint turns
/// out wrong (someone else unbound or rebound a device), so that a file with no hint is known
/// to be unbound without scanning again.
#[derive(Debug, Default)]
struct Known {
    devices: HashMap<PathBuf, u32>,
    complete: bool,
}

#[derive(Debug)]
struct Inner {
    pool: String,
    /// Canonical (symlink-free, absolute) pool directory: sysfs shows canonical paths.
    dir: PathBuf,
    direct_io: bool,
    /// Serialises finding, binding and unbinding loop devices, and guards what the backend
    /// knows of them.
    loop_lock: Mutex<Known>,
    /// How many times every loop device was scanned through sysfs.
    scans: AtomicU64,
}

impl FileBackend {
    /// Allocation granularity: 1 MiB.
    pub const GRANULARITY: u64 = MIB;

    /// A backend for the existing directory `dir` (resolved to its canonical path now).
    pub fn new(pool: &str, dir: &Path) -> Result<Self, BackendError> {
        if !dir.is_absolute() {
            return Err(BackendError::InvalidConfig {
                pool: pool.to_owned(),
                reason: format!("directory {} is not an absolute path", dir.display()),
            });
        }
        let canonical = fs::canonicalize(dir).map_err(|source| BackendError::Io {
            step: "resolve the pool directory",
            path: dir.to_owned(),
            source,
        })?;
        if !canonical.is_dir() {
            return Err(BackendError::InvalidConfig {
                pool: pool.to_owned(),
                reason: format!("{} is not a directory", canonical.display()),
            });
        }
        Ok(Self {
            inner: Arc::new(Inner {
                pool: pool.to_owned(),
                dir: canonical,
                direct_io: true,
                loop_lock: Mutex::new(Known::default()),
                scans: AtomicU64::new(0),
            }),
        })
    }

    /// The same backend binding loop devices without direct I/O (buffered through the page
    /// cache). Direct I/O is the default.
    #[must_use]
    #[cfg(any(test, feature = "test-seams"))]
    pub fn with_direct_io(self, direct_io: bool) -> Self {
        Self {
            inner: Arc::new(Inner {
                pool: self.inner.pool.clone(),
                dir: self.inner.dir.clone(),
                direct_io,
                loop_lock: Mutex::new(Known::default()),
                scans: AtomicU64::new(0),
            }),
        }
    }

    /// The canonical pool directory.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// How many times this backend read every `/sys/block/loopN` to find a volume's device
    /// (a cost that grows with the node's loop devices; see the module docs for when).
    #[cfg(any(test, feature = "test-seams"))]
    pub fn loop_scans(&self) -> u64 {
        self.inner.scans.load(Ordering::Relaxed)
    }

    /// The backing file of `volume`.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn backing_file(&self, volume: &VolumeId) -> PathBuf {
        self.inner.backing_file(volume)
    }

    /// `size_bytes` rounded up to a multiple of 1 MiB.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn round_size(&self, size_bytes: u64) -> u64 {
        super::round_up(size_bytes, Self::GRANULARITY)
    }

    pub async fn create(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
    ) -> Result<VolumeInfo, BackendError> {
        let volume = volume.clone();
        self.blocking(move |inner| inner.create(volume, size_bytes))
            .await
    }

    pub async fn expand(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
    ) -> Result<VolumeInfo, BackendError> {
        let volume = volume.clone();
        self.blocking(move |inner| inner.expand(volume, size_bytes))
            .await
    }

    pub async fn delete(&self, volume: &VolumeId) -> Result<(), BackendError> {
        let volume = volume.clone();
        self.blocking(move |inner| inner.delete(&volume)).await
    }

    pub async fn lookup(&self, volume: &VolumeId) -> Result<Option<VolumeInfo>, BackendError> {
        let volume = volume.clone();
        self.blocking(move |inner| inner.lookup(volume)).await
    }

    pub async fn list(&self) -> Result<Vec<VolumeInfo>, BackendError> {
        self.blocking(Inner::list).await
    }

    /// The volumes of the pool by name: what [`list`](Self::list) names, from the directory
    /// listing alone (no open or loop-device lookup per volume).
    pub async fn held(&self) -> Result<Vec<VolumeId>, BackendError> {
        self.blocking(Inner::candidates).await
    }

    /// Whether a volume file can be reflinked to where a copy `into` goes (probed each time:
    /// a directory can be remounted, and `.snapshots` may be another file system).
    pub async fn copies_at_once(&self, into: CopyInto) -> Result<bool, BackendError> {
        self.blocking(move |inner| {
            let to = match into {
                CopyInto::Volume => inner.dir.clone(),
                CopyInto::Snapshot => copy::ensure_snapshot_dir(&inner.dir)?,
            };
            Ok(copy::reflink_supported_between(&inner.dir, &to)?)
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
        self.blocking(move |inner| {
            copy::cut_snapshot(
                &inner.dir,
                &source,
                &inner.backing_file(&source),
                &snapshot,
                policy,
            )
        })
        .await
    }

    pub async fn lookup_snapshot(
        &self,
        snapshot: &VolumeId,
    ) -> Result<Option<SnapshotInfo>, BackendError> {
        let snapshot = snapshot.clone();
        self.blocking(move |inner| copy::find_snapshot(&inner.dir, &snapshot))
            .await
    }

    pub async fn delete_snapshot(&self, snapshot: &VolumeId) -> Result<(), BackendError> {
        let snapshot = snapshot.clone();
        self.blocking(move |inner| copy::remove_snapshot(&inner.dir, &snapshot))
            .await
    }

    /// Fills the backing file from `source`, then attaches it as [`create`](Self::create) does.
    pub async fn create_from(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
        source: &ContentSource,
        policy: CopyPolicy,
    ) -> Result<VolumeInfo, BackendError> {
        let size = checked_size(size_bytes, Self::GRANULARITY)?;
        let (v, source) = (volume.clone(), source.clone());
        self.blocking(move |inner| {
            copy::fill_from(
                &inner.dir,
                &v,
                &inner.backing_file(&v),
                size,
                &source,
                policy,
            )
        })
        .await?;
        self.create(volume, size).await
    }

    /// Checks that loop devices can be made (`/dev/loop-control` opens read-write) and
    /// returns the pool's capacity.
    pub async fn probe(&self) -> Result<Capacity, BackendError> {
        self.blocking(|inner| {
            loopdev::check_control().map_err(|source| BackendError::Loop {
                path: inner.dir.clone(),
                source,
            })?;
            inner.capacity()
        })
        .await
    }

    /// Size and free space of the file system holding the pool directory (`statvfs`). Files
    /// are sparse, so volumes may together promise more than is available.
    pub async fn capacity(&self) -> Result<Capacity, BackendError> {
        self.blocking(Inner::capacity).await
    }

    async fn blocking<T, F>(&self, f: F) -> Result<T, BackendError>
    where
        T: Send + 'static,
        F: FnOnce(&Inner) -> Result<T, BackendError> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        match tokio::task::spawn_blocking(move || f(&inner)).await {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(BackendError::Cancelled(e)),
        }
    }
}

impl Inner {
    fn backing_file(&self, volume: &VolumeId) -> PathBuf {
        // A VolumeId has no '/' and does not start with '.', so this stays inside `dir`.
        self.dir.join(format!("{}.{EXTENSION}", volume.as_str()))
    }

    fn lock(&self) -> MutexGuard<'_, Known> {
        // The map holds hints that are confirmed before use, so a panic while holding the lock
        // leaves nothing that could mislead.
        self.loop_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn create(&self, volume: VolumeId, requested: u64) -> Result<VolumeInfo, BackendError> {
        let size = checked_size(requested, FileBackend::GRANULARITY)?;
        let path = self.backing_file(&volume);
        let mut fresh = false;
        let file = match open_file(&path, true) {
            Ok(file) => {
                fresh = true;
                self.set_length(&file, &path, size)
                    .inspect_err(|_| remove_quietly(&path))?;
                sync_file(&file, &path)?;
                sync_dir(&self.dir)?;
                tracing::info!(%volume, size, path = %path.display(), "created backing file");
                file
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let file =
                    open_file(&path, false).map_err(io_err("open the backing file", &path))?;
                let existing = file_len(&file, &path)?;
                if existing == 0 {
                    tracing::info!(%volume, "finishing an interrupted create");
                    self.set_length(&file, &path, size)?;
                    sync_file(&file, &path)?;
                } else if existing != size {
                    return Err(BackendError::SizeMismatch {
                        volume,
                        existing,
                        requested: size,
                    });
                }
                file
            }
            Err(e) => return Err(io_err("create the backing file", &path)(e)),
        };
        let mut known = self.lock();
        let bindings = if fresh {
            // A file made just now: no loop device can be bound to its inode yet.
            Vec::new()
        } else {
            bindings_of(&mut known, self, &file, &path)?
        };
        let index = self.ensure_attached(&file, &path, size, &bindings)?;
        known.devices.insert(path, index);
        Ok(VolumeInfo {
            volume,
            size_bytes: size,
            device_path: loopdev::device_path(index),
        })
    }

    fn expand(&self, volume: VolumeId, requested: u64) -> Result<VolumeInfo, BackendError> {
        let size = checked_size(requested, FileBackend::GRANULARITY)?;
        let path = self.backing_file(&volume);
        let file = match open_file(&path, false) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(BackendError::NotFound { volume });
            }
            Err(e) => return Err(io_err("open the backing file", &path)(e)),
        };
        let current = file_len(&file, &path)?;
        if size < current {
            return Err(BackendError::ShrinkRefused {
                volume,
                current,
                requested: size,
            });
        }
        if size > current {
            self.set_length(&file, &path, size)?;
            sync_file(&file, &path)?;
            tracing::info!(%volume, from = current, to = size, "grew backing file");
        }
        // Binding (or finding) the loop device also brings its size in line with the file,
        // which finishes an expand interrupted between the two steps.
        let mut known = self.lock();
        let bindings = bindings_of(&mut known, self, &file, &path)?;
        let index = self.ensure_attached(&file, &path, size, &bindings)?;
        known.devices.insert(path, index);
        Ok(VolumeInfo {
            volume,
            size_bytes: size,
            device_path: loopdev::device_path(index),
        })
    }

    fn delete(&self, volume: &VolumeId) -> Result<(), BackendError> {
        let path = self.backing_file(volume);
        {
            let mut known = self.lock();
            known.devices.remove(&path);
            // Every loop device on this path, including ones bound to an earlier, already
            // unlinked file of the same name.
            for binding in self.bindings(&path)? {
                let device = loopdev::device_path(binding.index);
                match loopdev::detach(binding.index, DETACH_WAIT).map_err(|source| {
                    BackendError::Loop {
                        path: path.clone(),
                        source,
                    }
                })? {
                    Detach::Done | Detach::NotBound => {
                        tracing::info!(%volume, device = %device.display(), "detached loop device");
                    }
                    Detach::Busy | Detach::Deferred => {
                        return Err(BackendError::Busy {
                            volume: volume.clone(),
                            device,
                        });
                    }
                }
            }
        }
        match fs::remove_file(&path) {
            Ok(()) => {
                sync_dir(&self.dir)?;
                tracing::info!(%volume, path = %path.display(), "removed backing file");
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("remove the backing file", &path)(e)),
        }
    }

    fn lookup(&self, volume: VolumeId) -> Result<Option<VolumeInfo>, BackendError> {
        let path = self.backing_file(&volume);
        let file = match open_file(&path, false) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("open the backing file", &path)(e)),
        };
        let size = file_len(&file, &path)?;
        let mut known = self.lock();
        let bindings = bindings_of(&mut known, self, &file, &path)?;
        let index = self.ensure_attached(&file, &path, size, &bindings)?;
        known.devices.insert(path, index);
        Ok(Some(VolumeInfo {
            volume,
            size_bytes: size,
            device_path: loopdev::device_path(index),
        }))
    }

    /// The volume files of the pool by name, in no order (one directory listing: regular
    /// files named `<volume>.<EXTENSION>`).
    fn candidates(&self) -> Result<Vec<VolumeId>, BackendError> {
        let entries =
            fs::read_dir(&self.dir).map_err(io_err("list the pool directory", &self.dir))?;
        let suffix = format!(".{EXTENSION}");
        let mut candidates = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err("list the pool directory", &self.dir))?;
            let name = entry.file_name();
            let Some(volume) = name
                .to_str()
                .and_then(|n| n.strip_suffix(&suffix))
                .and_then(|stem| VolumeId::parse(stem).ok())
            else {
                continue;
            };
            let file_type = entry
                .file_type()
                .map_err(io_err("inspect a pool directory entry", &entry.path()))?;
            if file_type.is_file() {
                candidates.push(volume);
            }
        }
        Ok(candidates)
    }

    fn list(&self) -> Result<Vec<VolumeInfo>, BackendError> {
        let mut volumes = Vec::new();
        let mut candidates = self.candidates()?;
        candidates.sort();
        let mut known = self.lock();
        let all = self.all_bindings(&self.dir)?;
        for volume in candidates {
            let path = self.backing_file(&volume);
            let file = match open_file(&path, false) {
                Ok(file) => file,
                // Deleted between the listing and now.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("open the backing file", &path)(e)),
            };
            let size = file_len(&file, &path)?;
            let mine: Vec<Binding> = all
                .iter()
                .filter(|b| b.backing_file == path)
                .cloned()
                .collect();
            let index = self.ensure_attached(&file, &path, size, &mine)?;
            known.devices.insert(path, index);
            volumes.push(VolumeInfo {
                volume,
                size_bytes: size,
                device_path: loopdev::device_path(index),
            });
        }
        known.complete = true;
        Ok(volumes)
    }

    fn capacity(&self) -> Result<Capacity, BackendError> {
        let stat = rustix::fs::statvfs(&self.dir).map_err(|e| BackendError::Io {
            step: "statvfs the pool directory",
            path: self.dir.clone(),
            source: e.into(),
        })?;
        let block = stat.f_frsize;
        Ok(Capacity {
            total_bytes: stat.f_blocks.saturating_mul(block),
            available_bytes: stat.f_bavail.saturating_mul(block),
        })
    }

    fn set_length(&self, file: &File, path: &Path, size: u64) -> Result<(), BackendError> {
        file.set_len(size).map_err(|source| {
            if source.raw_os_error() == Some(libc::EFBIG) {
                BackendError::SizeUnsupported {
                    pool: self.pool.clone(),
                    requested: size,
                    source,
                }
            } else {
                io_err("set the backing file's length", path)(source)
            }
        })
    }

    /// The loop device bound to `file` (confirmed by device and inode number among
    /// `bindings`, which are the bindings whose path is `path`), brought to the file's size;
    /// or a newly bound one. Call with the loop lock held.
    fn ensure_attached(
        &self,
        file: &File,
        path: &Path,
        size: u64,
        bindings: &[Binding],
    ) -> Result<u32, BackendError> {
        let meta = file
            .metadata()
            .map_err(io_err("stat the backing file", path))?;
        let loop_err = |source| BackendError::Loop {
            path: path.to_owned(),
            source,
        };
        for binding in bindings.iter().filter(|b| !b.deleted) {
            match loopdev::backing_identity(binding.index) {
                Ok((dev, ino)) if dev == meta.dev() && ino == meta.ino() => {
                    let index = binding.index;
                    warn_on_block_size(index, path);
                    if loopdev::size_bytes(index).map_err(loop_err)? != size {
                        loopdev::set_capacity(index).map_err(loop_err)?;
                        tracing::info!(device = index, size, "loop device resized to its file");
                    }
                    return Ok(index);
                }
                Ok(_) => {
                    tracing::warn!(
                        device = binding.index,
                        path = %path.display(),
                        "loop device names this path but is bound to another file; ignored"
                    );
                }
                // Unbound since the sysfs scan.
                Err(e) if e.source.raw_os_error() == Some(libc::ENXIO) => {}
                Err(e) => return Err(loop_err(e)),
            }
        }
        for stale in bindings.iter().filter(|b| b.deleted) {
            tracing::warn!(
                device = stale.index,
                path = %path.display(),
                "loop device still bound to an unlinked earlier file of this volume"
            );
        }
        // Some kernels accept direct I/O for a file whose filesystem cannot do O_DIRECT (6.1 on
        // overlayfs over tmpfs) and then fail every read; ask only when a direct read works.
        let direct = self.direct_io && loopdev::supports_direct_io(path);
        let attached = loopdev::attach(file, path, direct).map_err(loop_err)?;
        tracing::info!(
            device = attached.index,
            direct_io = attached.direct_io,
            path = %path.display(),
            "bound loop device"
        );
        Ok(attached.index)
    }
}

/// Warns when a device found bound (by an agent before the block size was pinned, which let
/// the kernel choose) has a logical block size other than [`loopdev::LOGICAL_BLOCK_SIZE`]. It
/// is kept: a live export may be serving it, and its next bind gets the pinned size.
fn warn_on_block_size(index: u32, path: &Path) {
    match loopdev::logical_block_size(index) {
        Ok(loopdev::LOGICAL_BLOCK_SIZE) => {}
        Ok(size) => tracing::warn!(
            device = index,
            size,
            path = %path.display(),
            "loop device found bound with a logical block size other than 512 bytes; kept \
             until it is unbound, bound again with 512"
        ),
        Err(e) => tracing::warn!(device = index, error = %e, "reading the logical block size"),
    }
}

/// The loop devices to consider for `file` at `path`: the one remembered in `known` when it is
/// still bound to this very file (device and inode); none when there is no hint and `known` is
/// complete; else every binding sysfs shows for `path` (one scan of all loop devices, which
/// makes `known` complete for the pool). Call with the loop lock held (`known` is its data).
fn bindings_of(
    known: &mut Known,
    inner: &Inner,
    file: &File,
    path: &Path,
) -> Result<Vec<Binding>, BackendError> {
    match known.devices.get(path) {
        Some(&index) => {
            let meta = file
                .metadata()
                .map_err(io_err("stat the backing file", path))?;
            if matches!(loopdev::backing_identity(index), Ok(id) if id == (meta.dev(), meta.ino()))
            {
                return Ok(vec![Binding {
                    index,
                    backing_file: path.to_owned(),
                    deleted: false,
                }]);
            }
            // Unbound or rebound behind our back: what else changed is unknown.
            known.devices.remove(path);
            known.complete = false;
        }
        None if known.complete => return Ok(Vec::new()),
        None => {}
    }
    let all = inner.all_bindings(path)?;
    for b in all
        .iter()
        .filter(|b| !b.deleted && b.backing_file.parent() == Some(inner.dir.as_path()))
    {
        known
            .devices
            .entry(b.backing_file.clone())
            .or_insert(b.index);
    }
    known.complete = true;
    Ok(all.into_iter().filter(|b| b.backing_file == path).collect())
}

impl Inner {
    /// Every bound loop device, from sysfs.
    fn all_bindings(&self, path: &Path) -> Result<Vec<Binding>, BackendError> {
        self.scans.fetch_add(1, Ordering::Relaxed);
        loopdev::bindings().map_err(|source| BackendError::Loop {
            path: path.to_owned(),
            source,
        })
    }

    /// Bound loop devices whose sysfs backing file is `path` (deleted or not).
    fn bindings(&self, path: &Path) -> Result<Vec<Binding>, BackendError> {
        Ok(self
            .all_bindings(path)?
            .into_iter()
            .filter(|b| b.backing_file == path)
            .collect())
    }
}

/// Opens a backing file read-write; `create` makes a new one (failing if it exists). Never
/// follows a symlink: the pool directory holds only regular files pillar made.
fn open_file(path: &Path, create: bool) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(create)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "backing file is not a regular file",
        ));
    }
    Ok(file)
}

fn file_len(file: &File, path: &Path) -> Result<u64, BackendError> {
    Ok(file
        .metadata()
        .map_err(io_err("stat the backing file", path))?
        .len())
}

fn sync_file(file: &File, path: &Path) -> Result<(), BackendError> {
    file.sync_all()
        .map_err(io_err("fsync the backing file", path))
}

fn sync_dir(dir: &Path) -> Result<(), BackendError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("fsync the pool directory", dir))
}

fn remove_quietly(path: &Path) {
    if let Err(e) = fs::remove_file(path) {
        tracing::warn!(path = %path.display(), error = %e, "could not remove a half-created file");
    }
}

fn io_err(step: &'static str, path: &Path) -> impl FnOnce(io::Error) -> BackendError {
    let path = path.to_owned();
    move |source| BackendError::Io { step, path, source }
}
