//! Scenario 6: a stale revoke is rejected; the current revoke cuts the host off.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use pillar_agent::fence::decode;
use pillar_agent_api::v1 as agent_api;
use pillar_nvmet::{HostNqn, VolumeId};
use sha2::{Digest, Sha256};
use tonic::Code;

use crate::harness::checks::{
    blocked_write_probe, check_configfs_export, connect_opts, delete_host_controllers,
    host_controllers, host_device, token,
};
use crate::harness::data::pattern;
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::kmsg::needles::{IDENTIFIERS_CHANGED, not_allowed};
use crate::harness::lab::{Lab, host_paths, nqn_of};
use crate::harness::machine::{drop_caches, nvmet_is_empty};
use crate::harness::seqlog::SeqWriter;
use crate::harness::{ETC_HOSTID, ETC_HOSTNQN, MIB, POOL, PORT, RECONNECT_DELAY, SECOND_HOSTID};

/// Scenario 6: a revoke carrying an older generation, sent after a newer grant, is rejected
/// (FAILED_PRECONDITION) and the grant stays in configfs: the host still connects and does I/O.
/// Then the current revoke cuts the host off (W7) while a second admitted host keeps writing: its
/// controller is cut too, it reconnects by itself, and its writes only pause (measured). The
/// agent alone, driven with its own tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s6_stale_revoke_rejected() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s6_stale_revoke_rejected");
    let mut lab = Lab::new("s6", true).await;
    let k0 = lab.kmsg.mark();
    let mut agent = lab.start_agent(&[]).await;
    agent
        .resync_exports(agent_api::ResyncExportsRequest {
            exports: vec![],
            ..Default::default()
        })
        .await
        .expect("resync");
    let vol = "kl-s6";
    let uid = "0b9d6b1e-kernel-lane-s6";
    let host: HostNqn = fs::read_to_string(ETC_HOSTNQN)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let host_id: uuid::Uuid = fs::read_to_string(ETC_HOSTID)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    agent
        .create_volume(agent_api::CreateVolumeRequest {
            token: token(uid, 1),
            volume_id: vol.into(),
            pool: POOL.into(),
            size_bytes: 64 * MIB,
            source: None,
        })
        .await
        .expect("CreateVolume");
    agent
        .export(agent_api::ExportRequest {
            token: token(uid, 2),
            volume_id: vol.into(),
            pool: POOL.into(),
            protocol: Some(agent_api::ExportProtocol {
                service: u32::from(PORT),
                acl: true,
                auth_none: true,
                tls: false,
            }),
            allowed_host_nqns: vec![],
            credentials: vec![],
        })
        .await
        .expect("Export");
    check_configfs_export(vol, &[]);
    agent
        .grant_initiator(agent_api::GrantInitiatorRequest {
            token: token(uid, 4),
            volume_id: vol.into(),
            host_nqn: host.to_string(),
            credentials: None,
        })
        .await
        .expect("GrantInitiator");
    check_configfs_export(vol, &[&host]);
    sc.step("created, exported (acl), granted at generation 4");

    let stale = agent
        .revoke_initiator(agent_api::RevokeInitiatorRequest {
            token: token(uid, 3),
            volume_id: vol.into(),
            host_nqn: host.to_string(),
        })
        .await
        .expect_err("a revoke at generation 3 after the grant at 4 must be rejected");
    println!("  stale revoke: {:?} {}", stale.code(), stale.message());
    assert_eq!(stale.code(), Code::FailedPrecondition);
    let foreign = agent
        .revoke_initiator(agent_api::RevokeInitiatorRequest {
            token: token("another-lifecycle", 9),
            volume_id: vol.into(),
            host_nqn: host.to_string(),
        })
        .await
        .expect_err("a revoke from another lifecycle must be rejected");
    assert_eq!(foreign.code(), Code::FailedPrecondition);
    let none = agent
        .revoke_initiator(agent_api::RevokeInitiatorRequest {
            token: None,
            volume_id: vol.into(),
            host_nqn: host.to_string(),
        })
        .await
        .expect_err("a revoke without a token must be rejected");
    assert_eq!(none.code(), Code::FailedPrecondition);
    check_configfs_export(vol, &[&host]);
    let mark = decode(
        &VolumeId::parse(vol).unwrap(),
        &fs::read(lab.agent_state().join(format!("generations/{vol}.json"))).unwrap(),
    )
    .expect("the fencing mark decodes");
    println!("  fencing mark: {mark:?}");
    assert_eq!(
        (mark.owner_uid.as_str(), mark.generation),
        (uid, 4),
        "the mark stays at the grant's generation"
    );
    sc.step("stale, foreign and token-less revokes rejected (FAILED_PRECONDITION); grant and port link still in configfs");

    let ctrl = pillar_host::connect(&host_paths(), &connect_opts(vol, &host, host_id))
        .expect("the granted host connects");
    let dev = host_device(vol, &host);
    let payload = pattern(66, 1024 * 1024);
    {
        let mut f = OpenOptions::new().write(true).open(&dev.dev_path).unwrap();
        f.write_all(&payload).unwrap();
        f.sync_all().unwrap();
    }
    drop_caches();
    let mut back = vec![0u8; payload.len()];
    File::open(&dev.dev_path)
        .unwrap()
        .read_exact(&mut back)
        .unwrap();
    assert_eq!(Sha256::digest(&back), Sha256::digest(&payload));
    lab.kmsg.expect(
        k0,
        &["new ctrl: NQN \"", nqn_of(vol).as_str()],
        Duration::from_secs(5),
    );
    sc.step(&format!(
        "granted host connected ({}), 1 MiB written to /dev/{} and read back",
        ctrl.name, dev.name
    ));

    // A second host stays admitted through the revoke of the first: the cut drops its controller
    // too, it reconnects by itself after reconnect_delay, and its I/O only pauses.
    let host_b: HostNqn = format!("nqn.2014-08.org.nvmexpress:uuid:{SECOND_HOSTID}")
        .parse()
        .unwrap();
    agent
        .grant_initiator(agent_api::GrantInitiatorRequest {
            token: token(uid, 5),
            volume_id: vol.into(),
            host_nqn: host_b.to_string(),
            credentials: None,
        })
        .await
        .expect("GrantInitiator for the second host");
    pillar_host::connect(
        &host_paths(),
        &connect_opts(vol, &host_b, SECOND_HOSTID.parse().unwrap()),
    )
    .expect("the second host connects");
    let dev_b = host_device(vol, &host_b);
    let writer_b = SeqWriter::start(&dev_b.dev_path, 32 * MIB, 4096);
    while writer_b.log().acks.len() < 20 {
        let log = writer_b.log();
        assert!(
            log.failed().is_none(),
            "host B's writer: {:?}",
            log.failed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let k1 = lab.kmsg.mark();
    let revoke_sent = Instant::now();
    agent
        .revoke_initiator(agent_api::RevokeInitiatorRequest {
            token: token(uid, 6),
            volume_id: vol.into(),
            host_nqn: host.to_string(),
        })
        .await
        .expect("the current revoke");
    let revoked = Instant::now();
    check_configfs_export(vol, &[&host_b]);
    let start = Instant::now();
    lab.kmsg.expect(
        k1,
        &not_allowed(&host, &nqn_of(vol)),
        Duration::from_secs(10),
    );
    let refused = start.elapsed();
    let ctrls = host_controllers(vol, &host);
    assert!(
        ctrls.iter().all(|c| c.state.as_str() != "live"),
        "the revoked host still has a live controller: {ctrls:?}"
    );
    // W7: the revoked host can no longer do I/O. Kernels with the do-not-retry short cut
    // (measured on 6.12 and 7.2) delete the controller after the first refused reconnect; 6.1
    // keeps reconnecting (refused each time) until ctrl_loss_tmo, holding the I/O back.
    let probe_data = pattern(99, 4096);
    assert_ne!(&payload[..4096], &probe_data[..]);
    let probe = blocked_write_probe(&dev.dev_path, &probe_data, Duration::from_secs(5));
    println!("  write by the revoked host: {probe}");
    assert!(
        !probe.starts_with("SUCCEEDED"),
        "the revoked host wrote: {probe}"
    );
    let ctrls = host_controllers(vol, &host);
    println!(
        "  revoked host's controllers: {:?}",
        ctrls
            .iter()
            .map(|c| (c.name.clone(), c.state.as_str().to_owned()))
            .collect::<Vec<_>>()
    );
    sc.step(&format!(
        "revoke at generation 6 ({:.0} ms): host removed from the ACL, its connection cut and its \
         reconnect refused ({:.1}s); its writes do not reach the target",
        (revoked - revoke_sent).as_secs_f64() * 1000.0,
        refused.as_secs_f64()
    ));

    // Host B: its writes resume by themselves, without an error; how long they paused.
    let start = Instant::now();
    while !writer_b
        .log()
        .acks
        .iter()
        .any(|(_, t)| *t > revoked + Duration::from_millis(200))
    {
        let log = writer_b.log();
        assert!(
            log.failed().is_none(),
            "host B, still admitted, saw a write fail: {:?}",
            log.failed()
        );
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "host B's writes did not resume within 60 s of the revoke: {log:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    writer_b.stop();
    let log_b = writer_b.log();
    assert!(log_b.failed().is_none(), "host B: {:?}", log_b.failed());
    let (gap, after) = log_b.longest_gap().expect("host B acknowledged writes");
    sc.step(&format!(
        "host B, still admitted, reconnected by itself: its writes paused {:.2} s at most (record \
         {after}; reconnect_delay {RECONNECT_DELAY} s), none failed; {} acknowledged",
        gap.as_secs_f64(),
        log_b.acks.len()
    ));
    delete_host_controllers(vol, &host_b);

    agent
        .unexport(agent_api::UnexportRequest {
            token: token(uid, 7),
            volume_id: vol.into(),
        })
        .await
        .expect("Unexport");
    // The target side, after the export is gone (no controller of the volume left to write):
    // the backing file still holds the payload written before the revoke, not the probe's.
    let backing = lab.dir.join(format!("pool/{vol}.img"));
    let mut head = vec![0u8; payload.len()];
    File::open(&backing)
        .and_then(|mut f| f.read_exact(&mut head))
        .unwrap_or_else(|e| panic!("read {}: {e}", backing.display()));
    assert!(
        head[..4096] != probe_data[..],
        "the revoked host's write reached the backing file"
    );
    assert!(
        head == payload,
        "the backing file's first MiB is not the payload written before the revoke"
    );
    sc.step(
        "the backing file still holds the payload at sector 0: the revoked write never reached it",
    );
    agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: token(uid, 8),
            volume_id: vol.into(),
            pool: POOL.into(),
        })
        .await
        .expect("DeleteVolume");
    assert!(nvmet_is_empty(), "nvmet state left after unexport");
    lab.kmsg.expect_absent(k0, IDENTIFIERS_CHANGED);
}
