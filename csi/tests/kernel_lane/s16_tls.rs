//! Scenario 16: TLS for NVMe/TCP on the real target and host, the agent alone with its own
//! tokens.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::{ErrorReason, reason_of};
use pillar_host::{ConnectAuth, HostError};
use pillar_nvmet::{DhchapSecret, HostNqn, TlsPsk};
use sha2::{Digest, Sha256};
use tonic::Code;

use crate::capture::{Seen, classify, streams};
use crate::harness::checks::{connect_opts, delete_host_controllers, host_device, token};
use crate::harness::data::pattern;
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::lab::{Lab, host_paths, nqn_of};
use crate::harness::machine::{drop_caches, nvmet_is_empty};
use crate::harness::process::Proc;
use crate::harness::{ETC_HOSTID, ETC_HOSTNQN, MIB, NVMET, POOL, PORT};

/// Whether the running kernel has TLS for the NVMe/TCP target, seen as the agent sees it: a
/// port made and removed again has `addr_tsas` and takes `tls1.3`, and there is a `.nvme`
/// keyring (never decided from a kernel version).
fn kernel_has_tls() -> bool {
    let probe = Path::new(NVMET).join("ports/65534");
    fs::create_dir(&probe).expect("make a probe port");
    let write = |attr: &str, v: &str| {
        OpenOptions::new()
            .write(true)
            .open(probe.join(attr))
            .and_then(|mut f| f.write_all(v.as_bytes()))
    };
    let has = write("addr_trtype", "tcp").is_ok()
        && probe.join("addr_tsas").exists()
        && write("addr_tsas", "tls1.3").is_ok();
    fs::remove_dir(&probe).expect("remove the probe port");
    has && pillar_nvmet::nvme_keyring().ok().flatten().is_some()
}

/// The key serial a host controller's TLS connection uses (sysfs `tls_key`, `%08x`).
fn controller_tls_key(controller: &str) -> String {
    let dir = Path::new("/sys/class/nvme").join(controller);
    let serial = fs::read_to_string(dir.join("tls_key")).unwrap_or_else(|e| {
        let attrs: Vec<String> = fs::read_dir(&dir)
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        panic!("no TLS in the target's log and no tls_key on {controller} ({e}): {attrs:?}")
    });
    let serial = serial.trim().to_owned();
    assert!(
        serial.len() == 8 && serial.chars().all(|c| c.is_ascii_hexdigit()) && serial != "00000000",
        "tls_key of {controller}: {serial:?}"
    );
    serial
}

fn connect(
    vol: &str,
    host: &HostNqn,
    host_id: uuid::Uuid,
    auth: &ConnectAuth,
    tls: Option<TlsPsk>,
) -> Result<pillar_host::Controller, HostError> {
    let mut opts = connect_opts(vol, host, host_id);
    opts.auth = Some(auth.clone());
    opts.tls = tls;
    pillar_host::connect(&host_paths(), &opts)
}

fn write_read(dev: &Path, seed: u64) {
    let payload = pattern(seed, usize::try_from(MIB).expect("a MiB fits usize"));
    {
        let mut f = OpenOptions::new().write(true).open(dev).unwrap();
        f.write_all(&payload).unwrap();
        f.sync_all().unwrap();
    }
    drop_caches();
    let mut back = vec![0u8; payload.len()];
    File::open(dev).unwrap().read_exact(&mut back).unwrap();
    assert_eq!(Sha256::digest(&back), Sha256::digest(&payload));
}

/// tcpdump on lo, NVMe/TCP's port only, every byte of every packet, into `pcap`.
struct Capture {
    child: Child,
    pcap: PathBuf,
    log: PathBuf,
}

