//! ListVolumes and ListSnapshots in pages while entries come and go (issue 22, defect 14):
//! a page token names the last entry returned, so an entry deleted (or, for a snapshot, marked
//! deleting) between two pages never shifts the next page past one that existed the whole time.

#![allow(clippy::unwrap_used)]

mod support;

use pillar_csi::csi;
use pillar_state::store::Revision;
use support::{Env, Mode, StoreKind, create, delete};
use tonic::Code;

const STORES: [StoreKind; 2] = [StoreKind::Embedded, StoreKind::Kube];

fn volume_ids(r: &csi::ListVolumesResponse) -> Vec<String> {
    r.entries
        .iter()
        .map(|e| e.volume.as_ref().unwrap().volume_id.clone())
        .collect()
}

fn snapshot_ids(r: &csi::ListSnapshotsResponse) -> Vec<String> {
    r.entries
        .iter()
        .map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone())
        .collect()
}

async fn volume_page(env: &mut Env, token: &str, max: i32) -> csi::ListVolumesResponse {
    env.client
        .list_volumes(csi::ListVolumesRequest {
            max_entries: max,
            starting_token: token.into(),
        })
        .await
        .unwrap()
        .into_inner()
}

async fn snapshot_page(env: &mut Env, token: &str, max: i32) -> csi::ListSnapshotsResponse {
    env.client
        .list_snapshots(csi::ListSnapshotsRequest {
            max_entries: max,
            starting_token: token.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

// CSI ListVolumes and ListSnapshots pages (issue 22, defect 14): the volume returned last is
// deleted before the next page is asked for, and an entry not yet returned is created: the
// next page starts with the entry after the deleted one. On the old code the token was an
// index, and the page after it skipped "vb", which existed the whole time.
#[tokio::test]
async fn a_deleted_volume_never_shifts_the_next_page() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        for v in ["va", "vb", "vc"] {
            env.client
                .create_volume(create(v, Mode::SingleNodeWriter))
                .await
                .unwrap();
        }
        let first = volume_page(&mut env, "", 1).await;
        assert_eq!(volume_ids(&first), ["va"], "{kind:?}");
        env.client.delete_volume(delete("va")).await.unwrap();
        let second = volume_page(&mut env, &first.next_token, 1).await;
        assert_eq!(
            volume_ids(&second),
            ["vb"],
            "{kind:?}: an entry was skipped"
        );
        // An entry created behind the token is not returned; one ahead of it is.
        for v in ["v0", "vd"] {
            env.client
                .create_volume(create(v, Mode::SingleNodeWriter))
                .await
                .unwrap();
        }
        env.client.delete_volume(delete("vb")).await.unwrap();
        let rest = volume_page(&mut env, &second.next_token, 0).await;
        assert_eq!(volume_ids(&rest), ["vc", "vd"], "{kind:?}");
        assert!(rest.next_token.is_empty(), "{kind:?}");
        // A token this controller never issued is still ABORTED, as CSI asks.
        for bad in ["1", "zz", "after:", "after:Not An ID"] {
            let s = env
                .client
                .list_volumes(csi::ListVolumesRequest {
                    max_entries: 0,
                    starting_token: bad.into(),
                })
                .await
                .unwrap_err();
            assert_eq!(s.code(), Code::Aborted, "{kind:?}: {bad:?}: {s:?}");
        }
    }
}

// The same for ListSnapshots (issue 22, defect 14): a snapshot returned on a page is deleted,
// another one marked deleting (a DeleteSnapshot in progress) before the next page; the next
// page starts right after the last one returned. On the old code the index token skipped
// "sc" and "sd".
#[tokio::test]
async fn a_deleted_or_deleting_snapshot_never_shifts_the_next_page() {
    for kind in STORES {
        let mut env = Env::start(kind, true).await;
        env.client
            .create_volume(create("src", Mode::SingleNodeWriter))
            .await
            .unwrap();
        for s in ["sa", "sb", "sc", "sd"] {
            env.client
                .create_snapshot(csi::CreateSnapshotRequest {
                    source_volume_id: "src".into(),
                    name: s.into(),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        let first = snapshot_page(&mut env, "", 2).await;
        assert_eq!(snapshot_ids(&first), ["sa", "sb"], "{kind:?}");
        env.client
            .delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: "sa".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        // "sb" is being deleted by another replica: marked, not gone.
        let sb = env.store.get_snapshot("sb").await.unwrap().unwrap();
        let mut status = sb.status_or_default();
        status.deleting = true;
        env.store
            .replace_snapshot_status("sb", &Revision::of(&sb).unwrap(), status)
            .await
            .unwrap();
        let second = snapshot_page(&mut env, &first.next_token, 1).await;
        assert_eq!(
            snapshot_ids(&second),
            ["sc"],
            "{kind:?}: an entry was skipped"
        );
        assert!(!second.next_token.is_empty(), "{kind:?}");
        let rest = snapshot_page(&mut env, &second.next_token, 5).await;
        assert_eq!(snapshot_ids(&rest), ["sd"], "{kind:?}");
        assert!(rest.next_token.is_empty(), "{kind:?}");
        for bad in ["2", "not-a-token", "after:"] {
            let s = env
                .client
                .list_snapshots(csi::ListSnapshotsRequest {
                    starting_token: bad.into(),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert_eq!(s.code(), Code::Aborted, "{kind:?}: {bad:?}: {s:?}");
        }
    }
}
