//! The agent through its real gRPC server on a unix socket, with the file backend on real loop
//! devices and the configfs test double, once per engine (io_uring and sync).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pillar_agent_api::v1 as api;
use pillar_agent_api::{ErrorReason, reason_of};
use pillar_nvmet::{NamespaceId, NamespaceIdentity, VolumeId, derive_serial, observe};
use support::{Agent, ENGINES, MIB, code, create_req, export_req, host, token};
use tonic::Code;

fn nqn(volume: &str) -> String {
    VolumeId::parse(volume).unwrap().subsystem_nqn().to_string()
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

fn unexport(uid: &str, generation: u64, volume: &str) -> api::UnexportRequest {
    api::UnexportRequest {
        token: token(uid, generation),
        volume_id: volume.into(),
    }
}

fn delete(uid: &str, generation: u64, volume: &str) -> api::DeleteVolumeRequest {
    api::DeleteVolumeRequest {
        token: token(uid, generation),
        volume_id: volume.into(),
        pool: "p1".into(),
    }
}

// proves F1, F6: every token rule, through gRPC, with both engines.
#[tokio::test]
async fn every_token_rule_is_enforced() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;

        // No token.
        let mut no_token = create_req("u1", 1, "vol-a", 16 * MIB);
        no_token.token = None;
        let status = c.create_volume(no_token).await.unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition, "{engine:?}");
        assert_eq!(reason_of(&status), ErrorReason::NoToken);
        assert!(
            status.message().contains("no fencing token"),
            "{}",
            status.message()
        );

        c.create_volume(create_req("u1", 5, "vol-a", 16 * MIB))
            .await
            .unwrap();
        // An equal generation is a retry: idempotent.
        c.create_volume(create_req("u1", 5, "vol-a", 16 * MIB))
            .await
            .unwrap();
        // Lower generation.
        let status = c
            .export(export_req("u1", 4, "vol-a", true, &[]))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert_eq!(reason_of(&status), ErrorReason::StaleGeneration);
        assert!(
            status
                .message()
                .contains("generation 4 is older than generation 5"),
            "{}",
            status.message()
        );
        // Another UID while u1 is live.
        let status = c
            .create_volume(create_req("u2", 9, "vol-a", 16 * MIB))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert_eq!(reason_of(&status), ErrorReason::ForeignOwner);
        assert!(
            status.message().contains("owned by live lifecycle u1"),
            "{}",
            status.message()
        );

        // End the lifecycle: create/export/grant on it are refused.
        c.delete_volume(delete("u1", 6, "vol-a")).await.unwrap();
        for status in [
            c.create_volume(create_req("u1", 7, "vol-a", 16 * MIB))
                .await
                .unwrap_err(),
            c.export(export_req("u1", 7, "vol-a", true, &[]))
                .await
                .unwrap_err(),
            c.grant_initiator(grant("u1", 7, "vol-a", 1))
                .await
                .unwrap_err(),
        ] {
            assert_eq!(status.code(), Code::FailedPrecondition);
            assert_eq!(reason_of(&status), ErrorReason::EndedLifecycle);
            assert!(
                status.message().contains("has ended"),
                "{}",
                status.message()
            );
        }
        // A new lifecycle of the same name takes over; the old one is retired for good.
        c.create_volume(create_req("u2", 1, "vol-a", 16 * MIB))
            .await
            .unwrap();
        let status = c
            .revoke_initiator(revoke("u1", 100, "vol-a", 1))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert_eq!(reason_of(&status), ErrorReason::RetiredLifecycle);
        assert!(status.message().contains("retired"), "{}", status.message());
        c.delete_volume(delete("u2", 2, "vol-a")).await.unwrap();
    }
}

