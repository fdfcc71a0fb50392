//! The hosts: a Kubernetes node's kubelet and node plugin, as far as the simulation can run
//! them without a kernel.
//!
//! # What is real and what is a double
//!
//! Real (`pillar_csi::node::fuzzing`, the node plugin's own functions): the parsing of every
//! request (volume ID, capability, publish context, DH-HMAC-CHAP secrets), the N5 rule that
//! decides whether a stage is read-only (`stage_read_only`), the W9 rule that decides whether
//! a stage takes the reservation (`wants_reservation`), the reservation key of a host ID
//! (`pillar_host::resv::key_for_host`), and the stage records (`pillar_host::StageStore`, the
//! node plugin's durable records, written before the connect as N2 asks).
//!
//! Doubles, because the real thing needs a kernel: the NVMe/TCP connect is
//! `ConfigfsDouble::host_connects_with_secret` on the agent's target double, which decides as
//! the kernel does (the subsystem linked to the port, the host admitted, the secret right) and
//! keeps the host's controller until the host disconnects or the target cuts it (W7); the
//! mounts are this module's table (no mkfs, no mount(2): nothing in the simulation reads a
//! filesystem); the NVMe reservation is [`Reservations`], one Write Exclusive holder per
//! namespace, taken by preempt-and-abort as the node plugin does and lost with the target's
//! memory at a power loss. The node plugin's engine (`pillar_csi::node`'s stage, publish,
//! unstage) is not run: it calls mount(2), mkfs and NVMe ioctls directly, with no seam to put a
//! double behind. Its steps are followed here in its order: record, connect, reserve, mount,
//! record `Mounted`; unstage refuses while published, then unmounts, releases, disconnects and
//! removes the record.
//!
//! A host is live on a volume when it has it staged and holds a controller at the volume's
//! target: only then can it read or write it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use pillar_csi::csi;
use pillar_csi::node::AttachMode;
use pillar_csi::node::fuzzing::{
    self as rules, AttachTarget, stage_auth, stage_context, stage_read_only, wants_reservation,
};
use pillar_host::{StageMode, StagePhase, StageRecord, StageStore};
use pillar_nvmet::{ConfigfsDouble, HostNqn, VolumeId};

use crate::chaos::Chaos;

/// Each agent's target: its NVMe address, its name and its configfs double's root.
pub type Targets = Arc<BTreeMap<IpAddr, (String, PathBuf)>>;

/// The NVMe reservations of every target: per (agent, subsystem NQN) the key of the host that
/// holds Write Exclusive. Kernel memory: an agent's node losing power loses its entries.
#[derive(Debug, Default)]
pub struct Reservations(Mutex<BTreeMap<(String, String), u64>>);

impl Reservations {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<(String, String), u64>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The holder's key of `nqn` at `agent`.
    pub fn holder(&self, agent: &str, nqn: &str) -> Option<u64> {
        self.lock()
            .get(&(agent.to_owned(), nqn.to_owned()))
            .copied()
    }

    /// The target of `agent` lost its memory.
    pub fn forget(&self, agent: &str) {
        self.lock().retain(|(a, _), _| a != agent);
    }
}

/// A volume staged on a host.
#[derive(Clone, Debug)]
pub struct Staged {
    pub agent: String,
    pub nqn: String,
    pub port: u16,
    pub read_only: bool,
    /// Publish targets and whether each is read-only.
    pub published: BTreeMap<String, bool>,
}

