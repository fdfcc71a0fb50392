//! The operations a seed draws: the controller's (through a replica), the kubelets' (through
//! the hosts, `crate::host`), and the agent crash, each from the seed's generator.
//!
//! The weights below decide which operation a roll draws; a weight added at the end (as
//! NodeExpandVolume's was) leaves every other range where it was but changes the roll's
//! modulus, so a seed draws other operations than before it.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};

use pillar_csi::controller::{Controller, code_of, volume_id_for_name};
use pillar_csi::{context, csi};
use pillar_state::StateStore;

use crate::host::{Publication, SharedHost, lock_host};
use crate::invariants::{NodeAck, StageKey};
use crate::world::{World, host};

/// One operation, run as a task.
pub(crate) type Op = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// What a step does.
pub(crate) enum Draw {
    /// Start this operation.
    Task(String, Op),
    /// An agent crash chance.
    Crash,
    /// Nothing (a kubelet operation with nothing to act on), and why.
    Skip(String),
}

/// The step's random choices, drawn in a fixed order.
struct Pick {
    replica: usize,
    name: String,
    id: String,
    node: u32,
    variant: u32,
    roll: u64,
    snapshot: String,
}

/// Operation weights: controller operations first, as before the hosts came, then the new ones.
const CREATE: u64 = 14;
const SNAPSHOT: u64 = CREATE + 8;
const PUBLISH: u64 = SNAPSHOT + 30;
const UNPUBLISH: u64 = PUBLISH + 28;
const DELETE: u64 = UNPUBLISH + 11;
const DELETE_SNAPSHOT: u64 = DELETE + 2;
const RESYNC: u64 = DELETE_SNAPSHOT + 4;
const CRASH: u64 = RESYNC + 3;
const EXPAND: u64 = CRASH + 6;
const NODE_STAGE: u64 = EXPAND + 14;
const NODE_PUBLISH: u64 = NODE_STAGE + 6;
const NODE_UNPUBLISH: u64 = NODE_PUBLISH + 5;
const NODE_UNSTAGE: u64 = NODE_UNPUBLISH + 8;
const NODE_EXPAND: u64 = NODE_UNSTAGE + 6;

fn pick(w: &World) -> Pick {
    let c = &w.chaos;
    let volumes = w.config.volumes as u64;
    let replica = usize::try_from(c.below(2)).unwrap_or(0);
    // One name in four is a restore's ("vol-r<k>"): restores, and what happens to them.
    let name = if c.below(4) == 0 {
        format!("vol-r{}", c.below(volumes))
    } else {
        format!("vol-{}", c.below(volumes))
    };
    let id = volume_id_for_name(&name)
        .map(|v| v.to_string())
        .unwrap_or_default();
    let node = 1 + u32::try_from(c.below(u64::from(w.config.nodes))).unwrap_or(0);
    let variant = u32::try_from(c.below(2)).unwrap_or(0);
    let roll = c.below(NODE_EXPAND);
    let snapshot = format!("snap-{}", c.below(volumes));
    Pick {
        replica,
        name,
        id,
        node,
        variant,
        roll,
        snapshot,
    }
}

fn status(e: &pillar_csi::controller::ControllerError) -> String {
    format!("{:?}: {e}", code_of(e))
}

/// Draws step `step`'s operation.
pub(crate) fn draw(w: &World, _step: usize) -> Draw {
    let p = pick(w);
    let replica = Arc::clone(&w.replicas[p.replica]);
    let r = p.replica;
    let task = |label: String, op: Op| Draw::Task(format!("replica {r}: {label}"), op);
    match p.roll {
        0..CREATE => {
            let (label, op) = create_volume(w, &p, replica);
            task(label, op)
        }
        CREATE..SNAPSHOT => {
            let req = csi::CreateSnapshotRequest {
                name: p.snapshot.clone(),
                source_volume_id: p.id.clone(),
                ..Default::default()
            };
            task(
                format!("CreateSnapshot {} of {}", p.snapshot, p.name),
                Box::pin(async move {
                    replica
                        .create_snapshot(req)
                        .await
                        .map(drop)
                        .map_err(|e| status(&e))
                }),
            )
        }
        SNAPSHOT..PUBLISH => {
            let (label, op) = publish(w, &p, replica);
            task(label, op)
        }
        PUBLISH..UNPUBLISH => {
            let (label, op) = unpublish(w, &p, replica);
            task(label, op)
        }
        UNPUBLISH..DELETE => {
            let req = csi::DeleteVolumeRequest {
                volume_id: p.id.clone(),
                ..Default::default()
            };
            task(
                format!("DeleteVolume {}", p.name),
                Box::pin(async move {
                    replica
                        .delete_volume(req)
                        .await
                        .map(drop)
                        .map_err(|e| status(&e))
                }),
            )
        }
        DELETE..DELETE_SNAPSHOT => {
            let req = csi::DeleteSnapshotRequest {
                snapshot_id: p.snapshot.clone(),
                ..Default::default()
            };
            task(
                format!("DeleteSnapshot {}", p.snapshot),
                Box::pin(async move {
                    replica
                        .delete_snapshot(req)
                        .await
                        .map(drop)
                        .map_err(|e| status(&e))
                }),
            )
        }
        DELETE_SNAPSHOT..RESYNC => task(
            "resync waiting agents".to_owned(),
            Box::pin(async move {
                replica.resync_waiting_agents().await;
                Ok(())
            }),
        ),
        RESYNC..CRASH => Draw::Crash,
        CRASH..EXPAND => {
            let (label, op) = expand(w, &p, replica);
            task(label, op)
        }
        _ => kubelet(w, &p),
    }
}