impl Capture {
    fn start(dir: &Path) -> Self {
        let pcap = dir.join("nvme-tcp.pcap");
        let log = dir.join("tcpdump.log");
        let child = Command::new("tcpdump")
            .args([
                "-i", "lo", "-s", "0", "-B", "32768", "-U", "-n", "-Z", "root", "-w",
            ])
            .arg(&pcap)
            .args(["tcp", "port", &PORT.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).unwrap())
            .spawn()
            .expect("tcpdump (setup.sh installs it)");
        let start = Instant::now();
        while !fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("listening on")
        {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "tcpdump did not start: {}",
                fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Self { child, pcap, log }
    }

    /// Stops tcpdump and answers the file; fails when the kernel dropped packets.
    fn stop(mut self) -> Vec<u8> {
        // SAFETY: kill(2) on the pid of our own child, not reaped yet.
        unsafe {
            libc::kill(
                libc::pid_t::try_from(self.child.id()).unwrap(),
                libc::SIGTERM,
            )
        };
        let status = self.child.wait().unwrap();
        let log = fs::read_to_string(&self.log).unwrap_or_default();
        println!("  tcpdump ({status}): {}", log.trim().replace('\n', "; "));
        assert!(
            log.lines()
                .any(|l| l.trim() == "0 packets dropped by kernel"),
            "the capture lost packets: {log}"
        );
        fs::read(&self.pcap).unwrap()
    }
}

/// Scenario 16, the agent alone with its own tokens. Where the kernel has TLS for NVMe/TCP
/// (6.12 and 7.2, each with its own suite's tlshd running): the export's port is
/// `tls1.3`/`required`; the grant puts the host's PSK (derived from its DH-HMAC-CHAP secret) in
/// the `.nvme` keyring; the node's NQN with its secret but without TLS is refused; the node with its PSK connects over TLS and does
/// I/O; a capture of port 4420 shows the plain attempt's ICReq in clear (the capture sees plain
/// NVMe/TCP) and every byte of the TLS connections in TLS records, none in clear; the revoke
/// takes the PSK away. Where it has not (6.1): the export that requires TLS is refused
/// (FAILED_PRECONDITION, TLS_UNSUPPORTED) with nothing made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s16_tls() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s16_tls");
    let mut lab = Lab::new("s16", true).await;
    let has_tls = kernel_has_tls();
    let mut agent = lab.start_agent(&[]).await;
    agent
        .resync_exports(agent_api::ResyncExportsRequest {
            exports: vec![],
            ..Default::default()
        })
        .await
        .expect("resync");
    let vol = "kl-s16";
    let uid = "5e1f0d2a-kernel-lane-s16";
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
    let export = |generation: u64| agent_api::ExportRequest {
        token: token(uid, generation),
        volume_id: vol.into(),
        pool: POOL.into(),
        protocol: Some(agent_api::ExportProtocol {
            service: u32::from(PORT),
            acl: true,
            auth_none: false,
            tls: true,
        }),
        allowed_host_nqns: vec![],
        credentials: vec![],
    };

    if !has_tls {
        let refusal = agent
            .export(export(2))
            .await
            .expect_err("an export that requires TLS on a kernel without it");
        println!(
            "  export requiring TLS: {:?} {}",
            refusal.code(),
            refusal.message()
        );
        assert_eq!(refusal.code(), Code::FailedPrecondition);
        assert_eq!(reason_of(&refusal), ErrorReason::TlsUnsupported);
        assert!(nvmet_is_empty(), "the refused export left configfs entries");
        sc.step("no addr_tsas on ports: export requiring TLS refused (FAILED_PRECONDITION, TLS_UNSUPPORTED), nothing made");
        return;
    }

