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
    AccessMode, PillarAgent, PillarProtocol, PillarVolumeState, PillarVolumeStateStatus,
    PublishedNode,
};

use super::Controller;
use super::agent::VolumeAgent;
use super::condition::{
    Enforced, clear_acl_condition_if_unpublished, enforced, set_revoking_condition,
};
use super::error::{ControllerError, describe};
use super::record::{Write, token};
use super::request::{self, VolumeRef};
use crate::{context, csi};

/// What the publish table decides for a wanted publication.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// No record for this node: record it, then grant.
    Record,
    /// Recorded exactly so already (a retry): grant again, which is idempotent.
    AlreadyRecorded,
    /// The volume is being deleted: ABORTED.
    Deleting,
    /// This node's publication is being revoked: ABORTED, retry once it is gone.
    Revoking { node: String },
    /// This node holds the volume with another mode, readonly flag or host: ALREADY_EXISTS.
    PublishedDifferently { node: String },
    /// Another node holds the volume and the two cannot share it: FAILED_PRECONDITION.
    /// `node_id` is the CSI node ID of the publication that refuses (`<node>/<host-nqn>`), as
    /// the spec asks the error to name it.
    PublishedElsewhere { node_id: String, mode: AccessMode },
}

/// Whether a publication may coexist with publications on other nodes: only read-only access
/// with a multi-node mode (ROX, or a read-only MULTI_NODE_SINGLE_WRITER) is shared.
fn shareable(p: &PublishedNode) -> bool {
    p.access_mode.is_multi_node()
        && (p.readonly || p.access_mode == AccessMode::MultiNodeReaderOnly)
}

/// Whether a publication gives read access only: every node of it stages read-only (N5).
pub fn read_only(p: &PublishedNode) -> bool {
    p.readonly
        || matches!(
            p.access_mode,
            AccessMode::MultiNodeReaderOnly | AccessMode::SingleNodeReaderOnly
        )
}

