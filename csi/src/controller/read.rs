//! The controller calls that only read: ValidateVolumeCapabilities, ListVolumes,
//! ControllerGetVolume and GetCapacity.

use std::collections::HashMap;

use pillar_agent_api::v1 as agent_api;
use pillar_state::crd::{PillarAgent, PillarVolumeState};

use super::error::{ControllerError, agent_err};
use super::{Controller, params, request};
use crate::csi;
use crate::node_id::NodeId;

fn csi_volume(v: &PillarVolumeState) -> csi::Volume {
    csi::Volume {
        capacity_bytes: i64::try_from(v.spec.size_bytes).unwrap_or(i64::MAX),
        volume_id: v.spec.volume_id.clone(),
        volume_context: HashMap::new(),
        content_source: v
            .spec
            .content_source
            .as_ref()
            .map(super::provision::csi_source),
        accessible_topology: super::topology::accessible(&v.spec.topology),
    }
}

/// The CSI node IDs the volume is recorded as published to.
fn node_ids(v: &PillarVolumeState) -> Vec<String> {
    v.status_or_default()
        .published_nodes
        .iter()
        .filter_map(|p| {
            NodeId {
                node: p.node.clone(),
                host_nqn: p.host_nqn.parse().ok()?,
            }
            .format()
            .ok()
        })
        .collect()
}

impl Controller {
    async fn existing_volume(
        &self,
        volume: request::VolumeRef,
    ) -> Result<PillarVolumeState, ControllerError> {
        let name = volume.existing()?.to_string();
        self.store
            .get_volume(&name)
            .await?
            .ok_or(ControllerError::VolumeNotFound(name))
    }

    /// ValidateVolumeCapabilities.
    pub async fn validate(
        &self,
        req: csi::ValidateVolumeCapabilitiesRequest,
    ) -> Result<csi::ValidateVolumeCapabilitiesResponse, ControllerError> {
        let (volume, caps) = request::validate(&req)?;
        let state = self.existing_volume(volume).await?;
        let unsupported = caps.into_iter().find_map(|c| match c {
            Err(e) => Some(e),
            Ok(c) if c.volume_mode() != state.spec.volume_mode => {
                Some(format!("volume is {:?}", state.spec.volume_mode))
            }
            Ok(_) => None,
        });
        Ok(match unsupported {
            Some(message) => csi::ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message,
            },
            None => csi::ValidateVolumeCapabilitiesResponse {
                confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                    volume_context: req.volume_context,
                    volume_capabilities: req.volume_capabilities,
                    parameters: req.parameters,
                    mutable_parameters: HashMap::new(),
                }),
                message: String::new(),
            },
        })
    }

    /// ListVolumes, with the nodes each volume is published to.
    pub async fn list(
        &self,
        req: csi::ListVolumesRequest,
    ) -> Result<csi::ListVolumesResponse, ControllerError> {
        let page = request::list(&req)?;
        let mut volumes = self.store.list_volumes().await?;
        let (volumes, next_token) = request::paged(&mut volumes, |v| &v.spec.volume_id, &page);
        let entries = volumes
            .iter()
            .map(|v| csi::list_volumes_response::Entry {
                volume: Some(csi_volume(v)),
                status: Some(csi::list_volumes_response::VolumeStatus {
                    published_node_ids: node_ids(v),
                    volume_condition: None,
                }),
            })
            .collect();
        Ok(csi::ListVolumesResponse {
            entries,
            next_token,
        })
    }

    /// ControllerGetVolume: abnormal while an unpublish waits for the storage node's confirmation.
    pub async fn get(
        &self,
        req: csi::ControllerGetVolumeRequest,
    ) -> Result<csi::ControllerGetVolumeResponse, ControllerError> {
        let v = self.existing_volume(request::get(&req)?).await?;
        let revoking: Vec<String> = v
            .status_or_default()
            .published_nodes
            .iter()
            .filter(|p| p.revoking)
            .map(|p| p.node.clone())
            .collect();
        let condition = csi::VolumeCondition {
            abnormal: !revoking.is_empty(),
            message: if revoking.is_empty() {
                "ok".into()
            } else {
                format!("unpublish from {revoking:?} not yet confirmed by the storage node")
            },
        };
        Ok(csi::ControllerGetVolumeResponse {
            volume: Some(csi_volume(&v)),
            status: Some(csi::controller_get_volume_response::VolumeStatus {
                published_node_ids: node_ids(&v),
                volume_condition: Some(condition),
            }),
        })
    }

    /// GetCapacity, for the StorageClass's parameters and, when given, one topology segment
    /// (external-provisioner's capacity tracking asks once per segment): what CreateVolume
    /// with the same parameters could place there.
    ///
    /// - `pillar.io/agent` named: that agent's pool (the named one, or its only one), or
    ///   nothing when the segment cannot reach it;
    /// - only `pillar.io/pool` named: that pool on every agent reachable from the segment that
    ///   has it, summed (CreateVolume places such a class by topology among them); a segment
    ///   where none has it has nothing;
    /// - neither: every pool of every reachable agent.
    pub async fn capacity(
        &self,
        req: csi::GetCapacityRequest,
    ) -> Result<csi::GetCapacityResponse, ControllerError> {
        let reachable = |a: &PillarAgent| {
            req.accessible_topology
                .as_ref()
                .is_none_or(|t| super::topology::reachable_from(&a.spec.topology, &t.segments))
        };
        let targets: Vec<(PillarAgent, String)> = if req.parameters.contains_key(params::AGENT) {
            let (agent, pool) = self.pick_agent(&req.parameters, None).await?;
            if reachable(&agent) {
                vec![(agent, pool)]
            } else {
                Vec::new()
            }
        } else {
            let named = req.parameters.get(params::POOL);
            self.store
                .list_agents()
                .await?
                .into_iter()
                .filter(|a| reachable(a))
                .flat_map(|a| {
                    let pools: Vec<String> = a
                        .spec
                        .pools
                        .iter()
                        .map(|p| p.name.clone())
                        .filter(|p| named.is_none_or(|n| n == p))
                        .collect();
                    pools.into_iter().map(move |p| (a.clone(), p))
                })
                .collect()
        };
        let mut available = 0u64;
        for (agent, pool) in targets {
            let mut c = self.agents.client(&agent).await?;
            let cap = c
                .get_capacity(agent_api::GetCapacityRequest { pool })
                .await
                .map_err(agent_err("GetCapacity", ""))?
                .into_inner();
            available = available.saturating_add(cap.available_bytes);
        }
        Ok(csi::GetCapacityResponse {
            available_capacity: i64::try_from(available).unwrap_or(i64::MAX),
            maximum_volume_size: None,
            minimum_volume_size: None,
        })
    }
}
