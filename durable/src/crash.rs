//! Every state a crash (power loss) may leave of a recorded run, and a checker that runs a
//! path's real reader on each.
//!
//! The model: what ext4 (data=ordered) and xfs both guarantee, as ALICE and CrashMonkey model
//! journaling file systems. A crash after the first `k` operations of a run leaves:
//! - M1 (directory operations in order): a prefix of the run's directory operations (mkdir,
//!   create, rename, unlink). Both file systems log metadata in one ordered journal, so a later
//!   directory operation never survives an earlier one.
//! - M2 (a name is durable once its directory is fsynced): every directory operation before an
//!   fsync of a directory it changed survives, and with M1 every earlier one too. A file's own
//!   fsync is not counted as making its name durable (POSIX does not promise it, though ext4
//!   and xfs do it), which only adds states.
//! - M3 (data up to the last fsync): a file keeps the data and size it had at its last fsync;
//!   writes (and truncations) after it survive as any prefix of them, the last one possibly cut
//!   at a multiple of [`Model::block`] bytes. Data is independent of M1: a renamed file's name
//!   may survive while its unsynced data does not.
//! - M4 (rename is atomic): a renamed-over name holds the old or the new file, never neither.
//! - Not modelled, on purpose: ext4's `auto_da_alloc`, which flushes a file's data when it is
//!   renamed over another; xfs lacks it and `noauto_da_alloc` turns it off, so pillar must not
//!   rely on it (leaving it out adds states, never removes one). Not modelled, because neither
//!   file system does it since Linux 2.6.22 (xfs) / in data=ordered (ext4): a size that survives
//!   without its data (a file of zeros).
//!
//! Invariants:
//! - The states after `k` operations include the state with every operation applied (a crash
//!   right after the `k`-th) and, where nothing was fsynced, the baseline.
//! - Only files reachable by a name are in a state; an inode whose name did not survive is gone.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use crate::record::{FsOp, Inode, Recording, Tree};

/// The model's one parameter (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Model {
    /// Unsynced data survives in prefixes of this many bytes.
    pub block: usize,
}

impl Model {
    /// A disk sector: the unit a disk writes whole. Prefixes of 512 bytes include every state
    /// a 4096-byte file system block would leave.
    pub const SECTOR: Self = Self { block: 512 };
    /// 64-byte prefixes: finer than any disk writes, for showing that no torn file is ever
    /// accepted, and coarse enough that two unsynced files' prefixes (a record and the temp
    /// file of the next write) multiply to thousands of states, not hundreds of thousands.
    pub const FINE: Self = Self { block: 64 };
}

/// What a crash left: directories and files with their content (paths relative to the root).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CrashState {
    pub dirs: BTreeSet<PathBuf>,
    pub files: BTreeMap<PathBuf, Vec<u8>>,
}

impl CrashState {
    /// Writes the state under `root` (which must exist and be empty).
    pub fn build(&self, root: &Path) -> io::Result<()> {
        for dir in &self.dirs {
            std::fs::create_dir_all(root.join(dir))?;
        }
        for (path, bytes) in &self.files {
            std::fs::write(root.join(path), bytes)?;
        }
        Ok(())
    }
}

fn apply_tree(tree: &mut Tree, op: &FsOp) {
    match op {
        FsOp::Mkdir { path } => {
            tree.dirs.insert(path.clone());
        }
        FsOp::Create { path, inode } => {
            tree.files.insert(path.clone(), *inode);
        }
        FsOp::Rename { from, to } => {
            if let Some(inode) = tree.files.remove(from) {
                tree.files.insert(to.clone(), inode);
            }
        }
        FsOp::Unlink { path } => {
            tree.files.remove(path);
        }
        _ => {}
    }
}

fn apply_data(content: &mut Vec<u8>, op: &FsOp, keep: usize) {
    match op {
        FsOp::Truncate { .. } => content.clear(),
        FsOp::Write { offset, data, .. } => {
            let Ok(offset) = usize::try_from(*offset) else {
                return;
            };
            let data = &data[..keep.min(data.len())];
            if content.len() < offset + data.len() {
                content.resize(offset + data.len(), 0);
            }
            content[offset..offset + data.len()].copy_from_slice(data);
        }
        _ => {}
    }
}

/// Every content each inode may hold after `ops` (M3).
fn data_options(
    ops: &[FsOp],
    baseline: &BTreeMap<Inode, Vec<u8>>,
    model: Model,
) -> BTreeMap<Inode, Vec<Vec<u8>>> {
    let mut events: BTreeMap<Inode, (Vec<&FsOp>, usize)> = BTreeMap::new();
    for op in ops {
        match op {
            FsOp::Create { inode, .. } => {
                events.entry(*inode).or_default();
            }
            FsOp::Truncate { inode } | FsOp::Write { inode, .. } => {
                events.entry(*inode).or_default().0.push(op);
            }
            FsOp::Fsync { inode } => {
                let entry = events.entry(*inode).or_default();
                entry.1 = entry.0.len();
            }
            _ => {}
        }
    }
    let mut out = BTreeMap::new();
    for (inode, content) in baseline {
        out.insert(*inode, vec![content.clone()]);
    }
    for (inode, (events, durable)) in events {
        let start = baseline.get(&inode).cloned().unwrap_or_default();
        let mut seen = BTreeSet::new();
        let mut content = start;
        for event in &events[..durable] {
            apply_data(&mut content, event, usize::MAX);
        }
        seen.insert(content.clone());
        for event in &events[durable..] {
            if let FsOp::Write { data, .. } = event {
                for cut in (model.block.max(1)..data.len()).step_by(model.block.max(1)) {
                    let mut partial = content.clone();
                    apply_data(&mut partial, event, cut);
                    seen.insert(partial);
                }
            }
            apply_data(&mut content, event, usize::MAX);
            seen.insert(content.clone());
        }
        out.insert(inode, seen.into_iter().collect());
    }
    out
}

