//! In-flight bookkeeping, free of any ring access: which chain a completion belongs to, what
//! each chain's completions say, which descriptor slots are free, and group commit.
//!
//! A completion's user data is `(id << 16) | index`: the chain (or group fsync, or cleanup) it
//! belongs to, and the entry's position in that chain.

use std::ffi::CString;
use std::io;
use std::path::Path;
use std::sync::Arc;

use io_uring::squeue::Flags;
use io_uring::types::DestinationSlot;
use pillar_nvmet::{ApplyError, Op};

use super::job::{ConfigfsJob, DurableJob};
use crate::engine::{DurableDir, DurableStep, EngineError};

/// Bits of user data that hold the entry's index in its chain.
const INDEX_BITS: u32 = 16;
/// Ids use the remaining 48 bits.
const ID_LIMIT: u64 = 1 << (64 - INDEX_BITS);

/// User data of the eventfd read that wakes the ring thread. No entry of a chain has it: ids
/// stay below `ID_LIMIT - 1`.
pub(super) const WAKE: u64 = u64::MAX;

/// Names one chain, group fsync or cleanup in the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct FlightId(u64);

/// Hands out ids, cycling through 48 bits (a wrap-around is ~10^14 requests away, so an id is
/// never in use twice).
#[derive(Debug)]
pub(super) struct Ids {
    next: u64,
}

impl Ids {
    pub(super) fn new() -> Self {
        Self { next: 1 }
    }

    pub(super) fn next(&mut self) -> FlightId {
        let id = self.next;
        self.next += 1;
        if self.next >= ID_LIMIT - 1 {
            self.next = 1;
        }
        FlightId(id)
    }
}

/// The user data of entry `index` of chain `id`.
pub(super) fn user_data(id: FlightId, index: u16) -> u64 {
    (id.0 << INDEX_BITS) | u64::from(index)
}

/// What a completion's user data names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tag {
    Wake,
    Entry { id: FlightId, index: usize },
}

pub(super) fn decode(user_data: u64) -> Tag {
    if user_data == WAKE {
        return Tag::Wake;
    }
    let index = user_data & ((1 << INDEX_BITS) - 1);
    Tag::Entry {
        id: FlightId(user_data >> INDEX_BITS),
        // 16 bits always fit a usize.
        index: usize::from(u16::try_from(index).unwrap_or(u16::MAX)),
    }
}

/// A direct-descriptor slot. Not `Clone`: a slot belongs to exactly one chain at a time, or to
/// the pool, and a chain that opens a file needs one by type.
#[derive(Debug)]
pub(super) struct Slot {
    index: u32,
    dest: DestinationSlot,
}

impl Slot {
    pub(super) fn index(&self) -> u32 {
        self.index
    }

    /// The slot as an `openat` target.
    pub(super) fn dest(&self) -> DestinationSlot {
        self.dest
    }
}

/// The free slots.
#[derive(Debug)]
pub(super) struct SlotPool {
    free: Vec<Slot>,
}

impl SlotPool {
    /// Slots `0..count`.
    pub(super) fn new(count: u32) -> Self {
        let free = (0..count)
            .rev()
            .filter_map(|index| {
                // Every index up to u32::MAX - 2 is a valid target; the table is far smaller.
                DestinationSlot::try_from_slot_target(index)
                    .ok()
                    .map(|dest| Slot { index, dest })
            })
            .collect();
        Self { free }
    }

    pub(super) fn take(&mut self) -> Option<Slot> {
        self.free.pop()
    }

    pub(super) fn put(&mut self, slot: Slot) {
        self.free.push(slot);
    }

    #[cfg(test)]
    pub(super) fn free(&self) -> usize {
        self.free.len()
    }
}

/// What the bookkeeping needs to know about a step of a chain.
pub(super) trait StepKind: Copy {
    /// The step installs a file in the chain's descriptor slot.
    fn opens_slot(self) -> bool;
    /// The step closes the chain's descriptor slot.
    fn closes_slot(self) -> bool;
}

impl StepKind for DurableStep {
    fn opens_slot(self) -> bool {
        self == Self::Open
    }

