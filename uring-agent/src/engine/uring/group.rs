//! Group commit: durable requests for one directory share one directory fsync. A group forms
//! from the requests started in one round, and takes requests of later rounds for as long as
//! one of its members is still in the ring (at most [`MAX_MEMBERS`]): its fsync starts only once
//! every member's rename has completed, so a late member's rename is covered too. Each member's
//! reply is held until that fsync completes, and carries its error.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use super::flight::clone_error;
use super::job::Reply;
use crate::engine::{DurableDir, DurableStep, EngineError};

/// How many requests one group takes, so that a steady stream of arrivals cannot keep its
/// fsync from ever starting.
pub(super) const MAX_MEMBERS: usize = 256;

/// Durable requests for one directory, sharing one directory fsync.
pub(super) struct Group {
    dir: Arc<DurableDir>,
    /// Members whose chains are still in the ring.
    running: usize,
    /// Members ever added.
    members: usize,
    /// Members whose chains finished: their reply, path, and result so far. Held until the
    /// shared fsync completes.
    finished: Vec<(Reply, PathBuf, Result<(), EngineError>)>,
}

impl Group {
    pub(super) fn new(dir: Arc<DurableDir>) -> Self {
        Self {
            dir,
            running: 0,
            members: 0,
            finished: Vec::new(),
        }
    }

    pub(super) fn dir(&self) -> &Arc<DurableDir> {
        &self.dir
    }

    /// A member's chain is in the ring.
    pub(super) fn add_member(&mut self) {
        self.running += 1;
        self.members += 1;
    }

    /// Whether a request started now may join: the fsync has not started (a member is still
    /// in the ring, so the fsync waits for the new one's rename too) and there is room.
    pub(super) fn accepts(&self) -> bool {
        self.running > 0 && self.has_room()
    }

    /// Whether the group has room for another member.
    pub(super) fn has_room(&self) -> bool {
        self.members < MAX_MEMBERS
    }

    pub(super) fn has_members(&self) -> bool {
        self.running + self.finished.len() > 0
    }

    /// A member's chain finished with `result`; its reply waits for the directory fsync.
    /// Whether every member is done, so the directory fsync may start.
    pub(super) fn member_finished(
        &mut self,
        reply: Reply,
        path: PathBuf,
        result: Result<(), EngineError>,
    ) -> bool {
        self.running = self.running.saturating_sub(1);
        self.finished.push((reply, path, result));
        self.running == 0
    }

    /// Every member's answer once the directory fsync completed with `fsync`: its own result,
    /// or the fsync's error.
    pub(super) fn complete(self, fsync: io::Result<()>) -> Vec<(Reply, Result<(), EngineError>)> {
        self.finished
            .into_iter()
            .map(|(reply, path, result)| {
                let result = result.and_then(|()| match &fsync {
                    Ok(()) => Ok(()),
                    Err(e) => Err(EngineError::Step {
                        step: DurableStep::FsyncDir,
                        path,
                        source: clone_error(e),
                    }),
                });
                (reply, result)
            })
            .collect()
    }
}

impl Group {
    /// The replies held so far (the ring failed: they get its error).
    pub(super) fn into_replies(self) -> impl Iterator<Item = Reply> {
        self.finished.into_iter().map(|(reply, _, _)| reply)
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::oneshot;

    use super::*;

    /// A reply and its receiver, outside any engine's bound.
    fn reply() -> (Reply, oneshot::Receiver<Result<(), EngineError>>) {
        let (tx, rx) = oneshot::channel();
        let permit = super::super::admission::Admission::new(1).admit().unwrap();
        (Reply::new(tx, permit), rx)
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

    fn group() -> Group {
        let tmp = tempfile::tempdir().unwrap();
        Group::new(DurableDir::open(tmp.path()).unwrap())
    }

    // A late request may join only while a member is still in the ring: once the last one
    // finished, the fsync is due (or running) and a rename joining now would not be covered.
    #[test]
    fn a_group_takes_late_members_only_before_its_fsync_and_up_to_its_size() {
        let mut group = group();
        assert!(!group.accepts(), "an empty group has no fsync to share");
        group.add_member();
        assert!(group.accepts());
        group.add_member();
        let (first, _first_rx) = reply();
        assert!(!group.member_finished(first, path(), Ok(())));
        assert!(group.accepts(), "one member still in the ring");
        let (second, _second_rx) = reply();
        assert!(group.member_finished(second, path(), Ok(())));
        assert!(!group.accepts(), "every member finished: the fsync is due");

        let mut full = super::super::group::Group::new(Arc::clone(group.dir()));
        for _ in 0..MAX_MEMBERS {
            assert!(full.running == 0 || full.accepts());
            full.add_member();
        }
        assert!(!full.accepts(), "a full group takes no more");
    }

    #[test]
    fn group_replies_wait_for_the_shared_fsync() {
        let mut group = group();
        group.add_member();
        group.add_member();
        let (first, mut first_rx) = reply();
        let (second, mut second_rx) = reply();
        assert!(!group.member_finished(first, path(), Ok(())));
        assert!(
            group.member_finished(second, path(), Ok(())),
            "all done: fsync"
        );
        assert!(
            first_rx.try_recv().is_err(),
            "held until the fsync completes"
        );
        for (reply, result) in group.complete(Ok(())) {
            reply.send(result).unwrap();
        }
        assert!(first_rx.try_recv().unwrap().is_ok());
        assert!(second_rx.try_recv().unwrap().is_ok());
    }

    #[test]
    fn a_failed_shared_fsync_fails_every_member_and_own_errors_stay() {
        let mut group = group();
        group.add_member();
        group.add_member();
        let (good, _good_rx) = reply();
        let (bad, _bad_rx) = reply();
        let own = EngineError::Step {
            step: DurableStep::Rename,
            path: path(),
            source: io::Error::from_raw_os_error(libc::EISDIR),
        };
        group.member_finished(good, path(), Ok(()));
        group.member_finished(bad, path(), Err(own));
        let steps: Vec<Option<DurableStep>> = group
            .complete(Err(io::Error::from_raw_os_error(libc::EIO)))
            .into_iter()
            .map(|(_, result)| step_of(result))
            .collect();
        assert_eq!(
            steps,
            [Some(DurableStep::FsyncDir), Some(DurableStep::Rename)]
        );
    }

    #[test]
    fn an_empty_group_has_no_members() {
        let mut group = group();
        assert!(!group.has_members());
        group.add_member();
        assert!(group.has_members());
    }
}
