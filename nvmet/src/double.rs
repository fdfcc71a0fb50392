//! A configfs test double: a plain directory tree laid out like `/sys/kernel/config/nvmet`, and an
//! executor that refuses, with the kernel's errno, everything the kernel refuses.
//!
//! It stands in for the kernel only where configfs cannot run (unit tests, the single-machine
//! mode on a kernel without nvmet); it is always named as a double, and the real kernel checks
//! the same plans in the kernel lane. Invariants it keeps, each taken from the kernel source
//! (drivers/nvme/target/configfs.c, fs/configfs) and listed in `docs/rules.md` (K2-K9):
//! - `device_path`, `device_uuid`, `device_nguid` on an enabled namespace: EBUSY;
//!   `resv_enable`, `buffered_io` on an enabled namespace: EINVAL;
//! - a port's `addr_*` while any subsystem is linked to it: EACCES;
//! - linking into `allowed_hosts` while `attr_allow_any_host=1`, or setting it to 1 while hosts
//!   are linked: EINVAL;
//! - `attr_serial` / `attr_model` after a host identified the subsystem: EINVAL (until the
//!   subsystem is removed: a subsystem made again under its name takes them);
//! - `enable` without `device_path`: EINVAL, with a missing device: ENOENT;
//! - `revalidate_size` on a disabled namespace: EINVAL;
//! - rmdir of a link target: EBUSY; of an item with child items or links: ENOTEMPTY; of a
//!   default group: EPERM; mkdir where configfs has no group: EPERM;
//! - links are stored relative (`readlink` gives `../../../...`), as configfs returns them;
//! - new namespaces get a random UUID and a zero NGUID, new subsystems a random serial, like the
//!   kernel, so a plan that forgets identity is caught;
//! - host entries of a kernel with authentication (the default; [`ConfigfsDouble::without_auth`]
//!   models one without, like Debian's 6.1) have `dhchap_key`, `dhchap_ctrl_key`,
//!   `dhchap_hash` (`hmac(sha256)`) and `dhchap_dhgroup` (`null`); a key must start
//!   `DHHC-1:<0-3>:` or be empty (clears it), a hash or group one the kernel names: EINVAL
//!   otherwise (the key's body is checked only when a host authenticates, as on 7.2). Without authentication the attributes do not exist: a write is ENOENT. A host
//!   whose entry has a key connects only presenting it (EACCES otherwise; with a controller
//!   key the host must also check the target's, which the double takes as given).
//! - ports of a kernel with TLS for the NVMe/TCP target (the default; [`ConfigfsDouble::without_tls`]
//!   models one without, like Debian's 6.1, where a write of `addr_tsas` is ENOENT) have
//!   `addr_tsas`: `none` or `tls1.3` on a TCP port (EINVAL otherwise), reset to `none` by a
//!   write of `addr_trtype`; `tls1.3` makes `addr_treq` `required` when it was `not specified`,
//!   and `addr_treq` `not specified` is EINVAL while it is `tls1.3` (docs/rules.md K31).
//!
//! It also models host controllers, the part of the kernel a tree cannot show: a host connects
//! through a port only while the subsystem is linked to it and the host is admitted; unlinking
//! the subsystem from a port deletes its controllers there, while removing a host from
//! `allowed_hosts` deletes none (docs/rules.md, fencing at the target). And it can record every
//! operation it applied, in order, so a test can assert the exact configfs sequence of a plan
//! run by code it cannot reach (the agent): [`ConfigfsDouble::record_ops`].
//!
//! The double is the kernel's rules ([`ConfigfsRules`]) over a plain tree: each operation is
//! admitted (refused with the kernel's errno, changing nothing), then made with the plain
//! syscalls an executor makes against configfs, then completed with the kernel's side effects (a
//! new item's attributes, the value as the kernel keeps it, links read back relative, the
//! private state below). Its own [`Executor`] makes those syscalls with
//! [`crate::KernelExecutor`]; the agent's engines make them with theirs (the io_uring engine's
//! chains), so a plan on the double runs the engine's configfs path as on the kernel.
//!
//! Where each part lives: `place` (which place of the tree a path is), `parse` (the kernel's
//! value parsers), `items` (mkdir, rmdir), `attrs` (attribute writes), `links` (symlink,
//! unlink, enabling a port), `controllers` (host connects and disconnects), `record` (the
//! operation record). This file holds the double's handle, its kernel-model switches and the
//! executor every plan runs through.

