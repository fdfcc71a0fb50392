//! Scenario 13: the ZFS backend on the real OpenZFS module, with the data written and read
//! through NVMe/TCP: create, export, I/O, online expansion, snapshot, restore, clone, and
//! deletes in every order ZFS allows, refused (the volume left usable) in those it forbids.
//!
//! Runs on the kernels the lane has a ZFS module for (setup.sh builds Debian's zfs-dkms for
//! those its release supports; run.sh leaves the scenario out elsewhere and says so). The
//! guest has no udevd: [`UdevStandIn`] makes the `/dev/zvol/<dataset>` links as OpenZFS's
//! `60-zvol.rules` do, with OpenZFS's own `zvol_id`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::{ErrorReason, reason_of};
use tonic::Code;

use crate::attach::{attach, detach, from};
use crate::harness::MIB;
use crate::harness::data::pattern;
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::lab::Lab;
use crate::harness::machine::{drop_caches, read_attr};
use crate::lvm::{Lifecycle, read_at, write_at};

const ZPOOL: &str = "pillar-s13";
const PARENT: &str = "pillar-s13/csi";
const POOL: &str = "tank";

fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("spawn {program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{program} {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn zfs(args: &[&str]) -> String {
    println!("  zfs {}", args.join(" "));
    run("zfs", args).unwrap_or_else(|e| panic!("{e}"))
}

/// `zfs get -Hp -o value PROPERTY DATASET`.
fn prop(dataset: &str, property: &str) -> String {
    run("zfs", &["get", "-Hp", "-o", "value", property, dataset])
        .unwrap_or_else(|e| panic!("{e}"))
        .trim()
        .to_owned()
}

/// Every dataset of `kind` (volume, snapshot) in the scratch pool, sorted.
fn datasets(kind: &str) -> Vec<String> {
    let out = run(
        "zfs",
        &["list", "-H", "-o", "name", "-t", kind, "-r", ZPOOL],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut names: Vec<String> = out.lines().map(str::to_owned).collect();
    names.sort();
    names
}

/// What udevd does for zvols with OpenZFS's `60-zvol.rules` (`SYMLINK+="zvol/%c"` from
/// `zvol_id $devnode`) on each device's add event: a new `/dev/zdN` (a device node not seen
/// before, by inode) is probed once and linked; links whose node is gone are removed. Probing
/// only new nodes matters: `zvol_id` opens the device, and a zvol held open cannot be destroyed.
struct UdevStandIn {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl UdevStandIn {
    fn start(zvol_id: PathBuf) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen = std::collections::HashSet::new();
            while !flag.load(Ordering::Relaxed) {
                Self::sync_links(&zvol_id, &mut seen);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    fn sync_links(zvol_id: &Path, seen: &mut std::collections::HashSet<(String, u64)>) {
        use std::os::unix::fs::MetadataExt as _;
        let mut present = std::collections::HashSet::new();
        for entry in fs::read_dir("/dev").into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let whole = name
                .strip_prefix("zd")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
            let Ok(meta) = entry.metadata() else { continue };
            if !whole {
                continue;
            }
            let key = (name.clone(), meta.ino());
            present.insert(key.clone());
            if seen.contains(&key) {
                continue;
            }
            let node = format!("/dev/{name}");
            let Ok(dataset) = run(&zvol_id.to_string_lossy(), &[&node]) else {
                continue;
            };
            let link = Path::new("/dev/zvol").join(dataset.trim());
            let _ = fs::create_dir_all(link.parent().expect("a dataset has a parent"));
            let _ = fs::remove_file(&link);
            if std::os::unix::fs::symlink(&node, &link).is_ok() {
                seen.insert(key);
            }
        }
        seen.retain(|k| present.contains(k));
        Self::prune(Path::new("/dev/zvol"));
    }

    fn prune(dir: &Path) {
        for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                Self::prune(&path);
            } else if !path.exists() {
                let _ = fs::remove_file(&path);
            }
        }
    }
}