/// The capability every volume is created with and published with, in `mode`.
pub fn capability(mode: csi::volume_capability::access_mode::Mode) -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume};
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode.into() }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
    }
}

fn create_volume(w: &World, p: &Pick, replica: Arc<Controller>) -> (String, Op) {
    use csi::volume_capability::access_mode::Mode;
    let mut parameters = HashMap::new();
    let agent = w.chaos.below(w.config.agents as u64);
    // A restore's name: a volume restored from a snapshot (on the snapshot's agent).
    let restore = p.name.starts_with("vol-r");
    if !restore {
        parameters.insert(
            pillar_csi::controller::params::AGENT.to_owned(),
            format!("storage-{agent}"),
        );
    }
    let req = csi::CreateVolumeRequest {
        name: p.name.clone(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: 16 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![capability(Mode::SingleNodeWriter)],
        parameters,
        volume_content_source: restore.then(|| csi::VolumeContentSource {
            r#type: Some(csi::volume_content_source::Type::Snapshot(
                csi::volume_content_source::SnapshotSource {
                    snapshot_id: p.snapshot.clone(),
                },
            )),
        }),
        ..Default::default()
    };
    let label = if restore {
        format!("CreateVolume {} from {}", p.name, p.snapshot)
    } else {
        format!("CreateVolume {} on storage-{agent}", p.name)
    };
    (
        label,
        Box::pin(async move {
            replica
                .create_volume(req)
                .await
                .map(drop)
                .map_err(|e| status(&e))
        }),
    )
}

/// ControllerPublish: read-write single-node mostly, sometimes read-only (ROX, or a readonly
/// single-writer mode); the kubelet keeps the answer for its NodeStage.
fn publish(w: &World, p: &Pick, replica: Arc<Controller>) -> (String, Op) {
    use csi::volume_capability::access_mode::Mode;
    let (mode, readonly) = match w.chaos.below(10) {
        0..5 => (Mode::SingleNodeWriter, false),
        5..7 => (Mode::MultiNodeReaderOnly, false),
        7 => (Mode::SingleNodeWriter, true),
        _ => (Mode::MultiNodeSingleWriter, true),
    };
    let node_id = format!("node-{}/{}", p.node, host(p.node, p.variant));
    let cap = capability(mode);
    let req = csi::ControllerPublishVolumeRequest {
        volume_id: p.id.clone(),
        node_id: node_id.clone(),
        volume_capability: Some(cap.clone()),
        readonly,
        ..Default::default()
    };
    let publications = Arc::clone(&w.publications);
    let key = (p.id.clone(), node_id.clone());
    // Three times in four the kubelet stages right away, as it does once the attach is done.
    let stage = (w.chaos.below(4) != 0).then(|| kubelet_stage(w, &p.id, &node_id));
    (
        format!(
            "Publish {} to {node_id} ({mode:?}, readonly {readonly})",
            p.name
        ),
        Box::pin(async move {
            let answer = replica.publish(req).await.map_err(|e| status(&e))?;
            let publication = Publication {
                context: answer.publish_context,
                capability: cap,
                readonly,
            };
            publications
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(key, publication.clone());
            match stage.flatten() {
                Some(stage) => stage(publication).await,
                None => Ok(()),
            }
        }),
    )
}

