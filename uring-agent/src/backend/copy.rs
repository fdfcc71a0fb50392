//! Durable copies of a volume file, for the snapshots and clones of the file-based backends.
//!
//! Invariants:
//! - A copy appears under its final name only whole and durable: it is made in a temporary file
//!   next to it, synced, linked into place (never over an existing file) and its directory
//!   synced. A crash leaves the old
//!   state (no file, or a stale temporary file the next attempt removes) or the new one.
//! - The copy is a reflink (`FICLONE`: the file system shares the extents, and the kernel writes
//!   back the source's dirty pages and holds its lock for the clone, so it is one point in time)
//!   where the file system supports it, and a sparse-aware copy otherwise (`SEEK_DATA` /
//!   `SEEK_HOLE`, each data run by `copy_file_range`). The caller learns which: a sparse copy is
//!   consistent only if nothing writes the source meanwhile, so the caller asks for a reflink
//!   alone ([`CopyPolicy::AtOnce`]) when a host may be writing it: the decision is the copy
//!   itself, of the very two files, so no probe of other files can misjudge it (another file
//!   system mounted where the copy goes).
//!
//! This module and [`loopdev`](super::loopdev) are the backend's only `unsafe` code: the
//! `FICLONE` ioctl and `lseek` with `SEEK_DATA`/`SEEK_HOLE`, each on descriptors of files this
//! module holds open.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use pillar_nvmet::VolumeId;

use super::{BackendError, ContentSource, SnapshotInfo};

/// How a copy was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    /// `FICLONE`: shared extents, one point in time even of a file being written.
    Reflink,
    /// Data runs copied one by one, holes kept.
    SparseCopy,
}

impl CopyMethod {
    /// The name used in logs and the agent's answers.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reflink => "reflink",
            Self::SparseCopy => "sparse-copy",
        }
    }
}

/// Why a copy failed: the step and its error.
#[derive(Debug, thiserror::Error)]
#[error("{step} ({path})")]
pub struct CopyError {
    pub step: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

fn at(step: &'static str, path: &Path) -> impl FnOnce(io::Error) -> CopyError {
    let path = path.to_owned();
    move |source| CopyError { step, path, source }
}

/// How a copy may be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyPolicy {
    /// A reflink, or a sparse copy where the file system cannot reflink the two files: for a
    /// source nothing writes meanwhile.
    AnyWay,
    /// Only a reflink (one point in time): for a source a host may be writing. Where the file
    /// system cannot reflink the two files, nothing is made and the copy fails
    /// ([`CopyError::not_at_once`]).
    AtOnce,
}

/// The step of a copy [`CopyPolicy::AtOnce`] refused.
const NOT_AT_ONCE: &str =
    "reflink the source (a copy of a volume in use must be one point in time)";

impl CopyError {
    /// Whether this is a [`CopyPolicy::AtOnce`] copy the file system could not make by reflink
    /// (nothing was made).
    pub fn not_at_once(&self) -> bool {
        self.step == NOT_AT_ONCE
    }
}

/// Whether `dir` supports reflinks: a probe clone of a one-block file, removed afterwards.
#[cfg(any(test, feature = "test-seams"))]
pub fn reflink_supported(dir: &Path) -> Result<bool, CopyError> {
    reflink_supported_between(dir, dir)
}

/// Whether a file in `from` can be reflinked to a file in `to` (two directories may lie on two
/// file systems, and FICLONE works only within one): a probe clone of a one-block file made in
/// `from` to one made in `to`, both removed afterwards.
pub fn reflink_supported_between(from: &Path, to: &Path) -> Result<bool, CopyError> {
    let source = from.join(".pillar-reflink-probe.src");
    let dest = to.join(".pillar-reflink-probe.dst");
    let result = (|| {
        let src = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&source)
            .map_err(at("create the reflink probe", &source))?;
        io::Write::write_all(&mut &src, &[0_u8; 4096])
            .map_err(at("write the reflink probe", &source))?;
        let dst = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&dest)
            .map_err(at("create the reflink probe", &dest))?;
        match clone_file(&src, &dst) {
            Ok(()) => Ok(true),
            Err(e) if no_reflink(&e) => Ok(false),
            Err(e) => Err(at("probe FICLONE", &dest)(e)),
        }
    })();
    let _ = fs::remove_file(&source);
    let _ = fs::remove_file(&dest);
    result
}