impl Drop for UdevStandIn {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn sector_size(dev: &Path) -> u64 {
    let name = dev.file_name().expect("a device name").to_string_lossy();
    read_attr(&Path::new("/sys/block").join(&*name).join("size"))
        .parse::<u64>()
        .unwrap_or(0)
        * 512
}

async fn create(
    agent: &mut agent_api::agent_client::AgentClient<tonic::transport::Channel>,
    life: &mut Lifecycle,
    vol: &str,
    size: u64,
    source: Option<agent_api::ContentSource>,
) -> Result<agent_api::CreateVolumeResponse, tonic::Status> {
    agent
        .create_volume(agent_api::CreateVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: POOL.into(),
            size_bytes: size,
            source,
        })
        .await
        .map(tonic::Response::into_inner)
}

async fn delete(
    agent: &mut agent_api::agent_client::AgentClient<tonic::transport::Channel>,
    life: &mut Lifecycle,
    vol: &str,
) -> Result<(), tonic::Status> {
    agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: POOL.into(),
        })
        .await
        .map(|_| ())
}

async fn snapshot(
    agent: &mut agent_api::agent_client::AgentClient<tonic::transport::Channel>,
    life: &mut Lifecycle,
    id: &str,
    source: &str,
    source_uid: &str,
) -> Result<agent_api::CreateSnapshotResponse, tonic::Status> {
    agent
        .create_snapshot(agent_api::CreateSnapshotRequest {
            token: life.next(),
            snapshot_id: id.into(),
            pool: POOL.into(),
            source_volume_id: source.into(),
            source_lifecycle_uid: source_uid.into(),
        })
        .await
        .map(tonic::Response::into_inner)
}

async fn delete_snapshot(
    agent: &mut agent_api::agent_client::AgentClient<tonic::transport::Channel>,
    life: &mut Lifecycle,
    id: &str,
) {
    agent
        .delete_snapshot(agent_api::DeleteSnapshotRequest {
            token: life.next(),
            snapshot_id: id.into(),
            pool: POOL.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("DeleteSnapshot {id}: {e}"));
}

/// A refused DeleteVolume: FAILED_PRECONDITION naming what depends on the volume.
fn assert_refused(result: Result<(), tonic::Status>, names: &str) {
    let err = result.expect_err("DeleteVolume of a zvol something depends on");
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        err.message().contains(names) && err.message().contains("depends on it"),
        "the refusal does not name {names:?}: {}",
        err.message()
    );
    println!("  refused: {}", err.message());
}

