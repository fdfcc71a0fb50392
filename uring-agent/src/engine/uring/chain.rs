//! Chain builders, free of any ring access: from a request's data they make the entries, each
//! tagged with its step, its expected write length and the flags that link it to the next one.
//!
//! What a link guarantees depends on the opcode. A failed `openat`, `write` or `close` marks
//! itself failed: the kernel cancels the entries linked after it. A failed `fsync`, `renameat`,
//! `unlinkat`, `mkdirat` or `symlinkat` does not (Linux 6.x stores their result without marking
//! the request failed): the next entry runs anyway, and with `SKIP_SUCCESS` even the failure's
//! completion is skipped. So:
//! - `SKIP_SUCCESS` goes only on entries whose failure cancels the rest
//!   ([`failure_cancels_links`]); the others always post their completion.
//! - A chain ends after such an entry whenever what follows must not run after its failure.
//!
//! Hence:
//! - A replace is two chains: prepare, `openat (into the slot) -> write -> fsync -> close`, and,
//!   once every step of it succeeded, install, `renameat -> fsync(dir)`. A removal is `unlinkat
//!   =>(hard link) fsync(dir)`. In a group-commit group the directory fsync is left out: the
//!   group shares one.
//! - A configfs segment runs attribute writes (`openat -> write -> close` on the segment's slot)
//!   and ends after its first other operation (mkdir, symlink, unlink, rmdir), or after
//!   [`MAX_OPS_PER_CHAIN`] operations.
//!
//! Every entry but the last is linked to the next one, so a successful chain whose entries all
//! cancel on failure wakes the ring thread once.

use std::ffi::CStr;
use std::os::fd::RawFd;

use io_uring::opcode;
use io_uring::squeue::{Entry, Flags};
use io_uring::types::{Fd, Fixed};

use super::flight::{CfgPart, CfgStep, ChainState, Cleanup, FlightId, Planned, Slot, user_data};
use super::job::{CfgOp, ReplaceData};
use super::queue::FdOnly;
use crate::engine::{DurableStep, FaultInjection};

/// configfs operations per linked chain (an attribute write takes three entries).
pub const MAX_OPS_PER_CHAIN: usize = 64;

// Entry indices are 16 bits of user data.
const _: () = assert!(3 * MAX_OPS_PER_CHAIN < u16::MAX as usize);

/// How the engine builds chains on this kernel.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ChainOptions {
    /// The kernel can skip completions of successful entries.
    pub skip_success: bool,
    /// The step every durable chain fails at (tests).
    pub fault: FaultInjection,
}

/// A chain ready to push: its entries (user data and flags set) and their plan.
#[derive(Debug)]
pub(super) struct Chain<S> {
    pub entries: Vec<Entry>,
    pub planned: Vec<Planned<S>>,
}

impl<S: super::flight::StepKind> Chain<S> {
    /// The entries to push, and the state that collects their completions.
    pub(super) fn into_parts(self) -> (Vec<Entry>, ChainState<S>) {
        (self.entries, ChainState::new(self.planned))
    }
}

/// Collects entries, then seals them into a [`Chain`].
struct Builder<S> {
    entries: Vec<(S, Entry, Flags, Option<u32>)>,
}

impl<S: Copy> Builder<S> {
    fn new() -> Self {
        Self {
            entries: Vec::with_capacity(6),
        }
    }

    /// Adds `entry` for `step`, linked to the next entry with `link` (ignored for the last).
    fn add(&mut self, step: S, entry: Entry, link: Flags, write_len: Option<u32>) {
        self.entries.push((step, entry, link, write_len));
    }

    /// Sets user data `(id, index)` on every entry, and on every entry but the last its link
    /// and, with `skip_success`, `SKIP_SUCCESS` where a failure cancels the rest.
    fn seal(self, id: FlightId, skip_success: bool) -> Chain<S> {
        let n = self.entries.len();
        let (entries, planned) = self
            .entries
            .into_iter()
            .enumerate()
            .map(|(i, (step, entry, link, write_len))| {
                let skip = skip_success && failure_cancels_links(entry.get_opcode());
                let flags = match (i + 1 < n, skip) {
                    (false, _) => Flags::empty(),
                    (true, false) => link,
                    (true, true) => link | Flags::SKIP_SUCCESS,
                };
                let index = u16::try_from(i).expect("chains are shorter than 2^16 entries");
                let entry = entry.user_data(user_data(id, index)).flags(flags);
                (
                    entry,
                    Planned {
                        step,
                        write_len,
                        flags,
                    },
                )
            })
            .unzip();
        Chain { entries, planned }
    }
}

