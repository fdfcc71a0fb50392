//! Scenario 3: a storage-node reboot with stable identity recovers by itself.

use std::time::Duration;

use crate::harness::MIB;
use crate::harness::checks::{
    check_configfs_export, configfs_identity, host_controllers, host_device, volume_stats,
    wait_controller_state,
};
use crate::harness::data::{DataSet, Writer};
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::kmsg::needles::{IDENTIFIERS_CHANGED, fs_failure};
use crate::harness::lab::{Lab, nqn_of};
use crate::reboot::storage_reboot;

/// Scenario 3: a storage-node reboot with stable identity. The host reconnects by itself, the
/// kernel logs no `identifiers changed`, the same block device keeps working, data verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s3_storage_reboot_recovers() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s3_storage_reboot_recovers");
    let mut lab = Lab::new("s3", true).await;
    let k0 = lab.kmsg.mark();
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut node = lab.start_default_node().await;
    let vol = "kl-s3";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let s = lab.attach(&mut ctl, &mut node, vol).await;
    let data = DataSet::write(&s.target, "before", 4, 256 * 1024);
    let identity_before = configfs_identity(vol);
    let ctrl = host_controllers(vol, &node.host_nqn).remove(0).name;
    sc.step("volume staged, data written");

    let mut writer = Writer::start(&s.target.join("stream.bin"));
    std::thread::sleep(Duration::from_secs(2));
    let r = storage_reboot(&mut lab, &sc, &mut node, &s, &[]).await;
    let back = wait_controller_state(
        vol,
        &node.host_nqn,
        |s| s == "live",
        "live",
        Duration::from_secs(60),
    );
    let line = lab.kmsg.expect(
        r.cut,
        &[&format!("{ctrl}: Successfully reconnected")],
        Duration::from_secs(10),
    );
    lab.kmsg.expect(
        r.cut,
        &[
            "nvmet: ",
            "nvm controller",
            nqn_of(vol).as_str(),
            "for NQN",
            node.host_nqn.as_str(),
        ],
        Duration::from_secs(5),
    );
    sc.step(&format!("host reconnected by itself ({:.1}s after the export came back, {:.1}s after the cut): {line}", back.as_secs_f64(), r.export_back + back.as_secs_f64()));
    std::thread::sleep(Duration::from_secs(2));
    let w = writer.finish(Duration::from_secs(60));
    assert!(
        w.errors.is_empty(),
        "I/O failed across the reboot: {:?}",
        w.errors
    );
    assert!(w.done, "the writer is still blocked after the reconnect");
    writer.verify(&w);
    data.verify();
    let after = DataSet::write(&s.target, "after", 4, 256 * 1024);
    after.verify();
    sc.step(&format!(
        "I/O waited (max write+fsync {:.1}s) and went on; all data verified; new writes work",
        w.max_latency.as_secs_f64()
    ));

    lab.kmsg.expect_absent(k0, IDENTIFIERS_CHANGED);
    // The same needles scenario 4 expects (there the filesystem fails).
    lab.kmsg
        .expect_absent_any(k0, &fs_failure(s.device.name.as_str()));
    assert_eq!(
        configfs_identity(vol),
        identity_before,
        "configfs identity after the reboot"
    );
    check_configfs_export(vol, &[&node.host_nqn]);
    let dev = host_device(vol, &node.host_nqn);
    assert_eq!(
        (dev.name.as_str(), dev.devnum),
        (s.device.name.as_str(), s.device.devnum),
        "the same block device"
    );
    let m = pillar_host::find_mount(&s.staging)
        .unwrap()
        .expect("still mounted");
    assert_eq!(m.source, s.device.dev_path.display().to_string());
    assert_eq!(
        host_controllers(vol, &node.host_nqn).remove(0).name,
        ctrl,
        "the same controller reconnected"
    );
    assert!(
        lab.agent_state()
            .join(format!("generations/{vol}.json"))
            .exists(),
        "the resync wrote a new fencing mark"
    );
    sc.step("no `identifiers changed`; same controller, same device, same identity");

    let stats = volume_stats(&mut node, &s)
        .await
        .expect("NodeGetVolumeStats");
    let condition = stats.volume_condition.expect("condition");
    assert!(
        !condition.abnormal,
        "volume still abnormal after the reconnect: {condition:?}"
    );
    sc.step(&format!(
        "NodeGetVolumeStats after the reconnect: normal ({})",
        condition.message
    ));

    lab.detach(&mut ctl, &mut node, &s).await;
    lab.delete_volume(&mut ctl, vol).await;
}
