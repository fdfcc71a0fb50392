//! Requests as the ring thread receives them: everything a chain points into (paths as C
//! strings, data buffers), checked and converted before the request reaches the thread, so the
//! thread never meets a request it cannot start.
//!
//! Durable and configfs requests are separate types: a configfs request cannot reach the durable
//! path or the other way round, and each carries its own reply channel.

use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use pillar_nvmet::{Admitted, ApplyError, ConfigfsRules, Op};
use tokio::sync::oneshot;

use super::admission::Permit;
use crate::engine::{DurableDir, DurableStep, EngineError, c_path, temp_name};

/// Where a request's answer goes, with the request's place in the engine's bound
/// ([`Permit`]): the place is given back when the reply is sent (just before the answer
/// leaves) or dropped, whether or not the caller still waits, so the bound counts every request
/// the ring thread holds.
pub(super) struct Reply {
    tx: oneshot::Sender<Result<(), EngineError>>,
    _permit: Permit,
}

impl Reply {
    pub(super) fn new(tx: oneshot::Sender<Result<(), EngineError>>, permit: Permit) -> Self {
        Self {
            tx,
            _permit: permit,
        }
    }

    /// Sends the answer; `Err` with it when the caller went away. The place is given back
    /// first: a caller holding its answer must find its place free, or a request it sends right
    /// after an answer could be refused for a place its own finished request still held.
    pub(super) fn send(
        self,
        result: Result<(), EngineError>,
    ) -> Result<(), Result<(), EngineError>> {
        let Self { tx, _permit: permit } = self;
        drop(permit);
        tx.send(result)
    }
}

/// Answers a request. The caller may have given up waiting; then there is no one to tell.
pub(super) fn answer(reply: Reply, result: Result<(), EngineError>) {
    let _ = reply.send(result);
}

/// One request for the ring thread.
pub(super) enum Job {
    Durable(DurableJob),
    Configfs(ConfigfsJob),
}

impl Job {
    /// Answers the request with `error` without running it.
    pub(super) fn fail(self, error: EngineError) {
        match self {
            Self::Durable(job) => answer(job.reply, Err(error)),
            Self::Configfs(job) => answer(job.reply, Err(error)),
        }
    }
}

/// A durable replace or removal of one file in `dir`.
pub(super) struct DurableJob {
    pub dir: Arc<DurableDir>,
    /// The file's path, for errors.
    pub path: PathBuf,
    pub kind: DurableKind,
    pub reply: Reply,
}

pub(super) enum DurableKind {
    Replace(ReplaceData),
    Remove { name: CString },
}

/// What a replace writes, and where.
pub(super) struct ReplaceData {
    /// This write's own temp file (see [`temp_name`]).
    pub tmp: CString,
    pub name: CString,
    pub data: Vec<u8>,
    /// `data.len()`, which fits the 32-bit length of a write entry.
    pub len: u32,
}

impl DurableKind {
    /// A replace of `name` (at `path`) with `data`; refuses data one write entry cannot carry.
    pub(super) fn replace(name: &str, data: Vec<u8>, path: &Path) -> Result<Self, EngineError> {
        let len = u32::try_from(data.len()).map_err(|_| EngineError::Step {
            step: DurableStep::Write,
            path: path.to_owned(),
            source: io::Error::from_raw_os_error(libc::EFBIG),
        })?;
        Ok(Self::Replace(ReplaceData {
            tmp: c_path(temp_name(name).as_ref())?,
            name: c_path(name.as_ref())?,
            data,
            len,
        }))
    }

    /// A removal of `name`.
    pub(super) fn remove(name: &str) -> Result<Self, EngineError> {
        Ok(Self::Remove {
            name: c_path(name.as_ref())?,
        })
    }
}

/// A configfs plan, run in segments of linked chains; `next` is the first operation not yet run.
pub(super) struct ConfigfsJob {
    pub root: Arc<DurableDir>,
    /// The kernel's rules when the tree is a double (`None` on the kernel): each operation is
    /// then admitted before its own chain and completed after it.
    pub rules: Option<Arc<dyn ConfigfsRules>>,
    /// What the rules admitted of operation `next`, until it is completed.
    pub admitted: Option<Admitted>,
    /// The plan as given, for errors.
    pub ops: Vec<Op>,
    /// The plan as entries need it, one per operation of `ops`.
    pub prepared: Vec<CfgOp>,
    pub next: usize,
    pub reply: Reply,
}

