//! The main job of the single-machine mode, through the real CSI sockets, the way kubelet and
//! the sidecars drive a plugin: create, publish, stage (mkfs, mount), publish to a pod path,
//! write data with a checksum, read it back, stats, then tear everything down.

// The demo is the single-machine mode's main job: its steps are its output.
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use tonic::transport::{Channel, Endpoint, Uri};

use pillar_csi::csi;
use pillar_csi::csi::controller_client::ControllerClient;
use pillar_csi::csi::node_client::NodeClient;

/// Why the demo failed.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("connecting to {path}")]
    Connect {
        path: PathBuf,
        source: tonic::transport::Error,
    },
    #[error("{step} failed")]
    Call {
        step: &'static str,
        source: tonic::Status,
    },
    #[error("{step} on the published volume failed")]
    Io {
        step: &'static str,
        source: std::io::Error,
    },
    #[error("data read back differs from what was written")]
    Checksum,
}

async fn channel(path: &Path) -> Result<Channel, DemoError> {
    let p = path.to_owned();
    Endpoint::from_static("http://csi.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = p.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?))
            }
        }))
        .await
        .map_err(|source| DemoError::Connect {
            path: path.to_owned(),
            source,
        })
}

/// One timed step, printed as it completes.
#[derive(Debug, Clone)]
pub struct Step {
    pub name: &'static str,
    pub took: Duration,
}

fn mount_cap(mode: csi::volume_capability::access_mode::Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode.into() }),
        access_type: Some(csi::volume_capability::AccessType::Mount(
            csi::volume_capability::MountVolume {
                fs_type: "ext4".into(),
                mount_flags: vec![],
                volume_mount_group: String::new(),
            },
        )),
    }
}

/// Runs the whole flow for volume `name` of `size` bytes, staging under `work`. Prints each step.
pub async fn run(
    controller_socket: &Path,
    node_socket: &Path,
    work: &Path,
    name: &str,
    size: i64,
) -> Result<Vec<Step>, DemoError> {
    use csi::volume_capability::access_mode::Mode;
    let mut ctl = ControllerClient::new(channel(controller_socket).await?);
    let mut node = NodeClient::new(channel(node_socket).await?);
    let mut steps = Vec::new();
    let mut timed = |name: &'static str, started: Instant| {
        let s = Step {
            name,
            took: started.elapsed(),
        };
        println!("  {:<28} {:>9.3} ms", s.name, s.took.as_secs_f64() * 1e3);
        steps.push(s);
    };
    let call = |step: &'static str| move |source| DemoError::Call { step, source };
    let cap = mount_cap(Mode::SingleNodeWriter);

    let t = Instant::now();
    let node_id = node
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .map_err(call("NodeGetInfo"))?
        .into_inner()
        .node_id;
    timed("NodeGetInfo", t);
    let t = Instant::now();
    let created = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: size,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await
        .map_err(call("CreateVolume"))?
        .into_inner();
    timed("CreateVolume", t);
    let volume_context = created.volume.map(|v| v.volume_context).unwrap_or_default();
    let t = Instant::now();
    let published = ctl
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: name.into(),
            node_id: node_id.clone(),
            volume_capability: Some(cap.clone()),
            readonly: false,
            secrets: HashMap::new(),
            volume_context: volume_context.clone(),
        })
        .await
        .map_err(call("ControllerPublishVolume"))?
        .into_inner();
    timed("ControllerPublishVolume", t);
    let staging = work.join("staging");
    let target = work.join("pod/volume");
    let t = Instant::now();
    node.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: name.into(),
        publish_context: published.publish_context.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap.clone()),
        secrets: HashMap::new(),
        volume_context: volume_context.clone(),
    })
    .await
    .map_err(call("NodeStageVolume"))?;
    timed("NodeStageVolume (mkfs, mount)", t);
    let t = Instant::now();
    node.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: name.into(),
        publish_context: published.publish_context.clone(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap.clone()),
        readonly: false,
        secrets: HashMap::new(),
        volume_context,
    })
    .await
    .map_err(call("NodePublishVolume"))?;
    timed("NodePublishVolume", t);

    let t = Instant::now();
    let data: Vec<u8> = (0..4u32 << 20)
        .map(|i| u8::try_from(i.wrapping_mul(2_654_435_761) >> 24).unwrap_or(0))
        .collect();
    let file = target.join("data.bin");
    let io = |step| move |source| DemoError::Io { step, source };
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&file).map_err(io("create"))?;
        f.write_all(&data).map_err(io("write"))?;
        f.sync_all().map_err(io("fsync"))?;
    }
    let written = Sha256::digest(&data);
    let read = std::fs::read(&file).map_err(io("read"))?;
    if Sha256::digest(&read) != written {
        return Err(DemoError::Checksum);
    }
    timed("write 4 MiB + fsync + verify", t);
    let t = Instant::now();
    let stats = node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: name.into(),
            volume_path: target.display().to_string(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .map_err(call("NodeGetVolumeStats"))?
        .into_inner();
    timed("NodeGetVolumeStats", t);
    for u in &stats.usage {
        println!(
            "    usage: total {} used {} available {} ({:?})",
            u.total,
            u.used,
            u.available,
            u.unit()
        );
    }

    let t = Instant::now();
    node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: name.into(),
        target_path: target.display().to_string(),
    })
    .await
    .map_err(call("NodeUnpublishVolume"))?;
    timed("NodeUnpublishVolume", t);
    let t = Instant::now();
    node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: name.into(),
        staging_target_path: staging.display().to_string(),
    })
    .await
    .map_err(call("NodeUnstageVolume"))?;
    timed("NodeUnstageVolume", t);
    let t = Instant::now();
    ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
        volume_id: name.into(),
        node_id,
        secrets: HashMap::new(),
    })
    .await
    .map_err(call("ControllerUnpublishVolume"))?;
    timed("ControllerUnpublishVolume", t);
    let t = Instant::now();
    ctl.delete_volume(csi::DeleteVolumeRequest {
        volume_id: name.into(),
        secrets: HashMap::new(),
    })
    .await
    .map_err(call("DeleteVolume"))?;
    timed("DeleteVolume", t);
    Ok(steps)
}
