//! The CSI Node service.
//!
//! A thin gRPC layer ([`NodeService`]) over synchronous operations (`engine`, `attach`) built on
//! `pillar-host`. Each call checks its request first (INVALID_ARGUMENT before anything is
//! touched), takes the volume's lock (a second call on a busy volume gets ABORTED, as the CSI
//! spec suggests, instead of piling up behind a slow mkfs or connect), and runs the operation on
//! a blocking thread that keeps the lock until the work is really done, even when the caller
//! gives up. Errors become gRPC statuses in one place ([`code_of`]).
//!
//! The engine reaches the kernel (NVMe/TCP connect and sysfs, block devices and filesystems,
//! mounts, reservations) only through [`Kernel`]: [`HostKernel`], the running system, unless
//! [`NodeService::with_kernel`] is given another (the simulation's double, `sim/`).
//!
//! Rules: N1 (connect with the node's own host NQN and host ID, verify the namespace identity
//! before touching the device), N2 (stage record written before attaching), N3 (only a blank
//! device is formatted), N4 (unstage disconnects only this subsystem's controllers of this host),
//! C4 (a corrupt stage record is an error), W9 (a single-writer stager holds the NVMe Write
//! Exclusive reservation where the target has reservations: `reserve`).

mod attach;
mod config;
mod credentials;
mod device;
mod engine;
mod error;
mod expand;
mod kernel;
mod publish;
mod request;
mod reserve;

use std::collections::HashMap;
use std::sync::Arc;

use pillar_host::StageStore;
use pillar_lock_by_id::{IdGuard, LockById};
use pillar_nvmet::VolumeId;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

/// The request parsers each RPC applies to what a client sent, and the stage's decisions made
/// from them, for the fuzz targets (`fuzz/`) and the simulation's hosts (`sim/`); not part of
/// the crate's API.
#[doc(hidden)]
pub mod fuzzing {
    pub use super::device::wants_reservation;
    pub use super::request::{
        AttachTarget, StageContext, capability, path, published_path, stage_auth, stage_context,
        stage_read_only, volume_id,
    };
}

pub use config::{AttachMode, DEFAULT_CONNECT_TIMEOUT, NodeConfig};
pub use engine::DEFAULT_FS;
pub use error::{NodeError, code_of, describe};
pub use kernel::{HostKernel, Kernel};

use crate::credentials_delivery::client::CredentialsClient;
use crate::csi;
use crate::csi::node_server::{Node, NodeServer};
use crate::node_id::NodeId;
use credentials::stage_secrets;
use engine::Engine;

/// The topology key a node's segment is published under.
pub const TOPOLOGY_KEY: &str = "pillar.io/node";

/// Volumes with an operation in progress: a call on a held volume is refused at once
/// ([`NodeError::Busy`], ABORTED), never queued behind a slow mkfs or connect.
#[derive(Debug, Default)]
struct VolumeLocks(LockById<VolumeId>);

/// Held while an operation on one volume runs; dropping it frees the volume.
type VolumeGuard = IdGuard<VolumeId>;

impl VolumeLocks {
    fn try_lock(&self, volume: &VolumeId) -> Result<VolumeGuard, NodeError> {
        self.0
            .try_lock(volume.clone())
            .ok_or_else(|| NodeError::Busy(volume.to_string()))
    }
}

/// The CSI Node service.
#[derive(Debug, Clone)]
pub struct NodeService {
    engine: Arc<Engine>,
    locks: Arc<VolumeLocks>,
    node_id: String,
    /// Where a stage without its DH-HMAC-CHAP secret gets this node's pair (Kubernetes).
    credentials: Option<Arc<CredentialsClient>>,
}

impl NodeService {
    /// Checks the configuration and opens the stage record directory
    /// (`<state_dir>/staged`, created if missing); the kernel is the running system's.
    pub fn new(config: NodeConfig) -> Result<Self, NodeError> {
        let kernel = Arc::new(HostKernel {
            paths: config.paths.clone(),
        });
        Self::with_kernel(config, kernel)
    }

