//! The resync (the controller's complete export state of this node, C3) and what the node
//! serves (ListExports).
//!
//! Invariants:
//! - The agent serves only after a resync has run to its end; while the state is lost (C6) only
//!   a resync carrying the current epoch ends it, and one during which another loss was
//!   detected leaves it lost.
//! - A resync reads the whole target once, then each export plans from the model and is read
//!   back from the kernel; exports the resync could not restore are kept as `unrestored`.

use std::collections::BTreeSet;

use pillar_nvmet::{NamespaceId, SubsystemNqn, VolumeId};

use super::{Agent, AgentError, ExportRequest, ExportSummary, Readiness, ResyncOutcome};
use crate::fence::Intent;

/// How many exports a resync applies at once: enough that the engine gathers their configfs
/// chains and mark writes into shared submissions and group commits.
const RESYNC_IN_FLIGHT: usize = 64;

impl Agent {
    /// Applies the controller's complete export state of this node, then starts serving.
    /// While the state is lost (C6) `epoch` must be the current state epoch, and the agent
    /// serves afterwards only if no other loss was detected meanwhile.
    pub async fn resync(
        &self,
        exports: Vec<ExportRequest>,
        epoch: &str,
    ) -> Result<(Vec<ResyncOutcome>, Vec<String>), AgentError> {
        use futures::StreamExt as _;
        let serves_under = self.resync_epoch(epoch)?;
        let listed: BTreeSet<VolumeId> = exports.iter().map(|e| e.volume.clone()).collect();
        {
            // One full read for the whole resync; every export then reads only its own scope.
            let guard = self.target.exclusive().await;
            self.target.observe_all(&guard).await?;
        }
        let outcomes: Vec<ResyncOutcome> = futures::stream::iter(exports)
            .map(|request| async move {
                let volume = request.volume.clone();
                let result = self.export_unchecked(request, Intent::Resync).await;
                if let Err(e) = &result {
                    tracing::warn!(%volume, error = %e, "resync of one export failed");
                }
                ResyncOutcome { volume, result }
            })
            .buffered(RESYNC_IN_FLIGHT)
            .collect()
            .await;
        let subsystems = match self.target.modelled_subsystems() {
            Some(names) => names,
            None => {
                let guard = self.target.exclusive().await;
                let state = self.target.observe_all(&guard).await?;
                state.subsystems.into_keys().collect()
            }
        };
        let unlisted = subsystems
            .iter()
            .filter_map(|name| SubsystemNqn::parse(name).ok()?.volume_id().ok())
            .filter(|v| !listed.contains(v))
            .map(|v| v.to_string())
            .collect::<Vec<_>>();
        *self.unrestored_set() = outcomes
            .iter()
            .filter(|o| o.result.is_err())
            .map(|o| o.volume.clone())
            .collect();
        {
            let mut readiness = self.readiness.write().await;
            let mut current = self.epoch_slot();
            if *current != serves_under {
                // The state was lost (again) during this resync: its seeds may be incomplete.
                return Err(AgentError::StateLost);
            }
            *current = None;
            *readiness = Readiness::Serving;
        }
        tracing::info!(
            exports = outcomes.len(),
            unlisted = unlisted.len(),
            "resync complete; serving"
        );
        Ok((outcomes, unlisted))
    }

    /// pillar's exports on this node.
    pub async fn list_exports(&self) -> Result<Vec<ExportSummary>, AgentError> {
        let guard = self.target.exclusive().await;
        let state = self.target.observe_all(&guard).await?;
        let mut out = Vec::new();
        for (name, sub) in &state.subsystems {
            let Some(volume) = SubsystemNqn::parse(name)
                .ok()
                .and_then(|n| n.volume_id().ok())
            else {
                continue;
            };
            let ns = sub.namespaces.get(&NamespaceId::VOLUME);
            out.push(ExportSummary {
                volume,
                nqn: name.clone(),
                device_path: ns
                    .and_then(|n| n.device_path.as_ref())
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                acl: !sub.allow_any_host,
                allowed_hosts: sub.allowed_hosts.iter().cloned().collect(),
                services: state
                    .ports_linking(name)
                    .filter_map(|p| state.ports.get(&p)?.trsvcid.parse().ok())
                    .collect(),
                enabled: ns.is_some_and(|n| n.enabled),
            });
        }
        Ok(out)
    }
}
