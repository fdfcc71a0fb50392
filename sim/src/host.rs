//! The hosts: a Kubernetes node's kubelet and node plugin. The node plugin is the real one
//! (`pillar_csi::node::NodeService`: its request checks, its volume lock, its engine's stage,
//! publish, unpublish, unstage and expand, its stage records), run on the simulation's thread over a
//! kernel double ([`crate::kernel::SimKernel`]) that enforces the kernel's rules: the NVMe/TCP
//! connect is the agent's target double deciding as the kernel does (port link, ACL,
//! DH-HMAC-CHAP secret), a grown namespace shows its new size only once scanned (a rescan, a
//! reconnect), the mounts are a table (one mount per device, a mount needs a live
//! device and the filesystem its header names), the filesystem is a header in the volume's
//! backing file (written only through a live controller and never against another host's
//! Write Exclusive reservation), and the reservations are [`Reservations`], lost with the
//! target's memory at a power loss.
//!
//! A kubelet call reaches the plugin after a seeded pause (other operations run meanwhile),
//! then runs whole: the engine is synchronous, as it is on its blocking thread in production.
//!
//! A host is live on a volume when it has it mounted at its staging path and the target holds
//! its controller: only then can it read or write it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use pillar_csi::csi;
use pillar_csi::node::{AttachMode, NodeConfig, NodeError, NodeService, code_of, describe};
use pillar_host::HostPaths;
use pillar_nvmet::{HostNqn, SubsystemNqn};

use crate::chaos::Chaos;
use crate::kernel::SimKernel;
pub use crate::targets::{Reservations, Targets};

/// A volume staged on a host, as its kernel shows it.
#[derive(Clone, Debug)]
pub struct Staged {
    pub agent: String,
    pub nqn: String,
    pub port: u16,
    pub read_only: bool,
    /// The staging mount's ID in the host's mount table: another stage of the volume is
    /// another mount (invariant 9 holds for one stage).
    pub mount_id: u64,
    /// Publish targets (their names under the host's `pods`) and whether each is read-only.
    pub published: BTreeMap<String, bool>,
}

/// One host (a node presenting one host NQN): the real node plugin over its kernel double.
#[derive(Debug)]
pub struct SimHost {
    pub node: String,
    pub host_nqn: String,
    plugin: NodeService,
    kernel: Arc<SimKernel>,
    dir: PathBuf,
    staging: PathBuf,
    pods: PathBuf,
}

/// A host shared by the operations running on it.
pub type SharedHost = Arc<Mutex<SimHost>>;

/// What a kubelet knows of a publication: the publish context, the capability, readonly.
#[derive(Clone, Debug)]
pub struct Publication {
    pub context: HashMap<String, String>,
    pub capability: csi::VolumeCapability,
    pub readonly: bool,
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// A node plugin error as the kubelet sees it: the gRPC code and the message, with the host's
/// directory (a temp directory, another each run) and the wall time the engine waited (its
/// timeouts are zero here, but it measures them) left out so a seed's trace is the same.
fn status(e: &NodeError, dir: &Path) -> String {
    let text =
        format!("{:?}: {}", code_of(e), describe(e)).replace(&*dir.to_string_lossy(), "<host>");
    without_waits(&text)
}

/// `text` with each duration after "after " or "within " (as `{:?}` prints one) replaced by
/// `<time>`.
fn without_waits(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = ["after ", "within "]
        .iter()
        .filter_map(|w| rest.find(w).map(|i| i + w.len()))
        .min()
    {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let len = rest
            .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | 'µ' | 'n' | 'm' | 's')))
            .unwrap_or(rest.len());
        let token = &rest[..len];
        if token.starts_with(|c: char| c.is_ascii_digit()) && token.ends_with('s') {
            out.push_str("<time>");
            rest = &rest[len..];
        }
    }
    out.push_str(rest);
    out
}

/// The volume ID a subsystem NQN names.
pub fn volume_of(nqn: &str) -> String {
    SubsystemNqn::parse(nqn)
        .ok()
        .and_then(|n| n.volume_id().ok())
        .map(|v| v.to_string())
        .unwrap_or_default()
}

