//! The CSI Identity service.

use tonic::{Request, Response, Status};

use crate::csi;

/// The CSI driver name (`spec.driver` of PersistentVolumes, the CSIDriver object's name).
pub const DRIVER_NAME: &str = "pillar.csi.io";

/// The Identity service. Every instance reports the capabilities of the plugin as a whole,
/// whichever services it serves itself (CSI: GetPluginCapabilities is the same for all instances
/// of one version), so the node plugin's socket also reports the controller service.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdentityService;

#[tonic::async_trait]
impl csi::identity_server::Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: DRIVER_NAME.to_owned(),
            vendor_version: env!("CARGO_PKG_VERSION").to_owned(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use csi::plugin_capability::{Service, Type, VolumeExpansion, service, volume_expansion};
        let capabilities = vec![
            csi::PluginCapability {
                r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                    r#type: volume_expansion::Type::Online.into(),
                })),
            },
            csi::PluginCapability {
                r#type: Some(Type::Service(Service {
                    r#type: service::Type::ControllerService.into(),
                })),
            },
            // CreateVolume honours accessibility requirements (PillarAgent topology).
            csi::PluginCapability {
                r#type: Some(Type::Service(Service {
                    r#type: service::Type::VolumeAccessibilityConstraints.into(),
                })),
            },
        ];
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(
        &self,
        _: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        Ok(Response::new(csi::ProbeResponse { ready: Some(true) }))
    }
}
