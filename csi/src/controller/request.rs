//! Each CSI controller request parsed once into typed values. Everything INVALID_ARGUMENT is
//! decided here, before a lock is taken or the store is read.
//!
//! A volume ID pillar never issues names no volume: for calls that report on a volume it is
//! NOT_FOUND, for the idempotent removals (DeleteVolume, ControllerUnpublishVolume) it is
//! success; both are decided by the caller from [`VolumeRef`].

use std::collections::HashMap;

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

/// CreateVolume.
#[derive(Clone, Debug)]
pub struct Create {
    pub volume: VolumeId,
    pub capability: Capability,
    pub size: SizeRange,
    pub parameters: HashMap<String, String>,
}

pub fn create(req: csi::CreateVolumeRequest) -> Result<Create, ControllerError> {
    let volume = volume_id_for_name(&req.name)?;
    let capability = capability::parse_all(&req.volume_capabilities)?;
    if req.volume_content_source.is_some() {
        return Err(invalid(
            "volume content sources (snapshots, clones) are not supported",
        ));
    }
    Ok(Create {
        volume,
        capability,
        size: SizeRange::parse(req.capacity_range.as_ref())?,
        parameters: req.parameters,
    })
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
    Ok(Publish {
        volume,
        node_id: req.node_id.clone(),
        // An unparsable node ID is a node this driver never reported: NOT_FOUND, decided once
        // the volume is known to exist.
        node: NodeId::parse(&req.node_id).map_err(|e| e.to_string()),
        capability: capability::parse(cap)?,
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
pub fn list(req: &csi::ListVolumesRequest) -> Result<(usize, usize), ControllerError> {
    let start = if req.starting_token.is_empty() {
        0
    } else {
        req.starting_token
            .parse::<usize>()
            .map_err(|_| ControllerError::BadStartingToken(req.starting_token.clone()))?
    };
    let max = usize::try_from(req.max_entries)
        .map_err(|_| invalid("max_entries must not be negative"))?;
    Ok((start, max))
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