impl SimHost {
    /// Host `host_nqn` of `node`, its plugin's state under `dir`, reaching `targets`.
    pub fn new(
        node: &str,
        host_nqn: &str,
        dir: &Path,
        targets: Targets,
        reservations: Arc<Reservations>,
    ) -> Result<Self, String> {
        // The host ID the NQN carries (`...:uuid:<host ID>`), as nvme-cli makes them.
        let host_id = host_nqn
            .rsplit_once("uuid:")
            .and_then(|(_, id)| uuid::Uuid::parse_str(id).ok())
            .ok_or_else(|| format!("{host_nqn} carries no host ID"))?;
        let kernel = Arc::new(SimKernel::new(
            host_nqn,
            &host_id,
            dir.join("dev"),
            targets,
            reservations,
        ));
        let config = NodeConfig {
            node_name: node.to_owned(),
            host_nqn: HostNqn::parse(host_nqn).map_err(err)?,
            host_id,
            state_dir: dir.to_path_buf(),
            paths: HostPaths::under(dir),
            attach: AttachMode::NvmeTcp,
            // The double has the namespace at once or not at all: no waiting.
            connect_timeout: std::time::Duration::ZERO,
            reservations: true,
            topology: BTreeMap::new(),
        };
        let plugin = NodeService::with_kernel(config, Arc::clone(&kernel) as _).map_err(err)?;
        Ok(Self {
            node: node.to_owned(),
            host_nqn: host_nqn.to_owned(),
            plugin,
            kernel,
            dir: dir.to_path_buf(),
            staging: dir.join("staging"),
            pods: dir.join("pods"),
        })
    }

    /// The volumes mounted at their staging path, by volume ID, with their publications.
    pub fn staged(&self) -> BTreeMap<String, Staged> {
        let mounts = self.kernel.mounts();
        let mut out = BTreeMap::new();
        for (nqn, agent, port, m) in &mounts {
            if m.mount_point.parent() == Some(self.staging.as_path()) {
                out.insert(
                    volume_of(nqn),
                    Staged {
                        agent: agent.clone(),
                        nqn: nqn.clone(),
                        port: *port,
                        read_only: m.super_options == "ro",
                        mount_id: m.mount_id,
                        published: BTreeMap::new(),
                    },
                );
            }
        }
        for (nqn, _, _, m) in &mounts {
            if m.mount_point.parent() == Some(self.pods.as_path())
                && let Some(s) = out.get_mut(&volume_of(nqn))
                && let Some(name) = m.mount_point.file_name()
            {
                s.published
                    .insert(name.to_string_lossy().into_owned(), m.is_readonly());
            }
        }
        out
    }

    /// What the target's namespace of `staged`'s subsystem holds, in bytes (invariant 9).
    pub fn namespace_bytes(&self, staged: &Staged) -> Option<u64> {
        self.kernel.namespace_bytes(&staged.nqn)
    }

    /// This host's kernel double (the tests break it on purpose).
    pub fn kernel(&self) -> &SimKernel {
        &self.kernel
    }

    /// Whether the target holds this host's controller of `staged`'s subsystem.
    pub fn live(&self, staged: &Staged) -> bool {
        self.kernel.reaches(&staged.agent, &staged.nqn, staged.port)
    }
}

/// The host, locked (never across an await).
pub fn lock_host(host: &SharedHost) -> MutexGuard<'_, SimHost> {
    host.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The hosts' world: their targets and reservations.
#[derive(Clone, Debug)]
pub struct Fabric {
    pub targets: Targets,
    pub reservations: Arc<Reservations>,
    pub chaos: Chaos,
}

