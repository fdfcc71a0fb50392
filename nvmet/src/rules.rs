//! The kernel's rules around plain syscalls: what lets a plain directory tree stand in for
//! configfs below an executor that only makes syscalls.
//!
//! configfs enforces nvmet's rules inside the syscalls themselves (a `write` to an enabled
//! namespace's `device_path` fails with EBUSY, a `mkdir` of a subsystem makes its attributes).
//! A plain tree does neither, so [`ConfigfsRules`] splits each operation in three: the rules
//! [`admit`](ConfigfsRules::admit) it (the kernel's refusal, or readying the plain tree for the
//! syscall), the executor makes the very syscalls it makes against configfs, and the rules
//! [`complete`](ConfigfsRules::complete) it (the kernel's side effects). Any executor of plain
//! syscalls (the agent's engines, [`KernelExecutor`]) then runs a plan against the double exactly
//! as against the kernel, one operation at a time.
//!
//! Invariants:
//! - An operation the rules refuse changes nothing, and its error is the kernel's errno.
//! - [`complete`](ConfigfsRules::complete) runs exactly once for each admitted operation whose
//!   syscalls succeeded, before the next operation is admitted; an operation whose syscalls
//!   failed is not completed (the plan stops there, as it does on the kernel).

use std::io;

use crate::exec::{Executor, KernelExecutor};
use crate::plan::Op;

/// What the rules must know to complete an operation they admitted (the value the kernel
/// stores for a write, the item a removed link named). Opaque: only the rules read it.
#[derive(Debug, Default)]
pub struct Admitted(pub(crate) Then);

/// The side of [`Admitted`] only the crate's rules read.
#[derive(Debug, Default)]
pub(crate) enum Then {
    /// Nothing beyond what the operation itself tells.
    #[default]
    Nothing,
    /// An attribute write: the value as the kernel stores it (parsed, normalised).
    Store(String),
    /// An unlink: the tree-relative path of the item the link named.
    Unlinked(std::path::PathBuf),
}

/// The kernel's rules for a tree that is not configfs (see the module documentation).
pub trait ConfigfsRules: Send + Sync + std::fmt::Debug {
    /// Refuses `op` with the kernel's errno, changing nothing; or readies the plain tree for
    /// the plain syscalls of `op` (configfs removes an item's attributes with its directory, a
    /// plain `rmdir` needs them gone first) and says what completes it.
    fn admit(&self, op: &Op) -> io::Result<Admitted>;

    /// After the plain syscalls of the admitted `op` succeeded: the kernel's side effects (a
    /// new item's attributes and groups, the value as stored, links read back relative).
    fn complete(&self, op: &Op, admitted: Admitted) -> io::Result<()>;
}

/// An executor of plain syscalls with the rules around each operation: admit, execute,
/// complete. The plan runner [`crate::apply`] over it names a refused operation as it names
/// one the kernel refused.
#[derive(Debug)]
pub struct Ruled<'a, E> {
    rules: &'a dyn ConfigfsRules,
    inner: E,
}

impl<'a, E: Executor> Ruled<'a, E> {
    /// `inner` under `rules`.
    pub fn new(rules: &'a dyn ConfigfsRules, inner: E) -> Self {
        Self { rules, inner }
    }
}

impl<E: Executor> Executor for Ruled<'_, E> {
    fn execute(&mut self, op: &Op) -> io::Result<()> {
        let admitted = self.rules.admit(op)?;
        self.inner.execute(op)?;
        self.rules.complete(op, admitted)
    }
}

/// Runs `op` on the tree at `rules`' root with plain syscalls under `rules`.
pub(crate) fn execute_ruled(
    rules: &dyn ConfigfsRules,
    root: &std::path::Path,
    op: &Op,
) -> io::Result<()> {
    Ruled::new(rules, KernelExecutor::new(root)).execute(op)
}