// proves F5, F6 and scenario 6 at the agent: a revoke carrying an older generation, arriving
// after a newer grant, is rejected and the grant stays in configfs.
#[tokio::test]
async fn a_delayed_revoke_cannot_undo_a_newer_grant() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        c.create_volume(create_req("u1", 1, "vol-b", 16 * MIB))
            .await
            .unwrap();
        c.export(export_req("u1", 2, "vol-b", true, &[]))
            .await
            .unwrap();
        c.grant_initiator(grant("u1", 4, "vol-b", 7)).await.unwrap();
        assert_eq!(
            code(c.revoke_initiator(revoke("u1", 3, "vol-b", 7)).await),
            Code::FailedPrecondition
        );
        let state = observe(&a.dirs.configfs()).unwrap();
        assert!(
            state.subsystems[&nqn("vol-b")]
                .allowed_hosts
                .contains(&host(7)),
            "{engine:?}: grant survived"
        );
        c.revoke_initiator(revoke("u1", 5, "vol-b", 7))
            .await
            .unwrap();
        let state = observe(&a.dirs.configfs()).unwrap();
        assert!(state.subsystems[&nqn("vol-b")].allowed_hosts.is_empty());
        c.unexport(unexport("u1", 6, "vol-b")).await.unwrap();
        c.delete_volume(delete("u1", 7, "vol-b")).await.unwrap();
    }
}

// proves I1, I2, W6
#[tokio::test]
async fn exports_carry_the_derived_identity_and_the_requested_acl() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        c.create_volume(create_req("u1", 1, "vol-c", 32 * MIB))
            .await
            .unwrap();
        let r = c
            .export(export_req("u1", 2, "vol-c", true, &[1]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.subsystem_nqn, nqn("vol-c"));
        assert_eq!(
            (r.target_address.as_str(), r.target_service),
            ("127.0.0.1", 4420)
        );
        assert!(!r.identity_adopted);
        let n: pillar_nvmet::SubsystemNqn = r.subsystem_nqn.parse().unwrap();
        let state = observe(&a.dirs.configfs()).unwrap();
        let sub = &state.subsystems[n.as_str()];
        let ns = &sub.namespaces[&NamespaceId::VOLUME];
        assert_eq!(
            ns.identity(),
            Some(NamespaceIdentity::derive(&n, NamespaceId::VOLUME))
        );
        assert_eq!(sub.serial, derive_serial(&n).as_str());
        assert!(ns.enabled && !sub.allow_any_host);
        assert_eq!(sub.allowed_hosts.iter().collect::<Vec<_>>(), vec![&host(1)]);

        // acl: false admits any host.
        c.export(export_req("u1", 3, "vol-c", false, &[]))
            .await
            .unwrap();
        assert!(observe(&a.dirs.configfs()).unwrap().subsystems[n.as_str()].allow_any_host);
        let listed = c
            .list_exports(api::ListExportsRequest {})
            .await
            .unwrap()
            .into_inner()
            .exports;
        assert_eq!(listed.len(), 1);
        assert!(!listed[0].acl && listed[0].enabled && listed[0].services == vec![4420]);

        // Delete is refused while exported; unexport removes everything.
        assert_eq!(
            code(c.delete_volume(delete("u1", 4, "vol-c")).await),
            Code::FailedPrecondition
        );
        c.unexport(unexport("u1", 5, "vol-c")).await.unwrap();
        let state = observe(&a.dirs.configfs()).unwrap();
        assert!(state.subsystems.is_empty() && state.ports.is_empty() && state.hosts.is_empty());
        c.delete_volume(delete("u1", 6, "vol-c")).await.unwrap();
    }
}

// proves W9 (the agent turns reservations on before enabling a namespace where the target has
// `resv_enable`, probing a fresh target through the namespace directory it creates), both engines
#[tokio::test]
async fn exports_turn_reservations_on_where_the_target_has_them() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        let _ = pillar_nvmet::ConfigfsDouble::create(a.dirs.configfs())
            .unwrap()
            .with_reservations();
        a.serve_now().await;
        let c = &mut a.client;
        for (i, vol) in ["vol-r1", "vol-r2"].into_iter().enumerate() {
            let g = 10 * i as u64;
            c.create_volume(create_req("u1", g + 1, vol, 16 * MIB))
                .await
                .unwrap();
            c.export(export_req("u1", g + 2, vol, true, &[1]))
                .await
                .unwrap();
            let state = observe(&a.dirs.configfs()).unwrap();
            let ns = &state.subsystems[nqn(vol).as_str()].namespaces[&NamespaceId::VOLUME];
            assert!(ns.enabled, "{vol}");
            assert_eq!(ns.resv_enable, Some(true), "{vol}");
        }
    }
}

