//! The agent's gRPC request-field parsers: see `pillar_fuzz_oracles::agent_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pillar_fuzz_oracles::agent_request::check(data));