mod attrs;
mod controllers;
mod items;
mod links;
mod parse;
mod place;
mod record;
#[cfg(test)]
mod tests;

use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use crate::exec::Executor;
use crate::model::{HOSTS, PORTS, SUBSYSTEMS, read_attr};
use crate::plan::Op;
use crate::rules::{Admitted, ConfigfsRules, Then};

/// Where the double keeps state the real kernel keeps in memory (which subsystems a host has
/// identified, until the subsystem is removed). Outside the three nvmet directories, so readers
/// never see it.
const PRIVATE_DIR: &str = ".double";

/// Under [`PRIVATE_DIR`]: the record of applied operations, present only while recording. On
/// disk, so every handle on the same root (the agent clones its double per plan) records.
const OPS_LOG: &str = "ops.log";

/// Under [`PRIVATE_DIR`]: present when the double models a kernel with NVMe reservations.
const RESERVATIONS: &str = "reservations";

/// Under [`PRIVATE_DIR`]: present when the double models a kernel without NVMe in-band
/// authentication (no `dhchap_*` attributes on host entries).
const NO_AUTH: &str = "no-auth";

/// Under [`PRIVATE_DIR`]: present when the double models a kernel without TLS for the NVMe/TCP
/// target (no `addr_tsas` on ports).
const NO_TLS: &str = "no-tls";

/// Under [`PRIVATE_DIR`]: live host controllers, as `controllers/<port>/<subsystem>/<host>`.
const CONTROLLERS: &str = "controllers";

/// Under [`PRIVATE_DIR`]: which subsystems each port links, as `port-links/<port>/<subsystem>`,
/// so the double finds a duplicate link (EEXIST, whatever its name) without reading every link
/// of the port: the kernel walks its in-memory list, a directory walk would make the double's
/// cost grow with the port's links.
const PORT_LINKS: &str = "port-links";

/// The nvmet configfs test double rooted at a directory.
#[derive(Debug, Clone)]
pub struct ConfigfsDouble {
    root: PathBuf,
    reservations: bool,
    auth: bool,
}

fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

impl ConfigfsDouble {
    /// Creates an empty nvmet tree at `root` (or opens one the double made before), modelling a
    /// kernel without NVMe reservations (Linux < 6.13, like Debian bookworm's 6.1).
    pub fn create(root: impl Into<PathBuf>) -> io::Result<Self> {
        let root = root.into();
        for dir in [SUBSYSTEMS, PORTS, HOSTS] {
            fs::create_dir_all(root.join(dir))?;
        }
        fs::create_dir_all(root.join(PRIVATE_DIR).join("discovered"))?;
        let reservations = root.join(PRIVATE_DIR).join(RESERVATIONS).exists();
        let auth = !root.join(PRIVATE_DIR).join(NO_AUTH).exists();
        Ok(Self {
            root,
            reservations,
            auth,
        })
    }

    /// Models a kernel without NVMe in-band authentication (`CONFIG_NVME_TARGET_AUTH` not set,
    /// like Debian bookworm's 6.1): host entries have no `dhchap_*` attributes. Kept on disk for
    /// every handle on the same root, like [`Self::with_reservations`].
    #[must_use]
    pub fn without_auth(mut self) -> Self {
        self.auth = false;
        let _ = fs::write(self.root.join(PRIVATE_DIR).join(NO_AUTH), b"");
        self
    }

    fn auth_modelled(&self) -> bool {
        self.auth && !self.root.join(PRIVATE_DIR).join(NO_AUTH).exists()
    }

