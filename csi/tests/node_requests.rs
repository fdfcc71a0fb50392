//! The node service's answers that need no device: NodeGetInfo, NodeGetCapabilities, and every
//! INVALID_ARGUMENT / NOT_FOUND / FAILED_PRECONDITION decided before anything is touched. Served
//! over a real unix socket.

#![allow(clippy::unwrap_used)]

mod node_support;

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use node_support::*;
use pillar_csi::context;
use pillar_csi::csi;
use pillar_csi::csi::node_service_capability::{Type, rpc};
use pillar_csi::csi::volume_capability::access_mode::Mode;
use pillar_csi::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use pillar_csi::node::{AttachMode, NodeService, TOPOLOGY_KEY};
use pillar_csi::node_id::NodeId;
use pillar_host::HostPaths;
use tonic::Code;

#[tokio::test]
async fn node_info_names_the_node_and_its_host_nqn() {
    let h = Harness::local().await;
    let info = h
        .client
        .clone()
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    let id = NodeId::parse(&info.node_id).unwrap();
    assert_eq!(id.node, NODE);
    assert_eq!(id.host_nqn.as_str(), HOST_NQN);
    assert_eq!(info.max_volumes_per_node, 0);
    let topo = info.accessible_topology.unwrap();
    assert_eq!(
        topo.segments,
        HashMap::from([(TOPOLOGY_KEY.to_owned(), NODE.to_owned())])
    );
}

#[tokio::test]
async fn node_capabilities() {
    let h = Harness::local().await;
    let caps = h
        .client
        .clone()
        .node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let mut got: Vec<i32> = caps
        .into_iter()
        .map(|c| match c.r#type {
            Some(Type::Rpc(r)) => r.r#type,
            None => panic!("capability without a type"),
        })
        .collect();
    got.sort_unstable();
    let mut want: Vec<i32> = [
        rpc::Type::StageUnstageVolume,
        rpc::Type::ExpandVolume,
        rpc::Type::GetVolumeStats,
        rpc::Type::VolumeCondition,
        rpc::Type::SingleNodeMultiWriter,
    ]
    .into_iter()
    .map(i32::from)
    .collect();
    want.sort_unstable();
    assert_eq!(got, want);
}

#[test]
fn new_refuses_a_bad_configuration() {
    let dir = tempfile::tempdir().unwrap();
    for bad in [
        {
            let mut c = config(dir.path(), AttachMode::LocalDevice, HostPaths::system());
            c.node_name = String::new();
            c
        },
        {
            let mut c = config(dir.path(), AttachMode::LocalDevice, HostPaths::system());
            c.node_name = "a/b".into();
            c
        },
        {
            let mut c = config(dir.path(), AttachMode::NvmeTcp, HostPaths::system());
            c.host_id = uuid::Uuid::nil();
            c
        },
        {
            let mut c = config(dir.path(), AttachMode::NvmeTcp, HostPaths::system());
            c.node_name = "n".repeat(250);
            c
        },
    ] {
        assert!(NodeService::new(bad).is_err());
    }
    let svc =
        NodeService::new(config(dir.path(), AttachMode::NvmeTcp, HostPaths::system())).unwrap();
    assert_eq!(svc.node_id(), format!("{NODE}/{HOST_NQN}"));
    assert!(dir.path().join("state/staged").is_dir());
}

fn stage_req(
    volume: &str,
    staging: &str,
    cap: Option<csi::VolumeCapability>,
) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: volume.into(),
        publish_context: local_ctx(volume, Path::new("/dev/null")),
        staging_target_path: staging.into(),
        volume_capability: cap,
        ..Default::default()
    }
}

fn with_mode(mode: i32, access: Option<AccessType>) -> Option<csi::VolumeCapability> {
    Some(csi::VolumeCapability {
        access_type: access,
        access_mode: Some(AccessMode { mode }),
    })
}

fn mount(fs: &str) -> Option<AccessType> {
    Some(AccessType::Mount(MountVolume {
        fs_type: fs.into(),
        ..Default::default()
    }))
}

