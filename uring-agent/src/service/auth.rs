//! NVMe in-band authentication at the agent (W10): the host entries' DH-HMAC-CHAP keys.
//!
//! Invariants:
//! - An export that requires authentication is served only by a kernel that has it: the agent
//!   looks at a host entry's attributes (or makes a probe entry and removes it) before it
//!   changes anything, and refuses with `AUTH_UNSUPPORTED` otherwise. Never decided from a
//!   kernel version; the answer is kept (a kernel does not gain or lose it while running).
//! - A host's keys are written into its host entry in the same plan, under the same target
//!   lock, as the ACL change that admits it, and before the link: no window admits a host of an
//!   export that requires authentication on its NQN alone. A key change touches a shared entry
//!   (`touches_shared`), so it runs under the exclusive lock.
//! - A grant on an export that requires authentication carries the host's credentials, or is
//!   refused (INVALID_ARGUMENT) with nothing applied.
//! - Secrets go to configfs only: never to the state directory, a log or an error message.

use std::collections::BTreeMap;
use std::path::Path;

use pillar_nvmet::{
    AuthPlanError, HostAuth, HostNqn, ObservedHostAuth, Op, VolumeId, auth_supported_by_entries,
    observe_host_auth, plan_host_auth,
};

use super::{Agent, AgentError};

/// The host entry pillar makes, looks at and removes when no host entry shows whether the
/// kernel has authentication.
const PROBE_HOST: &str = "nqn.2014-08.io.pillar-csi:auth-probe";

impl Agent {
    /// Whether this node's kernel has NVMe in-band authentication.
    pub(super) async fn kernel_has_auth(&self) -> Result<bool, AgentError> {
        if let Some(known) = self.auth_supported.get() {
            return Ok(*known);
        }
        let guard = self.target.exclusive().await;
        let root = self.target.root().to_owned();
        let seen = auth_supported_by_entries(&root).map_err(observe_error)?;
        let supported = match seen {
            Some(s) => s,
            None => {
                let probe = Path::new(pillar_nvmet::HOSTS).join(PROBE_HOST);
                self.target
                    .apply(&guard, vec![Op::Mkdir { path: probe.clone() }])
                    .await?;
                let shown = observe_host_auth(&root, PROBE_HOST).map_err(observe_error);
                self.target
                    .apply(&guard, vec![Op::Rmdir { path: probe }])
                    .await?;
                matches!(shown?, ObservedHostAuth::Entry { .. })
            }
        };
        drop(guard);
        self.target.invalidate();
        tracing::info!(supported, "NVMe in-band authentication (DH-HMAC-CHAP) on this kernel");
        Ok(*self.auth_supported.get_or_init(|| supported))
    }

    /// Refuses, before anything is applied, an export of `volume` that requires authentication
    /// on a kernel without it.
    pub(super) async fn require_auth_support(&self, volume: &VolumeId) -> Result<(), AgentError> {
        if self.kernel_has_auth().await? {
            Ok(())
        } else {
            Err(AgentError::AuthUnsupported {
                volume: volume.to_string(),
            })
        }
    }

    /// `ops` with the key writes of every host in `creds` merged in: right after the mkdir of
    /// its host entry when `ops` makes it, else before the first link to it, else first (a
    /// rotation of an admitted host). `keep_after` is an index the writes must follow (the
    /// export plan's re-plan point); it is moved along with the operations it names.
    pub(super) fn with_host_keys(
        &self,
        volume: &VolumeId,
        mut ops: Vec<Op>,
        mut keep_after: Option<usize>,
        creds: &BTreeMap<HostNqn, HostAuth>,
    ) -> Result<(Vec<Op>, Option<usize>), AgentError> {
        let root = self.target.root().to_owned();
        for (host, want) in creds {
            let entry = Path::new(pillar_nvmet::HOSTS).join(host.as_str());
            let made_here = ops
                .iter()
                .position(|op| matches!(op, Op::Mkdir { path } if *path == entry));
            let observed = if made_here.is_some() {
                ObservedHostAuth::NoEntry
            } else {
                observe_host_auth(&root, host.as_str()).map_err(observe_error)?
            };
            let mut keys = plan_host_auth(host, &observed, want).map_err(|e| match e {
                AuthPlanError::Unsupported { .. } => AgentError::AuthUnsupported {
                    volume: volume.to_string(),
                },
            })?;
            if made_here.is_some() {
                keys.retain(|op| !matches!(op, Op::Mkdir { .. }));
            }
            let at = match made_here {
                Some(i) => i + 1,
                None => ops
                    .iter()
                    .position(|op| matches!(op, Op::Symlink { target, .. } if *target == entry))
                    .unwrap_or(0),
            };
            let at = match keep_after {
                Some(k) if at <= k => k + 1,
                _ => at,
            };
            let n = keys.len();
            ops.splice(at..at, keys);
            keep_after = keep_after.map(|k| if at <= k { k + n } else { k });
        }
        Ok((ops, keep_after))
    }

    /// Reads back every host entry in `creds`: a key set, the hash and the DH group asked for.
    pub(super) fn verify_host_keys(
        &self,
        creds: &BTreeMap<HostNqn, HostAuth>,
    ) -> Result<(), AgentError> {
        let root = self.target.root().to_owned();
        for (host, want) in creds {
            let shown = observe_host_auth(&root, host.as_str()).map_err(observe_error)?;
            let found = match &shown {
                ObservedHostAuth::Entry {
                    key, hash, dhgroup, ..
                } if !key.0.is_empty()
                    && hash == want.hash.kernel_name()
                    && dhgroup == want.dhgroup.kernel_name() =>
                {
                    continue;
                }
                other => format!("{other:?}"),
            };
            return Err(AgentError::Verify(pillar_nvmet::VerifyError {
                nqn: host.to_string(),
                mismatches: vec![pillar_nvmet::Mismatch {
                    what: "host entry authentication".into(),
                    expected: format!(
                        "a key set, {}, {}",
                        want.hash.kernel_name(),
                        want.dhgroup.kernel_name()
                    ),
                    found,
                }],
            }));
        }
        Ok(())
    }

    /// Whether the last Export or resync of `volume` required authentication.
    pub(super) fn export_requires_auth(&self, volume: &VolumeId) -> bool {
        self.export_auth
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(volume)
            .copied()
            // Unknown: not exported since this start (a grant then fails as NOT_EXPORTED; after
            // a restart nothing is granted before the resync re-exported everything).
            .unwrap_or(false)
    }

    pub(super) fn remember_export_auth(&self, volume: &VolumeId, required: Option<bool>) {
        let mut map = self
            .export_auth
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match required {
            Some(r) => {
                map.insert(volume.clone(), r);
            }
            None => {
                map.remove(volume);
            }
        }
    }
}

fn observe_error(e: pillar_nvmet::ObserveError) -> AgentError {
    AgentError::Target(crate::target::TargetError::Observe(e))
}
