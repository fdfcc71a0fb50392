//! A lost state directory fails closed (C6): an agent whose fencing marks are gone knows it,
//! refuses every mutating call until the controller re-seeds the marks with a resync carrying
//! the state epoch its Health reports, and then serves; a delayed stale request is refused
//! before, during and after.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pillar_agent::server::EngineKind;
use pillar_agent_api::v1 as api;
use pillar_agent_api::{ErrorReason, reason_of};
use support::*;
use tonic::Code;

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

fn delete(uid: &str, generation: u64, volume: &str) -> api::DeleteVolumeRequest {
    api::DeleteVolumeRequest {
        token: token(uid, generation),
        volume_id: volume.into(),
        pool: "p1".into(),
    }
}

fn reason<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> (Code, ErrorReason) {
    let status = r.expect_err("the call must be refused");
    (status.code(), reason_of(&status))
}

const LOST: (Code, ErrorReason) = (Code::Unavailable, ErrorReason::StateLost);

fn allowed(dirs: &Dirs, volume: &str) -> Vec<String> {
    let nqn = pillar_nvmet::VolumeId::parse(volume)
        .unwrap()
        .subsystem_nqn()
        .to_string();
    pillar_nvmet::observe(&dirs.configfs())
        .unwrap()
        .subsystems
        .get(&nqn)
        .map(|s| s.allowed_hosts.iter().cloned().collect())
        .unwrap_or_default()
}

fn held(dirs: &Dirs, volume: &str) -> bool {
    std::fs::read_dir(dirs.pool())
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with(volume))
}

/// The node before the loss: `vol-a` (lifecycle `a`) exported and granted to host 2 after host
/// 1 was revoked (mark 5); `vol-b` deleted as lifecycle `old` and created again as `new`, not
/// exported (mark: `new` 1, `old` retired). Each stale request below is refused here.
async fn before_the_loss(c: &mut Client) {
    c.create_volume(create_req("a", 1, "vol-a", 16 * MIB))
        .await
        .unwrap();
    c.export(export_req("a", 2, "vol-a", true, &[]))
        .await
        .unwrap();
    c.grant_initiator(grant("a", 3, "vol-a", 1)).await.unwrap();
    c.revoke_initiator(revoke("a", 4, "vol-a", 1))
        .await
        .unwrap();
    c.grant_initiator(grant("a", 5, "vol-a", 2)).await.unwrap();
    c.create_volume(create_req("old", 1, "vol-b", 16 * MIB))
        .await
        .unwrap();
    c.delete_volume(delete("old", 2, "vol-b")).await.unwrap();
    c.create_volume(create_req("new", 1, "vol-b", 16 * MIB))
        .await
        .unwrap();
    assert_eq!(
        reason(c.revoke_initiator(revoke("a", 4, "vol-a", 2)).await).1,
        ErrorReason::StaleGeneration
    );
    assert_eq!(
        reason(c.delete_volume(delete("old", 2, "vol-b")).await).1,
        ErrorReason::RetiredLifecycle
    );
}

/// The delayed requests: a revoke of the host granted since, a delete of the old lifecycle,
/// a create of the old lifecycle. Each must be refused with STATE_LOST while the state is lost.
async fn stale_requests_are_refused(c: &mut Client, dirs: &Dirs, engine: EngineKind) {
    assert_eq!(
        reason(c.revoke_initiator(revoke("a", 4, "vol-a", 2)).await),
        LOST,
        "{engine:?}"
    );
    assert_eq!(
        reason(c.delete_volume(delete("old", 2, "vol-b")).await),
        LOST,
        "{engine:?}"
    );
    assert_eq!(
        reason(
            c.create_volume(create_req("old", 1, "vol-b", 16 * MIB))
                .await
        ),
        LOST,
        "{engine:?}"
    );
    assert_eq!(allowed(dirs, "vol-a"), vec![host(2)], "{engine:?}");
    assert!(
        held(dirs, "vol-b"),
        "{engine:?}: the new lifecycle's volume"
    );
}

