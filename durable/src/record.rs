//! A [`DurableFs`] that performs every operation on a real directory and logs it, so a durable
//! write path's own sequence of operations can be replayed into crash states
//! ([`crate::crash`]).
//!
//! Invariants:
//! - Every operation is performed first and logged only when it succeeded, in the order the
//!   path issued it; a failed operation changes nothing in the log.
//! - Paths are logged relative to the recorder's root; an operation outside the root is refused
//!   (`PermissionDenied`), so nothing a path does escapes the log.
//! - Files that exist when the recorder starts form its baseline, taken as durable.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use crate::{DurableFile, DurableFs};

/// An inode number of the log (not the real file system's).
pub type Inode = u64;

/// One file operation, as a crash model sees it. Paths are relative to the recorder's root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FsOp {
    /// A directory was created.
    Mkdir { path: PathBuf },
    /// A new, empty file `inode` was created at `path`.
    Create { path: PathBuf, inode: Inode },
    /// The file `inode` was truncated to nothing (`File::create` of an existing file).
    Truncate { inode: Inode },
    /// `data` was written to `inode` at `offset`.
    Write {
        inode: Inode,
        offset: u64,
        data: Vec<u8>,
    },
    /// fsync of the file `inode`.
    Fsync { inode: Inode },
    /// `from` was renamed to `to` (replacing it).
    Rename { from: PathBuf, to: PathBuf },
    /// The file at `path` was removed.
    Unlink { path: PathBuf },
    /// fsync of the directory `path`.
    FsyncDir { path: PathBuf },
}

impl FsOp {
    /// Whether the operation changes a directory (journaled metadata on ext4 and xfs).
    pub fn is_directory_op(&self) -> bool {
        matches!(
            self,
            Self::Mkdir { .. } | Self::Create { .. } | Self::Rename { .. } | Self::Unlink { .. }
        )
    }

    /// The directories whose entries the operation changes.
    pub fn parents(&self) -> Vec<PathBuf> {
        let parent = |p: &Path| p.parent().map(Path::to_path_buf).unwrap_or_default();
        match self {
            Self::Mkdir { path } | Self::Create { path, .. } | Self::Unlink { path } => {
                vec![parent(path)]
            }
            Self::Rename { from, to } => vec![parent(from), parent(to)],
            _ => Vec::new(),
        }
    }
}

/// What a directory holds at a point: directories, and files by inode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tree {
    pub dirs: BTreeSet<PathBuf>,
    pub files: BTreeMap<PathBuf, Inode>,
}

/// A recorded run: the durable baseline, the operations, and where each acknowledged write
/// ended (an index into `ops`: the write's operations are `ops[..ack]`).
#[derive(Clone, Debug, Default)]
pub struct Recording {
    pub baseline: Tree,
    pub contents: BTreeMap<Inode, Vec<u8>>,
    pub ops: Vec<FsOp>,
    pub acks: Vec<usize>,
}

impl Recording {
    /// The same run with the operations `drop` refuses left out (acknowledgments kept at
    /// their place): a broken write order, for showing the model catches it.
    pub fn without(&self, drop: impl Fn(&FsOp) -> bool) -> Self {
        let mut out = Self {
            baseline: self.baseline.clone(),
            contents: self.contents.clone(),
            ops: Vec::new(),
            acks: Vec::new(),
        };
        let mut acks = self.acks.iter().peekable();
        for (i, op) in self.ops.iter().enumerate() {
            while acks.next_if(|&&a| a == i).is_some() {
                out.acks.push(out.ops.len());
            }
            if !drop(op) {
                out.ops.push(op.clone());
            }
        }
        out.acks.extend(acks.map(|_| out.ops.len()));
        out
    }
}

#[derive(Debug, Default)]
struct Log {
    recording: Recording,
    names: HashMap<PathBuf, Inode>,
    next: Inode,
}

impl Log {
    fn inode(&mut self) -> Inode {
        self.next += 1;
        self.next
    }
}

/// See the module documentation.
#[derive(Clone)]
pub struct Recorder {
    root: PathBuf,
    log: Arc<Mutex<Log>>,
}

impl fmt::Debug for Recorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recorder")
            .field("root", &self.root)
            .finish()
    }
}

fn outside(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("{} is outside the recorded directory", path.display()),
    )
}

