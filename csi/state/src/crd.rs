//! The four custom resources pillar keeps in the Kubernetes API (or, in single-machine mode, in
//! the [`EmbeddedStore`](crate::embedded::EmbeddedStore)): `PillarVolumeState`,
//! `PillarSnapshotState`, `PillarAgent` and `PillarProtocol`, all cluster-scoped in the group
//! `pillar-csi.io`, version `v1alpha1`.
//!
//! Short names are chosen not to clash with core Kubernetes ones (`pv`, `pvc`, `po`, `no`, `ns`,
//! `sc`, ...): `pillarvol`, `pillarsnap`, `pillaragent`, `pillarproto`.

use std::collections::BTreeMap;

use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::condition::{Condition, ConditionStatus};

/// The API group of every pillar resource.
pub const GROUP: &str = "pillar-csi.io";
/// The API version of every pillar resource.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` as it appears in objects.
pub const API_VERSION: &str = "pillar-csi.io/v1alpha1";

// The object's `metadata.uid` names one lifecycle of the volume name (F2, F3): a volume deleted
// and re-created under the same name gets a new UID, and every compare-and-swap on the status is
// pinned to the UID the operation started with.
/// Where a volume was provisioned and how it is presented.
// clippy reads repeated `type_ = ".."` inside separate `printcolumn(..)` groups as duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "pillar-csi.io",
    version = "v1alpha1",
    kind = "PillarVolumeState",
    plural = "pillarvolumestates",
    shortname = "pillarvol",
    status = "PillarVolumeStateStatus",
    derive = "PartialEq",
    doc = "One pillar volume: where it lives, and every node it is published to",
    printcolumn(name = "Agent", type_ = "string", json_path = ".spec.agent"),
    printcolumn(name = "Size", type_ = "integer", json_path = ".spec.sizeBytes"),
    printcolumn(
        name = "Nodes",
        type_ = "string",
        description = "nodes the volume is published to",
        json_path = ".status.publishedNodes[*].node"
    ),
    printcolumn(
        name = "Generation",
        type_ = "integer",
        description = "publication generation (fencing token)",
        json_path = ".status.publicationGeneration"
    ),
    printcolumn(
        name = "AclDisabled",
        type_ = "string",
        description = "published under a protocol with acl: false (any host can connect)",
        json_path = ".status.conditions[?(@.type==\"AclDisabled\")].status"
    ),
    printcolumn(
        name = "AuthDisabled",
        type_ = "string",
        description = "published without DH-HMAC-CHAP (auth: none or acl: false): a host is admitted on its NQN",
        json_path = ".status.conditions[?(@.type==\"AuthDisabled\")].status"
    ),
    printcolumn(
        name = "Revoking",
        type_ = "string",
        description = "an unpublish waits for the storage node to confirm its revoke",
        json_path = ".status.conditions[?(@.type==\"Revoking\")].status"
    ),
    printcolumn(
        name = "Deleting",
        type_ = "boolean",
        description = "a DeleteVolume has started",
        json_path = ".status.deleting"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct PillarVolumeStateSpec {
    /// The CSI volume ID.
    pub volume_id: String,
    /// Name of the `PillarAgent` (storage node) holding the volume.
    pub agent: String,
    /// Pool on that agent.
    pub pool: String,
    /// Provisioned size in bytes.
    pub size_bytes: u64,
    /// The access mode the volume was provisioned for.
    pub access_mode: AccessMode,
    /// Filesystem or raw block.
    pub volume_mode: VolumeMode,
    /// Name of the `PillarProtocol` the volume is exported with.
    pub protocol: String,
    /// StorageClass parameters the volume was created with.
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// The topology segments the volume is reachable from (its agent's, when it was created);
    /// empty: from every node.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub topology: BTreeMap<String, String>,
    /// The snapshot or volume the volume's content was copied from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_source: Option<ContentSourceRef>,
}

/// Where a volume's first content came from: a snapshot (a restore) or a volume (a clone).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContentSourceRef {
    /// Snapshot or volume.
    pub kind: ContentSourceKind,
    /// The CSI snapshot or volume ID.
    pub id: String,
    /// The source's lifecycle (its record's metadata.uid) when the volume was asked for: the
    /// agent copies only that lifecycle.
    pub uid: String,
}

