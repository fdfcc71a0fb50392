//! The lab: one scenario's processes (agent, controller, node plugins) and directories, and
//! the CSI flows driven through them.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::v1::agent_client::AgentClient;
use pillar_csi::csi;
use pillar_csi::csi::controller_client::ControllerClient;
use pillar_csi::csi::node_client::NodeClient;
use pillar_csi::csi::volume_capability::access_mode::Mode;
use pillar_host::HostPaths;
use pillar_host::NamespaceDevice;
use pillar_nvmet::{HostNqn, NamespaceId, NamespaceIdentity, SubsystemNqn, VolumeId};
use pillar_state::EmbeddedStore;
use pillar_state::crd::{NvmeTcp, PillarAgentSpec, PillarProtocolSpec, PoolRef, ProtocolAuth};
use pillar_state::store::StateStore;
use tonic::transport::Channel;

use crate::harness::checks::{host_controllers, host_device};
use crate::harness::kmsg::Kmsg;
use crate::harness::machine::{kernel_has_auth, lane_root, nvmet_is_empty, reset_machine};
use crate::harness::process::{Proc, agent_bin, channel, csi_bin};
use crate::harness::{
    AGENT_NAME, CTRL_LOSS_TMO, ETC_HOSTID, ETC_HOSTNQN, NVMET, POOL, PORT, PROTOCOL,
    RECONNECT_DELAY, SECOND_HOSTID,
};

