//! Making and removing items (mkdir, rmdir), with the groups and attributes the kernel gives a
//! new item and the refusals of its release.
//!
//! Each operation is two halves around the plain syscall (see [`crate::rules`]): `admit_*`
//! refuses as the kernel does, changing nothing (an rmdir it admits then clears the item's
//! attributes and default groups, which configfs removes with the directory and a plain `rmdir`
//! cannot), and `*_done` adds what the kernel does besides.
//!
//! Invariants:
//! - mkdir only where configfs has a group (EPERM elsewhere); a new item has the kernel's
//!   default groups and attributes, with random identities (a namespace's UUID, a subsystem's
//!   serial) so a plan that forgets identity is caught.
//! - rmdir of a link target is EBUSY, of an item with child items or links ENOTEMPTY, of a
//!   default group EPERM; a removed subsystem forgets that a host identified it.

use std::fs;
use std::io;
use std::path::Path;

use super::parse::kstrtou;
use super::place::{Place, classify};
use super::{ConfigfsDouble, PORT_LINKS, PRIVATE_DIR, RESERVATIONS, errno};
use crate::names::DISCOVERY_NQN;

impl ConfigfsDouble {
    /// Whether configfs would make the item `rel` (only where it has a group).
    pub(super) fn admit_mkdir(&self, rel: &Path) -> io::Result<()> {
        let path = self.at(rel)?;
        let parent_exists = path.parent().is_some_and(Path::is_dir);
        if !parent_exists {
            return Err(errno(libc::ENOENT));
        }
        if path.exists() {
            return Err(errno(libc::EEXIST));
        }
        match classify(rel) {
            Place::Subsystem(name) => {
                if name == DISCOVERY_NQN {
                    return Err(errno(libc::EINVAL));
                }
                if name.len() > 255 {
                    return Err(errno(libc::ENAMETOOLONG));
                }
                Ok(())
            }
            Place::Namespace(_, n) => {
                let nsid = kstrtou(n, u64::from(u32::MAX))?;
                if nsid == 0 || nsid == u64::from(u32::MAX) {
                    return Err(errno(libc::EINVAL));
                }
                Ok(())
            }
            Place::Port(p) => kstrtou(p, u64::from(u16::MAX))
                .map(drop)
                .map_err(|_| errno(libc::EINVAL)),
            Place::Host(_) => Ok(()),
            // Configfs has no make_group there: "Lack-of-mkdir returns -EPERM".
            _ => Err(errno(libc::EPERM)),
        }
    }

    /// The item `rel` was made: what the kernel gives it.
    pub(super) fn mkdir_done(&self, rel: &Path) -> io::Result<()> {
        let path = self.at(rel)?;
        match classify(rel) {
            Place::Subsystem(_) => self.make_subsystem(&path),
            Place::Namespace(..) => self.make_namespace(&path),
            Place::Port(_) => self.make_port(&path),
            Place::Host(_) => self.make_host(&path),
            _ => Err(errno(libc::EPERM)),
        }
    }

    /// A subsystem: its default groups and the kernel's attributes, with a random serial.
    fn make_subsystem(&self, path: &Path) -> io::Result<()> {
        fs::create_dir(path.join("namespaces"))?;
        fs::create_dir(path.join("allowed_hosts"))?;
        let serial: String = uuid::Uuid::new_v4().simple().to_string()[..20].to_owned();
        for (attr, value) in [
            ("attr_allow_any_host", "0"),
            ("attr_serial", serial.as_str()),
            ("attr_model", "Linux"),
            ("attr_version", "1.3"),
            ("attr_cntlid_min", "1"),
            ("attr_cntlid_max", "65519"),
            ("attr_qid_max", "128"),
        ] {
            self.set(&path.join(attr), value)?;
        }
        Ok(())
    }

    /// A namespace: a random UUID and a zero NGUID, like the kernel; `resv_enable` where the
    /// modelled kernel has reservations.
    fn make_namespace(&self, path: &Path) -> io::Result<()> {
        let uuid = uuid::Uuid::new_v4().hyphenated().to_string();
        let mut attrs = vec![
            ("device_path", "(null)"),
            ("device_uuid", uuid.as_str()),
            ("device_nguid", "00000000-0000-0000-0000-000000000000"),
            ("enable", "0"),
            ("ana_grpid", "1"),
            ("buffered_io", "0"),
            ("revalidate_size", ""),
        ];
        if self.reservations || self.root.join(PRIVATE_DIR).join(RESERVATIONS).exists() {
            attrs.push(("resv_enable", "0"));
        }
        for (attr, value) in attrs {
            self.set(&path.join(attr), value)?;
        }
        Ok(())
    }