/// One host (a node presenting one host NQN).
#[derive(Debug)]
pub struct SimHost {
    pub node: String,
    pub host_nqn: String,
    host_id: uuid::Uuid,
    records: StageStore,
    staging: PathBuf,
    /// Staged volumes, by volume ID.
    pub mounts: BTreeMap<String, Staged>,
    /// Volumes with an operation in progress (the node plugin's volume lock).
    busy: BTreeSet<String>,
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

/// The port of `root`'s target that listens on `traddr:trsvcid`.
fn port_of(root: &std::path::Path, traddr: IpAddr, trsvcid: u16) -> Result<u16, String> {
    let state = pillar_nvmet::observe(root).map_err(err)?;
    state
        .ports
        .iter()
        .find(|(_, p)| p.traddr == traddr.to_string() && p.trsvcid == trsvcid.to_string())
        .and_then(|(id, _)| id.to_string().parse().ok())
        .ok_or_else(|| format!("no port on {traddr}:{trsvcid}"))
}

impl SimHost {
    /// Host `host_nqn` of `node`, its stage records under `dir`.
    pub fn new(node: &str, host_nqn: &str, dir: &std::path::Path) -> Result<Self, String> {
        let records = StageStore::open(dir).map_err(err)?;
        // The host ID the NQN carries (`...:uuid:<host ID>`), as nvme-cli makes them.
        let host_id = host_nqn
            .rsplit_once("uuid:")
            .and_then(|(_, id)| uuid::Uuid::parse_str(id).ok())
            .ok_or_else(|| format!("{host_nqn} carries no host ID"))?;
        Ok(Self {
            node: node.to_owned(),
            host_nqn: host_nqn.to_owned(),
            host_id,
            records,
            staging: dir.join("staging"),
            mounts: BTreeMap::new(),
            busy: BTreeSet::new(),
        })
    }

    /// Whether the host holds a controller of `staged`'s subsystem at its target.
    pub fn live(&self, staged: &Staged, targets: &Targets) -> bool {
        let Some((_, root)) = targets.values().find(|(a, _)| *a == staged.agent) else {
            return false;
        };
        ConfigfsDouble::create(root.clone())
            .and_then(|d| d.controllers(&staged.nqn))
            .is_ok_and(|c| c.contains(&(staged.port, self.host_nqn.clone())))
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

/// Frees the volume's lock when the operation ends, however it ends.
struct Busy<'a>(&'a SharedHost, String);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        lock_host(self.0).busy.remove(&self.1);
    }
}

fn take<'a>(host: &'a SharedHost, volume: &str) -> Result<Busy<'a>, String> {
    if !lock_host(host).busy.insert(volume.to_owned()) {
        return Err(format!("Aborted: an operation on {volume} is in progress"));
    }
    Ok(Busy(host, volume.to_owned()))
}

impl Fabric {
    /// NodeStageVolume with `publication`'s context and the node's `secrets`.
    pub async fn stage(
        &self,
        host: &SharedHost,
        volume_id: &str,
        publication: &Publication,
        secrets: &HashMap<String, String>,
    ) -> Result<(), String> {
        let volume = rules::volume_id(volume_id).map_err(err)?;
        let cap = rules::capability(Some(&publication.capability)).map_err(err)?;
        let (host_nqn, host_id) = {
            let h = lock_host(host);
            (h.host_nqn.clone(), h.host_id)
        };
        let nqn_of_host = HostNqn::parse(&host_nqn).map_err(err)?;
        let ctx = stage_context(
            &volume,
            &publication.context,
            &AttachMode::NvmeTcp,
            &nqn_of_host,
            host_id,
        )
        .map_err(err)?;
        let AttachTarget::Nvme(opts) = &ctx.target else {
            return Err("not an NVMe/TCP context".into());
        };
        let auth = stage_auth(&volume, &publication.context, secrets).map_err(err)?;
        let read_only = stage_read_only(&cap, &ctx);
        let reserve = wants_reservation(&cap, read_only);
        let (traddr, trsvcid) = (opts.traddr, opts.trsvcid);
        let nqn = ctx.nqn.as_str().to_owned();
        let _busy = take(host, volume_id)?;
        let (agent, root) = self
            .targets
            .get(&traddr)
            .cloned()
            .ok_or_else(|| format!("no target at {traddr}"))?;
        let secret = auth.as_ref().map(|a| a.secret.expose().to_owned());
        if let Some(staged) = lock_host(host).mounts.get(volume_id).cloned() {
            if staged.read_only != read_only {
                return Err(format!(
                    "AlreadyExists: {volume_id} is staged {}",
                    if staged.read_only {
                        "read-only"
                    } else {
                        "read-write"
                    }
                ));
            }
            // Staged already; the kernel's host reconnects on its own after a target restart
            // (ctrl_loss_tmo), admitted only if the target's ACL still names it.
            let double = ConfigfsDouble::create(root).map_err(err)?;
            let _ = double.host_connects_with_secret(
                &staged.nqn,
                &host_nqn,
                staged.port,
                secret.as_deref(),
            );
            return Ok(());
        }
        let mut record = StageRecord {
            volume: volume.clone(),
            nqn: ctx.nqn.clone(),
            hostnqn: nqn_of_host,
            traddr,
            trsvcid,
            device: None,
            staging_path: lock_host(host).staging.join(volume_id),
            mode: StageMode::Filesystem {
                fs_type: pillar_csi::node::DEFAULT_FS,
            },
            phase: StagePhase::Connecting,
            reservation: reserve,
        };
        // N2: the record first.
        lock_host(host).records.write(&record).map_err(err)?;
        // The connect takes a while: other operations run meanwhile.
        tokio::time::sleep(self.chaos.pause(50)).await;
        let double = ConfigfsDouble::create(root.clone()).map_err(err)?;
        let port = port_of(&root, traddr, trsvcid)?;
        double
            .host_connects_with_secret(&nqn, &host_nqn, port, secret.as_deref())
            .map_err(|e| format!("connect to {nqn} refused: {e}"))?;
        if reserve {
            // W9: Write Exclusive, preempting a stale holder.
            let key = pillar_host::resv::key_for_host(&host_id);
            self.reservations
                .lock()
                .insert((agent.clone(), nqn.clone()), key);
        }
        record.phase = StagePhase::Mounted;
        let mut h = lock_host(host);
        h.records.write(&record).map_err(err)?;
        h.mounts.insert(
            volume_id.to_owned(),
            Staged {
                agent,
                nqn,
                port,
                read_only,
                published: BTreeMap::new(),
            },
        );
        Ok(())
    }