// proves C3
#[tokio::test]
async fn no_export_or_grant_before_the_controller_resyncs() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        let c = &mut a.client;
        let h = c.health(api::HealthRequest {}).await.unwrap().into_inner();
        assert_eq!(h.state(), api::health_response::State::WaitingForResync);
        c.create_volume(create_req("u1", 1, "vol-d", 16 * MIB))
            .await
            .unwrap();
        let status = c
            .export(export_req("u1", 2, "vol-d", true, &[]))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.message().contains("resync"), "{}", status.message());
        assert_eq!(
            code(c.grant_initiator(grant("u1", 2, "vol-d", 1)).await),
            Code::Unavailable
        );
        assert!(
            observe(&a.dirs.configfs()).unwrap().subsystems.is_empty(),
            "nothing exported"
        );

        let r = c
            .resync_exports(api::ResyncExportsRequest {
                exports: vec![export_req("u1", 2, "vol-d", true, &[3])],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(r.results.iter().all(|x| x.ok), "{r:?}");
        let h = c.health(api::HealthRequest {}).await.unwrap().into_inner();
        assert_eq!(h.state(), api::health_response::State::Serving);
        assert!(
            observe(&a.dirs.configfs()).unwrap().subsystems[&nqn("vol-d")]
                .allowed_hosts
                .contains(&host(3))
        );
        c.unexport(unexport("u1", 3, "vol-d")).await.unwrap();
        c.delete_volume(delete("u1", 4, "vol-d")).await.unwrap();
    }
}

// proves I3, I4: a live export with the identity nvmet leaves (random UUID, zero NGUID) is kept
// and recorded, reproduced after the target lost it (a storage reboot), and forgotten on
// unexport.
#[tokio::test]
async fn a_live_kernel_random_identity_is_adopted_recorded_reproduced_and_forgotten() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        c.create_volume(create_req("u1", 1, "vol-e", 16 * MIB))
            .await
            .unwrap();
        let device = c
            .list_volumes(api::ListVolumesRequest { pool: "p1".into() })
            .await
            .unwrap()
            .into_inner()
            .volumes[0]
            .device_path
            .clone();
        // An export made by an older release: namespace enabled without identity. Like the
        // kernel, the double draws a random UUID at mkdir and leaves the NGUID all zero (K16).
        let root = a.dirs.configfs();
        let s = format!("subsystems/{}", nqn("vol-e"));
        let mut double = pillar_nvmet::ConfigfsDouble::create(&root).unwrap();
        for op in [
            pillar_nvmet::Op::Mkdir {
                path: s.clone().into(),
            },
            pillar_nvmet::Op::Mkdir {
                path: format!("{s}/namespaces/1").into(),
            },
            pillar_nvmet::Op::Write {
                path: format!("{s}/namespaces/1/device_path").into(),
                value: device.clone(),
            },
            pillar_nvmet::Op::Write {
                path: format!("{s}/namespaces/1/enable").into(),
                value: "1".into(),
            },
        ] {
            pillar_nvmet::apply(&mut double, &[op]).unwrap();
        }
        let shown = |root: &std::path::Path| {
            let ns = observe(root).unwrap().subsystems[&nqn("vol-e")].namespaces
                [&NamespaceId::VOLUME]
                .clone();
            (ns.uuid.unwrap(), ns.nguid.unwrap())
        };
        let (random_uuid, nguid) = shown(&root);
        assert!(nguid.is_zero());
        let r = c
            .export(export_req("u1", 2, "vol-e", false, &[]))
            .await
            .unwrap()
            .into_inner();
        assert!(r.identity_adopted, "{engine:?}");
        assert_eq!(
            shown(&root),
            (random_uuid, nguid),
            "the live identity is kept"
        );
        let record = a.dirs.state().join("nvmet-identity/vol-e.json");
        let recorded = std::fs::read_to_string(&record).unwrap();
        assert!(recorded.contains(&random_uuid.to_string()), "{recorded}");
        // Exporting again (a resync) keeps it and says so.
        let r = c
            .export(export_req("u1", 3, "vol-e", false, &[]))
            .await
            .unwrap()
            .into_inner();
        assert!(r.identity_adopted, "{engine:?}");

        // Storage reboot: the whole target is gone; the record brings the same identity back,
        // the zero NGUID included (hosts keyed on exactly that pair). The tree goes, not its
        // root: the engine holds the root open, as it holds the kernel's nvmet directory.
        for entry in std::fs::read_dir(&root).unwrap() {
            std::fs::remove_dir_all(entry.unwrap().path()).unwrap();
        }
        pillar_nvmet::ConfigfsDouble::create(&root).unwrap();
        c.export(export_req("u1", 4, "vol-e", false, &[]))
            .await
            .unwrap();
        assert_eq!(
            shown(&root),
            (random_uuid, nguid),
            "re-created with the recorded identity"
        );

        // Unexport forgets it; the next export uses the derived identity.
        c.unexport(unexport("u1", 5, "vol-e")).await.unwrap();
        assert!(!record.exists());
        c.export(export_req("u1", 6, "vol-e", false, &[]))
            .await
            .unwrap();
        let n = VolumeId::parse("vol-e").unwrap().subsystem_nqn();
        let derived = NamespaceIdentity::derive(&n, NamespaceId::VOLUME);
        assert_eq!(shown(&root), (derived.uuid, derived.nguid));
        c.unexport(unexport("u1", 7, "vol-e")).await.unwrap();
        c.delete_volume(delete("u1", 8, "vol-e")).await.unwrap();
    }
}

