//! `pillarctl`: drives a pillar controller and node plugin through their CSI sockets, the way
//! kubelet and the sidecars do, for operators, the kernel lane and the xfstests harness.
//! Prints one JSON object per command on stdout.

// A command-line tool: its output is its result.
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use hyper_util::rt::TokioIo;
use pillar_csi::csi;
use pillar_csi::csi::controller_client::ControllerClient;
use pillar_csi::csi::node_client::NodeClient;
use pillar_csi::csi::volume_capability::access_mode::Mode as CsiMode;
use serde_json::json;
use tonic::transport::{Channel, Endpoint, Uri};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Drive pillar's CSI controller and node plugin from the command line"
)]
struct Args {
    /// The controller's CSI socket.
    #[arg(long, default_value = "/var/lib/pillar/local/controller.sock")]
    controller: PathBuf,
    /// The node plugin's CSI socket.
    #[arg(long, default_value = "/var/lib/pillar/local/node.sock")]
    node: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Mode {
    /// SINGLE_NODE_WRITER (ReadWriteOnce).
    Rwo,
    /// SINGLE_NODE_SINGLE_WRITER (ReadWriteOncePod).
    Rwop,
    /// MULTI_NODE_READER_ONLY (ReadOnlyMany).
    Rox,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// NodeGetInfo of the node plugin.
    Info,
    /// CreateVolume.
    Create(CreateArgs),
    /// ControllerPublishVolume to this node, then NodeStageVolume at PATH (and, with
    /// --target, NodePublishVolume there).
    Attach(AttachArgs),
    /// NodeUnpublishVolume (with --target), NodeUnstageVolume, ControllerUnpublishVolume.
    Detach(DetachArgs),
    /// ControllerExpandVolume, then NodeExpandVolume at PATH.
    Expand(ExpandArgs),
    /// NodeGetVolumeStats at PATH.
    Stats(StatsArgs),
    /// DeleteVolume.
    Delete { name: String },
    /// The NVMe block device of an attached volume on this host (by subsystem NQN in sysfs).
    Device { name: String },
    /// One node-side call alone, as kubelet makes it: with the publish context the attacher
    /// recorded in the VolumeAttachment and the PV's volume attributes (the end-to-end suite
    /// plays kubelet with these where no kubelet runs).
    #[command(subcommand)]
    Kubelet(KubeletCall),
}

/// The calls kubelet makes on a node plugin, each with what kubelet passes.
#[derive(Debug, clap::Args)]
struct CreateArgs {
    name: String,
    #[arg(long)]
    size: i64,
    #[arg(long)]
    block: bool,
    #[arg(long, value_enum, default_value = "rwo")]
    mode: Mode,
}

#[derive(Debug, clap::Args)]
struct AttachArgs {
    name: String,
    #[arg(long)]
    staging: PathBuf,
    #[arg(long)]
    target: Option<PathBuf>,
    #[arg(long)]
    block: bool,
    #[arg(long)]
    readonly: bool,
    #[arg(long, value_enum, default_value = "rwo")]
    mode: Mode,
}

#[derive(Debug, clap::Args)]
struct DetachArgs {
    name: String,
    #[arg(long)]
    staging: PathBuf,
    #[arg(long)]
    target: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct ExpandArgs {
    name: String,
    #[arg(long)]
    size: i64,
    #[arg(long)]
    path: PathBuf,
    #[arg(long)]
    staging: PathBuf,
}

#[derive(Debug, clap::Args)]
struct StatsArgs {
    name: String,
    #[arg(long)]
    path: PathBuf,
}

#[derive(Debug, Subcommand)]
enum KubeletCall {
    /// NodeStageVolume.
    Stage {
        volume_id: String,
        #[arg(long)]
        staging: PathBuf,
        #[command(flatten)]
        volume: KubeletVolume,
    },
    /// NodePublishVolume.
    Publish {
        volume_id: String,
        #[arg(long)]
        staging: PathBuf,
        #[arg(long)]
        target: PathBuf,
        #[arg(long)]
        readonly: bool,
        #[command(flatten)]
        volume: KubeletVolume,
    },
    /// NodeUnpublishVolume.
    Unpublish {
        volume_id: String,
        #[arg(long)]
        target: PathBuf,
    },
    /// NodeUnstageVolume.
    Unstage {
        volume_id: String,
        #[arg(long)]
        staging: PathBuf,
    },
    /// NodeExpandVolume.
    Expand {
        volume_id: String,
        #[arg(long)]
        size: i64,
        #[arg(long)]
        path: PathBuf,
        #[arg(long)]
        staging: PathBuf,
        #[arg(long)]
        block: bool,
        #[arg(long, value_enum, default_value = "rwo")]
        mode: Mode,
    },
}

/// What kubelet passes about the volume on stage and publish.
#[derive(Debug, clap::Args)]
struct KubeletVolume {
    #[arg(long)]
    block: bool,
    #[arg(long, value_enum, default_value = "rwo")]
    mode: Mode,
    /// The PV's `csi.fsType`.
    #[arg(long, default_value = "")]
    fs_type: String,
    /// A publish-context entry `KEY=VALUE` (repeatable).
    #[arg(long = "publish-context", value_parser = key_value)]
    publish_context: Vec<(String, String)>,
    /// A volume-context entry `KEY=VALUE` (repeatable).
    #[arg(long = "volume-context", value_parser = key_value)]
    volume_context: Vec<(String, String)>,
}

fn key_value(raw: &str) -> Result<(String, String), String> {
    raw.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{raw:?} is not KEY=VALUE"))
}

async fn channel(path: &Path) -> anyhow::Result<Channel> {
    let p = path.to_owned();
    Endpoint::from_static("http://csi.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = p.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?))
            }
        }))
        .await
        .with_context(|| format!("connecting to {}", path.display()))
}