fn unpublish(w: &World, p: &Pick, replica: Arc<Controller>) -> (String, Op) {
    // Now and then "from every node" (an empty node ID).
    let node_id = if w.chaos.below(5) == 0 {
        String::new()
    } else {
        format!("node-{}/{}", p.node, host(p.node, p.variant))
    };
    let req = csi::ControllerUnpublishVolumeRequest {
        volume_id: p.id.clone(),
        node_id: node_id.clone(),
        ..Default::default()
    };
    let publications = Arc::clone(&w.publications);
    let id = p.id.clone();
    (
        format!("Unpublish {} from {node_id:?}", p.name),
        Box::pin(async move {
            replica.unpublish(req).await.map_err(|e| status(&e))?;
            publications
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .retain(|(v, n), _| *v != id || (!node_id.is_empty() && *n != node_id));
            Ok(())
        }),
    )
}

/// ControllerExpandVolume to 17-20 MiB; an answer for the lifecycle seen before and after the
/// call is an acknowledged expansion (invariant 8). Three times in four the kubelets holding
/// the volume staged then expand it on their node, as they do once the resizer recorded the
/// new capacity.
fn expand(w: &World, p: &Pick, replica: Arc<Controller>) -> (String, Op) {
    let size = (16 + 1 + w.chaos.below(4)) << 20;
    let req = csi::ControllerExpandVolumeRequest {
        volume_id: p.id.clone(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: i64::try_from(size).unwrap_or(i64::MAX),
            limit_bytes: 0,
        }),
        ..Default::default()
    };
    let store = Arc::clone(&w.store);
    let expansions = Arc::clone(&w.expansions);
    let node_resizes = Arc::clone(&w.node_resizes);
    let id = p.id.clone();
    let kubelets = (w.chaos.below(4) != 0).then(|| Kubelets::of(w));
    (
        format!("ExpandVolume {} to {size}", p.name),
        Box::pin(async move {
            let before = lifecycle(&store, &id);
            let answer = replica.expand(req).await.map_err(|e| status(&e))?;
            let Some(uid) = before.filter(|b| Some(b) == lifecycle(&store, &id).as_ref()) else {
                return Ok(());
            };
            let acked = u64::try_from(answer.capacity_bytes).unwrap_or(0);
            let key = (id.clone(), uid);
            {
                let mut e = expansions.lock().unwrap_or_else(PoisonError::into_inner);
                let kept = e.entry(key.clone()).or_default();
                *kept = (*kept).max(acked);
            }
            if !answer.node_expansion_required {
                return Ok(());
            }
            let capacity = {
                let mut r = node_resizes.lock().unwrap_or_else(PoisonError::into_inner);
                let capacity = r.entry(key).or_default();
                *capacity = (*capacity).max(acked);
                *capacity
            };
            if let Some(kubelets) = kubelets {
                kubelets.expand_everywhere(&id, capacity).await;
            }
            Ok(())
        }),
    )
}

/// The lifecycle (UID) volume `id`'s record holds now.
fn lifecycle(store: &pillar_state::MemoryStore, id: &str) -> Option<String> {
    store
        .records::<pillar_state::crd::PillarVolumeState>()
        .ok()
        .and_then(|r| r.get(id).and_then(|v| v.metadata.uid.clone()))
}

/// The index in `w.hosts` of the host a node ID names.
fn host_index(w: &World, node_id: &str) -> Option<usize> {
    (1..=w.config.nodes)
        .flat_map(|n| (0..2).map(move |v| (n, v)))
        .position(|(n, v)| node_id == format!("node-{n}/{}", host(n, v)))
}

/// A kubelet's NodeStage of volume `id` on the host `node_id` names, made once the publication
/// is known.
fn kubelet_stage(
    w: &World,
    id: &str,
    node_id: &str,
) -> Option<impl FnOnce(Publication) -> Op + Send + 'static> {
    let index = host_index(w, node_id)?;
    let host: SharedHost = Arc::clone(&w.hosts[index]);
    let store = Arc::clone(&w.store);
    let fabric = w.fabric.clone();
    let kubelets = Kubelets::of(w);
    let node_resizes = Arc::clone(&w.node_resizes);
    let id = id.to_owned();
    let (node, host_nqn) = node_id
        .split_once('/')
        .map(|(n, h)| (n.to_owned(), h.to_owned()))?;
    Some(move |publication: Publication| -> Op {
        Box::pin(async move {
            // The CO passes the node's secret (W10) as the node-stage secrets.
            let c = store
                .node_credentials(&node, &host_nqn)
                .await
                .map_err(|e| e.to_string())?;
            let secrets = HashMap::from([
                (context::SECRET_DHCHAP.to_owned(), c.secret),
                (context::SECRET_DHCHAP_CTRL.to_owned(), c.ctrl_secret),
            ]);
            fabric
                .stage(&host, &id, &publication, &secrets)
                .await
                .map_err(|e| format!("published; NodeStage: {e}"))?;
            // A resize of the lifecycle is pending: kubelet expands right after NodeStage.
            let pending = lifecycle(&store, &id).and_then(|uid| {
                node_resizes
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&(id.clone(), uid))
                    .copied()
            });
            if let Some(required) = pending {
                let result = kubelets.expand(index, id.clone(), required).await;
                fabric.chaos.trace(format!(
                    "  kubelet after NodeStage: NodeExpand {id} on host {index} to {required} -> {}",
                    result.err().unwrap_or_else(|| "ok".into())
                ));
            }
            Ok(())
        })
    })
}