impl Recording {
    /// The directory operations a crash after `k` operations must keep (M2, with M1).
    fn durable_directory_ops(&self, k: usize) -> usize {
        let meta: Vec<(usize, &FsOp)> = self.ops[..k]
            .iter()
            .enumerate()
            .filter(|(_, op)| op.is_directory_op())
            .collect();
        let mut lower = 0;
        for (p, op) in self.ops[..k].iter().enumerate() {
            if let FsOp::FsyncDir { path } = op {
                for (m, (q, meta_op)) in meta.iter().enumerate() {
                    if *q < p && meta_op.parents().contains(path) {
                        lower = lower.max(m + 1);
                    }
                }
            }
        }
        lower
    }

    /// Every state a crash after the first `k` operations may leave.
    pub fn states_after(&self, k: usize, model: Model) -> BTreeSet<CrashState> {
        let ops = &self.ops[..k];
        let meta: Vec<&FsOp> = ops.iter().filter(|op| op.is_directory_op()).collect();
        let options = data_options(ops, &self.contents, model);
        let mut out = BTreeSet::new();
        for kept in self.durable_directory_ops(k)..=meta.len() {
            let mut tree = self.baseline.clone();
            for op in &meta[..kept] {
                apply_tree(&mut tree, op);
            }
            let mut partial = vec![BTreeMap::new()];
            for (path, inode) in &tree.files {
                let choices = options
                    .get(inode)
                    .cloned()
                    .unwrap_or_else(|| vec![Vec::new()]);
                partial = partial
                    .into_iter()
                    .flat_map(|files: BTreeMap<PathBuf, Vec<u8>>| {
                        choices.iter().map(move |bytes| {
                            let mut files = files.clone();
                            files.insert(path.clone(), bytes.clone());
                            files
                        })
                    })
                    .collect();
            }
            for files in partial {
                out.insert(CrashState {
                    dirs: tree.dirs.clone(),
                    files,
                });
            }
        }
        out
    }
}

/// What a path's real reader made of a crash state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Read<V> {
    /// No record (the reader's "never written").
    Absent,
    /// A record with this value.
    Value(V),
    /// The reader refused the state (an error, or the agent refusing to serve).
    Refused(String),
}

/// A state whose reading is not the last acknowledged value or the one in flight.
#[derive(Clone, Debug)]
pub struct Violation<V> {
    /// Operations executed before the crash.
    pub after: usize,
    /// Writes acknowledged before the crash.
    pub acked: usize,
    pub state: CrashState,
    pub read: Read<V>,
}

/// The outcome of [`check`].
#[derive(Clone, Debug)]
pub struct Report<V> {
    /// Operations recorded.
    pub ops: usize,
    /// Crash states over every prefix of the run (a state reachable after several prefixes is
    /// counted once per prefix).
    pub states: usize,
    /// Distinct states (each built and read once).
    pub distinct: usize,
    /// States checked against what was acknowledged (every one of `states`).
    pub checked: usize,
    pub violations: Vec<Violation<V>>,
}

impl<V> fmt::Display for Report<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} operations, {} crash states ({} distinct), {} checked, {} violations",
            self.ops,
            self.states,
            self.distinct,
            self.checked,
            self.violations.len()
        )
    }
}

/// Builds every crash state of `recording` under `scratch` and reads it with `read`; a state
/// must read as the last acknowledged value or the one in flight. `values[0]` is what the
/// baseline holds (`None`: no record), `values[i]` what the `i`-th acknowledged write wrote
/// (`None`: a removal). A torn or lost record shows as a violation whose read is
/// [`Read::Refused`] (failing closed) or any other value (failing open).
pub fn check<V: Clone + PartialEq + fmt::Debug>(
    recording: &Recording,
    model: Model,
    values: &[Option<V>],
    scratch: &Path,
    mut read: impl FnMut(&Path) -> Read<V>,
) -> io::Result<Report<V>> {
    let mut report = Report {
        ops: recording.ops.len(),
        states: 0,
        distinct: 0,
        checked: 0,
        violations: Vec::new(),
    };
    let mut reads: HashMap<CrashState, Read<V>> = HashMap::new();
    for k in 0..=recording.ops.len() {
        let acked = recording.acks.iter().filter(|&&a| a <= k).count();
        let allowed: Vec<Read<V>> = [values.get(acked), values.get(acked + 1)]
            .into_iter()
            .flatten()
            .map(|v| v.clone().map_or(Read::Absent, Read::Value))
            .collect();
        for state in recording.states_after(k, model) {
            report.states += 1;
            let got = match reads.get(&state) {
                Some(got) => got.clone(),
                None => {
                    let root = scratch.join(format!("state-{}", reads.len()));
                    std::fs::create_dir_all(&root)?;
                    state.build(&root)?;
                    let got = read(&root);
                    std::fs::remove_dir_all(&root)?;
                    reads.insert(state.clone(), got.clone());
                    got
                }
            };
            report.checked += 1;
            if !allowed.contains(&got) {
                report.violations.push(Violation {
                    after: k,
                    acked,
                    state,
                    read: got,
                });
            }
        }
    }
    report.distinct = reads.len();
    Ok(report)
}