    /// [`new`](Self::new) over another kernel: the simulation's double (see [`Kernel`]).
    pub fn with_kernel(config: NodeConfig, kernel: Arc<dyn Kernel>) -> Result<Self, NodeError> {
        if config.node_name.is_empty() || config.node_name.contains('/') {
            return Err(NodeError::Config(format!(
                "node name {:?} must be non-empty and without '/'",
                config.node_name
            )));
        }
        if config.host_id.is_nil() {
            return Err(NodeError::Config(
                "the host ID is the nil UUID; read /etc/nvme/hostid".into(),
            ));
        }
        let node_id = NodeId {
            node: config.node_name.clone(),
            host_nqn: config.host_nqn.clone(),
        }
        .format()
        .map_err(NodeError::NodeId)?;
        let store =
            StageStore::open(&config.state_dir).map_err(|source| NodeError::OpenStageStore {
                dir: config.state_dir.clone(),
                source: Box::new(source),
            })?;
        tracing::info!(%node_id, mode = ?config.attach, "node service ready");
        if config.attach == AttachMode::LocalDevice {
            tracing::warn!(
                "single-machine mode: volumes are local block devices and their NVMe identity \
                 cannot be verified"
            );
        }
        Ok(Self {
            engine: Arc::new(Engine {
                cfg: config,
                store,
                kernel,
            }),
            locks: Arc::default(),
            node_id,
            credentials: None,
        })
    }

    /// Stages needing DH-HMAC-CHAP whose request carries no secret ask the controller's
    /// credentials endpoint for this node's pair through `client`
    /// ([`crate::credentials_delivery::client`]).
    pub fn with_credentials_delivery(mut self, client: CredentialsClient) -> Self {
        self.credentials = Some(Arc::new(client));
        self
    }

    /// This node's CSI node ID, `<node-name>/<host-nqn>`.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The tonic service.
    pub fn into_server(self) -> NodeServer<Self> {
        NodeServer::new(self)
    }

    /// Runs `f` on a blocking thread inside `span`.
    async fn blocking<T, F>(&self, span: tracing::Span, f: F) -> Result<T, NodeError>
    where
        T: Send + 'static,
        F: FnOnce(&Engine) -> Result<T, NodeError> + Send + 'static,
    {
        let engine = Arc::clone(&self.engine);
        tokio::task::spawn_blocking(move || span.in_scope(|| f(&engine)))
            .await
            .map_err(NodeError::Task)?
    }
}

/// One call's work on the engine, its volume's lock held inside: what the RPC runs on a
/// blocking thread, and the simulation on its own.
type Work<T> = Box<dyn FnOnce(&Engine) -> Result<T, NodeError> + Send + 'static>;

/// Each RPC's checks (INVALID_ARGUMENT before anything is touched) and lock (ABORTED on a busy
/// volume), answering the work that follows them.
impl NodeService {
    fn stage_work(&self, req: &csi::NodeStageVolumeRequest) -> Result<Work<()>, NodeError> {
        let volume = request::volume_id(&req.volume_id)?;
        let staging = request::path("staging_target_path", &req.staging_target_path)?;
        let cap = request::capability(req.volume_capability.as_ref())?;
        let cfg = &self.engine.cfg;
        let mut ctx = request::stage_context(
            &volume,
            &req.publish_context,
            &cfg.attach,
            &cfg.host_nqn,
            cfg.host_id,
        )?;
        if let request::AttachTarget::Nvme(opts) = &mut ctx.target {
            opts.auth = request::stage_auth(&volume, &req.publish_context, &req.secrets)?;
            opts.tls = request::stage_tls(&volume, &req.publish_context, opts)?;
        }
        let guard = self.locks.try_lock(&volume)?;
        Ok(Box::new(move |e| {
            let _guard = guard;
            e.stage(&volume, &staging, &cap, &ctx)
        }))
    }

    fn unstage_work(&self, req: &csi::NodeUnstageVolumeRequest) -> Result<Work<()>, NodeError> {
        let volume = request::volume_id(&req.volume_id)?;
        let staging = request::path("staging_target_path", &req.staging_target_path)?;
        let guard = self.locks.try_lock(&volume)?;
        Ok(Box::new(move |e| {
            let _guard = guard;
            e.unstage(&volume, &staging)
        }))
    }

    fn publish_work(&self, req: &csi::NodePublishVolumeRequest) -> Result<Work<()>, NodeError> {
        let volume = request::volume_id(&req.volume_id)?;
        let target = request::path("target_path", &req.target_path)?;
        let cap = request::capability(req.volume_capability.as_ref())?;
        let staging = request::path("staging_target_path", &req.staging_target_path)?;
        let readonly = req.readonly;
        let guard = self.locks.try_lock(&volume)?;
        Ok(Box::new(move |e| {
            let _guard = guard;
            e.publish(&volume, &staging, &target, &cap, readonly)
        }))
    }

