//! Shared pieces of the node service tests: a NodeService served over a real unix socket, loop
//! devices and mounts that clean up after themselves, a fake NVMe host whose namespace is a real
//! loop device, and request builders.
//!
//! Needs root and /dev/loop-control (loop devices, mount, mknod), util-linux, e2fsprogs and
//! xfsprogs. Every loop device and mount a test makes is its own and is undone in a Drop guard.

// Each test crate uses a different part of this module.
#![allow(dead_code)]

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use pillar_csi::context;
use pillar_csi::csi;
use pillar_csi::csi::node_client::NodeClient;
use pillar_csi::csi::volume_capability::access_mode::Mode;
use pillar_csi::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use pillar_csi::node::{AttachMode, NodeConfig, NodeService};
use pillar_host::HostPaths;
use pillar_host::fake::{FakeController, FakeNamespace, FakeSysfs};
use pillar_nvmet::{HostNqn, NamespaceId, NamespaceIdentity, SubsystemNqn, VolumeId};
use tempfile::TempDir;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Server, Uri};

pub const MIB: u64 = 1 << 20;
/// mkfs.xfs refuses filesystems under 300 MiB.
pub const SIZE: u64 = 512 * MIB;
pub const HOST_NQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0a0a0a0a-0000-4000-8000-00000000000a";
pub const OTHER_HOST_NQN: &str =
    "nqn.2014-08.org.nvmexpress:uuid:0b0b0b0b-0000-4000-8000-00000000000b";
pub const HOST_ID: &str = "0a0a0a0a-0000-4000-8000-00000000000a";
pub const NODE: &str = "worker-1";

pub fn require_root_and_loop() {
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let root = status
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"));
    assert!(
        root && Path::new("/dev/loop-control").exists(),
        "these tests need root and loop devices (/dev/loop-control); run them where both exist"
    );
}

/// Whether this process may grow ext4 online (resize2fs needs CAP_SYS_RESOURCE).
pub fn has_cap_sys_resource() -> bool {
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    eff & (1 << 24) != 0
}

/// A loop device over a sparse file, detached on drop.
pub struct LoopDevice {
    pub dev: PathBuf,
    pub backing: PathBuf,
    /// The backing file's directory; `None` for a second device over another's file.
    _dir: Option<TempDir>,
}

impl LoopDevice {
    pub fn new(size: u64) -> Self {
        require_root_and_loop();
        let dir = tempfile::tempdir().unwrap();
        let backing = dir.path().join("backing.img");
        fs::File::create(&backing).unwrap().set_len(size).unwrap();
        let dev = attach(&backing);
        // The guard exists before any check can panic, so the device is always detached.
        let lo = Self {
            dev,
            backing,
            _dir: Some(dir),
        };
        assert!(
            lo.dev.to_string_lossy().starts_with("/dev/loop"),
            "{:?}",
            lo.dev
        );
        lo
    }

    /// A second loop device over the same backing file: how a second host sees the same
    /// namespace. Drop it before `self`.
    pub fn second_device(&self) -> Self {
        Self {
            dev: attach(&self.backing),
            backing: self.backing.clone(),
            _dir: None,
        }
    }

    /// A new loop device over a byte copy of this one's backing file (sparse): what a clone or
    /// a restore of the volume is. Copied while the device is mounted, it is a snapshot of a
    /// filesystem in use, whose log needs recovery.
    pub fn copy(&self) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let backing = dir.path().join("backing.img");
        let st = Command::new("cp")
            .arg("--sparse=always")
            .arg(&self.backing)
            .arg(&backing)
            .status()
            .unwrap();
        assert!(st.success());
        let dev = attach(&backing);
        Self {
            dev,
            backing,
            _dir: Some(dir),
        }
    }

    /// Enlarges the backing file and tells the loop driver (`losetup -c`).
    pub fn grow(&self, size: u64) {
        OpenOptions::new()
            .write(true)
            .open(&self.backing)
            .unwrap()
            .set_len(size)
            .unwrap();
        let st = Command::new("losetup")
            .arg("-c")
            .arg(&self.dev)
            .status()
            .unwrap();
        assert!(st.success());
    }

    /// `(major, minor)` of the device.
    pub fn devnum(&self) -> (u32, u32) {
        let rdev = fs::metadata(&self.dev).unwrap().rdev();
        (libc::major(rdev), libc::minor(rdev))
    }

    /// What blkid sees on the device (`TYPE`), or `None` for a blank device.
    pub fn fs_type(&self) -> Option<String> {
        blkid_type(&self.dev)
    }
}

/// Attaches a free loop device to `backing`.
fn attach(backing: &Path) -> PathBuf {
    let out = Command::new("losetup")
        .args(["--find", "--show"])
        .arg(backing)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "losetup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

pub fn blkid_type(dev: &Path) -> Option<String> {
    let out = Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "TYPE"])
        .arg(dev)
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (!t.is_empty()).then_some(t)
}

/// Unmounts `path` (lazily, with the system tool, independent of the code under test) on drop,
/// so a failing test leaves no mount that keeps its loop device busy.
pub struct MountGuard(pub PathBuf);

