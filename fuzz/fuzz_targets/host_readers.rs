//! The node's readers of kernel and tool output (mountinfo, connect reply, blkid, xfs_logprint, ext4 superblock, Reservation Report, sysfs): see `pillar_fuzz_oracles::host_readers`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pillar_fuzz_oracles::host_readers::check(data));