    let tlshd_bin = std::env::var("PILLAR_LANE_TLSHD")
        .expect("PILLAR_LANE_TLSHD: tlshd unpacked by setup.sh (run.sh passes it)");
    let conf = lab.dir.join("tlshd.conf");
    fs::write(
        &conf,
        "[debug]\nloglevel=1\ntls=0\nnl=0\n\n[authenticate]\n\n[authenticate.client]\n\n[authenticate.server]\n",
    )
    .unwrap();
    let mut tlshd = Proc::spawn(
        "tlshd",
        Path::new(&tlshd_bin),
        &["-s".into(), "-c".into(), conf.display().to_string()],
        &lab.dir.join("tlshd.log"),
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(tlshd.exited().is_none(), "tlshd ended: {}", tlshd.tail(20));

    agent.export(export(2)).await.expect("Export, TLS required");
    let port = Path::new(NVMET).join("ports").join(PORT.to_string());
    let attr = |a: &str| fs::read_to_string(port.join(a)).unwrap().trim().to_owned();
    assert_eq!(attr("addr_tsas"), "tls1.3");
    assert_eq!(attr("addr_treq"), "required");
    let secret = DhchapSecret::generate().unwrap();
    let ctrl = DhchapSecret::generate().unwrap();
    agent
        .grant_initiator(agent_api::GrantInitiatorRequest {
            token: token(uid, 3),
            volume_id: vol.into(),
            host_nqn: host.to_string(),
            credentials: Some(agent_api::HostCredentials {
                host_nqn: host.to_string(),
                dhchap_secret: secret.expose().to_owned(),
                dhchap_ctrl_secret: ctrl.expose().to_owned(),
                hash: String::new(),
                dhgroup: String::new(),
            }),
        })
        .await
        .expect("GrantInitiator");
    let psk = TlsPsk::derive(&secret, &host, &nqn_of(vol));
    let keys = fs::read_to_string("/proc/keys").unwrap();
    let installed: Vec<&str> = keys
        .lines()
        .filter(|l| l.contains(psk.identity()))
        .collect();
    println!("  /proc/keys after the grant: {installed:?}");
    assert!(
        installed
            .iter()
            .any(|l| l.contains(" psk ") && l.ends_with(": 32")),
        "the agent's PSK is in the keyring"
    );
    sc.step("TLS port (addr_tsas tls1.3, addr_treq required); the grant put the host's 32-byte PSK in the .nvme keyring");

    let capture = Capture::start(&lab.dir);
    let auth = ConnectAuth {
        secret: secret.clone(),
        ctrl_secret: Some(ctrl.clone()),
    };
    let k0 = lab.kmsg.mark();
    match connect(vol, &host, host_id, &auth, None) {
        Ok(c) => panic!("a plain host connected to a TLS-only port as {}", c.name),
        Err(e) => println!("  the node's NQN and secret without TLS: refused: {e}"),
    }
    if let Some(line) = lab.kmsg.find(k0, &["icresp"]) {
        println!("  kernel: {line}");
    }
    let c = connect(vol, &host, host_id, &auth, Some(psk.clone())).unwrap_or_else(|e| {
        panic!(
            "the node with its PSK connects over TLS: {e}; tlshd: {}",
            tlshd.tail(30)
        )
    });
    let dev = host_device(vol, &host);
    write_read(&dev.dev_path, 16);
    // The kernel's own word that the controller runs over TLS: the target's log says so from
    // 7.x on (", TLS."); 6.12's target logs the controller without it, and its host then shows
    // the key the controller's connection took (sysfs `tls_key`: one of the PSKs of this
    // identity in /proc/keys).
    match lab
        .kmsg
        .find(k0, &["Created nvm controller", host.as_str(), ", TLS."])
    {
        Some(line) => println!("  kernel: {line}"),
        None => {
            let serial = controller_tls_key(&c.name);
            println!(
                "  kernel: no TLS in the target's log; host {}: tls_key {serial}",
                c.name
            );
            let keys = fs::read_to_string("/proc/keys").unwrap();
            assert!(
                keys.lines().any(|l| l.starts_with(&serial)
                    && l.contains(" psk ")
                    && l.contains(psk.identity())),
                "the controller's tls_key {serial} is a PSK of {}: {keys}",
                psk.identity()
            );
        }
    }
    delete_host_controllers(vol, &host);
    let pcap = capture.stop();
    sc.step(&format!(
        "plain host refused; the node with its PSK connected over TLS ({}), 1 MiB written and read back",
        c.name
    ));

    let flows = streams(&pcap, PORT).expect("the capture reassembles");
    let mut plain = 0;
    let mut tls_bytes = 0;
    for ((client, _, to_server), bytes) in &flows {
        let seen = classify(bytes);
        println!(
            "  flow :{client} {}: {} bytes, {seen:?}",
            if *to_server {
                "to target"
            } else {
                "from target"
            },
            bytes.len()
        );
        match seen {
            Seen::PlainNvmeTcp => plain += 1,
            Seen::Tls { bytes, .. } => tls_bytes += bytes,
            Seen::Other => panic!("flow :{client} is neither TLS nor NVMe/TCP"),
        }
    }
    assert_eq!(
        plain, 1,
        "the refused plain attempt's ICReq is seen in clear"
    );
    assert!(
        tls_bytes > usize::try_from(MIB).unwrap(),
        "the MiB written went over TLS ({tls_bytes} bytes of TLS records)"
    );
    sc.step(&format!(
        "capture of port {PORT}: {} streams; the plain attempt's ICReq in clear, every other byte ({tls_bytes}) in TLS records, no NVMe/TCP PDU in clear",
        flows.len()
    ));

    agent
        .revoke_initiator(agent_api::RevokeInitiatorRequest {
            token: token(uid, 4),
            volume_id: vol.into(),
            host_nqn: host.to_string(),
        })
        .await
        .expect("RevokeInitiator");
    // An invalidated key may be listed until the key garbage collector ran.
    let start = Instant::now();
    while fs::read_to_string("/proc/keys")
        .unwrap()
        .lines()
        .any(|l| l.contains(psk.identity()))
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the revoke invalidated the PSK"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    agent
        .unexport(agent_api::UnexportRequest {
            token: token(uid, 5),
            volume_id: vol.into(),
        })
        .await
        .expect("Unexport");
    sc.step("revoke invalidated the PSK; unexport removed the TLS port");
    tlshd.stop();
}
