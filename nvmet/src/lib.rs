//! A typed, kernel-faithful model of the Linux NVMe-oF target (nvmet) as configured through
//! configfs.
//!
//! The face is the crate root: every name the agent, the CSI crates and the tests use is
//! re-exported here, and the rooms behind it are private:
//! - `names`: validated NQNs, port, namespace and volume IDs, and the volume -> NQN map.
//! - `identity`: namespace UUID/NGUID and subsystem serial derived from the NQN.
//! - `model`: the desired state of an export and the observed state of a configfs tree.
//! - `plan`: the planner, which turns their difference into ordered primitive operations that
//!   obey the kernel's rules.
//! - `exec`: a synchronous executor and the read-back check.
//! - `target_model`: an in-memory model of the whole tree that plans from a view.
//! - `auth`: DH-HMAC-CHAP secrets and the host entries' authentication attributes.
//! - `rules`: the kernel's rules around plain syscalls, which let an executor of plain syscalls
//!   (the agent's engines) run plans against a plain tree as against configfs.
//! - `tls`: TLS 1.3 for NVMe/TCP: the port attributes, the PSK derived from a host's secret, the
//!   kernel's `.nvme` keyring.
//! - `double`: a configfs test double that refuses what the kernel refuses, as those rules.
//!
//! Nothing here talks to io_uring or gRPC: the agent builds on these types.

mod auth;
mod double;
mod exec;
mod identity;
mod model;
mod names;
mod plan;
mod rules;
mod target_model;
mod tls;

pub use auth::{
    AuthError, AuthPlanError, DHCHAP_CTRL_KEY, DHCHAP_DHGROUP, DHCHAP_HASH, DHCHAP_KEY, DhGroup,
    DhchapHash, DhchapSecret, HostAuth, ObservedHostAuth, ShownSecret, auth_supported_by_entries,
    host_attr, observe_host_auth, plan_host_auth,
};
pub use double::ConfigfsDouble;
pub use exec::{
    ApplyError, Executor, KernelExecutor, Mismatch, VerifyError, apply, verify, verify_acl,
    verify_links,
};
pub use identity::{IdentityError, NamespaceIdentity, Nguid, Serial, derive_serial, parse_uuid};
pub use model::{ADDR_TREQ, ADDR_TSAS, TREQ_REQUIRED, TSAS_TLS13};
pub use model::{
    ExportSpec, HOSTS, HostAccess, NamespaceSpec, NamespaceState, ObserveError, PORTS, PortSpec,
    PortState, SubsystemState, TargetState, Transport, observe, observe_scope,
};
pub use names::{
    DISCOVERY_NQN, HostNqn, NQN_MAX_LEN, NameError, NamespaceId, Nqn, PILLAR_NQN_PREFIX, PortId,
    SubsystemNqn, UUID_NQN_PREFIX, VOLUME_ID_MAX_LEN, VolumeId,
};
pub use plan::{
    Adoption, ExportPlan, Op, PlanError, Released, plan_acl, plan_cut_connections, plan_export,
    plan_links, plan_release, plan_revalidate, plan_unexport,
};
pub use rules::{Admitted, ConfigfsRules, Ruled};
pub use target_model::TargetModel;
pub use tls::{TlsPsk, add_psk, nvme_keyring, psk_identity, remove_psk};

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
