//! A typed, kernel-faithful model of the Linux NVMe-oF target (nvmet) as configured through
//! configfs.
//!
//! - [`names`]: validated NQNs, port, namespace and volume IDs, and the volume -> NQN map.
//! - [`identity`]: namespace UUID/NGUID and subsystem serial derived from the NQN.
//! - [`model`]: the desired state of an export and the observed state of a configfs tree.
//! - [`plan`]: the planner, which turns their difference into ordered primitive operations that
//!   obey the kernel's rules.
//! - [`exec`]: a synchronous executor and the read-back check.
//! - [`double`]: a configfs test double that refuses what the kernel refuses.
//!
//! Nothing here talks to io_uring or gRPC: the agent builds on these types.

pub mod double;
pub mod exec;
pub mod identity;
pub mod model;
pub mod names;
pub mod plan;
pub mod target_model;

pub use double::ConfigfsDouble;
pub use exec::{
    ApplyError, Executor, KernelExecutor, Mismatch, VerifyError, apply, verify, verify_acl,
    verify_links,
};
pub use identity::{IdentityError, NamespaceIdentity, Nguid, Serial, derive_serial};
pub use model::{
    ExportSpec, HostAccess, NamespaceSpec, NamespaceState, ObserveError, PortSpec, PortState,
    SubsystemState, TargetState, Transport, observe, observe_scope,
};
pub use names::{HostNqn, NameError, NamespaceId, Nqn, PortId, SubsystemNqn, VolumeId};
pub use plan::{
    Adoption, ExportPlan, Op, PlanError, Released, plan_acl, plan_cut_connections, plan_export,
    plan_links, plan_release, plan_revalidate, plan_unexport,
};
pub use target_model::TargetModel;

/// Where the kernel mounts the nvmet configfs tree.
pub const KERNEL_NVMET_ROOT: &str = "/sys/kernel/config/nvmet";

/// The standard export of one volume: namespace 1 on `device`, derived identity and serial.
pub fn volume_export(
    volume: &VolumeId,
    device: impl Into<std::path::PathBuf>,
    access: HostAccess,
    ports: std::collections::BTreeMap<PortId, PortSpec>,
) -> ExportSpec {
    let nqn = volume.subsystem_nqn();
    let identity = NamespaceIdentity::derive(&nqn, NamespaceId::VOLUME);
    ExportSpec {
        serial: derive_serial(&nqn),
        namespaces: [(
            NamespaceId::VOLUME,
            NamespaceSpec {
                device_path: device.into(),
                identity,
            },
        )]
        .into_iter()
        .collect(),
        access,
        ports,
        nqn,
    }
}
