//! One parser of CSI volume capabilities, for the controller and the node plugin alike: both
//! accept and refuse exactly the same capabilities, and each maps [`CapabilityError`] to its own
//! error type.
//!
//! Accepted: every access mode but MULTI_NODE_MULTI_WRITER (W3: a pillar volume has one writer)
//! and UNKNOWN; block access, or mount access with `fs_type` ext4, xfs or empty; but not block
//! access with a reader-only mode (N5): nothing on a node can keep a workload that holds the
//! device node from writing (a read-only bind does not; the block device's read-only flag
//! does not stop NVMe passthrough writes), so a read-only raw block volume is refused when it is
//! created, not when a pod first waits for it.

use pillar_host::{FsType, StageMode};
use pillar_state::crd::{AccessMode, VolumeMode};

use crate::csi::VolumeCapability;
use crate::csi::volume_capability::AccessType;
use crate::csi::volume_capability::access_mode::Mode;

/// Why a capability is refused. Every variant is INVALID_ARGUMENT at both edges.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapabilityError {
    #[error("volume capability has no {0}")]
    Missing(&'static str),
    #[error("access mode {0} is not supported")]
    UnknownMode(i32),
    #[error("MULTI_NODE_MULTI_WRITER (RWX) is not supported: a pillar volume has one writer")]
    MultiWriter,
    #[error("filesystem {0:?} is not supported (pillar supports ext4 and xfs)")]
    Filesystem(String),
    #[error(
        "read-only raw block ({0}) is not supported: a workload holding the device node could \
         still write to it (neither a read-only bind nor the device's read-only flag stops \
         NVMe passthrough writes); use a filesystem volume for read-only sharing"
    )]
    ReadOnlyBlock(&'static str),
    #[error("block and mount capabilities cannot be mixed")]
    Mixed,
    #[error("volume capabilities are required")]
    None,
}

/// How the workload sees the volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Access {
    Block,
    Mount {
        /// The capability's `fs_type`; `None` when empty.
        fs: Option<FsType>,
        flags: Vec<String>,
    },
}

/// A checked volume capability.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capability {
    pub mode: AccessMode,
    pub access: Access,
}

impl Capability {
    /// Block or filesystem.
    pub fn volume_mode(&self) -> VolumeMode {
        match self.access {
            Access::Block => VolumeMode::Block,
            Access::Mount { .. } => VolumeMode::Filesystem,
        }
    }

    /// The access mode allows reading only.
    pub fn reader_only(&self) -> bool {
        matches!(
            self.mode,
            AccessMode::SingleNodeReaderOnly | AccessMode::MultiNodeReaderOnly
        )
    }

    /// Whether the workload gets the raw block device.
    pub fn is_block(&self) -> bool {
        self.access == Access::Block
    }

    /// The stage mode this capability asks for, with `default_fs` for a mount without a type.
    pub fn stage_mode(&self, default_fs: FsType) -> StageMode {
        match &self.access {
            Access::Block => StageMode::Block,
            Access::Mount { fs, .. } => StageMode::Filesystem {
                fs_type: fs.unwrap_or(default_fs),
            },
        }
    }
}

fn access_mode(raw: i32) -> Result<AccessMode, CapabilityError> {
    match Mode::try_from(raw) {
        Ok(Mode::SingleNodeWriter) => Ok(AccessMode::SingleNodeWriter),
        Ok(Mode::SingleNodeReaderOnly) => Ok(AccessMode::SingleNodeReaderOnly),
        Ok(Mode::MultiNodeReaderOnly) => Ok(AccessMode::MultiNodeReaderOnly),
        Ok(Mode::MultiNodeSingleWriter) => Ok(AccessMode::MultiNodeSingleWriter),
        Ok(Mode::SingleNodeSingleWriter) => Ok(AccessMode::SingleNodeSingleWriter),
        Ok(Mode::SingleNodeMultiWriter) => Ok(AccessMode::SingleNodeMultiWriter),
        Ok(Mode::MultiNodeMultiWriter) => Err(CapabilityError::MultiWriter),
        Ok(Mode::Unknown) | Err(_) => Err(CapabilityError::UnknownMode(raw)),
    }
}

