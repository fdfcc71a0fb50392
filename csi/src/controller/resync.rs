//! Bringing a restarted agent back (C3): it refuses exports and grants until the controller has
//! sent the complete export state of its node, each volume with a fresh token and the ACL its
//! record holds (publications being revoked are not re-admitted; volumes being deleted are not
//! exported again).
//!
//! Each volume's failure is its own: a bad record leaves that volume out and is reported, the
//! rest of the node is restored. An agent that serves but could not restore some exports lists
//! them in its health, and the controller exports each of them again on every round until it
//! succeeds.

use std::sync::Arc;
use std::time::Duration;

use pillar_agent_api::v1 as agent_api;
use pillar_state::crd::{PillarAgent, PillarVolumeState};
use pillar_state::lease::{Leadership, every_round_while_leader};
use pillar_state::store::Revision;

use super::Controller;
use super::agent::{export_request, pv_of};
use super::condition::{Enforced, enforced};
use super::error::{ControllerError, agent_err, describe};
use super::record::not_deleting;

/// What one round saw of an agent, for its status.
struct Seen {
    state: &'static str,
    message: String,
    /// Restored and failed exports, when this round resynced it.
    resync: Option<(u32, u32)>,
    /// Exports the agent still lists as not restored.
    unrestored: Option<u32>,
}

impl Seen {
    fn serving() -> Self {
        Self {
            state: "Serving",
            message: String::new(),
            resync: None,
            unrestored: Some(0),
        }
    }

    fn serving_with_unrestored(n: usize) -> Self {
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        Self {
            message: format!("{n} export(s) not restored yet; exported again every round"),
            unrestored: Some(n),
            ..Self::serving()
        }
    }

    fn resynced(response: &agent_api::ResyncExportsResponse) -> Self {
        let count = |ok: bool| {
            u32::try_from(response.results.iter().filter(|r| r.ok == ok).count())
                .unwrap_or(u32::MAX)
        };
        let failed = count(false);
        Self {
            message: if failed == 0 {
                String::new()
            } else {
                format!("{failed} export(s) not restored by the last resync")
            },
            resync: Some((count(true), failed)),
            unrestored: None,
            ..Self::serving()
        }
    }

    fn waiting(message: String) -> Self {
        Self {
            state: "WaitingForResync",
            message,
            resync: None,
            unrestored: None,
        }
    }

    fn unreachable(message: String) -> Self {
        Self {
            state: "Unreachable",
            message,
            resync: None,
            unrestored: None,
        }
    }
}

/// A volume whose `AclDisabled` and `AuthDisabled` follow an export being sent with the
/// protocol's `acl` and `auth`.
pub(super) struct AclChange {
    volume: String,
    uid: String,
    pv: Option<String>,
    protocol: String,
    mode: Enforced,
}

/// How often the resync loop scans every volume (revokes pending, acl edits).
const VOLUME_SCAN_EVERY: Duration = Duration::from_secs(60);

/// How many volumes' resync tokens are taken at once.
const RESYNC_TOKENS_IN_FLIGHT: usize = 32;

impl Controller {
    /// Sends `agent` the complete export state of its node (C3). Each volume gets a fresh token.
    pub async fn resync_agent(
        &self,
        agent: &PillarAgent,
    ) -> Result<agent_api::ResyncExportsResponse, ControllerError> {
        let start = std::time::Instant::now();
        let result = self.resync_agent_unmetered(agent).await;
        self.metrics
            .resync(result.is_ok(), start.elapsed().as_secs_f64());
        result
    }