/// Copies `source` to `dest` (which must not exist) durably, then makes it `len` bytes long
/// (`len` at least the source's length: a restore into a larger volume), as `policy` allows.
/// Returns how. The copy itself decides whether it is one point in time: a refused
/// [`CopyPolicy::AtOnce`] copy leaves nothing behind.
pub fn durable_copy(
    source: &Path,
    dest: &Path,
    len: u64,
    policy: CopyPolicy,
) -> Result<CopyMethod, CopyError> {
    let dir = dest.parent().ok_or_else(|| CopyError {
        step: "find the copy's directory",
        path: dest.to_owned(),
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })?;
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(at("remove a stale temporary copy", &tmp)(e)),
    }
    let src = File::open(source).map_err(at("open the copy's source", source))?;
    let src_len = src
        .metadata()
        .map_err(at("stat the copy's source", source))?
        .len();
    let dst = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(at("create the temporary copy", &tmp))?;
    let method = match clone_file(&src, &dst) {
        Ok(()) => CopyMethod::Reflink,
        Err(e) if no_reflink(&e) && policy == CopyPolicy::AtOnce => {
            drop(dst);
            fs::remove_file(&tmp).map_err(at("remove the temporary copy", &tmp))?;
            return Err(at(NOT_AT_ONCE, dest)(e));
        }
        Err(e) if no_reflink(&e) => {
            sparse_copy(&src, &dst, src_len).map_err(at("copy the data runs", &tmp))?;
            CopyMethod::SparseCopy
        }
        Err(e) => return Err(at("clone the source (FICLONE)", &tmp)(e)),
    };
    if len > src_len {
        dst.set_len(len).map_err(at("size the copy", &tmp))?;
    }
    dst.sync_all().map_err(at("fsync the copy", &tmp))?;
    drop(dst);
    // A link, not a rename: it fails if `dest` exists, so a copy never replaces a volume or
    // snapshot (a crash before the unlink leaves only a stale temporary file).
    fs::hard_link(&tmp, dest).map_err(at("link the copy into place", dest))?;
    fs::remove_file(&tmp).map_err(at("remove the temporary copy", &tmp))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(at("fsync the copy's directory", dir))?;
    Ok(method)
}

/// Removes `path` durably; `Ok` if it is not there.
pub fn durable_remove(path: &Path) -> Result<(), CopyError> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(at("remove the file", path)(e)),
    }
    let dir = path.parent().unwrap_or(Path::new("/"));
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(at("fsync the directory", dir))
}

/// The errors by which a file system says it cannot reflink these two files.
fn no_reflink(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::ENOTTY | libc::EXDEV | libc::EINVAL | libc::ENOSYS)
    )
}

fn clone_file(src: &File, dst: &File) -> io::Result<()> {
    // SAFETY: FICLONE takes the source descriptor as its argument and reads or writes no memory
    // of this process; both descriptors are open files borrowed for the call.
    let ret = unsafe { libc::ioctl(dst.as_raw_fd(), libc::FICLONE, src.as_raw_fd()) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `lseek(fd, offset, whence)`; `None` for ENXIO (no data or hole at or after `offset`).
fn seek_data_or_hole(file: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    let offset =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: lseek only moves the file offset of a descriptor this function borrows open; it
    // touches no memory of this process.
    let ret = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
    if ret >= 0 {
        return Ok(Some(
            u64::try_from(ret).expect("lseek returned a non-negative offset"),
        ));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENXIO) {
        Ok(None)
    } else {
        Err(e)
    }
}

/// Copies every data run of `src` (length `len`) to the same offsets of `dst`, leaving holes.
fn sparse_copy(src: &File, dst: &File, len: u64) -> io::Result<()> {
    dst.set_len(len)?;
    let mut offset = 0;
    while offset < len {
        let Some(data) = seek_data_or_hole(src, offset, libc::SEEK_DATA)? else {
            break;
        };
        let end = seek_data_or_hole(src, data, libc::SEEK_HOLE)?
            .unwrap_or(len)
            .min(len);
        let (mut from, mut to) = (src, dst);
        from.seek(SeekFrom::Start(data))?;
        to.seek(SeekFrom::Start(data))?;
        // std copies File to File with copy_file_range where the kernel offers it.
        let copied = io::copy(&mut io::Read::take(from, end - data), &mut to)?;
        if copied != end - data {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the source ended at {} while copying up to {end}",
                    data + copied
                ),
            ));
        }
        offset = end;
    }
    Ok(())
}

