//! Scenario 9: a force-detach from a lost node, end to end (W7).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::harness::MIB;
use crate::harness::checks::delete_host_controllers;
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::lab::{Lab, node_teardown};
use crate::harness::machine::drop_caches;
use crate::harness::seqlog::{Extent, RECORD, SeqWriter, physical_of, record};

/// Seconds a host keeps reconnecting in this scenario: on kernels that keep retrying a refused
/// host (6.1) this is how long a fenced writer hangs before its writes fail.
const CTRL_LOSS_TMO: i32 = 20;
/// Records in the writer's file (8 MiB): enough for the whole scenario at the writer's pace.
const RECORDS: u64 = 2048;
/// How long after the marker the backing file is checked for writes of the fenced host.
const WATCH: Duration = Duration::from_secs(8);

/// Scenario 9: node A has the volume staged RWO with a writer that logs every acknowledged write
/// (O_DIRECT + fdatasync, sequence numbers). Node A is lost: its plugin never unstages.
/// ControllerUnpublish for A arrives as Kubernetes' force-detach sends it, then
/// ControllerPublish and NodeStage for node B. (a) Once ControllerUnpublish returns, nothing A
/// sends reaches the device: right after it returns a marker is written over the records A has
/// not acknowledged yet, straight into the backing file, and 8 s later it is intact. (b) A's
/// writes fail (or hang: the kernel keeps a refused host reconnecting until ctrl_loss_tmo), and
/// the time is measured. (c) B mounts, reads every record A acknowledged before the unpublish
/// returned, and after B's unstage the filesystem checks clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s9_force_detach() {
    if !in_lane() {
        return;
    }
    force_detach(Scenario::start("s9_force_detach"), true).await;
}