async fn lost_epoch(c: &mut Client) -> String {
    let h = c.health(api::HealthRequest {}).await.unwrap().into_inner();
    assert_eq!(h.state(), api::health_response::State::Lost);
    assert!(!h.state_epoch.is_empty());
    h.state_epoch
}

/// The controller's resync, tokens newer than any before the loss: both volumes re-seeded and
/// exported; `vol-c` (held, no record at the controller) left out.
fn reseed(epoch: &str) -> api::ResyncExportsRequest {
    api::ResyncExportsRequest {
        exports: vec![
            export_req("a", 6, "vol-a", true, &[2]),
            export_req("new", 2, "vol-b", true, &[]),
        ],
        state_epoch: epoch.into(),
    }
}

/// After the resync: the agent serves, stale requests meet marks again, work resumes, and the
/// unclaimed volume is refused one by one and kept.
async fn work_resumes(c: &mut Client, dirs: &Dirs, engine: EngineKind) {
    let h = c.health(api::HealthRequest {}).await.unwrap().into_inner();
    assert_eq!(
        h.state(),
        api::health_response::State::Serving,
        "{engine:?}"
    );
    assert_eq!(
        h.unclaimed_volume_ids,
        vec!["vol-c".to_owned()],
        "{engine:?}"
    );
    assert_eq!(
        reason(c.revoke_initiator(revoke("a", 4, "vol-a", 2)).await).1,
        ErrorReason::StaleGeneration,
        "{engine:?}"
    );
    assert_eq!(
        reason(c.delete_volume(delete("old", 2, "vol-b")).await).1,
        ErrorReason::ForeignOwner,
        "{engine:?}"
    );
    assert_eq!(allowed(dirs, "vol-a"), vec![host(2)], "{engine:?}");
    c.revoke_initiator(revoke("a", 7, "vol-a", 2))
        .await
        .unwrap();
    c.grant_initiator(grant("a", 8, "vol-a", 3)).await.unwrap();
    assert_eq!(allowed(dirs, "vol-a"), vec![host(3)], "{engine:?}");
    c.unexport(api::UnexportRequest {
        token: token("new", 3),
        volume_id: "vol-b".into(),
    })
    .await
    .unwrap();
    c.delete_volume(delete("new", 4, "vol-b")).await.unwrap();
    assert!(!held(dirs, "vol-b"), "{engine:?}");
    assert_eq!(
        reason(c.delete_volume(delete("c", 9, "vol-c")).await),
        (Code::FailedPrecondition, ErrorReason::UnclaimedVolume),
        "{engine:?}"
    );
    assert!(
        held(dirs, "vol-c"),
        "{engine:?}: neither deleted nor adopted"
    );
}

// proves C6, F6: the state directory deleted under a running agent; delayed stale requests are
// refused (STATE_LOST) until the controller's resync with the agent's state epoch re-seeds the
// marks, and meet the re-seeded marks after it; a resync without the epoch, or with the epoch of
// an earlier incarnation, is refused whole; then work resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_directory_lost_under_a_running_agent_fails_closed_until_the_resync() {
    for engine in ENGINES {
        let mut agent = Agent::start(engine).await;
        agent.serve_now().await;
        let c = &mut agent.client;
        before_the_loss(c).await;
        c.create_volume(create_req("c", 1, "vol-c", 16 * MIB))
            .await
            .unwrap();
        std::fs::remove_dir_all(agent.dirs.state()).unwrap();

        stale_requests_are_refused(c, &agent.dirs, engine).await;
        let epoch = lost_epoch(c).await;
        // A resync whose tokens may predate the loss: no epoch, or another one.
        for wrong in ["", "f0000000-0000-0000-0000-000000000000"] {
            assert_eq!(
                reason(c.resync_exports(reseed(wrong)).await),
                LOST,
                "{engine:?}"
            );
        }
        // Exports and grants too, even with a fresh token.
        assert_eq!(
            reason(c.grant_initiator(grant("a", 6, "vol-a", 3)).await),
            LOST
        );
        let r = c.resync_exports(reseed(&epoch)).await.unwrap().into_inner();
        assert!(r.results.iter().all(|x| x.ok), "{engine:?}: {r:?}");
        work_resumes(c, &agent.dirs, engine).await;
        agent.stop().await;
    }
}