/// Checks one capability.
pub fn parse(cap: &VolumeCapability) -> Result<Capability, CapabilityError> {
    let mode = access_mode(
        cap.access_mode
            .ok_or(CapabilityError::Missing("access mode"))?
            .mode,
    )?;
    let access = match cap
        .access_type
        .as_ref()
        .ok_or(CapabilityError::Missing("access type"))?
    {
        AccessType::Block(_) => Access::Block,
        AccessType::Mount(m) => Access::Mount {
            fs: match m.fs_type.as_str() {
                "" => None,
                other => Some(
                    FsType::parse(other)
                        .map_err(|_| CapabilityError::Filesystem(other.to_owned()))?,
                ),
            },
            flags: m.mount_flags.clone(),
        },
    };
    let parsed = Capability { mode, access };
    if parsed.reader_only() && parsed.is_block() {
        return Err(CapabilityError::ReadOnlyBlock(match parsed.mode {
            AccessMode::MultiNodeReaderOnly => "MULTI_NODE_READER_ONLY",
            _ => "SINGLE_NODE_READER_ONLY",
        }));
    }
    Ok(parsed)
}

/// Checks a non-empty list of capabilities of one volume mode; the first one stands for the
/// list (its access mode is the one recorded).
pub fn parse_all(caps: &[VolumeCapability]) -> Result<Capability, CapabilityError> {
    let mut parsed = caps.iter().map(parse);
    let first = parsed.next().ok_or(CapabilityError::None)??;
    for next in parsed {
        if next?.volume_mode() != first.volume_mode() {
            return Err(CapabilityError::Mixed);
        }
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::csi::volume_capability::{AccessMode as CsiMode, BlockVolume, MountVolume};

    fn cap(mode: Mode, access: Option<AccessType>) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(CsiMode { mode: mode.into() }),
            access_type: access,
        }
    }

    fn mount(fs: &str) -> Option<AccessType> {
        Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: vec!["noatime".into()],
            volume_mount_group: String::new(),
        }))
    }

    fn block() -> Option<AccessType> {
        Some(AccessType::Block(BlockVolume {}))
    }

    #[test]
    fn accepted_capabilities() {
        let c = parse(&cap(Mode::SingleNodeWriter, mount(""))).unwrap();
        assert_eq!(c.mode, AccessMode::SingleNodeWriter);
        assert_eq!(
            c.access,
            Access::Mount {
                fs: None,
                flags: vec!["noatime".into()]
            }
        );
        assert!(!c.reader_only());
        assert_eq!(c.volume_mode(), VolumeMode::Filesystem);
        let c = parse(&cap(Mode::MultiNodeReaderOnly, mount("xfs"))).unwrap();
        assert!(c.reader_only());
        let c = parse(&cap(Mode::SingleNodeSingleWriter, block())).unwrap();
        assert!(c.is_block());
        assert_eq!(c.volume_mode(), VolumeMode::Block);
    }

    // proves W3, N5 (read-only raw block refused at the parser both sides share)
    #[test]
    fn refused_capabilities() {
        for (c, want) in [
            (
                cap(Mode::MultiNodeMultiWriter, block()),
                CapabilityError::MultiWriter,
            ),
            (cap(Mode::Unknown, block()), CapabilityError::UnknownMode(0)),
            (
                cap(Mode::SingleNodeWriter, mount("btrfs")),
                CapabilityError::Filesystem("btrfs".into()),
            ),
            (
                cap(Mode::MultiNodeReaderOnly, block()),
                CapabilityError::ReadOnlyBlock("MULTI_NODE_READER_ONLY"),
            ),
            (
                cap(Mode::SingleNodeReaderOnly, block()),
                CapabilityError::ReadOnlyBlock("SINGLE_NODE_READER_ONLY"),
            ),
            (
                cap(Mode::SingleNodeWriter, None),
                CapabilityError::Missing("access type"),
            ),
            (
                VolumeCapability {
                    access_mode: None,
                    access_type: block(),
                },
                CapabilityError::Missing("access mode"),
            ),
        ] {
            assert_eq!(parse(&c), Err(want));
        }
        assert_eq!(
            parse_all(&[
                cap(Mode::SingleNodeWriter, block()),
                cap(Mode::SingleNodeWriter, mount("ext4"))
            ]),
            Err(CapabilityError::Mixed)
        );
        assert_eq!(parse_all(&[]), Err(CapabilityError::None));
    }
}