// Malformed requests get INVALID_ARGUMENT (or NOT_FOUND for an unknown pool) and change nothing:
// no mark, no backing file, no configfs entry.
// proves W6, I3: a grant and a revoke on an export whose namespace shows what nvmet leaves
// without explicit identity (random UUID, zero NGUID) change the ACL and nothing else: the
// namespace stays enabled with the same identity, the serial and the port link stay.
#[tokio::test]
async fn acl_changes_leave_a_kernel_random_namespace_untouched() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        c.create_volume(create_req("u1", 1, "vol-r", 16 * MIB))
            .await
            .unwrap();
        let device = c
            .list_volumes(api::ListVolumesRequest { pool: "p1".into() })
            .await
            .unwrap()
            .into_inner()
            .volumes[0]
            .device_path
            .clone();
        // An export made without identity writes, as a bare nvmet leaves it: the double, like
        // the kernel, gives the namespace a random UUID and a zero NGUID at mkdir.
        let root = a.dirs.configfs();
        let s = format!("subsystems/{}", nqn("vol-r"));
        let mut double = pillar_nvmet::ConfigfsDouble::create(&root).unwrap();
        let ops = [
            pillar_nvmet::Op::Mkdir {
                path: s.clone().into(),
            },
            pillar_nvmet::Op::Mkdir {
                path: format!("{s}/namespaces/1").into(),
            },
            pillar_nvmet::Op::Write {
                path: format!("{s}/namespaces/1/device_path").into(),
                value: device,
            },
            pillar_nvmet::Op::Write {
                path: format!("{s}/namespaces/1/enable").into(),
                value: "1".into(),
            },
            pillar_nvmet::Op::Mkdir {
                path: "ports/4420".into(),
            },
            pillar_nvmet::Op::Write {
                path: "ports/4420/addr_trtype".into(),
                value: "tcp".into(),
            },
            pillar_nvmet::Op::Write {
                path: "ports/4420/addr_adrfam".into(),
                value: "ipv4".into(),
            },
            pillar_nvmet::Op::Write {
                path: "ports/4420/addr_traddr".into(),
                value: "127.0.0.1".into(),
            },
            pillar_nvmet::Op::Write {
                path: "ports/4420/addr_trsvcid".into(),
                value: "4420".into(),
            },
            pillar_nvmet::Op::Symlink {
                target: s.clone().into(),
                link: format!("ports/4420/subsystems/{}", nqn("vol-r")).into(),
            },
        ];
        pillar_nvmet::apply(&mut double, &ops).unwrap();
        let before = observe(&root).unwrap();
        let sub_before = before.subsystems[&nqn("vol-r")].clone();
        let ns_before = sub_before.namespaces[&NamespaceId::VOLUME].clone();
        assert!(ns_before.nguid.unwrap().is_zero());

        c.grant_initiator(grant("u1", 2, "vol-r", 1)).await.unwrap();
        c.grant_initiator(grant("u1", 3, "vol-r", 2)).await.unwrap();
        let granted = observe(&root).unwrap();
        let sub = &granted.subsystems[&nqn("vol-r")];
        assert_eq!(
            sub.allowed_hosts.iter().cloned().collect::<Vec<_>>(),
            vec![host(1), host(2)],
            "{engine:?}"
        );
        assert_eq!(
            sub.namespaces[&NamespaceId::VOLUME],
            ns_before,
            "{engine:?}"
        );
        assert_eq!(sub.serial, sub_before.serial);

        c.revoke_initiator(revoke("u1", 4, "vol-r", 1))
            .await
            .unwrap();
        let revoked = observe(&root).unwrap();
        let sub = &revoked.subsystems[&nqn("vol-r")];
        assert_eq!(
            sub.allowed_hosts.iter().cloned().collect::<Vec<_>>(),
            vec![host(2)]
        );
        assert_eq!(
            sub.namespaces[&NamespaceId::VOLUME],
            ns_before,
            "{engine:?}"
        );
        assert_eq!(sub.serial, sub_before.serial);
        assert_eq!(revoked.ports, before.ports, "the cut relinks the port");
    }
}

