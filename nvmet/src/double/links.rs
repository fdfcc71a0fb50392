//! Links (allowed hosts, a port's subsystems) and what linking a port enables: `admit_*`
//! before the plain `symlink`/`unlink`, `*_done` after it (see [`crate::rules`]).
//!
//! Invariants:
//! - Only `allowed_hosts/<host>` (to a host entry) and `ports/<p>/subsystems/<s>` (to a
//!   subsystem) are links; stored relative, as configfs returns them.
//! - Linking a host while `attr_allow_any_host=1`: EINVAL; the same target twice: EEXIST.
//! - The first subsystem linked to a port enables it: its transport and address are checked
//!   and an address another enabled port holds is EADDRINUSE.
//! - Unlinking a subsystem from a port deletes its controllers there; dropping an
//!   `allowed_hosts` link deletes none (W7).

use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::place::{Place, classify};
use super::{ConfigfsDouble, PORT_LINKS, PRIVATE_DIR, errno};
use crate::model::{PORTS, SUBSYSTEMS, normalize};

impl ConfigfsDouble {
    pub(super) fn port_linked(&self, port: &str) -> io::Result<bool> {
        Self::non_empty(&self.root.join(PORTS).join(port).join("subsystems"))
    }

    pub(super) fn port_link_marker(&self, port: &str, nqn: &str) -> PathBuf {
        self.root
            .join(PRIVATE_DIR)
            .join(PORT_LINKS)
            .join(port)
            .join(nqn)
    }

