//! Connecting to an NVMe/TCP subsystem through `/dev/nvme-fabrics`.
//!
//! The kernel's protocol (drivers/nvme/host/fabrics.c): open the misc device read-write, write
//! the whole options line in one write(2) (the write blocks until the controller is created or
//! creation failed, and fails with the kernel's errno), then read the same fd: a seq_file answers
//! `instance=N,cntlid=M\n` for the controller this fd created. nvme-tcp refuses a second
//! controller with the same address, subsystem and host NQN with EALREADY unless
//! `duplicate_connect` is passed, which pillar never does.
//!
//! Rule N1: the node's own host NQN and host ID are always passed explicitly; the kernel would
//! otherwise invent a default host identity.

use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::net::IpAddr;
use std::path::Path;

use pillar_nvmet::{HostNqn, SubsystemNqn};
use uuid::Uuid;

use crate::{HostError, HostPaths};

/// Name of the fabrics control device under [`HostPaths::dev`].
pub const FABRICS_DEVICE: &str = "nvme-fabrics";

/// Everything one connect needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectOptions {
    /// The target's address (`traddr=`), written without brackets for IPv6, as the kernel's
    /// `inet_pton_with_scope` expects.
    pub traddr: IpAddr,
    /// The target's TCP port (`trsvcid=`), normally 4420.
    pub trsvcid: u16,
    /// The subsystem to connect to.
    pub nqn: SubsystemNqn,
    /// This node's host NQN.
    pub hostnqn: HostNqn,
    /// This node's host ID.
    pub hostid: Uuid,
    /// Seconds to keep reconnecting after the connection drops; -1 means forever.
    pub ctrl_loss_tmo: i32,
    /// Seconds between reconnect attempts; at least 1.
    pub reconnect_delay: u32,
    /// DH-HMAC-CHAP (W10): the secret this host proves (`dhchap_secret=`) and the one it asks
    /// the target to prove (`dhchap_ctrl_secret=`, bidirectional). `None`: no authentication.
    /// Never logged: `Debug` of the secrets is redacted, and the options line is never logged.
    pub auth: Option<ConnectAuth>,
    /// TLS for NVMe/TCP: the PSK this host presents for the subsystem. [`connect`] puts it in
    /// the kernel's `.nvme` keyring and connects with `tls,tls_key=<its serial>`; the kernel
    /// hands it to `tlshd`, which does the handshake. `None`: no TLS. Never logged.
    pub tls: Option<pillar_nvmet::TlsPsk>,
}

/// The host's DH-HMAC-CHAP secrets for one connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectAuth {
    pub secret: pillar_nvmet::DhchapSecret,
    pub ctrl_secret: Option<pillar_nvmet::DhchapSecret>,
}

impl ConnectOptions {
    /// The options line, exactly as written to `/dev/nvme-fabrics`.
    pub fn options_line(&self) -> String {
        let mut line = String::with_capacity(512);
        // Writing to a String cannot fail.
        let _ = write!(
            line,
            "transport=tcp,traddr={},trsvcid={},nqn={},hostnqn={},hostid={},ctrl_loss_tmo={},\
             reconnect_delay={}",
            self.traddr,
            self.trsvcid,
            self.nqn,
            self.hostnqn,
            self.hostid.hyphenated(),
            self.ctrl_loss_tmo,
            self.reconnect_delay,
        );
        if let Some(auth) = &self.auth {
            let _ = write!(line, ",dhchap_secret={}", auth.secret.expose());
            if let Some(ctrl) = &auth.ctrl_secret {
                let _ = write!(line, ",dhchap_ctrl_secret={}", ctrl.expose());
            }
        }
        if self.tls.is_some() {
            line.push_str(",tls");
        }
        line
    }

    /// Refuses values the kernel would refuse (nvmf_parse_options) before anything is written.
    pub fn validate(&self) -> Result<(), HostError> {
        if self.reconnect_delay == 0 {
            return Err(HostError::InvalidArgument {
                what: "reconnect_delay",
                value: "0".into(),
                reason: "the kernel requires a reconnect delay of at least 1 second",
            });
        }
        if i32::try_from(self.reconnect_delay).is_err() {
            return Err(HostError::InvalidArgument {
                what: "reconnect_delay",
                value: self.reconnect_delay.to_string(),
                reason: "the kernel parses reconnect_delay as an int",
            });
        }
        if self.trsvcid == 0 {
            return Err(HostError::InvalidArgument {
                what: "trsvcid",
                value: "0".into(),
                reason: "port 0 cannot be connected to",
            });
        }
        if self.hostid.is_nil() {
            return Err(HostError::InvalidArgument {
                what: "hostid",
                value: self.hostid.to_string(),
                reason: "the nil UUID is no host identity",
            });
        }
        Ok(())
    }
}

