//! Grants and revokes: the ACL of an export and its port links, nothing else.
//!
//! Invariants:
//! - A grant or revoke changes the ACL (`plan_acl`) and the subsystem's port links: whatever
//!   the namespace shows, an ACL change never removes or rewrites it.
//! - A revoke under `acl` removes the host from the ACL and then cuts the subsystem's live
//!   connections, so the revoked host can no longer do I/O when the call returns (W7). The cut
//!   links the subsystem back to the ports its export belongs on, and a grant makes sure it is
//!   on them: a cut that failed half-way is finished by the next revoke or grant.
//! - An ACL entry that is not a host NQN pillar writes is refused, never rewritten.
//! - A grant on an export that requires authentication carries the host's keys (W10); on one
//!   that requires TLS its PSK goes into the keyring before the ACL change, and a revoke
//!   invalidates it after the cut.

use std::collections::{BTreeMap, BTreeSet};

use pillar_nvmet::{
    HostAccess, HostAuth, HostNqn, Op, TargetState, VolumeId, plan_acl, plan_cut_connections,
    plan_links, verify_acl, verify_links,
};

use super::identity::{ENABLE, strip_writes};
use super::{Agent, AgentError, released_under};
use crate::fence::{Intent, Token};

impl Agent {
    /// Admits a host (with `acl`; without it any host is admitted already). With `creds` its
    /// host entry gets the keys first (or new keys: a rotation); an export that requires
    /// authentication refuses a grant without them (W10).
    pub async fn grant(
        &self,
        token: Option<Token>,
        volume: &VolumeId,
        host: &HostNqn,
        creds: Option<HostAuth>,
    ) -> Result<(), AgentError> {
        self.ensure_serving().await?;
        if creds.is_none() && self.export_requires_auth(volume) {
            return Err(AgentError::InvalidArgument {
                field: "credentials",
                reason: format!(
                    "volume {volume}'s export requires DH-HMAC-CHAP: a grant of {host} must \
                     carry the host's credentials"
                ),
            });
        }
        if creds.is_some() {
            self.require_auth_support(volume).await?;
        }
        let creds: BTreeMap<HostNqn, HostAuth> =
            creds.map(|c| (host.clone(), c)).into_iter().collect();
        self.change_acl(token, volume, host, Intent::Grant, &creds)
            .await
    }

    /// Removes a host from the ACL and cuts its live connections.
    pub async fn revoke(
        &self,
        token: Option<Token>,
        volume: &VolumeId,
        host: &HostNqn,
    ) -> Result<(), AgentError> {
        self.ensure_not_lost().await?;
        self.change_acl(token, volume, host, Intent::Revoke, &BTreeMap::new())
            .await
    }

    /// A fenced grant or revoke under the volume's lock. The TLS keys move under it too, after
    /// the fence: a stale grant never installs a key, and a revoke's removal cannot take away
    /// the key of a newer grant that ran between its cut and the removal.
    async fn change_acl(
        &self,
        token: Option<Token>,
        volume: &VolumeId,
        host: &HostNqn,
        intent: Intent,
        creds: &BTreeMap<HostNqn, HostAuth>,
    ) -> Result<(), AgentError> {
        let _lock = self.lock_volume(volume).await;
        let decision = self.check(volume, token.as_ref(), intent).await?;
        self.commit(volume, decision).await?;
        if intent == Intent::Grant && self.export_requires_tls(volume) {
            // Before the ACL admits the host: it finds its PSK as soon as it may connect.
            self.install_psks(volume, creds)?;
        }
        self.apply_acl_change(volume, host, intent, creds).await?;
        if intent == Intent::Revoke {
            // After the cut: the host's live TLS sessions are gone with its controllers.
            self.remove_psk(volume, host)?;
        }
        Ok(())
    }

