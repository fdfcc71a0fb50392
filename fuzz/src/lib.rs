//! The properties the fuzz targets check, in a library so that `cargo test` here runs them on
//! the seed corpus without libFuzzer.

pub mod rewriter;