    fn closes_slot(self) -> bool {
        self == Self::Close
    }
}

/// Part of configfs operation `op` (an index into the plan); an attribute write takes three
/// entries (open, write, close), every other operation one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CfgStep {
    pub op: usize,
    pub part: CfgPart,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CfgPart {
    Open,
    Write,
    Close,
    Single,
}

impl StepKind for CfgStep {
    fn opens_slot(self) -> bool {
        self.part == CfgPart::Open
    }

    fn closes_slot(self) -> bool {
        self.part == CfgPart::Close
    }
}

/// One entry of a chain as planned: its step, the byte count a write must reach, and the flags
/// set on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Planned<S> {
    pub step: S,
    pub write_len: Option<u32>,
    pub flags: Flags,
}

impl<S> Planned<S> {
    /// Hard-linked to the next entry: a failure here does not cancel the rest.
    pub(super) fn hard_link(&self) -> bool {
        self.flags.contains(Flags::IO_HARDLINK)
    }

    /// A failure here cancels the rest of the chain and skips their completions: the entry is
    /// linked (not hard-linked) and carries `SKIP_SUCCESS`, which the builders set only where
    /// the kernel marks a failure (`chain::failure_cancels_links`).
    fn failure_ends_chain(&self) -> bool {
        self.flags.contains(Flags::IO_LINK | Flags::SKIP_SUCCESS) && !self.hard_link()
    }
}

/// The first failed entry of a chain.
#[derive(Debug)]
pub(super) struct Failure<S> {
    pub index: usize,
    pub step: S,
    pub error: io::Error,
}

/// The completions of one linked chain.
#[derive(Debug)]
pub(super) struct ChainState<S> {
    planned: Vec<Planned<S>>,
    results: Vec<Option<i32>>,
    /// Whether the chain's last entry has completed.
    last_done: bool,
}

fn cqe_error(res: i32) -> io::Error {
    io::Error::from_raw_os_error(-res)
}

impl<S: StepKind> ChainState<S> {
    pub(super) fn new(planned: Vec<Planned<S>>) -> Self {
        let results = vec![None; planned.len()];
        Self {
            planned,
            results,
            last_done: false,
        }
    }

    /// Records the completion of entry `index`.
    pub(super) fn record(&mut self, index: usize, res: i32) {
        if let Some(r) = self.results.get_mut(index) {
            *r = Some(res);
        }
        if index + 1 == self.results.len() {
            self.last_done = true;
        }
    }

    /// The result of entry `index`, if it posted a completion.
    pub(super) fn result(&self, index: usize) -> Option<i32> {
        self.results.get(index).copied().flatten()
    }

    /// The error of entry `index` from its result: a negative result, or a write that wrote
    /// less than asked (the kernel then cancels the rest of the chain too). A cancellation is
    /// never the cause of a failure.
    fn error(&self, index: usize, res: i32) -> Option<io::Error> {
        if res == -libc::ECANCELED {
            return None;
        }
        if res < 0 {
            return Some(cqe_error(res));
        }
        let len = self.planned.get(index)?.write_len?;
        if u32::try_from(res).ok() == Some(len) {
            return None;
        }
        let msg = format!("short write: {res} of {len} bytes");
        Some(io::Error::new(io::ErrorKind::WriteZero, msg))
    }

