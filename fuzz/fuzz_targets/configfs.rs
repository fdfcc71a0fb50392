//! The nvmet configfs readers, full and scoped: see `pillar_fuzz_oracles::configfs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pillar_fuzz_oracles::configfs::check(data));