/// One of the publications ControllerPublish answered (drawn), with its (volume ID, node ID).
fn drawn_publication(w: &World) -> Option<((String, String), Publication)> {
    let publications = w
        .publications
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let len = publications.len() as u64;
    if len == 0 {
        return None;
    }
    publications
        .iter()
        .nth(usize::try_from(w.chaos.below(len)).unwrap_or(0))
        .map(|(k, v)| (k.clone(), v.clone()))
}

/// A kubelet's call: a stage or publish of a publication ControllerPublish answered (one drawn
/// among them), an unpublish or unstage of a volume a host (drawn) holds staged.
fn kubelet(w: &World, p: &Pick) -> Draw {
    let drawn = drawn_publication(w);
    match p.roll {
        EXPAND..NODE_PUBLISH => {
            let Some(((id, node_id), publication)) = drawn else {
                return Draw::Skip("kubelet: nothing published".into());
            };
            kubelet_stage_or_publish(w, p, id, node_id, publication)
        }
        NODE_UNSTAGE.. => kubelet_expand(w),
        _ => kubelet_unpublish_or_unstage(w, p),
    }
}

fn kubelet_stage_or_publish(
    w: &World,
    p: &Pick,
    id: String,
    node_id: String,
    publication: Publication,
) -> Draw {
    let Some(index) = host_index(w, &node_id) else {
        return Draw::Skip(format!("kubelet: no host {node_id}"));
    };
    let host: SharedHost = Arc::clone(&w.hosts[index]);
    let fabric = w.fabric.clone();
    let at = format!("{id} on {node_id}");
    if p.roll >= NODE_STAGE {
        let target = id.clone();
        return Draw::Task(
            format!("NodePublish {at}"),
            Box::pin(async move { fabric.publish(&host, &id, &target, &publication) }),
        );
    }
    let Some(stage) = kubelet_stage(w, &id, &node_id) else {
        return Draw::Skip(format!("kubelet: no host {node_id}"));
    };
    Draw::Task(format!("NodeStage {at}"), stage(publication))
}

fn kubelet_unpublish_or_unstage(w: &World, p: &Pick) -> Draw {
    let index = usize::try_from((p.node - 1) * 2 + p.variant).unwrap_or(0);
    let host: SharedHost = Arc::clone(&w.hosts[index]);
    let staged: Vec<String> = crate::host::lock_host(&host).staged().into_keys().collect();
    if staged.is_empty() {
        return Draw::Skip(format!("kubelet: nothing staged on host {index}"));
    }
    let id = staged[usize::try_from(w.chaos.below(staged.len() as u64)).unwrap_or(0)].clone();
    let at = format!("{id} on host {index}");
    let fabric = w.fabric.clone();
    if p.roll < NODE_UNPUBLISH {
        let target = id.clone();
        Draw::Task(
            format!("NodeUnpublish {at}"),
            Box::pin(async move { fabric.unpublish(&host, &id, &target) }),
        )
    } else {
        Draw::Task(
            format!("NodeUnstage {at}"),
            Box::pin(async move { fabric.unstage(&host, &id) }),
        )
    }
}

/// A kubelet's NodeExpandVolume of a volume a host holds staged once a ControllerExpandVolume
/// of its lifecycle answered `node_expansion_required` (one such stage drawn among every
/// host's, as the kubelet of each node acts on its own: a retry, or the expansion at a pod's
/// mount), to the capacity answered.
fn kubelet_expand(w: &World) -> Draw {
    let mut pending = Vec::new();
    {
        let resizes = w
            .node_resizes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for (index, shared) in w.hosts.iter().enumerate() {
            for id in lock_host(shared).staged().into_keys() {
                let uid = lifecycle(&w.store, &id);
                if let Some(&required) = uid.and_then(|uid| resizes.get(&(id.clone(), uid))) {
                    pending.push((index, id, required));
                }
            }
        }
    }
    if pending.is_empty() {
        return Draw::Skip("kubelet: no staged volume has an expansion to apply".into());
    }
    let drawn = usize::try_from(w.chaos.below(pending.len() as u64)).unwrap_or(0);
    let (index, id, required) = pending.swap_remove(drawn.min(pending.len() - 1));
    let kubelets = Kubelets::of(w);
    Draw::Task(
        format!("NodeExpand {id} on host {index} to {required}"),
        Box::pin(async move { kubelets.expand(index, id, required).await }),
    )
}