/// The capability kubelet passes: the PV's access mode and, for a filesystem volume, its fsType.
fn kubelet_capability(volume: &KubeletVolume) -> csi::VolumeCapability {
    let mut cap = capability(volume.block, volume.mode);
    if let Some(csi::volume_capability::AccessType::Mount(m)) = &mut cap.access_type {
        m.fs_type.clone_from(&volume.fs_type);
    }
    cap
}

/// Makes one node-side call as kubelet does.
async fn kubelet_call(
    mut node: NodeClient<Channel>,
    call: KubeletCall,
) -> anyhow::Result<serde_json::Value> {
    let path = |p: &Path| p.display().to_string();
    Ok(match call {
        KubeletCall::Stage {
            volume_id,
            staging,
            volume,
        } => {
            node.node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: volume_id.clone(),
                publish_context: volume.publish_context.iter().cloned().collect(),
                staging_target_path: path(&staging),
                volume_capability: Some(kubelet_capability(&volume)),
                volume_context: volume.volume_context.iter().cloned().collect(),
                ..Default::default()
            })
            .await?;
            json!({"volume_id": volume_id, "staged": staging})
        }
        KubeletCall::Publish {
            volume_id,
            staging,
            target,
            readonly,
            volume,
        } => {
            node.node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: volume_id.clone(),
                publish_context: volume.publish_context.iter().cloned().collect(),
                staging_target_path: path(&staging),
                target_path: path(&target),
                volume_capability: Some(kubelet_capability(&volume)),
                readonly,
                volume_context: volume.volume_context.iter().cloned().collect(),
                ..Default::default()
            })
            .await?;
            json!({"volume_id": volume_id, "published": target})
        }
        KubeletCall::Unpublish { volume_id, target } => {
            node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: volume_id.clone(),
                target_path: path(&target),
            })
            .await?;
            json!({"volume_id": volume_id, "unpublished": target})
        }
        KubeletCall::Unstage { volume_id, staging } => {
            node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: volume_id.clone(),
                staging_target_path: path(&staging),
            })
            .await?;
            json!({"volume_id": volume_id, "unstaged": staging})
        }
        KubeletCall::Expand {
            volume_id,
            size,
            path: volume_path,
            staging,
            block,
            mode,
        } => {
            let request = csi::NodeExpandVolumeRequest {
                volume_id: volume_id.clone(),
                volume_path: path(&volume_path),
                capacity_range: size_range(size),
                staging_target_path: path(&staging),
                volume_capability: Some(capability(block, mode)),
                ..Default::default()
            };
            let grown = node.node_expand_volume(request).await?.into_inner();
            json!({"volume_id": volume_id, "capacity_bytes": grown.capacity_bytes})
        }
    })
}