    fn unpublish_work(&self, req: &csi::NodeUnpublishVolumeRequest) -> Result<Work<()>, NodeError> {
        let volume = request::volume_id(&req.volume_id)?;
        let target = request::path("target_path", &req.target_path)?;
        let guard = self.locks.try_lock(&volume)?;
        Ok(Box::new(move |e| {
            let _guard = guard;
            e.unpublish(&target)
        }))
    }

    fn expand_work(&self, req: &csi::NodeExpandVolumeRequest) -> Result<Work<u64>, NodeError> {
        let volume = request::volume_id(&req.volume_id)?;
        let path = request::published_path("volume_path", &req.volume_path)?;
        let required = req.capacity_range.as_ref().map_or(0, |r| r.required_bytes);
        let required = u64::try_from(required).map_err(|_| NodeError::InvalidField {
            field: "capacity_range.required_bytes",
            reason: format!("{required} is negative"),
        })?;
        if let Some(cap) = req.volume_capability.as_ref() {
            request::capability(Some(cap))?;
        }
        let guard = self.locks.try_lock(&volume)?;
        Ok(Box::new(move |e| {
            let _guard = guard;
            e.expand(&volume, &path, required)
        }))
    }
}

/// The node calls run on the caller's thread, for the simulation (`sim/`), whose scheduler
/// must own every step: the same checks, lock and engine as the RPCs, without the blocking
/// pool. Not part of the crate's API.
#[doc(hidden)]
impl NodeService {
    pub fn stage_inline(&self, req: &csi::NodeStageVolumeRequest) -> Result<(), NodeError> {
        self.stage_work(req)?(&self.engine)
    }

    pub fn unstage_inline(&self, req: &csi::NodeUnstageVolumeRequest) -> Result<(), NodeError> {
        self.unstage_work(req)?(&self.engine)
    }

    pub fn publish_inline(&self, req: &csi::NodePublishVolumeRequest) -> Result<(), NodeError> {
        self.publish_work(req)?(&self.engine)
    }

    pub fn unpublish_inline(&self, req: &csi::NodeUnpublishVolumeRequest) -> Result<(), NodeError> {
        self.unpublish_work(req)?(&self.engine)
    }

    pub fn expand_inline(&self, req: &csi::NodeExpandVolumeRequest) -> Result<u64, NodeError> {
        self.expand_work(req)?(&self.engine)
    }
}

/// Where node results become statuses: logs the failure with its cause chain.
fn respond<T>(result: Result<T, NodeError>) -> Result<Response<T>, Status> {
    match result {
        Ok(v) => Ok(Response::new(v)),
        Err(err) => {
            let status = Status::from(err);
            tracing::warn!(code = ?status.code(), error = %status.message(), "call failed");
            Err(status)
        }
    }
}

