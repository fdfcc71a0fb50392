//! The tonic adapter: each CSI Controller RPC runs its [`Controller`] method in a span carrying
//! the volume ID, and its error becomes a status through the code table (`error::code_of`).

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::Controller;
use super::error::{ControllerError, to_status};
use crate::csi;

/// The tonic service over a [`Controller`].
#[derive(Debug, Clone)]
pub struct ControllerService {
    inner: Arc<Controller>,
}

impl ControllerService {
    /// Serves `controller`.
    pub fn new(controller: Arc<Controller>) -> Self {
        Self { inner: controller }
    }
}

/// What a call is about, for its span and for the Refused event of a refusal.
#[derive(Clone, Copy)]
enum Subject<'a> {
    /// No volume (listings, capacity).
    None,
    /// A volume ID (a CreateSnapshot's source volume too).
    Volume(&'a str),
    /// A snapshot ID: its refusals are events on its source volume.
    Snapshot(&'a str),
}

async fn respond<T>(
    controller: &Controller,
    method: &'static str,
    subject: Subject<'_>,
    work: impl Future<Output = Result<T, ControllerError>>,
) -> Result<Response<T>, Status> {
    use tracing::Instrument;
    let span = match subject {
        Subject::None => tracing::info_span!("csi", method),
        Subject::Volume(volume) => tracing::info_span!("csi", method, volume_id = volume),
        Subject::Snapshot(snapshot) => tracing::info_span!("csi", method, snapshot_id = snapshot),
    };
    let start = std::time::Instant::now();
    let result = match work.instrument(span.clone()).await {
        Ok(v) => Ok(Response::new(v)),
        Err(e) => {
            let status = to_status(&e);
            span.in_scope(|| tracing::info!(code = ?status.code(), "{}", status.message()));
            // A refusal (a rule that holds until something changes) is an operator's
            // business: a Warning on the volume. A missing agent has its own.
            if status.code() == tonic::Code::FailedPrecondition
                && !matches!(e, ControllerError::AgentMissing { .. })
            {
                let warned = async {
                    match subject {
                        Subject::None => {}
                        Subject::Volume(volume) => {
                            controller
                                .warn_refused(method, volume, status.message())
                                .await;
                        }
                        Subject::Snapshot(snapshot) => {
                            controller
                                .warn_snapshot_refused(method, snapshot, status.message())
                                .await;
                        }
                    }
                };
                warned.instrument(span).await;
            }
            Err(status)
        }
    };
    let code = result
        .as_ref()
        .map_or_else(Status::code, |_| tonic::Code::Ok);
    controller
        .metrics
        .csi_call(method, code, start.elapsed().as_secs_f64());
    result
}

fn cap(t: csi::controller_service_capability::rpc::Type) -> csi::ControllerServiceCapability {
    csi::ControllerServiceCapability {
        r#type: Some(csi::controller_service_capability::Type::Rpc(
            csi::controller_service_capability::Rpc { r#type: t.into() },
        )),
    }
}