pub(crate) fn mount_cap(mode: Mode) -> csi::VolumeCapability {
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

pub(crate) fn rwo() -> csi::VolumeCapability {
    mount_cap(Mode::SingleNodeWriter)
}

pub(crate) fn host_paths() -> HostPaths {
    HostPaths::system()
}

pub(crate) fn nqn_of(volume: &str) -> SubsystemNqn {
    VolumeId::parse(volume).expect("volume id").subsystem_nqn()
}

pub(crate) fn identity_of(volume: &str) -> NamespaceIdentity {
    NamespaceIdentity::derive(&nqn_of(volume), NamespaceId::VOLUME)
}

/// A node plugin: its client and identity.
pub(crate) struct NodePlugin {
    name: String,
    id: String,
    pub(crate) host_nqn: HostNqn,
    pub(crate) host_id: uuid::Uuid,
    pub(crate) client: NodeClient<Channel>,
    pub(crate) dir: PathBuf,
}

/// One volume staged and published on a node.
#[derive(Clone, Debug)]
pub(crate) struct Staged {
    pub(crate) volume: String,
    node_id: String,
    pub(crate) publish_context: HashMap<String, String>,
    pub(crate) staging: PathBuf,
    pub(crate) target: PathBuf,
    pub(crate) device: NamespaceDevice,
}

impl Staged {
    /// `volume` as staged at `staging` and published at `target` on `node`, with the host's
    /// namespace device of it.
    pub(crate) fn on(
        node: &NodePlugin,
        volume: &str,
        publish_context: HashMap<String, String>,
        staging: PathBuf,
        target: PathBuf,
    ) -> Self {
        Self {
            volume: volume.into(),
            node_id: node.id.clone(),
            publish_context,
            staging,
            target,
            device: host_device(volume, &node.host_nqn),
        }
    }
}

pub(crate) struct Lab {
    pub(crate) dir: PathBuf,
    pub(crate) kmsg: Kmsg,
    pub(crate) agent: Option<Proc>,
    pub(crate) controller: Option<Proc>,
    nodes: Vec<Proc>,
}

impl Lab {
    /// A clean machine and a fresh directory; the store holds the PillarAgent and the
    /// PillarProtocol (acl as given) before the controller starts.
    pub(crate) async fn new(name: &str, acl: bool) -> Self {
        Self::with_ctrl_loss_tmo(name, acl, CTRL_LOSS_TMO).await
    }

    /// [`Lab::new`] with the PillarProtocol's `ctrl_loss_tmo` set to `ctrl_loss_tmo` seconds.
    pub(crate) async fn with_ctrl_loss_tmo(name: &str, acl: bool, ctrl_loss_tmo: i32) -> Self {
        reset_machine();
        assert!(
            nvmet_is_empty(),
            "nvmet state left over from an earlier scenario"
        );
        // W10: DH-HMAC-CHAP, pillar's default, where the kernel has it; `auth: none` (shown by
        // the controller's warning) where it has not, as an operator on that kernel must.
        let auth = if kernel_has_auth() {
            ProtocolAuth::Dhchap
        } else {
            println!(
                "  this kernel has no NVMe in-band authentication: the protocol says auth: none"
            );
            ProtocolAuth::None
        };
        let dir = lane_root().join(name);
        let _ = fs::remove_dir_all(&dir);
        for sub in ["pool", "store", "logs"] {
            fs::create_dir_all(dir.join(sub)).unwrap();
        }
        {
            let store = EmbeddedStore::open(dir.join("store"))
                .await
                .expect("open embedded store");
            store
                .create_agent(
                    AGENT_NAME,
                    PillarAgentSpec {
                        node: AGENT_NAME.into(),
                        address: format!("unix://{}", dir.join("agent.sock").display()),
                        tls: None,
                        pools: vec![PoolRef {
                            name: POOL.into(),
                            kind: "file".into(),
                        }],
                        nvme_address: "127.0.0.1".into(),
                        topology: Default::default(),
                    },
                )
                .await
                .expect("create PillarAgent");
            store
                .create_protocol(
                    PROTOCOL,
                    PillarProtocolSpec {
                        nvme_tcp: NvmeTcp {
                            port: PORT,
                            acl,
                            ctrl_loss_tmo,
                            reconnect_delay: RECONNECT_DELAY,
                            auth,
                            ..NvmeTcp::default()
                        },
                    },
                )
                .await
                .expect("create PillarProtocol");
        }
        Self {
            dir,
            kmsg: Kmsg::open(),
            agent: None,
            controller: None,
            nodes: Vec::new(),
        }
    }

    pub(crate) fn agent_state(&self) -> PathBuf {
        self.dir.join("agent-state")
    }

    /// Starts the agent on the kernel target; returns its client once it answers.
    pub(crate) async fn start_agent(&mut self, extra: &[&str]) -> AgentClient<Channel> {
        self.spawn_agent(&self.agent_state(), extra, &[]);
        AgentClient::new(channel(&self.dir.join("agent.sock")).await)
    }

    /// Starts the agent on the state directory `state`, with extra flags and environment
    /// variables; does not wait for it (see [`Lab::agent_client`]).
    pub(crate) fn spawn_agent(&mut self, state: &Path, extra: &[&str], env: &[(&str, &str)]) {
        let socket = self.dir.join("agent.sock");
        let _ = fs::remove_file(&socket);
        let engine = std::env::var("PILLAR_LANE_ENGINE").unwrap_or_else(|_| "io_uring".into());
        let mut args: Vec<String> = vec![
            "--state-dir".into(),
            state.display().to_string(),
            "--listen".into(),
            format!("unix://{}", socket.display()),
            "--engine".into(),
            engine,
            "--target".into(),
            "kernel".into(),
            "--nvme-address".into(),
            "127.0.0.1".into(),
            "--pool".into(),
            format!("{POOL}=file:{}", self.dir.join("pool").display()),
            "--insecure-plaintext".into(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        self.agent = Some(Proc::spawn_env(
            "agent",
            &agent_bin(),
            &args,
            &self.dir.join("logs/agent.log"),
            env,
        ));
    }

    pub(crate) async fn agent_client(&self) -> AgentClient<Channel> {
        AgentClient::new(channel(&self.dir.join("agent.sock")).await)
    }

    pub(crate) async fn start_controller(&mut self, resync_secs: u64) -> ControllerClient<Channel> {
        let socket = self.dir.join("controller.sock");
        let _ = fs::remove_file(&socket);
        let args: Vec<String> = vec![
            "controller".into(),
            "--endpoint".into(),
            format!("unix://{}", socket.display()),
            "--embedded-store".into(),
            self.dir.join("store").display().to_string(),
            "--resync-interval-secs".into(),
            resync_secs.to_string(),
            // The lane's agent listens on a unix socket, which takes no TLS.
            "--agent-insecure-plaintext".into(),
        ];
        self.controller = Some(Proc::spawn(
            "controller",
            &csi_bin(),
            &args,
            &self.dir.join("logs/controller.log"),
        ));
        ControllerClient::new(channel(&socket).await)
    }

    /// Starts a node plugin with the host identity in the given files.
    pub(crate) async fn start_node(
        &mut self,
        name: &str,
        hostnqn_file: &Path,
        hostid_file: &Path,
    ) -> NodePlugin {
        let dir = self.dir.join(name);
        fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("csi.sock");
        let args: Vec<String> = vec![
            "node".into(),
            "--endpoint".into(),
            format!("unix://{}", socket.display()),
            "--node-name".into(),
            name.into(),
            "--state-dir".into(),
            dir.join("state").display().to_string(),
            "--hostnqn-file".into(),
            hostnqn_file.display().to_string(),
            "--hostid-file".into(),
            hostid_file.display().to_string(),
        ];
        self.nodes.push(Proc::spawn(
            name,
            &csi_bin(),
            &args,
            &self.dir.join(format!("logs/{name}.log")),
        ));
        let mut client = NodeClient::new(channel(&socket).await);
        let info = client
            .node_get_info(csi::NodeGetInfoRequest {})
            .await
            .expect("NodeGetInfo")
            .into_inner();
        let host_nqn: HostNqn = fs::read_to_string(hostnqn_file)
            .unwrap()
            .trim()
            .parse()
            .expect("host NQN");
        let host_id: uuid::Uuid = fs::read_to_string(hostid_file)
            .unwrap()
            .trim()
            .parse()
            .expect("host ID");
        assert_eq!(
            info.node_id,
            format!("{name}/{host_nqn}"),
            "node ID is <node-name>/<host-nqn>"
        );
        println!("  node {name}: node ID {}", info.node_id);
        NodePlugin {
            name: name.into(),
            id: info.node_id,
            host_nqn,
            host_id,
            client,
            dir,
        }
    }

    /// The default node: the guest's /etc/nvme identity.
    pub(crate) async fn start_default_node(&mut self) -> NodePlugin {
        self.start_node("node-a", Path::new(ETC_HOSTNQN), Path::new(ETC_HOSTID))
            .await
    }

    /// A node with a second host identity of this machine.
    pub(crate) async fn start_second_node(&mut self) -> NodePlugin {
        let nqn = self.dir.join("hostnqn-b");
        let id = self.dir.join("hostid-b");
        fs::write(
            &nqn,
            format!("nqn.2014-08.org.nvmexpress:uuid:{SECOND_HOSTID}\n"),
        )
        .unwrap();
        fs::write(&id, format!("{SECOND_HOSTID}\n")).unwrap();
        self.start_node("node-b", &nqn, &id).await
    }

    /// The lifecycle UID the controller recorded for `volume` (read from the store's file).
    pub(crate) fn volume_uid(&self, volume: &str) -> String {
        let path = self.dir.join(format!("store/volumes/{volume}.json"));
        let v: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        v["metadata"]["uid"].as_str().expect("uid").to_owned()
    }

    pub(crate) fn dump_logs(&self) {
        for p in self
            .agent
            .iter()
            .chain(self.controller.iter())
            .chain(self.nodes.iter())
        {
            println!(
                "----- last lines of {} ({}):\n{}",
                p.name,
                p.log.display(),
                p.tail(40)
            );
        }
    }

    // -- CSI flows ------------------------------------------------------------------------------

    pub(crate) async fn create_volume(
        &self,
        ctl: &mut ControllerClient<Channel>,
        volume: &str,
        size: u64,
    ) -> csi::Volume {
        let v = ctl
            .create_volume(csi::CreateVolumeRequest {
                name: volume.into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: i64::try_from(size).unwrap(),
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![rwo()],
                ..Default::default()
            })
            .await
            .expect("CreateVolume")
            .into_inner()
            .volume
            .expect("volume");
        assert_eq!(v.volume_id, volume);
        assert!(
            u64::try_from(v.capacity_bytes).unwrap() >= size,
            "capacity {} < {size}",
            v.capacity_bytes
        );
        println!(
            "  CreateVolume {volume}: {} bytes, context {:?}",
            v.capacity_bytes, v.volume_context
        );
        v
    }

    pub(crate) async fn publish(
        &self,
        ctl: &mut ControllerClient<Channel>,
        volume: &str,
        node: &NodePlugin,
    ) -> Result<HashMap<String, String>, tonic::Status> {
        let r = ctl
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: volume.into(),
                node_id: node.id.clone(),
                volume_capability: Some(rwo()),
                readonly: false,
                secrets: HashMap::new(),
                volume_context: HashMap::new(),
            })
            .await
            .map(|r| r.into_inner().publish_context);
        println!(
            "  ControllerPublishVolume {volume} -> {}: {}",
            node.name,
            r.as_ref().map_or_else(
                |s| format!("{:?} {}", s.code(), s.message()),
                |c| format!("{c:?}")
            )
        );
        r
    }

    pub(crate) async fn stage(
        &self,
        node: &mut NodePlugin,
        volume: &str,
        publish_context: &HashMap<String, String>,
    ) -> Result<PathBuf, tonic::Status> {
        let staging = node.dir.join(format!("staging/{volume}"));
        let t = Instant::now();
        let r = node
            .client
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: volume.into(),
                publish_context: publish_context.clone(),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(rwo()),
                secrets: self.stage_secrets(node),
                volume_context: HashMap::new(),
            })
            .await;
        println!(
            "  NodeStageVolume {volume} on {} ({:.1}s): {}",
            node.name,
            t.elapsed().as_secs_f64(),
            r.as_ref().map_or_else(
                |s| format!("{:?} {}", s.code(), s.message()),
                |_| "ok".into()
            )
        );
        r.map(|_| staging)
    }

    /// What kubelet passes in NodeStageVolume's `secrets`: the node's own DH-HMAC-CHAP
    /// credentials, read from the controller's store (in a cluster: the PV's node-stage
    /// Secret); empty when the controller made none for it.
    pub(crate) fn stage_secrets(&self, node: &NodePlugin) -> HashMap<String, String> {
        let dir = self
            .dir
            .join("store")
            .join(pillar_state::embedded::CREDENTIALS_DIR);
        match pillar_state::credentials::read(&dir, &node.name).expect("credentials readable") {
            Some(c) => HashMap::from([
                (pillar_csi::context::SECRET_DHCHAP.to_owned(), c.secret),
                (
                    pillar_csi::context::SECRET_DHCHAP_CTRL.to_owned(),
                    c.ctrl_secret,
                ),
            ]),
            None => HashMap::new(),
        }
    }

    pub(crate) async fn node_publish(
        &self,
        node: &mut NodePlugin,
        volume: &str,
        staging: &Path,
        publish_context: &HashMap<String, String>,
    ) -> PathBuf {
        let pod = node.dir.join(format!("pods/pod-{volume}/volumes/{volume}"));
        fs::create_dir_all(&pod).unwrap();
        let target = pod.join("mount");
        node.client
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: volume.into(),
                publish_context: publish_context.clone(),
                staging_target_path: staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(rwo()),
                readonly: false,
                secrets: HashMap::new(),
                volume_context: HashMap::new(),
            })
            .await
            .expect("NodePublishVolume");
        println!(
            "  NodePublishVolume {volume} on {} -> {}",
            node.name,
            target.display()
        );
        target
    }

    /// ControllerPublish -> NodeStage -> NodePublish, then the checks every staged volume must
    /// pass: one namespace of this host with the derived identity, the staging mount on it, the
    /// pod path mounted.
    pub(crate) async fn attach(
        &mut self,
        ctl: &mut ControllerClient<Channel>,
        node: &mut NodePlugin,
        volume: &str,
    ) -> Staged {
        let publish_context = self
            .publish(ctl, volume, node)
            .await
            .expect("ControllerPublishVolume");
        let staging = self
            .stage(node, volume, &publish_context)
            .await
            .expect("NodeStageVolume");
        let target = self
            .node_publish(node, volume, &staging, &publish_context)
            .await;
        let device = host_device(volume, &node.host_nqn);
        let staged_mount = pillar_host::find_mount(&staging)
            .unwrap()
            .expect("staging path is mounted");
        assert_eq!(
            staged_mount.source,
            device.dev_path.display().to_string(),
            "staging mount is on the volume's namespace"
        );
        assert_eq!(staged_mount.fs_type, "ext4");
        let pod_mount = pillar_host::find_mount(&target)
            .unwrap()
            .expect("pod path is mounted");
        assert_eq!(
            (pod_mount.major, pod_mount.minor),
            (staged_mount.major, staged_mount.minor),
            "pod path shows the staged filesystem"
        );
        Staged {
            volume: volume.into(),
            node_id: node.id.clone(),
            publish_context,
            staging,
            target,
            device,
        }
    }

    /// NodeUnpublish -> NodeUnstage (this host's controller of the subsystem goes) ->
    /// ControllerUnpublish.
    pub(crate) async fn detach(
        &mut self,
        ctl: &mut ControllerClient<Channel>,
        node: &mut NodePlugin,
        s: &Staged,
    ) {
        node.client
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: s.volume.clone(),
                target_path: s.target.display().to_string(),
            })
            .await
            .expect("NodeUnpublishVolume");
        assert!(
            pillar_host::find_mount(&s.target).unwrap().is_none(),
            "pod path still mounted after NodeUnpublishVolume"
        );
        node.client
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: s.volume.clone(),
                staging_target_path: s.staging.display().to_string(),
            })
            .await
            .expect("NodeUnstageVolume");
        assert!(
            pillar_host::find_mount(&s.staging).unwrap().is_none(),
            "staging path still mounted after NodeUnstageVolume"
        );
        assert!(
            host_controllers(&s.volume, &node.host_nqn).is_empty(),
            "a controller of {} is left after NodeUnstageVolume",
            node.name
        );
        self.unpublish(ctl, node, s).await;
        println!("  detached {} from {}", s.volume, node.name);
    }

    /// ControllerUnpublish of `s` from `node`; the node's host NQN leaves `allowed_hosts`.
    pub(crate) async fn unpublish(
        &self,
        ctl: &mut ControllerClient<Channel>,
        node: &NodePlugin,
        s: &Staged,
    ) {
        ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: s.volume.clone(),
            node_id: s.node_id.clone(),
            secrets: HashMap::new(),
        })
        .await
        .expect("ControllerUnpublishVolume");
        let link = Path::new(NVMET)
            .join("subsystems")
            .join(nqn_of(&s.volume).as_str())
            .join("allowed_hosts")
            .join(node.host_nqn.as_str());
        assert!(
            !link.exists(),
            "{} still in allowed_hosts after ControllerUnpublishVolume",
            node.host_nqn
        );
        println!(
            "  ControllerUnpublishVolume {} from {}",
            s.volume, node.name
        );
    }

    pub(crate) async fn delete_volume(&self, ctl: &mut ControllerClient<Channel>, volume: &str) {
        ctl.delete_volume(csi::DeleteVolumeRequest {
            volume_id: volume.into(),
            secrets: HashMap::new(),
        })
        .await
        .expect("DeleteVolume");
        let sub = Path::new(NVMET)
            .join("subsystems")
            .join(nqn_of(volume).as_str());
        assert!(
            !sub.exists(),
            "subsystem {} left after DeleteVolume",
            sub.display()
        );
        assert!(
            !self.dir.join(format!("pool/{volume}.img")).exists(),
            "backing file left after DeleteVolume"
        );
        println!("  DeleteVolume {volume}: subsystem and backing file gone");
    }

    pub(crate) async fn wait_agent_state(
        &self,
        want: agent_api::health_response::State,
        timeout: Duration,
    ) -> Duration {
        let start = Instant::now();
        let mut c = self.agent_client().await;
        loop {
            if let Ok(h) = c.health(agent_api::HealthRequest {}).await
                && h.get_ref().state() == want
            {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < timeout,
                "agent did not reach {want:?} within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_logs();
        }
        for n in &mut self.nodes {
            n.stop();
        }
        if let Some(c) = self.controller.as_mut() {
            c.stop();
        }
        if let Some(a) = self.agent.as_mut() {
            a.stop();
        }
        reset_machine();
    }
}

/// NodeUnpublish + NodeUnstage on `node`, each within 60 s.
pub(crate) async fn node_teardown(node: &mut NodePlugin, s: &Staged) {
    let limit = Duration::from_secs(60);
    tokio::time::timeout(
        limit,
        node.client
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: s.volume.clone(),
                target_path: s.target.display().to_string(),
            }),
    )
    .await
    .expect("NodeUnpublishVolume answers")
    .expect("NodeUnpublishVolume");
    tokio::time::timeout(
        limit,
        node.client
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: s.volume.clone(),
                staging_target_path: s.staging.display().to_string(),
            }),
    )
    .await
    .expect("NodeUnstageVolume answers")
    .expect("NodeUnstageVolume");
    assert!(pillar_host::find_mount(&s.staging).unwrap().is_none());
    assert!(pillar_host::find_mount(&s.target).unwrap().is_none());
    assert!(host_controllers(&s.volume, &node.host_nqn).is_empty());
}
