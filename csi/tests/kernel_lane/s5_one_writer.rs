//! Scenario 5: one writer (acl) between two host identities.

use std::fs::{self, File};
use std::io::Read;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tonic::Code;

use crate::harness::MIB;
use crate::harness::checks::{
    WriteProbe, check_configfs_export, connect_opts, delete_host_controllers, host_controllers,
};
use crate::harness::data::{DataSet, pattern};
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::kmsg::needles::not_allowed;
use crate::harness::lab::{Lab, host_paths, node_teardown, nqn_of};

/// Scenario 5: one writer. With `acl: true` a second host identity in the same guest cannot
/// publish or connect while the volume is published RWO to the first; after unpublish from the
/// first and publish to the second, the second connects and sees the data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s5_one_writer() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s5_one_writer");
    let mut lab = Lab::new("s5", true).await;
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut a = lab.start_default_node().await;
    let mut b = lab.start_second_node().await;
    assert_ne!(a.host_nqn, b.host_nqn);
    let vol = "kl-s5";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let sa = lab.attach(&mut ctl, &mut a, vol).await;
    let data = DataSet::write(&sa.target, "from-a", 4, 256 * 1024);
    check_configfs_export(vol, &[&a.host_nqn]);
    sc.step("published RWO to node-a, data written");

    let err = lab
        .publish(&mut ctl, vol, &b)
        .await
        .expect_err("a second RWO publish must be refused");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("node-a"),
        "the refusal names the node holding the volume: {}",
        err.message()
    );
    check_configfs_export(vol, &[&a.host_nqn]);
    sc.step("ControllerPublish to node-b: FAILED_PRECONDITION naming node-a; ACL unchanged");

    let k1 = lab.kmsg.mark();
    let direct = pillar_host::connect(&host_paths(), &connect_opts(vol, &b.host_nqn, b.host_id));
    println!("  host B connects on its own: {direct:?}");
    assert!(
        direct.is_err(),
        "host B connected to a volume published RWO to node-a"
    );
    let refused_b = not_allowed(&b.host_nqn, &nqn_of(vol));
    lab.kmsg.expect(k1, &refused_b, Duration::from_secs(5));
    let staged_b = lab.stage(&mut b, vol, &sa.publish_context).await;
    assert!(
        staged_b.is_err(),
        "node-b staged a volume it was not published to"
    );
    assert!(
        host_controllers(vol, &b.host_nqn).is_empty(),
        "host B has a controller of the volume"
    );
    assert!(
        pillar_host::find_mount(&b.dir.join(format!("staging/{vol}")))
            .unwrap()
            .is_none()
    );
    // With DH-HMAC-CHAP (W10, where the kernel has it) node-b's NodeStage is refused before
    // it connects (it holds no secret for this publication): only the direct connect reaches
    // the target. Without it, both connects reach the target and are refused there.
    let reaching_target = if crate::harness::machine::kernel_has_auth() {
        1
    } else {
        2
    };
    assert!(
        lab.kmsg.count(k1, &refused_b) >= reaching_target,
        "the target refused fewer than {reaching_target} connects of host B to this subsystem"
    );
    sc.step(
        "host B (second hostnqn/hostid) refused by the target: direct connect and NodeStage fail",
    );

    // W7: ControllerUnpublish from node-a while its host is still connected, the volume staged
    // and mounted (a force-detach: kubelet has not unstaged). The controller's revoke must cut
    // the live connection, not only keep new ones out.
    let nqn = nqn_of(vol);
    let k_cut = lab.kmsg.mark();
    lab.unpublish(&mut ctl, &a, &sa).await;
    check_configfs_export(vol, &[]);
    lab.kmsg.expect(
        k_cut,
        &not_allowed(&a.host_nqn, &nqn),
        Duration::from_secs(15),
    );
    let ctrls = host_controllers(vol, &a.host_nqn);
    assert!(
        ctrls.iter().all(|c| c.state.as_str() != "live"),
        "host A still has a live controller after ControllerUnpublish: {ctrls:?}"
    );
    sc.step("ControllerUnpublish from node-a while its host is connected: connection cut, reconnect refused by the target");

    // The backing file as it is now; then host A writes a new file through its pod path.
    let backing = lab.dir.join(format!("pool/{vol}.img"));
    let snapshot = lab.dir.join("backing-after-cut.img");
    run_ok(
        Command::new("cp")
            .arg("--sparse=always")
            .arg(&backing)
            .arg(&snapshot),
    );
    let late = pattern(0x5_1A7E, 256 * 1024);
    let mut probe = WriteProbe::start(&sa.target.join("after-unpublish.bin"), &late, true);
    let outcome = probe.outcome(Duration::from_secs(5));
    println!("  write + fsync by host A after its unpublish: {outcome}");
    assert!(
        !outcome.starts_with("SUCCEEDED"),
        "host A wrote after its unpublish: {outcome}"
    );
    std::thread::sleep(Duration::from_secs(1));
    let same = Command::new("cmp")
        .arg("-s")
        .arg(&backing)
        .arg(&snapshot)
        .status()
        .expect("run cmp");
    assert!(
        same.success(),
        "the backing file changed after host A was cut off (cmp: {same})"
    );
    assert!(
        !file_has_block(&backing, &late[..4096]),
        "host A's late write is in the backing file"
    );
    fs::remove_file(&snapshot).unwrap();
    sc.step("host A's write after the cut failed or blocked; the backing file is unchanged");

    // Kubelet's teardown of the fenced volume on node-a. On 6.1 the host keeps reconnecting
    // (refused) until ctrl_loss_tmo with the write held; deleting its controller, as the host
    // does by itself on newer kernels after the refusal, fails the held I/O so that the
    // unmount does not wait for ctrl_loss_tmo.
    delete_host_controllers(vol, &a.host_nqn);
    let outcome = probe.outcome(Duration::from_secs(20));
    assert!(
        outcome.starts_with("FAILED"),
        "host A's write after its unpublish: {outcome}"
    );
    node_teardown(&mut a, &sa).await;
    sc.step(&format!(
        "node-a's teardown (NodeUnpublish, NodeUnstage) of the fenced volume works; its write: {outcome}"
    ));
    let sb = lab.attach(&mut ctl, &mut b, vol).await;
    check_configfs_export(vol, &[&b.host_nqn]);
    data.verify_at(&sa.target, &sb.target);
    let k2 = lab.kmsg.mark();
    let direct = pillar_host::connect(&host_paths(), &connect_opts(vol, &a.host_nqn, a.host_id));
    assert!(
        direct.is_err(),
        "host A connected after its unpublish: {direct:?}"
    );
    lab.kmsg.expect(
        k2,
        &not_allowed(&a.host_nqn, &nqn_of(vol)),
        Duration::from_secs(5),
    );
    sc.step("published to node-b: it connects and reads node-a's data; host A is now refused");
    lab.detach(&mut ctl, &mut b, &sb).await;
    lab.delete_volume(&mut ctl, vol).await;
}

fn run_ok(cmd: &mut Command) {
    let st = cmd.status().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(st.success(), "{cmd:?}: {st}");
}

/// Whether a 4 KiB-aligned block of `path` starts with `block` (file data of ext4 is in 4 KiB
/// blocks).
fn file_has_block(path: &Path, block: &[u8]) -> bool {
    let mut f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let mut n = 0;
        while n < buf.len() {
            match f.read(&mut buf[n..]).expect("read the backing file") {
                0 => break,
                m => n += m,
            }
        }
        if buf[..n].chunks(4096).any(|c| c.starts_with(block)) {
            return true;
        }
        if n < buf.len() {
            return false;
        }
    }
}