fn capability(block: bool, mode: Mode) -> csi::VolumeCapability {
    let mode = match mode {
        Mode::Rwo => CsiMode::SingleNodeWriter,
        Mode::Rwop => CsiMode::SingleNodeSingleWriter,
        Mode::Rox => CsiMode::MultiNodeReaderOnly,
    };
    csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode.into() }),
        access_type: Some(if block {
            csi::volume_capability::AccessType::Block(csi::volume_capability::BlockVolume {})
        } else {
            csi::volume_capability::AccessType::Mount(csi::volume_capability::MountVolume::default())
        }),
    }
}

/// The two CSI sockets, connected on first use by each command.
struct Sockets {
    controller: PathBuf,
    node: PathBuf,
}

impl Sockets {
    async fn node(&self) -> anyhow::Result<NodeClient<Channel>> {
        Ok(NodeClient::new(channel(&self.node).await?))
    }

    async fn controller(&self) -> anyhow::Result<ControllerClient<Channel>> {
        Ok(ControllerClient::new(channel(&self.controller).await?))
    }
}

fn size_range(size: i64) -> Option<csi::CapacityRange> {
    Some(csi::CapacityRange {
        required_bytes: size,
        limit_bytes: 0,
    })
}

async fn node_id(node: &mut NodeClient<Channel>) -> anyhow::Result<String> {
    let info = node.node_get_info(csi::NodeGetInfoRequest {}).await?;
    Ok(info.into_inner().node_id)
}

async fn info(s: &Sockets) -> anyhow::Result<serde_json::Value> {
    let mut node = s.node().await?;
    let info = node.node_get_info(csi::NodeGetInfoRequest {}).await?;
    let info = info.into_inner();
    let topology = info.accessible_topology.map(|t| t.segments);
    Ok(json!({"node_id": info.node_id, "topology": topology}))
}

async fn create(s: &Sockets, a: CreateArgs) -> anyhow::Result<serde_json::Value> {
    let request = csi::CreateVolumeRequest {
        name: a.name,
        capacity_range: size_range(a.size),
        volume_capabilities: vec![capability(a.block, a.mode)],
        ..Default::default()
    };
    let created = s.controller().await?.create_volume(request).await?;
    let v = created
        .into_inner()
        .volume
        .context("CreateVolume returned no volume")?;
    Ok(
        json!({"volume_id": v.volume_id, "capacity_bytes": v.capacity_bytes, "volume_context": v.volume_context}),
    )
}

/// ControllerPublish to this node, NodeStage, and NodePublish if a target is given.
async fn attach(s: &Sockets, a: AttachArgs) -> anyhow::Result<serde_json::Value> {
    let mut node = s.node().await?;
    let cap = capability(a.block, a.mode);
    let request = csi::ControllerPublishVolumeRequest {
        volume_id: a.name.clone(),
        node_id: node_id(&mut node).await?,
        volume_capability: Some(cap.clone()),
        readonly: a.readonly,
        ..Default::default()
    };
    let mut controller = s.controller().await?;
    let published = controller.controller_publish_volume(request).await?;
    let ctx = published.into_inner().publish_context;
    node.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: a.name.clone(),
        publish_context: ctx.clone(),
        staging_target_path: a.staging.display().to_string(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    })
    .await?;
    if let Some(target) = &a.target {
        node.node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: a.name.clone(),
            publish_context: ctx.clone(),
            staging_target_path: a.staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(cap),
            readonly: a.readonly,
            ..Default::default()
        })
        .await?;
    }
    Ok(
        json!({"volume_id": a.name, "publish_context": ctx, "staging": a.staging, "target": a.target}),
    )
}