    /// The ACL change and, for a revoke, the cut; called fenced, under the volume's lock.
    async fn apply_acl_change(
        &self,
        volume: &VolumeId,
        host: &HostNqn,
        intent: Intent,
        creds: &BTreeMap<HostNqn, HostAuth>,
    ) -> Result<(), AgentError> {
        let nqn = volume.subsystem_nqn();
        let acl_only = intent == Intent::Revoke && self.settings.unsafe_revoke_acl_only;
        let ports = self.ports_of(volume);
        let plan_error = |source| AgentError::Plan {
            volume: volume.to_string(),
            source,
        };
        let (guard, (ops, access)) = self
            .plan_under_lock(
                &nqn,
                |view| {
                    let planned = self.plan_acl_change(view, volume, host, intent, acl_only)?;
                    // Removing the host from allowed_hosts stops new connections only;
                    // unlinking the subsystem from its ports deletes its controllers, and only
                    // allowed hosts reconnect. The cut links it back to the ports its export
                    // belongs on, not only to those it is on now: a retry after a cut that
                    // failed half-way finishes it. A grant makes sure the subsystem is on them.
                    let links = match intent {
                        Intent::Revoke if planned.is_some() && !acl_only => {
                            plan_cut_connections(view, &nqn, &ports).map_err(plan_error)?
                        }
                        Intent::Revoke => Vec::new(),
                        _ => plan_links(view, &nqn, &ports).map_err(plan_error)?,
                    };
                    let (mut ops, access) =
                        planned.map_or((Vec::new(), None), |(ops, access)| (ops, Some(access)));
                    if access.is_some() {
                        ops = self.with_host_keys(volume, ops, None, creds)?.0;
                    }
                    ops.extend(links);
                    Ok((ops, access))
                },
                |(ops, _)| ops.as_slice(),
            )
            .await?;
        if ops.is_empty() && access.is_none() {
            return Ok(());
        }
        // The ACL first; a revoke that leaves nobody admitted ends it with the namespace
        // disabled: the kernel returns from that write only once every command in flight on it
        // has completed; then the cut.
        let released = released_under(&guard, &ops, &nqn);
        self.target.apply(&guard, ops).await?;
        let after = self.target.read_back(&guard, nqn.as_str()).await?;
        if let Some(access) = &access {
            verify_acl(&after, &nqn, access)?;
            self.verify_host_keys(creds)?;
        }
        if !acl_only {
            verify_links(&after, &nqn, &ports)?;
        }
        drop(guard);
        self.target.release(nqn.as_str(), &released, &after).await?;
        tracing::info!(%volume, %host, ?intent, "ACL changed");
        Ok(())
    }

    /// The ACL change of `intent` for `host` on what `view` shows: `None` when there is nothing
    /// to change (a revoke of a volume not exported here; `acl: false`, where the controller's
    /// publication record is the only guard and cutting connections would keep nobody out).
    fn plan_acl_change(
        &self,
        view: &TargetState,
        volume: &VolumeId,
        host: &HostNqn,
        intent: Intent,
        acl_only: bool,
    ) -> Result<Option<(Vec<Op>, HostAccess)>, AgentError> {
        let nqn = volume.subsystem_nqn();
        let Some(sub) = view.subsystem(&nqn) else {
            if intent == Intent::Revoke {
                // Nothing exported: nobody can reach the volume through this node.
                return Ok(None);
            }
            return Err(AgentError::NotExported {
                volume: volume.to_string(),
            });
        };
        if sub.allow_any_host {
            return Ok(None);
        }
        let mut hosts = sub
            .allowed_hosts
            .iter()
            .map(|h| {
                h.parse::<HostNqn>()
                    .map_err(|_| AgentError::ForeignAclEntry {
                        volume: volume.to_string(),
                        host: h.clone(),
                    })
            })
            .collect::<Result<BTreeSet<_>, _>>()?;
        if intent == Intent::Grant {
            hosts.insert(host.clone());
        } else {
            hosts.remove(host);
        }
        let access = HostAccess::Only(hosts);
        let expected = self.expected_identities(volume, sub)?;
        let ops = plan_acl(view, &nqn, &access, &expected).map_err(|source| AgentError::Plan {
            volume: volume.to_string(),
            source,
        })?;
        let ops = if acl_only {
            strip_writes(ops, ENABLE)
        } else {
            ops
        };
        Ok(Some((ops, access)))
    }
}
