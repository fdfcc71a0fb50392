//! Reaching a volume's agent: its PillarAgent and protocol records, the export request built
//! from a volume's record, and calls that answer an agent's request for a resync (C3) and retry
//! with a fresh token.

use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::{ErrorReason, reason_of};
use pillar_state::crd::{
    PillarAgent, PillarProtocol, PillarVolumeState, ProtocolAuth, ProtocolTls,
};
use pillar_state::store::{StateStore, StoreError};
use tonic::Status;

use super::Controller;
use super::error::{ControllerError, agent_err};
use super::record::Precondition;
use crate::agents::Client;

/// A volume's agent, as one operation on the volume reaches it: the PillarAgent, a client, and
/// the volume's name and lifecycle, so calls can take fresh tokens.
#[derive(Debug)]
pub(super) struct VolumeAgent {
    pub agent: PillarAgent,
    pub client: Client,
    pub name: String,
    pub uid: String,
    /// The PersistentVolume the sidecars named, for events.
    pub pv: Option<String>,
}

/// The PersistentVolume the sidecars named at CreateVolume, if they did.
pub(super) fn pv_of(volume: &PillarVolumeState) -> Option<String> {
    volume
        .spec
        .parameters
        .get(pillar_state::store::PV_NAME_PARAMETER)
        .filter(|pv| !pv.is_empty())
        .cloned()
}

impl Controller {
    /// The agent of `volume` (lifecycle `uid` as read); a missing PillarAgent fails closed (C1,
    /// W4).
    pub(super) async fn volume_agent(
        &self,
        volume: &PillarVolumeState,
    ) -> Result<VolumeAgent, ControllerError> {
        let name = &volume.spec.agent;
        let Some(agent) = self.store.get_agent(name).await? else {
            let uid = volume.metadata.uid.clone().unwrap_or_default();
            self.warn_agent_missing(&volume.spec.volume_id, &uid, pv_of(volume), name)
                .await;
            return Err(ControllerError::AgentMissing {
                volume: volume.spec.volume_id.clone(),
                agent: name.clone(),
            });
        };
        let client = self.agents.client(&agent).await?;
        Ok(VolumeAgent {
            agent,
            client,
            name: volume.spec.volume_id.clone(),
            uid: volume.metadata.uid.clone().unwrap_or_default(),
            pv: pv_of(volume),
        })
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

    /// Runs agent call `what` with `token` (a fresh one when `None`). When the agent waits for
    /// a resync, resyncs it and retries once with a fresh token: the resync took newer tokens,
    /// so the first one is stale by then.
    ///
    /// A fresh token is taken only while `still` holds of the record, in the same
    /// compare-and-swap (W8): during the resync another replica may have withdrawn what this
    /// call was decided on (unpublished the host this grant admits, marked the volume
    /// deleting), and a retry with a newer token would then overrule that replica's work.
    pub(super) async fn call_agent<T, F, Fut>(
        &self,
        target: &VolumeAgent,
        what: &'static str,
        token: Option<agent_api::FencingToken>,
        still: &Precondition<'_>,
        mut call: F,
    ) -> Result<T, ControllerError>
    where
        F: FnMut(Client, Option<agent_api::FencingToken>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let token = match token {
            Some(t) => Some(t),
            None => self.next_token_if(&target.name, &target.uid, still).await?,
        };
        let first = self.timed(what, call(target.client.clone(), token)).await;
        let status = match first {
            Ok(r) => return Ok(r.into_inner()),
            Err(s) if needs_resync(&s) => s,
            Err(s) => return Err(agent_err(what, &target.name)(s)),
        };
        tracing::info!(volume = %target.name, call = what, "agent waits for a resync: {}", status.message());
        self.resync_agent(&target.agent).await?;
        let token = self.next_token_if(&target.name, &target.uid, still).await?;
        self.timed(what, call(target.client.clone(), token))
            .await
            .map(tonic::Response::into_inner)
            .map_err(agent_err(what, &target.name))
    }

    /// Runs one agent call and records its latency and answer (`Ok` or the agent's reason).
    pub(super) async fn timed<T>(
        &self,
        what: &'static str,
        call: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, Status> {
        let start = std::time::Instant::now();
        let result = call.await;
        let answer = match &result {
            Ok(_) => "Ok".to_owned(),
            Err(s) => format!("{:?}", reason_of(s)),
        };
        self.metrics
            .agent_call(what, &answer, start.elapsed().as_secs_f64());
        result
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

/// Whether the agent answered that it waits for a resync: after a start (C3) or after it lost
/// its state (C6).
pub(super) fn needs_resync(status: &Status) -> bool {
    matches!(
        reason_of(status),
        ErrorReason::WaitingForResync | ErrorReason::StateLost
    )
}

/// The export of `volume` as its record says: the ACL admits the recorded publications that
/// are not being revoked.
pub(super) async fn export_request(
    store: &dyn StateStore,
    volume: &PillarVolumeState,
    protocol: &PillarProtocol,
    token: Option<agent_api::FencingToken>,
) -> Result<agent_api::ExportRequest, StoreError> {
    let status = volume.status_or_default();
    // A host being revoked is not re-admitted by an export.
    let admitted: Vec<_> = status
        .published_nodes
        .iter()
        .filter(|p| !p.revoking)
        .collect();
    let mut credentials = Vec::new();
    if requires_auth(protocol) {
        for p in &admitted {
            credentials.push(host_credentials(store, &p.node, &p.host_nqn).await?);
        }
    }
    Ok(agent_api::ExportRequest {
        token,
        volume_id: volume.spec.volume_id.clone(),
        pool: volume.spec.pool.clone(),
        protocol: Some(export_protocol(protocol)),
        allowed_host_nqns: admitted.iter().map(|p| p.host_nqn.clone()).collect(),
        credentials,
    })
}

/// Whether the protocol's exports require DH-HMAC-CHAP (W10): `auth: dhchap` with an ACL (the
/// kernel authenticates nobody on a subsystem that admits any host).
pub(super) fn requires_auth(protocol: &PillarProtocol) -> bool {
    protocol.spec.nvme_tcp.acl && protocol.spec.nvme_tcp.auth == ProtocolAuth::Dhchap
}

/// Whether the protocol's exports require TLS for NVMe/TCP. Sent as asked: the agent refuses
/// TLS without an ACL and authentication (INVALID_ARGUMENT), as the PSKs are derived from the
/// hosts' secrets.
pub(super) fn requires_tls(protocol: &PillarProtocol) -> bool {
    protocol.spec.nvme_tcp.tls == ProtocolTls::Required
}

pub(super) fn export_protocol(protocol: &PillarProtocol) -> agent_api::ExportProtocol {
    agent_api::ExportProtocol {
        service: u32::from(protocol.spec.nvme_tcp.port),
        acl: protocol.spec.nvme_tcp.acl,
        auth_none: !requires_auth(protocol),
        tls: requires_tls(protocol),
    }
}

/// `node`'s credentials for the agent (W10): hash and group are the agent's defaults
/// (`hmac(sha256)`, `ffdhe2048`).
pub(super) async fn host_credentials(
    store: &dyn StateStore,
    node: &str,
    host_nqn: &str,
) -> Result<agent_api::HostCredentials, StoreError> {
    let c = store.node_credentials(node, host_nqn).await?;
    Ok(agent_api::HostCredentials {
        host_nqn: host_nqn.to_owned(),
        dhchap_secret: c.secret,
        dhchap_ctrl_secret: c.ctrl_secret,
        hash: String::new(),
        dhgroup: String::new(),
    })
}
