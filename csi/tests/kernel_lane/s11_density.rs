//! Scenario 11: density on the real target (issue 11).

use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use pillar_agent::backend::loopdev;
use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::v1::agent_client::AgentClient;
use tonic::transport::Channel;

use crate::harness::checks::{check_configfs_export, token};
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::lab::Lab;
use crate::harness::machine::{entries, nvmet_teardown_all};
use crate::harness::{MIB, NVMET, POOL, PORT};

/// Exports on the node at the end.
const EXPORTS: usize = 1000;
/// Exports timed at each size.
const PROBES: usize = 10;
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000d011";

fn volume(n: usize) -> String {
    format!("kl-s11-{n:04}")
}

fn export_request(volume: &str) -> agent_api::ExportRequest {
    agent_api::ExportRequest {
        token: token(&format!("uid-{volume}"), 2),
        volume_id: volume.into(),
        pool: POOL.into(),
        protocol: Some(agent_api::ExportProtocol {
            service: u32::from(PORT),
            acl: true,
            auth_none: true,
            tls: false,
        }),
        allowed_host_nqns: vec![HOST.into()],
        credentials: vec![],
    }
}

async fn create(agent: &mut AgentClient<Channel>, volume: &str) {
    agent
        .create_volume(agent_api::CreateVolumeRequest {
            token: token(&format!("uid-{volume}"), 1),
            volume_id: volume.into(),
            pool: POOL.into(),
            size_bytes: MIB,
            source: None,
        })
        .await
        .unwrap_or_else(|e| panic!("CreateVolume {volume}: {e}"));
}

/// The median time of one more Export with `present` exports on the node (each probe volume is
/// created first, exported while timed, then unexported and deleted).
async fn probe_export(agent: &mut AgentClient<Channel>, present: usize) -> Duration {
    let mut times = Vec::new();
    for p in 0..PROBES {
        let v = format!("kl-s11-probe-{present}-{p}");
        create(agent, &v).await;
        let t = Instant::now();
        agent
            .export(export_request(&v))
            .await
            .unwrap_or_else(|e| panic!("Export {v}: {e}"));
        times.push(t.elapsed());
        agent
            .unexport(agent_api::UnexportRequest {
                token: token(&format!("uid-{v}"), 3),
                volume_id: v.clone(),
            })
            .await
            .unwrap();
        agent
            .delete_volume(agent_api::DeleteVolumeRequest {
                token: token(&format!("uid-{v}"), 4),
                volume_id: v.clone(),
                pool: POOL.into(),
            })
            .await
            .unwrap();
    }
    times.sort();
    times[times.len() / 2]
}

/// Scenario 11: a node with 1,000 exports on loop devices (the file backend), each with ACL and
/// derived identity. The cost of one more Export is timed with 10 and with 1,000 exports
/// present; then a storage-node reboot (agent killed, nvmet torn down, loop devices gone, the
/// agent's state kept) and one ResyncExports of all 1,000: every export comes back with its
/// identity, ACL, enabled namespace and port link. Figures are printed, not asserted (speed
/// goals live in the benchmark report).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s11_density() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s11_density");
    let mut lab = Lab::new("s11", true).await;
    let mut agent = lab.start_agent(&[]).await;
    agent
        .resync_exports(agent_api::ResyncExportsRequest::default())
        .await
        .expect("empty resync");
    let mut present = 0usize;
    let mut probes = Vec::new();
    let started = Instant::now();
    for k in [10, EXPORTS] {
        // Sixteen callers at once, as a controller serving many volumes sends them: exports of
        // different volumes change configfs concurrently on the real target.
        futures::stream::iter(present + 1..=k)
            .for_each_concurrent(16, |n| {
                let mut agent = agent.clone();
                async move {
                    let v = volume(n);
                    create(&mut agent, &v).await;
                    agent
                        .export(export_request(&v))
                        .await
                        .unwrap_or_else(|e| panic!("Export {v}: {e}"));
                }
            })
            .await;
        present = k;
        let median = probe_export(&mut agent, present).await;
        println!(
            "  one more Export with {present} exports present: median {:.2} ms",
            median.as_secs_f64() * 1e3
        );
        probes.push(median);
    }
    sc.step(&format!(
        "{EXPORTS} volumes created and exported in {:.1} s; one more Export: {:.2} ms at 10, {:.2} ms at {EXPORTS} ({:.2}x)",
        started.elapsed().as_secs_f64(),
        probes[0].as_secs_f64() * 1e3,
        probes[1].as_secs_f64() * 1e3,
        probes[1].as_secs_f64() / probes[0].as_secs_f64()
    ));

    lab.agent.as_mut().expect("agent").kill();
    nvmet_teardown_all().expect("nvmet teardown");
    let loops = detach_pool_loops(&lab.dir.join("pool"));
    assert!(
        entries(&Path::new(NVMET).join("subsystems")).is_empty(),
        "nvmet not empty after the teardown"
    );
    sc.step(&format!(
        "storage reboot: agent killed, nvmet torn down, {loops} loop devices detached"
    ));
    let mut agent = lab.start_agent(&[]).await;
    let t = Instant::now();
    let response = agent
        .resync_exports(agent_api::ResyncExportsRequest {
            exports: (1..=EXPORTS).map(|n| export_request(&volume(n))).collect(),
            // The state directory survived the reboot: no loss, no epoch needed.
            state_epoch: String::new(),
        })
        .await
        .expect("ResyncExports")
        .into_inner();
    let resync = t.elapsed();
    let failed: Vec<_> = response.results.iter().filter(|r| !r.ok).collect();
    assert!(failed.is_empty(), "exports not restored: {failed:?}");
    assert_eq!(response.results.len(), EXPORTS);
    sc.step(&format!(
        "resync of {EXPORTS} exports onto the empty target (loop devices bound again): {:.2} s",
        resync.as_secs_f64()
    ));

    // Every export is back as pillar promises it: derived identity and serial, enabled,
    // admitting exactly its host, linked on the port.
    let host: pillar_nvmet::HostNqn = HOST.parse().expect("host NQN");
    for n in 1..=EXPORTS {
        check_configfs_export(&volume(n), &[&host]);
    }
    let subsystems = entries(&Path::new(NVMET).join("subsystems"));
    assert_eq!(subsystems.len(), EXPORTS, "subsystems in configfs");
    sc.step("every export back with derived identity, enabled, admitting its host, on the port");

    // Cleanup with ioctls rather than a `losetup` per device (the next scenario's reset would
    // spawn a thousand): the agent first, then nvmet, then the loop devices.
    if let Some(mut agent) = lab.agent.take() {
        agent.stop();
    }
    nvmet_teardown_all().expect("nvmet teardown");
    detach_pool_loops(&lab.dir.join("pool"));
}

/// Detaches every loop device bound to a file under `pool` through the loop ioctls; how many.
fn detach_pool_loops(pool: &Path) -> usize {
    let bindings = loopdev::bindings().expect("loop bindings");
    let mine: Vec<_> = bindings
        .iter()
        .filter(|b| b.backing_file.starts_with(pool))
        .collect();
    for b in &mine {
        loopdev::detach(b.index, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("detach loop{}: {e}", b.index));
    }
    mine.len()
}
