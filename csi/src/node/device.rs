//! What the engine's steps hand each other about a volume's device, and the rule that decides
//! whether a stage takes the namespace's reservation (W9): plain data and one pure function,
//! shared by the engine (`engine.rs`), the attach (`attach.rs`) and the reservation
//! (`reserve.rs`) steps, so none of those imports another's types.

use std::path::PathBuf;

use crate::capability::Capability;

/// A volume's block device, found and (for NVMe) verified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Device {
    /// The device node.
    pub path: PathBuf,
    /// What the stage record keeps as a hint: the NVMe disk name, or the local device path.
    pub hint: String,
}

/// A volume's health, for NodeGetVolumeStats.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Condition {
    pub abnormal: bool,
    pub message: String,
}

/// Whether a stage with `cap` (read-only when `read_only`) takes the reservation: a read-write
/// stage of a single-node mode (SINGLE_NODE_WRITER, SINGLE_NODE_SINGLE_WRITER, and
/// SINGLE_NODE_MULTI_WRITER, whose writers all share this one host and its reservation).
pub fn wants_reservation(cap: &Capability, read_only: bool) -> bool {
    !read_only && !cap.reader_only() && !cap.mode.is_multi_node()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capability::Access;
    use pillar_state::crd::AccessMode;

    fn cap(mode: AccessMode) -> Capability {
        Capability {
            mode,
            access: Access::Block,
        }
    }

    // proves W9 (which stages take the reservation: single-node read-write only)
    #[test]
    fn only_single_node_read_write_stages_take_the_reservation() {
        assert!(wants_reservation(&cap(AccessMode::SingleNodeWriter), false));
        assert!(wants_reservation(
            &cap(AccessMode::SingleNodeSingleWriter),
            false
        ));
        assert!(wants_reservation(
            &cap(AccessMode::SingleNodeMultiWriter),
            false
        ));
        assert!(!wants_reservation(&cap(AccessMode::SingleNodeWriter), true));
        assert!(!wants_reservation(
            &cap(AccessMode::SingleNodeReaderOnly),
            false
        ));
        assert!(!wants_reservation(
            &cap(AccessMode::MultiNodeReaderOnly),
            false
        ));
        assert!(!wants_reservation(
            &cap(AccessMode::MultiNodeSingleWriter),
            false
        ));
    }
}