impl Drop for MountGuard {
    fn drop(&mut self) {
        for _ in 0..4 {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The mount at exactly `path`, from the system's own view: `(fs type, options)`.
pub fn mount_at(path: &Path) -> Option<(String, String)> {
    let out = Command::new("findmnt")
        .args(["-n", "-o", "FSTYPE,OPTIONS", "--mountpoint"])
        .arg(path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().next()?;
    let mut parts = line.split_whitespace();
    Some((parts.next()?.to_owned(), parts.next()?.to_owned()))
}

/// A NodeService on a unix socket and a client connected to it.
pub struct Harness {
    pub client: NodeClient<Channel>,
    /// The plugin's state directory (records under `staged/`).
    pub state: PathBuf,
    /// A scratch directory for staging and target paths.
    pub work: PathBuf,
    _dir: TempDir,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub fn host_nqn() -> HostNqn {
    HostNqn::parse(HOST_NQN).unwrap()
}

pub fn config(dir: &Path, attach: AttachMode, paths: HostPaths) -> NodeConfig {
    NodeConfig {
        node_name: NODE.into(),
        host_nqn: host_nqn(),
        host_id: HOST_ID.parse().unwrap(),
        state_dir: dir.join("state"),
        paths,
        attach,
        connect_timeout: Duration::from_secs(3),
        // The fake sysfs's namespaces are loop devices, which answer no NVMe ioctl; the tests
        // that want the reservation step turn it on.
        reservations: false,
        topology: Default::default(),
    }
}

impl Harness {
    /// The single-machine mode on this host's /dev and /sys.
    pub async fn local() -> Self {
        Self::start(|dir| config(dir, AttachMode::LocalDevice, HostPaths::system())).await
    }

    /// NVMe/TCP mode on the given roots (a fake sysfs tree).
    pub async fn nvme(paths: HostPaths, connect_timeout: Duration) -> Self {
        Self::start(move |dir| {
            let mut c = config(dir, AttachMode::NvmeTcp, paths);
            c.connect_timeout = connect_timeout;
            c
        })
        .await
    }

    pub async fn start(make: impl FnOnce(&Path) -> NodeConfig) -> Self {
        Self::start_with(make, |service| service).await
    }

    /// As [`Self::start`], the service passed through `wrap` before it is served.
    pub async fn start_with(
        make: impl FnOnce(&Path) -> NodeConfig,
        wrap: impl FnOnce(NodeService) -> NodeService,
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let cfg = make(dir.path());
        let state = cfg.state_dir.clone();
        let service = wrap(NodeService::new(cfg).unwrap());
        let sock = dir.path().join("csi.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let server = tokio::spawn(async move {
            Server::builder()
                .add_service(service.into_server())
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await
                .unwrap();
        });
        let channel = Endpoint::try_from("http://[::]:50051")
            .unwrap()
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let sock = sock.clone();
                async move { Ok::<_, io::Error>(TokioIo::new(UnixStream::connect(sock).await?)) }
            }))
            .await
            .unwrap();
        let work = dir.path().join("work");
        fs::create_dir_all(&work).unwrap();
        Self {
            client: NodeClient::new(channel),
            state,
            work,
            _dir: dir,
            server,
        }
    }

    /// A path under the scratch directory, guarded by an unmount on drop.
    pub fn path(&self, name: &str) -> (PathBuf, MountGuard) {
        let p = self.work.join(name);
        (p.clone(), MountGuard(p))
    }

    pub fn record_path(&self, volume: &str) -> PathBuf {
        self.state.join("staged").join(format!("{volume}.json"))
    }

    /// The stage record as JSON, if any.
    pub fn record(&self, volume: &str) -> Option<serde_json::Value> {
        let text = fs::read_to_string(self.record_path(volume)).ok()?;
        Some(serde_json::from_str(&text).unwrap())
    }

    pub async fn stage(
        &self,
        volume: &str,
        staging: &Path,
        cap: csi::VolumeCapability,
        ctx: HashMap<String, String>,
    ) -> Result<(), tonic::Status> {
        self.client
            .clone()
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: volume.into(),
                publish_context: ctx,
                staging_target_path: path_str(staging),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    pub async fn unstage(&self, volume: &str, staging: &Path) -> Result<(), tonic::Status> {
        self.client
            .clone()
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: volume.into(),
                staging_target_path: path_str(staging),
            })
            .await
            .map(|_| ())
    }

