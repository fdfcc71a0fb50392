//! NVMe in-band authentication at the agent (W10), through the real gRPC server on the configfs
//! double, once per engine: an export that requires authentication is refused where the kernel
//! has none, with nothing applied; a grant needs the host's credentials and writes them before
//! the host is linked; only the keyed host connects; a grant with new credentials rotates them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pillar_agent_api::v1 as api;
use pillar_agent_api::{ErrorReason, reason_of};
use pillar_nvmet::{ConfigfsDouble, DhchapSecret, Op, VolumeId};
use support::{Agent, Dirs, ENGINES, MIB, code, create_req, host, token};
use tonic::Code;

fn nqn(volume: &str) -> String {
    VolumeId::parse(volume).unwrap().subsystem_nqn().to_string()
}

fn export(uid: &str, generation: u64, volume: &str) -> api::ExportRequest {
    api::ExportRequest {
        token: token(uid, generation),
        volume_id: volume.into(),
        pool: "p1".into(),
        protocol: Some(api::ExportProtocol {
            service: 4420,
            acl: true,
            auth_none: false,
            tls: false,
        }),
        allowed_host_nqns: vec![],
        credentials: vec![],
    }
}

fn creds(h: u32, secret: &DhchapSecret) -> api::HostCredentials {
    api::HostCredentials {
        host_nqn: host(h),
        dhchap_secret: secret.expose().to_owned(),
        dhchap_ctrl_secret: DhchapSecret::generate().unwrap().expose().to_owned(),
        hash: String::new(),
        dhgroup: String::new(),
    }
}

fn grant(
    uid: &str,
    generation: u64,
    volume: &str,
    h: u32,
    c: Option<api::HostCredentials>,
) -> api::GrantInitiatorRequest {
    api::GrantInitiatorRequest {
        token: token(uid, generation),
        volume_id: volume.into(),
        host_nqn: host(h),
        credentials: c,
    }
}

// proves W10
#[tokio::test]
async fn an_export_that_requires_auth_is_refused_where_the_kernel_has_none() {
    for engine in ENGINES {
        let dirs = Dirs::new();
        let _ = ConfigfsDouble::create(dirs.configfs())
            .unwrap()
            .without_auth();
        let mut a = Agent::start_in(dirs, engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        c.create_volume(create_req("u1", 1, "v1", 8 * MIB))
            .await
            .unwrap();
        let before = a.snapshot();
        let refused = a
            .client
            .export(export("u1", 2, "v1"))
            .await
            .expect_err("refused without kernel authentication");
        assert_eq!(refused.code(), Code::FailedPrecondition, "{engine:?}");
        assert_eq!(reason_of(&refused), ErrorReason::AuthUnsupported);
        assert!(
            refused.message().contains("auth: none"),
            "{}",
            refused.message()
        );
        // Nothing applied: no subsystem, no host entry, the mark unchanged.
        assert_eq!(a.snapshot(), before, "{engine:?}");
        // Opting out serves it.
        let mut none = export("u1", 3, "v1");
        none.protocol.as_mut().unwrap().auth_none = true;
        a.client.export(none).await.unwrap();
        a.client
            .grant_initiator(grant("u1", 4, "v1", 1, None))
            .await
            .unwrap();
        let double = ConfigfsDouble::create(a.dirs.configfs()).unwrap();
        double.host_connects(&nqn("v1"), &host(1), 4420).unwrap();
    }
}

// proves W10
#[tokio::test]
async fn a_grant_writes_the_keys_before_the_link_and_only_the_keyed_host_connects() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        c.create_volume(create_req("u1", 1, "v1", 8 * MIB))
            .await
            .unwrap();
        c.export(export("u1", 2, "v1")).await.unwrap();
        // An export naming a host without its credentials: refused at the edge.
        let mut bare = export("u1", 3, "v1");
        bare.allowed_host_nqns = vec![host(1)];
        assert_eq!(code(c.export(bare).await), Code::InvalidArgument);
        // A grant without credentials: refused, nothing linked.
        let before = a.snapshot();
        let refused = a
            .client
            .grant_initiator(grant("u1", 4, "v1", 1, None))
            .await
            .expect_err("a grant without credentials");
        assert_eq!(refused.code(), Code::InvalidArgument, "{engine:?}");
        assert_eq!(a.snapshot().2, before.2, "configfs unchanged");
        // A malformed secret: refused, and the message does not echo it.
        let mut bad = creds(1, &DhchapSecret::generate().unwrap());
        bad.dhchap_secret = "DHHC-1:00:c2VjcmV0LXRleHQ=:".into();
        let refused = a
            .client
            .grant_initiator(grant("u1", 5, "v1", 1, Some(bad)))
            .await
            .expect_err("a malformed secret");
        assert_eq!(refused.code(), Code::InvalidArgument);
        assert!(
            !refused.message().contains("c2VjcmV0"),
            "{}",
            refused.message()
        );

        let secret = DhchapSecret::generate().unwrap();
        let double = ConfigfsDouble::create(a.dirs.configfs()).unwrap();
        double.record_ops().unwrap();
        a.client
            .grant_initiator(grant("u1", 6, "v1", 1, Some(creds(1, &secret))))
            .await
            .unwrap();
        let ops = double.recorded_ops().unwrap();
        let key = ops
            .iter()
            .position(|op| matches!(op, Op::Write { path, .. } if path.ends_with("dhchap_key")))
            .expect("the host key written");
        let link = ops
            .iter()
            .position(|op| matches!(op, Op::Symlink { .. }))
            .expect("the host linked");
        assert!(key < link, "{engine:?}: keys before the link: {ops:?}");
        let n = nqn("v1");
        assert!(double.host_connects(&n, &host(1), 4420).is_err());
        let wrong = DhchapSecret::generate().unwrap();
        assert!(
            double
                .host_connects_with_secret(&n, &host(1), 4420, Some(wrong.expose()))
                .is_err()
        );
        double
            .host_connects_with_secret(&n, &host(1), 4420, Some(secret.expose()))
            .unwrap();

        // Rotation: a grant with new credentials replaces the keys, the link stays.
        let rotated = DhchapSecret::generate().unwrap();
        a.client
            .grant_initiator(grant("u1", 7, "v1", 1, Some(creds(1, &rotated))))
            .await
            .unwrap();
        assert!(
            double
                .host_connects_with_secret(&n, &host(1), 4420, Some(secret.expose()))
                .is_err(),
            "the old secret no longer connects"
        );
        double
            .host_connects_with_secret(&n, &host(1), 4420, Some(rotated.expose()))
            .unwrap();
        // A resync carries the credentials of every admitted host.
        let mut resync = export("u1", 8, "v1");
        resync.allowed_host_nqns = vec![host(1)];
        resync.credentials = vec![creds(1, &rotated)];
        a.client.export(resync).await.unwrap();
        double
            .host_connects_with_secret(&n, &host(1), 4420, Some(rotated.expose()))
            .unwrap();
    }
}
