//! Host controllers, the part of the kernel a tree cannot show: connects (with the ACL and
//! DH-HMAC-CHAP checks the kernel makes), disconnects, and which subsystems a host identified.
//!
//! Invariants:
//! - A host connects through a port only while the subsystem is linked to it and the host is
//!   admitted (`allow_any_host` or `allowed_hosts`); where its entry has a key, only presenting
//!   exactly that key.
//! - A connected host has identified the subsystem: its serial and model are fixed from then
//!   on, until the subsystem is removed.

use std::fs;
use std::io;
use std::path::PathBuf;

use super::{CONTROLLERS, ConfigfsDouble, PRIVATE_DIR, errno};
use crate::model::{HOSTS, PORTS, SUBSYSTEMS, read_attr};

impl ConfigfsDouble {
    /// Simulates a host sending Identify Controller to `nqn`: from now on its serial and model
    /// are fixed, as in the kernel (`subsys_discovered`).
    pub fn host_identifies(&self, nqn: &str) -> io::Result<()> {
        if !self.root.join(SUBSYSTEMS).join(nqn).is_dir() {
            return Err(errno(libc::ENOENT));
        }
        fs::write(self.discovered_marker(nqn), b"")
    }

    /// Simulates `host` connecting to `nqn` through port `port`, as the kernel's fabrics connect
    /// decides it: the subsystem must be linked to the port (else ENOENT) and the host admitted
    /// by `allow_any_host` or `allowed_hosts` (else EACCES, the kernel's "invalid host"). A
    /// connected host has identified the subsystem.
    pub fn host_connects(&self, nqn: &str, host: &str, port: u16) -> io::Result<()> {
        self.host_connects_with_secret(nqn, host, port, None)
    }

    /// [`Self::host_connects`] by a host presenting `secret` (the fabrics option
    /// `dhchap_secret`): where the host entry has a `dhchap_key`, the connect succeeds only when
    /// the host presents exactly that secret (EACCES otherwise: the kernel's failed
    /// authentication); where it has none, any host the ACL admits connects.
    pub fn host_connects_with_secret(
        &self,
        nqn: &str,
        host: &str,
        port: u16,
        secret: Option<&str>,
    ) -> io::Result<()> {
        let port = port.to_string();
        let linked = self
            .root
            .join(PORTS)
            .join(&port)
            .join(SUBSYSTEMS)
            .join(nqn)
            .symlink_metadata()
            .is_ok();
        if !linked {
            return Err(errno(libc::ENOENT));
        }
        let sub = self.root.join(SUBSYSTEMS).join(nqn);
        let any = self.attr(&sub.join("attr_allow_any_host"))? == "1";
        let allowed = sub
            .join("allowed_hosts")
            .join(host)
            .symlink_metadata()
            .is_ok();
        if !any && !allowed {
            return Err(errno(libc::EACCES));
        }
        // The kernel looks up the host entry's key only for a subsystem with an ACL
        // (`nvmet_setup_auth` skips `allow_any_host` subsystems).
        if !any {
            let key = self
                .root
                .join(HOSTS)
                .join(host)
                .join(crate::auth::DHCHAP_KEY);
            if let Ok(shown) = read_attr(&key) {
                let presented = secret.map(|s| s.trim_end_matches(['\n', ':']));
                // A key the store took but that is no well-formed secret authenticates nobody.
                let usable = crate::auth::DhchapSecret::parse(&shown).is_ok();
                if !shown.is_empty() && (!usable || presented != Some(shown.trim_end_matches(':')))
                {
                    return Err(errno(libc::EACCES));
                }
            }
        }
        let dir = self.controllers_dir().join(&port).join(nqn);
        fs::create_dir_all(&dir)?;
        fs::write(dir.join(host), b"")?;
        self.host_identifies(nqn)
    }

    /// Simulates `host` disconnecting from `nqn` (`nvme disconnect` of that subsystem): its
    /// controllers on every port end. Disconnecting a host that has none is not an error.
    pub fn host_disconnects(&self, nqn: &str, host: &str) -> io::Result<()> {
        let dir = self.controllers_dir();
        if !dir.is_dir() {
            return Ok(());
        }
        for port in Self::dir_entries(&dir)? {
            match fs::remove_file(dir.join(port).join(nqn).join(host)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// The live controllers of `nqn`: (port, host NQN) pairs, sorted.
    pub fn controllers(&self, nqn: &str) -> io::Result<Vec<(u16, String)>> {
        let mut out = Vec::new();
        let dir = self.controllers_dir();
        if !dir.is_dir() {
            return Ok(out);
        }
        for port in Self::dir_entries(&dir)? {
            let hosts = dir.join(&port).join(nqn);
            if !hosts.is_dir() {
                continue;
            }
            let id = port.parse::<u16>().map_err(|_| errno(libc::EINVAL))?;
            for host in Self::dir_entries(&hosts)? {
                out.push((id, host));
            }
        }
        out.sort();
        Ok(out)
    }

    pub(super) fn controllers_dir(&self) -> PathBuf {
        self.root.join(PRIVATE_DIR).join(CONTROLLERS)
    }

    pub(super) fn discovered_marker(&self, nqn: &str) -> PathBuf {
        self.root.join(PRIVATE_DIR).join("discovered").join(nqn)
    }

    pub(super) fn discovered(&self, nqn: &str) -> bool {
        self.discovered_marker(nqn).exists()
    }
}
