//! Each CSI controller request parsed once into typed values. Everything INVALID_ARGUMENT is
//! decided here, before a lock is taken or the store is read.
//!
//! A volume ID pillar never issues names no volume: for calls that report on a volume it is
//! NOT_FOUND, for the idempotent removals (DeleteVolume, ControllerUnpublishVolume) it is
//! success; both are decided by the caller from [`VolumeRef`].

use std::collections::HashMap;

use pillar_host::FsType;
use pillar_nvmet::VolumeId;

use super::DEFAULT_VOLUME_BYTES;
use super::error::ControllerError;
use crate::capability::{self, Capability};
use crate::csi;
use crate::node_id::NodeId;

fn invalid(message: impl Into<String>) -> ControllerError {
    ControllerError::InvalidArgument(message.into())
}

/// A volume ID as the caller sent it: one pillar issues, or one that names no volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VolumeRef {
    Pillar(VolumeId),
    Unknown(String),
}

impl VolumeRef {
    /// The volume, or NOT_FOUND for an ID pillar never issues.
    pub fn existing(self) -> Result<VolumeId, ControllerError> {
        match self {
            Self::Pillar(v) => Ok(v),
            Self::Unknown(id) => Err(ControllerError::VolumeNotFound(id)),
        }
    }
}

/// Whether `id` is a volume ID pillar issues: a pillar `VolumeId` that is also a valid
/// Kubernetes object name (the PillarVolumeState is named after it).
fn pillar_volume_id(id: &str) -> Option<VolumeId> {
    let volume = VolumeId::parse(id).ok()?;
    pillar_state::store::validate_name("PillarVolumeState", id).ok()?;
    Some(volume)
}

/// A required volume ID.
fn volume_ref(id: &str) -> Result<VolumeRef, ControllerError> {
    if id.is_empty() {
        return Err(invalid("volume ID is required"));
    }
    Ok(pillar_volume_id(id).map_or_else(|| VolumeRef::Unknown(id.to_owned()), VolumeRef::Pillar))
}

/// The prefix of volume IDs made from a hash of the name.
const HASHED_PREFIX: &str = "pillar-";

