//! The storage-node reboot shared by scenarios 3 and 4.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use pillar_agent_api::v1 as agent_api;
use tonic::Code;

use crate::harness::checks::{
    check_configfs_export_exists, host_controllers, token, volume_stats, wait_controller_state,
};
use crate::harness::gate::Scenario;
use crate::harness::lab::{Lab, NodePlugin, Staged, nqn_of};
use crate::harness::machine::{
    detach_loops_under, nvmet_is_empty, nvmet_teardown_all, take_ports_away,
};
use crate::harness::{NVMET, POOL, PORT};

/// What a storage-node reboot leaves behind, for scenarios 3 and 4.
pub(crate) struct Reboot {
    /// kmsg position at the cut.
    pub(crate) cut: usize,
    /// Seconds from the cut until the export was back in configfs.
    pub(crate) export_back: f64,
}

/// A storage-node reboot: the agent dies, the port is taken away (the TCP connections drop),
/// all nvmet state is torn down, loop devices go, the agent's state directory is wiped; the
/// agent restarts and refuses exports until the controller resyncs (the controller is down
/// during the reboot, so the refusal is observed before any resync; its resync loop sends the
/// resync once it is back).
pub(crate) async fn storage_reboot(
    lab: &mut Lab,
    sc: &Scenario,
    node: &mut NodePlugin,
    staged: &Staged,
    agent_args: &[&str],
) -> Reboot {
    let volume = staged.volume.as_str();
    let host = &node.host_nqn.clone();
    let ctrl = host_controllers(volume, host).remove(0).name;
    lab.controller.as_mut().unwrap().stop();
    let cut = lab.kmsg.mark();
    let t_cut = Instant::now();
    lab.agent.as_mut().unwrap().kill();
    take_ports_away().expect("take the port away");
    sc.step("storage node down: agent killed, subsystem unlinked and port removed");
    lab.kmsg.expect(
        cut,
        &[&format!("{ctrl}: starting error recovery")],
        Duration::from_secs(10),
    );
    let lost = wait_controller_state(
        volume,
        host,
        |s| s != "live",
        "not live",
        Duration::from_secs(20),
    );
    println!(
        "  host noticed the loss after {:.1}s: {:?}",
        lost.as_secs_f64(),
        host_controllers(volume, host)
            .iter()
            .map(|c| (c.name.clone(), c.state.as_str().to_owned()))
            .collect::<Vec<_>>()
    );
    nvmet_teardown_all().expect("tear down nvmet");
    assert!(nvmet_is_empty(), "nvmet state left after the teardown");
    let loops = detach_loops_under(&lab.dir.join("pool"));
    assert!(loops >= 1, "the volume's loop device was not found");
    fs::remove_dir_all(lab.agent_state()).expect("wipe the agent's state directory");
    sc.step("all nvmet state torn down, loop devices detached, agent state directory wiped");
    // Nothing listens any more: the host's reconnects are refused at the TCP level.
    lab.kmsg.expect(
        cut,
        &[&format!("{ctrl}: failed to connect socket: -111")],
        Duration::from_secs(10),
    );

    let mut agent = lab.start_agent(agent_args).await;
    let h = agent
        .health(agent_api::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    // The state directory was wiped: the agent knows its state was lost (C6) and waits for
    // the resync that re-seeds its marks.
    assert_eq!(
        h.state(),
        agent_api::health_response::State::Lost,
        "a restarted agent whose state was wiped knows it lost its state"
    );
    let uid = lab.volume_uid(volume);
    let refused = agent
        .export(agent_api::ExportRequest {
            token: token(&uid, u64::MAX / 2),
            volume_id: volume.into(),
            pool: POOL.into(),
            protocol: Some(agent_api::ExportProtocol {
                service: u32::from(PORT),
                acl: true,
                auth_none: true,
                tls: false,
            }),
            allowed_host_nqns: vec![host.to_string()],
            credentials: vec![],
        })
        .await
        .expect_err("an export before the resync must be refused");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains("state directory was lost"),
        "{refused:?}"
    );
    let refused = agent
        .grant_initiator(agent_api::GrantInitiatorRequest {
            token: token(&uid, u64::MAX / 2),
            volume_id: volume.into(),
            host_nqn: host.to_string(),
            credentials: None,
        })
        .await
        .expect_err("a grant before the resync must be refused");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        !lab.agent_state()
            .join(format!("generations/{volume}.json"))
            .exists(),
        "a refused request left a fencing mark"
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        nvmet_is_empty(),
        "the agent created nvmet state before the resync"
    );
    assert!(
        host_controllers(volume, host)
            .iter()
            .all(|c| c.state.as_str() != "live"),
        "host live without an export"
    );
    sc.step("agent restarted: STATE_LOST, Export and GrantInitiator refused (UNAVAILABLE), nvmet still empty after 3 s");
    // C5: the outage is visible to the CO, and asking does not hang.
    let stats = volume_stats(node, staged).await;
    println!("  NodeGetVolumeStats during the outage: {stats:?}");
    let condition = stats
        .expect("NodeGetVolumeStats answers during the outage")
        .volume_condition
        .expect("condition");
    assert!(
        condition.abnormal,
        "volume condition normal while the storage node is down: {condition:?}"
    );
    sc.step(&format!(
        "NodeGetVolumeStats during the outage: abnormal ({})",
        condition.message
    ));

    lab.start_controller(1).await;
    lab.wait_agent_state(
        agent_api::health_response::State::Serving,
        Duration::from_secs(30),
    )
    .await;
    let start = Instant::now();
    while !Path::new(NVMET)
        .join("subsystems")
        .join(nqn_of(volume).as_str())
        .join("namespaces/1/enable")
        .exists()
        && start.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    check_configfs_export_exists(volume);
    let export_back = t_cut.elapsed().as_secs_f64();
    sc.step(&format!(
        "controller back: its resync loop re-created the export ({export_back:.1}s after the cut)"
    ));
    Reboot { cut, export_back }
}