/// Whether a failure of an entry with this opcode cancels the entries linked after it (and,
/// with `SKIP_SUCCESS`, still posts its own completion). Linux 6.x marks failures of `openat`,
/// `read`/`write` and `close` but only stores the result of `fsync`, `renameat`, `unlinkat`,
/// `mkdirat` and `symlinkat`: after one of those fails the chain runs on.
pub(super) fn failure_cancels_links(opcode: u32) -> bool {
    let unmarked = [
        opcode::Fsync::CODE,
        opcode::RenameAt::CODE,
        opcode::UnlinkAt::CODE,
        opcode::MkDirAt::CODE,
        opcode::SymlinkAt::CODE,
    ];
    !unmarked.iter().any(|code| u32::from(*code) == opcode)
}

/// `entry`, or in its place an entry that always fails when fault injection fails `step`.
fn or_injected(step: DurableStep, entry: Entry, fault: FaultInjection) -> Entry {
    if fault.fail_at == Some(step) {
        FdOnly::failing().into_entry()
    } else {
        entry
    }
}

/// The first chain of a replace: the new content into this write's temp file in `dirfd`,
/// through `slot`, made durable and closed. Its fsync does not cancel the close when it fails
/// (the slot is closed either way); the chain ends there, so nothing is renamed after a failure.
pub(super) fn prepare(
    id: FlightId,
    data: &ReplaceData,
    dirfd: RawFd,
    slot: &Slot,
    options: ChainOptions,
) -> Chain<DurableStep> {
    let file = Fixed(slot.index());
    // The temp name is this write's own: O_EXCL, never someone else's file. No O_CLOEXEC: the
    // kernel refuses it for direct descriptors (they are never in the process's fd table, so
    // there is nothing to leak across exec).
    let steps = [
        (
            DurableStep::Open,
            opcode::OpenAt::new(Fd(dirfd), data.tmp.as_ptr())
                .flags(libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL)
                .mode(0o600)
                .file_index(Some(slot.dest()))
                .build(),
        ),
        (
            DurableStep::Write,
            opcode::Write::new(file, data.data.as_ptr(), data.len)
                .offset(0)
                .build(),
        ),
        (DurableStep::Fsync, opcode::Fsync::new(file).build()),
        (DurableStep::Close, FdOnly::close_slot(slot).into_entry()),
    ];
    let mut chain = Builder::new();
    for (step, entry) in steps {
        if step == DurableStep::Fsync && options.fault.skip_fsync {
            continue;
        }
        let write_len = (step == DurableStep::Write).then_some(data.len);
        let entry = or_injected(step, entry, options.fault);
        chain.add(step, entry, Flags::IO_LINK, write_len);
    }
    chain.seal(id, options.skip_success)
}

/// The second chain of a replace, once the prepared temp file is durable: rename it over the
/// file, then (unless grouped) fsync the directory. A failed rename does not cancel the fsync,
/// which is harmless; its completion says it failed.
pub(super) fn install(
    id: FlightId,
    data: &ReplaceData,
    dirfd: RawFd,
    grouped: bool,
    options: ChainOptions,
) -> Chain<DurableStep> {
    let dir = Fd(dirfd);
    let rename = opcode::RenameAt::new(dir, data.tmp.as_ptr(), dir, data.name.as_ptr()).build();
    let mut chain = Builder::new();
    let rename = or_injected(DurableStep::Rename, rename, options.fault);
    chain.add(DurableStep::Rename, rename, Flags::IO_LINK, None);
    if !grouped {
        add_dir_fsync(&mut chain, dirfd, options.fault);
    }
    chain.seal(id, options.skip_success)
}