/// The kind of a content source.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ContentSourceKind {
    Snapshot,
    Volume,
}

// W3: RWX is rejected at provisioning, so no record can carry it.
/// CSI access modes pillar accepts. RWX (`MULTI_NODE_MULTI_WRITER`) is deliberately absent: it is
/// rejected when a volume is provisioned, so no record can ever carry it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum AccessMode {
    /// `SINGLE_NODE_WRITER` (RWO).
    SingleNodeWriter,
    /// `SINGLE_NODE_SINGLE_WRITER` (RWOP).
    SingleNodeSingleWriter,
    /// `SINGLE_NODE_MULTI_WRITER`.
    SingleNodeMultiWriter,
    /// `SINGLE_NODE_READER_ONLY`.
    SingleNodeReaderOnly,
    /// `MULTI_NODE_READER_ONLY` (ROX).
    MultiNodeReaderOnly,
    /// `MULTI_NODE_SINGLE_WRITER`.
    MultiNodeSingleWriter,
}

impl AccessMode {
    /// Whether the mode lets more than one node hold the volume at once.
    pub fn is_multi_node(self) -> bool {
        matches!(
            self,
            Self::MultiNodeReaderOnly | Self::MultiNodeSingleWriter
        )
    }
}

/// How the volume is presented to workloads.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum VolumeMode {
    /// A filesystem, formatted on first stage.
    Filesystem,
    /// The raw block device.
    Block,
}

/// The status subresource of a `PillarVolumeState`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PillarVolumeStateStatus {
    // W1: written before the agent is asked to grant access; W4: removed only after the agent
    // confirms the revoke.
    /// Every node the volume is published to. A record is written before the node is granted
    /// access and removed only after the grant is confirmed revoked.
    #[serde(default)]
    pub published_nodes: Vec<PublishedNode>,
    // F2: with metadata.uid this is the fencing token.
    /// Counter the controller increments by compare-and-swap for each operation; with the
    /// object's UID it is the fencing token sent to the agent.
    #[serde(default)]
    pub publication_generation: u64,
    // W5, W8: set in the same compare-and-swap that found no publication; publishes are refused
    // from then on, so no publication can appear while the volume is deleted.
    /// A DeleteVolume has started: the volume takes no new publication and is never exported
    /// again.
    #[serde(default)]
    pub deleting: bool,
    // W6, W7, W10: written in the same compare-and-swap as the publication records they
    // describe, or after the agent confirmed what they say.
    /// Conditions in the shape of `metav1.Condition`, one per type. `AclDisabled`: a
    /// publication is recorded under a protocol with `acl: false`, so any host that reaches the
    /// port can connect and unpublishing cannot keep a lost node out. `AuthDisabled`: the
    /// storage node was confirmed to export the volume without requiring DH-HMAC-CHAP (`auth:
    /// none`, or `acl: false`), so a host is admitted on the NQN it presents. `Revoking`: an unpublish
    /// waits for the storage node to confirm its revoke; the publication stays recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// One publication record.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PublishedNode {
    /// Kubernetes node name: the first part of the CSI node ID `<node>/<host-nqn>`.
    pub node: String,
    /// The node's NVMe host NQN.
    pub host_nqn: String,
    /// The access mode of this publication.
    pub access_mode: AccessMode,
    /// Whether it was published read-only.
    #[serde(default)]
    pub readonly: bool,
    /// An unpublish has started and the revoke is not yet confirmed.
    #[serde(default)]
    pub revoking: bool,
    // W8: with node and host NQN, the identity of this publication. An unpublish acts only on
    // the publication it read, never on a later one of the same node.
    /// The publication generation of the write that recorded this publication.
    #[serde(default)]
    pub recorded_generation: u64,
}

impl PillarVolumeState {
    /// The status, or the empty status when none was ever written.
    pub fn status_or_default(&self) -> PillarVolumeStateStatus {
        self.status.clone().unwrap_or_default()
    }
}

