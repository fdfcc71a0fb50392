//! CreateVolume, DeleteVolume and ControllerExpandVolume: a volume's lifecycle.
//!
//! - The PillarVolumeState is created before anything exists on a storage node (F10); a volume
//!   without one owns nothing, and deleting it needs no agent call.
//! - Every agent call carries a fresh token (F1, F2), taken by compare-and-swap pinned to the
//!   lifecycle the call started on (F3).
//! - DeleteVolume refuses while a publication is recorded (W5) and fails closed without the
//!   PillarAgent (C1).
//! - A size the agent grew the volume to is recorded, or the call is ABORTED: it never reports
//!   a size the record does not hold.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use pillar_agent_api::v1 as agent_api;
use pillar_state::crd::{
    ContentSourceKind, ContentSourceRef, PillarAgent, PillarProtocol, PillarVolumeState,
    PillarVolumeStateSpec,
};
use pillar_state::store::StoreError;
use tonic::Status;

use super::agent::{VolumeAgent, export_request};
use super::error::ControllerError;
use super::record::{Precondition, Write, always, not_deleting, token};
use super::request::{self, Create, Source, VolumeRef};
use super::{Controller, params, topology};
use crate::{context, csi};

/// Where a new volume goes: agent, its topology, pool, size, and the content source.
type Placement = (
    String,
    BTreeMap<String, String>,
    String,
    u64,
    Option<ContentSourceRef>,
);

