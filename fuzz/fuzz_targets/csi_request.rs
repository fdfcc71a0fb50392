//! The CSI controller's and node plugin's request parsers: see `pillar_fuzz_oracles::csi_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pillar_fuzz_oracles::csi_request::check(data));
