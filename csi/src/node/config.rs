//! The node plugin's configuration.

use std::path::PathBuf;
use std::time::Duration;

use pillar_host::HostPaths;
use pillar_nvmet::HostNqn;

/// How long NodeStageVolume waits, by default, for the namespace after connecting.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// How the node reaches a volume's block device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    /// Connect to the volume's NVMe/TCP subsystem, find its namespace by subsystem NQN and verify
    /// its identity (rule N1). The production mode.
    NvmeTcp,
    /// The single-machine mode on the configfs test double, where no NVMe host exists: the
    /// device is the local block device named by `publish_context[pillar.io/localDevice]`.
    /// No identity check is possible; every stage says so in the log.
    LocalDevice,
}

/// Everything the node service needs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The Kubernetes node name (the first half of the node ID, and the topology segment).
    pub node_name: String,
    /// This node's host NQN (`/etc/nvme/hostnqn`), passed explicitly on every connect.
    pub host_nqn: HostNqn,
    /// This node's host ID (`/etc/nvme/hostid`), passed explicitly on every connect.
    pub host_id: uuid::Uuid,
    /// Stage records live under `<state_dir>/staged/`. Must survive reboots of the plugin.
    pub state_dir: PathBuf,
    /// The `/dev` and `/sys` roots.
    pub paths: HostPaths,
    pub attach: AttachMode,
    /// How long to wait for the namespace after connecting, and for a grown device to show its
    /// new size.
    pub connect_timeout: Duration,
    /// Whether NodeStage of a read-write single-node volume takes the NVMe Write Exclusive
    /// reservation (rule W9). On in every real deployment; off only where the NVMe devices are
    /// stand-ins that cannot answer NVMe ioctls (loop devices under a fake sysfs in tests).
    pub reservations: bool,
    /// Topology segments this node reports besides [`TOPOLOGY_KEY`](super::TOPOLOGY_KEY) (for
    /// example `topology.pillar-csi.io/zone`): a volume is placed only on an agent whose
    /// segments this node reports with the same values.
    pub topology: std::collections::BTreeMap<String, String>,
}