/// NodeUnpublish if a target is given, NodeUnstage, ControllerUnpublish from this node.
async fn detach(s: &Sockets, a: DetachArgs) -> anyhow::Result<serde_json::Value> {
    let mut node = s.node().await?;
    let node_id = node_id(&mut node).await?;
    if let Some(target) = &a.target {
        node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: a.name.clone(),
            target_path: target.display().to_string(),
        })
        .await?;
    }
    node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: a.name.clone(),
        staging_target_path: a.staging.display().to_string(),
    })
    .await?;
    let request = csi::ControllerUnpublishVolumeRequest {
        volume_id: a.name.clone(),
        node_id,
        secrets: HashMap::new(),
    };
    s.controller()
        .await?
        .controller_unpublish_volume(request)
        .await?;
    Ok(json!({"volume_id": a.name, "detached": true}))
}

/// ControllerExpand, then NodeExpand if the controller says the node must grow too.
async fn expand(s: &Sockets, a: ExpandArgs) -> anyhow::Result<serde_json::Value> {
    let request = csi::ControllerExpandVolumeRequest {
        volume_id: a.name.clone(),
        capacity_range: size_range(a.size),
        ..Default::default()
    };
    let mut controller = s.controller().await?;
    let grown = controller.controller_expand_volume(request).await?;
    let grown = grown.into_inner();
    let node = if grown.node_expansion_required {
        let request = csi::NodeExpandVolumeRequest {
            volume_id: a.name.clone(),
            volume_path: a.path.display().to_string(),
            capacity_range: size_range(a.size),
            staging_target_path: a.staging.display().to_string(),
            ..Default::default()
        };
        let grown = s.node().await?.node_expand_volume(request).await?;
        Some(grown.into_inner().capacity_bytes)
    } else {
        None
    };
    Ok(
        json!({"volume_id": a.name, "controller_capacity_bytes": grown.capacity_bytes, "node_capacity_bytes": node}),
    )
}

async fn stats(s: &Sockets, a: StatsArgs) -> anyhow::Result<serde_json::Value> {
    let request = csi::NodeGetVolumeStatsRequest {
        volume_id: a.name.clone(),
        volume_path: a.path.display().to_string(),
        staging_target_path: String::new(),
    };
    let stats = s.node().await?.node_get_volume_stats(request).await?;
    let stats = stats.into_inner();
    let usage: Vec<_> = stats
        .usage
        .iter()
        .map(|u| json!({"unit": u.unit().as_str_name(), "total": u.total, "used": u.used, "available": u.available}))
        .collect();
    let condition = stats
        .volume_condition
        .map(|c| json!({"abnormal": c.abnormal, "message": c.message}));
    Ok(json!({"volume_id": a.name, "usage": usage, "condition": condition}))
}

async fn delete(s: &Sockets, name: String) -> anyhow::Result<serde_json::Value> {
    let request = csi::DeleteVolumeRequest {
        volume_id: name.clone(),
        secrets: HashMap::new(),
    };
    s.controller().await?.delete_volume(request).await?;
    Ok(json!({"volume_id": name, "deleted": true}))
}

/// The NVMe block devices this host has for the volume's subsystem.
fn device(name: String) -> anyhow::Result<serde_json::Value> {
    let nqn = pillar_nvmet::VolumeId::parse(&name)?.subsystem_nqn();
    let devices = pillar_host::namespaces_for(&pillar_host::HostPaths::system(), &nqn)
        .context("reading NVMe sysfs")?;
    let paths: Vec<_> = devices
        .iter()
        .map(|d| d.dev_path.display().to_string())
        .collect();
    Ok(json!({"volume_id": name, "nqn": nqn.to_string(), "devices": paths}))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let s = Sockets {
        controller: args.controller,
        node: args.node,
    };
    let out = match args.command {
        Command::Info => info(&s).await?,
        Command::Create(a) => create(&s, a).await?,
        Command::Attach(a) => attach(&s, a).await?,
        Command::Detach(a) => detach(&s, a).await?,
        Command::Expand(a) => expand(&s, a).await?,
        Command::Stats(a) => stats(&s, a).await?,
        Command::Delete { name } => delete(&s, name).await?,
        Command::Device { name } => device(name)?,
        Command::Kubelet(call) => kubelet_call(s.node().await?, call).await?,
    };
    println!("{out}");
    Ok(())
}
