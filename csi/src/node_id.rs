//! The CSI node ID: `<node-name>/<host-nqn>`. The controller learns each node's host NQN from
//! it (NodeGetInfo), so grants name the host the kernel will see at connect. `/` cannot occur
//! in an NQN (pillar refuses it) nor in a Kubernetes node name, so the split is unambiguous.

use pillar_nvmet::HostNqn;

/// The CSI limit on node IDs, in bytes.
pub const MAX_NODE_ID_LEN: usize = 256;

/// Why a node ID was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeIdError {
    #[error("node ID {0:?} is not <node-name>/<host-nqn>")]
    Shape(String),
    #[error("node ID {id:?} has an invalid host NQN: {reason}")]
    HostNqn { id: String, reason: String },
    #[error("node ID would be {0} bytes; CSI allows {MAX_NODE_ID_LEN}")]
    TooLong(usize),
}

/// A parsed node ID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeId {
    pub node: String,
    pub host_nqn: HostNqn,
}

impl NodeId {
    /// Parses `<node-name>/<host-nqn>`.
    pub fn parse(id: &str) -> Result<Self, NodeIdError> {
        let (node, nqn) = id
            .split_once('/')
            .ok_or_else(|| NodeIdError::Shape(id.to_owned()))?;
        if node.is_empty() || node.len() > 253 {
            return Err(NodeIdError::Shape(id.to_owned()));
        }
        let host_nqn = HostNqn::parse(nqn).map_err(|e| NodeIdError::HostNqn {
            id: id.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            node: node.to_owned(),
            host_nqn,
        })
    }

    /// Formats the ID, refusing one longer than CSI allows.
    pub fn format(&self) -> Result<String, NodeIdError> {
        let id = format!("{}/{}", self.node, self.host_nqn);
        if id.len() > MAX_NODE_ID_LEN {
            return Err(NodeIdError::TooLong(id.len()));
        }
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let id = "worker-1/nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555";
        let parsed = NodeId::parse(id).unwrap();
        assert_eq!(parsed.node, "worker-1");
        assert_eq!(parsed.format().unwrap(), id);
        for bad in [
            "",
            "worker-1",
            "/nqn.2014-08.com.example:x",
            "w/not-an-nqn",
            "w/nqn.2014-08.com.example:a,b",
        ] {
            assert!(NodeId::parse(bad).is_err(), "{bad:?}");
        }
    }
}
