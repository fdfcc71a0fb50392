//! TLS for NVMe/TCP at the agent, through the real gRPC server on the configfs double, once per
//! engine: an export that requires TLS is refused where the kernel has none (TLS_UNSUPPORTED,
//! FAILED_PRECONDITION), with nothing applied; TLS without authentication is a bad request;
//! where the kernel has it the export's port speaks TLS 1.3 only, a grant puts the host's PSK
//! (derived from its DH-HMAC-CHAP secret, as the node derives it) in the keyring before the
//! host is admitted, a revoke and an unexport take it away.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::{Path, PathBuf};

use pillar_agent::EngineKind;
use pillar_agent_api::v1 as api;
use pillar_agent_api::{ErrorReason, reason_of};
use pillar_nvmet::{ConfigfsDouble, DhchapSecret, HostNqn, TlsPsk, VolumeId};
use support::{Agent, Dirs, ENGINES, MIB, create_req, host, token};
use tonic::Code;

fn export(uid: &str, generation: u64, volume: &str) -> api::ExportRequest {
    api::ExportRequest {
        token: token(uid, generation),
        volume_id: volume.into(),
        pool: "p1".into(),
        protocol: Some(api::ExportProtocol {
            service: 4420,
            acl: true,
            auth_none: false,
            tls: true,
        }),
        allowed_host_nqns: vec![],
        credentials: vec![],
    }
}

fn grant(
    uid: &str,
    generation: u64,
    volume: &str,
    secret: &DhchapSecret,
) -> api::GrantInitiatorRequest {
    api::GrantInitiatorRequest {
        token: token(uid, generation),
        volume_id: volume.into(),
        host_nqn: host(1),
        credentials: Some(api::HostCredentials {
            host_nqn: host(1),
            dhchap_secret: secret.expose().to_owned(),
            dhchap_ctrl_secret: String::new(),
            hash: String::new(),
            dhgroup: String::new(),
        }),
    }
}

/// An agent on `engine`, serving, with volume v1 created (u1, generation 1) and exported
/// (generation 2); and its configfs root.
async fn exported_v1(engine: EngineKind) -> (Agent, PathBuf) {
    let mut a = Agent::start(engine).await;
    a.serve_now().await;
    let configfs = a.dirs.configfs();
    a.client
        .create_volume(create_req("u1", 1, "v1", 8 * MIB))
        .await
        .unwrap();
    a.client.export(export("u1", 2, "v1")).await.unwrap();
    (a, configfs)
}