/// The body of scenario 9 and of its control (`fenced` false: the agent's test-only ACL-only
/// revoke, where (a) must fail).
pub(crate) async fn force_detach(sc: Scenario, fenced: bool) {
    let mut lab =
        Lab::with_ctrl_loss_tmo(if fenced { "s9" } else { "s9c" }, true, CTRL_LOSS_TMO).await;
    let agent_args: &[&str] = if fenced {
        &[]
    } else {
        &["--unsafe-revoke-acl-only"]
    };
    lab.start_agent(agent_args).await;
    let mut ctl = lab.start_controller(1).await;
    let mut a = lab.start_default_node().await;
    let mut b = lab.start_second_node().await;
    let vol = "kl-s9";
    lab.create_volume(&mut ctl, vol, 64 * MIB).await;
    let sa = lab.attach(&mut ctl, &mut a, vol).await;
    let (writer, extents) = SeqWriter::prepare_and_start(&sa.target.join("seq.log"), RECORDS);
    println!("  writer file extents (physical byte offsets): {extents:?}");
    let start = Instant::now();
    while writer.log().acks.len() < 50 {
        let log = writer.log();
        assert!(log.failed().is_none(), "writer failed: {:?}", log.failed());
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the writer acknowledged {} records in 60 s",
            log.acks.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sc.step(&format!(
        "node A staged RWO; writer running (O_DIRECT + fdatasync, 4 KiB records): {} acknowledged",
        writer.log().acks.len()
    ));

    // Node A is lost: no NodeUnpublish, no NodeUnstage. The force-detach's ControllerUnpublish.
    let sent = Instant::now();
    lab.unpublish(&mut ctl, &a, &sa).await;
    let returned = Instant::now();
    let backing = lab.dir.join(format!("pool/{vol}.img"));
    let log = writer.log();
    let acked = log
        .last_acked_before(returned)
        .expect("the writer acknowledged records before the unpublish");
    let first = acked + 1;
    // The next 64 records first (where A's next writes go, in milliseconds), then the rest.
    let near = (first + 64).min(RECORDS);
    write_markers(&backing, &extents, first, near);
    let marked_near = Instant::now();
    write_markers(&backing, &extents, near, RECORDS);
    let marked = Instant::now();
    sc.step(&format!(
        "ControllerUnpublish(A) took {:.0} ms; A had acknowledged records 0..={acked}; marker over \
         records {first}..{near} of the backing file {:.0} ms after it returned, over the rest \
         up to {RECORDS} {:.0} ms after",
        ms(returned - sent),
        ms(marked_near - returned),
        ms(marked - returned)
    ));

    tokio::time::sleep(WATCH).await;
    let overwritten = overwritten_markers(&backing, &extents, first);
    let log = writer.log();
    let late_acks: Vec<u64> = log
        .acks
        .iter()
        .filter(|(_, t)| *t >= returned)
        .map(|(s, _)| *s)
        .collect();
    println!(
        "  after {WATCH:?}: marker records overwritten {}, A's acknowledgements after the unpublish \
         returned {late_acks:?}, A's first failure {:?}, in flight {:?}",
        overwritten.len(),
        log.failed()
            .map(|(s, t, e)| format!("record {s} at +{:.0} ms: {e}", ms(*t - returned))),
        log.in_flight
            .map(|(s, t)| format!("record {s} since +{:.0} ms", signed_ms(t, returned))),
    );
    if !fenced {
        // The control: an ACL-only revoke leaves A's controller working, and A's writes land
        // over the marker. If they did not, the check above could not tell the two apart.
        assert!(
            !overwritten.is_empty(),
            "control: A's writes should have landed over the marker after an ACL-only revoke; \
             none did, so the scenario cannot tell a fenced revoke from an unfenced one"
        );
        sc.step(&format!(
            "control (ACL-only revoke): A kept writing after ControllerUnpublish returned: {} \
             marker records overwritten, {} acknowledgements after it returned: (a) fails, as it must",
            overwritten.len(),
            late_acks.len()
        ));
        writer.stop();
        node_teardown(&mut a, &sa).await;
        lab.delete_volume(&mut ctl, vol).await;
        return;
    }
    assert!(
        overwritten.is_empty(),
        "A's writes reached the device after ControllerUnpublish returned: records {overwritten:?}"
    );
    // The one write A had in flight when the namespace was drained may be acknowledged after the
    // unpublish returned (it completed before); nothing after it.
    assert!(
        late_acks.iter().all(|s| *s <= first),
        "A acknowledged records it wrote after the unpublish: {late_acks:?}"
    );
    sc.step(&format!(
        "(a) no write of A reached the device in the {WATCH:?} after ControllerUnpublish returned \
         (marker intact over {} records)",
        RECORDS - first
    ));

    // (b) How A's writes end: failed, or hung until ctrl_loss_tmo. The writer goes on to the
    // next record after a failure: the first failure shows how a write in flight at the cut
    // ends, the second how long a write issued after it waits.
    let limit = Duration::from_secs(u64::try_from(CTRL_LOSS_TMO).unwrap() + 30);
    while writer.log().failures.len() < 2 && returned.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = writer.log();
    assert!(
        log.failures.len() >= 2,
        "A's writes did not fail twice within {limit:?} of the unpublish: {log:?}"
    );
    let since = |t: Instant| signed_ms(t, returned) / 1000.0;
    let (s1, t1, e1) = &log.failures[0];
    let (s2, t2, e2) = &log.failures[1];
    sc.step(&format!(
        "(b) A's writes fail: record {s1} at {:+.2} s from ControllerUnpublish's return ({e1}), \
         the next one, record {s2}, at {:+.2} s ({e2}); ctrl_loss_tmo {CTRL_LOSS_TMO} s, \
         reconnect_delay 1 s",
        since(*t1),
        since(*t2),
    ));
    assert!(
        overwritten_markers(&backing, &extents, first).is_empty(),
        "A's writes reached the device before they failed"
    );
    writer.stop();
    // Nodes A and B share this guest's kernel, whose NVMe host refuses a second controller
    // with the same controller ID in one subsystem ("Duplicate cntlid"): the target hands B the
    // ID A's cut controller had. A lost node's controller lives on its own machine; remove it
    // from this one before B connects.
    delete_host_controllers(vol, &a.host_nqn);

    // (c) Node B takes over.
    let sb = lab.attach(&mut ctl, &mut b, vol).await;
    drop_caches();
    let file = File::open(sb.target.join("seq.log")).expect("B opens the writer's file");
    let mut block = vec![0u8; RECORD];
    for seq in 0..=acked {
        file.read_exact_at(&mut block, seq * RECORD as u64)
            .expect("read a record through B");
        assert!(
            block == record(seq),
            "record {seq}, acknowledged to A before the unpublish returned, is not on the volume"
        );
    }
    drop(file);
    sc.step(&format!(
        "(c) node B published and staged: its mount shows all {} records A acknowledged before \
         the unpublish returned",
        acked + 1
    ));
    lab.detach(&mut ctl, &mut b, &sb).await;
    // Node A comes back: its controller is gone, its mounts go.
    node_teardown(&mut a, &sa).await;
    let fsck = Command::new("e2fsck")
        .args(["-f", "-n"])
        .arg(&backing)
        .output()
        .expect("run e2fsck");
    println!(
        "  e2fsck -fn: {}\n{}",
        fsck.status,
        String::from_utf8_lossy(&fsck.stdout)
    );
    assert!(fsck.status.success(), "the filesystem does not check clean");
    sc.step("(c) after B's unstage, e2fsck -fn of the volume reports it clean");
    lab.delete_volume(&mut ctl, vol).await;
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn signed_ms(t: Instant, base: Instant) -> f64 {
    if t >= base {
        ms(t - base)
    } else {
        -ms(base - t)
    }
}

/// The marker of record `seq`: what no writer writes.
fn marker(seq: u64) -> Vec<u8> {
    let mut m = b"PILLAR-FENCE-MARKER\0".to_vec();
    m.extend_from_slice(&seq.to_le_bytes());
    m.resize(RECORD, 0xA5);
    m
}

/// Writes the marker over records `first..end` straight into the backing file, durably: one
/// write per run of records that are contiguous on the device, so it takes milliseconds (a write
/// of A landing before the marker covers its place would go unseen).
fn write_markers(backing: &Path, extents: &[Extent], first: u64, end: u64) {
    let f = OpenOptions::new()
        .write(true)
        .open(backing)
        .expect("open the backing file");
    let mut seq = first;
    while seq < end {
        let at = physical_of(extents, seq);
        let mut run = marker(seq);
        let mut next = seq + 1;
        while next < end && physical_of(extents, next) == at + (next - seq) * RECORD as u64 {
            run.extend_from_slice(&marker(next));
            next += 1;
        }
        f.write_all_at(&run, at).expect("write markers");
        seq = next;
    }
    f.sync_data().expect("sync the backing file");
}

/// The records from `first` on whose marker was overwritten.
fn overwritten_markers(backing: &Path, extents: &[Extent], first: u64) -> Vec<u64> {
    let f = File::open(backing).expect("open the backing file");
    let mut block = vec![0u8; RECORD];
    (first..RECORDS)
        .filter(|seq| {
            f.read_exact_at(&mut block, physical_of(extents, *seq))
                .expect("read a marker");
            block != marker(*seq)
        })
        .collect()
}
