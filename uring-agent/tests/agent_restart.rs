//! The agent binary killed with SIGKILL: during fencing-mark writes (no torn mark, nothing
//! acknowledged lost, stale requests still refused) and between operations (after a restart it
//! refuses exports until resync, then serves them with the same identity, even with its state
//! directory and the target wiped).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use pillar_agent::fence::decode;
use pillar_agent_api::v1 as api;
use pillar_nvmet::{NamespaceId, NamespaceIdentity, VolumeId, observe};
use support::{
    AgentProcess, Dirs, MIB, connect, create_req, detach_loops_under, export_req, host, token,
};
use tokio::sync::Mutex;
use tonic::Code;

const ENGINES: [&str; 2] = ["io_uring", "sync"];

fn revoke(generation: u64, volume: &str) -> api::RevokeInitiatorRequest {
    api::RevokeInitiatorRequest {
        token: token("u1", generation),
        volume_id: volume.into(),
        host_nqn: host(1),
    }
}

// Crash safety by SIGKILL at arbitrary points of a stream of mark updates: every mark reads back
// whole (old or new, never torn), no acknowledged generation is lost, and a request older than the
// surviving mark is refused after the restart. proves F7, F8
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_during_mark_writes_leaves_whole_marks_and_keeps_fencing() {
    let volumes = ["k0", "k1", "k2", "k3"];
    for engine in ENGINES {
        let dirs = Dirs::new();
        for round in 0..6u64 {
            let agent = AgentProcess::spawn(&dirs, engine);
            let mut client = connect(&dirs.socket()).await;
            client
                .resync_exports(api::ResyncExportsRequest {
                    exports: vec![],
                    ..Default::default()
                })
                .await
                .unwrap();
            // Per volume: (highest generation sent, highest acknowledged).
            let progress = Arc::new(Mutex::new(BTreeMap::<String, (u64, u64)>::new()));
            let mut tasks = Vec::new();
            for v in volumes {
                let (mut c, progress) = (client.clone(), Arc::clone(&progress));
                tasks.push(tokio::spawn(async move {
                    let mut generation = round * 1_000_000;
                    loop {
                        generation += 1;
                        progress.lock().await.entry(v.into()).or_default().0 = generation;
                        match c.revoke_initiator(revoke(generation, v)).await {
                            Ok(_) => {
                                progress.lock().await.entry(v.into()).or_default().1 = generation
                            }
                            Err(_) => return,
                        }
                    }
                }));
            }
            // The kill lands at a different point of the stream each round, counted from the
            // first acknowledged update: on a loaded machine the stream may take longer to start
            // than any fixed offset.
            let started = tokio::time::Instant::now();
            while progress.lock().await.values().all(|(_, acked)| *acked == 0) {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "{engine}: no update acknowledged within 60 s"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(50 + 97 * round)).await;
            agent.kill();
            for t in tasks {
                let _ = t.await;
            }
            let progress = progress.lock().await.clone();
            let mut checked = 0;
            for (v, (sent, acked)) in &progress {
                let path = dirs.state().join(format!("generations/{v}.json"));
                let Ok(bytes) = std::fs::read(&path) else {
                    assert_eq!(*acked, 0, "{engine}: {v} acknowledged but no mark");
                    continue;
                };
                let mark = decode(&VolumeId::parse(v).unwrap(), &bytes)
                    .unwrap_or_else(|e| panic!("{engine}: torn mark {v}: {e}"));
                assert!(
                    mark.generation >= *acked,
                    "{engine}: {v} lost acknowledged generation {acked} (mark {})",
                    mark.generation
                );
                assert!(
                    mark.generation <= *sent,
                    "{engine}: {v} mark {} beyond anything sent ({sent})",
                    mark.generation
                );
                checked += 1;
            }
            assert!(
                checked > 0,
                "{engine}: the agent applied nothing before the kill"
            );

            // After restart, anything older than the surviving mark is still refused.
            let agent = AgentProcess::spawn(&dirs, engine);
            let mut client = connect(&dirs.socket()).await;
            for v in volumes {
                let path = dirs.state().join(format!("generations/{v}.json"));
                let Ok(bytes) = std::fs::read(&path) else {
                    continue;
                };
                let mark = decode(&VolumeId::parse(v).unwrap(), &bytes).unwrap();
                let status = client
                    .revoke_initiator(revoke(mark.generation - 1, v))
                    .await
                    .unwrap_err();
                assert_eq!(status.code(), Code::FailedPrecondition, "{engine}: {v}");
            }
            agent.kill();
        }
    }
}

