//! ControllerPublishVolume and ControllerUnpublishVolume: who may use a volume.
//!
//! - [`decide_publication`] is the publish table (W2), a pure function of the recorded
//!   publications and the wanted one. It runs inside the compare-and-swap that records the
//!   publication (W1, W8): a record another replica wrote in between makes the write conflict
//!   and the table is consulted again on the new records.
//! - The agent is asked to grant only after the record is written (W1). A record is removed
//!   only after the agent confirmed the revoke (W4); a failed revoke or a missing PillarAgent
//!   keeps it (C2).

use std::collections::HashMap;

use pillar_agent_api::v1 as agent_api;
use pillar_nvmet::VolumeId;
use pillar_state::crd::{
    AccessMode, PillarAgent, PillarProtocol, PillarVolumeStateStatus, PublishedNode,
};

use super::Controller;
use super::error::{ControllerError, agent_err};
use super::record::token;
use super::request::{self, VolumeRef};
use crate::agents::Client;
use crate::{context, csi};

/// What the publish table decides for a wanted publication.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// No record for this node: record it, then grant.
    Record,
    /// Recorded exactly so already (a retry): grant again, which is idempotent.
    AlreadyRecorded,
    /// This node's publication is being revoked: ABORTED, retry once it is gone.
    Revoking { node: String },
    /// This node holds the volume with another mode, readonly flag or host: ALREADY_EXISTS.
    PublishedDifferently { node: String },
    /// Another node holds the volume and the two cannot share it: FAILED_PRECONDITION.
    PublishedElsewhere { node: String, mode: AccessMode },
}

/// Whether a publication may coexist with publications on other nodes: only read-only access
/// with a multi-node mode (ROX, or a read-only MULTI_NODE_SINGLE_WRITER) is shared.
fn shareable(p: &PublishedNode) -> bool {
    p.access_mode.is_multi_node()
        && (p.readonly || p.access_mode == AccessMode::MultiNodeReaderOnly)
}

/// The publish table (W2): `wanted` against every publication recorded in `status`, in record
/// order; the first record that refuses it decides.
pub fn decide_publication(status: &PillarVolumeStateStatus, wanted: &PublishedNode) -> Decision {
    let mut recorded = false;
    for p in &status.published_nodes {
        if p.node == wanted.node {
            if p.revoking {
                return Decision::Revoking {
                    node: p.node.clone(),
                };
            }
            if p.access_mode != wanted.access_mode
                || p.readonly != wanted.readonly
                || p.host_nqn != wanted.host_nqn
            {
                return Decision::PublishedDifferently {
                    node: p.node.clone(),
                };
            }
            recorded = true;
        } else if !(shareable(p) && shareable(wanted)) {
            return Decision::PublishedElsewhere {
                node: p.node.clone(),
                mode: p.access_mode,
            };
        }
    }
    if recorded {
        Decision::AlreadyRecorded
    } else {
        Decision::Record
    }
}

/// Applies a decision to the status being written, or refuses with the CSI error.
fn record(
    decision: Decision,
    volume: &str,
    wanted: &PublishedNode,
    status: &mut PillarVolumeStateStatus,
) -> Result<(), ControllerError> {
    match decision {
        Decision::Record => status.published_nodes.push(wanted.clone()),
        Decision::AlreadyRecorded => {}
        Decision::Revoking { node } => {
            return Err(ControllerError::Revoking {
                volume: volume.to_owned(),
                node,
            });
        }
        Decision::PublishedDifferently { node } => {
            return Err(ControllerError::PublishedDifferently {
                volume: volume.to_owned(),
                node,
            });
        }
        Decision::PublishedElsewhere { node, mode } => {
            return Err(ControllerError::PublishedElsewhere {
                volume: volume.to_owned(),
                node,
                mode,
                requested: wanted.node.clone(),
            });
        }
    }
    Ok(())
}