    async fn resync_agent_unmetered(
        &self,
        agent: &PillarAgent,
    ) -> Result<agent_api::ResyncExportsResponse, ControllerError> {
        let _one_at_a_time = self.resync_lock.lock().await;
        use futures::StreamExt as _;
        let name = agent.metadata.name.clone().unwrap_or_default();
        // C6: an agent that lost its state takes a resync only with the epoch it reports now,
        // read before any token is taken: every token below is then newer than its loss.
        let state_epoch = self
            .agents
            .client(agent)
            .await?
            .health(agent_api::HealthRequest {})
            .await
            .map_err(agent_err("Health", ""))?
            .into_inner()
            .state_epoch;
        let volumes: Vec<PillarVolumeState> = self
            .store
            .list_volumes()
            .await?
            .into_iter()
            .filter(|v| v.spec.agent == name && !v.status_or_default().deleting)
            .collect();
        // A token is one compare-and-swap per volume: the Kubernetes API has no transaction
        // over several objects. They are taken RESYNC_TOKENS_IN_FLIGHT at a time, so a node of
        // thousands of volumes waits for the API server's throughput, not its round trips.
        let requests: Vec<_> = futures::stream::iter(volumes)
            .map(|v| async move {
                let request = self.resync_request(&v).await;
                (v, request)
            })
            .buffered(RESYNC_TOKENS_IN_FLIGHT)
            .collect()
            .await;
        let mut exports = Vec::with_capacity(requests.len());
        let mut acl_changes = Vec::new();
        for (v, request) in requests {
            // One bad record is that volume's failure alone: reported, and the rest goes on.
            match request {
                Ok(Some((request, change))) => {
                    exports.push(request);
                    acl_changes.extend(change);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(agent = %name, volume = %v.spec.volume_id, error = %describe(&e), "volume left out of the resync");
                }
            }
        }
        let mut client = self.agents.client(agent).await?;
        let count = exports.len();
        let response = client
            .resync_exports(agent_api::ResyncExportsRequest {
                exports,
                state_epoch,
            })
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
        for change in acl_changes {
            let restored = response
                .results
                .iter()
                .any(|r| r.ok && r.volume_id == change.volume);
            if restored {
                self.record_acl_change(change).await;
            }
        }
        Ok(response)
    }

    /// Records in `AclDisabled` and `AuthDisabled` the mode an export the agent confirmed gave a
    /// volume's target (the protocol's `acl` or `auth` changed since the conditions were
    /// written). Best-effort: a failed write leaves the conditions saying the old mode, and the
    /// next publication exports again.
    pub(super) async fn record_acl_change(&self, change: AclChange) {
        let AclChange {
            volume,
            uid,
            pv,
            protocol,
            mode,
        } = change;
        if let Err(e) = self
            .record_enforced(&volume, &uid, pv, &protocol, mode)
            .await
        {
            tracing::warn!(%volume, error = %describe(&e), "AclDisabled/AuthDisabled not updated after the export");
        }
    }

