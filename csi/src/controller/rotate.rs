//! Rotation of a node's DH-HMAC-CHAP pair (W10): new secrets in the store, then every storage
//! node where the node holds a publication is resynced, so each export admitting it carries the
//! new pair and the agent rewrites the host entry's keys (only what differs, under the target
//! lock, read back).
//!
//! Invariants:
//! - The pair is replaced in the store before any agent gets it, so a grant or resync running
//!   meanwhile sends the new pair too, never an older one after the newer.
//! - A storage node that could not be resynced keeps the old keys until its next resync (which
//!   reads the store again): it is reported, never retried here with old credentials.
//! - Live connections stay authenticated until the host re-authenticates (K29); a new connect
//!   needs the new secret, which the node gets at its next stage.

use std::collections::BTreeSet;

use super::Controller;
use super::error::{ControllerError, describe};

/// What a rotation did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rotation {
    /// The storage nodes (PillarAgents) that hold the new pair.
    pub agents: Vec<String>,
    /// The storage nodes whose resync failed, with why: they still hold the old pair.
    pub failed: Vec<(String, String)>,
}

impl Controller {
    /// Rotates `node`'s pair and has every storage node where it holds a publication take the
    /// new one. FAILED_PRECONDITION when it holds none (nothing uses its pair: its first
    /// publication makes one).
    pub async fn rotate_node_credentials(&self, node: &str) -> Result<Rotation, ControllerError> {
        let mut host_nqns = BTreeSet::new();
        let mut agents = BTreeSet::new();
        for v in self.store.list_volumes().await? {
            let status = v.status_or_default();
            for p in status.published_nodes.iter().filter(|p| p.node == node) {
                host_nqns.insert(p.host_nqn.clone());
                agents.insert(v.spec.agent.clone());
            }
        }
        let host_nqn = match host_nqns.len() {
            1 => host_nqns.pop_first().unwrap_or_default(),
            0 => {
                return Err(ControllerError::NodeNotFound(
                    node.to_owned(),
                    "it holds no publication, so no storage node holds its secrets".into(),
                ));
            }
            _ => {
                return Err(ControllerError::InvalidArgument(format!(
                    "node {node} holds publications under several host NQNs; unpublish the \
                     stale ones first"
                )));
            }
        };
        self.store.rotate_node_credentials(node, &host_nqn).await?;
        tracing::info!(%node, agents = agents.len(), "DH-HMAC-CHAP pair rotated; resyncing its storage nodes");
        let mut rotation = Rotation::default();
        for name in agents {
            let result = async {
                let agent = self.store.get_agent(&name).await?.ok_or_else(|| {
                    ControllerError::Unreachable(format!("PillarAgent {name} does not exist"))
                })?;
                let response = self.resync_agent(&agent).await?;
                match response.results.iter().find(|r| !r.ok) {
                    Some(r) => Err(ControllerError::Unreachable(format!(
                        "volume {}: {}",
                        r.volume_id, r.message
                    ))),
                    None => Ok(()),
                }
            }
            .await;
            match result {
                Ok(()) => rotation.agents.push(name),
                Err(e) => {
                    tracing::warn!(%node, agent = %name, error = %describe(&e), "the storage node keeps the old pair until its next resync");
                    rotation.failed.push((name, describe(&e)));
                }
            }
        }
        Ok(rotation)
    }
}