// Every malformed NodeStageVolume is INVALID_ARGUMENT, and nothing is recorded or touched.
#[tokio::test]
async fn stage_invalid_arguments() {
    let h = Harness::local().await;
    let staging = path_str(&h.work.join("staging"));
    let ok_cap = Some(mount_cap("ext4"));
    let writer = i32::from(Mode::SingleNodeWriter);
    let mut cases: Vec<(&str, csi::NodeStageVolumeRequest)> = vec![
        ("empty volume_id", {
            let mut r = stage_req("pvc-1", &staging, ok_cap.clone());
            r.volume_id.clear();
            r
        }),
        ("empty staging path", stage_req("pvc-1", "", ok_cap.clone())),
        (
            "relative staging path",
            stage_req("pvc-1", "rel/path", ok_cap.clone()),
        ),
        ("missing capability", stage_req("pvc-1", &staging, None)),
        (
            "multi-node multi-writer",
            stage_req(
                "pvc-1",
                &staging,
                with_mode(Mode::MultiNodeMultiWriter.into(), mount("ext4")),
            ),
        ),
        (
            "multi-node multi-writer block",
            stage_req(
                "pvc-1",
                &staging,
                with_mode(
                    Mode::MultiNodeMultiWriter.into(),
                    Some(AccessType::Block(BlockVolume {})),
                ),
            ),
        ),
        (
            "unknown mode",
            stage_req("pvc-1", &staging, with_mode(99, mount("ext4"))),
        ),
        (
            "mode UNKNOWN",
            stage_req("pvc-1", &staging, with_mode(0, mount("ext4"))),
        ),
        (
            "btrfs",
            stage_req("pvc-1", &staging, with_mode(writer, mount("btrfs"))),
        ),
        (
            "no access type",
            stage_req("pvc-1", &staging, with_mode(writer, None)),
        ),
        ("no access mode", {
            let mut r = stage_req("pvc-1", &staging, ok_cap.clone());
            r.volume_capability.as_mut().unwrap().access_mode = None;
            r
        }),
        ("bad volume id", {
            let mut r = stage_req("pvc-1", &staging, ok_cap.clone());
            r.volume_id = "../etc".into();
            r
        }),
        ("no NQN", {
            let mut r = stage_req("pvc-1", &staging, ok_cap.clone());
            r.publish_context.remove(context::NQN);
            r
        }),
        ("another volume's NQN", {
            let mut r = stage_req("pvc-1", &staging, ok_cap.clone());
            r.publish_context
                .insert(context::NQN.into(), nqn("pvc-2").to_string());
            r
        }),
        ("an NQN that is not pillar's", {
            let mut r = stage_req("pvc-1", &staging, ok_cap.clone());
            r.publish_context
                .insert(context::NQN.into(), "nqn.2014-08.com.example:pvc-1".into());
            r
        }),
        ("no local device", {
            let mut r = stage_req("pvc-1", &staging, ok_cap.clone());
            r.publish_context.remove(context::LOCAL_DEVICE);
            r
        }),
        ("bad fs type in the context", {
            let mut r = stage_req("pvc-1", &staging, Some(mount_cap("")));
            r.publish_context
                .insert(context::FS_TYPE.into(), "ntfs".into());
            r
        }),
        ("mkfs options not a JSON array", {
            let mut r = stage_req("pvc-1", &staging, ok_cap.clone());
            r.publish_context
                .insert(context::MKFS_OPTIONS.into(), "-m0".into());
            r
        }),
    ];
    for (what, req) in cases.drain(..) {
        let err = h.client.clone().node_stage_volume(req).await.unwrap_err();
        assert_eq!(
            err.code(),
            Code::InvalidArgument,
            "{what}: {}",
            err.message()
        );
    }
    assert_eq!(fs::read_dir(h.state.join("staged")).unwrap().count(), 0);
    assert!(!h.work.join("staging").exists());
}

// In NVMe/TCP mode every connect option must be in publish_context (rule N1: nothing implicit).
#[tokio::test]
async fn stage_nvme_needs_every_connect_option() {
    let dir = tempfile::tempdir().unwrap();
    let h = Harness::nvme(
        HostPaths::under(dir.path()),
        std::time::Duration::from_secs(1),
    )
    .await;
    let staging = h.work.join("staging");
    for key in [
        context::NQN,
        context::TRADDR,
        context::TRSVCID,
        context::CTRL_LOSS_TMO,
        context::RECONNECT_DELAY,
    ] {
        let mut ctx = nvme_ctx("pvc-1");
        ctx.remove(key);
        let err = h
            .stage("pvc-1", &staging, mount_cap("ext4"), ctx)
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Code::InvalidArgument,
            "{key}: {}",
            err.message()
        );
        assert!(err.message().contains(key), "{}", err.message());
    }
    for (key, bad) in [
        (context::TRADDR, "storage.example"),
        (context::TRSVCID, "70000"),
        (context::CTRL_LOSS_TMO, "soon"),
        (context::RECONNECT_DELAY, "0"),
    ] {
        let mut ctx = nvme_ctx("pvc-1");
        ctx.insert(key.into(), bad.into());
        assert_code(
            h.stage("pvc-1", &staging, mount_cap("ext4"), ctx).await,
            Code::InvalidArgument,
        );
    }
    assert_eq!(fs::read_dir(h.state.join("staged")).unwrap().count(), 0);
}

