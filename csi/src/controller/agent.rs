//! Reaching a volume's agent: its PillarAgent and protocol records, the export request built
//! from a volume's record, and the resync an agent asks for after a start (C3).

use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::{ErrorReason, reason_of};
use pillar_state::crd::{PillarAgent, PillarProtocol, PillarVolumeState};
use tonic::Status;

use super::Controller;
use super::error::{ControllerError, agent_err, describe};
use crate::agents::Client;

impl Controller {
    /// The volume's PillarAgent and a client for it; a missing PillarAgent fails closed (C1, W4).
    pub(super) async fn agent_of(
        &self,
        volume: &PillarVolumeState,
    ) -> Result<(PillarAgent, Client), ControllerError> {
        let name = &volume.spec.agent;
        let agent =
            self.store
                .get_agent(name)
                .await?
                .ok_or_else(|| ControllerError::AgentMissing {
                    volume: volume.spec.volume_id.clone(),
                    agent: name.clone(),
                })?;
        let client = self.agents.client(&agent).await?;
        Ok((agent, client))
    }

    /// The volume's PillarProtocol.
    pub(super) async fn protocol_of(
        &self,
        volume: &PillarVolumeState,
    ) -> Result<PillarProtocol, ControllerError> {
        self.store
            .get_protocol(&volume.spec.protocol)
            .await?
            .ok_or_else(|| ControllerError::ProtocolMissing(volume.spec.protocol.clone()))
    }

    /// Runs an agent call; when the agent says it waits for a resync, resyncs it and retries
    /// once.
    pub(super) async fn with_resync<T, F, Fut>(
        &self,
        agent: &PillarAgent,
        client: &Client,
        mut call: F,
    ) -> Result<T, Status>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        match call(client.clone()).await {
            Err(s) if reason_of(&s) == ErrorReason::WaitingForResync => {
                if let Err(e) = self.resync_agent(agent).await {
                    return Err(Status::unavailable(format!(
                        "agent waits for a resync, and the resync failed: {}",
                        describe(&e)
                    )));
                }
                call(client.clone()).await
            }
            other => other,
        }
    }

    /// With an agent on the configfs test double no host can connect over NVMe/TCP; the
    /// single-machine mode hands the node the local device instead, and says so.
    pub(super) async fn local_device(
        &self,
        client: &Client,
        state: &PillarVolumeState,
    ) -> Result<Option<String>, ControllerError> {
        let mut c = client.clone();
        let caps = c
            .get_capabilities(agent_api::GetCapabilitiesRequest {})
            .await
            .map_err(agent_err("GetCapabilities", &state.spec.volume_id))?
            .into_inner();
        if caps.target != "test-double" {
            return Ok(None);
        }
        let volumes = c
            .list_volumes(agent_api::ListVolumesRequest {
                pool: state.spec.pool.clone(),
            })
            .await
            .map_err(agent_err("ListVolumes", &state.spec.volume_id))?
            .into_inner()
            .volumes;
        Ok(volumes
            .into_iter()
            .find(|v| v.volume_id == state.spec.volume_id)
            .map(|v| v.device_path))
    }
}

/// The export of `volume` as its record says: the ACL admits the recorded publications that
/// are not being revoked.
pub(super) fn export_request(
    volume: &PillarVolumeState,
    protocol: &PillarProtocol,
    token: Option<agent_api::FencingToken>,
) -> agent_api::ExportRequest {
    let status = volume.status_or_default();
    agent_api::ExportRequest {
        token,
        volume_id: volume.spec.volume_id.clone(),
        pool: volume.spec.pool.clone(),
        protocol: Some(agent_api::ExportProtocol {
            service: u32::from(protocol.spec.nvme_tcp.port),
            acl: protocol.spec.nvme_tcp.acl,
        }),
        // A host being revoked is not re-admitted by an export.
        allowed_host_nqns: status
            .published_nodes
            .iter()
            .filter(|p| !p.revoking)
            .map(|p| p.host_nqn.clone())
            .collect(),
    }
}
