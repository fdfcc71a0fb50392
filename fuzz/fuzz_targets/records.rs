//! Records read back from disk (fencing mark, identity record, stage record): see `pillar_fuzz_oracles::records`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pillar_fuzz_oracles::records::check(data));
