//! The ring thread: takes requests, starts their chains, submits and waits in one place, and
//! hands each completion to the bookkeeping of the chain it belongs to.
//!
//! Every request is answered exactly once: with its result, with the error of a push the kernel
//! refused, or with [`EngineError::Unavailable`] if the ring itself fails. A request that cannot
//! start yet (no free descriptor slot, or a full queue the kernel asks to drain first) waits for
//! the next round; nothing is dropped.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};

use io_uring::squeue::Entry;

use super::Sleep;
use super::chain::{self, ChainOptions};
use super::flight::{
    Cleanup, ConfigfsFlight, DurableFlight, FlightId, Ids, Slot, SlotPool, Stage, Tag, TempFile,
    cqe_result, decode,
};
use super::group::Group;
use super::job::{ConfigfsJob, DurableJob, DurableKind, Job, Reply, answer};
use super::queue::{PushError, Queue};
use crate::engine::{DurableStep, EngineError, EngineStats};

/// What became of a request the thread tried to start.
enum Start<J> {
    Started,
    /// Not now (no free slot, or the queue is busy): it keeps waiting.
    Later(J),
    /// The kernel refused it; its caller has the error.
    Answered,
}

/// Pushes `entries`, which point into heap buffers `owner` owns, and on success keeps `owner`
/// in `table` under `id`. On failure the kernel never saw the entries, and `owner` comes back.
fn push_owned<T>(
    queue: &mut Queue,
    table: &mut HashMap<FlightId, T>,
    id: FlightId,
    owner: T,
    entries: &[Entry],
) -> Result<(), (PushError, T)> {
    // SAFETY: `entries` point only into heap buffers owned by `owner` (C strings, data
    // vectors), which moving `owner` into `table` does not move. The ring thread takes `owner`
    // out of `table` only once its chain is finished (every completion it will post was reaped:
    // `ChainState::finished`, `Cleanup::remaining`), and on a ring failure leaks those buffers
    // instead of freeing them (`RingThread::fail_everything`). Directory descriptors the entries
    // name stay open as long: `owner` holds their `Arc<DurableDir>`.
    match unsafe { queue.push(entries) } {
        Ok(()) => {
            table.insert(id, owner);
            Ok(())
        }
        Err(e) => Err((e, owner)),
    }
}

/// The state of the ring thread. See the module documentation.
pub(super) struct RingThread {
    queue: Queue,
    rx: Receiver<Job>,
    sleep: Arc<Sleep>,
    disconnected: bool,
    ids: Ids,
    slots: SlotPool,
    options: ChainOptions,
    stats: Arc<EngineStats>,
    waiting: VecDeque<Job>,
    durable: HashMap<FlightId, DurableFlight>,
    configfs: HashMap<FlightId, ConfigfsFlight>,
    groups: HashMap<FlightId, Group>,
    cleanups: HashMap<FlightId, Cleanup>,
    /// Groups whose directory fsync waits for room in the queue.
    due_fsyncs: Vec<FlightId>,
    /// Cleanups waiting for room in the queue.
    due_cleanups: Vec<Cleanup>,
    /// Replaces whose prepared temp file waits for room in the queue to be installed.
    due_installs: Vec<DurableFlight>,
    /// The kernel refused entries this round (busy): push nothing more until completions were
    /// reaped.
    busy: bool,
}

impl RingThread {
    pub(super) fn new(
        queue: Queue,
        rx: Receiver<Job>,
        sleep: Arc<Sleep>,
        slots: SlotPool,
        options: ChainOptions,
        stats: Arc<EngineStats>,
    ) -> Self {
        Self {
            queue,
            rx,
            sleep,
            disconnected: false,
            ids: Ids::new(),
            slots,
            options,
            stats,
            waiting: VecDeque::new(),
            durable: HashMap::new(),
            configfs: HashMap::new(),
            groups: HashMap::new(),
            cleanups: HashMap::new(),
            due_fsyncs: Vec::new(),
            due_cleanups: Vec::new(),
            due_installs: Vec::new(),
            busy: false,
        }
    }