    /// The failed entries that posted a completion, in chain order.
    fn failures(&self) -> impl Iterator<Item = (usize, io::Error)> + '_ {
        self.results
            .iter()
            .enumerate()
            .filter_map(|(index, res)| Some((index, self.error(index, (*res)?)?)))
    }

    /// The first failed entry. An entry without a completion succeeded (its completion was
    /// skipped) or was cancelled after a failure; it is never the failure itself.
    pub(super) fn first_failure(&self) -> Option<Failure<S>> {
        let (index, error) = self.failures().next()?;
        let step = self.planned.get(index)?.step;
        Some(Failure { index, step, error })
    }

    /// The failure that cancelled the rest of the chain and skipped their completions, if any.
    fn chain_ending_failure(&self) -> Option<usize> {
        self.failures().map(|(index, _)| index).find(|index| {
            self.planned
                .get(*index)
                .is_some_and(Planned::failure_ends_chain)
        })
    }

    /// Whether every completion this chain will post has arrived. Its last entry completes
    /// unless an earlier failure cancelled it with its completion skipped (a failed entry
    /// carrying `SKIP_SUCCESS`: the kernel then skips the cancellations, `REQ_F_SKIP_LINK_CQES`).
    pub(super) fn finished(&self) -> bool {
        if self.last_done {
            let last = self.results.last().copied().flatten();
            // A cancelled last entry means an earlier failure; wait to have seen it.
            return last != Some(-libc::ECANCELED) || self.first_failure().is_some();
        }
        self.chain_ending_failure().is_some()
    }

    /// Whether entry `index` ran and succeeded, in a finished chain. An entry without a
    /// completion succeeded (skipped) unless a chain-ending failure came before it.
    pub(super) fn succeeded(&self, index: usize) -> bool {
        match self.results.get(index) {
            Some(Some(res)) => *res >= 0 && self.error(index, *res).is_none(),
            Some(None) => self.chain_ending_failure().is_none_or(|end| index < end),
            None => false,
        }
    }

    /// Whether the (finished) chain left a file installed in its slot: its last successful
    /// open has no successful close after it.
    pub(super) fn slot_left_open(&self) -> bool {
        let mut open = false;
        for (index, planned) in self.planned.iter().enumerate() {
            if !self.succeeded(index) {
                continue;
            }
            if planned.step.opens_slot() {
                open = true;
            } else if planned.step.closes_slot() {
                open = false;
            }
        }
        open
    }
}

impl ChainState<DurableStep> {
    /// The outcome of a finished durable chain for the file at `path` (before any shared
    /// directory fsync). Removing a file that is already gone is success once the directory is
    /// synced: the unlink is hard-linked to the fsync, which still ran.
    pub(super) fn outcome(&self, path: &Path) -> Result<(), EngineError> {
        let failure = match self.first_failure() {
            None => return Ok(()),
            Some(f) => f,
        };
        let step_error = |step, source| EngineError::Step {
            step,
            path: path.to_owned(),
            source,
        };
        if failure.step == DurableStep::Unlink && failure.error.raw_os_error() == Some(libc::ENOENT)
        {
            return match self.result(failure.index + 1) {
                Some(r) if r < 0 => Err(step_error(DurableStep::FsyncDir, cqe_error(r))),
                _ => Ok(()),
            };
        }
        Err(step_error(failure.step, failure.error))
    }
}

impl ChainState<DurableStep> {
    /// Whether a finished replace chain installed its temp file: otherwise the temp file may
    /// still be there (even a failed open may have created it).
    pub(super) fn renamed(&self) -> bool {
        self.planned
            .iter()
            .position(|p| p.step == DurableStep::Rename)
            .is_some_and(|index| self.succeeded(index))
    }
}

impl ChainState<CfgStep> {
    /// The outcome of a finished configfs chain of the plan `ops`.
    pub(super) fn outcome(&self, ops: &[Op]) -> Result<(), ApplyError> {
        match self.first_failure() {
            None => Ok(()),
            Some(f) => Err(ApplyError {
                index: f.step.op,
                // Steps index the plan they were built from.
                op: ops[f.step.op].clone(),
                source: f.error,
            }),
        }
    }
}

/// Which chain of a durable request is in the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// A replace's temp file being written, made durable and closed.
    Prepare,
    /// The rename (or a removal's unlink), and the directory fsync unless grouped.
    Install,
}

/// A durable request whose chain is in the ring.
pub(super) struct DurableFlight {
    pub job: DurableJob,
    pub stage: Stage,
    pub chain: ChainState<DurableStep>,
    /// The replace's descriptor slot (a removal opens nothing).
    pub slot: Option<Slot>,
    /// The group-commit group whose directory fsync this request waits for.
    pub group: Option<FlightId>,
}

/// A segment of a configfs plan in the ring.
pub(super) struct ConfigfsFlight {
    pub job: ConfigfsJob,
    pub chain: ChainState<CfgStep>,
    pub slot: Slot,
}

