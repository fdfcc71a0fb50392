//! The engine's bound: how many requests it holds at once (sent to the ring thread and not yet
//! answered). A request past the bound is refused at once with [`EngineError::QueueFull`],
//! before anything of it reaches the ring, so the memory the queue and the ring thread's
//! tables hold is bounded, and a caller learns at once that the node is overloaded instead of
//! waiting behind an ever longer queue.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::engine::EngineError;

/// The count of requests held, and its limit.
#[derive(Debug)]
pub(super) struct Admission {
    held: AtomicUsize,
    limit: usize,
}

/// One request's place: given back when dropped (with its reply, once answered or dropped).
#[derive(Debug)]
pub(super) struct Permit(Arc<Admission>);

impl Admission {
    pub(super) fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            held: AtomicUsize::new(0),
            limit,
        })
    }

    /// A place for one more request, or [`EngineError::QueueFull`] when all are taken.
    pub(super) fn admit(self: &Arc<Self>) -> Result<Permit, EngineError> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held < self.limit).then_some(held + 1)
            })
            .map(|_| Permit(Arc::clone(self)))
            .map_err(|_| EngineError::QueueFull { limit: self.limit })
    }

    /// Requests held now.
    #[cfg(any(test, feature = "test-seams"))]
    pub(super) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_taken_up_to_the_limit_and_given_back_on_drop() {
        let admission = Admission::new(2);
        let first = admission.admit().unwrap();
        let _second = admission.admit().unwrap();
        assert!(matches!(
            admission.admit(),
            Err(EngineError::QueueFull { limit: 2 })
        ));
        assert_eq!(admission.held(), 2);
        drop(first);
        assert_eq!(admission.held(), 1);
        let _third = admission.admit().unwrap();
    }
}