    /// Runs until the engine handle is gone and every request was answered.
    pub(super) fn run(mut self) {
        loop {
            self.busy = false;
            let _ = self.take_new_jobs();
            self.push_due();
            self.start_waiting_jobs();
            if self.disconnected && self.idle() {
                if let Err(e) = self.queue.disarm_wake() {
                    tracing::warn!(error = %e, "io_uring_enter failed while shutting down");
                }
                return;
            }
            if !self.disconnected {
                self.queue.arm_wake();
            }
            // Block for a completion, unless something waits to be retried and no completion
            // is coming to wake us.
            let want = usize::from(self.in_flight() || !self.retry_pending());
            if want > 0 && !self.disconnected {
                // Requests sent from now on write the eventfd; one sent before is found here.
                self.sleep.about_to_block();
                if self.take_new_jobs() {
                    self.sleep.awake();
                    continue;
                }
            }
            let result = self.queue.submit_and_wait(want);
            self.sleep.awake();
            if let Err(e) = result {
                tracing::error!(error = %e, "io_uring_enter failed; failing every request in flight");
                self.fail_everything(&e);
                return;
            }
            self.reap();
        }
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty()
            && self.durable.is_empty()
            && self.configfs.is_empty()
            && self.groups.is_empty()
            && self.cleanups.is_empty()
            && self.due_cleanups.is_empty()
            && self.due_installs.is_empty()
    }

    /// Whether some completion is still to come.
    fn in_flight(&self) -> bool {
        !self.durable.is_empty()
            || !self.configfs.is_empty()
            || !self.cleanups.is_empty()
            || self.groups.len() > self.due_fsyncs.len()
    }

    fn retry_pending(&self) -> bool {
        self.busy
            || !self.due_fsyncs.is_empty()
            || !self.due_cleanups.is_empty()
            || !self.due_installs.is_empty()
    }

    /// Moves every request sent so far to `waiting`; whether there was any (or the channel
    /// closed, which also needs a round).
    fn take_new_jobs(&mut self) -> bool {
        let mut any = false;
        loop {
            match self.rx.try_recv() {
                Ok(job) => {
                    self.waiting.push_back(job);
                    any = true;
                }
                Err(TryRecvError::Empty) => return any,
                Err(TryRecvError::Disconnected) => {
                    self.disconnected = true;
                    return true;
                }
            }
        }
    }

    /// Pushes the installs, group fsyncs and cleanups a busy queue held back.
    fn push_due(&mut self) {
        for flight in std::mem::take(&mut self.due_installs) {
            self.push_install(flight);
        }
        for gid in std::mem::take(&mut self.due_fsyncs) {
            self.push_group_fsync(gid);
        }
        for cleanup in std::mem::take(&mut self.due_cleanups) {
            self.push_cleanup(cleanup);
        }
    }

    /// Starts every waiting request that can start. Durable requests started in this round for
    /// the same directory form one group-commit group.
    fn start_waiting_jobs(&mut self) {
        let mut by_dir: HashMap<RawFd, Vec<DurableJob>> = HashMap::new();
        let mut later = VecDeque::new();
        while let Some(job) = self.waiting.pop_front() {
            match job {
                Job::Durable(job) => by_dir.entry(job.dir.raw_fd()).or_default().push(job),
                Job::Configfs(job) => {
                    if let Start::Later(job) = self.start_configfs(job) {
                        later.push_back(Job::Configfs(job));
                    }
                }
            }
        }
        for jobs in by_dir.into_values() {
            self.start_durable_round(jobs, &mut later);
        }
        later.append(&mut self.waiting);
        self.waiting = later;
    }

    /// Starts one directory's requests of this round: they join the directory's group still
    /// taking members, or form a new group when there are several, or run alone (the directory
    /// fsync in their own chain).
    fn start_durable_round(&mut self, jobs: Vec<DurableJob>, later: &mut VecDeque<Job>) {
        let Some(first) = jobs.first() else {
            return;
        };
        let dirfd = first.dir.raw_fd();
        // At most one group of a directory accepts: a new one forms only when none does. It is
        // taken out of `groups` for the round (no completion is reaped meanwhile).
        let open = self
            .groups
            .iter()
            .find(|(_, g)| g.dir().raw_fd() == dirfd && g.accepts())
            .map(|(gid, _)| *gid);
        let mut group = match open {
            Some(gid) => self.groups.remove(&gid).map(|g| (gid, g)),
            None if jobs.len() > 1 => Some((self.ids.next(), Group::new(Arc::clone(&first.dir)))),
            None => None,
        };
        for job in jobs {
            let gid = group
                .as_ref()
                .filter(|(_, g)| g.has_room())
                .map(|(gid, _)| *gid);
            match self.start_durable(job, gid) {
                Start::Started => {
                    if let (Some(_), Some((_, g))) = (gid, &mut group) {
                        g.add_member();
                    }
                }
                Start::Later(job) => later.push_back(Job::Durable(job)),
                Start::Answered => {}
            }
        }
        if let Some((gid, group)) = group
            && group.has_members()
        {
            self.groups.insert(gid, group);
        }
    }

