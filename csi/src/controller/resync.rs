//! Bringing a restarted agent back (C3): it refuses exports and grants until the controller has
//! sent the complete export state of its node, each volume with a fresh token and the ACL its
//! record holds (publications being revoked are not re-admitted).

use std::sync::Arc;
use std::time::Duration;

use pillar_agent_api::v1 as agent_api;
use pillar_state::crd::PillarAgent;

use super::Controller;
use super::agent::export_request;
use super::error::{ControllerError, agent_err, describe};

impl Controller {
    /// Sends `agent` the complete export state of its node (C3). Each volume gets a fresh token.
    pub async fn resync_agent(
        &self,
        agent: &PillarAgent,
    ) -> Result<agent_api::ResyncExportsResponse, ControllerError> {
        let _one_at_a_time = self.resync_lock.lock().await;
        let name = agent.metadata.name.clone().unwrap_or_default();
        let mut exports = Vec::new();
        for v in self
            .store
            .list_volumes()
            .await?
            .into_iter()
            .filter(|v| v.spec.agent == name)
        {
            let uid = v.metadata.uid.clone().unwrap_or_default();
            let protocol = self.protocol_of(&v).await?;
            let t = match self.next_token(&v.spec.volume_id, &uid).await {
                Ok(t) => t,
                Err(ControllerError::LifecycleGone { .. }) => continue,
                Err(e) => return Err(e),
            };
            let current = self.store.get_volume(&v.spec.volume_id).await?.unwrap_or(v);
            exports.push(export_request(&current, &protocol, t));
        }
        let mut client = self.agents.client(agent).await?;
        let count = exports.len();
        let response = client
            .resync_exports(agent_api::ResyncExportsRequest { exports })
            .await
            .map_err(agent_err("ResyncExports", ""))?
            .into_inner();
        let failed: Vec<_> = response.results.iter().filter(|r| !r.ok).collect();
        tracing::info!(agent = %name, exports = count, failed = failed.len(), "resync sent");
        for f in &failed {
            tracing::warn!(agent = %name, volume = %f.volume_id, code = %f.code, "resync of a volume failed: {}", f.message);
        }
        for v in &response.unlisted_volume_ids {
            tracing::warn!(agent = %name, volume = %v, "the storage node exports a volume the controller has no record of; left in place");
        }
        Ok(response)
    }

    /// Checks every agent once; resyncs those that wait for it.
    pub async fn resync_waiting_agents(&self) {
        let agents = match self.store.list_agents().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list agents");
                return;
            }
        };
        for agent in agents {
            let name = agent.metadata.name.clone().unwrap_or_default();
            let health = match self.agents.client(&agent).await {
                Ok(mut c) => c.health(agent_api::HealthRequest {}).await,
                Err(e) => {
                    tracing::debug!(agent = %name, error = %e, "agent unreachable");
                    continue;
                }
            };
            match health {
                Ok(h)
                    if h.get_ref().state()
                        == agent_api::health_response::State::WaitingForResync =>
                {
                    if let Err(e) = self.resync_agent(&agent).await {
                        tracing::warn!(agent = %name, error = %describe(&e), "resync failed");
                    }
                }
                Ok(_) => {}
                Err(status) => {
                    tracing::debug!(agent = %name, %status, "agent health failed");
                    self.agents.forget(&name).await;
                }
            }
        }
    }

    /// Runs [`resync_waiting_agents`](Self::resync_waiting_agents) every `interval`.
    pub fn spawn_resync_loop(self: &Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                me.resync_waiting_agents().await;
                tokio::time::sleep(interval).await;
            }
        })
    }
}