#[tonic::async_trait]
impl csi::controller_server::Controller for ControllerService {
    async fn create_volume(
        &self,
        r: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let r = r.into_inner();
        respond(
            &self.inner,
            "CreateVolume",
            Subject::Volume(&r.name.clone()),
            self.inner.create_volume(r),
        )
        .await
    }
    async fn delete_volume(
        &self,
        r: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let r = r.into_inner();
        respond(
            &self.inner,
            "DeleteVolume",
            Subject::Volume(&r.volume_id.clone()),
            self.inner.delete_volume(r),
        )
        .await
    }
    async fn controller_publish_volume(
        &self,
        r: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        let r = r.into_inner();
        respond(
            &self.inner,
            "ControllerPublishVolume",
            Subject::Volume(&r.volume_id.clone()),
            self.inner.publish(r),
        )
        .await
    }
    async fn controller_unpublish_volume(
        &self,
        r: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        let r = r.into_inner();
        respond(
            &self.inner,
            "ControllerUnpublishVolume",
            Subject::Volume(&r.volume_id.clone()),
            self.inner.unpublish(r),
        )
        .await
    }
    async fn validate_volume_capabilities(
        &self,
        r: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<csi::ValidateVolumeCapabilitiesResponse>, Status> {
        let r = r.into_inner();
        respond(
            &self.inner,
            "ValidateVolumeCapabilities",
            Subject::Volume(&r.volume_id.clone()),
            self.inner.validate(r),
        )
        .await
    }
    async fn list_volumes(
        &self,
        r: Request<csi::ListVolumesRequest>,
    ) -> Result<Response<csi::ListVolumesResponse>, Status> {
        respond(
            &self.inner,
            "ListVolumes",
            Subject::None,
            self.inner.list(r.into_inner()),
        )
        .await
    }
    async fn get_capacity(
        &self,
        r: Request<csi::GetCapacityRequest>,
    ) -> Result<Response<csi::GetCapacityResponse>, Status> {
        respond(
            &self.inner,
            "GetCapacity",
            Subject::None,
            self.inner.capacity(r.into_inner()),
        )
        .await
    }
    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csi::controller_service_capability::rpc::Type;
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities: [
                Type::CreateDeleteVolume,
                Type::PublishUnpublishVolume,
                Type::ListVolumes,
                Type::ListVolumesPublishedNodes,
                Type::GetCapacity,
                Type::ExpandVolume,
                Type::GetVolume,
                Type::VolumeCondition,
                Type::SingleNodeMultiWriter,
                // ControllerPublishVolume honours `readonly` (N5: the node stages read-only).
                Type::PublishReadonly,
                Type::CreateDeleteSnapshot,
                Type::ListSnapshots,
                Type::GetSnapshot,
                Type::CloneVolume,
            ]
            .into_iter()
            .map(cap)
            .collect(),
        }))
    }
    async fn create_snapshot(
        &self,
        r: Request<csi::CreateSnapshotRequest>,
    ) -> Result<Response<csi::CreateSnapshotResponse>, Status> {
        let r = r.into_inner();
        respond(
            &self.inner,
            "CreateSnapshot",
            Subject::Volume(&r.source_volume_id.clone()),
            self.inner.create_snapshot(r),
        )
        .await
    }
    async fn delete_snapshot(
        &self,
        r: Request<csi::DeleteSnapshotRequest>,
    ) -> Result<Response<csi::DeleteSnapshotResponse>, Status> {
        let r = r.into_inner();
        respond(
            &self.inner,
            "DeleteSnapshot",
            Subject::Snapshot(&r.snapshot_id.clone()),
            self.inner.delete_snapshot(r),
        )
        .await
    }
    async fn list_snapshots(
        &self,
        r: Request<csi::ListSnapshotsRequest>,
    ) -> Result<Response<csi::ListSnapshotsResponse>, Status> {
        respond(
            &self.inner,
            "ListSnapshots",
            Subject::None,
            self.inner.list_snapshots(r.into_inner()),
        )
        .await
    }
    async fn get_snapshot(
        &self,
        r: Request<csi::GetSnapshotRequest>,
    ) -> Result<Response<csi::GetSnapshotResponse>, Status> {
        let r = r.into_inner();
        respond(
            &self.inner,
            "GetSnapshot",
            Subject::Snapshot(&r.snapshot_id.clone()),
            self.inner.get_snapshot(r),
        )
        .await
    }
    async fn controller_expand_volume(
        &self,
        r: Request<csi::ControllerExpandVolumeRequest>,
    ) -> Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        let r = r.into_inner();
        respond(
            &self.inner,
            "ControllerExpandVolume",
            Subject::Volume(&r.volume_id.clone()),
            self.inner.expand(r),
        )
        .await
    }
    async fn controller_get_volume(
        &self,
        r: Request<csi::ControllerGetVolumeRequest>,
    ) -> Result<Response<csi::ControllerGetVolumeResponse>, Status> {
        let r = r.into_inner();
        respond(
            &self.inner,
            "ControllerGetVolume",
            Subject::Volume(&r.volume_id.clone()),
            self.inner.get(r),
        )
        .await
    }
    async fn controller_modify_volume(
        &self,
        _: Request<csi::ControllerModifyVolumeRequest>,
    ) -> Result<Response<csi::ControllerModifyVolumeResponse>, Status> {
        Err(Status::unimplemented(
            "volume modification is not supported",
        ))
    }
}
