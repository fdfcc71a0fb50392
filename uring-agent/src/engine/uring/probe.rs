//! Setting the ring up: created disabled, its opcodes probed, its direct-descriptor table and
//! io-wq worker limit registered, then restricted to exactly what the engine uses and enabled.
//!
//! The restriction is an allowlist the kernel enforces from then on, like a seccomp filter for
//! the ring: an entry with any other opcode or SQE flag completes with `-EACCES` without running,
//! and no `io_uring_register` operation is allowed at all once the ring runs (the engine
//! registers everything it needs before enabling it).

use std::io;

use io_uring::squeue::Flags;
use io_uring::{IoUring, Probe, opcode};

use crate::engine::EngineError;

/// Every opcode the engine submits, with its name for errors. Probed at start, and the ring's
/// SQE opcode allowlist is exactly this list.
pub(super) const OPCODES: [(u8, &str); 9] = [
    (opcode::OpenAt::CODE, "openat"),
    (opcode::Write::CODE, "write"),
    // The eventfd read that wakes the ring thread.
    (opcode::Read::CODE, "read"),
    (opcode::Fsync::CODE, "fsync"),
    (opcode::Close::CODE, "close"),
    (opcode::RenameAt::CODE, "renameat"),
    (opcode::UnlinkAt::CODE, "unlinkat"),
    (opcode::MkDirAt::CODE, "mkdirat"),
    (opcode::SymlinkAt::CODE, "symlinkat"),
];

/// The SQE flags the engine sets: links between the entries of a chain, and writes and fsyncs
/// on direct descriptors (`IOSQE_FIXED_FILE`). `SKIP_SUCCESS` is added where the kernel has it.
const FLAGS: Flags = Flags::IO_LINK
    .union(Flags::IO_HARDLINK)
    .union(Flags::FIXED_FILE);

/// A ring ready for the engine, and what it learnt about the kernel.
pub(super) struct RingSetup {
    pub ring: IoUring,
    /// The kernel can skip completions of successful entries (Linux 5.17+).
    pub skip_success: bool,
}

/// An [`EngineError::Unavailable`] naming the failed step, a hint for the usual causes, and the
/// way out (`--engine sync`).
pub(super) fn unavailable(what: &str, e: &io::Error) -> EngineError {
    let hint = match e.raw_os_error() {
        Some(libc::ENOSYS) => " (the kernel has no io_uring, or a seccomp profile hides it)",
        Some(libc::EPERM) => {
            " (io_uring is disabled: see /proc/sys/kernel/io_uring_disabled, or a container seccomp profile blocks it)"
        }
        _ => "",
    };
    EngineError::Unavailable {
        reason: format!("{what}: {e}{hint}; run the agent with --engine sync"),
    }
}

/// Builds the engine's ring with `entries` submission entries and `file_slots` direct
/// descriptors (and as many io-wq workers), restricted to [`OPCODES`] and the engine's flags.
pub(super) fn restricted_ring(entries: u32, file_slots: u32) -> Result<RingSetup, EngineError> {
    let ring = IoUring::builder()
        .dontfork()
        .setup_r_disabled()
        .build(entries)
        .map_err(|e| unavailable("io_uring_setup", &e))?;
    require_opcodes(&ring)?;
    ring.submitter()
        .register_files_sparse(file_slots)
        .map_err(|e| unavailable("registering direct descriptors", &e))?;
    raise_worker_limit(&ring, file_slots);
    let skip_success = ring.params().is_feature_skip_cqe_on_success();
    restrict(&ring, skip_success)?;
    ring.submitter()
        .register_enable_rings()
        .map_err(|e| unavailable("enabling the ring", &e))?;
    Ok(RingSetup { ring, skip_success })
}

/// Fails with the names of the opcodes the kernel lacks.
fn require_opcodes(ring: &IoUring) -> Result<(), EngineError> {
    let mut probe = Probe::new();
    ring.submitter()
        .register_probe(&mut probe)
        .map_err(|e| unavailable("io_uring probe", &e))?;
    let missing: Vec<&str> = OPCODES
        .iter()
        .filter(|(code, _)| !probe.is_supported(*code))
        .map(|(_, name)| *name)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(EngineError::Unavailable {
        reason: format!(
            "the kernel's io_uring lacks {}; run the agent with --engine sync",
            missing.join(", ")
        ),
    })
}