    /// What to do with a request whose push failed: wait for the next round if the queue was
    /// busy, or answer it with the error.
    fn refused<J>(
        &mut self,
        job: J,
        error: PushError,
        reply: impl FnOnce(J, EngineError),
    ) -> Start<J> {
        match error {
            PushError::Busy => {
                self.busy = true;
                Start::Later(job)
            }
            PushError::Failed(source) => {
                reply(job, EngineError::Submit { source });
                Start::Answered
            }
        }
    }

    /// Starts a durable request: a replace's prepare chain (it needs a slot), or a removal.
    fn start_durable(&mut self, job: DurableJob, group: Option<FlightId>) -> Start<DurableJob> {
        if self.busy {
            return Start::Later(job);
        }
        let id = self.ids.next();
        let dirfd = job.dir.raw_fd();
        let (stage, chain, slot) = match &job.kind {
            DurableKind::Replace(data) => {
                let Some(slot) = self.slots.take() else {
                    return Start::Later(job);
                };
                let chain = chain::prepare(id, data, dirfd, &slot, self.options);
                (Stage::Prepare, chain, Some(slot))
            }
            DurableKind::Remove { name } => {
                let chain = chain::remove(id, name, dirfd, group.is_some(), self.options);
                (Stage::Install, chain, None)
            }
        };
        let (entries, chain) = chain.into_parts();
        let flight = DurableFlight {
            job,
            stage,
            chain,
            slot,
            group,
        };
        match push_owned(&mut self.queue, &mut self.durable, id, flight, &entries) {
            Ok(()) => Start::Started,
            Err((error, flight)) => {
                // Never submitted: the slot holds nothing.
                if let Some(slot) = flight.slot {
                    self.slots.put(slot);
                }
                self.refused(flight.job, error, |job, e| answer(job.reply, Err(e)))
            }
        }
    }

    /// Pushes the install chain of a replace whose temp file is prepared.
    fn push_install(&mut self, flight: DurableFlight) {
        if self.busy {
            self.due_installs.push(flight);
            return;
        }
        let DurableKind::Replace(data) = &flight.job.kind else {
            // Only a replace is prepared; a removal starts at its install chain, and is
            // answered as it stands.
            let result = flight.chain.outcome(&flight.job.path);
            self.answer_durable(flight, result);
            return;
        };
        let id = self.ids.next();
        let dirfd = flight.job.dir.raw_fd();
        let grouped = flight.group.is_some();
        let (entries, chain) = chain::install(id, data, dirfd, grouped, self.options).into_parts();
        let flight = DurableFlight {
            stage: Stage::Install,
            chain,
            ..flight
        };
        match push_owned(&mut self.queue, &mut self.durable, id, flight, &entries) {
            Ok(()) => {}
            Err((PushError::Busy, flight)) => {
                self.busy = true;
                self.due_installs.push(flight);
            }
            Err((PushError::Failed(source), flight)) => {
                self.answer_durable(flight, Err(EngineError::Submit { source }));
            }
        }
    }

    fn start_configfs(&mut self, job: ConfigfsJob) -> Start<ConfigfsJob> {
        if self.busy {
            return Start::Later(job);
        }
        match self.slots.take() {
            Some(slot) => self.start_segment(job, slot),
            None => Start::Later(job),
        }
    }

    /// Pushes the plan's segment starting at `job.next`; under a double's rules, once they
    /// admitted its operation (a refusal answers the plan as the kernel's errno would).
    fn start_segment(&mut self, mut job: ConfigfsJob, slot: Slot) -> Start<ConfigfsJob> {
        if let Err(refused) = job.admit_next() {
            self.slots.put(slot);
            answer(job.reply, Err(EngineError::Configfs(refused)));
            return Start::Answered;
        }
        let id = self.ids.next();
        let rootfd = job.root.raw_fd();
        let chain = chain::configfs_segment(
            id,
            &job.prepared,
            (job.next, chain::ops_per_chain(job.one_op_per_chain())),
            rootfd,
            &slot,
            self.options.skip_success,
        );
        let (entries, chain) = chain.into_parts();
        let flight = ConfigfsFlight { job, chain, slot };
        match push_owned(&mut self.queue, &mut self.configfs, id, flight, &entries) {
            Ok(()) => Start::Started,
            Err((error, flight)) => {
                self.slots.put(flight.slot);
                self.refused(flight.job, error, |job, e| answer(job.reply, Err(e)))
            }
        }
    }