    /// NodePublishVolume at `target`.
    pub fn publish(
        &self,
        host: &SharedHost,
        volume_id: &str,
        target: &str,
        publication: &Publication,
    ) -> Result<(), String> {
        let cap = rules::capability(Some(&publication.capability)).map_err(err)?;
        let readonly = publication.readonly || cap.reader_only();
        let _busy = take(host, volume_id)?;
        let mut h = lock_host(host);
        let Some(staged) = h.mounts.get_mut(volume_id) else {
            return Err(format!("FailedPrecondition: {volume_id} is not staged"));
        };
        match staged.published.get(target) {
            Some(&ro) if ro != readonly => Err(format!(
                "AlreadyExists: {target} is published with the other access"
            )),
            Some(_) => Ok(()),
            None => {
                staged.published.insert(target.to_owned(), readonly);
                Ok(())
            }
        }
    }

    /// NodeUnpublishVolume of `target`.
    pub fn unpublish(
        &self,
        host: &SharedHost,
        volume_id: &str,
        target: &str,
    ) -> Result<(), String> {
        let _busy = take(host, volume_id)?;
        if let Some(staged) = lock_host(host).mounts.get_mut(volume_id) {
            staged.published.remove(target);
        }
        Ok(())
    }

    /// NodeUnstageVolume.
    pub fn unstage(&self, host: &SharedHost, volume_id: &str) -> Result<(), String> {
        let volume: VolumeId = rules::volume_id(volume_id).map_err(err)?;
        let _busy = take(host, volume_id)?;
        let mut h = lock_host(host);
        let record = h.records.read(&volume).map_err(err)?;
        let staged = h.mounts.get(volume_id).cloned();
        if staged.as_ref().is_some_and(|s| !s.published.is_empty()) {
            return Err(format!(
                "FailedPrecondition: {volume_id} is still published"
            ));
        }
        let Some(record) = record else {
            return Ok(());
        };
        let nqn = record.nqn.as_str().to_owned();
        if let Some((agent, root)) = self.targets.get(&record.traddr) {
            if record.reservation {
                let key = pillar_host::resv::key_for_host(&h.host_id);
                let mut held = self.reservations.lock();
                if held.get(&(agent.clone(), nqn.clone())) == Some(&key) {
                    held.remove(&(agent.clone(), nqn.clone()));
                }
            }
            ConfigfsDouble::create(root.clone())
                .and_then(|d| d.host_disconnects(&nqn, &h.host_nqn))
                .map_err(err)?;
        }
        h.mounts.remove(volume_id);
        h.records.remove(&volume).map_err(err)?;
        Ok(())
    }
}