/// The steps of one replace as this engine chains them, in order: the first chain's, then
/// the second's (without the directory fsync when `grouped`: the group's one fsync follows
/// once every member renamed). The crash-state tests compare them with the operations the
/// synchronous engine records, so the crash states of one recording are this engine's too.
#[cfg(any(test, feature = "test-seams"))]
pub fn replace_steps(grouped: bool) -> Vec<DurableStep> {
    let data = ReplaceData {
        tmp: c".a.json.tmp".to_owned(),
        name: c"a.json".to_owned(),
        data: vec![b'\n'],
        len: 1,
    };
    let Some(slot) = super::flight::SlotPool::new(1).take() else {
        return Vec::new();
    };
    let id = super::flight::Ids::new().next();
    let options = ChainOptions::default();
    let prepared = prepare(id, &data, -1, &slot, options);
    let installed = install(id, &data, -1, grouped, options);
    (prepared.planned.iter())
        .chain(&installed.planned)
        .map(|p| p.step)
        .collect()
}

/// The chain of a removal of `name` from the directory `dirfd`.
pub(super) fn remove(
    id: FlightId,
    name: &CStr,
    dirfd: RawFd,
    grouped: bool,
    options: ChainOptions,
) -> Chain<DurableStep> {
    let mut chain = Builder::new();
    // Hard link: the directory fsync runs even when the file was already gone, so a removal
    // that an earlier crash left non-durable becomes durable.
    let unlink = opcode::UnlinkAt::new(Fd(dirfd), name.as_ptr()).build();
    chain.add(DurableStep::Unlink, unlink, Flags::IO_HARDLINK, None);
    if !grouped {
        add_dir_fsync(&mut chain, dirfd, options.fault);
    }
    chain.seal(id, options.skip_success)
}

fn add_dir_fsync(chain: &mut Builder<DurableStep>, dirfd: RawFd, fault: FaultInjection) {
    let fsync = group_fsync_entry(dirfd, fault).into_entry();
    chain.add(DurableStep::FsyncDir, fsync, Flags::empty(), None);
}

fn group_fsync_entry(dirfd: RawFd, fault: FaultInjection) -> FdOnly {
    if fault.fail_at == Some(DurableStep::FsyncDir) {
        FdOnly::failing()
    } else {
        FdOnly::fsync(dirfd)
    }
}

/// The fsync of directory `dirfd` a group-commit group `id` shares.
pub(super) fn group_fsync(id: FlightId, dirfd: RawFd, fault: FaultInjection) -> FdOnly {
    group_fsync_entry(dirfd, fault).user_data(user_data(id, 0))
}

/// The entries of cleanup `id`: close of the descriptor a failed chain left in its slot, then
/// unlink of the temp file it left. Hard-linked (the unlink runs whatever the close did), and
/// every entry posts its completion.
pub(super) fn cleanup(id: FlightId, cleanup: &Cleanup) -> Vec<Entry> {
    let mut chain = Builder::new();
    if cleanup.close_slot
        && let Some(slot) = &cleanup.slot
    {
        chain.add(
            (),
            FdOnly::close_slot(slot).into_entry(),
            Flags::IO_HARDLINK,
            None,
        );
    }
    if let Some(temp) = &cleanup.temp {
        let unlink = opcode::UnlinkAt::new(Fd(temp.dir.raw_fd()), temp.name.as_ptr()).build();
        chain.add((), unlink, Flags::IO_HARDLINK, None);
    }
    chain.seal(id, false).entries
}

/// Operations a chain may hold: [`MAX_OPS_PER_CHAIN`] on the kernel, one where each must be
/// admitted by a double's rules after the one before it ran.
pub(super) fn ops_per_chain(one_op_per_chain: bool) -> usize {
    if one_op_per_chain {
        1
    } else {
        MAX_OPS_PER_CHAIN
    }
}

/// Where the segment of `ops` that starts at `next` ends: after its first operation other than
/// an attribute write (whose failure would not stop the rest), or after `max_ops` operations
/// ([`MAX_OPS_PER_CHAIN`] on the kernel, 1 under a double's rules), or at the end of the plan.
pub(super) fn segment_end(ops: &[CfgOp], next: usize, max_ops: usize) -> usize {
    let limit = next.saturating_add(max_ops.max(1)).min(ops.len());
    ops.iter()
        .enumerate()
        .take(limit)
        .skip(next)
        .find(|(_, op)| !matches!(op, CfgOp::Write { .. }))
        .map_or(limit, |(i, _)| i + 1)
}