    /// The export request of one volume for a resync, with a fresh token; `None` when its
    /// lifecycle ended meanwhile or another replica marked it deleting.
    ///
    /// The volume was listed before the token is taken, so "not being deleted" is checked
    /// again inside the compare-and-swap that takes the token (W5, W8): a DeleteVolume that
    /// marked it deleting and unexported it in between must not find it exported again. A
    /// deleting mark written after the token bumped the generation past it, so the agent
    /// refuses this export; it is left out all the same.
    pub(super) async fn resync_request(
        &self,
        v: &PillarVolumeState,
    ) -> Result<Option<(agent_api::ExportRequest, Option<AclChange>)>, ControllerError> {
        let uid = v.metadata.uid.clone().unwrap_or_default();
        let protocol = self.protocol_of(v).await?;
        let t = match self
            .next_token_if(&v.spec.volume_id, &uid, &not_deleting)
            .await
        {
            Ok(t) => t,
            Err(ControllerError::LifecycleGone { .. } | ControllerError::Deleting { .. }) => {
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        // The ACL read after the token was taken is the one the token vouches for.
        let Some(current) = self
            .store
            .get_volume(&v.spec.volume_id)
            .await?
            .filter(|c| c.metadata.uid.as_deref() == Some(uid.as_str()))
            .filter(|c| !c.status_or_default().deleting)
        else {
            return Ok(None);
        };
        let mode = Enforced::of(&protocol);
        let status = current.status_or_default();
        // W6, W10: a published volume whose target was last confirmed in another mode gets its
        // conditions written once the agent confirmed this export.
        let change =
            (!status.published_nodes.is_empty() && enforced(&status) != Some(mode)).then(|| {
                AclChange {
                    volume: v.spec.volume_id.clone(),
                    uid: uid.clone(),
                    pv: pv_of(&current),
                    protocol: v.spec.protocol.clone(),
                    mode,
                }
            });
        Ok(Some((
            export_request(&*self.store, &current, &protocol, t).await?,
            change,
        )))
    }

    /// Exports again, one by one, the volumes a serving agent reports it could not restore.
    async fn restore_exports(&self, agent: &PillarAgent, volumes: &[String]) {
        let name = agent.metadata.name.clone().unwrap_or_default();
        for volume in volumes {
            let result = async {
                let Some(v) = self.store.get_volume(volume).await? else {
                    return Ok(false);
                };
                if v.status_or_default().deleting || v.spec.agent != name {
                    return Ok(false);
                }
                let Some((request, change)) = self.resync_request(&v).await? else {
                    return Ok(false);
                };
                let mut client = self.agents.client(agent).await?;
                client
                    .export(request)
                    .await
                    .map_err(agent_err("Export", volume))?;
                if let Some(change) = change {
                    self.record_acl_change(change).await;
                }
                Ok::<_, ControllerError>(true)
            }
            .await;
            match result {
                Ok(true) => tracing::info!(agent = %name, %volume, "export restored"),
                Ok(false) => {
                    tracing::warn!(agent = %name, %volume, "the agent could not restore an export the controller has no live record of, or whose volume is being deleted; left to an operator or to the DeleteVolume")
                }
                Err(e) => {
                    tracing::warn!(agent = %name, %volume, error = %describe(&e), "restoring an export failed; retried on the next round")
                }
            }
        }
    }

    /// Checks every agent once; resyncs those that wait for it.
    pub async fn resync_waiting_agents(&self) {
        self.resync_round(&Leadership::sole()).await;
    }

    /// One round of the resync loop; stops before the next agent once `leadership` is lost
    /// (a replica that was paused past its renew deadline acts no more).
    async fn resync_round(&self, leadership: &Leadership) {
        self.scan_volumes(leadership).await;
        let agents = match self.store.list_agents().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list agents");
                return;
            }
        };
        for agent in agents {
            if !leadership.is_leader() {
                tracing::info!("no longer the leader: resync round stopped");
                return;
            }
            let name = agent.metadata.name.clone().unwrap_or_default();
            let health = match self.agents.client(&agent).await {
                Ok(mut c) => c.health(agent_api::HealthRequest {}).await,
                Err(e) => {
                    tracing::debug!(agent = %name, error = %e, "agent unreachable");
                    let seen = Seen::unreachable(crate::error_chain(&e));
                    self.record_agent_status(&agent, seen).await;
                    continue;
                }
            };
            let health = health.map(tonic::Response::into_inner);
            if let Ok(h) = &health {
                self.metrics.agent_waiting(
                    &name,
                    h.state() != agent_api::health_response::State::Serving,
                );
            }
            let seen = match health {
                Ok(h)
                    if matches!(
                        h.state(),
                        agent_api::health_response::State::WaitingForResync
                            | agent_api::health_response::State::Lost
                    ) =>
                {
                    match self.resync_agent(&agent).await {
                        Ok(response) => {
                            self.metrics.agent_waiting(&name, false);
                            Seen::resynced(&response)
                        }
                        Err(e) => {
                            tracing::warn!(agent = %name, error = %describe(&e), "resync failed");
                            Seen::waiting(describe(&e))
                        }
                    }
                }
                Ok(h) if !h.unrestored_volume_ids.is_empty() => {
                    self.restore_exports(&agent, &h.unrestored_volume_ids).await;
                    Seen::serving_with_unrestored(h.unrestored_volume_ids.len())
                }
                Ok(_) => Seen::serving(),
                Err(status) => {
                    tracing::debug!(agent = %name, %status, "agent health failed");
                    self.agents.forget(&name).await;
                    Seen::unreachable(status.message().to_owned())
                }
            };
            self.record_agent_status(&agent, seen).await;
        }
    }

