//! What holds when a request is overtaken, cancelled by its caller, or raced by another request
//! on the same volume: through the real gRPC server, once per engine, with test hooks stalling
//! or slowing the agent at named points.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use pillar_agent::fence::decode;
use pillar_agent::hooks::HookPoint;
use pillar_agent_api::v1 as api;
use pillar_agent_api::{ErrorReason, reason_of};
use pillar_nvmet::{NamespaceId, VolumeId, observe};
use support::{Agent, ENGINES, MIB, create_req, export_req, host, token};
use tonic::{Code, Request};

fn nqn(volume: &str) -> String {
    VolumeId::parse(volume).unwrap().subsystem_nqn().to_string()
}

fn mark_generation(a: &Agent, volume: &str) -> u64 {
    let bytes = std::fs::read(a.dirs.state().join(format!("generations/{volume}.json"))).unwrap();
    decode(&VolumeId::parse(volume).unwrap(), &bytes)
        .unwrap()
        .generation
}

fn revoke(uid: &str, generation: u64, volume: &str, h: u32) -> api::RevokeInitiatorRequest {
    api::RevokeInitiatorRequest {
        token: token(uid, generation),
        volume_id: volume.into(),
        host_nqn: host(h),
    }
}

fn grant(uid: &str, generation: u64, volume: &str, h: u32) -> api::GrantInitiatorRequest {
    api::GrantInitiatorRequest {
        token: token(uid, generation),
        volume_id: volume.into(),
        host_nqn: host(h),
        credentials: None,
    }
}

fn with_deadline<T>(message: T, deadline: Duration) -> Request<T> {
    let mut r = Request::new(message);
    r.set_timeout(deadline);
    r
}

async fn wait_reached(gate: &Arc<pillar_agent::hooks::Gate>) {
    let gate = Arc::clone(gate);
    let reached =
        tokio::task::spawn_blocking(move || gate.wait_reached(1, Duration::from_secs(20)))
            .await
            .unwrap();
    assert!(reached, "the stalled request never reached the hook");
}

// proves F11, F5, W7 (defect: a cancelled request kept working after it released its locks).
// An Export listing host 1 is stalled inside its configfs apply (as on a frozen configfs) and
// its caller gives up after 1 s. A Revoke of host 1 with a newer token must wait for the export
// to finish, then remove host 1: the revoke never answers OK while an export that re-admits the
// host is still in flight. On the old code the revoke found nothing exported, answered OK at
// once, and the export landed afterwards with host 1 admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_export_finishes_under_its_lock_before_a_newer_revoke() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        a.client
            .create_volume(create_req("u1", 1, "vol-c", 16 * MIB))
            .await
            .unwrap();
        let gate = a.hooks.stall(HookPoint::ConfigfsApply);
        let status = a
            .client
            .export(with_deadline(
                export_req("u1", 2, "vol-c", true, &[1]),
                Duration::from_secs(1),
            ))
            .await
            .unwrap_err();
        assert!(
            matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
            "{engine:?}: {status:?}"
        );
        wait_reached(&gate).await;
        let mut c = a.client.clone();
        let revoke =
            tokio::spawn(async move { c.revoke_initiator(revoke("u1", 3, "vol-c", 1)).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !revoke.is_finished(),
            "{engine:?}: the revoke answered while the export it overtakes was still in flight: {:?}",
            revoke.await
        );
        gate.release();
        a.hooks.clear(HookPoint::ConfigfsApply);
        revoke.await.unwrap().unwrap();
        let state = observe(&a.dirs.configfs()).unwrap();
        let sub = &state.subsystems[&nqn("vol-c")];
        assert!(
            sub.allowed_hosts.is_empty(),
            "{engine:?}: host 1 still admitted after its confirmed revoke: {:?}",
            sub.allowed_hosts
        );
        assert!(
            !sub.namespaces[&NamespaceId::VOLUME].enabled,
            "{engine:?}: nobody admitted, yet the namespace is enabled (W7: drained)"
        );
        assert_eq!(mark_generation(&a, "vol-c"), 3);
    }
}