impl Controller {
    /// ControllerPublishVolume.
    pub async fn publish(
        &self,
        req: csi::ControllerPublishVolumeRequest,
    ) -> Result<csi::ControllerPublishVolumeResponse, ControllerError> {
        let req = request::publish(&req)?;
        let volume = req.volume.existing()?;
        let node = req
            .node
            .map_err(|reason| ControllerError::NodeNotFound(req.node_id.clone(), reason))?;
        let name = volume.to_string();
        let _lock = self.locks.lock(name.clone()).await;
        let state = self
            .store
            .get_volume(&name)
            .await?
            .ok_or_else(|| ControllerError::VolumeNotFound(name.clone()))?;
        let volume_mode = req.capability.volume_mode();
        if state.spec.volume_mode != volume_mode {
            return Err(ControllerError::InvalidArgument(format!(
                "volume {name} is {:?}, the capability asks for {volume_mode:?}",
                state.spec.volume_mode
            )));
        }
        let uid = state.metadata.uid.clone().unwrap_or_default();
        // The agent must exist before anything is recorded (C1: nothing recorded that cannot be
        // undone while the node is gone).
        let (agent, client) = self.agent_of(&state).await?;
        let protocol = self.protocol_of(&state).await?;
        let wanted = PublishedNode {
            node: node.node.clone(),
            host_nqn: node.host_nqn.to_string(),
            access_mode: req.capability.mode,
            readonly: req.readonly,
            revoking: false,
        };
        // W1, W2: decided and recorded in one compare-and-swap that also bumps the generation
        // for the grant's token.
        let (_, generation) = self
            .update_status(&name, &uid, |_, status| {
                record(decide_publication(status, &wanted), &name, &wanted, status)?;
                status.publication_generation += 1;
                Ok(status.publication_generation)
            })
            .await?;
        let t = token(&uid, generation);
        self.with_resync(&agent, &client, |mut c| {
            let r = agent_api::GrantInitiatorRequest {
                token: t.clone(),
                volume_id: name.clone(),
                host_nqn: wanted.host_nqn.clone(),
            };
            async move { c.grant_initiator(r).await }
        })
        .await
        .map_err(agent_err("GrantInitiator", &name))?;
        let mut publish_context = publish_context(&volume, &agent, &protocol);
        if let Some(device) = self.local_device(&client, &state).await? {
            publish_context.insert(context::LOCAL_DEVICE.to_owned(), device);
        }
        tracing::info!(volume = %name, node = %wanted.node, mode = ?wanted.access_mode, readonly = wanted.readonly, "published");
        Ok(csi::ControllerPublishVolumeResponse { publish_context })
    }

    /// ControllerUnpublishVolume. An empty node ID unpublishes from every node.
    pub async fn unpublish(
        &self,
        req: csi::ControllerUnpublishVolumeRequest,
    ) -> Result<csi::ControllerUnpublishVolumeResponse, ControllerError> {
        let req = request::unpublish(&req)?;
        let VolumeRef::Pillar(volume) = req.volume else {
            return Ok(csi::ControllerUnpublishVolumeResponse {});
        };
        let name = volume.to_string();
        let _lock = self.locks.lock(name.clone()).await;
        let Some(state) = self.store.get_volume(&name).await? else {
            return Ok(csi::ControllerUnpublishVolumeResponse {});
        };
        let uid = state.metadata.uid.clone().unwrap_or_default();
        let targets: Vec<PublishedNode> = state
            .status_or_default()
            .published_nodes
            .into_iter()
            .filter(|p| req.node.as_ref().is_none_or(|n| *n == p.node))
            .collect();
        if targets.is_empty() {
            return Ok(csi::ControllerUnpublishVolumeResponse {});
        }
        // W4: a missing agent keeps every record.
        let (agent, client) = self.agent_of(&state).await?;
        for target in targets {
            self.revoke(&name, &uid, &agent, &client, &target).await?;
        }
        Ok(csi::ControllerUnpublishVolumeResponse {})
    }

    /// Revokes one publication: marked revoking with the revoke's token in one write, revoked
    /// at the agent, and removed only once the agent confirmed (W4).
    async fn revoke(
        &self,
        name: &str,
        uid: &str,
        agent: &PillarAgent,
        client: &Client,
        target: &PublishedNode,
    ) -> Result<(), ControllerError> {
        // Publishes to this node get ABORTED from now on.
        let (_, generation) = self
            .update_status(name, uid, |_, status| {
                for p in &mut status.published_nodes {
                    if p.node == target.node {
                        p.revoking = true;
                    }
                }
                status.publication_generation += 1;
                Ok(status.publication_generation)
            })
            .await?;
        let t = token(uid, generation);
        self.with_resync(agent, client, |mut c| {
            let r = agent_api::RevokeInitiatorRequest {
                token: t.clone(),
                volume_id: name.to_owned(),
                host_nqn: target.host_nqn.clone(),
            };
            async move { c.revoke_initiator(r).await }
        })
        .await
        .map_err(agent_err("RevokeInitiator", name))?;
        // Confirmed: only now does the record go.
        self.update_status(name, uid, |_, status| {
            status.published_nodes.retain(|p| p.node != target.node);
            Ok(())
        })
        .await?;
        tracing::info!(volume = %name, node = %target.node, "unpublished");
        Ok(())
    }
}

