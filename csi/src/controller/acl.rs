//! The target follows the PillarProtocol's `acl` and `auth` (W6, W7, W10): an operator's edit
//! of either reaches every published volume within one volume scan of the leader's resync loop,
//! not only at the volume's next publication or its agent's next resync.
//!
//! A volume's `AclDisabled` and `AuthDisabled` conditions say what its storage node was last
//! confirmed to enforce (`condition::enforced`); a published volume whose confirmed mode is not its protocol's
//! is exported again, as `restore_exports` does: a fresh token taken only while the volume is
//! not being deleted, the ACL read from the record after it (the recorded publications not
//! being revoked), and the condition written once the agent confirmed. The agent cuts the live
//! connections of a subsystem an ACL closes.

use std::collections::HashMap;

use pillar_state::crd::PillarVolumeState;
use pillar_state::lease::Leadership;

use super::Controller;
use super::condition::{Enforced, enforced};
use super::error::{ControllerError, agent_err, describe};

impl Controller {
    /// Exports again, with its protocol's `acl` and `auth`, each published volume of `volumes` whose
    /// target was last confirmed in the other mode (or never). Stops once `leadership` is lost.
    pub(super) async fn converge_acls(
        &self,
        volumes: &[PillarVolumeState],
        leadership: &Leadership,
    ) {
        let protocols: HashMap<String, Enforced> = match self.store.list_protocols().await {
            Ok(all) => all
                .iter()
                .map(|p| (p.metadata.name.clone().unwrap_or_default(), Enforced::of(p)))
                .collect(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot list protocols; acl edits not applied this round");
                return;
            }
        };
        for v in volumes {
            let status = v.status_or_default();
            let Some(&mode) = protocols.get(&v.spec.protocol) else {
                continue;
            };
            if status.deleting
                || status.published_nodes.is_empty()
                || enforced(&status) == Some(mode)
            {
                continue;
            }
            if !leadership.is_leader() {
                tracing::info!("no longer the leader: acl edits left to the next leader");
                return;
            }
            let volume = &v.spec.volume_id;
            match self.export_with_protocol_acl(v).await {
                Ok(true) => {
                    tracing::info!(%volume, acl = mode.acl, auth = mode.auth, "exported again: the protocol's acl or auth changed")
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(%volume, acl = mode.acl, auth = mode.auth, error = %describe(&e), "exporting with the protocol's acl and auth failed; retried on the next scan")
                }
            }
        }
    }

    /// One volume's export with its protocol's `acl`; `false` when there is nothing to do (its
    /// agent, lifecycle or record is gone, or it is being deleted).
    async fn export_with_protocol_acl(
        &self,
        v: &PillarVolumeState,
    ) -> Result<bool, ControllerError> {
        let Some(agent) = self.store.get_agent(&v.spec.agent).await? else {
            return Ok(false);
        };
        let Some((request, change)) = self.resync_request(v).await? else {
            return Ok(false);
        };
        let mut client = self.agents.client(&agent).await?;
        client
            .export(request)
            .await
            .map_err(agent_err("Export", &v.spec.volume_id))?;
        if let Some(change) = change {
            self.record_acl_change(change).await;
        }
        Ok(true)
    }
}