    /// Writes what this round saw of `agent` into its status, only when that changed (one
    /// compare-and-swap against the record the round read; a conflict waits for the next
    /// round). Best-effort: the status is for operators.
    async fn record_agent_status(&self, agent: &PillarAgent, seen: Seen) {
        let name = agent.metadata.name.clone().unwrap_or_default();
        let current = agent.status.clone().unwrap_or_default();
        let now = self.condition_time();
        let mut next = current.clone();
        if next.state != seen.state {
            next.state = seen.state.to_owned();
            next.last_transition_time = Some(now.clone());
        }
        next.message = seen.message;
        if let Some((restored, failed)) = seen.resync {
            next.last_resync_time = Some(now);
            next.exports_restored = restored;
            next.exports_failed = failed;
        } else if let Some(unrestored) = seen.unrestored {
            next.exports_failed = unrestored;
        }
        if next == current {
            return;
        }
        let written = match Revision::of(agent) {
            Ok(rev) => self.store.replace_agent_status(&name, &rev, next).await,
            Err(e) => Err(e),
        };
        match written {
            Ok(_) => {}
            // Another replica wrote it since this round read it: the next round writes again.
            Err(e) if e.is_conflict() => {
                tracing::debug!(agent = %name, error = %e, "agent status not written this round");
            }
            // Refused (RBAC, validation) or unreachable: operators read this status, so say why
            // it stays stale.
            Err(e) => tracing::warn!(
                agent = %name,
                error = %pillar_state::error_chain(&e),
                "agent status not written"
            ),
        }
    }

    /// At most once a minute (it lists every volume): counts the volumes with a revoke pending,
    /// for `volumes_revoking`, and exports again with their protocol's `acl` the published
    /// volumes whose target was confirmed in the other mode (`acl.rs`).
    async fn scan_volumes(&self, leadership: &Leadership) {
        {
            let mut last = self.volumes_scanned.lock().await;
            // A scrape while this replica did not lead zeroed the gauge: count again now.
            if self.metrics.take_leader_gauges_reset() {
                *last = None;
            }
            if last.is_some_and(|t| t.elapsed() < VOLUME_SCAN_EVERY) {
                return;
            }
            *last = Some(tokio::time::Instant::now());
        }
        match self.store.list_volumes().await {
            Ok(volumes) => {
                let n = volumes
                    .iter()
                    .filter(|v| {
                        v.status_or_default()
                            .published_nodes
                            .iter()
                            .any(|p| p.revoking)
                    })
                    .count();
                self.metrics.set_volumes_revoking(n);
                self.converge_acls(&volumes, leadership).await;
            }
            Err(e) => tracing::debug!(error = %e, "cannot list the volumes to scan"),
        }
    }

    /// Runs a resync round every `interval` while `leadership` holds (one controller replica
    /// runs the loop; the Lease decides which, [`pillar_state::lease`]).
    pub fn spawn_resync_loop(
        self: &Arc<Self>,
        interval: Duration,
        leadership: Leadership,
    ) -> tokio::task::JoinHandle<()> {
        let me = Arc::clone(self);
        self.metrics.watch_leadership(leadership.clone());
        tokio::spawn(every_round_while_leader(
            leadership.clone(),
            interval,
            move || {
                let me = Arc::clone(&me);
                let leadership = leadership.clone();
                async move { me.resync_round(&leadership).await }
            },
        ))
    }
}