/// What the node plugin needs to attach: the export's address and the host's connect settings.
fn publish_context(
    volume: &VolumeId,
    agent: &PillarAgent,
    protocol: &PillarProtocol,
) -> HashMap<String, String> {
    let nvme = &protocol.spec.nvme_tcp;
    [
        (context::NQN, volume.subsystem_nqn().to_string()),
        (context::TRADDR, agent.spec.nvme_address.clone()),
        (context::TRSVCID, nvme.port.to_string()),
        (context::CTRL_LOSS_TMO, nvme.ctrl_loss_tmo.to_string()),
        (context::RECONNECT_DELAY, nvme.reconnect_delay.to_string()),
        (context::FS_TYPE, nvme.fs_type.as_str().to_owned()),
        (
            context::MKFS_OPTIONS,
            serde_json::to_string(&nvme.mkfs_options).unwrap_or_else(|_| "[]".into()),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

#[cfg(test)]
mod tests {
    //! The publish table, row by row (W2).

    use super::*;

    const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000000a";
    const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000000b";

    fn p(node: &str, mode: AccessMode, readonly: bool) -> PublishedNode {
        PublishedNode {
            node: node.into(),
            host_nqn: if node == "a" { HOST_A } else { HOST_B }.into(),
            access_mode: mode,
            readonly,
            revoking: false,
        }
    }

    fn status(records: &[PublishedNode]) -> PillarVolumeStateStatus {
        PillarVolumeStateStatus {
            published_nodes: records.to_vec(),
            ..Default::default()
        }
    }

    use AccessMode::{
        MultiNodeReaderOnly as Rox, MultiNodeSingleWriter as Mnsw, SingleNodeReaderOnly as Snro,
        SingleNodeSingleWriter as Rwop, SingleNodeWriter as Rwo,
    };

    fn elsewhere(mode: AccessMode) -> Decision {
        Decision::PublishedElsewhere {
            node: "a".into(),
            mode,
        }
    }

    // proves W2
    #[test]
    fn nothing_recorded_records() {
        assert_eq!(
            decide_publication(&status(&[]), &p("a", Rwo, false)),
            Decision::Record
        );
    }

    // proves W2
    #[test]
    fn the_same_publication_again_is_a_retry() {
        let a = p("a", Rwo, false);
        assert_eq!(
            decide_publication(&status(std::slice::from_ref(&a)), &a),
            Decision::AlreadyRecorded
        );
    }

    // proves W2
    #[test]
    fn a_node_being_revoked_is_aborted() {
        let mut a = p("a", Rwo, false);
        a.revoking = true;
        assert_eq!(
            decide_publication(&status(&[a]), &p("a", Rwo, false)),
            Decision::Revoking { node: "a".into() }
        );
    }

    // proves W2
    #[test]
    fn the_same_node_with_another_mode_flag_or_host_already_exists() {
        let recorded = status(&[p("a", Rwo, false)]);
        let mut other_host = p("a", Rwo, false);
        other_host.host_nqn = HOST_B.into();
        for wanted in [p("a", Rwop, false), p("a", Rwo, true), other_host] {
            assert_eq!(
                decide_publication(&recorded, &wanted),
                Decision::PublishedDifferently { node: "a".into() },
                "{wanted:?}"
            );
        }
    }

    // proves W2
    #[test]
    fn a_single_node_mode_elsewhere_is_refused_naming_the_node() {
        for (held, wanted) in [
            (Rwo, Rwo),
            (Rwo, Rox),
            (Rwop, Rox),
            (Snro, Snro),
            (Snro, Rox),
        ] {
            assert_eq!(
                decide_publication(&status(&[p("a", held, false)]), &p("b", wanted, false)),
                elsewhere(held),
                "{held:?} on a, {wanted:?} on b"
            );
        }
    }

    // proves W2
    #[test]
    fn read_only_multi_node_publications_share() {
        for (held, wanted) in [
            (p("a", Rox, false), p("b", Rox, false)),
            (p("a", Rox, true), p("b", Rox, false)),
            (p("a", Mnsw, true), p("b", Mnsw, true)),
            (p("a", Mnsw, true), p("b", Rox, false)),
        ] {
            assert_eq!(
                decide_publication(&status(std::slice::from_ref(&held)), &wanted),
                Decision::Record,
                "{held:?} / {wanted:?}"
            );
        }
    }

    // proves W2
    #[test]
    fn a_writer_never_shares() {
        assert_eq!(
            decide_publication(&status(&[p("a", Mnsw, false)]), &p("b", Rox, false)),
            elsewhere(Mnsw)
        );
        assert_eq!(
            decide_publication(&status(&[p("a", Rox, false)]), &p("b", Mnsw, false)),
            elsewhere(Rox)
        );
    }

    // proves W2, W4: a publication being revoked still holds the volume against other nodes
    // until the agent confirmed the revoke.
    #[test]
    fn a_revoking_record_still_blocks_other_nodes() {
        let mut a = p("a", Rwo, false);
        a.revoking = true;
        assert_eq!(
            decide_publication(&status(&[a]), &p("b", Rwo, false)),
            elsewhere(Rwo)
        );
    }
}