/// fsync is a blocking operation the kernel runs on io-wq workers, whose bounded pool defaults
/// to a few per CPU; let every request in flight have one, so concurrent volumes' fsyncs run in
/// parallel instead of queueing behind each other. The kernel keeps the limit with the ring and
/// applies it to the ring thread's workers when that thread first submits.
fn raise_worker_limit(ring: &IoUring, workers: u32) {
    let mut max_workers = [workers, 0];
    if let Err(e) = ring.submitter().register_iowq_max_workers(&mut max_workers) {
        tracing::warn!(error = %e, "could not raise the io-wq worker limit; fsyncs may queue");
    }
}

/// The restriction list: each opcode of [`OPCODES`], and the SQE flags the engine sets. No
/// register operation is listed, so none is allowed once the ring is enabled.
fn allowlist(skip_success: bool) -> Vec<io_uring::register::Restriction> {
    use io_uring::register::Restriction;
    let flags = if skip_success {
        FLAGS | Flags::SKIP_SUCCESS
    } else {
        FLAGS
    };
    OPCODES
        .iter()
        .map(|(code, _)| Restriction::sqe_op(*code))
        // One entry: the kernel keeps only the last "flags allowed" restriction it is given.
        .chain([Restriction::sqe_flags_allowed(flags.bits())])
        .collect()
}

fn restrict(ring: &IoUring, skip_success: bool) -> Result<(), EngineError> {
    ring.submitter()
        .register_restrictions(&mut allowlist(skip_success))
        .map_err(|e| unavailable("registering the io_uring restrictions", &e))
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use io_uring::squeue::Entry;
    use io_uring::types::Fd;

    use super::*;

    fn ring() -> RingSetup {
        restricted_ring(8, 4).expect("io_uring works on this machine")
    }

    /// Submits one entry that holds no pointer and returns its completion's result.
    fn run_one(ring: &mut IoUring, entry: &Entry) -> i32 {
        // SAFETY: the entries pushed by these tests (nop, fsync of an open descriptor) carry no
        // pointer into user memory.
        unsafe { ring.submission().push(entry) }.expect("an empty queue has room");
        ring.submit_and_wait(1).expect("io_uring_enter");
        ring.completion()
            .next()
            .expect("one completion after waiting for one")
            .result()
    }

    #[test]
    fn allowed_opcodes_run() {
        let mut setup = ring();
        let file = tempfile::tempfile().unwrap();
        let fsync = opcode::Fsync::new(Fd(file.as_raw_fd())).build();
        assert_eq!(run_one(&mut setup.ring, &fsync), 0);
        let linked = opcode::Fsync::new(Fd(file.as_raw_fd()))
            .build()
            .flags(Flags::IO_HARDLINK);
        assert_eq!(run_one(&mut setup.ring, &linked), 0);
    }

    #[test]
    fn an_opcode_outside_the_allowlist_is_refused() {
        let mut setup = ring();
        let nop = opcode::Nop::new().build();
        assert_eq!(run_one(&mut setup.ring, &nop), -libc::EACCES);
        let file = tempfile::tempfile().unwrap();
        let fallocate = opcode::Fallocate::new(Fd(file.as_raw_fd()), 4096).build();
        assert_eq!(run_one(&mut setup.ring, &fallocate), -libc::EACCES);
    }

    #[test]
    fn a_flag_outside_the_allowlist_is_refused() {
        let mut setup = ring();
        let file = tempfile::tempfile().unwrap();
        for flag in [Flags::ASYNC, Flags::IO_DRAIN] {
            let fsync = opcode::Fsync::new(Fd(file.as_raw_fd())).build().flags(flag);
            assert_eq!(run_one(&mut setup.ring, &fsync), -libc::EACCES, "{flag:?}");
        }
    }

    #[test]
    fn no_register_operation_is_allowed_once_enabled() {
        let setup = ring();
        let err = setup
            .ring
            .submitter()
            .register_probe(&mut Probe::new())
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EACCES));
    }

    #[test]
    fn the_engines_chain_flags_run() {
        let mut setup = ring();
        let file = tempfile::tempfile().unwrap();
        let mut first = Flags::IO_LINK;
        if setup.skip_success {
            first |= Flags::SKIP_SUCCESS;
        }
        let entries = [
            opcode::Fsync::new(Fd(file.as_raw_fd()))
                .build()
                .flags(first),
            opcode::Fsync::new(Fd(file.as_raw_fd())).build(),
        ];
        // SAFETY: fsyncs of an open descriptor carry no pointer into user memory.
        unsafe { setup.ring.submission().push_multiple(&entries) }.unwrap();
        setup.ring.submit_and_wait(1).unwrap();
        let results: Vec<i32> = setup.ring.completion().map(|c| c.result()).collect();
        assert!(results.iter().all(|r| *r == 0), "{results:?}");
    }
}
