//! Fixtures shared by this crate's tests.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::apiserver_double::ApiServerDouble;
use crate::crd::{
    AccessMode, AgentTls, NvmeTcp, PillarAgentSpec, PillarProtocolSpec, PillarVolumeStateSpec,
    PoolRef, VolumeMode,
};
use crate::{EmbeddedStore, KubeStore, StateStore};

pub(crate) fn volume_spec(id: &str) -> PillarVolumeStateSpec {
    PillarVolumeStateSpec {
        content_source: None,
        topology: BTreeMap::new(),
        volume_id: id.to_owned(),
        agent: "storage-1".into(),
        pool: "pool-a".into(),
        size_bytes: 1 << 30,
        access_mode: AccessMode::SingleNodeWriter,
        volume_mode: VolumeMode::Filesystem,
        protocol: "nvme-tcp".into(),
        parameters: BTreeMap::from([("csi.storage.k8s.io/fstype".into(), "ext4".into())]),
    }
}

pub(crate) fn agent_spec(node: &str) -> PillarAgentSpec {
    PillarAgentSpec {
        node: node.to_owned(),
        address: "10.0.0.1:9500".into(),
        tls: Some(AgentTls {
            server_name: format!("{node}.agents.pillar"),
            ca_bundle_path: "/etc/pillar/ca.pem".into(),
        }),
        pools: vec![PoolRef {
            name: "pool-a".into(),
            kind: "lvm".into(),
        }],
        nvme_address: "10.0.1.1".into(),
        topology: Default::default(),
    }
}

pub(crate) fn protocol_spec() -> PillarProtocolSpec {
    PillarProtocolSpec {
        nvme_tcp: NvmeTcp {
            acl: true,
            ..NvmeTcp::default()
        },
    }
}

/// A store under test and what keeps its backend alive.
pub(crate) struct Harness {
    pub store: Arc<dyn StateStore>,
    pub double: Option<Arc<ApiServerDouble>>,
    _dir: Option<tempfile::TempDir>,
}

pub(crate) async fn embedded() -> Harness {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = EmbeddedStore::open(dir.path().join("state"))
        .await
        .expect("open embedded store");
    Harness {
        store: Arc::new(store),
        double: None,
        _dir: Some(dir),
    }
}

pub(crate) async fn kube() -> Harness {
    let double = Arc::new(ApiServerDouble::start().await.expect("start double"));
    let client = double.client().expect("client");
    Harness {
        store: Arc::new(KubeStore::new(client)),
        double: Some(double),
        _dir: None,
    }
}

/// The core's own store: the rules on the in-memory tables.
pub(crate) fn memory() -> Harness {
    Harness {
        store: Arc::new(crate::MemoryStore::new()),
        double: None,
        _dir: None,
    }
}

/// The generic fault-injecting wrapper, disarmed, over the core's store: it must change nothing.
pub(crate) fn faulty_memory() -> Harness {
    let inner: Arc<dyn StateStore> = Arc::new(crate::MemoryStore::new());
    Harness {
        store: crate::faults::FaultyStore::new(inner),
        double: None,
        _dir: None,
    }
}