impl ConfigfsJob {
    /// Whether each operation needs a chain of its own: under a double's rules, which must see
    /// each operation's result before they admit the next.
    pub(super) fn one_op_per_chain(&self) -> bool {
        self.rules.is_some()
    }

    fn failed(&self, source: io::Error) -> ApplyError {
        ApplyError {
            index: self.next,
            // `next` indexes the plan while the job runs.
            op: self.ops[self.next].clone(),
            source,
        }
    }

    /// Admits operation `next` under the rules (once: a segment waiting for room in the queue
    /// is not admitted again). A refusal fails the plan at that operation, as the kernel's
    /// errno on its syscall would.
    pub(super) fn admit_next(&mut self) -> Result<(), ApplyError> {
        let Some(rules) = &self.rules else {
            return Ok(());
        };
        if self.admitted.is_none() {
            let admitted = rules.admit(&self.ops[self.next]);
            self.admitted = Some(admitted.map_err(|e| self.failed(e))?);
        }
        Ok(())
    }

    /// Completes operation `next` under the rules, once its chain succeeded.
    pub(super) fn complete_next(&mut self) -> Result<(), ApplyError> {
        let (Some(rules), Some(admitted)) = (&self.rules, self.admitted.take()) else {
            return Ok(());
        };
        let done = rules.complete(&self.ops[self.next], admitted);
        done.map_err(|e| self.failed(e))
    }
}

/// One configfs operation with its paths as C strings (relative to the configfs root, except
/// symlink targets: absolute, as the kernel resolves configfs link targets itself).
#[derive(Debug)]
pub(super) enum CfgOp {
    Mkdir {
        path: CString,
    },
    Write {
        path: CString,
        value: Vec<u8>,
        len: u32,
    },
    Symlink {
        link: CString,
        target: CString,
    },
    Unlink {
        path: CString,
    },
    Rmdir {
        path: CString,
    },
}

impl CfgOp {
    /// Converts `op` (the `index`th of its plan) for the tree at `root`.
    pub(super) fn prepare(index: usize, op: &Op, root: &Path) -> Result<Self, EngineError> {
        let path = c_path(op.path())?;
        Ok(match op {
            Op::Mkdir { .. } => Self::Mkdir { path },
            Op::Write { value, .. } => {
                let len = u32::try_from(value.len()).map_err(|_| ApplyError {
                    index,
                    op: op.clone(),
                    source: io::Error::from_raw_os_error(libc::EFBIG),
                })?;
                Self::Write {
                    path,
                    value: value.as_bytes().to_vec(),
                    len,
                }
            }
            Op::Symlink { target, .. } => Self::Symlink {
                link: path,
                target: c_path(&root.join(target))?,
            },
            Op::Unlink { .. } => Self::Unlink { path },
            Op::Rmdir { .. } => Self::Rmdir { path },
        })
    }
}

/// Converts a plan for the configfs tree at `root`.
pub(super) fn prepare_plan(ops: &[Op], root: &Path) -> Result<Vec<CfgOp>, EngineError> {
    ops.iter()
        .enumerate()
        .map(|(i, op)| CfgOp::prepare(i, op, root))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll, Wake, Waker};

    use super::super::admission::Admission;
    use super::*;

    /// Notes how many places are held at the moment the answer wakes the caller.
    struct HeldAtWake {
        admission: Arc<Admission>,
        seen: Mutex<Option<usize>>,
    }

    impl Wake for HeldAtWake {
        fn wake(self: Arc<Self>) {
            *self.seen.lock().unwrap() = Some(self.admission.held());
        }
    }

    #[test]
    fn the_place_is_free_when_the_caller_is_woken_with_its_answer() {
        let admission = Admission::new(1);
        let (tx, mut rx) = oneshot::channel();
        let reply = Reply::new(tx, admission.admit().unwrap());
        let waker = Arc::new(HeldAtWake {
            admission: Arc::clone(&admission),
            seen: Mutex::new(None),
        });
        let wake = Waker::from(Arc::clone(&waker));
        let mut cx = Context::from_waker(&wake);
        assert!(Pin::new(&mut rx).poll(&mut cx).is_pending());
        assert!(reply.send(Ok(())).is_ok());
        assert_eq!(*waker.seen.lock().unwrap(), Some(0), "woken while its place was held");
        assert!(matches!(Pin::new(&mut rx).poll(&mut cx), Poll::Ready(Ok(Ok(())))));
        // The next request gets the place at once.
        assert!(admission.admit().is_ok());
    }
}