fn live_identity(dirs: &Dirs, volume: &str) -> Option<NamespaceIdentity> {
    let nqn = VolumeId::parse(volume).unwrap().subsystem_nqn();
    observe(&dirs.configfs())
        .ok()?
        .subsystems
        .get(nqn.as_str())?
        .namespaces
        .get(&NamespaceId::VOLUME)?
        .identity()
}

// proves C3, I1: after SIGKILL and restart on the same state the agent refuses exports until the
// controller resyncs; then it serves the same export with the same identity. The same holds after
// a storage-node reboot that wiped the target and the agent's state directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_waits_for_resync_then_restores_the_same_identity() {
    for engine in ENGINES {
        let dirs = Dirs::new();
        let agent = AgentProcess::spawn(&dirs, engine);
        let mut c = connect(&dirs.socket()).await;
        c.resync_exports(api::ResyncExportsRequest {
            exports: vec![],
            ..Default::default()
        })
        .await
        .unwrap();
        c.create_volume(create_req("u1", 1, "vol-r", 16 * MIB))
            .await
            .unwrap();
        c.export(export_req("u1", 2, "vol-r", true, &[1]))
            .await
            .unwrap();
        let before = live_identity(&dirs, "vol-r").expect("exported");
        agent.kill();

        for wipe in [false, true] {
            if wipe {
                // Storage reboot: configfs is empty and the agent's state directory is gone.
                std::fs::remove_dir_all(dirs.configfs()).unwrap();
                std::fs::remove_dir_all(dirs.state()).unwrap();
            }
            let agent = AgentProcess::spawn(&dirs, engine);
            let mut c = connect(&dirs.socket()).await;
            let h = c.health(api::HealthRequest {}).await.unwrap().into_inner();
            // With the state directory gone while the pool still holds the volume, the agent
            // knows its marks were lost (C6) and takes a resync only with its state epoch.
            let want = if wipe {
                api::health_response::State::Lost
            } else {
                api::health_response::State::WaitingForResync
            };
            assert_eq!(h.state(), want, "{engine}");
            let status = c
                .export(export_req("u1", 3, "vol-r", true, &[1]))
                .await
                .unwrap_err();
            assert_eq!(
                status.code(),
                Code::Unavailable,
                "{engine}: {}",
                status.message()
            );
            let r = c
                .resync_exports(api::ResyncExportsRequest {
                    exports: vec![export_req("u1", 3, "vol-r", true, &[1])],
                    state_epoch: h.state_epoch.clone(),
                })
                .await
                .unwrap()
                .into_inner();
            assert!(r.results.iter().all(|x| x.ok), "{engine}: {r:?}");
            assert_eq!(
                live_identity(&dirs, "vol-r"),
                Some(before),
                "{engine} (wiped: {wipe})"
            );
            let n = VolumeId::parse("vol-r").unwrap().subsystem_nqn();
            assert_eq!(before, NamespaceIdentity::derive(&n, NamespaceId::VOLUME));
            agent.kill();
        }
        let agent = AgentProcess::spawn(&dirs, engine);
        let mut c = connect(&dirs.socket()).await;
        c.resync_exports(api::ResyncExportsRequest {
            exports: vec![],
            ..Default::default()
        })
        .await
        .unwrap();
        c.unexport(api::UnexportRequest {
            token: token("u1", 10),
            volume_id: "vol-r".into(),
        })
        .await
        .unwrap();
        c.delete_volume(api::DeleteVolumeRequest {
            token: token("u1", 11),
            volume_id: "vol-r".into(),
            pool: "p1".into(),
        })
        .await
        .unwrap();
        agent.kill();
        detach_loops_under(&dirs.pool());
    }
}
