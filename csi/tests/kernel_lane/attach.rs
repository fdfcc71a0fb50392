//! Attaching volumes of a snapshot scenario (12, 13) to the guest's NVMe/TCP host: export,
//! connect, find the block device; and back.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::v1::agent_client::AgentClient;
use pillar_nvmet::HostNqn;
use tonic::transport::Channel;

use crate::harness::checks::{connect_opts, host_controllers, host_device};
use crate::harness::lab::host_paths;
use crate::harness::machine::write_attr;
use crate::harness::{ETC_HOSTID, ETC_HOSTNQN, PORT};
use crate::lvm::Lifecycle;

/// The host's view of one exported volume.
pub(crate) struct Attached {
    pub(crate) ctrl: String,
    pub(crate) dev: PathBuf,
    pub(crate) size: u64,
}

async fn export(agent: &mut AgentClient<Channel>, pool: &str, vol: &str, life: &mut Lifecycle) {
    agent
        .export(agent_api::ExportRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: pool.into(),
            protocol: Some(agent_api::ExportProtocol {
                service: u32::from(PORT),
                acl: false,
                auth_none: true,
                tls: false,
            }),
            allowed_host_nqns: vec![],
            credentials: vec![],
        })
        .await
        .unwrap_or_else(|e| panic!("Export {vol}: {e}"));
}

fn host() -> (HostNqn, uuid::Uuid) {
    let nqn = fs::read_to_string(ETC_HOSTNQN)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let id = fs::read_to_string(ETC_HOSTID)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (nqn, id)
}

/// Exports `vol` of `pool` and connects the host to it.
pub(crate) async fn attach(
    agent: &mut AgentClient<Channel>,
    pool: &str,
    vol: &str,
    life: &mut Lifecycle,
) -> Attached {
    export(agent, pool, vol, life).await;
    let (nqn, id) = host();
    let ctrl = pillar_host::connect(&host_paths(), &connect_opts(vol, &nqn, id))
        .unwrap_or_else(|e| panic!("connect {vol}: {e}"));
    let dev = host_device(vol, &nqn);
    Attached {
        ctrl: ctrl.name,
        dev: dev.dev_path,
        size: dev.size_bytes,
    }
}

/// Disconnects the host from `vol` and unexports it.
pub(crate) async fn detach(
    agent: &mut AgentClient<Channel>,
    vol: &str,
    a: &Attached,
    life: &mut Lifecycle,
) {
    let (nqn, _) = host();
    write_attr(
        &Path::new("/sys/class/nvme")
            .join(&a.ctrl)
            .join("delete_controller"),
        "1",
    )
    .expect("disconnect");
    let start = Instant::now();
    while !host_controllers(vol, &nqn).is_empty() && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        host_controllers(vol, &nqn).is_empty(),
        "controller of {vol} left"
    );
    agent
        .unexport(agent_api::UnexportRequest {
            token: life.next(),
            volume_id: vol.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("Unexport {vol}: {e}"));
}

pub(crate) fn from(
    snapshot: Option<&str>,
    volume: Option<&str>,
    uid: &str,
) -> Option<agent_api::ContentSource> {
    use agent_api::content_source::Source;
    Some(agent_api::ContentSource {
        source: Some(match (snapshot, volume) {
            (Some(s), _) => Source::SnapshotId(s.into()),
            (None, Some(v)) => Source::VolumeId(v.into()),
            (None, None) => unreachable!("a source names a snapshot or a volume"),
        }),
        lifecycle_uid: uid.into(),
    })
}
