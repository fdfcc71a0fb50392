//! Kernel-side checks (configfs, sysfs, block devices) and small shared helpers.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use pillar_agent_api::v1 as agent_api;
use pillar_csi::csi;
use pillar_host::ConnectOptions;
use pillar_host::{NamespaceDevice, controllers_for, namespaces_for_host};
use pillar_nvmet::{HostNqn, derive_serial};

use crate::harness::lab::{NodePlugin, Staged, host_paths, identity_of, nqn_of};
use crate::harness::machine::{names, read_attr, write_attr};
use crate::harness::{CTRL_LOSS_TMO, NVMET, PORT, RECONNECT_DELAY};

/// This host's controllers of `volume`'s subsystem.
///
/// A bounded retry (2 s): a controller that is being set up, reconnecting or torn down can
/// answer a read of one of its sysfs attributes with an error (ENODEV) while its directory is
/// still listed, and the scenarios list controllers exactly then (right after a connect, after
/// a cut). Such a read says nothing about the volume; a listing that keeps failing does.
pub(crate) fn host_controllers(volume: &str, host: &HostNqn) -> Vec<pillar_host::ControllerInfo> {
    let start = Instant::now();
    let all = loop {
        match controllers_for(&host_paths(), &nqn_of(volume)) {
            Ok(all) => break all,
            Err(e) if start.elapsed() < Duration::from_secs(2) => {
                println!("  listing controllers of {volume}: {e} (retrying)");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("listing controllers of {volume}: {e}"),
        }
    };
    all.into_iter()
        .filter(|c| c.hostnqn.as_deref() == Some(host.as_str()))
        .collect()
}

/// The one namespace disk of `volume` this host sees (waiting up to 10 s for it to appear after
/// a connect), with the derived identity. A sysfs read that fails while the listing runs (an
/// earlier controller's entries going away as it is read) is printed and read again, as
/// [`host_controllers`] does, until the deadline.
pub(crate) fn host_device(volume: &str, host: &HostNqn) -> NamespaceDevice {
    let start = Instant::now();
    let mut devs = loop {
        let listed = namespaces_for_host(&host_paths(), &nqn_of(volume), Some(host));
        let timed_out = start.elapsed() > Duration::from_secs(10);
        match listed {
            Ok(devs) => {
                let ready = !devs.is_empty() && devs.iter().all(|d| d.dev_path.exists());
                if ready || timed_out {
                    break devs;
                }
            }
            Err(e) if !timed_out => println!("  listing namespaces of {volume}: {e} (retrying)"),
            Err(e) => panic!("listing namespaces of {volume}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if devs.is_empty() {
        let block: Vec<String> = names(Path::new("/sys/block"));
        println!("  /sys/block: {block:?}");
        for b in block.iter().filter(|b| b.starts_with("nvme")) {
            let d = Path::new("/sys/block").join(b);
            println!(
                "  {b}: device -> {:?}, hidden {}, uuid {}",
                fs::canonicalize(d.join("device")),
                read_attr(&d.join("hidden")),
                read_attr(&d.join("uuid"))
            );
        }
    }
    assert_eq!(
        devs.len(),
        1,
        "host {host} sees {} namespaces of {volume}: {devs:?}",
        devs.len()
    );
    let dev = devs.remove(0);
    let want = identity_of(volume);
    assert_eq!(dev.uuid, Some(want.uuid), "namespace UUID in sysfs");
    assert_eq!(dev.nguid, Some(want.nguid), "namespace NGUID in sysfs");
    dev
}

/// Deletes this host's controllers of `volume` (sysfs `delete_controller`: queued I/O fails) and
/// waits up to 20 s for them to go.
pub(crate) fn delete_host_controllers(volume: &str, host: &HostNqn) {
    for c in host_controllers(volume, host) {
        let r = write_attr(
            &Path::new("/sys/class/nvme")
                .join(&c.name)
                .join("delete_controller"),
            "1",
        );
        println!(
            "  delete controller {} ({}): {r:?}",
            c.name,
            c.state.as_str()
        );
    }
    let start = Instant::now();
    while !host_controllers(volume, host).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "controllers of {volume} for {host} left 20 s after delete_controller"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until one of this host's controllers of `volume` is in `state` (sysfs `state`).
pub(crate) fn wait_controller_state(
    volume: &str,
    host: &HostNqn,
    pred: impl Fn(&str) -> bool,
    what: &str,
    timeout: Duration,
) -> Duration {
    let start = Instant::now();
    loop {
        let ctrls = host_controllers(volume, host);
        if ctrls.iter().any(|c| pred(c.state.as_str())) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < timeout,
            "no controller of {volume} for {host} became {what} within {timeout:?}: {ctrls:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The identity configfs holds for `volume`: (device_uuid, device_nguid, attr_serial).
pub(crate) fn configfs_identity(volume: &str) -> (String, String, String) {
    let sub = Path::new(NVMET)
        .join("subsystems")
        .join(nqn_of(volume).as_str());
    (
        read_attr(&sub.join("namespaces/1/device_uuid")),
        read_attr(&sub.join("namespaces/1/device_nguid")),
        read_attr(&sub.join("attr_serial")),
    )
}

/// The configfs export of `volume` as pillar promises it: derived identity and serial, enabled
/// exactly while a host is admitted, linked to the TCP port on 127.0.0.1, allowed hosts exactly
/// `hosts` (acl).
pub(crate) fn check_configfs_export(volume: &str, hosts: &[&HostNqn]) {
    let nqn = nqn_of(volume);
    let sub = Path::new(NVMET).join("subsystems").join(nqn.as_str());
    assert!(sub.is_dir(), "no subsystem {}", sub.display());
    let want = identity_of(volume);
    let (uuid, nguid, serial) = configfs_identity(volume);
    assert_eq!(uuid, want.uuid.to_string(), "configfs device_uuid");
    assert_eq!(nguid, want.nguid.to_string(), "configfs device_nguid");
    assert_eq!(
        serial,
        derive_serial(&nqn).to_string(),
        "configfs attr_serial"
    );
    // W7: enabled exactly while a host is admitted; a disabled namespace keeps its identity.
    let enabled = if hosts.is_empty() { "0" } else { "1" };
    assert_eq!(
        read_attr(&sub.join("namespaces/1/enable")),
        enabled,
        "namespace enable while {} host(s) are admitted",
        hosts.len()
    );
    assert_eq!(
        read_attr(&sub.join("attr_allow_any_host")),
        "0",
        "acl: allow_any_host is 0"
    );
    let mut want_hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
    want_hosts.sort();
    assert_eq!(
        names(&sub.join("allowed_hosts")),
        want_hosts,
        "allowed_hosts"
    );
    let port = Path::new(NVMET).join(format!("ports/{PORT}"));
    assert_eq!(read_attr(&port.join("addr_trtype")), "tcp");
    assert_eq!(read_attr(&port.join("addr_traddr")), "127.0.0.1");
    assert_eq!(read_attr(&port.join("addr_trsvcid")), PORT.to_string());
    assert!(
        port.join("subsystems").join(nqn.as_str()).exists(),
        "subsystem not linked to port {PORT}"
    );
    println!(
        "  configfs: {} enable={enabled}, uuid {uuid}, nguid {nguid}, serial {serial}, allowed_hosts {want_hosts:?}, port {PORT}",
        nqn
    );
}

/// NodeGetVolumeStats of a staged volume, with a 20 s limit (a hang is an error too).
pub(crate) async fn volume_stats(
    node: &mut NodePlugin,
    staged: &Staged,
) -> Result<csi::NodeGetVolumeStatsResponse, String> {
    let call = node
        .client
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: staged.volume.clone(),
            volume_path: staged.target.display().to_string(),
            staging_target_path: staged.staging.display().to_string(),
        });
    match tokio::time::timeout(Duration::from_secs(20), call).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(status)) => Err(format!("{:?}: {}", status.code(), status.message())),
        Err(_) => Err("no answer within 20 s".into()),
    }
}

/// A write of some data at offset 0 of a path + fsync, running in a thread of its own: a write
/// that cannot reach the target may block (the host keeps reconnecting) or fail. A block device
/// is opened as it is, never created: on kernels that drop a refused controller its device
/// node goes, and creating the path would write a regular file on devtmpfs (seen: a "write by
/// the revoked host" that succeeded that way on 7.2). A new file on a filesystem is created
/// (and must not exist).
pub(crate) struct WriteProbe {
    rx: std::sync::mpsc::Receiver<std::io::Result<()>>,
    outcome: Option<String>,
}

impl WriteProbe {
    pub(crate) fn start(path: &Path, data: &[u8], new_file: bool) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        let (path, data) = (path.to_owned(), data.to_owned());
        std::thread::spawn(move || {
            let r = OpenOptions::new()
                .write(true)
                .create_new(new_file)
                .open(&path)
                .and_then(|mut f| f.write_all(&data).and_then(|()| f.sync_all()));
            let _ = tx.send(r);
        });
        Self { rx, outcome: None }
    }

    /// What happened within `timeout` (or earlier): "SUCCEEDED", "FAILED: <error>" or "BLOCKED
    /// for <timeout>" (still waiting; ask again later).
    pub(crate) fn outcome(&mut self, timeout: Duration) -> String {
        if let Some(o) = &self.outcome {
            return o.clone();
        }
        let o = match self.rx.recv_timeout(timeout) {
            Ok(Ok(())) => "SUCCEEDED".to_owned(),
            Ok(Err(e)) => format!("FAILED: {e}"),
            Err(_) => return format!("BLOCKED for {timeout:?}"),
        };
        self.outcome = Some(o.clone());
        o
    }
}

/// [`WriteProbe`] on block device `dev`, asked once: the thread of a blocked write is left to
/// finish when the controller is deleted at cleanup.
pub(crate) fn blocked_write_probe(dev: &Path, data: &[u8], timeout: Duration) -> String {
    WriteProbe::start(dev, data, false).outcome(timeout)
}

pub(crate) fn check_configfs_export_exists(volume: &str) {
    let sub = Path::new(NVMET)
        .join("subsystems")
        .join(nqn_of(volume).as_str());
    assert_eq!(
        read_attr(&sub.join("namespaces/1/enable")),
        "1",
        "no enabled export of {volume} in configfs"
    );
}

pub(crate) fn statvfs_total(path: &Path) -> u64 {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: an all-zero statvfs is a valid value to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid, writable statvfs.
    let r = unsafe { libc::statvfs(c.as_ptr(), &raw mut st) };
    assert_eq!(r, 0, "statvfs {}", path.display());
    st.f_blocks * st.f_frsize
}

pub(crate) fn connect_opts(volume: &str, host: &HostNqn, host_id: uuid::Uuid) -> ConnectOptions {
    ConnectOptions {
        traddr: "127.0.0.1".parse().unwrap(),
        trsvcid: PORT,
        nqn: nqn_of(volume),
        hostnqn: host.clone(),
        hostid: host_id,
        ctrl_loss_tmo: CTRL_LOSS_TMO,
        reconnect_delay: RECONNECT_DELAY,
        auth: None,
        tls: None,
    }
}

pub(crate) fn token(uid: &str, generation: u64) -> Option<agent_api::FencingToken> {
    Some(agent_api::FencingToken {
        lifecycle_uid: uid.into(),
        generation,
    })
}
