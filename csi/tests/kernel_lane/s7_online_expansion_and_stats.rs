//! Scenario 7: online expansion and volume stats.

use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use pillar_csi::csi;

use crate::harness::MIB;
use crate::harness::checks::{check_configfs_export, host_device, statvfs_total};
use crate::harness::data::{DataSet, verify_big_file, write_big_file};
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::kmsg::needles::IDENTIFIERS_CHANGED;
use crate::harness::lab::{Lab, rwo};
use crate::harness::machine::read_attr;

/// Scenario 7: online expansion (the host sees the new size, the filesystem grows while
/// mounted) and volume stats before and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s7_online_expansion_and_stats() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s7_online_expansion_and_stats");
    let mut lab = Lab::new("s7", true).await;
    let k0 = lab.kmsg.mark();
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut node = lab.start_default_node().await;
    let vol = "kl-s7";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let s = lab.attach(&mut ctl, &mut node, vol).await;
    let data = DataSet::write(&s.target, "before", 4, 256 * 1024);
    assert_eq!(s.device.size_bytes, 64 * MIB);

    let stats = |u: &csi::NodeGetVolumeStatsResponse, unit: csi::volume_usage::Unit| {
        u.usage
            .iter()
            .find(|x| x.unit() == unit)
            .cloned()
            .expect("usage unit")
    };
    let before = node
        .client
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: vol.into(),
            volume_path: s.target.display().to_string(),
            staging_target_path: s.staging.display().to_string(),
        })
        .await
        .expect("NodeGetVolumeStats")
        .into_inner();
    let b = stats(&before, csi::volume_usage::Unit::Bytes);
    let i = stats(&before, csi::volume_usage::Unit::Inodes);
    println!(
        "  stats before: {:?}, condition {:?}",
        before.usage, before.volume_condition
    );
    assert!(
        b.total > 0 && b.used >= 1024 * 1024 && b.available > 0 && b.used + b.available <= b.total,
        "bytes {b:?}"
    );
    assert!(i.total > 0 && i.used >= 4, "inodes {i:?}");
    assert_eq!(
        i64::try_from(statvfs_total(&s.target)).unwrap(),
        b.total,
        "stats total equals statvfs"
    );
    assert!(
        !before
            .volume_condition
            .as_ref()
            .expect("condition")
            .abnormal
    );
    sc.step("NodeGetVolumeStats: bytes and inodes, condition normal");

    let k1 = lab.kmsg.mark();
    let grown = ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: vol.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: i64::try_from(128 * MIB).unwrap(),
                limit_bytes: 0,
            }),
            secrets: HashMap::new(),
            volume_capability: Some(rwo()),
        })
        .await
        .expect("ControllerExpandVolume")
        .into_inner();
    println!("  ControllerExpandVolume: {grown:?}");
    assert!(grown.capacity_bytes >= i64::try_from(128 * MIB).unwrap());
    assert!(grown.node_expansion_required);
    assert_eq!(
        fs::metadata(lab.dir.join(format!("pool/{vol}.img")))
            .unwrap()
            .len(),
        128 * MIB,
        "backing file grown"
    );
    check_configfs_export(vol, &[&node.host_nqn]);
    let start = Instant::now();
    let size = |d: &str| {
        read_attr(&Path::new("/sys/block").join(d).join("size"))
            .parse::<u64>()
            .unwrap_or(0)
            * 512
    };
    while size(&s.device.name) != 128 * MIB && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        size(&s.device.name),
        128 * MIB,
        "the host did not see the new size"
    );
    lab.kmsg.expect(
        k1,
        &[s.device.name.as_str(), "detected capacity change"],
        Duration::from_secs(5),
    );
    sc.step(&format!(
        "host sees 128 MiB on {} ({:.1}s after the expand) without any node call",
        s.device.name,
        start.elapsed().as_secs_f64()
    ));

    let fs_before = statvfs_total(&s.target);
    let expanded = node
        .client
        .node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: vol.into(),
            volume_path: s.target.display().to_string(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: i64::try_from(128 * MIB).unwrap(),
                limit_bytes: 0,
            }),
            staging_target_path: s.staging.display().to_string(),
            volume_capability: Some(rwo()),
            secrets: HashMap::new(),
        })
        .await
        .expect("NodeExpandVolume")
        .into_inner();
    let fs_after = statvfs_total(&s.target);
    println!("  NodeExpandVolume: {expanded:?}; filesystem {fs_before} -> {fs_after} bytes");
    assert!(expanded.capacity_bytes >= i64::try_from(128 * MIB).unwrap());
    assert!(
        fs_after > fs_before + 48 * MIB,
        "the filesystem did not grow"
    );
    lab.kmsg.expect(
        k1,
        &["EXT4-fs (", s.device.name.as_str(), "resiz"],
        Duration::from_secs(5),
    );
    sc.step("NodeExpandVolume: filesystem grown online");

    // Data that did not fit before fits now.
    let big_mib = usize::try_from(b.available).unwrap() / (1024 * 1024) + 8;
    write_big_file(&s.target.join("big.bin"), big_mib);
    verify_big_file(&s.target.join("big.bin"), big_mib);
    data.verify();
    let after = node
        .client
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: vol.into(),
            volume_path: s.target.display().to_string(),
            staging_target_path: s.staging.display().to_string(),
        })
        .await
        .expect("NodeGetVolumeStats")
        .into_inner();
    let a = stats(&after, csi::volume_usage::Unit::Bytes);
    println!("  stats after: {:?}", after.usage);
    assert!(
        a.total > b.total + i64::try_from(48 * MIB).unwrap(),
        "stats total did not grow: {b:?} -> {a:?}"
    );
    assert!(a.used > b.available, "stats used shows the big file");
    assert_eq!(host_device(vol, &node.host_nqn).name, s.device.name);
    lab.kmsg.expect_absent(k0, IDENTIFIERS_CHANGED);
    sc.step("a file larger than the old free space written and verified; stats show the growth");

    lab.detach(&mut ctl, &mut node, &s).await;
    lab.delete_volume(&mut ctl, vol).await;
}
