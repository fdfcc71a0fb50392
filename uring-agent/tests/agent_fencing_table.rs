//! F1 as a table: every agent call that changes a volume, with every kind of bad fencing token,
//! through the real gRPC server, once per engine. Each is refused with FAILED_PRECONDITION and
//! the reason of its token, and nothing changed: the marks, the configfs double and the backend
//! pool are byte-identical before and after.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pillar_agent_api::v1 as api;
use pillar_agent_api::{ErrorReason, reason_of};
use support::{Agent, ENGINES, MIB, create_req, export_req, host, token};
use tonic::Code;

const VOLUME: &str = "vol-f1";

/// The bad tokens, against a mark owned by "u1" at generation 10 with "u0" retired.
fn bad_tokens() -> Vec<(&'static str, Option<api::FencingToken>, ErrorReason)> {
    vec![
        ("missing", None, ErrorReason::NoToken),
        (
            "older generation",
            token("u1", 9),
            ErrorReason::StaleGeneration,
        ),
        (
            "foreign lifecycle",
            token("u-other", 100),
            ErrorReason::ForeignOwner,
        ),
        (
            "retired lifecycle",
            token("u0", 100),
            ErrorReason::RetiredLifecycle,
        ),
        // A token without a lifecycle UID names no lifecycle: it is no token.
        ("malformed (no UID)", token("", 100), ErrorReason::NoToken),
    ]
}

/// Every mutating RPC of the agent API, each a request that would change the volume if its token
/// were good (grow it, change its ACL, remove it...).
#[derive(Clone, Copy, Debug)]
enum Call {
    Create,
    Expand,
    Delete,
    Export,
    Unexport,
    Grant,
    Revoke,
    Resync,
}

const CALLS: [Call; 8] = [
    Call::Create,
    Call::Expand,
    Call::Delete,
    Call::Export,
    Call::Unexport,
    Call::Grant,
    Call::Revoke,
    Call::Resync,
];

/// Sends `call` with `tok`; the refusal as (code, reason).
async fn send(a: &mut Agent, call: Call, tok: Option<api::FencingToken>) -> (Code, ErrorReason) {
    let c = &mut a.client;
    let result = match call {
        Call::Create => {
            let mut r = create_req("x", 0, VOLUME, 16 * MIB);
            r.token = tok;
            c.create_volume(r).await.map(drop)
        }
        Call::Expand => c
            .expand_volume(api::ExpandVolumeRequest {
                token: tok,
                volume_id: VOLUME.into(),
                pool: "p1".into(),
                size_bytes: 32 * MIB,
            })
            .await
            .map(drop),
        Call::Delete => c
            .delete_volume(api::DeleteVolumeRequest {
                token: tok,
                volume_id: VOLUME.into(),
                pool: "p1".into(),
            })
            .await
            .map(drop),
        Call::Export => {
            let mut r = export_req("x", 0, VOLUME, true, &[1, 3]);
            r.token = tok;
            c.export(r).await.map(drop)
        }
        Call::Unexport => c
            .unexport(api::UnexportRequest {
                token: tok,
                volume_id: VOLUME.into(),
            })
            .await
            .map(drop),
        Call::Grant => c
            .grant_initiator(api::GrantInitiatorRequest {
                token: tok,
                volume_id: VOLUME.into(),
                host_nqn: host(3),
                credentials: None,
            })
            .await
            .map(drop),
        Call::Revoke => c
            .revoke_initiator(api::RevokeInitiatorRequest {
                token: tok,
                volume_id: VOLUME.into(),
                host_nqn: host(1),
            })
            .await
            .map(drop),
        Call::Resync => {
            // A resync answers per volume; its refusal is that volume's result.
            let mut r = export_req("x", 0, VOLUME, true, &[3]);
            r.token = tok;
            let resp = c
                .resync_exports(api::ResyncExportsRequest {
                    exports: vec![r],
                    ..Default::default()
                })
                .await
                .expect("a resync answers per volume")
                .into_inner();
            let [result] = resp.results.as_slice() else {
                panic!("one result per listed volume: {resp:?}");
            };
            assert!(!result.ok, "{result:?}");
            assert_eq!(result.volume_id, VOLUME);
            assert_eq!(result.code, "FailedPrecondition", "{result:?}");
            return (
                Code::FailedPrecondition,
                ErrorReason::try_from(result.reason).unwrap_or(ErrorReason::Unspecified),
            );
        }
    };
    let status = result.expect_err("a bad token must be refused");
    (status.code(), reason_of(&status))
}

// proves F1, F6 (and F5: the check comes before any change): every mutating call x every bad
// token is refused with FAILED_PRECONDITION and the token's reason, with both engines, and the
// marks, the configfs tree and the backend are byte-identical afterwards.
#[tokio::test]
async fn every_mutating_call_with_every_bad_token_is_refused_and_changes_nothing() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        // A mark owned by u1 at generation 10, with u0's ended lifecycle retired, and a live
        // export admitting host 1.
        let c = &mut a.client;
        c.create_volume(create_req("u0", 1, VOLUME, 16 * MIB))
            .await
            .unwrap();
        c.delete_volume(api::DeleteVolumeRequest {
            token: token("u0", 2),
            volume_id: VOLUME.into(),
            pool: "p1".into(),
        })
        .await
        .unwrap();
        c.create_volume(create_req("u1", 1, VOLUME, 16 * MIB))
            .await
            .unwrap();
        c.export(export_req("u1", 2, VOLUME, true, &[1]))
            .await
            .unwrap();
        c.grant_initiator(api::GrantInitiatorRequest {
            token: token("u1", 10),
            volume_id: VOLUME.into(),
            host_nqn: host(2),
            credentials: None,
        })
        .await
        .unwrap();
        let before = a.snapshot();
        let mut rows = 0;
        for call in CALLS {
            for (what, tok, reason) in bad_tokens() {
                let got = send(&mut a, call, tok).await;
                assert_eq!(
                    got,
                    (Code::FailedPrecondition, reason),
                    "{engine:?} {call:?} with {what} token"
                );
                let after = a.snapshot();
                assert!(
                    before == after,
                    "{engine:?} {call:?} with {what} token changed something"
                );
                rows += 1;
            }
        }
        assert_eq!(rows, CALLS.len() * bad_tokens().len());
        // The good token still works: the table refused on the token, not on something else.
        let c = &mut a.client;
        c.unexport(api::UnexportRequest {
            token: token("u1", 11),
            volume_id: VOLUME.into(),
        })
        .await
        .unwrap();
        c.delete_volume(api::DeleteVolumeRequest {
            token: token("u1", 12),
            volume_id: VOLUME.into(),
            pool: "p1".into(),
        })
        .await
        .unwrap();
    }
}
