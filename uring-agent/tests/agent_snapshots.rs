//! Snapshots, restores and clones through the agent's real gRPC server (file backend on real
//! loop devices, configfs double): content, sizes, fencing by the snapshot's own token, the
//! source's lifecycle, and the refusal to copy a volume in use where the pool cannot reflink.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use pillar_agent::backend::copy::reflink_supported;
use pillar_agent_api::v1 as api;
use pillar_agent_api::{ErrorReason, reason_of};
use support::{Agent, ENGINES, MIB, code, create_req, export_req, token};
use tonic::Code;

fn snap(
    uid: &str,
    generation: u64,
    id: &str,
    source: &str,
    source_uid: &str,
) -> api::CreateSnapshotRequest {
    api::CreateSnapshotRequest {
        token: token(uid, generation),
        snapshot_id: id.into(),
        pool: "p1".into(),
        source_volume_id: source.into(),
        source_lifecycle_uid: source_uid.into(),
    }
}

fn delete_snap(uid: &str, generation: u64, id: &str) -> api::DeleteSnapshotRequest {
    api::DeleteSnapshotRequest {
        token: token(uid, generation),
        snapshot_id: id.into(),
        pool: "p1".into(),
    }
}

fn from_snapshot(
    uid: &str,
    volume: &str,
    size: u64,
    snapshot: &str,
    snapshot_uid: &str,
) -> api::CreateVolumeRequest {
    api::CreateVolumeRequest {
        source: Some(api::ContentSource {
            source: Some(api::content_source::Source::SnapshotId(snapshot.into())),
            lifecycle_uid: snapshot_uid.into(),
        }),
        ..create_req(uid, 1, volume, size)
    }
}

fn from_volume(
    uid: &str,
    volume: &str,
    size: u64,
    source: &str,
    source_uid: &str,
) -> api::CreateVolumeRequest {
    api::CreateVolumeRequest {
        source: Some(api::ContentSource {
            source: Some(api::content_source::Source::VolumeId(source.into())),
            lifecycle_uid: source_uid.into(),
        }),
        ..create_req(uid, 1, volume, size)
    }
}

fn write_at(pool: &Path, volume: &str, offset: u64, byte: u8) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(pool.join(format!("{volume}.img")))
        .unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&[byte; 4096]).unwrap();
    f.sync_all().unwrap();
}

fn read_at(pool: &Path, volume: &str, offset: u64) -> Vec<u8> {
    let mut f = std::fs::File::open(pool.join(format!("{volume}.img"))).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut b = vec![0; 4096];
    f.read_exact(&mut b).unwrap();
    b
}

fn reason<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> (Code, ErrorReason) {
    let s = r.expect_err("the call must fail");
    (s.code(), reason_of(&s))
}