/// The publish table (W2): `wanted` against every publication recorded in `status`, in record
/// order; the first record that refuses it decides. A volume being deleted takes none (W5).
pub fn decide_publication(status: &PillarVolumeStateStatus, wanted: &PublishedNode) -> Decision {
    if status.deleting {
        return Decision::Deleting;
    }
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
                node_id: format!("{}/{}", p.node, p.host_nqn),
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

/// Applies a decision to the status being written (bumping the generation for the grant's
/// token), or refuses with the CSI error. Returns the grant's generation.
fn record(
    volume: &str,
    wanted: &PublishedNode,
    status: &mut PillarVolumeStateStatus,
) -> Result<u64, ControllerError> {
    let generation = status.publication_generation + 1;
    match decide_publication(status, wanted) {
        Decision::Record => status.published_nodes.push(PublishedNode {
            recorded_generation: generation,
            ..wanted.clone()
        }),
        Decision::AlreadyRecorded => {}
        Decision::Deleting => {
            return Err(ControllerError::Deleting {
                volume: volume.to_owned(),
            });
        }
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
        Decision::PublishedElsewhere { node_id, mode } => {
            return Err(ControllerError::PublishedElsewhere {
                volume: volume.to_owned(),
                node_id,
                mode,
                requested: format!("{}/{}", wanted.node, wanted.host_nqn),
            });
        }
    }
    status.publication_generation = generation;
    Ok(generation)
}

/// The identity of one publication: an unpublish acts on the publication it read, never on a
/// later publication of the same node (W8).
fn same_publication(a: &PublishedNode, b: &PublishedNode) -> bool {
    a.node == b.node && a.host_nqn == b.host_nqn && a.recorded_generation == b.recorded_generation
}

/// The precondition of a grant sent again after a resync: the publication it admits is still
/// recorded as written (same node, host and generation), not being revoked, and the volume is
/// not being deleted. Otherwise another replica withdrew it and the grant must not re-admit it.
fn still_admitted(
    current: &PillarVolumeState,
    recorded: &PublishedNode,
) -> Result<(), ControllerError> {
    let status = current.status_or_default();
    let admitted = !status.deleting
        && status
            .published_nodes
            .iter()
            .any(|p| same_publication(p, recorded) && !p.revoking);
    if admitted {
        Ok(())
    } else {
        Err(ControllerError::PublicationWithdrawn {
            volume: current.spec.volume_id.clone(),
            node: recorded.node.clone(),
        })
    }
}

/// The precondition of a revoke sent again after a resync: the publication it revokes is still
/// recorded. Once gone, a newer token would revoke whatever publication of the host came after.
fn still_recorded(
    current: &PillarVolumeState,
    publication: &PublishedNode,
) -> Result<(), ControllerError> {
    let status = current.status_or_default();
    if status
        .published_nodes
        .iter()
        .any(|p| same_publication(p, publication))
    {
        Ok(())
    } else {
        Err(ControllerError::PublicationWithdrawn {
            volume: current.spec.volume_id.clone(),
            node: publication.node.clone(),
        })
    }
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
        // The agent must exist before anything is recorded (C1: nothing recorded that cannot be
        // undone while the node is gone).
        let target = self.volume_agent(&state).await?;
        let protocol = self.protocol_of(&state).await?;
        let wanted = PublishedNode {
            node: node.node.clone(),
            host_nqn: node.host_nqn.to_string(),
            access_mode: req.capability.mode,
            readonly: req.readonly,
            revoking: false,
            recorded_generation: 0,
        };
        // W1, W2, W8: decided and recorded in one compare-and-swap that also bumps the
        // generation for the agent call's token; the same read says what the storage node was
        // last confirmed to enforce (W6).
        let (_, (generation, enforced)) = self
            .update_status(&name, &target.uid, |_, status| {
                let enforced = enforced(status);
                Ok((record(&name, &wanted, status)?, enforced))
            })
            .await?;
        let recorded = PublishedNode {
            recorded_generation: generation,
            ..wanted.clone()
        };
        self.admit(&target, &protocol, &recorded, enforced).await?;
        let mut publish_context = publish_context(&volume, &target.agent, &protocol);
        if read_only(&wanted) {
            publish_context.insert(context::READ_ONLY.to_owned(), "true".to_owned());
        }
        if let Some(device) = self.local_device(&target.client, &state).await? {
            publish_context.insert(context::LOCAL_DEVICE.to_owned(), device);
        }
        publish_context.insert(
            context::AUTH.to_owned(),
            if super::agent::requires_auth(&protocol) {
                "dhchap"
            } else {
                "none"
            }
            .to_owned(),
        );
        if super::agent::requires_tls(&protocol) {
            publish_context.insert(context::TLS.to_owned(), "required".to_owned());
        }
        if !protocol.spec.nvme_tcp.acl {
            tracing::warn!(volume = %name, protocol = %state.spec.protocol, "published with acl: false: any host that reaches the port can connect, and unpublishing cannot keep a lost node out");
        } else if !super::agent::requires_auth(&protocol) {
            tracing::warn!(volume = %name, protocol = %state.spec.protocol, "published with auth: none: any host presenting a published node's NQN is admitted, without proving a secret (W10)");
        }
        tracing::info!(volume = %name, node = %wanted.node, mode = ?wanted.access_mode, readonly = wanted.readonly, "published");
        Ok(csi::ControllerPublishVolumeResponse { publish_context })
    }

    /// Has the agent admit the host of `recorded` (written with its generation). When the
    /// storage node was last confirmed to enforce the protocol's `acl` and `auth`, a grant does
    /// it (a grant changes only the ACL and the host's keys, never the mode). Otherwise (the
    /// protocol's `acl` or `auth` was edited, or the mode is not known: the first publication
    /// since the last was removed) the subsystem is exported again from the record with the
    /// protocol's settings, which the agent applies (an export closing a subsystem that
    /// admitted any host cuts its live connections, W7; one requiring authentication sets every
    /// admitted host's keys, W10), and then `AclDisabled` and `AuthDisabled` record what it
    /// enforces: the conditions never claim an ACL or an authentication the target does not
    /// hold.
    async fn admit(
        &self,
        target: &VolumeAgent,
        protocol: &PillarProtocol,
        recorded: &PublishedNode,
        enforced: Option<Enforced>,
    ) -> Result<(), ControllerError> {
        let name = &target.name;
        let mode = Enforced::of(protocol);
        let still_admitted = |current: &PillarVolumeState| still_admitted(current, recorded);
        let token = token(&target.uid, recorded.recorded_generation);
        if enforced == Some(mode) {
            let credentials = if mode.auth {
                Some(
                    super::agent::host_credentials(
                        &*self.store,
                        &recorded.node,
                        &recorded.host_nqn,
                    )
                    .await?,
                )
            } else {
                None
            };
            self.call_agent(
                target,
                "GrantInitiator",
                token,
                &still_admitted,
                |mut c, token| {
                    let r = agent_api::GrantInitiatorRequest {
                        token,
                        volume_id: name.clone(),
                        host_nqn: recorded.host_nqn.clone(),
                        credentials: credentials.clone(),
                    };
                    async move { c.grant_initiator(r).await }
                },
            )
            .await?;
            return Ok(());
        }
        if let Some(was) = enforced {
            tracing::info!(volume = %name, was_acl = was.acl, was_auth = was.auth, acl = mode.acl, auth = mode.auth, "the protocol's acl or auth changed: exported again");
        }
        self.export(target, protocol, token, &still_admitted)
            .await?;
        let protocol_name = protocol.metadata.name.clone().unwrap_or_default();
        self.record_enforced(name, &target.uid, target.pv.clone(), &protocol_name, mode)
            .await
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
        let agent = self.volume_agent(&state).await?;
        for publication in targets {
            self.revoke(&agent, &publication).await?;
        }
        Ok(csi::ControllerUnpublishVolumeResponse {})
    }

    /// Revokes one publication, the one read (W8): marked revoking with the revoke's token in
    /// one write, revoked at the agent, and removed only once the agent confirmed (W4). When the
    /// record is no longer the one read (another replica unpublished it, and maybe published
    /// the node again), there is nothing left of this publication to revoke.
    async fn revoke(
        &self,
        target: &VolumeAgent,
        publication: &PublishedNode,
    ) -> Result<(), ControllerError> {
        let (name, uid) = (&target.name, &target.uid);
        let Some(generation) = self.mark_revoking(target, publication).await? else {
            tracing::info!(volume = %name, node = %publication.node, "publication already gone");
            return Ok(());
        };
        let still_recorded = |current: &PillarVolumeState| still_recorded(current, publication);
        let revoked = self
            .call_agent(
                target,
                "RevokeInitiator",
                token(uid, generation),
                &still_recorded,
                |mut c, token| {
                    let r = agent_api::RevokeInitiatorRequest {
                        token,
                        volume_id: name.clone(),
                        host_nqn: publication.host_nqn.clone(),
                    };
                    async move { c.revoke_initiator(r).await }
                },
            )
            .await;
        match revoked {
            Ok(_) => {}
            // Another replica confirmed this revoke and removed the record (W4) while the
            // storage node was being resynced: nothing of this publication is left.
            Err(ControllerError::PublicationWithdrawn { .. }) => {
                tracing::info!(volume = %name, node = %publication.node, "publication already gone");
                return Ok(());
            }
            Err(e) => {
                self.warn_revoke_failed(
                    name,
                    uid,
                    target.pv.clone(),
                    &publication.node,
                    &describe(&e),
                )
                .await;
                return Err(e);
            }
        }
        // Confirmed: only now does the record go, and only this publication's.
        self.remove_publication(target, publication).await?;
        tracing::info!(volume = %name, node = %publication.node, "unpublished");
        Ok(())
    }

    /// Marks `publication` revoking, with a new publication generation (the revoke's token), in
    /// one write: publishes to this node get ABORTED from then on. `None` when the record no
    /// longer holds the publication read.
    async fn mark_revoking(
        &self,
        target: &VolumeAgent,
        publication: &PublishedNode,
    ) -> Result<Option<u64>, ControllerError> {
        let (name, uid) = (&target.name, &target.uid);
        let at = self.condition_time();
        let (_, generation) = self
            .compare_and_swap(name, uid, |current| {
                let mut status = current.status_or_default();
                let Some(p) = status
                    .published_nodes
                    .iter_mut()
                    .find(|p| same_publication(p, publication))
                else {
                    return Ok((Write::Nothing, None));
                };
                p.revoking = true;
                status.publication_generation += 1;
                let generation = status.publication_generation;
                set_revoking_condition(&mut status, current.metadata.generation, &at);
                Ok((Write::Status(status), Some(generation)))
            })
            .await?;
        Ok(generation)
    }

    /// Removes `publication` from the record once the agent confirmed its revoke (W4), and
    /// only it. The last one going clears AclDisabled in the same write (W6, W7).
    async fn remove_publication(
        &self,
        target: &VolumeAgent,
        publication: &PublishedNode,
    ) -> Result<(), ControllerError> {
        let (name, uid) = (&target.name, &target.uid);
        let at = self.condition_time();
        self.compare_and_swap(name, uid, |current| {
            let mut status = current.status_or_default();
            let before = status.published_nodes.len();
            status
                .published_nodes
                .retain(|p| !same_publication(p, publication));
            let write = if status.published_nodes.len() == before {
                Write::Nothing
            } else {
                clear_acl_condition_if_unpublished(&mut status, current.metadata.generation, &at);
                set_revoking_condition(&mut status, current.metadata.generation, &at);
                Write::Status(status)
            };
            Ok((write, ()))
        })
        .await?;
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
            recorded_generation: 0,
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
            node_id: format!("a/{HOST_A}"),
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
    fn a_single_node_mode_elsewhere_is_refused_naming_the_node_id() {
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

    // proves W5: a volume being deleted takes no publication.
    #[test]
    fn a_volume_being_deleted_is_aborted() {
        let mut s = status(&[]);
        s.deleting = true;
        assert_eq!(
            decide_publication(&s, &p("a", Rwo, false)),
            Decision::Deleting
        );
    }

    // proves N5: every node of a read-only publication stages read-only.
    #[test]
    fn read_only_publications() {
        assert!(read_only(&p("a", Rox, false)));
        assert!(read_only(&p("a", Snro, false)));
        assert!(read_only(&p("a", Mnsw, true)));
        assert!(read_only(&p("a", Rwo, true)));
        assert!(!read_only(&p("a", Mnsw, false)));
        assert!(!read_only(&p("a", Rwo, false)));
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