#[tokio::test]
async fn unstage_publish_unpublish_invalid_arguments() {
    let h = Harness::local().await;
    let p = path_str(&h.work.join("p"));
    let mut client = h.client.clone();
    for (volume_id, staging_target_path) in
        [("", p.as_str()), ("pvc-1", ""), ("bad id", p.as_str())]
    {
        let err = client
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: volume_id.into(),
                staging_target_path: staging_target_path.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    }
    let publish =
        |volume: &str, staging: &str, target: &str, cap: Option<csi::VolumeCapability>| {
            csi::NodePublishVolumeRequest {
                volume_id: volume.into(),
                staging_target_path: staging.into(),
                target_path: target.into(),
                volume_capability: cap,
                ..Default::default()
            }
        };
    let t = path_str(&h.work.join("t"));
    for req in [
        publish("", &p, &t, Some(mount_cap("ext4"))),
        publish("pvc-1", &p, "", Some(mount_cap("ext4"))),
        publish("pvc-1", &p, &t, None),
        publish("pvc-1", "", &t, Some(mount_cap("ext4"))),
        publish(
            "pvc-1",
            &p,
            &t,
            with_mode(Mode::MultiNodeMultiWriter.into(), mount("")),
        ),
    ] {
        let err = client.node_publish_volume(req).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    }
    // Well-formed, but never staged: FAILED_PRECONDITION, and no target is created.
    assert_code(
        client
            .node_publish_volume(publish("pvc-1", &p, &t, Some(mount_cap("ext4"))))
            .await,
        Code::FailedPrecondition,
    );
    assert!(!h.work.join("t").exists());
    for (volume_id, target_path) in [("", t.as_str()), ("pvc-1", "")] {
        let err = client
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: volume_id.into(),
                target_path: target_path.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    }
    // Unpublish of a target that does not exist, and unstage of a volume never staged: OK.
    h.unpublish("pvc-1", &h.work.join("t")).await.unwrap();
    h.unstage("pvc-1", &h.work.join("p")).await.unwrap();
}

#[tokio::test]
async fn stats_and_expand_invalid_arguments_and_not_found() {
    let h = Harness::local().await;
    let mut client = h.client.clone();
    let existing = path_str(&h.work);
    for (volume_id, volume_path) in [("", existing.as_str()), ("pvc-1", "")] {
        let err = client
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: volume_id.into(),
                volume_path: volume_path.into(),
                staging_target_path: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
        let err = client
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: volume_id.into(),
                volume_path: volume_path.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    }
    assert_code(h.expand("pvc-1", &h.work, -1).await, Code::InvalidArgument);
    // The volume path does not exist: NOT_FOUND.
    assert_code(
        h.stats("pvc-1", &h.work.join("missing")).await,
        Code::NotFound,
    );
    // The path exists but the volume is not staged here: NOT_FOUND (the CSI spec's code for
    // NodeExpandVolume and NodeGetVolumeStats on an unknown volume).
    assert_code(h.stats("pvc-1", &h.work).await, Code::NotFound);
    assert_code(h.expand("pvc-1", &h.work, 0).await, Code::NotFound);
    // A relative path names no mount of this host: NOT_FOUND, as csi-sanity expects for a
    // volume that is not at the given path.
    assert_code(
        h.stats("pvc-1", Path::new("some/path")).await,
        Code::NotFound,
    );
    assert_code(
        h.expand("pvc-1", Path::new("some/path"), 0).await,
        Code::NotFound,
    );
}

// Every instance reports the plugin's capabilities as a whole (CSI GetPluginCapabilities), so
// the node plugin's socket also names the controller service.
#[tokio::test]
async fn the_node_socket_reports_the_whole_plugin() {
    use pillar_csi::csi::identity_server::Identity as _;
    let caps = pillar_csi::identity::IdentityService
        .get_plugin_capabilities(tonic::Request::new(csi::GetPluginCapabilitiesRequest {}))
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let controller = caps.iter().any(|c| {
        matches!(&c.r#type, Some(csi::plugin_capability::Type::Service(s))
            if s.r#type == i32::from(csi::plugin_capability::service::Type::ControllerService))
    });
    assert!(controller, "{caps:?}");
    let topology = caps.iter().any(|c| {
        matches!(&c.r#type, Some(csi::plugin_capability::Type::Service(s))
            if s.r#type == i32::from(csi::plugin_capability::service::Type::VolumeAccessibilityConstraints))
    });
    assert!(topology, "{caps:?}");
}

// Issue 12 item 4: the node reports its configured segments with its own, so a volume is
// placed only on an agent whose segments it reports.
#[tokio::test]
async fn node_info_reports_the_configured_topology_segments() {
    let h = Harness::start(|dir| {
        let mut c = config(dir, AttachMode::LocalDevice, HostPaths::system());
        c.topology
            .insert("topology.pillar-csi.io/zone".into(), "zone-a".into());
        c
    })
    .await;
    let info = h
        .client
        .clone()
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        info.accessible_topology.unwrap().segments,
        HashMap::from([
            (TOPOLOGY_KEY.to_owned(), NODE.to_owned()),
            (
                "topology.pillar-csi.io/zone".to_owned(),
                "zone-a".to_owned()
            ),
        ])
    );
}