// The object's `metadata.uid` names one lifecycle of the snapshot ID, as for volumes: the
// agent's snapshot mark is fenced by it and the status generation (F2, F3 for snapshots).
/// A snapshot: its source, where it lives, and whether it is cut.
// clippy reads repeated `type_ = ".."` inside separate `printcolumn(..)` groups as duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "pillar-csi.io",
    version = "v1alpha1",
    kind = "PillarSnapshotState",
    plural = "pillarsnapshotstates",
    shortname = "pillarsnap",
    status = "PillarSnapshotStateStatus",
    derive = "PartialEq",
    doc = "One pillar snapshot: its source volume, where it lives, and whether it is ready",
    printcolumn(name = "Source", type_ = "string", json_path = ".spec.sourceVolumeId"),
    printcolumn(name = "Agent", type_ = "string", json_path = ".spec.agent"),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.readyToUse"),
    printcolumn(name = "Size", type_ = "integer", json_path = ".status.sizeBytes"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct PillarSnapshotStateSpec {
    /// The CSI snapshot ID (the object's name).
    pub snapshot_id: String,
    /// The CSI volume ID of the source volume.
    pub source_volume_id: String,
    /// The source volume's lifecycle when the snapshot was asked for (its
    /// PillarVolumeState's metadata.uid): the agent cuts only that lifecycle.
    pub source_uid: String,
    /// Name of the `PillarAgent` holding the snapshot (the source's).
    pub agent: String,
    /// Pool on that agent (the source's).
    pub pool: String,
}

/// The status subresource of a `PillarSnapshotState`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PillarSnapshotStateStatus {
    // F2: with metadata.uid this is the snapshot's fencing token.
    /// Counter the controller increments by compare-and-swap for each agent call; with the
    /// object's UID it is the fencing token.
    #[serde(default)]
    pub generation: u64,
    /// The agent confirmed the cut.
    #[serde(default)]
    pub ready_to_use: bool,
    /// The source's size at the cut: the least a restore takes.
    #[serde(default)]
    pub size_bytes: u64,
    /// When the snapshot was cut (seconds and nanoseconds since the epoch), as the agent says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_unix_seconds: Option<i64>,
    #[serde(default)]
    pub creation_nanos: i32,
    /// A DeleteSnapshot has started: no restore may use it from then on.
    #[serde(default)]
    pub deleting: bool,
}

impl PillarSnapshotState {
    /// The status, or the empty status when none was ever written.
    pub fn status_or_default(&self) -> PillarSnapshotStateStatus {
        self.status.clone().unwrap_or_default()
    }
}

/// What the controller's resync loop (on the Lease holder) last saw of an agent. Written only
/// when it changes; an operator's view, never an input to a safety decision.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PillarAgentStatus {
    /// `Serving`, `WaitingForResync` (it refuses exports until the controller resyncs it) or
    /// `Unreachable`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub state: String,
    /// Why it is unreachable, or what its last resync left undone.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// When `state` last changed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    /// When the controller last resynced its exports (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_resync_time: Option<String>,
    /// Exports that resync restored.
    #[serde(default)]
    pub exports_restored: u32,
    /// Exports that resync could not restore (the agent keeps asking for them).
    #[serde(default)]
    pub exports_failed: u32,
}

/// One storage node's agent.
// clippy reads repeated `type_ = ".."` inside separate `printcolumn(..)` groups as duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "pillar-csi.io",
    version = "v1alpha1",
    kind = "PillarAgent",
    plural = "pillaragents",
    shortname = "pillaragent",
    status = "PillarAgentStatus",
    derive = "PartialEq",
    doc = "One storage node's pillar agent",
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.node"),
    printcolumn(name = "Address", type_ = "string", json_path = ".spec.address"),
    printcolumn(name = "NVMe", type_ = "string", json_path = ".spec.nvmeAddress"),
    printcolumn(
        name = "State",
        type_ = "string",
        description = "Serving, WaitingForResync or Unreachable, as the leader last saw it",
        json_path = ".status.state"
    ),
    printcolumn(
        name = "LastResync",
        type_ = "date",
        json_path = ".status.lastResyncTime"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct PillarAgentSpec {
    /// The Kubernetes node the agent runs on.
    pub node: String,
    /// Where the controller reaches the agent's gRPC API: `host:port` or `unix:///path`.
    pub address: String,
    /// TLS for the gRPC connection; absent means plaintext, which the controller uses only when
    /// started with `--agent-insecure-plaintext` (`unix://` addresses take no TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<AgentTls>,
    /// Storage pools the agent offers.
    #[serde(default)]
    pub pools: Vec<PoolRef>,
    /// The address hosts connect to over NVMe/TCP.
    pub nvme_address: String,
    /// Topology segments of the storage node (for example `topology.pillar-csi.io/zone: a`).
    /// A volume on this agent is reachable from a node whose NodeGetInfo reports every one of
    /// these keys with the same value; none means from every node.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub topology: BTreeMap<String, String>,
}

/// TLS settings for talking to an agent.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentTls {
    /// The name the agent's certificate must carry.
    pub server_name: String,
    /// Path (on the controller) of the PEM bundle of CAs that sign the agent's certificate.
    pub ca_bundle_path: String,
}

