//! TLS for NVMe/TCP at the agent: whether the kernel has it, and the hosts' PSKs in the
//! target's keyring.
//!
//! Invariants:
//! - An export that requires TLS is served only by a kernel that has it: before anything
//!   changes, the agent makes a probe port, looks for `addr_tsas`, writes `tls1.3` to it (the
//!   kernel refuses it without `CONFIG_NVME_TARGET_TCP_TLS` or without its keyring) and removes
//!   the port, and on the kernel it also needs the `.nvme` keyring; otherwise it refuses with
//!   `TLS_UNSUPPORTED`. Never decided from a kernel version; the answer is kept.
//! - A host's PSK (derived from its DH-HMAC-CHAP secret, `pillar_nvmet::TlsPsk`) is in the
//!   keyring before the ACL change that admits it is applied, and is invalidated when the host
//!   is revoked or the export removed. A PSK without an admission admits nobody: the ACL and
//!   DH-HMAC-CHAP still decide who connects.
//! - PSKs go to the keyring only: never to the state directory, a log or an error message.
//!   Under the test double (which has no keyring) they are kept beside its tree, in
//!   `.double/keyring/<identity>` (the key in hex), where the tests read them.

use std::collections::{BTreeMap, BTreeSet};

use std::path::Path;

use pillar_nvmet::{HostAuth, HostNqn, Op, TlsPsk, VolumeId};

use super::{Agent, AgentError};

/// The port pillar makes, writes `tls1.3` to and removes to learn whether the kernel has TLS
/// for the NVMe/TCP target. Port IDs are the services pillar exports on; 65535 is none.
const PROBE_PORT: &str = "65535";

/// Where the agent puts hosts' PSKs.
#[derive(Debug)]
pub(crate) enum PskKeyring {
    /// The kernel's `.nvme` keyring, found when first needed (`None` inside: the kernel has
    /// none).
    Kernel(std::sync::OnceLock<Option<i32>>),
    /// The test double's stand-in: a folder beside the double's tree, one file per identity.
    Double(std::path::PathBuf),
}

impl PskKeyring {
    /// The keyring of a target of `kind` (`"kernel"` or the double's, at `root`).
    pub(crate) fn for_target(kind: &str, root: &Path) -> Self {
        if kind == "kernel" {
            Self::Kernel(std::sync::OnceLock::new())
        } else {
            Self::Double(root.join(".double").join("keyring"))
        }
    }

    fn kernel_keyring(cell: &std::sync::OnceLock<Option<i32>>) -> Result<Option<i32>, AgentError> {
        if let Some(found) = cell.get() {
            return Ok(*found);
        }
        let found = pillar_nvmet::nvme_keyring().map_err(|e| keyring_error("find", &e))?;
        Ok(*cell.get_or_init(|| found))
    }

    /// Whether there is a keyring to put PSKs in.
    fn available(&self) -> Result<bool, AgentError> {
        match self {
            Self::Kernel(cell) => Ok(Self::kernel_keyring(cell)?.is_some()),
            Self::Double(_) => Ok(true),
        }
    }

    fn add(&self, psk: &TlsPsk) -> Result<(), AgentError> {
        match self {
            Self::Kernel(cell) => {
                let ring = Self::kernel_keyring(cell)?.ok_or_else(no_keyring)?;
                pillar_nvmet::add_psk(ring, psk).map_err(|e| keyring_error("add a PSK to", &e))?;
            }
            Self::Double(dir) => {
                std::fs::create_dir_all(dir)
                    .and_then(|()| std::fs::write(dir.join(psk.identity()), psk.key_hex()))
                    .map_err(|e| keyring_error("add a PSK to", &e))?;
            }
        }
        Ok(())
    }

    fn remove(&self, identity: &str) -> Result<(), AgentError> {
        match self {
            Self::Kernel(cell) => {
                if let Some(ring) = Self::kernel_keyring(cell)? {
                    pillar_nvmet::remove_psk(ring, identity)
                        .map_err(|e| keyring_error("remove a PSK from", &e))?;
                }
            }
            Self::Double(dir) => match std::fs::remove_file(dir.join(identity)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(keyring_error("remove a PSK from", &e));
                }
                _ => {}
            },
        }
        Ok(())
    }

}

fn keyring_error(what: &str, e: &std::io::Error) -> AgentError {
    AgentError::Keyring {
        what: format!("cannot {what} the kernel's .nvme keyring: {e}"),
    }
}

fn no_keyring() -> AgentError {
    AgentError::Keyring {
        what: "the kernel has no .nvme keyring".into(),
    }
}

