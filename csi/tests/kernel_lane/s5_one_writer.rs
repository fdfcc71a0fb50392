//! Scenario 5: one writer (acl) between two host identities.

use std::time::Duration;

use tonic::Code;

use crate::harness::MIB;
use crate::harness::checks::{check_configfs_export, connect_opts, host_controllers};
use crate::harness::data::DataSet;
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::kmsg::needles::not_allowed;
use crate::harness::lab::{Lab, host_paths, nqn_of};

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
    assert!(
        lab.kmsg.count(k1, &refused_b) >= 2,
        "the target refused both connects of host B to this subsystem"
    );
    sc.step(
        "host B (second hostnqn/hostid) refused by the target: direct connect and NodeStage fail",
    );

    lab.detach(&mut ctl, &mut a, &sa).await;
    check_configfs_export(vol, &[]);
    sc.step("unpublished from node-a");
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