#[tokio::test]
async fn malformed_requests_change_nothing() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        c_setup(&mut a).await;
        let before = a.snapshot();
        let c = &mut a.client;
        for (volume, size) in [
            ("", MIB),
            ("../x", MIB),
            ("a/b", MIB),
            (".hidden", MIB),
            ("ok", 0),
            ("ok", 1 << 60),
        ] {
            let status = c
                .create_volume(create_req("u1", 9, volume, size))
                .await
                .unwrap_err();
            assert_eq!(
                status.code(),
                Code::InvalidArgument,
                "{volume:?} {size}: {}",
                status.message()
            );
            assert_eq!(reason_of(&status), ErrorReason::InvalidRequest);
        }
        let mut bad_pool = create_req("u1", 9, "ok", MIB);
        bad_pool.pool = "nope".into();
        let status = c.create_volume(bad_pool).await.unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
        assert_eq!(reason_of(&status), ErrorReason::UnknownPool);
        let mut no_port = export_req("u1", 9, "base", true, &[]);
        no_port.protocol = Some(api::ExportProtocol {
            service: 0,
            acl: true,
            auth_none: true,
            tls: false,
        });
        assert_eq!(code(c.export(no_port).await), Code::InvalidArgument);
        let mut bad_host = grant("u1", 9, "base", 1);
        bad_host.host_nqn = "not-an-nqn".into();
        assert_eq!(
            code(c.grant_initiator(bad_host).await),
            Code::InvalidArgument
        );
        let mut comma = grant("u1", 9, "base", 1);
        comma.host_nqn = "nqn.2014-08.com.example:a,hostnqn=evil".into();
        assert_eq!(code(c.grant_initiator(comma).await), Code::InvalidArgument);
        let mut bad_service = export_req("u1", 9, "base", true, &[]);
        bad_service.protocol = Some(api::ExportProtocol {
            service: 70000,
            acl: true,
            auth_none: true,
            tls: false,
        });
        assert_eq!(code(c.export(bad_service).await), Code::InvalidArgument);
        let mut bad_acl_host = export_req("u1", 9, "base", true, &[]);
        bad_acl_host.allowed_host_nqns = vec!["nqn.bad".into()];
        assert_eq!(code(c.export(bad_acl_host).await), Code::InvalidArgument);
        let after = a.snapshot();
        assert_eq!(before, after, "{engine:?}: nothing changed");
        c_teardown(&mut a).await;
    }
}

async fn c_setup(a: &mut Agent) {
    a.client
        .create_volume(create_req("u1", 1, "base", 16 * MIB))
        .await
        .unwrap();
    a.client
        .export(export_req("u1", 2, "base", true, &[]))
        .await
        .unwrap();
}

async fn c_teardown(a: &mut Agent) {
    a.client.unexport(unexport("u1", 20, "base")).await.unwrap();
    a.client
        .delete_volume(delete("u1", 21, "base"))
        .await
        .unwrap();
}

