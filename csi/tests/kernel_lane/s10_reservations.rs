//! Scenario 10: NVMe reservations where the kernel has them (rule W9).

use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::Duration;

use pillar_host::resv::{self, CommandError, ResvError};

use crate::harness::checks::{connect_opts, host_device, wait_controller_state};
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::lab::{Lab, host_paths, nqn_of};
use crate::harness::{MIB, NVMET};

/// Scenario 10 (proves W9 on a real kernel). `acl: false`, so a second host identity can stay
/// connected next to the stager. Where namespaces have `resv_enable` (7.x): the export turned it
/// on; node A's NodeStage holds Write Exclusive under A's key; host B, connected, cannot write
/// (reservation conflict); after ControllerUnpublish from A and publish to B, B's NodeStage
/// preempts and aborts A, and A's writes fail with a reservation conflict while A stays
/// connected. Without `resv_enable` (6.1): nothing was written to it (the namespace has no such
/// attribute), the target answers the report with an unsupported status, and the stage works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s10_reservations() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s10_reservations");
    let mut lab = Lab::new("s10", false).await;
    lab.start_agent(&[]).await;
    let mut ctl = lab.start_controller(1).await;
    let mut a = lab.start_default_node().await;
    let mut b = lab.start_second_node().await;
    let vol = "kl-s10";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let ns_dir = Path::new(NVMET)
        .join("subsystems")
        .join(nqn_of(vol).as_str())
        .join("namespaces/1");
    let resv_attr = ns_dir.join("resv_enable");
    let has_resv = resv_attr.exists();
    let sa = lab.attach(&mut ctl, &mut a, vol).await;
    let dev_a = sa.device.dev_path.clone();

    if !has_resv {
        println!(
            "  this kernel lacks NVMe reservations: {} has no resv_enable",
            ns_dir.display()
        );
        let entries: Vec<String> = fs::read_dir(&ns_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            !entries.iter().any(|e| e.contains("resv")),
            "a reservation attribute appeared in the namespace directory: {entries:?}"
        );
        let report = resv::report(&dev_a);
        println!("  Reservation Report on {}: {report:?}", dev_a.display());
        assert!(
            matches!(&report, Err(ResvError::Report { source: CommandError::Status(s), .. }) if s.is_unsupported()),
            "a target without resv_enable must answer the report as unsupported: {report:?}"
        );
        sc.step("no resv_enable: nothing written to it, report unsupported, NodeStage staged without a reservation");
        lab.detach(&mut ctl, &mut a, &sa).await;
        lab.delete_volume(&mut ctl, vol).await;
        return;
    }

    assert_eq!(
        fs::read_to_string(&resv_attr).unwrap().trim(),
        "1",
        "the export turns resv_enable on"
    );
    let report = resv::report(&dev_a).expect("Reservation Report through host A");
    println!("  report after A's stage: {report:?}");
    assert!(
        report.held_by(&a.host_id),
        "host A holds Write Exclusive: {report:?}"
    );
    assert_eq!(
        report.holder().map(|h| h.key),
        Some(resv::key_for_host(&a.host_id))
    );
    sc.step("resv_enable=1 in configfs; node A's NodeStage holds Write Exclusive under A's key");

    // Host B connects on its own (acl: false admits it) while A holds the reservation.
    pillar_host::connect(&host_paths(), &connect_opts(vol, &b.host_nqn, b.host_id))
        .expect("host B connects (acl: false)");
    let dev_b = host_device(vol, &b.host_nqn).dev_path;
    let w = direct_write(&dev_b, Duration::from_secs(10));
    println!("  O_DIRECT write by host B on {}: {w:?}", dev_b.display());
    assert_conflict(&w, "host B's write while A holds the reservation");
    sc.step("host B, connected, cannot write: reservation conflict");

    // A is revoked by the controller (its record goes); with acl: false its host reconnects
    // after the cut and stays connected: only the reservation can stop its writes now.
    lab.unpublish(&mut ctl, &a, &sa).await;
    for host in [&a.host_nqn, &b.host_nqn] {
        wait_controller_state(vol, host, |s| s == "live", "live", Duration::from_secs(30));
    }
    let ctx_b = lab
        .publish(&mut ctl, vol, &b)
        .await
        .expect("ControllerPublish to node-b after node-a's unpublish");
    lab.stage(&mut b, vol, &ctx_b)
        .await
        .expect("NodeStage on node-b preempts node-a");
    let report = resv::report(&dev_b).expect("Reservation Report through host B");
    println!("  report after B's stage: {report:?}");
    assert!(
        report.held_by(&b.host_id),
        "host B holds Write Exclusive: {report:?}"
    );
    assert!(
        report.registration_of(&a.host_id).is_none(),
        "host A's registration was preempted: {report:?}"
    );
    let w = direct_write(&dev_a, Duration::from_secs(10));
    println!("  O_DIRECT write by host A on {}: {w:?}", dev_a.display());
    assert_conflict(&w, "host A's write after B's preempt-and-abort");
    assert!(
        crate::harness::checks::host_controllers(vol, &a.host_nqn)
            .iter()
            .any(|c| c.state.as_str() == "live"),
        "host A is still connected: only the reservation fenced it"
    );
    sc.step("node B's NodeStage preempted and aborted A: B holds it, A's writes fail with a reservation conflict while A stays connected");

    // Teardown: B unstages (release, unregister); A's controller is deleted.
    let staging_b = b.dir.join(format!("staging/{vol}"));
    b.client
        .node_unstage_volume(pillar_csi::csi::NodeUnstageVolumeRequest {
            volume_id: vol.into(),
            staging_target_path: staging_b.display().to_string(),
        })
        .await
        .expect("NodeUnstage on node-b");
    crate::harness::checks::delete_host_controllers(vol, &a.host_nqn);
}

/// A 4 KiB O_DIRECT write at offset 1 MiB of `dev`, in a thread, waited for up to `timeout`.
fn direct_write(dev: &Path, timeout: Duration) -> Result<(), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let dev = dev.to_owned();
    std::thread::spawn(move || {
        let r = (|| {
            let f = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&dev)?;
            // An aligned 4 KiB buffer inside an 8 KiB allocation.
            let mut raw = vec![0x5Au8; 8192];
            let off = raw.as_ptr().align_offset(4096);
            f.write_all_at(&raw[off..off + 4096], MIB)?;
            raw.clear();
            Ok::<(), std::io::Error>(())
        })();
        let _ = tx.send(r);
    });
    match rx.recv_timeout(timeout) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("errno {:?}: {e}", e.raw_os_error())),
        Err(_) => Err(format!("BLOCKED for {timeout:?}")),
    }
}

/// The block layer's errno for a reservation conflict (BLK_STS_RESV_CONFLICT).
fn assert_conflict(w: &Result<(), String>, what: &str) {
    let want = format!("errno {:?}", Some(libc::EBADE));
    assert!(
        matches!(w, Err(e) if e.starts_with(&want)),
        "{what}: expected a reservation conflict ({want}), got {w:?}"
    );
}
