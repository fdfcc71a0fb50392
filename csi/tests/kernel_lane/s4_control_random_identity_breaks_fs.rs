//! Scenario 4 (control): the same reboot with kernel-random identity breaks the filesystem.

use std::fs::{self, File};
use std::io::Write;
use std::time::Duration;

use pillar_csi::csi;
use pillar_host::namespaces_for_host;

use crate::harness::MIB;
use crate::harness::checks::{configfs_identity, host_controllers, volume_stats};
use crate::harness::data::{DataSet, Writer, pattern};
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::kmsg::needles::{IDENTIFIERS_CHANGED, fs_failure};
use crate::harness::lab::{Lab, host_paths, identity_of, nqn_of};
use crate::harness::machine::drop_caches;
use crate::reboot::storage_reboot;

/// Scenario 4 (control): the same reboot, but the restarted agent leaves identity to the
/// kernel (test-only switch). The host logs `identifiers changed for nsid`, drops the namespace
/// and the filesystem fails: this proves scenario 3 can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s4_control_random_identity_breaks_fs() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s4_control_random_identity_breaks_fs");
    let mut lab = Lab::new("s4", true).await;
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut node = lab.start_default_node().await;
    let vol = "kl-s4";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let s = lab.attach(&mut ctl, &mut node, vol).await;
    let data = DataSet::write(&s.target, "before", 4, 256 * 1024);
    let identity_before = configfs_identity(vol);
    sc.step("volume staged (stable identity), data written");

    let mut writer = Writer::start(&s.target.join("stream.bin"));
    std::thread::sleep(Duration::from_secs(2));
    let r = storage_reboot(
        &mut lab,
        &sc,
        &mut node,
        &s,
        &["--unsafe-kernel-random-identity"],
    )
    .await;
    let (uuid, nguid, serial) = configfs_identity(vol);
    println!(
        "  configfs identity now: uuid {uuid}, nguid {nguid}, serial {serial} (before: {identity_before:?})"
    );
    assert_ne!(
        uuid, identity_before.0,
        "the kernel-random switch must leave a new UUID"
    );
    let line = lab
        .kmsg
        .expect(r.cut, IDENTIFIERS_CHANGED, Duration::from_secs(60));
    sc.step(&format!("kernel: {line}"));

    let w = writer.finish(Duration::from_secs(30));
    // The filesystem must fail: the writer's fsync, a new file, or reading the old data.
    let mut failures: Vec<String> = w.errors.clone();
    let probe = s.target.join("after.bin");
    if let Err(e) = File::create(&probe).and_then(|mut f| {
        f.write_all(&pattern(7, 64 * 1024))
            .and_then(|()| f.sync_all())
    }) {
        failures.push(format!("write+fsync of a new file: {e}"));
    }
    drop_caches();
    for (p, _) in &data.files {
        if let Err(e) = fs::read(p) {
            failures.push(format!("read {}: {e}", p.display()));
            break;
        }
    }
    println!("  I/O failures observed: {failures:?}");
    assert!(
        !failures.is_empty(),
        "the control scenario expected the filesystem to fail, but all I/O succeeded"
    );
    let gone = namespaces_for_host(&host_paths(), &nqn_of(vol), Some(&node.host_nqn)).unwrap();
    assert!(
        gone.iter()
            .all(|d| d.name != s.device.name || d.uuid != Some(identity_of(vol).uuid)),
        "the old namespace is still there: {gone:?}"
    );
    // The same needles scenario 3 requires to be absent across its reboot.
    let fs_line = lab
        .kmsg
        .find_any(r.cut, &fs_failure(s.device.name.as_str()));
    println!("  kernel log on the filesystem: {fs_line:?}");
    assert!(
        fs_line.is_some(),
        "no ext4 or I/O error line for {} in the kernel log",
        s.device.name
    );
    sc.step("as expected: identifiers changed, namespace dropped, the filesystem fails");
    drop(writer);

    // What the node plugin says about the broken volume, and whether kubelet's teardown works.
    let stats = volume_stats(&mut node, &s)
        .await
        .expect("NodeGetVolumeStats answers");
    let condition = stats.volume_condition.expect("condition");
    println!("  NodeGetVolumeStats after the identity change: {condition:?}");
    assert!(
        condition.abnormal,
        "volume condition normal after `identifiers changed`: {condition:?}"
    );
    sc.step(&format!(
        "NodeGetVolumeStats: abnormal ({})",
        condition.message
    ));
    node.client
        .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: vol.into(),
            target_path: s.target.display().to_string(),
        })
        .await
        .expect("NodeUnpublishVolume of the broken volume");
    node.client
        .node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: vol.into(),
            staging_target_path: s.staging.display().to_string(),
        })
        .await
        .expect("NodeUnstageVolume of the broken volume");
    assert!(pillar_host::find_mount(&s.target).unwrap().is_none());
    assert!(pillar_host::find_mount(&s.staging).unwrap().is_none());
    assert!(
        host_controllers(vol, &node.host_nqn).is_empty(),
        "NodeUnstageVolume left a controller"
    );
    sc.step("kubelet's teardown of the broken volume works: unmounted, disconnected");
}