    /// Names of items that symlinks anywhere in the tree point to, as tree-relative paths.
    /// Links that vanish while this reads (another writer unlinking or removing its own
    /// subsystem, as the agent's concurrent changes of other volumes do) are skipped.
    pub(super) fn link_targets(&self) -> io::Result<Vec<PathBuf>> {
        let gone = |e: &io::Error| e.kind() == io::ErrorKind::NotFound;
        let mut targets = Vec::new();
        let mut read = |dir: PathBuf| -> io::Result<()> {
            let links = match Self::dir_entries(&dir) {
                Err(e) if gone(&e) => return Ok(()),
                other => other?,
            };
            for link in links {
                match self.resolve_link(&dir.join(link)) {
                    Ok(t) => targets.push(t),
                    Err(e) if gone(&e) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        };
        for sub in Self::dir_entries(&self.root.join(SUBSYSTEMS))? {
            read(self.root.join(SUBSYSTEMS).join(&sub).join("allowed_hosts"))?;
        }
        for port in Self::dir_entries(&self.root.join(PORTS))? {
            read(self.root.join(PORTS).join(&port).join("subsystems"))?;
        }
        Ok(targets)
    }

    pub(super) fn resolve_link(&self, link: &Path) -> io::Result<PathBuf> {
        let raw = fs::read_link(link)?;
        let abs = normalize(&link.parent().unwrap_or(Path::new("/")).join(raw));
        abs.strip_prefix(normalize(&self.root))
            .map(Path::to_path_buf)
            .map_err(|_| errno(libc::EPERM))
    }

    /// What the kernel checks when the first subsystem is linked to a port (nvmet_enable_port
    /// and the TCP transport's add_port), including a clash with another enabled port.
    pub(super) fn enable_port(&self, port: &str) -> io::Result<()> {
        let dir = self.root.join(PORTS).join(port);
        let trtype = self.attr(&dir.join("addr_trtype"))?;
        match trtype.as_str() {
            "loop" => return Ok(()),
            "tcp" => {}
            _ => return Err(errno(libc::EINVAL)),
        }
        let adrfam = self.attr(&dir.join("addr_adrfam"))?;
        let traddr = self.attr(&dir.join("addr_traddr"))?;
        let trsvcid = self.attr(&dir.join("addr_trsvcid"))?;
        let ip: IpAddr = traddr.parse().map_err(|_| errno(libc::EINVAL))?;
        let family_ok = matches!(
            (adrfam.as_str(), ip),
            ("ipv4", IpAddr::V4(_)) | ("ipv6", IpAddr::V6(_))
        );
        if !family_ok || trsvcid.parse::<u16>().is_err() {
            return Err(errno(libc::EINVAL));
        }
        for other in Self::dir_entries(&self.root.join(PORTS))? {
            if other == port || !self.port_linked(&other)? {
                continue;
            }
            let o = self.root.join(PORTS).join(&other);
            if self.attr(&o.join("addr_traddr"))? == traddr
                && self.attr(&o.join("addr_trsvcid"))? == trsvcid
            {
                return Err(errno(libc::EADDRINUSE));
            }
        }
        Ok(())
    }

    /// Whether configfs would make the link `link_rel` to `target_rel` (and enable the port it
    /// is the first subsystem of).
    pub(super) fn admit_symlink(&self, target_rel: &Path, link_rel: &Path) -> io::Result<()> {
        let link = self.at(link_rel)?;
        let target = self.at(target_rel)?;
        let place = classify(link_rel);
        if !matches!(
            place,
            Place::AllowedHostLink(..) | Place::PortSubsystemLink(..)
        ) {
            return Err(errno(libc::EPERM));
        }
        if !link.parent().is_some_and(Path::is_dir) {
            return Err(errno(libc::ENOENT));
        }
        if !target.exists() {
            return Err(errno(libc::ENOENT));
        }
        if !target.is_dir() {
            return Err(errno(libc::ENOTDIR));
        }
        if link.symlink_metadata().is_ok() {
            return Err(errno(libc::EEXIST));
        }
        let link_dir = link.parent().ok_or_else(|| errno(libc::EPERM))?;
        match (place, classify(target_rel)) {
            (Place::AllowedHostLink(nqn, _), Place::Host(_)) => {
                if self.attr(
                    &self
                        .root
                        .join(SUBSYSTEMS)
                        .join(nqn)
                        .join("attr_allow_any_host"),
                )? == "1"
                {
                    return Err(errno(libc::EINVAL));
                }
                // A subsystem has few host links: read them all.
                for l in Self::dir_entries(link_dir)? {
                    if self.resolve_link(&link_dir.join(l))? == target_rel {
                        return Err(errno(libc::EEXIST));
                    }
                }
                Ok(())
            }
            (Place::PortSubsystemLink(port, _), Place::Subsystem(target)) => {
                if self.port_link_marker(port, target).exists() {
                    return Err(errno(libc::EEXIST));
                }
                if !Self::non_empty(link_dir)? {
                    self.enable_port(port)?;
                }
                Ok(())
            }
            _ => Err(errno(libc::EINVAL)),
        }
    }

    /// The link `link_rel` to `target_rel` was made: it reads back relative, as configfs
    /// returns links (replaced in one rename, so no reader finds it missing), and a port's link
    /// is marked.
    pub(super) fn symlink_done(&self, target_rel: &Path, link_rel: &Path) -> io::Result<()> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let link = self.at(link_rel)?;
        // Relative, like configfs: from <root>/<a>/<b>/<c>/link, three levels up is the root.
        let depth = link_rel.components().count() - 1;
        let relative = Path::new(&"../".repeat(depth)).join(target_rel);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let temp = (self.root.join(PRIVATE_DIR)).join(format!("link.{}.{n}", std::process::id()));
        std::os::unix::fs::symlink(relative, &temp)?;
        fs::rename(&temp, &link)?;
        if let (Place::PortSubsystemLink(port, _), Place::Subsystem(target)) =
            (classify(link_rel), classify(target_rel))
        {
            let m = self.port_link_marker(port, target);
            if let Some(parent) = m.parent() {
                fs::create_dir_all(parent)?;
            }
            fs::write(m, b"")?;
        }
        Ok(())
    }

    /// Whether configfs would remove the link `rel`; the tree-relative item it names.
    pub(super) fn admit_unlink(&self, rel: &Path) -> io::Result<PathBuf> {
        let path = self.at(rel)?;
        let meta = path.symlink_metadata().map_err(|_| errno(libc::ENOENT))?;
        if meta.is_dir() {
            return Err(errno(libc::EISDIR));
        }
        if !meta.file_type().is_symlink() {
            return Err(errno(libc::EPERM));
        }
        self.resolve_link(&path)
    }

    /// The link `rel` to `target` was removed: unlinking a subsystem from a port deletes every
    /// controller of it on that port (nvmet_port_subsys_drop_link); dropping an allowed_hosts
    /// link deletes none.
    pub(super) fn unlink_done(&self, rel: &Path, target: &Path) -> io::Result<()> {
        if let Place::PortSubsystemLink(port, nqn) = classify(rel) {
            if let Place::Subsystem(linked) = classify(target) {
                let m = self.port_link_marker(port, linked);
                if m.exists() {
                    fs::remove_file(m)?;
                }
            }
            let dir = self.controllers_dir().join(port).join(nqn);
            if dir.is_dir() {
                fs::remove_dir_all(dir)?;
            }
        }
        Ok(())
    }
}
