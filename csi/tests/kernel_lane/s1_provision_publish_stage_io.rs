//! Scenario 1: provision, publish, stage, I/O, teardown.

use std::path::Path;
use std::time::Duration;

use pillar_agent_api::v1 as agent_api;
use pillar_nvmet::derive_serial;

use crate::harness::checks::{check_configfs_export, host_controllers};
use crate::harness::data::DataSet;
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::kmsg::needles::IDENTIFIERS_CHANGED;
use crate::harness::lab::{Lab, nqn_of};
use crate::harness::machine::{entries, read_attr};
use crate::harness::{MIB, NVMET};

/// Scenario 1: provision, publish, stage (mkfs, mount), publish to a pod path, write data with
/// checksums, read back; then the way back, a second stage that finds the data (no mkfs of a
/// non-blank device), and delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s1_provision_publish_stage_io() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s1_provision_publish_stage_io");
    let mut lab = Lab::new("s1", true).await;
    let k0 = lab.kmsg.mark();
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut node = lab.start_default_node().await;
    lab.wait_agent_state(
        agent_api::health_response::State::Serving,
        Duration::from_secs(30),
    )
    .await;
    sc.step("agent serving after the controller's resync");

    let vol = "kl-s1";
    let nqn = nqn_of(vol);
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    check_configfs_export(vol, &[]);
    sc.step("CreateVolume: exported with no host admitted");

    let s = lab.attach(&mut ctl, &mut node, vol).await;
    sc.step("ControllerPublish + NodeStage + NodePublish");
    check_configfs_export(vol, &[&node.host_nqn]);
    let ctrls = host_controllers(vol, &node.host_nqn);
    assert_eq!(ctrls.len(), 1, "one controller: {ctrls:?}");
    let c = Path::new("/sys/class/nvme").join(&ctrls[0].name);
    assert_eq!(read_attr(&c.join("state")), "live");
    assert_eq!(read_attr(&c.join("transport")), "tcp");
    assert_eq!(
        read_attr(&c.join("serial")),
        derive_serial(&nqn).to_string(),
        "controller serial seen by the host"
    );
    assert_eq!(read_attr(&c.join("hostnqn")), node.host_nqn.to_string());
    assert_eq!(read_attr(&c.join("hostid")), node.host_id.to_string());
    assert!(
        read_attr(&c.join("address")).contains("traddr=127.0.0.1,trsvcid=4420"),
        "address {}",
        read_attr(&c.join("address"))
    );
    println!(
        "  host: controller {} live, device {} ({} bytes), uuid {:?}",
        ctrls[0].name, s.device.name, s.device.size_bytes, s.device.uuid
    );
    // 6.1: "nvmet: creating nvm controller 1 for subsystem <nqn> for NQN <host>."; 7.x:
    // "nvmet: Created nvm controller ...".
    lab.kmsg.expect(
        k0,
        &[
            "nvmet: ",
            "nvm controller",
            nqn.as_str(),
            "for NQN",
            node.host_nqn.as_str(),
        ],
        Duration::from_secs(5),
    );
    lab.kmsg.expect(
        k0,
        &["new ctrl: NQN \"", nqn.as_str(), "127.0.0.1:4420"],
        Duration::from_secs(5),
    );
    lab.kmsg.expect(
        k0,
        &["EXT4-fs (", s.device.name.as_str(), "mounted filesystem"],
        Duration::from_secs(5),
    );

    let data = DataSet::write(&s.target, "s1", 8, 512 * 1024);
    data.verify();
    sc.step("8 files written through the pod path, read back with equal SHA-256");

    // The way back, and a second stage of the same volume: the data is still there.
    let k1 = lab.kmsg.mark();
    let ctrl_name = ctrls[0].name.clone();
    lab.detach(&mut ctl, &mut node, &s).await;
    lab.kmsg.expect(
        k1,
        &[&format!("{ctrl_name}: Removing ctrl: NQN \"{nqn}\"")],
        Duration::from_secs(10),
    );
    check_configfs_export(vol, &[]);
    sc.step("NodeUnpublish + NodeUnstage (disconnect) + ControllerUnpublish (ACL emptied)");

    let s2 = lab.attach(&mut ctl, &mut node, vol).await;
    data.verify_at(&s.target, &s2.target);
    sc.step("staged again: not reformatted, data intact");
    lab.detach(&mut ctl, &mut node, &s2).await;
    lab.delete_volume(&mut ctl, vol).await;
    assert!(
        entries(&Path::new(NVMET).join("subsystems")).is_empty(),
        "subsystems left"
    );
    assert!(
        entries(&Path::new(NVMET).join("ports")).is_empty(),
        "an unreferenced port is left"
    );
    lab.kmsg.expect_absent(k0, IDENTIFIERS_CHANGED);
    sc.step("DeleteVolume: configfs empty");
}