/// What a kubelet's NodeExpandVolume needs of the world.
#[derive(Clone)]
struct Kubelets {
    hosts: Vec<SharedHost>,
    fabric: crate::host::Fabric,
    store: Arc<pillar_state::MemoryStore>,
    publications: Arc<Mutex<BTreeMap<(String, String), Publication>>>,
    acks: Arc<Mutex<BTreeMap<StageKey, NodeAck>>>,
}

impl Kubelets {
    fn of(w: &World) -> Self {
        Self {
            hosts: w.hosts.clone(),
            fabric: w.fabric.clone(),
            store: Arc::clone(&w.store),
            publications: Arc::clone(&w.publications),
            acks: Arc::clone(&w.node_expansions),
        }
    }

    /// NodeExpandVolume of `id` on host `index` to `required` bytes, at the staging path or one
    /// of the volume's publish targets (drawn when the call starts), with the PV's capability
    /// (what ControllerPublish was asked for this node); an answer is an acknowledged node
    /// expansion of the stage standing (invariant 9).
    async fn expand(&self, index: usize, id: String, required: u64) -> Result<(), String> {
        let host = &self.hosts[index];
        let targets: Vec<String> = lock_host(host)
            .staged()
            .remove(&id)
            .map(|s| s.published.into_keys().collect())
            .unwrap_or_default();
        let chaos = &self.fabric.chaos;
        let at = usize::try_from(chaos.below(targets.len() as u64 + 1))
            .ok()
            .and_then(|i| i.checked_sub(1))
            .and_then(|i| targets.get(i).cloned());
        let node_id = {
            let h = lock_host(host);
            format!("{}/{}", h.node, h.host_nqn)
        };
        let cap = self
            .publications
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(id.clone(), node_id))
            .map_or_else(
                || capability(csi::volume_capability::access_mode::Mode::SingleNodeWriter),
                |p| p.capability.clone(),
            );
        let answered = self
            .fabric
            .expand(host, &id, at.as_deref(), &cap, required)
            .await
            .map_err(|e| format!("at {at:?}: {e}"))?;
        // Nothing ran since the answer (the call runs whole and this task has not yielded
        // since): the stage, the lifecycle and the namespace are as the answer left them.
        acknowledge_node_expansion(host, index, &self.store, &self.acks, id, answered);
        Ok(())
    }

    /// Every host holding `id` staged expands it to `required`, one after the other, each
    /// call traced with its result.
    async fn expand_everywhere(&self, id: &str, required: u64) {
        let staged_on: Vec<usize> = (0..self.hosts.len())
            .filter(|&i| lock_host(&self.hosts[i]).staged().contains_key(id))
            .collect();
        for index in staged_on {
            let result = self.expand(index, id.to_owned(), required).await;
            self.fabric.chaos.trace(format!(
                "  kubelet after ExpandVolume: NodeExpand {id} on host {index} to {required} -> {}",
                result.err().unwrap_or_else(|| "ok".into())
            ));
        }
    }
}

/// Records NodeExpandVolume's answer `answered` for volume `id` on host `index` (invariant
/// 9), right after it came: as an answer for the stage standing now and the lifecycle the
/// record holds now, with what the target's namespace holds now.
pub(crate) fn acknowledge_node_expansion(
    host: &SharedHost,
    index: usize,
    store: &pillar_state::MemoryStore,
    acks: &Mutex<BTreeMap<StageKey, NodeAck>>,
    id: String,
    answered: u64,
) {
    let h = lock_host(host);
    let (Some(uid), Some(staged)) = (lifecycle(store, &id), h.staged().remove(&id)) else {
        return;
    };
    let held = h.namespace_bytes(&staged);
    let mut acks = acks.lock().unwrap_or_else(PoisonError::into_inner);
    let ack = acks.entry((index, id, uid, staged.mount_id)).or_default();
    ack.bytes = ack.bytes.max(answered);
    if let Some(held) = held.filter(|h| answered > *h) {
        ack.overclaim = ack.overclaim.or(Some((answered, held)));
    }
}