/// The controller a connect created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Controller {
    /// The controller's name, `nvme<instance>` (its directory in `/sys/class/nvme`).
    pub name: String,
    /// The controller instance number the kernel assigned.
    pub instance: u32,
    /// The controller ID the target assigned.
    pub cntlid: u16,
}

/// Connects to the subsystem described by `opts` and returns the new controller.
///
/// Errors: [`HostError::OpenFabrics`] when the control device is missing or cannot be opened,
/// [`HostError::AlreadyConnected`] (EALREADY) when this host already has a controller for the
/// same address and subsystem, [`HostError::Connect`] carrying the kernel's errno otherwise.
pub fn connect(paths: &HostPaths, opts: &ConnectOptions) -> Result<Controller, HostError> {
    opts.validate()?;
    let path = paths.dev.join(FABRICS_DEVICE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|source| HostError::OpenFabrics {
            path: path.clone(),
            source,
        })?;
    tracing::info!(
        nqn = %opts.nqn, traddr = %opts.traddr, trsvcid = opts.trsvcid, hostnqn = %opts.hostnqn,
        dhchap = opts.auth.is_some(), tls = opts.tls.is_some(), "connecting NVMe/TCP controller"
    );
    let tls_key = opts.tls.as_ref().map(install_psk).transpose()?;
    let ctrl = connect_on(&mut file, &path, opts, tls_key)?;
    tracing::info!(nqn = %opts.nqn, controller = %ctrl.name, cntlid = ctrl.cntlid, "connected");
    Ok(ctrl)
}

/// Puts `psk` into the kernel's `.nvme` keyring (replacing the key of the same identity) and
/// answers its serial, for `tls_key=`.
fn install_psk(psk: &pillar_nvmet::TlsPsk) -> Result<i32, HostError> {
    let ring = pillar_nvmet::nvme_keyring()
        .map_err(|source| HostError::Keyring {
            what: "find",
            source,
        })?
        .ok_or(HostError::NoKeyring)?;
    pillar_nvmet::add_psk(ring, psk).map_err(|source| HostError::Keyring {
        what: "add a TLS PSK to",
        source,
    })
}

/// Invalidates this host's PSK of `identity` (after the last controller of its subsystem is
/// gone). A kernel without the keyring has none to remove.
pub fn remove_psk(identity: &str) -> Result<(), HostError> {
    let Some(ring) = pillar_nvmet::nvme_keyring().map_err(|source| HostError::Keyring {
        what: "find",
        source,
    })?
    else {
        return Ok(());
    };
    pillar_nvmet::remove_psk(ring, identity)
        .map(|_| ())
        .map_err(|source| HostError::Keyring {
            what: "remove a TLS PSK from",
            source,
        })
}

/// The write-then-read exchange on an open control device (split out so it can be tested with a
/// stand-in for the kernel's seq_file).
pub(crate) fn connect_on<F: Read + Write>(
    file: &mut F,
    path: &Path,
    opts: &ConnectOptions,
    tls_key: Option<i32>,
) -> Result<Controller, HostError> {
    let mut line = opts.options_line();
    if let Some(serial) = tls_key {
        let _ = write!(line, ",tls_key={serial}");
    }
    // One write(2): the kernel parses whatever a single write delivers as the complete options.
    let written = file.write(line.as_bytes()).map_err(|source| {
        if source.raw_os_error() == Some(libc::EALREADY) {
            HostError::AlreadyConnected {
                nqn: opts.nqn.to_string(),
                traddr: opts.traddr,
                trsvcid: opts.trsvcid,
                source,
            }
        } else {
            HostError::Connect {
                nqn: opts.nqn.to_string(),
                traddr: opts.traddr,
                trsvcid: opts.trsvcid,
                source,
            }
        }
    })?;
    if written != line.len() {
        return Err(HostError::ShortConnectWrite {
            written,
            len: line.len(),
        });
    }
    let mut reply = Vec::with_capacity(64);
    let mut buf = [0u8; 256];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                reply.extend_from_slice(&buf[..n]);
                if reply.contains(&b'\n') || reply.len() > 4096 {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(HostError::ReadConnectReply {
                    path: path.to_path_buf(),
                    source,
                });
            }
        }
    }
    parse_reply(&String::from_utf8_lossy(&reply))
}

