//! The authority rewriter against h2's decoder: see `pillar_fuzz_oracles::rewriter`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pillar_fuzz_oracles::rewriter::check(data));