/// The directory of a file-based pool's snapshots: `<pool dir>/.snapshots` (a name no volume
/// file can take: volume files are `<volume-id>.img` and a volume ID never starts with '.').
pub fn snapshot_dir(pool_dir: &Path) -> PathBuf {
    pool_dir.join(".snapshots")
}

/// The snapshot directory of a file-based pool, made (durably) if it is not there yet.
pub fn ensure_snapshot_dir(pool_dir: &Path) -> Result<PathBuf, CopyError> {
    let dir = snapshot_dir(pool_dir);
    if !dir.is_dir() {
        fs::create_dir_all(&dir).map_err(at("create the snapshot directory", &dir))?;
        File::open(pool_dir)
            .and_then(|d| d.sync_all())
            .map_err(at("fsync the pool directory", pool_dir))?;
    }
    Ok(dir)
}

/// The file of snapshot `id` in a file-based pool.
pub fn snapshot_file(pool_dir: &Path, id: &str) -> PathBuf {
    snapshot_dir(pool_dir).join(format!("{id}.img"))
}

/// Length and time of a finished copy, or `None` when there is none.
pub fn stat_copy(path: &Path) -> Result<Option<(u64, std::time::SystemTime)>, CopyError> {
    match fs::metadata(path) {
        // A copy is never written after it is linked in, so its mtime is when it was cut.
        Ok(m) => Ok(Some((
            m.len(),
            m.modified().map_err(at("read the copy's time", path))?,
        ))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(at("stat the copy", path)(e)),
    }
}

/// Snapshot `id` of a file-based pool, or `None`.
pub fn find_snapshot(pool_dir: &Path, id: &VolumeId) -> Result<Option<SnapshotInfo>, BackendError> {
    Ok(
        stat_copy(&snapshot_file(pool_dir, id.as_str()))?.map(|(len, created)| SnapshotInfo {
            snapshot: id.clone(),
            size_bytes: len,
            created,
            method: None,
        }),
    )
}

/// A copy error as the backend reports it: a refused [`CopyPolicy::AtOnce`] copy is
/// [`BackendError::NotAtOnce`].
fn copy_failed(volume: &VolumeId) -> impl FnOnce(CopyError) -> BackendError {
    let volume = volume.clone();
    move |e| {
        if e.not_at_once() {
            BackendError::NotAtOnce {
                volume,
                path: e.path,
                source: e.source,
            }
        } else {
            BackendError::Copy(e)
        }
    }
}

/// Cuts snapshot `id` of the volume file `source_file` in a file-based pool (idempotent), as
/// `policy` allows.
pub fn cut_snapshot(
    pool_dir: &Path,
    source: &VolumeId,
    source_file: &Path,
    id: &VolumeId,
    policy: CopyPolicy,
) -> Result<SnapshotInfo, BackendError> {
    if let Some(existing) = find_snapshot(pool_dir, id)? {
        return Ok(existing);
    }
    if stat_copy(source_file)?.is_none() {
        return Err(BackendError::NotFound {
            volume: source.clone(),
        });
    }
    ensure_snapshot_dir(pool_dir)?;
    let file = snapshot_file(pool_dir, id.as_str());
    let method = durable_copy(source_file, &file, 0, policy).map_err(copy_failed(source))?;
    tracing::info!(%source, snapshot = %id, method = method.as_str(), "cut snapshot");
    let (len, created) = stat_copy(&file)?.ok_or_else(|| CopyError {
        step: "stat the snapshot just made",
        path: file.clone(),
        source: io::Error::from(io::ErrorKind::NotFound),
    })?;
    Ok(SnapshotInfo {
        snapshot: id.clone(),
        size_bytes: len,
        created,
        method: Some(method.as_str()),
    })
}

/// Fills the volume file `dest` of a file-based pool with `source`'s content, `size` bytes
/// long (already rounded), as `policy` allows, unless it exists (a retry: the caller's create
/// checks its size).
pub fn fill_from(
    pool_dir: &Path,
    volume: &VolumeId,
    dest: &Path,
    size: u64,
    source: &ContentSource,
    policy: CopyPolicy,
) -> Result<(), BackendError> {
    if stat_copy(dest)?.is_some() {
        return Ok(());
    }
    let from = match source {
        ContentSource::Snapshot(id) => snapshot_file(pool_dir, id.as_str()),
        ContentSource::Volume(id) => pool_dir.join(format!("{}.img", id.as_str())),
    };
    let Some((source_bytes, _)) = stat_copy(&from)? else {
        return Err(match source {
            ContentSource::Snapshot(id) => BackendError::SnapshotNotFound {
                snapshot: id.clone(),
            },
            ContentSource::Volume(id) => BackendError::NotFound { volume: id.clone() },
        });
    };
    if size < source_bytes {
        return Err(BackendError::SmallerThanSource {
            volume: volume.clone(),
            source_bytes,
            requested: size,
        });
    }
    let method = durable_copy(&from, dest, size, policy).map_err(copy_failed(source.id()))?;
    tracing::info!(%volume, source = %source.id(), method = method.as_str(), size, "filled a volume from its source");
    Ok(())
}

/// Removes snapshot `id` of a file-based pool; `Ok` if it is not there.
pub fn remove_snapshot(pool_dir: &Path, id: &VolumeId) -> Result<(), BackendError> {
    Ok(durable_remove(&snapshot_file(pool_dir, id.as_str()))?)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn pattern(file: &mut File, at: u64, byte: u8, len: usize) {
        file.seek(SeekFrom::Start(at)).unwrap();
        file.write_all(&vec![byte; len]).unwrap();
    }

    #[test]
    fn a_copy_holds_the_same_bytes_keeps_holes_and_grows_to_the_asked_length() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("v.img");
        let mut f = File::create(&source).unwrap();
        f.set_len(64 << 20).unwrap();
        pattern(&mut f, 0, 0xa1, 4096);
        pattern(&mut f, 10 << 20, 0xb2, 1 << 20);
        pattern(&mut f, (64 << 20) - 4096, 0xc3, 4096);
        f.sync_all().unwrap();
        drop(f);

        let dest = dir.path().join("snap.img");
        let method = durable_copy(&source, &dest, 128 << 20, CopyPolicy::AnyWay).unwrap();
        let expected = if reflink_supported(dir.path()).unwrap() {
            CopyMethod::Reflink
        } else {
            CopyMethod::SparseCopy
        };
        assert_eq!(method, expected);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        File::open(&source).unwrap().read_to_end(&mut a).unwrap();
        File::open(&dest).unwrap().read_to_end(&mut b).unwrap();
        assert_eq!(b.len(), 128 << 20);
        assert_eq!(&b[..a.len()], &a[..]);
        assert!(b[a.len()..].iter().all(|&x| x == 0));
        // Sparse: about the 1 MiB + 8 KiB written, not 64 MiB.
        let allocated = fs::metadata(&dest).unwrap().blocks() * 512;
        assert!(allocated < 8 << 20, "{allocated} bytes allocated");
        // No temporary file is left, and an existing destination is never replaced.
        assert!(!dir.path().join(".snap.img.tmp").exists());
        fs::write(&source, b"other").unwrap();
        let err = durable_copy(&source, &dest, 5, CopyPolicy::AnyWay).unwrap_err();
        assert_eq!(err.source.kind(), io::ErrorKind::AlreadyExists, "{err}");
        assert_eq!(fs::metadata(&dest).unwrap().len(), 128 << 20);
    }

    #[test]
    fn a_stale_temporary_file_is_replaced_and_a_missing_source_fails_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("v.img");
        fs::write(&source, b"hello").unwrap();
        fs::write(dir.path().join(".c.img.tmp"), b"half a copy from a crash").unwrap();
        let dest = dir.path().join("c.img");
        durable_copy(&source, &dest, 5, CopyPolicy::AnyWay).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"hello");

        let err = durable_copy(
            &dir.path().join("gone.img"),
            &dir.path().join("d.img"),
            5,
            CopyPolicy::AnyWay,
        )
        .unwrap_err();
        assert_eq!(err.step, "open the copy's source");
        assert!(!dir.path().join("d.img").exists());

        durable_remove(&dest).unwrap();
        durable_remove(&dest).unwrap();
        assert!(!dest.exists());
    }
}