    fn reap(&mut self) {
        for (user_data, res) in self.queue.completions() {
            match decode(user_data) {
                // The queue consumes the wake-up read's completion itself.
                Tag::Wake => {}
                Tag::Entry { id, index } => self.complete(id, index, res),
            }
        }
    }

    /// Hands the completion of entry `index` of `id` to whatever `id` names.
    fn complete(&mut self, id: FlightId, index: usize, res: i32) {
        if let Some(flight) = self.durable.get_mut(&id) {
            flight.chain.record(index, res);
            if flight.chain.finished()
                && let Some(flight) = self.durable.remove(&id)
            {
                self.finish_durable(flight);
            }
        } else if let Some(flight) = self.configfs.get_mut(&id) {
            flight.chain.record(index, res);
            if flight.chain.finished()
                && let Some(flight) = self.configfs.remove(&id)
            {
                self.finish_segment(flight);
            }
        } else if let Some(group) = self.groups.remove(&id) {
            EngineStats::add(&self.stats.dir_fsyncs, 1);
            self.answer_group(group, cqe_result(res));
        } else if let Some(cleanup) = self.cleanups.get_mut(&id) {
            cleanup.remaining = cleanup.remaining.saturating_sub(1);
            if cleanup.remaining == 0
                && let Some(cleanup) = self.cleanups.remove(&id)
                && let Some(slot) = cleanup.slot
            {
                self.slots.put(slot);
            }
        } else {
            tracing::warn!(?id, index, res, "io_uring completion of no known request");
        }
    }

    /// A durable request's chain finished: a prepared replace goes on to its install chain,
    /// anything else is answered (through its group, if any).
    fn finish_durable(&mut self, mut flight: DurableFlight) {
        let result = flight.chain.outcome(&flight.job.path);
        let left_open = flight.chain.slot_left_open();
        if flight.stage == Stage::Prepare && result.is_ok() {
            // The temp file is durable and closed: the slot is free for others.
            if let Some(slot) = flight.slot.take() {
                self.tidy(Cleanup::of_slot(slot, left_open));
            }
            self.push_install(flight);
            return;
        }
        let slot = flight.slot.take();
        let renamed = flight.stage == Stage::Install && flight.chain.renamed();
        let temp = match &flight.job.kind {
            DurableKind::Replace(data) if !renamed => Some(TempFile {
                dir: Arc::clone(&flight.job.dir),
                name: data.tmp.clone(),
            }),
            _ => None,
        };
        self.tidy(Cleanup {
            slot,
            close_slot: left_open,
            temp,
            remaining: 0,
        });
        self.answer_durable(flight, result);
    }

    /// Answers a durable request, or hands its result to its group-commit group.
    fn answer_durable(&mut self, flight: DurableFlight, result: Result<(), EngineError>) {
        let DurableJob { path, reply, .. } = flight.job;
        match flight.group {
            None => {
                if result.is_ok() {
                    EngineStats::add(&self.stats.durable_ops, 1);
                    EngineStats::add(&self.stats.dir_fsyncs, 1);
                }
                answer(reply, result);
            }
            Some(gid) => self.member_done(gid, reply, path, result),
        }
    }

    /// A group member's chain finished: its reply joins the group's, and the directory fsync
    /// starts once every member is done.
    fn member_done(
        &mut self,
        gid: FlightId,
        reply: Reply,
        path: PathBuf,
        result: Result<(), EngineError>,
    ) {
        let Some(group) = self.groups.get_mut(&gid) else {
            // A group outlives its members' chains; should it not, the rename is not durable.
            tracing::error!(?gid, "a group-commit member outlived its group");
            let lost = EngineError::Step {
                step: DurableStep::FsyncDir,
                path,
                source: io::Error::other("the shared directory fsync was lost"),
            };
            answer(reply, result.and(Err(lost)));
            return;
        };
        if group.member_finished(reply, path, result) {
            self.push_group_fsync(gid);
        }
    }