fn saturating_i64(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

impl Controller {
    /// The agent and pool for a volume: the StorageClass's, or the only ones there are; when
    /// the request names topologies, only an agent reachable from a requisite one, the most
    /// preferred first (`topology::rank`), with the named pool or its only pool.
    pub(super) async fn pick_agent(
        &self,
        parameters: &HashMap<String, String>,
        requirement: Option<&csi::TopologyRequirement>,
    ) -> Result<(PillarAgent, String), ControllerError> {
        let invalid = ControllerError::InvalidArgument;
        let pool_of = |agent: &PillarAgent| -> Result<String, ControllerError> {
            match (parameters.get(params::POOL), agent.spec.pools.as_slice()) {
                (Some(p), pools) if pools.iter().any(|x| x.name == *p) => Ok(p.clone()),
                (Some(p), _) => Err(invalid(format!("agent has no pool {p:?}"))),
                (None, [only]) => Ok(only.name.clone()),
                (None, _) => Err(invalid(format!(
                    "name the pool with the {} parameter",
                    params::POOL
                ))),
            }
        };
        if let Some(name) = parameters.get(params::AGENT) {
            let agent = self.store.get_agent(name).await?.ok_or_else(|| {
                invalid(format!(
                    "PillarAgent {name:?} named in {} does not exist",
                    params::AGENT
                ))
            })?;
            if topology::rank(std::slice::from_ref(&agent), requirement).is_empty() {
                return Err(ControllerError::Unreachable(format!(
                    "PillarAgent {name:?} is not reachable from the requested topology"
                )));
            }
            let pool = pool_of(&agent)?;
            return Ok((agent, pool));
        }
        let all = self.store.list_agents().await?;
        if requirement.is_none() && all.len() != 1 {
            return Err(invalid(format!(
                "{} agents exist; name one with the {} parameter",
                all.len(),
                params::AGENT
            )));
        }
        let ranked = topology::rank(&all, requirement);
        let mut refused = None;
        for agent in ranked {
            match pool_of(agent) {
                Ok(pool) => return Ok((agent.clone(), pool)),
                Err(e) => refused = Some(e),
            }
        }
        Err(refused.unwrap_or_else(|| {
            ControllerError::Unreachable(format!(
                "none of the {} PillarAgents is reachable from the requested topology",
                all.len()
            ))
        }))
    }

    async fn pick_protocol(
        &self,
        parameters: &HashMap<String, String>,
    ) -> Result<PillarProtocol, ControllerError> {
        if let Some(name) = parameters.get(params::PROTOCOL) {
            return self
                .store
                .get_protocol(name)
                .await?
                .ok_or_else(|| ControllerError::ProtocolMissing(name.clone()));
        }
        let mut all = self.store.list_protocols().await?;
        if all.len() != 1 {
            return Err(ControllerError::InvalidArgument(format!(
                "{} protocols exist; name one with the {} parameter",
                all.len(),
                params::PROTOCOL
            )));
        }
        Ok(all.remove(0))
    }

    /// The volume's record: the existing one if it matches the request, else a new one (F10).
    async fn find_or_record(&self, req: &Create) -> Result<PillarVolumeState, ControllerError> {
        let name = req.volume.to_string();
        let mode = req.capability.mode;
        let volume_mode = req.capability.volume_mode();
        if let Some(v) = self.store.get_volume(&name).await? {
            if v.status_or_default().deleting {
                return Err(ControllerError::Deleting { volume: name });
            }
            let same_source = match (&req.source, &v.spec.content_source) {
                (None, None) => true,
                (Some(Source::Snapshot(VolumeRef::Pillar(id))), Some(s)) => {
                    s.kind == ContentSourceKind::Snapshot && s.id == id.as_str()
                }
                (Some(Source::Volume(VolumeRef::Pillar(id))), Some(s)) => {
                    s.kind == ContentSourceKind::Volume && s.id == id.as_str()
                }
                _ => false,
            };
            if v.spec.access_mode != mode
                || v.spec.volume_mode != volume_mode
                || !req.size.fits(v.spec.size_bytes)
                || !same_source
            {
                let what = format!(
                    "{:?}/{:?} with {} bytes",
                    v.spec.access_mode, v.spec.volume_mode, v.spec.size_bytes
                );
                return Err(ControllerError::AlreadyExists(name, what));
            }
            return Ok(v);
        }
        let (agent, topology, pool, size, content_source) = match &req.source {
            None => {
                let (agent, pool) = self
                    .pick_agent(&req.parameters, req.topology.as_ref())
                    .await?;
                let name = agent.metadata.name.clone().unwrap_or_default();
                (name, agent.spec.topology, pool, req.size.size(), None)
            }
            Some(source) => self.source_placement(req, source).await?,
        };
        let protocol = self.pick_protocol(&req.parameters).await?;
        let fs = request::volume_fs(&req.capability, protocol.spec.nvme_tcp.fs_type);
        let size = request::fit_filesystem(&name, size, req.size, fs)?;
        let spec = PillarVolumeStateSpec {
            content_source,
            topology,
            volume_id: name.clone(),
            agent,
            pool,
            size_bytes: size,
            access_mode: mode,
            volume_mode,
            protocol: protocol.metadata.name.clone().unwrap_or_default(),
            parameters: req
                .parameters
                .clone()
                .into_iter()
                .collect::<BTreeMap<_, _>>(),
        };
        match self.store.create_volume(&name, spec).await {
            Ok(v) => Ok(v),
            // Another replica recorded it first: retry, and find it.
            Err(StoreError::AlreadyExists { .. }) => {
                Err(ControllerError::Contention { volume: name })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Where a restore or clone goes and how large it is: its source's agent and pool (a copy
    /// stays in its source's pool), at least its source's size (smaller is OUT_OF_RANGE).
    async fn source_placement(
        &self,
        req: &Create,
        source: &Source,
    ) -> Result<Placement, ControllerError> {
        let (kind, id, uid, agent, pool, source_bytes) = match source {
            Source::Snapshot(id) => {
                let s = self.restorable_snapshot(id.clone()).await?;
                let bytes = s.status_or_default().size_bytes;
                let uid = s.metadata.uid.clone().unwrap_or_default();
                (
                    ContentSourceKind::Snapshot,
                    s.spec.snapshot_id,
                    uid,
                    s.spec.agent,
                    s.spec.pool,
                    bytes,
                )
            }
            Source::Volume(id) => {
                let id = id.clone().existing()?.to_string();
                let v = self
                    .store
                    .get_volume(&id)
                    .await?
                    .ok_or_else(|| ControllerError::VolumeNotFound(id.clone()))?;
                if v.status_or_default().deleting {
                    return Err(ControllerError::Deleting { volume: id });
                }
                let uid = v.metadata.uid.clone().unwrap_or_default();
                (
                    ContentSourceKind::Volume,
                    id,
                    uid,
                    v.spec.agent,
                    v.spec.pool,
                    v.spec.size_bytes,
                )
            }
        };
        for (param, wanted) in [(params::AGENT, &agent), (params::POOL, &pool)] {
            if let Some(named) = req.parameters.get(param)
                && named != wanted
            {
                return Err(ControllerError::InvalidArgument(format!(
                    "{param} is {named:?}, but a restore or clone is made where its source \
                     {id} lives ({wanted:?})"
                )));
            }
        }
        let record =
            self.store
                .get_agent(&agent)
                .await?
                .ok_or_else(|| ControllerError::AgentMissing {
                    volume: id.clone(),
                    agent: agent.clone(),
                })?;
        if topology::rank(std::slice::from_ref(&record), req.topology.as_ref()).is_empty() {
            return Err(ControllerError::Unreachable(format!(
                "{id} lives on PillarAgent {agent:?}, which is not reachable from the requested \
                 topology; a restore or clone is made where its source lives"
            )));
        }
        let size = req.size.required.max(source_bytes);
        if req.size.required != 0 && req.size.required < source_bytes
            || req.size.limit != 0 && req.size.limit < source_bytes
        {
            return Err(ControllerError::OutOfRange(format!(
                "{id} holds {source_bytes} bytes; the volume's capacity range cannot hold it"
            )));
        }
        Ok((
            agent,
            record.spec.topology,
            pool,
            size,
            Some(ContentSourceRef { kind, id, uid }),
        ))
    }

    /// CreateVolume: record, backing device, export.
    pub async fn create_volume(
        &self,
        req: csi::CreateVolumeRequest,
    ) -> Result<csi::CreateVolumeResponse, ControllerError> {
        let req = request::create(req)?;
        let name = req.volume.to_string();
        let _lock = self.locks.lock(name.clone()).await;
        let state = self.find_or_record(&req).await?;
        let target = self.volume_agent(&state).await?;
        let protocol = self.protocol_of(&state).await?;
        let created = self
            .call_agent(
                &target,
                "CreateVolume",
                None,
                &not_deleting,
                |mut c, token| {
                    let r = agent_api::CreateVolumeRequest {
                        token,
                        volume_id: name.clone(),
                        pool: state.spec.pool.clone(),
                        size_bytes: state.spec.size_bytes,
                        source: state.spec.content_source.as_ref().map(agent_source),
                    };
                    async move { c.create_volume(r).await }
                },
            )
            .await?;
        if req.size.limit != 0 && created.size_bytes > req.size.limit {
            return Err(ControllerError::OutOfRange(format!(
                "the pool rounds the volume to {} bytes, above limit_bytes {}",
                created.size_bytes, req.size.limit
            )));
        }
        let exported = self.export(&target, &protocol, None, &not_deleting).await?;
        tracing::info!(volume = %name, agent = %state.spec.agent, size = created.size_bytes, "volume created and exported");
        Ok(csi::CreateVolumeResponse {
            volume: Some(csi::Volume {
                capacity_bytes: saturating_i64(created.size_bytes),
                volume_id: name,
                volume_context: [(context::NQN.to_owned(), exported.subsystem_nqn)]
                    .into_iter()
                    .collect(),
                content_source: state.spec.content_source.as_ref().map(csi_source),
                accessible_topology: topology::accessible(&state.spec.topology),
            }),
        })
    }

    /// Exports the volume as its record says, with `token` (a fresh one taken while `still`
    /// holds when `None`), under `protocol`'s `acl`.
    pub(super) async fn export(
        &self,
        target: &VolumeAgent,
        protocol: &PillarProtocol,
        token: Option<agent_api::FencingToken>,
        still: &Precondition<'_>,
    ) -> Result<agent_api::ExportResponse, ControllerError> {
        let exported = self
            .call_agent(target, "Export", token, still, |mut c, token| {
                let store = Arc::clone(&self.store);
                let (name, uid) = (target.name.clone(), target.uid.clone());
                let protocol = protocol.clone();
                async move {
                    // The ACL is read after the token was taken: it is the one that token
                    // vouches for.
                    let current = store
                        .get_volume(&name)
                        .await
                        .map_err(|e| Status::unavailable(e.to_string()))?
                        .filter(|v| v.metadata.uid.as_deref() == Some(uid.as_str()))
                        .ok_or_else(|| Status::aborted(format!("volume {name} is gone")))?;
                    let request = export_request(&*store, &current, &protocol, token)
                        .await
                        .map_err(|e| match e {
                            StoreError::NoCredentials { .. } => {
                                Status::failed_precondition(e.to_string())
                            }
                            other => Status::unavailable(other.to_string()),
                        })?;
                    c.export(request).await
                }
            })
            .await?;
        if exported.identity_adopted {
            tracing::warn!(volume = %target.name, "the storage node kept a live non-derived identity for this volume; nodes will refuse to stage it until it is re-exported");
        }
        Ok(exported)
    }

    /// DeleteVolume: unexport, delete the backing device (the agent ends the lifecycle in its
    /// mark), then delete the record.
    pub async fn delete_volume(
        &self,
        req: csi::DeleteVolumeRequest,
    ) -> Result<csi::DeleteVolumeResponse, ControllerError> {
        // An ID pillar never issues names no volume: nothing to delete.
        let VolumeRef::Pillar(volume) = request::delete(&req)? else {
            return Ok(csi::DeleteVolumeResponse {});
        };
        let name = volume.to_string();
        let _lock = self.locks.lock(name.clone()).await;
        // F10: no record, nothing on any agent.
        let Some(state) = self.store.get_volume(&name).await? else {
            return Ok(csi::DeleteVolumeResponse {});
        };
        // W5, W8: "no publication" is decided in the compare-and-swap that marks the volume
        // deleting; from then on no publication can be recorded, whichever replica tries.
        let target = self.volume_agent(&state).await?;
        let (_, generation) = self
            .update_status(&name, &target.uid, |current, status| {
                refuse_while_published(current)?;
                status.deleting = true;
                status.publication_generation += 1;
                Ok(status.publication_generation)
            })
            .await?;
        self.call_agent(
            &target,
            "Unexport",
            token(&target.uid, generation),
            &always,
            |mut c, token| {
                let r = agent_api::UnexportRequest {
                    token,
                    volume_id: name.clone(),
                };
                async move { c.unexport(r).await }
            },
        )
        .await?;
        self.call_agent(&target, "DeleteVolume", None, &always, |mut c, token| {
            let r = agent_api::DeleteVolumeRequest {
                token,
                volume_id: name.clone(),
                pool: state.spec.pool.clone(),
            };
            async move { c.delete_volume(r).await }
        })
        .await?;
        match self
            .compare_and_swap(&name, &target.uid, |current| {
                refuse_while_published(current)?;
                Ok((Write::Delete, ()))
            })
            .await
        {
            Ok(_) | Err(ControllerError::LifecycleGone { .. }) => {
                tracing::info!(volume = %name, "volume deleted");
                Ok(csi::DeleteVolumeResponse {})
            }
            Err(e) => Err(e),
        }
    }

    /// ControllerExpandVolume: the agent grows the volume (and its live namespace), then the
    /// new size is recorded.
    pub async fn expand(
        &self,
        req: csi::ControllerExpandVolumeRequest,
    ) -> Result<csi::ControllerExpandVolumeResponse, ControllerError> {
        let req = request::expand(&req)?;
        let name = req.volume.existing()?.to_string();
        let _lock = self.locks.lock(name.clone()).await;
        let state = self
            .store
            .get_volume(&name)
            .await?
            .ok_or_else(|| ControllerError::VolumeNotFound(name.clone()))?;
        if state.status_or_default().deleting {
            return Err(ControllerError::Deleting { volume: name });
        }
        let target = self.volume_agent(&state).await?;
        let grown = self
            .call_agent(
                &target,
                "ExpandVolume",
                None,
                &not_deleting,
                |mut c, token| {
                    let r = agent_api::ExpandVolumeRequest {
                        token,
                        volume_id: name.clone(),
                        pool: state.spec.pool.clone(),
                        size_bytes: req.required,
                    };
                    async move { c.expand_volume(r).await }
                },
            )
            .await?;
        // The size is recorded or the call fails (ABORTED after persistent conflicts): the
        // caller never hears of a size the record does not hold.
        self.compare_and_swap(&name, &target.uid, |current| {
            let mut spec = current.spec.clone();
            // Never below what the record holds: a concurrent expansion to a larger size (the
            // other replica's, answered and recorded first) must not be overwritten by this
            // call's smaller answer, obtained before that growth.
            spec.size_bytes = spec.size_bytes.max(grown.size_bytes);
            Ok((Write::Spec(spec), ()))
        })
        .await?;
        Ok(csi::ControllerExpandVolumeResponse {
            capacity_bytes: saturating_i64(grown.size_bytes),
            node_expansion_required: state.spec.volume_mode
                == pillar_state::crd::VolumeMode::Filesystem,
        })
    }
}

/// The agent's view of a recorded content source.
fn agent_source(s: &ContentSourceRef) -> agent_api::ContentSource {
    use agent_api::content_source::Source as S;
    agent_api::ContentSource {
        source: Some(match s.kind {
            ContentSourceKind::Snapshot => S::SnapshotId(s.id.clone()),
            ContentSourceKind::Volume => S::VolumeId(s.id.clone()),
        }),
        lifecycle_uid: s.uid.clone(),
    }
}

/// The CSI view of a recorded content source.
pub(super) fn csi_source(s: &ContentSourceRef) -> csi::VolumeContentSource {
    use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
    csi::VolumeContentSource {
        r#type: Some(match s.kind {
            ContentSourceKind::Snapshot => Type::Snapshot(SnapshotSource {
                snapshot_id: s.id.clone(),
            }),
            ContentSourceKind::Volume => Type::Volume(VolumeSource {
                volume_id: s.id.clone(),
            }),
        }),
    }
}

/// W5: no delete while any publication is recorded.
fn refuse_while_published(state: &PillarVolumeState) -> Result<(), ControllerError> {
    let published: Vec<String> = state
        .status_or_default()
        .published_nodes
        .iter()
        .map(|p| p.node.clone())
        .collect();
    if published.is_empty() {
        Ok(())
    } else {
        Err(ControllerError::StillPublished {
            volume: state.spec.volume_id.clone(),
            nodes: published,
        })
    }
}
