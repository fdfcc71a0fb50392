//! The real-kernel lane (issue 5): pillar's own binaries against a real Linux kernel. The agent
//! (`pillar-agent --target kernel`) drives configfs/nvmet, the node plugin (`pillar-csi node`)
//! connects with the kernel's NVMe/TCP host over loopback, the controller (`pillar-csi
//! controller`) keeps its records in the embedded store. The test drives the CSI calls the way
//! kubelet and the sidecars do and checks the kernel's side: its log (`/dev/kmsg`), configfs
//! (`/sys/kernel/config/nvmet`), sysfs (`/sys/class/nvme*`, `/sys/block/nvme*`) and I/O with
//! checksums.
//!
//! Where it runs: inside the VM of `tests/kernel-lane/run.sh` (guest script
//! `tests/kernel-lane/guest/pillar.sh`, which runs the binary with `--include-ignored` and sets
//! `PILLAR_KERNEL_LANE=1`). Two gates keep it off other machines: every scenario is `#[ignore]`d
//! (a plain `cargo test` lists them as ignored, never as passed), and without the variable a
//! scenario run with `--ignored` prints `SKIP: ...` and returns. The scenarios tear down ALL
//! nvmet state and delete every NVMe/TCP controller of the machine they run on, so they must
//! never run by accident, even on a machine that has nvmet. With the variable set and no nvmet
//! in the kernel, the scenario fails.
//!
//! Binaries: `pillar-csi` is this package's (`CARGO_BIN_EXE_pillar-csi`), `pillar-agent` is
//! looked up next to it (build it first: `cargo build -p pillar-agent`); `PILLAR_CSI_BIN` and
//! `PILLAR_AGENT_BIN` override both.
//!
//! Scenarios (one test each; run them with `--test-threads=1`):
//! 1. provision, publish, stage (mkfs, mount), publish to a pod path, checksummed I/O, teardown
//! 2. agent restart (SIGKILL) with its state kept: I/O goes on, identity unchanged
//! 3. storage-node reboot (port taken away, nvmet torn down, agent state wiped, agent refuses
//!    exports until the controller resyncs): the host reconnects by itself, data intact
//! 4. control: the same reboot with kernel-random identity breaks the filesystem
//! 5. one writer: a second host identity cannot connect while the volume is published RWO to
//!    the first (acl); ControllerUnpublish while the first host is connected cuts it off (W7:
//!    its writes fail or block, the backing file is unchanged); after publish to the second, it
//!    connects and reads the data
//! 6. a stale revoke (older generation after a newer grant) is rejected; the grant stays; the
//!    current revoke cuts the host off and its write never reaches the backing file
//! 7. online expansion (host sees the new size, filesystem grows) and volume stats
//! 8. the LVM backends (linear and thin) on device-mapper: extent rounding, the `pillar` tag,
//!    export of the LV, I/O, online expansion, shrink refused, delete; foreign LVs untouched
//! 9. force-detach from a lost node (W7): after ControllerUnpublish returns no write of the old
//!    node reaches the device (a marker written then stays intact), its writes fail or hang, and
//!    the new node mounts a clean filesystem with every write the old one had acknowledged; its
//!    control (an ACL-only revoke) shows the marker overwritten
//! 10. NVMe reservations (W9): with `resv_enable` the stager holds Write Exclusive, a connected
//!     second host cannot write, the next stager preempts and aborts the first; without it,
//!     nothing is written to it and the stage works
//! 11. density: 1,000 exports on loop devices; one more Export timed at 10 and at 1,000; a
//!     storage reboot and one resync of all 1,000, each back with its identity, ACL and port
//! 12. lvm-thin snapshots: data written through NVMe/TCP, a snapshot cut with the host
//!     connected, more writes; a restore holds exactly the data at the cut, a clone the data
//!     after; deletes in the orders thin LVM allows, refusals where the rules forbid
//! 13. zfs on the real OpenZFS module (the kernels it supports): create, export, I/O, online
//!     expansion, snapshot, restore, clone through NVMe/TCP; deletes in every order, refused
//!     while a snapshot or clone depends on the zvol
//! 14. crash states: the agent's state directory on ext4 on a `dm-log-writes` device; fenced
//!     operations, then every FLUSH, FUA and mark point of the log replayed onto a fresh device:
//!     each record old or new, never torn or behind an acknowledged mark, and the restarted
//!     agent fails closed; its control leaves out the temp file's fsync and is caught
//! 15. DH-HMAC-CHAP (W10): without a secret or with a wrong one the node's NQN is refused, with
//!     it the node connects and does I/O; rotation with the controller live; a revoked secret
//!     no longer connects; without kernel support the export requiring it is refused
//! 16. TLS for NVMe/TCP (tlshd from sid): the node with its PSK connects over TLS and does I/O,
//!     a plain host is refused, a capture of the port shows no NVMe/TCP PDU in clear but the
//!     refused plain attempt's; without kernel support the export requiring TLS is refused
//!
//! Benchmarks (`b*`, left out of the lane's default run; `tests/kernel-lane/run.sh b1_`):
//! 1. the attach path: CreateVolume -> ControllerPublish -> NodeStage -> NodePublish of 50
//!    volumes, p50/p99 per phase from the node plugin's log, pillar's own share
//!
//! Layout: [`harness`] (settings, the gate and result lines, the kernel log, processes, machine
//! state, data with checksums, the lab, kernel-side checks), [`lvm`] (scenario 8's LVM helpers), [`attach`] (NVMe/TCP attach of scenarios 12 and 13),
//! [`reboot`] (the storage-node reboot of scenarios 3 and 4), [`logwrites`] (scenario 14's
//! log-writes device and replayed states), [`capture`] (scenario 16's look at the wire), and one module per scenario, named
//! as its test (libtest paths are `<scenario>::<scenario>`; name filters such as `s3_` match).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod attach;
mod b1_attach_path;
mod capture;
mod harness;
mod logwrites;
mod lvm;
mod reboot;

mod s10_reservations;
mod s11_density;
mod s12_lvm_thin_snapshots;
mod s13_zfs;
mod s14_crash_states;
mod s15_dhchap;
mod s16_tls;
mod s1_provision_publish_stage_io;
mod s2_agent_restart_keeps_identity;
mod s3_storage_reboot_recovers;
mod s4_control_random_identity_breaks_fs;
mod s5_one_writer;
mod s6_stale_revoke_rejected;
mod s7_online_expansion_and_stats;
mod s8_lvm_backends;
mod s9_control_acl_only_revoke;
mod s9_force_detach;