impl Agent {
    /// Whether this node's kernel has TLS for the NVMe/TCP target (and a keyring for PSKs).
    pub(super) async fn kernel_has_tls(&self) -> Result<bool, AgentError> {
        if let Some(known) = self.tls_supported.get() {
            return Ok(*known);
        }
        let supported = self.psk_keyring.available()? && self.probe_port_tls().await?;
        tracing::info!(supported, "TLS for the NVMe/TCP target on this kernel");
        Ok(*self.tls_supported.get_or_init(|| supported))
    }

    /// Makes the probe port, asks it for TLS 1.3 and removes it, under the exclusive lock. A
    /// port of the probe's ID that exists is an export's (65535 is a valid service): it is
    /// never written or removed, and whether it has `addr_tsas` answers.
    async fn probe_port_tls(&self) -> Result<bool, AgentError> {
        let guard = self.target.exclusive().await;
        let dir = Path::new(pillar_nvmet::PORTS).join(PROBE_PORT);
        let root = self.target.root().to_owned();
        if root.join(&dir).exists() {
            return Ok(root.join(&dir).join(pillar_nvmet::ADDR_TSAS).exists());
        }
        self.target
            .apply(&guard, vec![Op::Mkdir { path: dir.clone() }])
            .await?;
        let write = |attr: &str, value: &str| Op::Write {
            path: dir.join(attr),
            value: value.to_owned(),
        };
        let mut supported = self
            .target
            .apply(&guard, vec![write("addr_trtype", "tcp")])
            .await
            .is_ok();
        supported = supported && root.join(&dir).join(pillar_nvmet::ADDR_TSAS).exists();
        if supported
            && let Err(e) = self
                .target
                .apply(
                    &guard,
                    vec![write(pillar_nvmet::ADDR_TSAS, pillar_nvmet::TSAS_TLS13)],
                )
                .await
        {
            tracing::info!(error = %e, "the kernel refuses tls1.3 on a port");
            supported = false;
        }
        self.target
            .apply(&guard, vec![Op::Rmdir { path: dir }])
            .await?;
        drop(guard);
        self.target.invalidate();
        Ok(supported)
    }

    /// Refuses, before anything is applied, an export of `volume` that requires TLS on a
    /// kernel without it.
    pub(super) async fn require_tls_support(&self, volume: &VolumeId) -> Result<(), AgentError> {
        if self.kernel_has_tls().await? {
            Ok(())
        } else {
            Err(AgentError::TlsUnsupported {
                volume: volume.to_string(),
            })
        }
    }

    /// Whether the last Export or resync of `volume` put it on a TLS port.
    pub(super) fn export_requires_tls(&self, volume: &VolumeId) -> bool {
        self.ports_of(volume).values().any(|p| p.tls)
    }

    /// Puts the PSK of every host in `creds` for `volume`'s subsystem into the keyring.
    pub(super) fn install_psks(
        &self,
        volume: &VolumeId,
        creds: &BTreeMap<HostNqn, HostAuth>,
    ) -> Result<(), AgentError> {
        let nqn = volume.subsystem_nqn();
        for (host, auth) in creds {
            self.psk_keyring
                .add(&TlsPsk::derive(&auth.secret, host, &nqn))?;
            self.psk_hosts()
                .entry(volume.clone())
                .or_default()
                .insert(host.clone());
        }
        Ok(())
    }

    /// Invalidates `host`'s PSK for `volume` (a revoke).
    pub(super) fn remove_psk(&self, volume: &VolumeId, host: &HostNqn) -> Result<(), AgentError> {
        let nqn = volume.subsystem_nqn();
        self.psk_keyring
            .remove(&pillar_nvmet::psk_identity(host, &nqn))?;
        if let Some(hosts) = self.psk_hosts().get_mut(volume) {
            hosts.remove(host);
        }
        Ok(())
    }

    /// Invalidates every PSK installed for `volume` since the start (an unexport).
    pub(super) fn remove_psks(&self, volume: &VolumeId) -> Result<(), AgentError> {
        let hosts = self.psk_hosts().remove(volume).unwrap_or_default();
        let nqn = volume.subsystem_nqn();
        for host in hosts {
            self.psk_keyring
                .remove(&pillar_nvmet::psk_identity(&host, &nqn))?;
        }
        Ok(())
    }

    fn psk_hosts(
        &self,
    ) -> std::sync::MutexGuard<'_, BTreeMap<VolumeId, BTreeSet<HostNqn>>> {
        self.psk_hosts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