/// A storage pool on an agent.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolRef {
    /// Pool name, unique on its agent.
    pub name: String,
    /// Backend kind (for example `lvm` or `file`).
    pub kind: String,
}

/// How volumes are exported and attached.
// Several print columns share `type_ = "string"`: the lint reads them as one attribute repeated.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "pillar-csi.io",
    version = "v1alpha1",
    kind = "PillarProtocol",
    plural = "pillarprotocols",
    shortname = "pillarproto",
    derive = "PartialEq",
    doc = "How pillar exports volumes and how nodes attach them",
    printcolumn(name = "Port", type_ = "integer", json_path = ".spec.nvmeTcp.port"),
    printcolumn(name = "ACL", type_ = "boolean", json_path = ".spec.nvmeTcp.acl"),
    printcolumn(name = "Auth", type_ = "string", json_path = ".spec.nvmeTcp.auth"),
    printcolumn(name = "TLS", type_ = "string", json_path = ".spec.nvmeTcp.tls"),
    printcolumn(name = "FS", type_ = "string", json_path = ".spec.nvmeTcp.fsType"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct PillarProtocolSpec {
    /// NVMe over TCP settings.
    #[serde(default)]
    pub nvme_tcp: NvmeTcp,
}

/// NVMe/TCP export and connect settings.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NvmeTcp {
    /// Target port (`trsvcid`).
    #[serde(default = "default_port")]
    pub port: u16,
    // W6.
    /// `true` (default): the subsystem admits only the host NQNs of published nodes, so a
    /// revoke keeps a host out. `false`: `allow_any_host`, so any host that can reach the port
    /// can connect and an unpublish cannot fence anyone.
    #[serde(default = "default_acl")]
    pub acl: bool,
    // W10.
    /// `dhchap` (default): every admitted host proves its own DH-HMAC-CHAP secret, and the
    /// target proves its controller secret back; an export is refused on a storage node whose
    /// kernel has no NVMe in-band authentication. `none`: hosts are admitted on their NQN alone
    /// (shown on each published volume as `AuthDisabled=True`, with a Warning event).
    #[serde(default)]
    pub auth: ProtocolAuth,
    /// `none` (default): NVMe/TCP in clear. `required`: hosts connect over TLS 1.3 with a PSK
    /// (the storage node's port has `addr_tsas=tls1.3`, `addr_treq=required`; `tlshd` from
    /// ktls-utils does the handshake on both ends), so a host without its PSK, or without TLS,
    /// is refused. Each host's PSK is derived from its DH-HMAC-CHAP secret, so `required` needs
    /// `acl: true` and `auth: dhchap`. An export is refused on a storage node whose kernel has
    /// no TLS for the NVMe/TCP target. Ports are shared by the protocols on the same `port`,
    /// which must then agree on `tls`; an edit reaches exports made after it.
    #[serde(default)]
    pub tls: ProtocolTls,
    /// `ctrl_loss_tmo` in seconds passed at connect; default 600, the kernel's and nvme-cli's own
    /// default. `-1` reconnects forever.
    #[serde(default = "default_ctrl_loss_tmo")]
    pub ctrl_loss_tmo: i32,
    /// `reconnect_delay` in seconds passed at connect; default 10, the kernel's default.
    #[serde(default = "default_reconnect_delay")]
    pub reconnect_delay: u32,
    /// Filesystem for `Filesystem` volumes.
    #[serde(default)]
    pub fs_type: FsType,
    /// Extra arguments for `mkfs`.
    #[serde(default)]
    pub mkfs_options: Vec<String>,
}

