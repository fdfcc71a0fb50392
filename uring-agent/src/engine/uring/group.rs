//! Group commit: durable requests for one directory started in the same round share one
//! directory fsync. Each member's reply is held until that fsync completes, and carries its
//! error.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use super::flight::clone_error;
use super::job::Reply;
use crate::engine::{DurableDir, DurableStep, EngineError};

/// Durable requests for one directory started in the same round, sharing one directory fsync.
pub(super) struct Group {
    dir: Arc<DurableDir>,
    /// Members whose chains are still in the ring.
    running: usize,
    /// Members whose chains finished: their reply, path, and result so far. Held until the
    /// shared fsync completes.
    finished: Vec<(Reply, PathBuf, Result<(), EngineError>)>,
}

impl Group {
    pub(super) fn new(dir: Arc<DurableDir>) -> Self {
        Self {
            dir,
            running: 0,
            finished: Vec::new(),
        }
    }

    pub(super) fn dir(&self) -> &Arc<DurableDir> {
        &self.dir
    }

    /// A member's chain is in the ring.
    pub(super) fn add_member(&mut self) {
        self.running += 1;
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

    #[test]
    fn group_replies_wait_for_the_shared_fsync() {
        let mut group = group();
        group.add_member();
        group.add_member();
        let (first, mut first_rx) = oneshot::channel();
        let (second, mut second_rx) = oneshot::channel();
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
        let (good, _good_rx) = oneshot::channel();
        let (bad, _bad_rx) = oneshot::channel();
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