// proves F11, F5: a grant stalled after its mark commit and abandoned by its caller still holds
// the volume: a newer revoke runs only after the grant finished, so the final ACL is the
// revoke's, and the mark never goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_grant_holds_the_volume_until_it_is_done() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        c.create_volume(create_req("u1", 1, "vol-g", 16 * MIB))
            .await
            .unwrap();
        c.export(export_req("u1", 2, "vol-g", true, &[]))
            .await
            .unwrap();
        let gate = a.hooks.stall(HookPoint::ConfigfsApply);
        let status = a
            .client
            .grant_initiator(with_deadline(
                grant("u1", 3, "vol-g", 1),
                Duration::from_secs(1),
            ))
            .await
            .unwrap_err();
        assert!(matches!(
            status.code(),
            Code::DeadlineExceeded | Code::Cancelled
        ));
        wait_reached(&gate).await;
        assert_eq!(
            mark_generation(&a, "vol-g"),
            3,
            "the mark is durable before the change"
        );
        let mut c = a.client.clone();
        let revoke =
            tokio::spawn(async move { c.revoke_initiator(revoke("u1", 4, "vol-g", 1)).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !revoke.is_finished(),
            "{engine:?}: revoke overtook an unfinished grant"
        );
        gate.release();
        a.hooks.clear(HookPoint::ConfigfsApply);
        revoke.await.unwrap().unwrap();
        let state = observe(&a.dirs.configfs()).unwrap();
        assert!(state.subsystems[&nqn("vol-g")].allowed_hosts.is_empty());
        assert_eq!(mark_generation(&a, "vol-g"), 4);
    }
}

// proves F5 with the target lock scoped (issue 11): a configfs change stalled on one volume (a
// frozen configfs write) holds up neither the fenced change of another volume nor its mark; only
// a change of an entry volumes share (creating a host entry) waits for it. With the node-wide
// target lock of before, the revoke of vol-b waited for vol-a's stalled grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_change_of_one_volume_does_not_hold_up_another() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        for (volume, hosts) in [("vol-a", &[][..]), ("vol-b", &[1][..]), ("vol-c", &[1][..])] {
            c.create_volume(create_req("u1", 1, volume, 16 * MIB))
                .await
                .unwrap();
            c.export(export_req("u1", 2, volume, true, hosts))
                .await
                .unwrap();
        }
        let gate = a.hooks.stall(HookPoint::ConfigfsApply);
        let mut c = a.client.clone();
        let stalled =
            tokio::spawn(async move { c.grant_initiator(grant("u1", 3, "vol-a", 1)).await });
        wait_reached(&gate).await;
        // Only the grant already waiting stays stalled.
        a.hooks.clear(HookPoint::ConfigfsApply);
        tokio::time::timeout(
            Duration::from_secs(20),
            a.client.revoke_initiator(revoke("u1", 3, "vol-b", 1)),
        )
        .await
        .unwrap_or_else(|_| panic!("{engine:?}: vol-b's revoke waited for vol-a's stalled grant"))
        .unwrap();
        assert_eq!(mark_generation(&a, "vol-b"), 3);
        assert!(!stalled.is_finished(), "{engine:?}: the stall did not hold");
        let mut c = a.client.clone();
        let new_host =
            tokio::spawn(async move { c.grant_initiator(grant("u1", 4, "vol-b", 2)).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !new_host.is_finished(),
            "{engine:?}: a new host entry was created while another change was in flight"
        );
        gate.release();
        stalled.await.unwrap().unwrap();
        new_host.await.unwrap().unwrap();
        let state = observe(&a.dirs.configfs()).unwrap();
        let hosts = |v: &str| state.subsystems[&nqn(v)].allowed_hosts.clone();
        assert_eq!(hosts("vol-a").into_iter().collect::<Vec<_>>(), [host(1)]);
        assert_eq!(hosts("vol-b").into_iter().collect::<Vec<_>>(), [host(2)]);
        assert_eq!(hosts("vol-c").into_iter().collect::<Vec<_>>(), [host(1)]);
    }
}

