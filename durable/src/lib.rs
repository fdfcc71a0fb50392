//! The file operations pillar's durable writes are made of, behind one seam.
//!
//! Every durable write path (the agent's fencing marks, snapshot marks and identity records
//! through its synchronous engine, the agent's state identity, the node plugin's stage records)
//! issues its file operations through a [`DurableFs`]. Production uses [`StdFs`], which is
//! `std::fs` and nothing more. Tests pass a recorder (`record::Recorder`, feature `model`) that
//! performs each operation on a real directory and logs it, and the crash-state model
//! (`crash`, feature `model`) enumerates every state a power loss may leave of that log on ext4
//! (data=ordered) and xfs, so each path's real reader can be run on each of them. The real
//! kernel's side of the same question: `logwrites` (feature `model`) reads and replays the log of
//! the kernel's `dm-log-writes` target, so the kernel lane can rebuild every state a power loss
//! leaves on a real ext4 or xfs.
//!
//! Invariants:
//! - [`StdFs`] adds no behaviour of its own: each method is one `std::fs` call (or one
//!   `create_dir_all`), so routing a path through it changes nothing in production.
//! - A path's order of operations is its own; this crate neither reorders nor merges them.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, OnceLock};

#[cfg(feature = "model")]
pub mod crash;
#[cfg(feature = "model")]
pub mod logwrites;
#[cfg(feature = "model")]
pub mod record;

/// A file opened for writing through a [`DurableFs`]; dropping it closes it.
pub trait DurableFile: io::Write + fmt::Debug + Send {
    /// fsync: the file's data and size reach the disk.
    fn sync_all(&mut self) -> io::Result<()>;
}

/// The file operations of a durable write (see the module documentation).
pub trait DurableFs: fmt::Debug + Send + Sync {
    /// Creates `path`, which must not exist (`O_CREAT | O_EXCL`), with `mode`, for writing.
    fn create_new(&self, path: &Path, mode: u32) -> io::Result<Box<dyn DurableFile>>;
    /// Creates `path` or truncates the file there, for writing (`File::create`).
    fn create(&self, path: &Path) -> io::Result<Box<dyn DurableFile>>;
    /// Renames `from` to `to`, replacing `to` atomically.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes the file `path`.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Creates the directory `path` and its missing parents.
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// fsync of the directory `dir`: the names created, renamed or removed in it reach the disk.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// The production [`DurableFs`]: `std::fs`.
#[derive(Clone, Copy, Debug, Default)]
pub struct StdFs;

impl DurableFile for File {
    fn sync_all(&mut self) -> io::Result<()> {
        File::sync_all(self)
    }
}

impl DurableFs for StdFs {
    fn create_new(&self, path: &Path, mode: u32) -> io::Result<Box<dyn DurableFile>> {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)?;
        Ok(Box::new(file))
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn DurableFile>> {
        Ok(Box::new(File::create(path)?))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

/// The shared production [`DurableFs`].
pub fn std_fs() -> Arc<dyn DurableFs> {
    static FS: OnceLock<Arc<dyn DurableFs>> = OnceLock::new();
    Arc::clone(FS.get_or_init(|| Arc::new(StdFs)))
}
