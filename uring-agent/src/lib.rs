//! pillar's storage-node agent: fenced volume, export and ACL operations on the Linux NVMe-oF
//! target, with an io_uring core.
pub mod backend;
pub mod engine;
pub mod fence;