/// The temp file of a failed replace, to remove. Holds the name the unlink entry points into,
/// and the directory it names.
pub(super) struct TempFile {
    pub dir: Arc<DurableDir>,
    pub name: CString,
}

/// What a finished chain leaves to tidy: its slot (closing first a file it left there), and a
/// temp file it left behind.
pub(super) struct Cleanup {
    pub slot: Option<Slot>,
    pub close_slot: bool,
    pub temp: Option<TempFile>,
    /// Completions still to come. Every entry of a cleanup posts one (none skips it).
    pub remaining: usize,
}

impl Cleanup {
    /// Returning `slot`, closing the file a chain left in it first if `close_slot`.
    pub(super) fn of_slot(slot: Slot, close_slot: bool) -> Self {
        Self {
            slot: Some(slot),
            close_slot,
            temp: None,
            remaining: 0,
        }
    }

    /// Whether there is anything to do in the ring (otherwise the slot just goes back).
    pub(super) fn needs_ring(&self) -> bool {
        self.close_slot || self.temp.is_some()
    }
}

/// A copy of `e` for each of several callers (io::Error is not Clone).
pub(super) fn clone_error(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(errno) => io::Error::from_raw_os_error(errno),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

/// The result of a completion as an `io::Result`.
pub(super) fn cqe_result(res: i32) -> io::Result<()> {
    if res < 0 { Err(cqe_error(res)) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use std::ffi::CString as CStr;

    use std::path::PathBuf;

    use super::*;
    use crate::engine::FaultInjection;
    use crate::engine::uring::chain::{self, ChainOptions};
    use crate::engine::uring::job::ReplaceData;

    const DIRFD: i32 = 7;

    fn options(skip_success: bool) -> ChainOptions {
        ChainOptions {
            skip_success,
            fault: FaultInjection::default(),
        }
    }

    fn data() -> ReplaceData {
        ReplaceData {
            tmp: CStr::new(".a.json.1-0.tmp").unwrap(),
            name: CStr::new("a.json").unwrap(),
            data: b"0123456789".to_vec(),
            len: 10,
        }
    }

    /// The bookkeeping of a replace's first chain, as the engine builds it.
    fn prepare(skip_success: bool) -> ChainState<DurableStep> {
        let slot = SlotPool::new(1).take().unwrap();
        let chain = chain::prepare(
            Ids::new().next(),
            &data(),
            DIRFD,
            &slot,
            options(skip_success),
        );
        chain.into_parts().1
    }

    /// The bookkeeping of a replace's second chain.
    fn install(skip_success: bool) -> ChainState<DurableStep> {
        let chain = chain::install(
            Ids::new().next(),
            &data(),
            DIRFD,
            false,
            options(skip_success),
        );
        chain.into_parts().1
    }

    fn removal(skip_success: bool) -> ChainState<DurableStep> {
        let name = CStr::new("a.json").unwrap();
        let chain = chain::remove(
            Ids::new().next(),
            &name,
            DIRFD,
            false,
            options(skip_success),
        );
        chain.into_parts().1
    }

    fn record_all<S: StepKind>(chain: &mut ChainState<S>, results: &[(usize, i32)]) {
        for (index, res) in results {
            chain.record(*index, *res);
        }
    }

    fn failed_step<S: StepKind>(chain: &ChainState<S>) -> Option<S> {
        chain.first_failure().map(|f| f.step)
    }

    fn path() -> PathBuf {
        PathBuf::from("/state/a.json")
    }

    fn step_of(result: Result<(), EngineError>) -> Option<DurableStep> {
        match result {
            Ok(()) => None,
            Err(EngineError::Step { step, .. }) => Some(step),
            Err(other) => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn user_data_encodes_id_and_index() {
        let mut ids = Ids::new();
        let id = ids.next();
        for index in [0u16, 1, 5, u16::MAX - 1] {
            assert_eq!(
                decode(user_data(id, index)),
                Tag::Entry {
                    id,
                    index: usize::from(index)
                }
            );
        }
        assert_eq!(decode(WAKE), Tag::Wake);
        assert_ne!(ids.next(), id);
    }

    #[test]
    fn ids_wrap_before_they_could_collide_with_the_wake_read() {
        let mut ids = Ids { next: ID_LIMIT - 2 };
        assert_eq!(ids.next(), FlightId(ID_LIMIT - 2));
        assert_eq!(ids.next(), FlightId(1));
        let largest = FlightId(ID_LIMIT - 2);
        assert_ne!(user_data(largest, u16::MAX), WAKE);
    }

    #[test]
    fn slots_are_handed_out_once_until_put_back() {
        let mut pool = SlotPool::new(4);
        let taken: Vec<Slot> = std::iter::from_fn(|| pool.take()).collect();
        let mut indices: Vec<u32> = taken.iter().map(Slot::index).collect();
        indices.sort_unstable();
        assert_eq!(indices, [0, 1, 2, 3]);
        assert!(pool.take().is_none());
        for slot in taken {
            pool.put(slot);
        }
        assert_eq!(pool.free(), 4);
    }

    #[test]
    fn a_good_prepare_posts_only_its_fsync_and_close_when_skipping() {
        let mut chain = prepare(true);
        chain.record(2, 0);
        assert!(!chain.finished());
        chain.record(3, 0);
        assert!(chain.finished());
        assert!(chain.first_failure().is_none());
        assert!(!chain.slot_left_open());
        assert!(chain.outcome(&path()).is_ok());
    }

    #[test]
    fn without_skipping_a_chain_finishes_with_its_last_completion() {
        let mut chain = prepare(false);
        record_all(&mut chain, &[(0, 0), (1, 10), (2, 0)]);
        assert!(!chain.finished());
        chain.record(3, 0);
        assert!(chain.finished());
        assert!(chain.outcome(&path()).is_ok());
    }

    #[test]
    fn a_cancelling_failure_ends_a_skipping_chain_at_once() {
        let mut chain = prepare(true);
        // The kernel skips the completions of the successes and of the cancelled rest.
        chain.record(1, -libc::ENOSPC);
        assert!(chain.finished());
        assert_eq!(failed_step(&chain), Some(DurableStep::Write));
        assert!(
            chain.slot_left_open(),
            "opened, and the close was cancelled"
        );
        assert_eq!(step_of(chain.outcome(&path())), Some(DurableStep::Write));
    }

    #[test]
    fn a_failed_fsync_cancels_nothing_so_the_chain_waits_for_the_close() {
        let mut chain = prepare(true);
        chain.record(2, -libc::EIO);
        assert!(!chain.finished(), "the close still runs and completes");
        chain.record(3, 0);
        assert!(chain.finished());
        assert_eq!(step_of(chain.outcome(&path())), Some(DurableStep::Fsync));
        assert!(!chain.slot_left_open(), "the close ran");
    }

    #[test]
    fn a_failure_in_the_middle_waits_for_the_cancellations_without_skipping() {
        let mut chain = prepare(false);
        record_all(&mut chain, &[(0, 0), (1, -libc::ENOSPC)]);
        assert!(!chain.finished());
        record_all(&mut chain, &[(2, -libc::ECANCELED), (3, -libc::ECANCELED)]);
        assert!(chain.finished());
        assert_eq!(failed_step(&chain), Some(DurableStep::Write));
        assert!(chain.slot_left_open());
    }

    #[test]
    fn a_cancelled_last_entry_waits_for_the_failure_that_caused_it() {
        let mut chain = prepare(false);
        chain.record(3, -libc::ECANCELED);
        assert!(!chain.finished(), "the failure has not been seen yet");
        chain.record(1, -libc::ENOSPC);
        assert!(chain.finished());
        assert_eq!(failed_step(&chain), Some(DurableStep::Write));
    }

    #[test]
    fn a_short_write_is_a_failure() {
        let mut chain = prepare(true);
        chain.record(1, 5);
        assert!(chain.finished(), "the kernel cancels the rest of the chain");
        let failure = chain.first_failure().unwrap();
        assert_eq!(failure.step, DurableStep::Write);
        assert_eq!(failure.error.kind(), io::ErrorKind::WriteZero);
        assert!(chain.slot_left_open());
    }

    #[test]
    fn the_slot_is_left_open_only_between_a_good_open_and_a_missing_close() {
        // Completions of a skipping prepare chain that fails at each step in turn.
        type Case<'a> = (&'a [(usize, i32)], DurableStep, bool);
        let cases: [Case; 4] = [
            (&[(0, -libc::EACCES)], DurableStep::Open, false),
            (&[(1, -libc::ENOSPC)], DurableStep::Write, true),
            (&[(2, -libc::EIO), (3, 0)], DurableStep::Fsync, false),
            (&[(2, 0), (3, -libc::EBADF)], DurableStep::Close, true),
        ];
        for (results, step, left_open) in cases {
            let mut chain = prepare(true);
            record_all(&mut chain, results);
            assert!(chain.finished(), "{step}");
            assert_eq!(failed_step(&chain), Some(step));
            assert_eq!(chain.slot_left_open(), left_open, "failure at {step}");
        }
    }

    #[test]
    fn a_failed_rename_shows_though_the_directory_fsync_runs() {
        for skip_success in [false, true] {
            let mut chain = install(skip_success);
            chain.record(0, -libc::EISDIR);
            assert!(!chain.finished(), "the directory fsync still runs");
            chain.record(1, 0);
            assert!(chain.finished());
            assert_eq!(step_of(chain.outcome(&path())), Some(DurableStep::Rename));
            assert!(!chain.renamed(), "the temp file is still there");

            let mut chain = install(skip_success);
            record_all(&mut chain, &[(0, 0), (1, -libc::EIO)]);
            assert!(chain.finished());
            assert_eq!(step_of(chain.outcome(&path())), Some(DurableStep::FsyncDir));
            assert!(chain.renamed());
        }
    }

    #[test]
    fn a_hard_linked_failure_lets_the_rest_run() {
        for skip_success in [false, true] {
            let mut chain = removal(skip_success);
            chain.record(0, -libc::ENOENT);
            assert!(!chain.finished(), "the fsync still runs");
            chain.record(1, 0);
            assert!(chain.finished());
            assert_eq!(
                step_of(chain.outcome(&path())),
                None,
                "already gone is fine"
            );

            let mut chain = removal(skip_success);
            record_all(&mut chain, &[(0, -libc::ENOENT), (1, -libc::EIO)]);
            assert_eq!(step_of(chain.outcome(&path())), Some(DurableStep::FsyncDir));

            let mut chain = removal(skip_success);
            record_all(&mut chain, &[(0, -libc::EISDIR), (1, 0)]);
            assert_eq!(step_of(chain.outcome(&path())), Some(DurableStep::Unlink));
        }
    }

    #[test]
    fn a_configfs_failure_names_the_operation_of_the_plan() {
        let ops = vec![
            Op::Write {
                path: "a/attr".into(),
                value: "1".into(),
            },
            Op::Mkdir { path: "b".into() },
        ];
        let part = |part| CfgStep { op: 0, part };
        let linked = Flags::IO_LINK | Flags::SKIP_SUCCESS;
        let planned = [
            (part(CfgPart::Open), linked),
            (part(CfgPart::Write), linked),
            (part(CfgPart::Close), Flags::IO_LINK),
            (
                CfgStep {
                    op: 1,
                    part: CfgPart::Single,
                },
                Flags::empty(),
            ),
        ]
        .map(|(step, flags)| Planned {
            step,
            write_len: (step.part == CfgPart::Write).then_some(1),
            flags,
        });
        let mut chain = ChainState::new(planned.to_vec());
        chain.record(0, -libc::ENOENT);
        assert!(chain.finished());
        assert!(
            !chain.slot_left_open(),
            "the open failed: nothing installed"
        );
        let err = chain.outcome(&ops).unwrap_err();
        assert_eq!(err.index, 0);
        assert_eq!(err.op, ops[0]);
        assert_eq!(err.source.raw_os_error(), Some(libc::ENOENT));

        let mut chain = ChainState::new(planned.to_vec());
        record_all(&mut chain, &[(3, -libc::EEXIST)]);
        assert!(chain.finished());
        assert_eq!(chain.outcome(&ops).unwrap_err().index, 1);
    }
}