// proves F5, F6, F10 for snapshots (own token, own marks), and that a restore or clone is a
// new volume holding the source's content at the time of the cut
#[tokio::test]
async fn snapshots_restores_and_clones_hold_the_content_of_their_moment_and_are_fenced() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let pool = a.dirs.pool();
        let c = &mut a.client;
        c.create_volume(create_req("u-v1", 1, "v1", 4 * MIB))
            .await
            .unwrap();
        write_at(&pool, "v1", 0, 0xa1);
        write_at(&pool, "v1", 3 * MIB, 0xa2);

        // No token, a wrong source lifecycle, an unknown source: refused, nothing cut.
        assert_eq!(
            code(c.create_snapshot(snap("", 1, "s1", "v1", "u-v1")).await),
            Code::FailedPrecondition
        );
        assert_eq!(
            reason(
                c.create_snapshot(snap("u-s1", 1, "s1", "v1", "u-v1-old"))
                    .await
            ),
            (Code::FailedPrecondition, ErrorReason::SourceNotLive)
        );
        assert_eq!(
            reason(
                c.create_snapshot(snap("u-s1", 1, "s1", "nope", "u-nope"))
                    .await
            ),
            (Code::FailedPrecondition, ErrorReason::SourceNotLive)
        );
        assert!(!pool.join(".snapshots/s1.img").exists());

        let first = c
            .create_snapshot(snap("u-s1", 1, "s1", "v1", "u-v1"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(first.size_bytes, 4 * MIB);
        let expected = if reflink_supported(&pool).unwrap() {
            "reflink"
        } else {
            "sparse-copy"
        };
        assert_eq!(first.method, expected);
        // A retry: the same snapshot, the same time, nothing made.
        let again = c
            .create_snapshot(snap("u-s1", 1, "s1", "v1", "u-v1"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (
                again.size_bytes,
                again.creation_unix_seconds,
                again.creation_nanos,
                again.method.as_str()
            ),
            (
                first.size_bytes,
                first.creation_unix_seconds,
                first.creation_nanos,
                ""
            )
        );
        // A retry with a newer token moves the snapshot's mark on: an older one is then stale.
        c.create_snapshot(snap("u-s1", 2, "s1", "v1", "u-v1"))
            .await
            .unwrap();
        assert_eq!(
            reason(c.delete_snapshot(delete_snap("u-s1", 1, "s1")).await),
            (Code::FailedPrecondition, ErrorReason::StaleGeneration)
        );
        // A snapshot ID equal to a volume ID has marks of its own.
        c.create_snapshot(snap("u-snap-v1", 1, "v1", "v1", "u-v1"))
            .await
            .unwrap();

        // The volume moves on after the cut.
        write_at(&pool, "v1", 0, 0xb1);

        // Restore, larger than the source: the content of the cut, then zeros.
        let restored = c
            .create_volume(from_snapshot("u-v2", "v2", 8 * MIB, "s1", "u-s1"))
            .await
            .unwrap();
        assert_eq!(restored.into_inner().size_bytes, 8 * MIB);
        assert_eq!(read_at(&pool, "v2", 0), vec![0xa1; 4096]);
        assert_eq!(read_at(&pool, "v2", 3 * MIB), vec![0xa2; 4096]);
        assert_eq!(read_at(&pool, "v2", 6 * MIB), vec![0; 4096]);
        // Smaller than the source: OUT_OF_RANGE, nothing made.
        assert_eq!(
            reason(
                c.create_volume(from_snapshot("u-v3", "v3", 2 * MIB, "s1", "u-s1"))
                    .await
            ),
            (Code::OutOfRange, ErrorReason::SizeOutOfRange)
        );
        assert!(!pool.join("v3.img").exists());
        // Clone: the volume as it is now.
        c.create_volume(from_volume("u-v4", "v4", 4 * MIB, "v1", "u-v1"))
            .await
            .unwrap();
        assert_eq!(read_at(&pool, "v4", 0), vec![0xb1; 4096]);
        assert_eq!(
            code(
                c.create_volume(from_volume("u-v1", "v1", 4 * MIB, "v1", "u-v1"))
                    .await
            ),
            Code::InvalidArgument
        );

        // The snapshot's own token: an older generation is refused; delete ends it.
        c.delete_snapshot(delete_snap("u-s1", 3, "s1"))
            .await
            .unwrap();
        assert!(!pool.join(".snapshots/s1.img").exists());
        assert_eq!(
            reason(c.delete_snapshot(delete_snap("u-s1", 2, "s1")).await),
            (Code::FailedPrecondition, ErrorReason::StaleGeneration)
        );
        c.delete_snapshot(delete_snap("u-s1", 3, "s1"))
            .await
            .unwrap();
        // A deleted snapshot restores nothing, even named with its old lifecycle.
        assert_eq!(
            reason(
                c.create_volume(from_snapshot("u-v5", "v5", 4 * MIB, "s1", "u-s1"))
                    .await
            ),
            (Code::FailedPrecondition, ErrorReason::SourceNotLive)
        );
        assert!(!pool.join("v5.img").exists());
        // A new lifecycle of the same snapshot ID takes over; the old one is retired.
        c.create_snapshot(snap("u-s1-new", 1, "s1", "v1", "u-v1"))
            .await
            .unwrap();
        assert_eq!(
            reason(c.delete_snapshot(delete_snap("u-s1", 9, "s1")).await),
            (Code::FailedPrecondition, ErrorReason::RetiredLifecycle)
        );
        drop(a);
    }
}

// proves the copy rule: where the pool cannot reflink, a volume a host may be writing (its
// namespace enabled) is not copied; once no host is admitted it is
#[tokio::test]
async fn a_volume_in_use_is_not_copied_where_the_pool_cannot_reflink() {
    let mut a = Agent::start(support::ENGINES[0]).await;
    a.serve_now().await;
    let pool = a.dirs.pool();
    if reflink_supported(&pool).unwrap() {
        // A reflink is one point in time even of a volume being written: nothing to refuse.
        eprintln!("skipped: the test directory's file system reflinks");
        return;
    }
    let c = &mut a.client;
    c.create_volume(create_req("u-v1", 1, "v1", 4 * MIB))
        .await
        .unwrap();
    c.export(export_req("u-v1", 2, "v1", true, &[1]))
        .await
        .unwrap();
    assert_eq!(
        reason(c.create_snapshot(snap("u-s1", 1, "s1", "v1", "u-v1")).await),
        (Code::FailedPrecondition, ErrorReason::SourceInUse)
    );
    assert_eq!(
        reason(
            c.create_volume(from_volume("u-v2", "v2", 4 * MIB, "v1", "u-v1"))
                .await
        ),
        (Code::FailedPrecondition, ErrorReason::SourceInUse)
    );
    assert!(!pool.join(".snapshots/s1.img").exists() && !pool.join("v2.img").exists());
    // The last host revoked: the namespace is disabled (W7), nobody can write.
    c.revoke_initiator(api::RevokeInitiatorRequest {
        token: token("u-v1", 3),
        volume_id: "v1".into(),
        host_nqn: support::host(1),
    })
    .await
    .unwrap();
    c.create_snapshot(snap("u-s1", 1, "s1", "v1", "u-v1"))
        .await
        .unwrap();
    c.create_volume(from_volume("u-v2", "v2", 4 * MIB, "v1", "u-v1"))
        .await
        .unwrap();
}
