//! The properties pillar's fuzz targets check, one module per target, in a library so that the
//! cargo-fuzz targets (`fuzz/fuzz_targets/`) and the replay test of the root workspace
//! (`tests/corpus_replay.rs`, every checked-in corpus file of every target) check the same
//! thing. Each `check` takes the raw fuzz input, panics on a violated property and returns
//! otherwise; it never touches anything outside a temporary directory of its own.
//!
//! Beyond "no panic", each checks what can be said of its parser: a decoded value re-encodes
//! to a form that decodes equal, a refusal carries the gRPC code a client must get, what is
//! accepted is exactly what was sent, and nothing grows far beyond the input.

pub mod agent_request;
pub mod configfs;
pub mod csi_request;
pub mod host_readers;
pub mod records;
pub mod rewriter;
mod tree;

/// A target's check: panics on a violated property.
pub type Check = fn(&[u8]);

/// Every target: its name (`fuzz/fuzz_targets/<name>.rs`, `fuzz/corpus/<name>/`) and check.
pub const TARGETS: &[(&str, Check)] = &[
    ("rewriter", rewriter::check),
    ("records", records::check),
    ("agent_request", agent_request::check),
    ("csi_request", csi_request::check),
    ("configfs", configfs::check),
    ("host_readers", host_readers::check),
];

/// Most a decoded value may take re-encoded, for an input of `len` bytes: decoding never
/// inflates beyond pretty-printing's indentation.
pub(crate) fn bound(len: usize) -> usize {
    8 * len + 4096
}