/// Scenario 13 (issue 12 item 6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
#[allow(clippy::too_many_lines)]
async fn s13_zfs() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s13_zfs");
    let userland = std::env::var("PILLAR_LANE_ZFS_USERLAND")
        .expect("PILLAR_LANE_ZFS_USERLAND: the lane runs s13 only where it prepared ZFS");
    let module = read_attr(Path::new("/sys/module/zfs/version"));
    let mut lab = Lab::new("s13", false).await;
    let vdev = lab.dir.join("zpool.img");
    fs::File::create(&vdev)
        .and_then(|f| f.set_len(320 * MIB))
        .expect("the pool's file vdev");
    let _ = run("zpool", &["destroy", "-f", ZPOOL]);
    run(
        "zpool",
        &[
            "create",
            "-f",
            "-o",
            "cachefile=none",
            "-O",
            "mountpoint=none",
            ZPOOL,
            &vdev.to_string_lossy(),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    zfs(&["create", PARENT]);
    let _udev = UdevStandIn::start(Path::new(&userland).join("lib/udev/zvol_id"));
    let mut agent = lab
        .start_agent(&["--pool", &format!("{POOL}=zfs:{PARENT}")])
        .await;
    agent
        .resync_exports(agent_api::ResyncExportsRequest {
            exports: vec![],
            ..Default::default()
        })
        .await
        .expect("resync");
    sc.step(&format!(
        "OpenZFS module {module}; pool {ZPOOL} on a file vdev; agent serving {POOL}=zfs:{PARENT}"
    ));

    // Create, export, I/O, online expansion.
    let (src_uid, snap_uid) = ("s13-src-uid", "s13-snap-uid");
    let mut src = Lifecycle::new(src_uid);
    let created = create(&mut agent, &mut src, "kl-s13-src", 32 * MIB, None)
        .await
        .expect("CreateVolume");
    assert_eq!(created.size_bytes, 32 * MIB);
    let zsrc = format!("{PARENT}/kl-s13-src");
    assert_eq!(prop(&zsrc, "volsize"), (32 * MIB).to_string());
    assert_eq!(prop(&zsrc, "volmode"), "dev");
    assert_eq!(prop(&zsrc, "io.pillar-csi:owner"), "pillar");
    assert!(
        prop(&zsrc, "refreservation").parse::<u64>().unwrap() >= 32 * MIB,
        "a created zvol is thick"
    );
    let a = attach(&mut agent, POOL, "kl-s13-src", &mut src).await;
    assert_eq!(a.size, 32 * MIB);
    let grown = agent
        .expand_volume(agent_api::ExpandVolumeRequest {
            token: src.next(),
            volume_id: "kl-s13-src".into(),
            pool: POOL.into(),
            size_bytes: 48 * MIB,
        })
        .await
        .expect("ExpandVolume while attached")
        .into_inner();
    assert_eq!(grown.size_bytes, 48 * MIB);
    assert_eq!(prop(&zsrc, "volsize"), (48 * MIB).to_string());
    let start = Instant::now();
    while sector_size(&a.dev) != 48 * MIB && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(sector_size(&a.dev), 48 * MIB, "the host sees the new size");
    let mib = usize::try_from(MIB).unwrap();
    let (before_head, before_tail) = (pattern(1300, mib), pattern(1301, mib));
    write_at(&a.dev, 0, &before_head);
    write_at(&a.dev, 47 * MIB, &before_tail);
    sc.step(&format!(
        "zvol {zsrc}: volmode=dev, owner pillar, thick; attached at {}, grown online to 48 MiB \
         ({:.1}s until the host saw it); first and last MiB written",
        a.dev.display(),
        start.elapsed().as_secs_f64()
    ));

    // The snapshot, with the host connected.
    let mut snap = Lifecycle::new(snap_uid);
    let cut = snapshot(&mut agent, &mut snap, "kl-s13-snap", "kl-s13-src", src_uid)
        .await
        .expect("CreateSnapshot");
    assert_eq!((cut.size_bytes, cut.method.as_str()), (48 * MIB, "zfs"));
    let zsnap = format!("{zsrc}@kl-s13-snap");
    assert_eq!(prop(&zsnap, "io.pillar-csi:owner"), "pillar-snapshot");
    assert_eq!(
        prop(&zsnap, "creation"),
        cut.creation_unix_seconds.to_string()
    );
    let retry = agent
        .create_snapshot(agent_api::CreateSnapshotRequest {
            token: snap.again(),
            snapshot_id: "kl-s13-snap".into(),
            pool: POOL.into(),
            source_volume_id: "kl-s13-src".into(),
            source_lifecycle_uid: src_uid.into(),
        })
        .await
        .expect("CreateSnapshot retried")
        .into_inner();
    assert_eq!(
        (retry.creation_unix_seconds, retry.method.as_str()),
        (cut.creation_unix_seconds, "")
    );
    sc.step(&format!(
        "CreateSnapshot with the host connected: {zsnap}, owner pillar-snapshot, creation {}; \
         a retry is the same snapshot",
        cut.creation_unix_seconds
    ));

    let (after_head, after_tail) = (pattern(1310, mib), pattern(1311, mib));
    write_at(&a.dev, 0, &after_head);
    write_at(&a.dev, 47 * MIB, &after_tail);
    drop_caches();
    assert_eq!(read_at(&a.dev, 0, mib), after_head);

    // Restore (larger) and clone; a restore smaller than the snapshot is refused.
    let mut restored = Lifecycle::new("s13-restored-uid");
    let r = create(
        &mut agent,
        &mut restored,
        "kl-s13-restored",
        64 * MIB,
        from(Some("kl-s13-snap"), None, snap_uid),
    )
    .await
    .expect("CreateVolume from the snapshot");
    assert_eq!(r.size_bytes, 64 * MIB);
    let mut cloned = Lifecycle::new("s13-cloned-uid");
    create(
        &mut agent,
        &mut cloned,
        "kl-s13-cloned",
        48 * MIB,
        from(None, Some("kl-s13-src"), src_uid),
    )
    .await
    .expect("CreateVolume from the volume");
    let small = create(
        &mut agent,
        &mut Lifecycle::new("s13-small-uid"),
        "kl-s13-small",
        32 * MIB,
        from(Some("kl-s13-snap"), None, snap_uid),
    )
    .await
    .expect_err("a restore smaller than its snapshot");
    assert_eq!(small.code(), Code::OutOfRange, "{}", small.message());
    let zrestored = format!("{PARENT}/kl-s13-restored");
    let zcloned = format!("{PARENT}/kl-s13-cloned");
    let origin = format!("{zsrc}@clone:kl-s13-cloned");
    assert_eq!(prop(&zrestored, "origin"), zsnap);
    assert_eq!(prop(&zcloned, "origin"), origin);
    assert_eq!(prop(&zrestored, "volsize"), (64 * MIB).to_string());
    assert_eq!(prop(&zcloned, "io.pillar-csi:owner"), "pillar");
    assert_eq!(
        prop(&origin, "defer_destroy"),
        "on",
        "the clone's hidden origin goes with the clone"
    );
    assert!(
        datasets("volume")
            .iter()
            .all(|v| !v.ends_with("kl-s13-small")),
        "a refused restore left a zvol"
    );
    sc.step(
        "CreateVolume from the snapshot (64 MiB) and from the volume: zfs clones of the snapshot \
         and of a hidden origin marked defer_destroy; a restore smaller than the snapshot \
         OUT_OF_RANGE, nothing created",
    );

    let r_att = attach(&mut agent, POOL, "kl-s13-restored", &mut restored).await;
    assert_eq!(r_att.size, 64 * MIB, "the host sees the restore's size");
    let c_att = attach(&mut agent, POOL, "kl-s13-cloned", &mut cloned).await;
    drop_caches();
    assert!(
        read_at(&r_att.dev, 0, mib) == before_head,
        "restore: first MiB"
    );
    assert!(
        read_at(&r_att.dev, 47 * MIB, mib) == before_tail,
        "restore: last MiB of the source"
    );
    assert!(
        read_at(&r_att.dev, 56 * MIB, mib).iter().all(|&b| b == 0),
        "restore: the grown part is not zero"
    );
    assert!(
        read_at(&c_att.dev, 0, mib) == after_head,
        "clone: first MiB"
    );
    assert!(
        read_at(&c_att.dev, 47 * MIB, mib) == after_tail,
        "clone: last MiB"
    );
    write_at(&r_att.dev, 0, &pattern(1400, mib));
    drop_caches();
    assert!(
        read_at(&a.dev, 0, mib) == after_head,
        "a write to the restore reached the source"
    );
    sc.step(
        "through NVMe/TCP: the restore holds exactly the data at the cut (zeros past the \
         source's size), the clone the data after it; a write to the restore leaves the source",
    );

    // Orders. The source is refused while anything depends on it, and stays usable.
    detach(&mut agent, "kl-s13-src", &a, &mut src).await;
    assert_refused(delete(&mut agent, &mut src, "kl-s13-src").await, "kl-s13-");
    let mut snap2 = Lifecycle::new("s13-snap2-uid");
    snapshot(
        &mut agent,
        &mut snap2,
        "kl-s13-snap2",
        "kl-s13-src",
        src_uid,
    )
    .await
    .expect("a refused delete left the source's lifecycle live");
    delete_snapshot(&mut agent, &mut snap2, "kl-s13-snap2").await;
    assert!(
        !datasets("snapshot").contains(&format!("{zsrc}@kl-s13-snap2")),
        "a snapshot without clones is destroyed at once"
    );
    // The snapshot goes while its restore lives: ZFS keeps it, hidden.
    delete_snapshot(&mut agent, &mut snap, "kl-s13-snap").await;
    assert_eq!(prop(&zsnap, "defer_destroy"), "on");
    let gone = create(
        &mut agent,
        &mut Lifecycle::new("s13-late-uid"),
        "kl-s13-late",
        48 * MIB,
        from(Some("kl-s13-snap"), None, snap_uid),
    )
    .await
    .expect_err("a restore of a deleted snapshot");
    assert_eq!(
        reason_of(&gone),
        ErrorReason::SourceNotLive,
        "{}",
        gone.message()
    );
    drop_caches();
    assert!(
        read_at(&r_att.dev, 47 * MIB, mib) == before_tail,
        "the restore lost data with its snapshot"
    );
    sc.step(
        "DeleteVolume of the source FAILED_PRECONDITION naming its dependent, the source still \
         live (a new snapshot of it cut and deleted at once); DeleteSnapshot while its restore \
         lives: kept by ZFS (defer_destroy), a restore of it refused, the restore keeps its data",
    );

    detach(&mut agent, "kl-s13-restored", &r_att, &mut restored).await;
    assert_refused(delete(&mut agent, &mut src, "kl-s13-src").await, "kl-s13-");
    delete(&mut agent, &mut restored, "kl-s13-restored")
        .await
        .expect("DeleteVolume of the restore");
    assert!(
        !datasets("snapshot").contains(&zsnap),
        "the deleted snapshot went with its last restore"
    );
    assert_refused(
        delete(&mut agent, &mut src, "kl-s13-src").await,
        "volume kl-s13-cloned (cloned from it)",
    );
    detach(&mut agent, "kl-s13-cloned", &c_att, &mut cloned).await;
    delete(&mut agent, &mut cloned, "kl-s13-cloned")
        .await
        .expect("DeleteVolume of the clone");
    assert!(
        datasets("snapshot").is_empty(),
        "snapshots left: {:?}",
        datasets("snapshot")
    );
    delete(&mut agent, &mut src, "kl-s13-src")
        .await
        .expect("DeleteVolume of the source once nothing depends on it");
    assert!(
        datasets("volume").is_empty(),
        "zvols left: {:?}",
        datasets("volume")
    );
    sc.step(
        "the restore deleted: its deleted snapshot went with it; the source refused while the \
         clone lives (named); the clone deleted: its hidden origin went with it; the source \
         deleted; no zvol and no snapshot left",
    );

    // What the backend relies on to reuse a snapshot ID whose deleted snapshot ZFS still keeps:
    // a snapshot marked defer_destroy can be renamed out of the way.
    let x = format!("{PARENT}/fact-x");
    zfs(&["create", "-V", "16M", &x]);
    zfs(&["snapshot", &format!("{x}@a")]);
    zfs(&["clone", &format!("{x}@a"), &format!("{PARENT}/fact-y")]);
    zfs(&["destroy", "-d", &format!("{x}@a")]);
    zfs(&["rename", &format!("{x}@a"), &format!("{x}@deleted:a:1")]);
    assert_eq!(prop(&format!("{x}@deleted:a:1"), "defer_destroy"), "on");
    zfs(&["destroy", &format!("{PARENT}/fact-y")]);
    zfs(&["destroy", &x]);
    sc.step("a defer_destroy snapshot renames (the backend frees a reused ID's name that way)");

    lab.agent.as_mut().unwrap().stop();
    run("zpool", &["destroy", ZPOOL]).unwrap_or_else(|e| panic!("{e}"));
    sc.step("pool destroyed");
}