// proves F5: check and commit happen under one lock. Many requests with shuffled generations
// race on one volume, each paused between its fence check and its commit; a request is
// accepted only if no higher generation was accepted before it, so the mark ends at the
// highest accepted generation and never goes back. Taking the lock after the check (or
// releasing it between check and commit) makes a lower generation commit over a higher one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_requests_on_one_volume_never_move_the_mark_back() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        a.client
            .create_volume(create_req("u1", 1, "vol-r", 16 * MIB))
            .await
            .unwrap();
        a.client
            .export(export_req("u1", 2, "vol-r", true, &[]))
            .await
            .unwrap();
        a.hooks
            .delay(HookPoint::BetweenCheckAndCommit, Duration::from_millis(3));
        let mut base = 10;
        for round in 0..8 {
            // Generations base..base+16, sent in an order that mixes low and high.
            let gens: Vec<u64> = (0..16).map(|i| base + (i * 7 + round) % 16).collect();
            base += 16;
            let mut tasks = Vec::new();
            for g in gens {
                let mut c = a.client.clone();
                let h = u32::try_from(g % 3).unwrap() + 1;
                tasks.push(tokio::spawn(async move {
                    let r = if g % 2 == 0 {
                        c.grant_initiator(grant("u1", g, "vol-r", h))
                            .await
                            .map(|_| ())
                    } else {
                        c.revoke_initiator(revoke("u1", g, "vol-r", h))
                            .await
                            .map(|_| ())
                    };
                    (g, r)
                }));
            }
            let mut accepted = Vec::new();
            for t in tasks {
                let (g, r) = t.await.unwrap();
                match r {
                    Ok(()) => accepted.push(g),
                    Err(s) => assert_eq!(
                        reason_of(&s),
                        ErrorReason::StaleGeneration,
                        "{engine:?} gen {g}: {s:?}"
                    ),
                }
            }
            let highest = *accepted.iter().max().expect("at least one request wins");
            assert_eq!(
                mark_generation(&a, "vol-r"),
                highest,
                "{engine:?} round {round}: the mark is not the highest accepted generation"
            );
        }
        a.hooks.clear(HookPoint::BetweenCheckAndCommit);
    }
}

// proves F7: the mark is made durable before the change. When the mark write fails, the
// request fails with the mark's error and configfs, the pool and the mark stay as they were
// (swapping commit and apply would leave the change applied with no durable mark).
#[tokio::test]
async fn a_failed_mark_write_changes_nothing() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        a.client
            .create_volume(create_req("u1", 1, "vol-m", 16 * MIB))
            .await
            .unwrap();
        a.client
            .export(export_req("u1", 2, "vol-m", true, &[1]))
            .await
            .unwrap();
        let before = a.snapshot();
        a.hooks.fail(HookPoint::MarkWrite);
        let c = &mut a.client;
        let failures = [
            c.grant_initiator(grant("u1", 3, "vol-m", 2))
                .await
                .unwrap_err(),
            c.revoke_initiator(revoke("u1", 4, "vol-m", 1))
                .await
                .unwrap_err(),
            c.export(export_req("u1", 5, "vol-m", true, &[3]))
                .await
                .unwrap_err(),
            c.unexport(api::UnexportRequest {
                token: token("u1", 6),
                volume_id: "vol-m".into(),
            })
            .await
            .unwrap_err(),
        ];
        for status in failures {
            assert_eq!(
                reason_of(&status),
                ErrorReason::MarkIo,
                "{engine:?}: {status:?}"
            );
        }
        let after = a.snapshot();
        assert_eq!(
            before, after,
            "{engine:?}: a change ran without its durable mark"
        );
        a.hooks.clear(HookPoint::MarkWrite);
        a.client
            .revoke_initiator(revoke("u1", 7, "vol-m", 1))
            .await
            .unwrap();
        assert_eq!(mark_generation(&a, "vol-m"), 7);
    }
}