/// The chain of operations `next..segment_end(ops, next, max_ops)` of a configfs plan against
/// the tree open at `rootfd`, writing attributes through `slot`.
pub(super) fn configfs_segment(
    id: FlightId,
    ops: &[CfgOp],
    (next, max_ops): (usize, usize),
    rootfd: RawFd,
    slot: &Slot,
    skip_success: bool,
) -> Chain<CfgStep> {
    let root = Fd(rootfd);
    let end = segment_end(ops, next, max_ops);
    let mut chain = Builder::new();
    let single = |op| CfgStep {
        op,
        part: CfgPart::Single,
    };
    for (op, cfg) in ops.iter().enumerate().take(end).skip(next) {
        match cfg {
            CfgOp::Mkdir { path } => {
                let mkdir = opcode::MkDirAt::new(root, path.as_ptr())
                    .mode(0o755)
                    .build();
                chain.add(single(op), mkdir, Flags::IO_LINK, None);
            }
            CfgOp::Write { path, value, len } => {
                let open = opcode::OpenAt::new(root, path.as_ptr())
                    .flags(libc::O_WRONLY)
                    .file_index(Some(slot.dest()))
                    .build();
                let write = opcode::Write::new(Fixed(slot.index()), value.as_ptr(), *len)
                    .offset(0)
                    .build();
                let close = FdOnly::close_slot(slot).into_entry();
                let part = |part| CfgStep { op, part };
                chain.add(part(CfgPart::Open), open, Flags::IO_LINK, None);
                chain.add(part(CfgPart::Write), write, Flags::IO_LINK, Some(*len));
                chain.add(part(CfgPart::Close), close, Flags::IO_LINK, None);
            }
            CfgOp::Symlink { link, target } => {
                let symlink = opcode::SymlinkAt::new(root, target.as_ptr(), link.as_ptr()).build();
                chain.add(single(op), symlink, Flags::IO_LINK, None);
            }
            CfgOp::Unlink { path } => {
                let unlink = opcode::UnlinkAt::new(root, path.as_ptr()).build();
                chain.add(single(op), unlink, Flags::IO_LINK, None);
            }
            CfgOp::Rmdir { path } => {
                let rmdir = opcode::UnlinkAt::new(root, path.as_ptr())
                    .flags(libc::AT_REMOVEDIR)
                    .build();
                chain.add(single(op), rmdir, Flags::IO_LINK, None);
            }
        }
    }
    chain.seal(id, skip_success)
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;

    use super::*;
    use crate::engine::uring::flight::SlotPool;

    const DIRFD: RawFd = 7;

    fn slot() -> Slot {
        SlotPool::new(1).take().unwrap()
    }

    fn data() -> ReplaceData {
        ReplaceData {
            tmp: CString::new(".a.json.1.tmp").unwrap(),
            name: CString::new("a.json").unwrap(),
            data: b"0123456789".to_vec(),
            len: 10,
        }
    }

    fn id() -> FlightId {
        let mut ids = super::super::flight::Ids::new();
        ids.next();
        ids.next()
    }

    fn options(skip_success: bool) -> ChainOptions {
        ChainOptions {
            skip_success,
            fault: FaultInjection::default(),
        }
    }

    fn steps<S: Copy>(chain: &Chain<S>) -> Vec<S> {
        chain.planned.iter().map(|p| p.step).collect()
    }

    fn opcodes<S>(chain: &Chain<S>) -> Vec<u8> {
        chain
            .entries
            .iter()
            .map(|e| u8::try_from(e.get_opcode()).unwrap())
            .collect()
    }

    /// Every entry but the last carries `link`, and SKIP_SUCCESS when asked and its failure
    /// cancels the rest; the last carries nothing. The planned flags are the entry's own.
    fn assert_links<S>(chain: &Chain<S>, link: &[Flags], skip_success: bool) {
        let n = chain.planned.len();
        for (i, (planned, entry)) in chain.planned.iter().zip(&chain.entries).enumerate() {
            // The entry's own flags (its Debug output is the crate's only window on them),
            // besides FIXED_FILE, which the crate sets on entries addressing a slot.
            let shown = format!("{entry:?}");
            let set: u8 = shown
                .split("flags: ")
                .nth(1)
                .and_then(|rest| rest.split(',').next())
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(
                set & !Flags::FIXED_FILE.bits(),
                planned.flags.bits(),
                "entry {i}: {shown}"
            );
            if i + 1 == n {
                assert_eq!(planned.flags, Flags::empty(), "last entry {i}");
            } else {
                let mut want = link[i];
                if skip_success && failure_cancels_links(entry.get_opcode()) {
                    want |= Flags::SKIP_SUCCESS;
                }
                assert_eq!(planned.flags, want, "entry {i}");
            }
        }
    }

    fn assert_user_data<S>(chain: &Chain<S>, id: FlightId) {
        for (i, entry) in chain.entries.iter().enumerate() {
            let index = u16::try_from(i).unwrap();
            assert_eq!(entry.get_user_data(), user_data(id, index));
        }
    }

    fn skip_flags<S>(chain: &Chain<S>) -> Vec<bool> {
        let skips = |p: &Planned<S>| p.flags.contains(Flags::SKIP_SUCCESS);
        chain.planned.iter().map(skips).collect()
    }

    #[test]
    fn only_openat_write_and_close_failures_cancel_a_chain() {
        for code in [
            opcode::OpenAt::CODE,
            opcode::Write::CODE,
            opcode::Close::CODE,
        ] {
            assert!(failure_cancels_links(code.into()));
        }
        for code in [
            opcode::Fsync::CODE,
            opcode::RenameAt::CODE,
            opcode::UnlinkAt::CODE,
            opcode::MkDirAt::CODE,
            opcode::SymlinkAt::CODE,
        ] {
            assert!(!failure_cancels_links(code.into()));
        }
    }

    #[test]
    fn a_replace_prepares_open_write_fsync_close() {
        for skip_success in [false, true] {
            let chain = prepare(id(), &data(), DIRFD, &slot(), options(skip_success));
            assert_eq!(steps(&chain), DurableStep::REPLACE[..4]);
            assert_eq!(
                opcodes(&chain),
                [
                    opcode::OpenAt::CODE,
                    opcode::Write::CODE,
                    opcode::Fsync::CODE,
                    opcode::Close::CODE,
                ]
            );
            assert_links(&chain, &[Flags::IO_LINK; 3], skip_success);
            // The fsync always posts its completion: its failure cancels nothing.
            assert_eq!(
                skip_flags(&chain),
                [skip_success, skip_success, false, false]
            );
            assert_user_data(&chain, id());
            let write_len: Vec<Option<u32>> = chain.planned.iter().map(|p| p.write_len).collect();
            assert_eq!(write_len, [None, Some(10), None, None]);
        }
    }

    #[test]
    fn a_replace_installs_rename_then_fsync_dir() {
        for skip_success in [false, true] {
            let chain = install(id(), &data(), DIRFD, false, options(skip_success));
            assert_eq!(steps(&chain), DurableStep::REPLACE[4..]);
            assert_eq!(
                opcodes(&chain),
                [opcode::RenameAt::CODE, opcode::Fsync::CODE]
            );
            assert_links(&chain, &[Flags::IO_LINK], skip_success);
            assert_eq!(
                skip_flags(&chain),
                [false, false],
                "a failed rename must show"
            );
            assert_user_data(&chain, id());
        }
    }

    #[test]
    fn a_grouped_replace_leaves_the_directory_fsync_to_its_group() {
        let chain = install(id(), &data(), DIRFD, true, options(true));
        assert_eq!(steps(&chain), [DurableStep::Rename]);
        assert_eq!(chain.planned[0].flags, Flags::empty());
    }

    #[test]
    fn a_removal_is_hard_linked_to_the_directory_fsync() {
        for skip_success in [false, true] {
            let name = CString::new("a.json").unwrap();
            let chain = remove(id(), &name, DIRFD, false, options(skip_success));
            assert_eq!(steps(&chain), [DurableStep::Unlink, DurableStep::FsyncDir]);
            assert_eq!(
                opcodes(&chain),
                [opcode::UnlinkAt::CODE, opcode::Fsync::CODE]
            );
            assert_links(&chain, &[Flags::IO_HARDLINK], skip_success);
            assert!(chain.planned[0].hard_link());
            assert_eq!(
                skip_flags(&chain),
                [false, false],
                "a failed unlink must show"
            );
            assert_user_data(&chain, id());

            let grouped = remove(id(), &name, DIRFD, true, options(skip_success));
            assert_eq!(steps(&grouped), [DurableStep::Unlink]);
            assert_eq!(grouped.planned[0].flags, Flags::empty());
        }
    }

    /// The opcodes of both chains of a replace, with `fault`.
    fn replace_opcodes(fault: FaultInjection) -> (Vec<DurableStep>, Vec<u8>) {
        let options = ChainOptions {
            skip_success: true,
            fault,
        };
        let first = prepare(id(), &data(), DIRFD, &slot(), options);
        let second = install(id(), &data(), DIRFD, false, options);
        let steps = [steps(&first), steps(&second)].concat();
        (steps, [opcodes(&first), opcodes(&second)].concat())
    }

    #[test]
    fn a_skipped_fsync_leaves_only_the_temp_files_fsync_out() {
        let (steps, got) = replace_opcodes(FaultInjection {
            skip_fsync: true,
            ..FaultInjection::default()
        });
        let mut want = DurableStep::REPLACE.to_vec();
        want.retain(|s| *s != DurableStep::Fsync);
        assert_eq!(steps, want);
        assert_eq!(
            got,
            [
                opcode::OpenAt::CODE,
                opcode::Write::CODE,
                opcode::Close::CODE,
                opcode::RenameAt::CODE,
                opcode::Fsync::CODE,
            ],
            "the directory fsync stays"
        );
    }

    #[test]
    fn fault_injection_replaces_exactly_the_chosen_step() {
        let (_, clean) = replace_opcodes(FaultInjection::default());
        for (index, step) in DurableStep::REPLACE.into_iter().enumerate() {
            let (steps, got) = replace_opcodes(FaultInjection {
                fail_at: Some(step),
                ..FaultInjection::default()
            });
            assert_eq!(steps, DurableStep::REPLACE, "the plan is unchanged");
            for (i, (got, clean)) in got.iter().zip(&clean).enumerate() {
                if i == index {
                    // The always-failing close (for the close step itself, the same opcode on
                    // descriptor -1 instead of the slot).
                    assert_eq!(*got, opcode::Close::CODE, "{step}");
                } else {
                    assert_eq!(got, clean, "{step}: entry {i} untouched");
                }
            }
        }
    }

    fn cfg(path: &str) -> CString {
        CString::new(path).unwrap()
    }

    #[test]
    fn a_configfs_segment_maps_each_operation_to_its_entries() {
        let ops = vec![
            CfgOp::Mkdir { path: cfg("a") },
            CfgOp::Write {
                path: cfg("a/attr"),
                value: b"1".to_vec(),
                len: 1,
            },
            CfgOp::Symlink {
                link: cfg("b/a"),
                target: cfg("/cfg/a"),
            },
            CfgOp::Unlink { path: cfg("b/a") },
            CfgOp::Rmdir { path: cfg("a") },
        ];
        let mut chains = Vec::new();
        let mut next = 0;
        while next < ops.len() {
            let span = (next, MAX_OPS_PER_CHAIN);
            chains.push(configfs_segment(id(), &ops, span, DIRFD, &slot(), true));
            next = segment_end(&ops, next, MAX_OPS_PER_CHAIN);
        }
        // Each operation whose failure would not stop the rest ends its segment.
        let single = |op| {
            vec![CfgStep {
                op,
                part: CfgPart::Single,
            }]
        };
        let part = |part| CfgStep { op: 1, part };
        let all: Vec<Vec<CfgStep>> = chains.iter().map(steps).collect();
        assert_eq!(
            all,
            [
                single(0),
                vec![
                    part(CfgPart::Open),
                    part(CfgPart::Write),
                    part(CfgPart::Close),
                    CfgStep {
                        op: 2,
                        part: CfgPart::Single
                    },
                ],
                single(3),
                single(4),
            ]
        );
        let codes: Vec<Vec<u8>> = chains.iter().map(opcodes).collect();
        assert_eq!(
            codes,
            [
                vec![opcode::MkDirAt::CODE],
                vec![
                    opcode::OpenAt::CODE,
                    opcode::Write::CODE,
                    opcode::Close::CODE,
                    opcode::SymlinkAt::CODE,
                ],
                vec![opcode::UnlinkAt::CODE],
                vec![opcode::UnlinkAt::CODE],
            ]
        );
        assert_eq!(chains[1].planned[1].write_len, Some(1));
        assert_links(&chains[1], &[Flags::IO_LINK; 3], true);
        assert_user_data(&chains[1], id());
    }

    #[test]
    fn a_configfs_segment_runs_at_most_max_ops_per_chain_operations() {
        let len = 2 * MAX_OPS_PER_CHAIN + 5;
        let ops: Vec<CfgOp> = (0..len)
            .map(|i| CfgOp::Write {
                path: cfg(&format!("attr{i}")),
                value: b"1".to_vec(),
                len: 1,
            })
            .collect();
        let mut next = 0;
        let mut segments = Vec::new();
        while next < len {
            let span = (next, MAX_OPS_PER_CHAIN);
            let chain = configfs_segment(id(), &ops, span, DIRFD, &slot(), false);
            let mut covered: Vec<usize> = steps(&chain).iter().map(|s| s.op).collect();
            covered.dedup();
            let end = segment_end(&ops, next, MAX_OPS_PER_CHAIN);
            assert_eq!(covered, (next..end).collect::<Vec<_>>());
            segments.push(covered.len());
            next = end;
        }
        assert_eq!(segments, [MAX_OPS_PER_CHAIN, MAX_OPS_PER_CHAIN, 5]);
    }

    // Under a double's rules each operation is admitted before its chain and completed after
    // it, so a segment is one operation, even of attribute writes that would share a chain.
    #[test]
    fn a_segment_of_one_operation_holds_that_operation_alone() {
        let write = |i: usize| CfgOp::Write {
            path: cfg(&format!("attr{i}")),
            value: b"1".to_vec(),
            len: 1,
        };
        let ops = vec![write(0), write(1), CfgOp::Mkdir { path: cfg("a") }, write(2)];
        for next in 0..ops.len() {
            assert_eq!(segment_end(&ops, next, 1), next + 1);
            let chain = configfs_segment(id(), &ops, (next, 1), DIRFD, &slot(), true);
            assert!(steps(&chain).iter().all(|s| s.op == next), "{next}");
        }
        assert_eq!(segment_end(&ops, 0, MAX_OPS_PER_CHAIN), 3, "the kernel's segments");
    }

    #[test]
    fn a_cleanup_closes_the_slot_then_unlinks_the_temp_file_each_with_a_completion() {
        use std::sync::Arc;

        use crate::engine::DurableDir;
        use crate::engine::uring::flight::TempFile;

        let tmp = tempfile::tempdir().unwrap();
        let dir: Arc<DurableDir> = DurableDir::open(tmp.path()).unwrap();
        let cleanup = Cleanup {
            slot: Some(slot()),
            close_slot: true,
            temp: Some(TempFile {
                dir,
                name: cfg(".a.json.1-0.tmp"),
            }),
            remaining: 0,
        };
        let entries = super::cleanup(id(), &cleanup);
        let ops: Vec<u8> = entries
            .iter()
            .map(|e| u8::try_from(e.get_opcode()).unwrap())
            .collect();
        assert_eq!(ops, [opcode::Close::CODE, opcode::UnlinkAt::CODE]);
        let user: Vec<u64> = entries.iter().map(Entry::get_user_data).collect();
        assert_eq!(user, [user_data(id(), 0), user_data(id(), 1)]);
        // Hard-linked, and no SKIP_SUCCESS: the unlink runs whatever the close did, and both
        // post their completion.
        let shown = format!("{:?}", entries[0]);
        let hard = Flags::IO_HARDLINK.bits();
        assert!(shown.contains(&format!("flags: {hard},")), "{shown}");

        let only_slot = Cleanup::of_slot(slot(), true);
        assert_eq!(super::cleanup(id(), &only_slot).len(), 1);
        assert!(!Cleanup::of_slot(slot(), false).needs_ring());
    }
}