/// A path as the CSI request carries it.
fn text(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

impl Fabric {
    /// The plugin and its paths, for one call (the host is not locked while the call runs).
    fn plugin(host: &SharedHost) -> (NodeService, PathBuf, PathBuf, PathBuf) {
        let h = lock_host(host);
        (
            h.plugin.clone(),
            h.staging.clone(),
            h.pods.clone(),
            h.dir.clone(),
        )
    }

    /// NodeStageVolume with `publication`'s context and the node's `secrets`.
    pub async fn stage(
        &self,
        host: &SharedHost,
        volume_id: &str,
        publication: &Publication,
        secrets: &HashMap<String, String>,
    ) -> Result<(), String> {
        // The call reaches the plugin after a while: other operations run meanwhile.
        tokio::time::sleep(self.chaos.pause(50)).await;
        let (plugin, staging, _, dir) = Self::plugin(host);
        let req = csi::NodeStageVolumeRequest {
            volume_id: volume_id.to_owned(),
            publish_context: publication.context.clone(),
            staging_target_path: text(&staging.join(volume_id)),
            volume_capability: Some(publication.capability.clone()),
            secrets: secrets.clone(),
            ..Default::default()
        };
        plugin.stage_inline(&req).map_err(|e| status(&e, &dir))
    }

    /// NodePublishVolume at `target` (a name under the host's `pods`).
    pub fn publish(
        &self,
        host: &SharedHost,
        volume_id: &str,
        target: &str,
        publication: &Publication,
    ) -> Result<(), String> {
        let (plugin, staging, pods, dir) = Self::plugin(host);
        let req = csi::NodePublishVolumeRequest {
            volume_id: volume_id.to_owned(),
            publish_context: publication.context.clone(),
            staging_target_path: text(&staging.join(volume_id)),
            target_path: text(&pods.join(target)),
            volume_capability: Some(publication.capability.clone()),
            readonly: publication.readonly,
            ..Default::default()
        };
        plugin.publish_inline(&req).map_err(|e| status(&e, &dir))
    }

    /// NodeUnpublishVolume of `target`.
    pub fn unpublish(
        &self,
        host: &SharedHost,
        volume_id: &str,
        target: &str,
    ) -> Result<(), String> {
        let (plugin, _, pods, dir) = Self::plugin(host);
        let req = csi::NodeUnpublishVolumeRequest {
            volume_id: volume_id.to_owned(),
            target_path: text(&pods.join(target)),
        };
        plugin.unpublish_inline(&req).map_err(|e| status(&e, &dir))
    }

    /// NodeExpandVolume of a staged volume to `required` bytes, as kubelet sends it after a
    /// ControllerExpandVolume that answered `node_expansion_required`: `volume_path` is the
    /// publish target `at` names (the expansion of a volume a pod uses) or, with `None`, the
    /// staging path (kubelet's call right after NodeStage), `staging_target_path` the staging
    /// path, the capacity range the PV's new capacity with no limit, the capability the PV's.
    /// Returns the capacity answered. The call runs whole after a seeded pause, and nothing
    /// runs between its answer and the caller's next step.
    pub async fn expand(
        &self,
        host: &SharedHost,
        volume_id: &str,
        at: Option<&str>,
        capability: &csi::VolumeCapability,
        required: u64,
    ) -> Result<u64, String> {
        tokio::time::sleep(self.chaos.pause(50)).await;
        let (plugin, staging, pods, dir) = Self::plugin(host);
        let req = csi::NodeExpandVolumeRequest {
            volume_id: volume_id.to_owned(),
            volume_path: text(&at.map_or_else(|| staging.join(volume_id), |t| pods.join(t))),
            staging_target_path: text(&staging.join(volume_id)),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: i64::try_from(required).unwrap_or(i64::MAX),
                limit_bytes: 0,
            }),
            volume_capability: Some(capability.clone()),
            ..Default::default()
        };
        plugin.expand_inline(&req).map_err(|e| status(&e, &dir))
    }

    /// NodeUnstageVolume.
    pub fn unstage(&self, host: &SharedHost, volume_id: &str) -> Result<(), String> {
        let (plugin, staging, _, dir) = Self::plugin(host);
        let req = csi::NodeUnstageVolumeRequest {
            volume_id: volume_id.to_owned(),
            staging_target_path: text(&staging.join(volume_id)),
        };
        plugin.unstage_inline(&req).map_err(|e| status(&e, &dir))
    }
}

#[cfg(test)]
mod tests {
    use super::without_waits;

    #[test]
    fn a_status_keeps_no_wall_time() {
        assert_eq!(
            without_waits("is 16 bytes after 190.537µs; 20 bytes within 1.2ms: after all, 3s"),
            "is 16 bytes after <time>; 20 bytes within <time>: after all, 3s"
        );
    }
}