    fn push_group_fsync(&mut self, gid: FlightId) {
        let Some(group) = self.groups.get(&gid) else {
            return;
        };
        if self.busy {
            self.due_fsyncs.push(gid);
            return;
        }
        let entry = chain::group_fsync(gid, group.dir().raw_fd(), self.options.fault);
        match self.queue.push_fd_only(entry) {
            Ok(()) => {}
            Err(PushError::Busy) => {
                self.busy = true;
                self.due_fsyncs.push(gid);
            }
            Err(PushError::Failed(e)) => {
                if let Some(group) = self.groups.remove(&gid) {
                    self.answer_group(group, Err(e));
                }
            }
        }
    }

    fn answer_group(&mut self, group: Group, fsync: io::Result<()>) {
        for (reply, result) in group.complete(fsync) {
            if result.is_ok() {
                EngineStats::add(&self.stats.durable_ops, 1);
            }
            answer(reply, result);
        }
    }

    fn finish_segment(&mut self, flight: ConfigfsFlight) {
        let ConfigfsFlight {
            mut job,
            chain,
            slot,
        } = flight;
        // Under rules the segment is one operation, completed once its syscalls succeeded.
        let result = chain.outcome(&job.ops).and_then(|()| job.complete_next());
        let left_open = chain.slot_left_open();
        let end = chain::segment_end(
            &job.prepared,
            job.next,
            chain::ops_per_chain(job.one_op_per_chain()),
        );
        if result.is_ok() && end < job.prepared.len() {
            job.next = end;
            let start = if left_open {
                // A successful segment closed every file it opened; should it not, the next
                // segment waits for a fresh slot.
                self.tidy(Cleanup::of_slot(slot, true));
                Start::Later(job)
            } else {
                self.start_segment(job, slot)
            };
            if let Start::Later(job) = start {
                self.waiting.push_back(Job::Configfs(job));
            }
            return;
        }
        self.tidy(Cleanup::of_slot(slot, left_open));
        if result.is_ok() {
            EngineStats::add(&self.stats.configfs_plans, 1);
        }
        answer(job.reply, result.map_err(EngineError::Configfs));
    }

    /// Returns a finished chain's slot to the pool, after closing a file it left in the slot
    /// and removing a temp file it left behind.
    fn tidy(&mut self, cleanup: Cleanup) {
        if cleanup.needs_ring() {
            self.push_cleanup(cleanup);
        } else if let Some(slot) = cleanup.slot {
            self.slots.put(slot);
        }
    }

    fn push_cleanup(&mut self, mut cleanup: Cleanup) {
        if self.busy {
            self.due_cleanups.push(cleanup);
            return;
        }
        let id = self.ids.next();
        let entries = chain::cleanup(id, &cleanup);
        cleanup.remaining = entries.len();
        match push_owned(&mut self.queue, &mut self.cleanups, id, cleanup, &entries) {
            Ok(()) => {}
            Err((PushError::Busy, cleanup)) => {
                self.busy = true;
                self.due_cleanups.push(cleanup);
            }
            Err((PushError::Failed(e), cleanup)) => {
                // The next openat into the slot replaces, and so closes, a file left in it; a
                // temp file stays behind (hidden, and named for this write only).
                tracing::warn!(error = %e, "could not tidy up after a failed chain");
                if let Some(slot) = cleanup.slot {
                    self.slots.put(slot);
                }
            }
        }
    }

    /// The ring failed: every request still here gets an error. The kernel may still run
    /// entries it took, so the buffers they point into are leaked, not freed.
    fn fail_everything(&mut self, e: &io::Error) {
        let reason = format!("io_uring_enter failed: {e}");
        let error = || EngineError::Unavailable {
            reason: reason.clone(),
        };
        for (_, flight) in self.durable.drain() {
            let DurableJob { reply, kind, .. } = flight.job;
            std::mem::forget(kind);
            answer(reply, Err(error()));
        }
        for flight in self.due_installs.drain(..) {
            answer(flight.job.reply, Err(error()));
        }
        for (_, flight) in self.configfs.drain() {
            let ConfigfsJob {
                reply, prepared, ..
            } = flight.job;
            std::mem::forget(prepared);
            answer(reply, Err(error()));
        }
        for (_, group) in self.groups.drain() {
            for reply in group.into_replies() {
                answer(reply, Err(error()));
            }
        }
        for job in self.waiting.drain(..) {
            job.fail(error());
        }
        for (_, cleanup) in self.cleanups.drain() {
            std::mem::forget(cleanup.temp);
        }
    }
}