fn port_attr(configfs: &Path, attr: &str) -> String {
    std::fs::read_to_string(configfs.join("ports/4420").join(attr))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// The double's stand-in keyring: identity -> key in hex.
fn keyring(configfs: &Path) -> Vec<(String, String)> {
    let dir = configfs.join(".double/keyring");
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .map(|d| {
            d.map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read_to_string(e.path()).unwrap(),
                )
            })
            .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

#[tokio::test]
async fn an_export_that_requires_tls_is_refused_where_the_kernel_has_none() {
    for engine in ENGINES {
        let dirs = Dirs::new();
        let _ = ConfigfsDouble::create(dirs.configfs())
            .unwrap()
            .without_tls();
        let mut a = Agent::start_in(dirs, engine).await;
        a.serve_now().await;
        a.client
            .create_volume(create_req("u1", 1, "v1", 8 * MIB))
            .await
            .unwrap();
        let before = a.snapshot();
        let refused = a
            .client
            .export(export("u1", 2, "v1"))
            .await
            .expect_err("refused without kernel TLS");
        assert_eq!(refused.code(), Code::FailedPrecondition, "{engine:?}");
        assert_eq!(reason_of(&refused), ErrorReason::TlsUnsupported);
        assert!(
            refused.message().contains("tls: none"),
            "{}",
            refused.message()
        );
        // Nothing applied: no subsystem, no port (the probe port is gone), the mark unchanged.
        assert_eq!(a.snapshot(), before, "{engine:?}");
        // Without TLS the same export is served.
        let mut plain = export("u1", 3, "v1");
        plain.protocol.as_mut().unwrap().tls = false;
        a.client.export(plain).await.unwrap();
    }
}

#[tokio::test]
async fn tls_without_authentication_is_a_bad_request() {
    let mut a = Agent::start(ENGINES[0]).await;
    a.serve_now().await;
    a.client
        .create_volume(create_req("u1", 1, "v1", 8 * MIB))
        .await
        .unwrap();
    for (acl, auth_none) in [(true, true), (false, false)] {
        let mut req = export("u1", 2, "v1");
        let p = req.protocol.as_mut().unwrap();
        p.acl = acl;
        p.auth_none = auth_none;
        let refused = a.client.export(req).await.expect_err("TLS needs auth");
        assert_eq!(
            refused.code(),
            Code::InvalidArgument,
            "{}",
            refused.message()
        );
    }
}

#[tokio::test]
async fn a_tls_export_speaks_tls_only_and_its_hosts_psks_follow_their_admission() {
    for engine in ENGINES {
        let (mut a, configfs) = exported_v1(engine).await;
        assert_eq!(port_attr(&configfs, "addr_tsas"), "tls1.3", "{engine:?}");
        assert_eq!(port_attr(&configfs, "addr_treq"), "required");
        // The probe port was removed again.
        assert!(!configfs.join("ports/65535").exists());
        assert!(keyring(&configfs).is_empty(), "no host admitted, no PSK");
        let secret = DhchapSecret::generate().unwrap();
        a.client
            .grant_initiator(grant("u1", 3, "v1", &secret))
            .await
            .unwrap();
        let h = HostNqn::parse(&host(1)).unwrap();
        let nqn = VolumeId::parse("v1").unwrap().subsystem_nqn();
        // The node derives the same PSK from the same secret (csi node `stage_tls`).
        let psk = TlsPsk::derive(&secret, &h, &nqn);
        assert_eq!(
            keyring(&configfs),
            vec![(psk.identity().to_owned(), psk.key_hex())],
            "{engine:?}"
        );
        a.client
            .revoke_initiator(api::RevokeInitiatorRequest {
                token: token("u1", 4),
                volume_id: "v1".into(),
                host_nqn: host(1),
            })
            .await
            .unwrap();
        assert!(keyring(&configfs).is_empty(), "the revoke removed the PSK");
        a.client
            .grant_initiator(grant("u1", 5, "v1", &secret))
            .await
            .unwrap();
        assert_eq!(keyring(&configfs).len(), 1);
        a.client
            .unexport(api::UnexportRequest {
                token: token("u1", 6),
                volume_id: "v1".into(),
            })
            .await
            .unwrap();
        assert!(
            keyring(&configfs).is_empty(),
            "the unexport removed the PSK"
        );
        assert!(!configfs.join("ports/4420").exists());
    }
}

/// 65535 is a valid service, and the probe port's ID: an export on it is never written to or
/// removed by the probe, and a TLS export elsewhere is still served (the probe used to write
/// `addr_trtype` to that live port and then try to remove it, failing the TLS export).
#[tokio::test]
async fn the_tls_probe_leaves_an_export_on_its_port_id_alone() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let configfs = a.dirs.configfs();
        for (uid, volume) in [("u1", "v1"), ("u2", "v2")] {
            a.client
                .create_volume(create_req(uid, 1, volume, 8 * MIB))
                .await
                .unwrap();
        }
        let mut plain = export("u1", 2, "v1");
        let protocol = plain.protocol.as_mut().unwrap();
        protocol.service = 65535;
        protocol.tls = false;
        a.client.export(plain).await.unwrap();
        let v1 = VolumeId::parse("v1").unwrap().subsystem_nqn();
        let link = configfs.join("ports/65535/subsystems").join(v1.as_str());
        assert!(link.exists(), "{engine:?}");
        a.client
            .export(export("u2", 2, "v2"))
            .await
            .expect("a TLS export beside an export on port 65535");
        assert!(
            link.exists(),
            "the probe left port 65535 alone ({engine:?})"
        );
        assert_eq!(port_attr(&configfs, "addr_tsas"), "tls1.3", "{engine:?}");
    }
}

/// A grant's PSK goes into the keyring only once the grant passed its fence: a delayed grant
/// from before a revoke is refused and installs nothing (it used to install the key before the
/// fence check refused it). proves F5, F6
#[tokio::test]
async fn a_stale_grant_installs_no_psk() {
    for engine in ENGINES {
        let (mut a, configfs) = exported_v1(engine).await;
        let secret = DhchapSecret::generate().unwrap();
        a.client
            .grant_initiator(grant("u1", 3, "v1", &secret))
            .await
            .unwrap();
        a.client
            .revoke_initiator(api::RevokeInitiatorRequest {
                token: token("u1", 4),
                volume_id: "v1".into(),
                host_nqn: host(1),
            })
            .await
            .unwrap();
        assert!(keyring(&configfs).is_empty(), "{engine:?}");
        let stale = a
            .client
            .grant_initiator(grant("u1", 3, "v1", &secret))
            .await
            .expect_err("a grant older than the revoke is refused");
        assert_eq!(
            stale.code(),
            Code::FailedPrecondition,
            "{}",
            stale.message()
        );
        assert!(
            keyring(&configfs).is_empty(),
            "the stale grant installed a PSK ({engine:?})"
        );
    }
}
