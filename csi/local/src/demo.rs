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
    let mut demo = Demo {
        ctl: ControllerClient::new(channel(controller_socket).await?),
        node: NodeClient::new(channel(node_socket).await?),
        name: name.to_owned(),
        staging: work.join("staging").display().to_string(),
        target: work.join("pod/volume"),
        steps: Vec::new(),
    };
    let attached = demo.attach(size).await?;
    demo.write_and_verify()?;
    demo.stats().await?;
    demo.detach(attached.node_id).await?;
    Ok(demo.steps)
}

fn call(step: &'static str) -> impl FnOnce(tonic::Status) -> DemoError {
    move |source| DemoError::Call { step, source }
}

fn io(step: &'static str) -> impl FnOnce(std::io::Error) -> DemoError {
    move |source| DemoError::Io { step, source }
}

/// The clients, paths and steps of one run.
struct Demo {
    ctl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    name: String,
    staging: String,
    target: PathBuf,
    steps: Vec<Step>,
}

/// What detaching needs from attaching.
struct Attached {
    node_id: String,
}

impl Demo {
    /// Records a step that started at `started` and prints it.
    fn timed(&mut self, name: &'static str, started: Instant) {
        let s = Step {
            name,
            took: started.elapsed(),
        };
        println!("  {:<28} {:>9.3} ms", s.name, s.took.as_secs_f64() * 1e3);
        self.steps.push(s);
    }

    fn target_path(&self) -> String {
        self.target.display().to_string()
    }

    /// NodeGetInfo, CreateVolume, ControllerPublish, NodeStage (mkfs, mount), NodePublish.
    async fn attach(&mut self, size: i64) -> Result<Attached, DemoError> {
        use csi::volume_capability::access_mode::Mode;
        let cap = mount_cap(Mode::SingleNodeWriter);
        let t = Instant::now();
        let info = self.node.node_get_info(csi::NodeGetInfoRequest {}).await;
        let node_id = info.map_err(call("NodeGetInfo"))?.into_inner().node_id;
        self.timed("NodeGetInfo", t);
        let t = Instant::now();
        let request = csi::CreateVolumeRequest {
            name: self.name.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: size,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        };
        let created = self.ctl.create_volume(request).await;
        let created = created.map_err(call("CreateVolume"))?.into_inner();
        self.timed("CreateVolume", t);
        let volume_context = created.volume.map(|v| v.volume_context).unwrap_or_default();
        let t = Instant::now();
        let request = csi::ControllerPublishVolumeRequest {
            volume_id: self.name.clone(),
            node_id: node_id.clone(),
            volume_capability: Some(cap.clone()),
            readonly: false,
            secrets: HashMap::new(),
            volume_context: volume_context.clone(),
        };
        let published = self.ctl.controller_publish_volume(request).await;
        let publish_context = published
            .map_err(call("ControllerPublishVolume"))?
            .into_inner()
            .publish_context;
        self.timed("ControllerPublishVolume", t);
        let t = Instant::now();
        let request = csi::NodeStageVolumeRequest {
            volume_id: self.name.clone(),
            publish_context: publish_context.clone(),
            staging_target_path: self.staging.clone(),
            volume_capability: Some(cap.clone()),
            secrets: HashMap::new(),
            volume_context: volume_context.clone(),
        };
        let staged = self.node.node_stage_volume(request).await;
        staged.map_err(call("NodeStageVolume"))?;
        self.timed("NodeStageVolume (mkfs, mount)", t);
        let t = Instant::now();
        let request = csi::NodePublishVolumeRequest {
            volume_id: self.name.clone(),
            publish_context,
            staging_target_path: self.staging.clone(),
            target_path: self.target_path(),
            volume_capability: Some(cap),
            readonly: false,
            secrets: HashMap::new(),
            volume_context,
        };
        let published = self.node.node_publish_volume(request).await;
        published.map_err(call("NodePublishVolume"))?;
        self.timed("NodePublishVolume", t);
        Ok(Attached { node_id })
    }

    /// Writes 4 MiB of a fixed pattern to the published path, fsyncs, reads it back and
    /// compares checksums.
    fn write_and_verify(&mut self) -> Result<(), DemoError> {
        use std::io::Write as _;
        let t = Instant::now();
        let data: Vec<u8> = (0..4u32 << 20)
            .map(|i| u8::try_from(i.wrapping_mul(2_654_435_761) >> 24).unwrap_or(0))
            .collect();
        let file = self.target.join("data.bin");
        {
            let mut f = std::fs::File::create(&file).map_err(io("create"))?;
            f.write_all(&data).map_err(io("write"))?;
            f.sync_all().map_err(io("fsync"))?;
        }
        let written = Sha256::digest(&data);
        let read = std::fs::read(&file).map_err(io("read"))?;
        if Sha256::digest(&read) != written {
            return Err(DemoError::Checksum);
        }
        self.timed("write 4 MiB + fsync + verify", t);
        Ok(())
    }

    /// NodeGetVolumeStats on the published path, printed.
    async fn stats(&mut self) -> Result<(), DemoError> {
        let t = Instant::now();
        let request = csi::NodeGetVolumeStatsRequest {
            volume_id: self.name.clone(),
            volume_path: self.target_path(),
            staging_target_path: self.staging.clone(),
        };
        let stats = self.node.node_get_volume_stats(request).await;
        let stats = stats.map_err(call("NodeGetVolumeStats"))?.into_inner();
        self.timed("NodeGetVolumeStats", t);
        for u in &stats.usage {
            println!(
                "    usage: total {} used {} available {} ({:?})",
                u.total,
                u.used,
                u.available,
                u.unit()
            );
        }
        Ok(())
    }

    /// NodeUnpublish, NodeUnstage, ControllerUnpublish, DeleteVolume.
    async fn detach(&mut self, node_id: String) -> Result<(), DemoError> {
        let t = Instant::now();
        let request = csi::NodeUnpublishVolumeRequest {
            volume_id: self.name.clone(),
            target_path: self.target_path(),
        };
        let done = self.node.node_unpublish_volume(request).await;
        done.map_err(call("NodeUnpublishVolume"))?;
        self.timed("NodeUnpublishVolume", t);
        let t = Instant::now();
        let request = csi::NodeUnstageVolumeRequest {
            volume_id: self.name.clone(),
            staging_target_path: self.staging.clone(),
        };
        let done = self.node.node_unstage_volume(request).await;
        done.map_err(call("NodeUnstageVolume"))?;
        self.timed("NodeUnstageVolume", t);
        let t = Instant::now();
        let request = csi::ControllerUnpublishVolumeRequest {
            volume_id: self.name.clone(),
            node_id,
            secrets: HashMap::new(),
        };
        let done = self.ctl.controller_unpublish_volume(request).await;
        done.map_err(call("ControllerUnpublishVolume"))?;
        self.timed("ControllerUnpublishVolume", t);
        let t = Instant::now();
        let request = csi::DeleteVolumeRequest {
            volume_id: self.name.clone(),
            secrets: HashMap::new(),
        };
        let done = self.ctl.delete_volume(request).await;
        done.map_err(call("DeleteVolume"))?;
        self.timed("DeleteVolume", t);
        Ok(())
    }
}