    pub async fn publish(
        &self,
        volume: &str,
        staging: &Path,
        target: &Path,
        cap: csi::VolumeCapability,
        readonly: bool,
    ) -> Result<(), tonic::Status> {
        self.client
            .clone()
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: volume.into(),
                staging_target_path: path_str(staging),
                target_path: path_str(target),
                volume_capability: Some(cap),
                readonly,
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    pub async fn unpublish(&self, volume: &str, target: &Path) -> Result<(), tonic::Status> {
        self.client
            .clone()
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: volume.into(),
                target_path: path_str(target),
            })
            .await
            .map(|_| ())
    }

    pub async fn stats(
        &self,
        volume: &str,
        path: &Path,
    ) -> Result<csi::NodeGetVolumeStatsResponse, tonic::Status> {
        self.client
            .clone()
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: volume.into(),
                volume_path: path_str(path),
                staging_target_path: String::new(),
            })
            .await
            .map(tonic::Response::into_inner)
    }

    pub async fn expand(
        &self,
        volume: &str,
        path: &Path,
        required: i64,
    ) -> Result<i64, tonic::Status> {
        self.client
            .clone()
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: volume.into(),
                volume_path: path_str(path),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: required,
                    limit_bytes: 0,
                }),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().capacity_bytes)
    }
}

/// A byte count as CSI's int64.
pub fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap()
}

pub fn path_str(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

pub fn mount_cap(fs_type: &str) -> csi::VolumeCapability {
    cap(
        Mode::SingleNodeWriter,
        AccessType::Mount(MountVolume {
            fs_type: fs_type.into(),
            ..Default::default()
        }),
    )
}

pub fn block_cap() -> csi::VolumeCapability {
    cap(Mode::SingleNodeWriter, AccessType::Block(BlockVolume {}))
}

pub fn cap(mode: Mode, access: AccessType) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_type: Some(access),
        access_mode: Some(AccessMode { mode: mode.into() }),
    }
}

pub fn nqn(volume: &str) -> SubsystemNqn {
    VolumeId::parse(volume).unwrap().subsystem_nqn()
}

pub fn identity(volume: &str) -> NamespaceIdentity {
    NamespaceIdentity::derive(&nqn(volume), NamespaceId::VOLUME)
}

/// The publish_context of the single-machine mode.
pub fn local_ctx(volume: &str, dev: &Path) -> HashMap<String, String> {
    HashMap::from([
        (context::NQN.to_owned(), nqn(volume).to_string()),
        (context::LOCAL_DEVICE.to_owned(), path_str(dev)),
    ])
}

/// The publish_context of NVMe/TCP.
pub fn nvme_ctx(volume: &str) -> HashMap<String, String> {
    HashMap::from([
        (context::NQN.to_owned(), nqn(volume).to_string()),
        (context::TRADDR.to_owned(), "192.0.2.10".to_owned()),
        (context::TRSVCID.to_owned(), "4420".to_owned()),
        (context::CTRL_LOSS_TMO.to_owned(), "-1".to_owned()),
        (context::RECONNECT_DELAY.to_owned(), "2".to_owned()),
        // These tests are about the attach, not authentication (node_requests covers that).
        (context::AUTH.to_owned(), "none".to_owned()),
    ])
}

pub fn controller(instance: u32, subsys: u32, host: &str, state: &str) -> FakeController {
    FakeController {
        instance,
        subsys_instance: subsys,
        hostnqn: host.into(),
        traddr: "192.0.2.10".into(),
        trsvcid: 4420,
        state: state.into(),
    }
}

/// Adds subsystem `subsys` of `volume` with this host's live controller `ctrl` and a
/// (multipath) namespace of identity `id`, and points the namespace's device node and sysfs
/// `dev`/`size` at the real loop device `lo`, so the code under test finds the loop device the
/// way it would find an NVMe namespace. Returns the disk name (`nvme<subsys>n1`).
pub fn add_volume_on_loop(
    f: &mut FakeSysfs,
    subsys: u32,
    ctrl: u32,
    volume: &str,
    id: NamespaceIdentity,
    lo: &LoopDevice,
) -> String {
    f.add_subsystem(subsys, nqn(volume).as_str()).unwrap();
    f.add_controller(&controller(ctrl, subsys, HOST_NQN, "live"))
        .unwrap();
    let names = f
        .add_namespace(&FakeNamespace {
            subsys_instance: subsys,
            head_instance: 1,
            nsid: 1,
            multipath: true,
            ctrl_instances: vec![ctrl],
            uuid: Some(id.uuid),
            nguid: Some(id.nguid),
            size_sectors: SIZE / 512,
        })
        .unwrap();
    let name = names[0].clone();
    let (major, minor) = lo.devnum();
    let sys_disk = f.paths().sys.join("block").join(&name);
    fs::write(sys_disk.join("dev"), format!("{major}:{minor}\n")).unwrap();
    let node = f.paths().dev.join(&name);
    fs::remove_file(&node).unwrap();
    let st = Command::new("mknod")
        .arg(&node)
        .arg("b")
        .arg(major.to_string())
        .arg(minor.to_string())
        .status()
        .unwrap();
    assert!(st.success(), "mknod {node:?}");
    name
}

/// The gRPC code of a failed call, with the message in the assertion text on mismatch.
#[track_caller]
pub fn assert_code<T: std::fmt::Debug>(result: Result<T, tonic::Status>, code: tonic::Code) {
    match result {
        Err(s) => assert_eq!(s.code(), code, "{}", s.message()),
        Ok(v) => panic!("expected {code:?}, got Ok({v:?})"),
    }
}