// proves F8, C4, F9: a corrupt mark fails that volume only, and is never replaced by a guess;
// marks outlive their volumes.
#[tokio::test]
async fn a_corrupt_mark_is_an_error_for_that_volume_only() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        c.create_volume(create_req("u1", 1, "vol-f", 16 * MIB))
            .await
            .unwrap();
        c.create_volume(create_req("u1", 1, "vol-g", 16 * MIB))
            .await
            .unwrap();
        let mark = a.dirs.state().join("generations/vol-f.json");
        let original = std::fs::read_to_string(&mark).unwrap();
        std::fs::write(
            &mark,
            original.replace("\"generation\": 1", "\"generation\": 0"),
        )
        .unwrap();
        let status = c
            .create_volume(create_req("u1", 2, "vol-f", 16 * MIB))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::DataLoss, "{}", status.message());
        assert!(status.message().contains("corrupt"), "{}", status.message());
        assert_ne!(
            std::fs::read_to_string(&mark).unwrap(),
            original,
            "the agent did not rewrite it"
        );
        c.create_volume(create_req("u1", 2, "vol-g", 16 * MIB))
            .await
            .unwrap();
        std::fs::write(&mark, &original).unwrap();
        c.delete_volume(delete("u1", 3, "vol-f")).await.unwrap();
        c.delete_volume(delete("u1", 3, "vol-g")).await.unwrap();
        let kept = std::fs::read_to_string(a.dirs.state().join("generations/vol-g.json")).unwrap();
        assert!(
            kept.contains("\"ended\": true"),
            "mark kept after delete: {kept}"
        );
    }
}