    /// A port: its default groups (ANA group 1 optimized) and empty address attributes.
    fn make_port(&self, path: &Path) -> io::Result<()> {
        for group in ["subsystems", "referrals", "ana_groups", "ana_groups/1"] {
            fs::create_dir(path.join(group))?;
        }
        self.set(&path.join("ana_groups/1/ana_state"), "optimized")?;
        for (attr, value) in [
            ("addr_trtype", ""),
            ("addr_adrfam", ""),
            ("addr_traddr", ""),
            ("addr_trsvcid", ""),
            ("addr_treq", "not specified"),
            ("param_inline_data_size", "-1"),
        ] {
            self.set(&path.join(attr), value)?;
        }
        if self.tls_modelled() {
            // Shown empty until `addr_trtype` is written (no transport, no secure channel).
            self.set(&path.join(crate::model::ADDR_TSAS), "")?;
        }
        Ok(())
    }

    /// A host entry, with the `dhchap_*` attributes where the modelled kernel authenticates.
    fn make_host(&self, path: &Path) -> io::Result<()> {
        if self.auth_modelled() {
            for (attr, value) in [
                (crate::auth::DHCHAP_KEY, ""),
                (crate::auth::DHCHAP_CTRL_KEY, ""),
                (crate::auth::DHCHAP_HASH, "hmac(sha256)"),
                (crate::auth::DHCHAP_DHGROUP, "null"),
            ] {
                self.set(&path.join(attr), value)?;
            }
        }
        Ok(())
    }

    /// Whether configfs would remove the item `rel`; if so, clears what it holds besides its
    /// own directory (attributes and default groups, which configfs drops with it), so the plain
    /// `rmdir` that follows finds it empty.
    pub(super) fn admit_rmdir(&self, rel: &Path) -> io::Result<()> {
        let path = self.at(rel)?;
        let meta = path.symlink_metadata().map_err(|_| errno(libc::ENOENT))?;
        if !meta.is_dir() {
            return Err(errno(libc::ENOTDIR));
        }
        let linked = || -> io::Result<bool> { Ok(self.link_targets()?.iter().any(|t| t == rel)) };
        match classify(rel) {
            Place::Subsystem(nqn) => {
                // Linked from a port: the port-link markers say so without reading every link.
                let ports = self.root.join(PRIVATE_DIR).join(PORT_LINKS);
                let on_a_port = match fs::read_dir(&ports) {
                    Ok(entries) => entries
                        .map(|e| e.map(|e| e.path().join(nqn).exists()))
                        .collect::<io::Result<Vec<_>>>()?
                        .contains(&true),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => false,
                    Err(e) => return Err(e),
                };
                if on_a_port {
                    return Err(errno(libc::EBUSY));
                }
                if !Self::dir_entries(&path.join("namespaces"))?.is_empty()
                    || !Self::dir_entries(&path.join("allowed_hosts"))?.is_empty()
                {
                    return Err(errno(libc::ENOTEMPTY));
                }
            }
            Place::Namespace(..) => {} // the kernel disables an enabled namespace on release
            Place::Port(_) => {
                let extra_ana = Self::dir_entries(&path.join("ana_groups"))?
                    .iter()
                    .any(|g| g != "1");
                if !Self::dir_entries(&path.join("subsystems"))?.is_empty()
                    || !Self::dir_entries(&path.join("referrals"))?.is_empty()
                    || extra_ana
                {
                    return Err(errno(libc::ENOTEMPTY));
                }
            }
            Place::Host(_) => {
                if linked()? {
                    return Err(errno(libc::EBUSY));
                }
            }
            _ => return Err(errno(libc::EPERM)),
        }
        Self::clear(&path)
    }

    /// Removes everything inside the directory `path`, leaving it empty.
    fn clear(path: &Path) -> io::Result<()> {
        for entry in fs::read_dir(path)? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                fs::remove_dir_all(entry.path())?;
            } else {
                fs::remove_file(entry.path())?;
            }
        }
        Ok(())
    }

    /// The item `rel` was removed: what the kernel forgets with it.
    pub(super) fn rmdir_done(&self, rel: &Path) -> io::Result<()> {
        if let Place::Subsystem(nqn) = classify(rel) {
            // The kernel keeps "a host identified it" in the subsystem itself
            // (`subsys_discovered`), so it goes with it: a subsystem made again under the same
            // name takes a serial and a model again.
            match fs::remove_file(self.discovered_marker(nqn)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }
}