/// Parses the kernel's `instance=N,cntlid=M\n` reply.
pub fn parse_reply(reply: &str) -> Result<Controller, HostError> {
    let bad = || HostError::ConnectReply {
        reply: reply.to_owned(),
    };
    let line = reply.strip_suffix('\n').unwrap_or(reply);
    let mut instance = None;
    let mut cntlid = None;
    for field in line.split(',') {
        let (key, value) = field.split_once('=').ok_or_else(bad)?;
        match key {
            "instance" if instance.is_none() => instance = Some(value),
            "cntlid" if cntlid.is_none() => cntlid = Some(value),
            _ => return Err(bad()),
        }
    }
    let decimal = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit());
    let (Some(instance), Some(cntlid)) = (instance, cntlid) else {
        return Err(bad());
    };
    if !decimal(instance) || !decimal(cntlid) {
        return Err(bad());
    }
    let instance: u32 = instance.parse().map_err(|_| bad())?;
    let cntlid: u16 = cntlid.parse().map_err(|_| bad())?;
    Ok(Controller {
        name: format!("nvme{instance}"),
        instance,
        cntlid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> ConnectOptions {
        ConnectOptions {
            traddr: "192.0.2.10".parse().unwrap(),
            trsvcid: 4420,
            nqn: SubsystemNqn::parse("nqn.2026-11.io.pillar-csi:vol:pvc-1").unwrap(),
            hostnqn: HostNqn::parse(
                "nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6",
            )
            .unwrap(),
            hostid: "f81d4fae-7dec-11d0-a765-00a0c91e6bf6".parse().unwrap(),
            ctrl_loss_tmo: -1,
            reconnect_delay: 2,
            auth: None,
            tls: None,
        }
    }

    // proves N1: the node's host NQN and host ID are always on the line.
    #[test]
    fn options_line_is_exact() {
        assert_eq!(
            opts().options_line(),
            "transport=tcp,traddr=192.0.2.10,trsvcid=4420,\
             nqn=nqn.2026-11.io.pillar-csi:vol:pvc-1,\
             hostnqn=nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6,\
             hostid=f81d4fae-7dec-11d0-a765-00a0c91e6bf6,ctrl_loss_tmo=-1,reconnect_delay=2"
        );
    }

    // proves W10: the secrets go on the line, and nowhere else.
    #[test]
    fn dhchap_secrets_are_on_the_line_and_not_in_debug() {
        let secret = pillar_nvmet::DhchapSecret::generate().unwrap();
        let ctrl = pillar_nvmet::DhchapSecret::generate().unwrap();
        let mut o = opts();
        o.auth = Some(ConnectAuth {
            secret: secret.clone(),
            ctrl_secret: Some(ctrl.clone()),
        });
        let line = o.options_line();
        assert!(
            line.ends_with(&format!(
                ",reconnect_delay=2,dhchap_secret={},dhchap_ctrl_secret={}",
                secret.expose(),
                ctrl.expose()
            )),
            "{line}"
        );
        let debug = format!("{o:?}");
        assert!(!debug.contains(&secret.expose()[10..40]), "{debug}");
        assert!(!debug.contains(&ctrl.expose()[10..40]), "{debug}");
    }

    #[test]
    fn tls_is_on_the_line_with_the_key_serial_and_the_psk_nowhere() {
        let secret = pillar_nvmet::DhchapSecret::generate().unwrap();
        let mut o = opts();
        assert!(!o.options_line().contains("tls"));
        let psk = pillar_nvmet::TlsPsk::derive(&secret, &o.hostnqn, &o.nqn);
        o.tls = Some(psk.clone());
        assert!(
            o.options_line().ends_with(",reconnect_delay=2,tls"),
            "{}",
            o.options_line()
        );
        let mut f = fake(None);
        connect_on(&mut f, Path::new("/dev/nvme-fabrics"), &o, Some(0x1234)).unwrap();
        let written = String::from_utf8(f.writes[0].clone()).unwrap();
        assert!(written.ends_with(",tls,tls_key=4660"), "{written}");
        assert!(format!("{o:?}").contains("<redacted>"));
    }

    #[test]
    fn ipv6_addresses_have_no_brackets() {
        let mut o = opts();
        o.traddr = "fd00::1".parse().unwrap();
        o.ctrl_loss_tmo = 600;
        let line = o.options_line();
        assert!(line.contains(",traddr=fd00::1,trsvcid=4420,"), "{line}");
        assert!(line.contains(",ctrl_loss_tmo=600,"), "{line}");
    }

    #[test]
    fn validation_refuses_what_the_kernel_refuses() {
        let mut o = opts();
        o.reconnect_delay = 0;
        assert!(matches!(
            o.validate(),
            Err(HostError::InvalidArgument {
                what: "reconnect_delay",
                ..
            })
        ));
        let mut o = opts();
        o.hostid = Uuid::nil();
        assert!(o.validate().is_err());
        let mut o = opts();
        o.trsvcid = 0;
        assert!(o.validate().is_err());
        opts().validate().unwrap();
    }

    #[test]
    fn reply_parsing() {
        assert_eq!(
            parse_reply("instance=3,cntlid=1\n").unwrap(),
            Controller {
                name: "nvme3".into(),
                instance: 3,
                cntlid: 1
            }
        );
        for bad in [
            "",
            "\n",
            "instance=-1,cntlid=-1\n",
            "instance=3\n",
            "instance=3,cntlid=70000\n",
            "instance=3,cntlid=1,cntlid=2\n",
            "instance=+3,cntlid=1\n",
            "instance=-1,cntlid=-1,transport=%s,traddr=%s\n",
            "cntlid=1,instance=x\n",
        ] {
            assert!(
                matches!(parse_reply(bad), Err(HostError::ConnectReply { .. })),
                "{bad:?}"
            );
        }
    }

    /// Stands in for the kernel's seq_file: records every write, fails the write with a given
    /// errno, or answers reads with a canned reply.
    struct FakeFabrics {
        writes: Vec<Vec<u8>>,
        fail_with: Option<i32>,
        reply: &'static [u8],
        read_pos: usize,
    }

    impl Write for FakeFabrics {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.writes.push(buf.to_vec());
            match self.fail_with {
                Some(errno) => Err(io::Error::from_raw_os_error(errno)),
                None => Ok(buf.len()),
            }
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Read for FakeFabrics {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let rest = &self.reply[self.read_pos..];
            let n = rest.len().min(buf.len()).min(5); // dribble: prove the reply is reassembled
            buf[..n].copy_from_slice(&rest[..n]);
            self.read_pos += n;
            Ok(n)
        }
    }

    fn fake(fail_with: Option<i32>) -> FakeFabrics {
        FakeFabrics {
            writes: Vec::new(),
            fail_with,
            reply: b"instance=7,cntlid=2\n",
            read_pos: 0,
        }
    }

    #[test]
    fn connect_writes_once_and_reads_the_reply() {
        let mut f = fake(None);
        let ctrl = connect_on(&mut f, Path::new("/dev/nvme-fabrics"), &opts(), None).unwrap();
        assert_eq!(ctrl.name, "nvme7");
        assert_eq!(ctrl.cntlid, 2);
        assert_eq!(f.writes.len(), 1);
        assert_eq!(f.writes[0], opts().options_line().into_bytes());
    }

    #[test]
    fn ealready_is_reported_distinctly() {
        let err = connect_on(
            &mut fake(Some(libc::EALREADY)),
            Path::new("/x"),
            &opts(),
            None,
        )
        .unwrap_err();
        assert!(matches!(err, HostError::AlreadyConnected { .. }), "{err:?}");
        assert_eq!(err.errno(), Some(libc::EALREADY));
        let err = connect_on(
            &mut fake(Some(libc::ECONNREFUSED)),
            Path::new("/x"),
            &opts(),
            None,
        )
        .unwrap_err();
        assert!(matches!(err, HostError::Connect { .. }), "{err:?}");
        assert_eq!(err.errno(), Some(libc::ECONNREFUSED));
    }

    #[test]
    fn missing_control_device_is_open_fabrics() {
        let dir = tempfile::tempdir().unwrap();
        let err = connect(&HostPaths::under(dir.path()), &opts()).unwrap_err();
        assert!(matches!(err, HostError::OpenFabrics { .. }), "{err:?}");
        assert_eq!(err.class(), crate::ErrorClass::Unavailable);
    }
}
