//! Scenario 2: an agent restart keeps the identity and the I/O going.

use std::fs;
use std::time::Duration;

use pillar_agent::fence::{Mark, decode};
use pillar_agent_api::v1 as agent_api;
use pillar_nvmet::VolumeId;

use crate::harness::MIB;
use crate::harness::checks::{
    check_configfs_export, configfs_identity, host_controllers, host_device,
};
use crate::harness::data::{DataSet, Writer};
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::kmsg::needles::IDENTIFIERS_CHANGED;
use crate::harness::lab::Lab;

/// Scenario 2: the agent is killed (SIGKILL) and restarted with its state directory kept.
/// nvmet keeps the export, so the host's I/O never stops; the restarted agent waits for the
/// controller's resync (the controller's loop sends it), and the identity is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s2_agent_restart_keeps_identity() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s2_agent_restart_keeps_identity");
    let mut lab = Lab::new("s2", true).await;
    let k0 = lab.kmsg.mark();
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut node = lab.start_default_node().await;
    let vol = "kl-s2";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let s = lab.attach(&mut ctl, &mut node, vol).await;
    let data = DataSet::write(&s.target, "before", 4, 256 * 1024);
    let identity_before = configfs_identity(vol);
    let ctrl_before = host_controllers(vol, &node.host_nqn);
    let mark_before = read_mark(&lab, vol);
    println!("  fencing mark before the restart: {mark_before:?}");
    sc.step("volume staged, data written");

    let mut writer = Writer::start(&s.target.join("stream.bin"));
    std::thread::sleep(Duration::from_secs(2));
    let k1 = lab.kmsg.mark();
    lab.agent.as_mut().unwrap().kill();
    sc.step("agent killed (SIGKILL)");
    std::thread::sleep(Duration::from_secs(2));
    check_configfs_export(vol, &[&node.host_nqn]);
    let during = writer.snapshot();
    assert!(
        during.errors.is_empty(),
        "I/O failed while the agent was down: {:?}",
        during.errors
    );
    lab.start_agent(&[]).await;
    sc.step("agent restarted with the same state directory");
    let waited = lab
        .wait_agent_state(
            agent_api::health_response::State::Serving,
            Duration::from_secs(30),
        )
        .await;
    sc.step(&format!(
        "agent serving {:.1}s after its restart (the controller's resync loop)",
        waited.as_secs_f64()
    ));
    lab.kmsg.poll();
    std::thread::sleep(Duration::from_secs(2));
    let w = writer.finish(Duration::from_secs(30));
    assert!(
        w.errors.is_empty(),
        "I/O failed across the agent restart: {:?}",
        w.errors
    );
    assert!(w.done, "the writer is blocked");
    assert!(
        w.chunks.len() >= 10,
        "too little I/O went on: {} chunks",
        w.chunks.len()
    );
    assert!(
        w.max_latency < Duration::from_secs(5),
        "a write+fsync took {:?}",
        w.max_latency
    );
    writer.verify(&w);
    data.verify();
    sc.step("I/O went on throughout; all data verified");

    assert_eq!(
        configfs_identity(vol),
        identity_before,
        "configfs identity changed across the agent restart"
    );
    check_configfs_export(vol, &[&node.host_nqn]);
    let ctrl_after = host_controllers(vol, &node.host_nqn);
    assert_eq!(
        ctrl_after.iter().map(|c| &c.name).collect::<Vec<_>>(),
        ctrl_before.iter().map(|c| &c.name).collect::<Vec<_>>(),
        "same controller"
    );
    assert_eq!(ctrl_after[0].state.as_str(), "live");
    let dev = host_device(vol, &node.host_nqn);
    assert_eq!(
        (dev.name.as_str(), dev.devnum),
        (s.device.name.as_str(), s.device.devnum),
        "same block device"
    );
    lab.kmsg.expect_absent(k0, IDENTIFIERS_CHANGED);
    lab.kmsg.expect_absent(k1, &["Reconnecting"]);
    lab.kmsg.expect_absent(k1, &["Removing ctrl"]);
    // The resync's token is newer than every token applied before the restart: the mark (decoded
    // and verified with the agent's own format) has the same owner and a greater generation.
    let mark_after = read_mark(&lab, vol);
    println!("  fencing mark after the resync: {mark_after:?}");
    assert_eq!(
        mark_after.owner_uid, mark_before.owner_uid,
        "the mark's owner lifecycle is unchanged"
    );
    assert!(!mark_after.ended, "the lifecycle has not ended");
    assert!(
        mark_after.generation > mark_before.generation,
        "the resync's token moved the mark's generation forward: {} -> {}",
        mark_before.generation,
        mark_after.generation
    );
    sc.step("identity, controller and device unchanged; the connection never dropped");

    lab.detach(&mut ctl, &mut node, &s).await;
    lab.delete_volume(&mut ctl, vol).await;
    sc.step("the restarted agent serves the teardown");
}

/// The agent's fencing mark of `volume`, decoded (format and checksum verified) as the agent
/// reads it.
fn read_mark(lab: &Lab, volume: &str) -> Mark {
    let path = lab.agent_state().join(format!("generations/{volume}.json"));
    let bytes = fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    decode(&VolumeId::parse(volume).expect("volume id"), &bytes)
        .unwrap_or_else(|e| panic!("fencing mark {}: {e}", path.display()))
}
