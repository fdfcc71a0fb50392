//! The harness shared by the scenarios: the lane's settings, the gate, the kernel log,
//! processes, machine state, data with checksums, the lab and the kernel-side checks.

pub(crate) mod checks;
pub(crate) mod data;
pub(crate) mod gate;
pub(crate) mod kmsg;
pub(crate) mod lab;
pub(crate) mod machine;
pub(crate) mod process;
pub(crate) mod seqlog;

use std::time::Duration;

pub(crate) const NVMET: &str = "/sys/kernel/config/nvmet";
pub(crate) const AGENT_NAME: &str = "storage-1";
pub(crate) const POOL: &str = "pool";
pub(crate) const PROTOCOL: &str = "nvme-tcp";
pub(crate) const PORT: u16 = 4420;
pub(crate) const MIB: u64 = 1 << 20;
/// Seconds between the host's reconnect attempts: short, so reconnects are quick under TCG.
pub(crate) const RECONNECT_DELAY: u32 = 1;
/// Seconds the host keeps reconnecting: long enough for a whole emulated storage-node reboot.
pub(crate) const CTRL_LOSS_TMO: i32 = 120;
/// How long a started process has to open its socket (debug binaries under TCG start slowly).
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(60);
/// The default node's identity: written by the guest script into /etc/nvme.
pub(crate) const ETC_HOSTNQN: &str = "/etc/nvme/hostnqn";
pub(crate) const ETC_HOSTID: &str = "/etc/nvme/hostid";
/// A second host identity in the same guest (scenario 5).
pub(crate) const SECOND_HOSTID: &str = "5c0ffee0-0000-4000-8000-0000000000b2";