/// NVMe in-band authentication of a protocol's hosts (W10).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ProtocolAuth {
    /// DH-HMAC-CHAP, bidirectional (the default).
    #[default]
    Dhchap,
    /// No authentication: a host is admitted on the NQN it presents.
    None,
}

/// TLS for a protocol's NVMe/TCP connections.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ProtocolTls {
    /// No TLS (the default).
    #[default]
    None,
    /// TLS 1.3 with a PSK per host and volume; plain hosts are refused.
    Required,
}

/// Filesystems pillar formats.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FsType {
    /// ext4 (the default).
    #[default]
    Ext4,
    /// XFS.
    Xfs,
}

impl FsType {
    /// The name `mkfs.<name>` and `mount -t` use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ext4 => "ext4",
            Self::Xfs => "xfs",
        }
    }
}

/// Default NVMe/TCP port.
pub const DEFAULT_NVME_TCP_PORT: u16 = 4420;
/// Default `ctrl_loss_tmo` (seconds).
pub const DEFAULT_CTRL_LOSS_TMO: i32 = 600;
/// Default `reconnect_delay` (seconds).
pub const DEFAULT_RECONNECT_DELAY: u32 = 10;

fn default_acl() -> bool {
    true
}
fn default_port() -> u16 {
    DEFAULT_NVME_TCP_PORT
}
fn default_ctrl_loss_tmo() -> i32 {
    DEFAULT_CTRL_LOSS_TMO
}
fn default_reconnect_delay() -> u32 {
    DEFAULT_RECONNECT_DELAY
}

impl Default for NvmeTcp {
    fn default() -> Self {
        Self {
            port: DEFAULT_NVME_TCP_PORT,
            acl: true,
            auth: ProtocolAuth::Dhchap,
            tls: ProtocolTls::None,
            ctrl_loss_tmo: DEFAULT_CTRL_LOSS_TMO,
            reconnect_delay: DEFAULT_RECONNECT_DELAY,
            fs_type: FsType::Ext4,
            mkfs_options: Vec::new(),
        }
    }
}

/// The three CustomResourceDefinitions as one multi-document YAML stream, as `crdgen` prints it
/// and as `deploy/base/crds.yaml` holds it.
pub fn crds_yaml() -> Result<String, serde_yaml::Error> {
    let mut out = String::new();
    for crd in [
        PillarVolumeState::crd(),
        PillarSnapshotState::crd(),
        PillarAgent::crd(),
        PillarProtocol::crd(),
    ] {
        let mut value =
            serde_json::to_value(&crd).map_err(<serde_yaml::Error as serde::ser::Error>::custom)?;
        kubernetes_formats(&mut value);
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&value)?);
    }
    Ok(out)
}

/// Rewrites the integer formats schemars derives from Rust's unsigned types (`uint64`,
/// `uint32`, `uint16`, `uint8`), which the API server does not know and warns about, into the
/// OpenAPI formats it does (`int64`, and `int32` for 16 and 8 bits), with the bounds the unsigned
/// type had: the server then refuses what the Rust type could not hold (a negative generation is
/// 422).
fn kubernetes_formats(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            let bounds = match map.get("format").and_then(serde_json::Value::as_str) {
                Some("uint64") => Some(("int64", None)),
                Some("uint32") => Some(("int64", Some(u64::from(u32::MAX)))),
                Some("uint16") => Some(("int32", Some(u64::from(u16::MAX)))),
                Some("uint8") => Some(("int32", Some(u64::from(u8::MAX)))),
                _ => None,
            };
            if let Some((format, maximum)) = bounds {
                map.insert("format".into(), format.into());
                map.insert("minimum".into(), 0.into());
                if let Some(max) = maximum {
                    map.insert("maximum".into(), max.into());
                }
            }
            map.values_mut().for_each(kubernetes_formats);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(kubernetes_formats),
        _ => {}
    }
}