impl Recorder {
    /// A recorder over `root`, whose present content is the durable baseline.
    pub fn new(root: &Path) -> io::Result<Self> {
        let mut log = Log::default();
        let mut stack = vec![PathBuf::new()];
        while let Some(rel) = stack.pop() {
            for entry in std::fs::read_dir(root.join(&rel))? {
                let entry = entry?;
                let name = rel.join(entry.file_name());
                if entry.file_type()?.is_dir() {
                    log.recording.baseline.dirs.insert(name.clone());
                    stack.push(name);
                } else {
                    let inode = log.inode();
                    let bytes = std::fs::read(entry.path())?;
                    log.recording.contents.insert(inode, bytes);
                    log.recording.baseline.files.insert(name.clone(), inode);
                    log.names.insert(name, inode);
                }
            }
        }
        Ok(Self {
            root: root.to_path_buf(),
            log: Arc::new(Mutex::new(log)),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn rel(&self, path: &Path) -> io::Result<PathBuf> {
        path.strip_prefix(&self.root)
            .map(Path::to_path_buf)
            .map_err(|_| outside(path))
    }

    fn push(&self, op: FsOp) {
        self.lock().recording.ops.push(op);
    }

    /// The write whose operations were logged so far was acknowledged (its function returned
    /// success): a crash from here on must keep it.
    pub fn ack(&self) {
        let mut log = self.lock();
        let at = log.recording.ops.len();
        log.recording.acks.push(at);
    }

    /// What was recorded so far.
    pub fn recording(&self) -> Recording {
        self.lock().recording.clone()
    }

    fn opened(&self, rel: PathBuf, file: File) -> Box<dyn DurableFile> {
        let mut log = self.lock();
        let inode = match log.names.get(&rel) {
            Some(&inode) => {
                log.recording.ops.push(FsOp::Truncate { inode });
                inode
            }
            None => {
                let inode = log.inode();
                log.names.insert(rel.clone(), inode);
                log.recording.ops.push(FsOp::Create { path: rel, inode });
                inode
            }
        };
        Box::new(RecordedFile {
            file,
            inode,
            offset: 0,
            recorder: self.clone(),
        })
    }
}

/// A file opened through a [`Recorder`].
struct RecordedFile {
    file: File,
    inode: Inode,
    offset: u64,
    recorder: Recorder,
}

impl fmt::Debug for RecordedFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordedFile")
            .field("inode", &self.inode)
            .finish()
    }
}

impl Write for RecordedFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write(buf)?;
        self.recorder.push(FsOp::Write {
            inode: self.inode,
            offset: self.offset,
            data: buf[..n].to_vec(),
        });
        self.offset += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl DurableFile for RecordedFile {
    fn sync_all(&mut self) -> io::Result<()> {
        self.file.sync_all()?;
        self.recorder.push(FsOp::Fsync { inode: self.inode });
        Ok(())
    }
}

impl DurableFs for Recorder {
    fn create_new(&self, path: &Path, mode: u32) -> io::Result<Box<dyn DurableFile>> {
        let rel = self.rel(path)?;
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)?;
        Ok(self.opened(rel, file))
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn DurableFile>> {
        let rel = self.rel(path)?;
        let file = File::create(path)?;
        Ok(self.opened(rel, file))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let (rel_from, rel_to) = (self.rel(from)?, self.rel(to)?);
        std::fs::rename(from, to)?;
        let mut log = self.lock();
        if let Some(inode) = log.names.remove(&rel_from) {
            log.names.insert(rel_to.clone(), inode);
        }
        log.recording.ops.push(FsOp::Rename {
            from: rel_from,
            to: rel_to,
        });
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let rel = self.rel(path)?;
        std::fs::remove_file(path)?;
        let mut log = self.lock();
        log.names.remove(&rel);
        log.recording.ops.push(FsOp::Unlink { path: rel });
        Ok(())
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let rel = self.rel(path)?;
        let mut at = PathBuf::new();
        for part in rel.components() {
            at.push(part);
            match std::fs::create_dir(self.root.join(&at)) {
                Ok(()) => self.push(FsOp::Mkdir { path: at.clone() }),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let rel = self.rel(dir)?;
        File::open(dir)?.sync_all()?;
        self.push(FsOp::FsyncDir { path: rel });
        Ok(())
    }
}