// proves C6: the state directory lost while the agent was down (a disk replaced, a reinstall);
// the agent starts knowing it, a restart before the resync keeps it lost under a new epoch (the
// old one refused), and the resync with the current epoch brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_directory_lost_while_down_is_known_at_start_and_across_restarts() {
    for engine in ENGINES {
        let mut agent = Agent::start(engine).await;
        agent.serve_now().await;
        before_the_loss(&mut agent.client).await;
        agent
            .client
            .create_volume(create_req("c", 1, "vol-c", 16 * MIB))
            .await
            .unwrap();
        let dirs = agent.stop().await;
        std::fs::remove_dir_all(dirs.state()).unwrap();

        let mut agent = Agent::start_in(dirs, engine).await;
        let c = &mut agent.client;
        stale_requests_are_refused(c, &agent.dirs, engine).await;
        let first = lost_epoch(c).await;
        let dirs = agent.stop().await;

        let mut agent = Agent::start_in(dirs, engine).await;
        let c = &mut agent.client;
        let epoch = lost_epoch(c).await;
        assert_ne!(
            epoch, first,
            "{engine:?}: a new epoch at every start that finds a loss"
        );
        stale_requests_are_refused(c, &agent.dirs, engine).await;
        assert_eq!(reason(c.resync_exports(reseed(&first)).await), LOST);
        let r = c.resync_exports(reseed(&epoch)).await.unwrap().into_inner();
        assert!(r.results.iter().all(|x| x.ok), "{engine:?}: {r:?}");
        work_resumes(c, &agent.dirs, engine).await;
        agent.stop().await;
    }
}

// proves C6 (no false alarm): the first start on an empty state directory and empty pools is no
// loss, nor is a start on a state directory from before the identity file (marks for every
// volume held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_start_and_a_state_without_identity_file_are_no_loss() {
    let mut agent = Agent::start(EngineKind::Sync).await;
    let h = agent.client.health(api::HealthRequest {}).await.unwrap();
    assert_eq!(
        h.into_inner().state(),
        api::health_response::State::WaitingForResync
    );
    agent.serve_now().await;
    agent
        .client
        .create_volume(create_req("a", 1, "vol-a", 16 * MIB))
        .await
        .unwrap();
    let dirs = agent.stop().await;
    std::fs::remove_file(dirs.state().join(pillar_agent::state::FILE)).unwrap();
    let mut agent = Agent::start_in(dirs, EngineKind::Sync).await;
    let h = agent.client.health(api::HealthRequest {}).await.unwrap();
    assert_eq!(
        h.into_inner().state(),
        api::health_response::State::WaitingForResync
    );
    agent.serve_now().await;
    agent
        .client
        .delete_volume(delete("a", 2, "vol-a"))
        .await
        .unwrap();
    agent.stop().await;
}

// proves C6 with C4 (no false alarm): a held volume whose mark is corrupt has a mark: a start
// lists the marks instead of reading each one, and a corrupt file there is no loss (the volume
// fails on its own at its next call, `a_corrupt_mark_is_an_error_for_that_volume_only`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_takes_a_corrupt_mark_for_a_mark_not_a_loss() {
    let mut agent = Agent::start(EngineKind::Sync).await;
    agent.serve_now().await;
    agent
        .client
        .create_volume(create_req("k", 1, "vol-k", 16 * MIB))
        .await
        .unwrap();
    let dirs = agent.stop().await;
    std::fs::write(dirs.state().join("generations/vol-k.json"), b"not a mark").unwrap();
    let mut agent = Agent::start_in(dirs, EngineKind::Sync).await;
    let h = agent.client.health(api::HealthRequest {}).await.unwrap();
    assert_eq!(
        h.into_inner().state(),
        api::health_response::State::WaitingForResync
    );
    agent.stop().await;
}