    /// Models a kernel without TLS for the NVMe/TCP target (`CONFIG_NVME_TARGET_TCP_TLS` not
    /// set, or older than 6.7, like Debian bookworm's 6.1): ports have no `addr_tsas`. Kept on
    /// disk for every handle on the same root.
    #[must_use]
    pub fn without_tls(self) -> Self {
        let _ = fs::write(self.root.join(PRIVATE_DIR).join(NO_TLS), b"");
        self
    }

    fn tls_modelled(&self) -> bool {
        !self.root.join(PRIVATE_DIR).join(NO_TLS).exists()
    }

    /// Models a kernel with NVMe reservations (`resv_enable` on namespaces, Linux >= 6.13), for
    /// this handle and every other handle on the same root (kept on disk, like the operation
    /// record, so a test can turn it on for an agent's double).
    #[must_use]
    pub fn with_reservations(mut self) -> Self {
        self.reservations = true;
        // A handle that cannot persist the marker still models reservations itself; handles
        // opened later would not, which a test relying on them notices.
        let _ = fs::write(self.root.join(PRIVATE_DIR).join(RESERVATIONS), b"");
        self
    }

    /// The root of the tree, to read with [`crate::observe`].
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn at(&self, rel: &Path) -> io::Result<PathBuf> {
        // Plans are relative; anything escaping the root is not the nvmet tree.
        if rel.is_absolute() || rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(errno(libc::EPERM));
        }
        Ok(self.root.join(rel))
    }

    fn attr(&self, path: &Path) -> io::Result<String> {
        read_attr(path).map_err(|_| errno(libc::ENOENT))
    }

    fn set(&self, path: &Path, value: &str) -> io::Result<()> {
        fs::write(path, format!("{value}\n"))
    }

    fn ns_enabled(&self, ns_dir: &Path) -> io::Result<bool> {
        Ok(self.attr(&ns_dir.join("enable"))? == "1")
    }

    fn dir_entries(path: &Path) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in fs::read_dir(path)? {
            out.push(e?.file_name().to_string_lossy().into_owned());
        }
        Ok(out)
    }

    /// Whether `dir` has an entry, reading only the first few.
    fn non_empty(dir: &Path) -> io::Result<bool> {
        Ok(crate::model::first_entry_except(dir, None)?.is_some())
    }
}

/// The double's executor: the kernel's rules around the plain syscalls
/// [`crate::KernelExecutor`] makes, exactly as an engine runs a plan on the double's root with
/// it as the rules ([`ConfigfsRules`]).
impl Executor for ConfigfsDouble {
    fn execute(&mut self, op: &Op) -> io::Result<()> {
        let root = self.root.clone();
        crate::rules::execute_ruled(self, &root, op)
    }
}

impl ConfigfsRules for ConfigfsDouble {
    fn admit(&self, op: &Op) -> io::Result<Admitted> {
        let then = match op {
            Op::Mkdir { path } => self.admit_mkdir(path).map(|()| Then::Nothing),
            Op::Write { path, value } => self.admit_write(path, value).map(Then::Store),
            Op::Symlink { target, link } => {
                self.admit_symlink(target, link).map(|()| Then::Nothing)
            }
            Op::Unlink { path } => self.admit_unlink(path).map(Then::Unlinked),
            Op::Rmdir { path } => self.admit_rmdir(path).map(|()| Then::Nothing),
        }?;
        Ok(Admitted(then))
    }

    fn complete(&self, op: &Op, admitted: Admitted) -> io::Result<()> {
        match (op, admitted.0) {
            (Op::Mkdir { path }, _) => self.mkdir_done(path),
            // The plain write left the bytes as given (and any longer old value's tail): the
            // attribute shows what the kernel keeps.
            (Op::Write { path, .. }, Then::Store(value)) => {
                self.set(&self.at(path)?, &value)?;
                self.port_write_done(path, &value)
            }
            (Op::Symlink { target, link }, _) => self.symlink_done(target, link),
            (Op::Unlink { path }, Then::Unlinked(target)) => self.unlink_done(path, &target),
            (Op::Rmdir { path }, _) => self.rmdir_done(path),
            // Admitted for another operation: the caller mixed up its plan.
            _ => Err(errno(libc::EINVAL)),
        }?;
        self.record(op)
    }
}