/// Whether `id` has the shape of a hashed ID: `pillar-` and 32 lowercase hex digits.
fn is_hashed_shape(id: &str) -> bool {
    id.strip_prefix(HASHED_PREFIX).is_some_and(|hex| {
        hex.len() == 32
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// The volume ID for a CreateVolume `name`. CSI allows any Unicode name but a few control
/// characters; Kubernetes sends `pvc-<uuid>`. A name that already is a valid ID is kept, so IDs
/// stay readable, unless it has the shape of a hashed ID; any other name maps to `pillar-` +
/// the first 128 bits of its SHA-256 in hex. The map is injective: kept names never have the
/// hashed shape, so a kept name and a hashed one never meet (two names whose hashes share 128
/// bits aside). It is a function of the name, so retries of one name find the same volume.
pub fn volume_id_for_name(name: &str) -> Result<VolumeId, ControllerError> {
    if name.is_empty() {
        return Err(invalid("name is required"));
    }
    let banned = |c: char| matches!(c, '\u{0}'..='\u{8}' | '\u{b}' | '\u{c}' | '\u{e}'..='\u{1f}' | '\u{7f}'..='\u{9f}');
    if name.chars().any(banned) {
        return Err(invalid(
            "name contains a control character CSI does not allow",
        ));
    }
    if !is_hashed_shape(name)
        && let Some(volume) = pillar_volume_id(name)
    {
        return Ok(volume);
    }
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(name.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    VolumeId::parse(&format!("{HASHED_PREFIX}{hex}")).map_err(|e| invalid(e.to_string()))
}

/// The size a CreateVolume asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeRange {
    /// At least this many bytes (0: no minimum).
    pub required: u64,
    /// At most this many bytes (0: no limit).
    pub limit: u64,
}

impl SizeRange {
    fn parse(range: Option<&csi::CapacityRange>) -> Result<Self, ControllerError> {
        let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
        let (Ok(required), Ok(limit)) = (u64::try_from(required), u64::try_from(limit)) else {
            return Err(invalid("capacity range must not be negative"));
        };
        if limit != 0 && limit < required {
            return Err(invalid(format!(
                "limit_bytes {limit} is below required_bytes {required}"
            )));
        }
        Ok(Self { required, limit })
    }

    /// The size to create: the minimum, or the default capped by the limit.
    pub fn size(self) -> u64 {
        match (self.required, self.limit) {
            (0, 0) => DEFAULT_VOLUME_BYTES,
            (0, limit) => limit.min(DEFAULT_VOLUME_BYTES),
            (required, _) => required,
        }
    }

    /// Whether an existing volume of `bytes` satisfies the range.
    pub fn fits(self, bytes: u64) -> bool {
        bytes >= self.required && (self.limit == 0 || bytes <= self.limit)
    }
}

/// The filesystem a new volume will hold: the capability's `fs_type` (what the provisioner passes
/// from `csi.storage.k8s.io/fstype`), else the protocol's `fsType`, as the node decides at
/// NodeStage; `None` for a block volume.
pub fn volume_fs(cap: &Capability, protocol_fs: pillar_state::crd::FsType) -> Option<FsType> {
    match &cap.access {
        capability::Access::Block => None,
        capability::Access::Mount { fs: Some(fs), .. } => Some(*fs),
        capability::Access::Mount { fs: None, .. } => Some(match protocol_fs {
            pillar_state::crd::FsType::Ext4 => FsType::Ext4,
            pillar_state::crd::FsType::Xfs => FsType::Xfs,
        }),
    }
}

/// `size` rounded up to what mkfs of `fs` needs, or OUT_OF_RANGE when `range`'s limit does not
/// allow that: a volume the node can never format is refused here rather than created and
/// failed at every NodeStage.
pub fn fit_filesystem(
    volume: &str,
    size: u64,
    range: SizeRange,
    fs: Option<FsType>,
) -> Result<u64, ControllerError> {
    let Some(min) = fs.and_then(FsType::min_device_bytes) else {
        return Ok(size);
    };
    if size >= min {
        return Ok(size);
    }
    if range.limit != 0 && range.limit < min {
        return Err(ControllerError::OutOfRange(format!(
            "volume {volume} will hold {fs}, which mkfs makes only on {min} bytes or more; \
             limit_bytes {limit} is below that (use ext4 or allow {min} bytes)",
            fs = fs.map_or("", FsType::as_str),
            limit = range.limit,
        )));
    }
    Ok(min)
}

/// What a new volume's content comes from, as the request names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A snapshot ID (pillar's, or one that names no snapshot).
    Snapshot(VolumeRef),
    /// A volume ID (a clone).
    Volume(VolumeRef),
}

/// CreateVolume.
#[derive(Clone, Debug)]
pub struct Create {
    pub volume: VolumeId,
    pub capability: Capability,
    pub size: SizeRange,
    pub parameters: HashMap<String, String>,
    pub source: Option<Source>,
    /// Where the volume must (requisite) and should (preferred) be reachable from.
    pub topology: Option<csi::TopologyRequirement>,
}

pub fn create(req: csi::CreateVolumeRequest) -> Result<Create, ControllerError> {
    use csi::volume_content_source::Type;
    let volume = volume_id_for_name(&req.name)?;
    let capability = capability::parse_all(&req.volume_capabilities)?;
    let source = match req.volume_content_source.map(|s| s.r#type) {
        None => None,
        Some(Some(Type::Snapshot(s))) => Some(Source::Snapshot(snapshot_ref(&s.snapshot_id)?)),
        Some(Some(Type::Volume(v))) => Some(Source::Volume(volume_ref(&v.volume_id)?)),
        Some(None) => return Err(invalid("volume_content_source names no snapshot or volume")),
    };
    Ok(Create {
        volume,
        capability,
        size: SizeRange::parse(req.capacity_range.as_ref())?,
        parameters: req.parameters,
        source,
        topology: req.accessibility_requirements,
    })
}

/// A required snapshot ID: snapshot IDs follow the volume IDs' rules (pillar issues them with
/// [`volume_id_for_name`] from the CreateSnapshot name), in a space of their own.
pub fn snapshot_ref(id: &str) -> Result<VolumeRef, ControllerError> {
    if id.is_empty() {
        return Err(invalid("snapshot ID is required"));
    }
    Ok(pillar_volume_id(id).map_or_else(|| VolumeRef::Unknown(id.to_owned()), VolumeRef::Pillar))
}

/// CreateSnapshot: the snapshot ID for the name, and the source volume.
pub fn create_snapshot(
    req: &csi::CreateSnapshotRequest,
) -> Result<(VolumeId, VolumeRef), ControllerError> {
    if req.source_volume_id.is_empty() {
        return Err(invalid("source_volume_id is required"));
    }
    Ok((
        volume_id_for_name(&req.name)?,
        volume_ref(&req.source_volume_id)?,
    ))
}

/// ListSnapshots' page.
pub fn list_snapshots(req: &csi::ListSnapshotsRequest) -> Result<Page, ControllerError> {
    page(&req.starting_token, req.max_entries)
}

/// ControllerPublishVolume.
#[derive(Clone, Debug)]
pub struct Publish {
    pub volume: VolumeRef,
    /// The node ID as sent (for NOT_FOUND messages) and parsed.
    pub node_id: String,
    pub node: Result<NodeId, String>,
    pub capability: Capability,
    pub readonly: bool,
}

pub fn publish(req: &csi::ControllerPublishVolumeRequest) -> Result<Publish, ControllerError> {
    let volume = volume_ref(&req.volume_id)?;
    if req.node_id.is_empty() {
        return Err(invalid("node ID is required"));
    }
    let cap = req
        .volume_capability
        .as_ref()
        .ok_or_else(|| invalid("volume capability is required"))?;
    let capability = capability::parse(cap)?;
    // N5: the read-only flag on a block capability is read-only raw block too (see
    // `capability`): refused here, before anything is recorded or granted.
    if req.readonly && capability.is_block() {
        return Err(invalid(
            "a read-only publication of a raw block volume is not supported: a workload holding \
             the device node could still write to it; use a filesystem volume",
        ));
    }
    Ok(Publish {
        volume,
        node_id: req.node_id.clone(),
        // An unparsable node ID is a node this driver never reported: NOT_FOUND, decided once
        // the volume is known to exist.
        node: NodeId::parse(&req.node_id).map_err(|e| e.to_string()),
        capability,
        readonly: req.readonly,
    })
}

/// ControllerUnpublishVolume: from one node, or from every node.
#[derive(Clone, Debug)]
pub struct Unpublish {
    pub volume: VolumeRef,
    /// The node name; `None` unpublishes from every node.
    pub node: Option<String>,
}

pub fn unpublish(
    req: &csi::ControllerUnpublishVolumeRequest,
) -> Result<Unpublish, ControllerError> {
    let volume = volume_ref(&req.volume_id)?;
    let node = if req.node_id.is_empty() {
        None
    } else {
        Some(
            NodeId::parse(&req.node_id)
                .map(|n| n.node)
                .map_err(|e| ControllerError::NodeNotFound(req.node_id.clone(), e.to_string()))?,
        )
    };
    Ok(Unpublish { volume, node })
}

/// DeleteVolume.
pub fn delete(req: &csi::DeleteVolumeRequest) -> Result<VolumeRef, ControllerError> {
    volume_ref(&req.volume_id)
}

/// ControllerExpandVolume.
#[derive(Clone, Debug)]
pub struct Expand {
    pub volume: VolumeRef,
    pub required: u64,
}

pub fn expand(req: &csi::ControllerExpandVolumeRequest) -> Result<Expand, ControllerError> {
    let volume = volume_ref(&req.volume_id)?;
    let range = req
        .capacity_range
        .as_ref()
        .ok_or_else(|| invalid("capacity range is required"))?;
    let required = u64::try_from(range.required_bytes)
        .map_err(|_| invalid("required_bytes must not be negative"))?;
    Ok(Expand {
        volume,
        required: required.max(1),
    })
}

/// ValidateVolumeCapabilities: the volume and whether each capability parses.
pub fn validate(
    req: &csi::ValidateVolumeCapabilitiesRequest,
) -> Result<(VolumeRef, Vec<Result<Capability, String>>), ControllerError> {
    let volume = volume_ref(&req.volume_id)?;
    if req.volume_capabilities.is_empty() {
        return Err(invalid("volume capabilities are required"));
    }
    let caps = req
        .volume_capabilities
        .iter()
        .map(|c| capability::parse(c).map_err(|e| e.to_string()))
        .collect();
    Ok((volume, caps))
}

/// ControllerGetVolume.
pub fn get(req: &csi::ControllerGetVolumeRequest) -> Result<VolumeRef, ControllerError> {
    volume_ref(&req.volume_id)
}

/// ListVolumes paging: where to start and how many entries at most (0: all).
pub fn list(req: &csi::ListVolumesRequest) -> Result<Page, ControllerError> {
    page(&req.starting_token, req.max_entries)
}

/// One page of a listing sorted by name: the entries after `after` (from the first when
/// `None`), at most `max` of them (0: all).
///
/// The page token names the last entry returned, not its index: an entry deleted (or, for a
/// snapshot, marked deleting) between two pages does not shift the next page, so no entry that
/// existed the whole time is skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Page {
    pub after: Option<VolumeId>,
    pub max: usize,
}

/// What a page token starts with; the rest is the name of the last entry returned.
const PAGE_TOKEN_PREFIX: &str = "after:";

/// The token of the page after the one that ended with `last`.
pub fn page_token(last: &str) -> String {
    format!("{PAGE_TOKEN_PREFIX}{last}")
}

fn page(starting_token: &str, max_entries: i32) -> Result<Page, ControllerError> {
    let after = if starting_token.is_empty() {
        None
    } else {
        // Volume and snapshot IDs share one form; a token this controller never issued is
        // ABORTED, as CSI asks.
        let issued = starting_token
            .strip_prefix(PAGE_TOKEN_PREFIX)
            .and_then(pillar_volume_id)
            .ok_or_else(|| ControllerError::BadStartingToken(starting_token.to_owned()))?;
        Some(issued)
    };
    let max =
        usize::try_from(max_entries).map_err(|_| invalid("max_entries must not be negative"))?;
    Ok(Page { after, max })
}

/// The entries of `page` in `all` (sorted here by `name`, the order tokens rely on), and the
/// token of the next page (empty after the last).
pub fn paged<'a, T>(all: &'a mut [T], name: impl Fn(&T) -> &str, page: &Page) -> (&'a [T], String) {
    all.sort_by(|a, b| name(a).cmp(name(b)));
    let start = page.after.as_ref().map_or(0, |after| {
        all.partition_point(|e| name(e) <= after.as_str())
    });
    let rest = &all[start..];
    let n = if page.max == 0 {
        rest.len()
    } else {
        page.max.min(rest.len())
    };
    let next = match n.checked_sub(1).map(|last| &rest[last]) {
        Some(last) if n < rest.len() => page_token(name(last)),
        _ => String::new(),
    };
    (&rest[..n], next)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    // proves W1 (one name, one volume): a name that looks like a hashed ID is hashed too, so it
    // cannot alias the volume of the name that hashes to it. The old map kept
    // `pillar-1cbec737f863e4922cee63cc2ebbfaaf` as is, which is also the ID of `Foo`.
    #[test]
    fn two_names_never_share_a_volume() {
        let foo = volume_id_for_name("Foo").unwrap();
        assert_eq!(foo.to_string(), "pillar-1cbec737f863e4922cee63cc2ebbfaaf");
        let lookalike = volume_id_for_name(foo.as_str()).unwrap();
        assert_ne!(lookalike, foo);
        assert!(is_hashed_shape(lookalike.as_str()));
        // Near misses of the shape are ordinary names and kept.
        for kept in [
            "pillar-1cbec737",
            "pillar-1CBEC737F863E4922CEE63CC2EBBFAAF",
            "pvc-0a1b",
        ] {
            if let Some(id) = pillar_volume_id(kept) {
                assert_eq!(volume_id_for_name(kept).unwrap(), id, "{kept}");
            }
        }
    }

    // proves N5: read-only raw block is refused before anything is recorded: by CreateVolume's
    // capabilities and by ControllerPublish's read-only flag on a block capability.
    #[test]
    fn read_only_raw_block_is_refused_at_the_controller() {
        use crate::csi::volume_capability::access_mode::Mode;
        use crate::csi::volume_capability::{AccessMode as CsiMode, AccessType, BlockVolume};
        let block = |mode: Mode| csi::VolumeCapability {
            access_mode: Some(CsiMode { mode: mode.into() }),
            access_type: Some(AccessType::Block(BlockVolume {})),
        };
        let code = |r: Result<(), ControllerError>| {
            crate::controller::error::to_status(&r.unwrap_err()).code()
        };
        let create_req = |mode| csi::CreateVolumeRequest {
            name: "pvc-rox-block".into(),
            volume_capabilities: vec![block(mode)],
            ..Default::default()
        };
        assert_eq!(
            code(create(create_req(Mode::MultiNodeReaderOnly)).map(|_| ())),
            tonic::Code::InvalidArgument
        );
        assert!(create(create_req(Mode::SingleNodeWriter)).is_ok());
        let publish_req = |readonly| csi::ControllerPublishVolumeRequest {
            volume_id: "pvc-1".into(),
            node_id: "node-a/nqn.2014-08.org.nvmexpress:uuid:0a0a0a0a-0000-4000-8000-00000000000a"
                .into(),
            volume_capability: Some(block(Mode::SingleNodeWriter)),
            readonly,
            ..Default::default()
        };
        assert_eq!(
            code(publish(&publish_req(true)).map(|_| ())),
            tonic::Code::InvalidArgument
        );
        assert!(publish(&publish_req(false)).is_ok());
    }

    #[test]
    fn sizes() {
        let r = |required, limit| SizeRange { required, limit };
        assert_eq!(r(0, 0).size(), DEFAULT_VOLUME_BYTES);
        assert_eq!(r(0, 1024).size(), 1024);
        assert_eq!(r(0, u64::MAX).size(), DEFAULT_VOLUME_BYTES);
        assert_eq!(r(5000, 0).size(), 5000);
        assert!(r(10, 20).fits(15) && !r(10, 20).fits(21) && !r(10, 0).fits(9));
        let bad = csi::CapacityRange {
            required_bytes: 10,
            limit_bytes: 5,
        };
        assert!(SizeRange::parse(Some(&bad)).is_err());
    }

    #[test]
    fn xfs_sizes_are_rounded_up_to_the_mkfs_minimum_within_the_limit() {
        let r = |required, limit| SizeRange { required, limit };
        let min = pillar_host::XFS_MIN_BYTES;
        let xfs = Some(FsType::Xfs);
        assert_eq!(
            fit_filesystem("v", 1 << 20, r(1 << 20, 0), xfs).unwrap(),
            min
        );
        assert_eq!(fit_filesystem("v", 1 << 20, r(0, min), xfs).unwrap(), min);
        assert_eq!(
            fit_filesystem("v", min + 1, r(min + 1, 0), xfs).unwrap(),
            min + 1
        );
        let err = fit_filesystem("v", 1 << 20, r(0, min - 1), xfs).unwrap_err();
        assert!(matches!(err, ControllerError::OutOfRange(_)), "{err:?}");
        for other in [Some(FsType::Ext4), None] {
            assert_eq!(
                fit_filesystem("v", 1 << 20, r(0, 1 << 20), other).unwrap(),
                1 << 20
            );
        }
    }

    mod properties {
        //! Bounded for CI: 512 cases per property.
        use proptest::prelude::*;
        use tonic::Code;

        use super::super::*;
        use crate::controller::code_of;
        use crate::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};

        /// CreateVolume names: anything, names that already are volume IDs, names with the
        /// hashed shape, and names with near-miss shapes.
        fn name() -> impl Strategy<Value = String> {
            prop_oneof![
                any::<String>(),
                "[a-z0-9][a-z0-9.-]{0,20}",
                "pvc-[0-9a-f-]{36}",
                "pillar-[0-9a-f]{32}",
                "pillar-[0-9a-fA-F]{30,34}",
                "[a-zA-Z0-9._-]{1,130}",
            ]
        }

        fn capability() -> impl Strategy<Value = Option<csi::VolumeCapability>> {
            let access = prop_oneof![
                Just(None),
                Just(Some(AccessType::Block(BlockVolume {}))),
                ("[a-z0-9]{0,6}", prop::collection::vec("[ -~]{0,8}", 0..2)).prop_map(
                    |(fs_type, mount_flags)| Some(AccessType::Mount(MountVolume {
                        fs_type,
                        mount_flags,
                        ..Default::default()
                    }))
                ),
            ];
            let mode = prop_oneof![
                Just(None),
                (-2i32..10).prop_map(|mode| Some(AccessMode { mode }))
            ];
            prop::option::of((access, mode).prop_map(|(access_type, access_mode)| {
                csi::VolumeCapability {
                    access_type,
                    access_mode,
                }
            }))
        }

        fn range() -> impl Strategy<Value = Option<csi::CapacityRange>> {
            prop::option::of((any::<i64>(), any::<i64>()).prop_map(
                |(required_bytes, limit_bytes)| csi::CapacityRange {
                    required_bytes,
                    limit_bytes,
                },
            ))
        }

        fn volume_ref_ok(sent: &str, got: &VolumeRef) -> Result<(), TestCaseError> {
            match got {
                VolumeRef::Pillar(v) => {
                    prop_assert_eq!(v.as_str(), sent);
                    prop_assert!(pillar_volume_id(sent).is_some());
                }
                VolumeRef::Unknown(id) => {
                    prop_assert_eq!(id.as_str(), sent);
                    prop_assert!(pillar_volume_id(sent).is_none());
                }
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

            // proves W1 (one name, one volume): the name -> volume ID map is injective, for
            // arbitrary names, names that already are IDs, and a name equal to the ID another
            // name hashed to. Every ID it gives is one pillar issues (a volume ID and a valid
            // object name); a refusal is INVALID_ARGUMENT.
            #[test]
            fn the_name_map_is_injective(a in name(), b in name(), lookalike in any::<bool>()) {
                let ia = volume_id_for_name(&a);
                let b = match (&ia, lookalike) {
                    (Ok(id), true) => id.to_string(),
                    _ => b,
                };
                let ib = volume_id_for_name(&b);
                for (name, id) in [(&a, &ia), (&b, &ib)] {
                    match id {
                        Ok(id) => prop_assert!(pillar_volume_id(id.as_str()).is_some(), "{name:?} -> {id}"),
                        Err(e) => {
                            prop_assert_eq!(code_of(e), Code::InvalidArgument);
                            prop_assert!(name.is_empty() || name.chars().any(char::is_control));
                        }
                    }
                }
                if let (Ok(ia), Ok(ib)) = (&ia, &ib) {
                    prop_assert_eq!(a == b, ia == ib, "{:?} and {:?} both map to {}", a, b, ia);
                }
                // Stable: a retry of the same name finds the same volume.
                prop_assert_eq!(ia.ok(), volume_id_for_name(&a).ok());
            }

            // The controller's request parsers on arbitrary fields: no panic; an accepted
            // request carries what was sent; a refusal has the code CSI asks for
            // (INVALID_ARGUMENT for malformed fields, NOT_FOUND for an unknown node in
            // ControllerUnpublish, ABORTED for a bad ListVolumes starting token).
            #[test]
            fn request_parsers_never_panic_and_answer_the_right_code(
                name in name(),
                volume_id in name(),
                node_id in prop_oneof![any::<String>(), "[a-z0-9-]{1,10}/nqn\\.2014-08\\.org\\.nvmexpress:uuid:[0-9a-f-]{36}"],
                cap in capability(),
                caps in prop::collection::vec(capability(), 0..3),
                capacity in range(),
                readonly in any::<bool>(),
                token in prop_oneof![any::<String>(), "[0-9]{0,4}", "after:[a-z0-9.:-]{0,12}"],
                max_entries in any::<i32>(),
            ) {
                let create_req = csi::CreateVolumeRequest {
                    name: name.clone(),
                    capacity_range: capacity,
                    volume_capabilities: caps.iter().flatten().cloned().collect(),
                    ..Default::default()
                };
                match create(create_req) {
                    Ok(c) => {
                        prop_assert_eq!(c.volume, volume_id_for_name(&name).unwrap());
                        prop_assert!(c.size.limit == 0 || c.size.limit >= c.size.required);
                    }
                    Err(e) => prop_assert_eq!(code_of(&e), Code::InvalidArgument, "{}", e),
                }

                let publish_req = csi::ControllerPublishVolumeRequest {
                    volume_id: volume_id.clone(),
                    node_id: node_id.clone(),
                    volume_capability: cap.clone(),
                    readonly,
                    ..Default::default()
                };
                match publish(&publish_req) {
                    Ok(p) => {
                        volume_ref_ok(&volume_id, &p.volume)?;
                        prop_assert_eq!(&p.node_id, &node_id);
                        prop_assert!(!node_id.is_empty() && cap.is_some());
                        prop_assert_eq!(p.readonly, readonly);
                    }
                    Err(e) => prop_assert_eq!(code_of(&e), Code::InvalidArgument, "{}", e),
                }

                let unpublish_req = csi::ControllerUnpublishVolumeRequest {
                    volume_id: volume_id.clone(),
                    node_id: node_id.clone(),
                    ..Default::default()
                };
                match unpublish(&unpublish_req) {
                    Ok(u) => {
                        volume_ref_ok(&volume_id, &u.volume)?;
                        prop_assert_eq!(u.node.is_none(), node_id.is_empty());
                    }
                    Err(e) => {
                        let code = code_of(&e);
                        prop_assert!(
                            (volume_id.is_empty() && code == Code::InvalidArgument)
                                || (!volume_id.is_empty() && code == Code::NotFound),
                            "{e}"
                        );
                    }
                }

                for result in [
                    delete(&csi::DeleteVolumeRequest { volume_id: volume_id.clone(), ..Default::default() }),
                    get(&csi::ControllerGetVolumeRequest { volume_id: volume_id.clone() }),
                ] {
                    match result {
                        Ok(v) => volume_ref_ok(&volume_id, &v)?,
                        Err(e) => {
                            prop_assert!(volume_id.is_empty());
                            prop_assert_eq!(code_of(&e), Code::InvalidArgument);
                        }
                    }
                }

                match expand(&csi::ControllerExpandVolumeRequest {
                    volume_id: volume_id.clone(),
                    capacity_range: capacity,
                    ..Default::default()
                }) {
                    Ok(x) => {
                        volume_ref_ok(&volume_id, &x.volume)?;
                        prop_assert!(x.required >= 1);
                    }
                    Err(e) => prop_assert_eq!(code_of(&e), Code::InvalidArgument, "{}", e),
                }

                match validate(&csi::ValidateVolumeCapabilitiesRequest {
                    volume_id: volume_id.clone(),
                    volume_capabilities: caps.iter().flatten().cloned().collect(),
                    ..Default::default()
                }) {
                    Ok((v, parsed)) => {
                        volume_ref_ok(&volume_id, &v)?;
                        prop_assert_eq!(parsed.len(), caps.iter().flatten().count());
                    }
                    Err(e) => prop_assert_eq!(code_of(&e), Code::InvalidArgument, "{}", e),
                }

                match list(&csi::ListVolumesRequest { starting_token: token.clone(), max_entries }) {
                    Ok(page) => {
                        match &page.after {
                            None => prop_assert!(token.is_empty()),
                            Some(after) => prop_assert_eq!(page_token(after.as_str()), token.clone()),
                        }
                        prop_assert!(max_entries >= 0 && usize::try_from(max_entries) == Ok(page.max));
                    }
                    Err(e) => {
                        let code = code_of(&e);
                        prop_assert!(code == Code::Aborted || (code == Code::InvalidArgument && max_entries < 0), "{e}");
                    }
                }
            }
        }
    }

    #[test]
    fn names_map_to_stable_ids() {
        assert_eq!(
            volume_id_for_name("pvc-1").unwrap(),
            volume_id_for_name("pvc-1").unwrap()
        );
        let hashed = volume_id_for_name("Foo Bar/Ünïcode").unwrap();
        assert!(hashed.to_string().starts_with("pillar-"));
        assert!(volume_id_for_name("").is_err());
        assert_eq!(volume_id_for_name("pvc-1").unwrap().to_string(), "pvc-1");
        assert!(volume_id_for_name("a\u{1}b").is_err());
    }
}