fn usage(unit: csi::volume_usage::Unit, total: u64, available: u64, used: u64) -> csi::VolumeUsage {
    let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    csi::VolumeUsage {
        available: clamp(available),
        total: clamp(total),
        used: clamp(used),
        unit: unit.into(),
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        let span = tracing::info_span!("NodeStageVolume", volume_id = %req.volume_id);
        let result = async {
            let mut req = req;
            // The request's own fields first: a malformed one is refused before any network.
            let volume = request::volume_id(&req.volume_id)?;
            request::path("staging_target_path", &req.staging_target_path)?;
            request::capability(req.volume_capability.as_ref())?;
            let cfg = &self.engine.cfg;
            request::stage_context(
                &volume,
                &req.publish_context,
                &cfg.attach,
                &cfg.host_nqn,
                cfg.host_id,
            )?;
            // W10: this node's pair from the controller where kubelet passed none.
            req.secrets = stage_secrets(
                self.credentials.as_deref(),
                &cfg.node_name,
                &cfg.host_nqn,
                &volume,
                &req.publish_context,
                std::mem::take(&mut req.secrets),
            )
            .await?;
            let work = self.stage_work(&req)?;
            self.blocking(tracing::Span::current(), work).await?;
            Ok(csi::NodeStageVolumeResponse {})
        }
        .instrument(span.clone())
        .await;
        span.in_scope(|| respond(result))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        let span = tracing::info_span!("NodeUnstageVolume", volume_id = %req.volume_id);
        let result = async {
            let work = self.unstage_work(&req)?;
            self.blocking(tracing::Span::current(), work).await?;
            Ok(csi::NodeUnstageVolumeResponse {})
        }
        .instrument(span.clone())
        .await;
        span.in_scope(|| respond(result))
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let span = tracing::info_span!("NodePublishVolume", volume_id = %req.volume_id);
        let result = async {
            let work = self.publish_work(&req)?;
            self.blocking(tracing::Span::current(), work).await?;
            Ok(csi::NodePublishVolumeResponse {})
        }
        .instrument(span.clone())
        .await;
        span.in_scope(|| respond(result))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let span = tracing::info_span!("NodeUnpublishVolume", volume_id = %req.volume_id);
        let result = async {
            let work = self.unpublish_work(&req)?;
            self.blocking(tracing::Span::current(), work).await?;
            Ok(csi::NodeUnpublishVolumeResponse {})
        }
        .instrument(span.clone())
        .await;
        span.in_scope(|| respond(result))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        let span = tracing::debug_span!("NodeGetVolumeStats", volume_id = %req.volume_id);
        let result = async {
            let volume = request::volume_id(&req.volume_id)?;
            let path = request::published_path("volume_path", &req.volume_path)?;
            // No lock for reading, so the periodic stats never make a stage wait or abort; the
            // reservation is taken back only if the volume's lock is free (W9).
            let locks = Arc::clone(&self.locks);
            let u = self
                .blocking(tracing::Span::current(), move |e| {
                    e.stats(&volume, &path, || locks.try_lock(&volume).ok())
                })
                .await?;
            use csi::volume_usage::Unit;
            let mut out = vec![usage(
                Unit::Bytes,
                u.bytes_total,
                u.bytes_available.unwrap_or(0),
                u.bytes_used.unwrap_or(0),
            )];
            if let Some((total, free, used)) = u.inodes {
                out.push(usage(Unit::Inodes, total, free, used));
            }
            Ok(csi::NodeGetVolumeStatsResponse {
                usage: out,
                volume_condition: Some(csi::VolumeCondition {
                    abnormal: u.condition.abnormal,
                    message: u.condition.message,
                }),
            })
        }
        .instrument(span.clone())
        .await;
        span.in_scope(|| respond(result))
    }

    async fn node_expand_volume(
        &self,
        request: Request<csi::NodeExpandVolumeRequest>,
    ) -> Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let span = tracing::info_span!("NodeExpandVolume", volume_id = %req.volume_id);
        let result = async {
            let work = self.expand_work(&req)?;
            let size = self.blocking(tracing::Span::current(), work).await?;
            Ok(csi::NodeExpandVolumeResponse {
                capacity_bytes: i64::try_from(size).unwrap_or(i64::MAX),
            })
        }
        .instrument(span.clone())
        .await;
        span.in_scope(|| respond(result))
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        use csi::node_service_capability::{Rpc, Type, rpc};
        let capabilities = [
            rpc::Type::StageUnstageVolume,
            rpc::Type::ExpandVolume,
            rpc::Type::GetVolumeStats,
            rpc::Type::VolumeCondition,
            // The controller advertises it too: the CO may only use the mode where both agree.
            rpc::Type::SingleNodeMultiWriter,
        ]
        .into_iter()
        .map(|t| csi::NodeServiceCapability {
            r#type: Some(Type::Rpc(Rpc { r#type: t.into() })),
        })
        .collect();
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn node_get_info(
        &self,
        _request: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        let mut segments: HashMap<String, String> =
            self.engine.cfg.topology.clone().into_iter().collect();
        segments.insert(TOPOLOGY_KEY.to_owned(), self.engine.cfg.node_name.clone());
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(csi::Topology { segments }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A second operation on a volume in progress is refused at once with the same ABORTED
    // answer, another volume is not held up, and the volume is free again when the first ends.
    #[test]
    fn a_busy_volume_is_aborted_until_its_operation_ends() {
        let locks = VolumeLocks::default();
        let a = VolumeId::parse("pvc-a").expect("volume id");
        let b = VolumeId::parse("pvc-b").expect("volume id");
        let held = locks.try_lock(&a).expect("free volume");
        let err = locks.try_lock(&a).expect_err("held volume");
        assert!(
            matches!(&err, NodeError::Busy(v) if v == "pvc-a"),
            "{err:?}"
        );
        assert_eq!(code_of(&err), tonic::Code::Aborted);
        assert_eq!(
            err.to_string(),
            "an operation on volume pvc-a is already in progress; retry later"
        );
        let other = locks.try_lock(&b).expect("another volume is not held up");
        drop(held);
        drop(other);
        assert!(locks.0.is_empty(), "no entry outlives its operation");
        let _again = locks.try_lock(&a).expect("free again");
    }
}