// Sizes: rounded by the backend, shrink refused, growth reaches a live namespace.
#[tokio::test]
async fn expand_grows_and_shrink_is_refused() {
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        let created = c
            .create_volume(create_req("u1", 1, "vol-h", 16 * MIB + 1))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(created.size_bytes, 17 * MIB, "rounded up to whole MiB");
        c.export(export_req("u1", 2, "vol-h", false, &[]))
            .await
            .unwrap();
        let grown = c
            .expand_volume(api::ExpandVolumeRequest {
                token: token("u1", 3),
                volume_id: "vol-h".into(),
                pool: "p1".into(),
                size_bytes: 64 * MIB,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(grown.size_bytes, 64 * MIB);
        let status = c
            .expand_volume(api::ExpandVolumeRequest {
                token: token("u1", 4),
                volume_id: "vol-h".into(),
                pool: "p1".into(),
                size_bytes: 32 * MIB,
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::OutOfRange, "{}", status.message());
        c.unexport(unexport("u1", 5, "vol-h")).await.unwrap();
        c.delete_volume(delete("u1", 6, "vol-h")).await.unwrap();
    }
}

// proves W7 at the agent: a revoke under `acl` cuts the revoked host's live connection, not only
// its future ones. The configfs double models host controllers (unlinking a subsystem from a
// port deletes them; dropping an allowed_hosts link deletes none) and records the operations the
// agent applied: the revoke is exactly "drop the host from the ACL, then unlink the subsystem
// from its port and link it back", in that order (the other way round, the revoked host could
// reconnect between the cut and the ACL change). Afterwards no controller of the revoked host
// remains and it cannot reconnect, while the still-admitted host can.
#[tokio::test]
async fn a_revoke_cuts_the_live_connection_of_the_revoked_host() {
    use pillar_nvmet::{ConfigfsDouble, Op};
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        c.create_volume(create_req("u1", 1, "vol-w7", 16 * MIB))
            .await
            .unwrap();
        c.export(export_req("u1", 2, "vol-w7", true, &[1, 2]))
            .await
            .unwrap();
        let n = nqn("vol-w7");
        let double = ConfigfsDouble::create(a.dirs.configfs()).unwrap();
        double.host_connects(&n, &host(1), 4420).unwrap();
        double.host_connects(&n, &host(2), 4420).unwrap();
        assert_eq!(
            double.controllers(&n).unwrap(),
            vec![(4420, host(1)), (4420, host(2))]
        );
        double.record_ops().unwrap();

        c.revoke_initiator(revoke("u1", 3, "vol-w7", 1))
            .await
            .unwrap();

        let port_link = format!("ports/4420/subsystems/{n}");
        assert_eq!(
            double.recorded_ops().unwrap(),
            vec![
                Op::Unlink {
                    path: format!("subsystems/{n}/allowed_hosts/{}", host(1)).into()
                },
                Op::Rmdir {
                    path: format!("hosts/{}", host(1)).into()
                },
                Op::Unlink {
                    path: port_link.clone().into()
                },
                Op::Symlink {
                    target: format!("subsystems/{n}").into(),
                    link: port_link.into()
                },
            ],
            "{engine:?}"
        );
        assert!(
            double.controllers(&n).unwrap().is_empty(),
            "{engine:?}: the cut deleted every controller of the subsystem"
        );
        assert_eq!(
            double
                .host_connects(&n, &host(1), 4420)
                .unwrap_err()
                .raw_os_error(),
            Some(libc::EACCES),
            "{engine:?}: the revoked host cannot reconnect"
        );
        double.host_connects(&n, &host(2), 4420).unwrap();
        assert_eq!(double.controllers(&n).unwrap(), vec![(4420, host(2))]);

        c.unexport(unexport("u1", 4, "vol-w7")).await.unwrap();
        c.delete_volume(delete("u1", 5, "vol-w7")).await.unwrap();
    }
}

// proves W7 at the agent: a revoke that leaves nobody admitted is drained. After the ACL change
// the agent disables the namespace (the kernel returns from `enable=0` only once no command is in
// flight on it, and a disabled namespace takes none), then cuts the connections. Identity and
// device stay configured, so the next grant enables the namespace again, before it links the
// host, and hosts see the same identity. A revoke that leaves a host admitted does not disable it.
#[tokio::test]
async fn a_revoke_of_the_last_host_drains_the_namespace_and_a_grant_restores_it() {
    use pillar_nvmet::{ConfigfsDouble, Op};
    for engine in ENGINES {
        let mut a = Agent::start(engine).await;
        a.serve_now().await;
        let c = &mut a.client;
        c.create_volume(create_req("u1", 1, "vol-dr", 16 * MIB))
            .await
            .unwrap();
        c.export(export_req("u1", 2, "vol-dr", true, &[1, 2]))
            .await
            .unwrap();
        let n = nqn("vol-dr");
        let ns_enable = format!("subsystems/{n}/namespaces/1/enable");
        let port_link = format!("ports/4420/subsystems/{n}");
        let namespace = || {
            observe(&a.dirs.configfs()).unwrap().subsystems[&n].namespaces[&NamespaceId::VOLUME]
                .clone()
        };
        let before = namespace();
        assert!(before.enabled);
        let double = ConfigfsDouble::create(a.dirs.configfs()).unwrap();
        double.host_connects(&n, &host(1), 4420).unwrap();
        double.record_ops().unwrap();

        // Host 2 leaves, host 1 stays admitted: no drain.
        c.revoke_initiator(revoke("u1", 3, "vol-dr", 2))
            .await
            .unwrap();
        assert!(
            !double
                .recorded_ops()
                .unwrap()
                .iter()
                .any(|op| op.path() == std::path::Path::new(&ns_enable)),
            "{engine:?}: a host stays admitted; the namespace must stay enabled"
        );
        assert!(namespace().enabled, "{engine:?}");
        double.host_connects(&n, &host(1), 4420).unwrap();
        double.record_ops().unwrap();

        // The last host leaves: ACL, then the drain, then the cut.
        c.revoke_initiator(revoke("u1", 4, "vol-dr", 1))
            .await
            .unwrap();
        assert_eq!(
            double.recorded_ops().unwrap(),
            vec![
                Op::Unlink {
                    path: format!("subsystems/{n}/allowed_hosts/{}", host(1)).into()
                },
                Op::Rmdir {
                    path: format!("hosts/{}", host(1)).into()
                },
                Op::Write {
                    path: ns_enable.clone().into(),
                    value: "0".into()
                },
                Op::Unlink {
                    path: port_link.clone().into()
                },
                Op::Symlink {
                    target: format!("subsystems/{n}").into(),
                    link: port_link.clone().into()
                },
            ],
            "{engine:?}"
        );
        let drained = namespace();
        assert!(!drained.enabled, "{engine:?}");
        assert_eq!(
            (drained.device_path, drained.uuid, drained.nguid),
            (before.device_path.clone(), before.uuid, before.nguid),
            "{engine:?}: identity and device stay configured"
        );
        assert!(double.controllers(&n).unwrap().is_empty(), "{engine:?}");

        // A grant enables it again, before the host is linked.
        double.record_ops().unwrap();
        c.grant_initiator(grant("u1", 5, "vol-dr", 2))
            .await
            .unwrap();
        assert_eq!(
            double.recorded_ops().unwrap().first(),
            Some(&Op::Write {
                path: ns_enable.clone().into(),
                value: "1".into()
            }),
            "{engine:?}"
        );
        assert_eq!(
            namespace(),
            before,
            "{engine:?}: same namespace as before the drain"
        );
        double.host_connects(&n, &host(2), 4420).unwrap();

        c.unexport(unexport("u1", 6, "vol-dr")).await.unwrap();
        c.delete_volume(delete("u1", 7, "vol-dr")).await.unwrap();
    }
}
