//! Keys of the CSI `publish_context` and `volume_context` maps pillar fills in the controller
//! and reads in the node plugin. The volume's namespace identity is never among them: the node
//! derives it from the NQN (I1).

/// Subsystem NQN of the volume's export.
pub const NQN: &str = "pillar.io/nqn";
/// Target address hosts connect to.
pub const TRADDR: &str = "pillar.io/traddr";
/// Target TCP service (port).
pub const TRSVCID: &str = "pillar.io/trsvcid";
/// Seconds the host keeps retrying a lost controller (-1: forever).
pub const CTRL_LOSS_TMO: &str = "pillar.io/ctrlLossTmo";
/// Seconds between reconnect attempts.
pub const RECONNECT_DELAY: &str = "pillar.io/reconnectDelay";
/// Filesystem to create on a blank device: `ext4` or `xfs`.
pub const FS_TYPE: &str = "pillar.io/fsType";
/// Extra mkfs options, as a JSON array of strings.
pub const MKFS_OPTIONS: &str = "pillar.io/mkfsOptions";
/// Only in the single-machine mode on the configfs test double: the local block device to use
/// instead of an NVMe/TCP connection (no NVMe host exists there).
pub const LOCAL_DEVICE: &str = "pillar.io/localDevice";
/// `"true"` when the publication gives read access only (ROX, SINGLE_NODE_READER_ONLY, or
/// published readonly): the node stages the volume read-only (N5), so two nodes never mount one
/// filesystem read-write.
pub const READ_ONLY: &str = "pillar.io/readOnly";
/// `"dhchap"` when the export requires NVMe in-band authentication (W10): the node connects
/// with its own secrets, which come in NodeStageVolume's `secrets` (never here), and refuses to
/// stage without them. `"none"`: the protocol opted out (`auth: none`).
pub const AUTH: &str = "pillar.io/auth";
/// `"required"` when the export requires TLS for NVMe/TCP: the node derives its PSK for the
/// subsystem from its DH-HMAC-CHAP secret, puts it in its kernel's `.nvme` keyring and connects
/// with `tls`. Absent or `"none"`: no TLS.
pub const TLS: &str = "pillar.io/tls";

/// Keys of NodeStageVolume's `secrets` (kubelet fills them from the PV's node-stage Secret): the
/// node's DH-HMAC-CHAP secret and the controller secret it checks the target with.
pub const SECRET_DHCHAP: &str = "dhchapSecret";
/// See [`SECRET_DHCHAP`].
pub const SECRET_DHCHAP_CTRL: &str = "dhchapCtrlSecret";
