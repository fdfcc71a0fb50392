//! A builder for `sys/` and `dev/` trees in the layout a Linux NVMe/TCP host shows (see the
//! [`crate::sysfs`] module docs), for tests of code that reads them.
//!
//! What it reproduces: the `devices/virtual/...` directories with `class/` and `block/` symlinks
//! into them, each disk's `device` link to its parent, attribute files with the kernel's trailing
//! newline and formats (`%pU` UUIDs and NGUIDs, sizes in 512-byte sectors, `major:minor`), the
//! kernel's NGUID fallback in `uuid`, hidden per-path disks under multipath, and real block device
//! nodes in `dev/` (made with mknod(2), so building a tree needs CAP_MKNOD; the nodes are never
//! opened).
//!
//! What it does not: the kernel acting on writes. Writing `delete_controller` leaves `1` in the
//! file and the controller in place; [`FakeSysfs::deletes_requested`] reports those writes.

use std::fs;
use std::io;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use pillar_nvmet::Nguid;
use uuid::Uuid;

use crate::HostPaths;

/// Block major the fake gives its disks (the kernel's dynamic `blkext` major for NVMe).
pub const FAKE_BLOCK_MAJOR: u32 = 259;

/// A fake sysfs + dev tree under one root.
#[derive(Debug)]
pub struct FakeSysfs {
    paths: HostPaths,
    next_minor: u32,
}

/// One fabrics controller.
#[derive(Clone, Debug)]
pub struct FakeController {
    /// C in `nvmeC`.
    pub instance: u32,
    /// S of the `nvme-subsysS` it belongs to (add the subsystem first).
    pub subsys_instance: u32,
    pub hostnqn: String,
    pub traddr: String,
    pub trsvcid: u16,
    /// The `state` text, e.g. `live`.
    pub state: String,
}

/// One namespace, visible through the listed controllers.
#[derive(Clone, Debug)]
pub struct FakeNamespace {
    pub subsys_instance: u32,
    /// H in `nvmeSnH`.
    pub head_instance: u32,
    pub nsid: u32,
    /// Multipath on: one `nvmeSnH` under the subsystem plus hidden `nvmeScCnH` per controller.
    /// Off: one `nvmeCnH` per controller.
    pub multipath: bool,
    pub ctrl_instances: Vec<u32>,
    pub uuid: Option<Uuid>,
    pub nguid: Option<Nguid>,
    pub size_sectors: u64,
}

fn write_attr(path: &Path, value: &str) -> io::Result<()> {
    fs::write(path, format!("{value}\n"))
}

impl FakeSysfs {
    /// An empty host under `root` (`root/sys`, `root/dev`), with the nvme classes present.
    pub fn new(root: &Path) -> io::Result<Self> {
        let paths = HostPaths::under(root);
        for dir in [
            "class/nvme",
            "class/nvme-subsystem",
            "block",
            "devices/virtual/nvme-fabrics/ctl",
            "devices/virtual/nvme-subsystem",
        ] {
            fs::create_dir_all(paths.sys.join(dir))?;
        }
        fs::create_dir_all(&paths.dev)?;
        Ok(Self {
            paths,
            next_minor: 60000,
        })
    }

    /// The roots to pass to the functions under test.
    pub fn paths(&self) -> &HostPaths {
        &self.paths
    }

    fn subsys_dir(&self, s: u32) -> PathBuf {
        self.paths
            .sys
            .join(format!("devices/virtual/nvme-subsystem/nvme-subsys{s}"))
    }

    fn ctrl_dir(&self, c: u32) -> PathBuf {
        self.paths
            .sys
            .join(format!("devices/virtual/nvme-fabrics/ctl/nvme{c}"))
    }

    /// `nvme-subsysS` with its `subsysnqn`.
    pub fn add_subsystem(&mut self, instance: u32, nqn: &str) -> io::Result<()> {
        let dir = self.subsys_dir(instance);
        fs::create_dir_all(&dir)?;
        write_attr(&dir.join("subsysnqn"), nqn)?;
        write_attr(&dir.join("iopolicy"), "numa")?;
        write_attr(&dir.join("model"), "Linux")?;
        symlink(
            format!("../../devices/virtual/nvme-subsystem/nvme-subsys{instance}"),
            self.paths
                .sys
                .join(format!("class/nvme-subsystem/nvme-subsys{instance}")),
        )
    }

    /// A controller `nvmeC` of an existing subsystem.
    pub fn add_controller(&mut self, c: &FakeController) -> io::Result<()> {
        let sdir = self.subsys_dir(c.subsys_instance);
        let nqn = fs::read_to_string(sdir.join("subsysnqn"))?;
        let dir = self.ctrl_dir(c.instance);
        fs::create_dir_all(&dir)?;
        fs::write(dir.join("subsysnqn"), nqn)?;
        write_attr(&dir.join("state"), &c.state)?;
        write_attr(&dir.join("transport"), "tcp")?;
        write_attr(
            &dir.join("address"),
            &format!(
                "traddr={},trsvcid={},src_addr=192.0.2.1",
                c.traddr, c.trsvcid
            ),
        )?;
        write_attr(&dir.join("hostnqn"), &c.hostnqn)?;
        write_attr(&dir.join("hostid"), "f81d4fae-7dec-11d0-a765-00a0c91e6bf6")?;
        write_attr(&dir.join("cntlid"), &(c.instance + 1).to_string())?;
        // Write-only attributes: present and empty.
        fs::write(dir.join("delete_controller"), "")?;
        fs::write(dir.join("rescan_controller"), "")?;
        fs::write(dir.join("reset_controller"), "")?;
        symlink(
            format!("../../devices/virtual/nvme-fabrics/ctl/nvme{}", c.instance),
            self.paths
                .sys
                .join(format!("class/nvme/nvme{}", c.instance)),
        )?;
        symlink(
            format!("../../nvme-fabrics/ctl/nvme{}", c.instance),
            sdir.join(format!("nvme{}", c.instance)),
        )
    }

    /// Replaces a controller's `state`.
    pub fn set_state(&self, instance: u32, state: &str) -> io::Result<()> {
        write_attr(&self.ctrl_dir(instance).join("state"), state)
    }

    /// Controllers whose `delete_controller` was written with `1`, by instance.
    pub fn deletes_requested(&self) -> Vec<u32> {
        let Ok(iter) = fs::read_dir(self.paths.sys.join("devices/virtual/nvme-fabrics/ctl")) else {
            return Vec::new();
        };
        let mut out: Vec<u32> = iter
            .filter_map(|e| {
                let e = e.ok()?;
                let name = e.file_name().into_string().ok()?;
                let instance = name.strip_prefix("nvme")?.parse().ok()?;
                let written = fs::read_to_string(e.path().join("delete_controller")).ok()?;
                (written.trim() == "1").then_some(instance)
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Adds a namespace; returns the visible disk names it created.
    pub fn add_namespace(&mut self, ns: &FakeNamespace) -> io::Result<Vec<String>> {
        let mut visible = Vec::new();
        if ns.multipath {
            let name = format!("nvme{}n{}", ns.subsys_instance, ns.head_instance);
            let dir = self.subsys_dir(ns.subsys_instance).join(&name);
            self.add_disk(
                ns,
                &dir,
                &name,
                &format!("../../nvme-subsys{}", ns.subsys_instance),
                &format!(
                    "../devices/virtual/nvme-subsystem/nvme-subsys{}/{name}",
                    ns.subsys_instance
                ),
                false,
            )?;
            visible.push(name);
            for &c in &ns.ctrl_instances {
                let name = format!("nvme{}c{c}n{}", ns.subsys_instance, ns.head_instance);
                let dir = self.ctrl_dir(c).join(&name);
                self.add_disk(
                    ns,
                    &dir,
                    &name,
                    &format!("../../nvme{c}"),
                    &format!("../devices/virtual/nvme-fabrics/ctl/nvme{c}/{name}"),
                    true,
                )?;
            }
        } else {
            for &c in &ns.ctrl_instances {
                let name = format!("nvme{c}n{}", ns.head_instance);
                let dir = self.ctrl_dir(c).join(&name);
                self.add_disk(
                    ns,
                    &dir,
                    &name,
                    &format!("../../nvme{c}"),
                    &format!("../devices/virtual/nvme-fabrics/ctl/nvme{c}/{name}"),
                    false,
                )?;
                visible.push(name);
            }
        }
        Ok(visible)
    }

    fn add_disk(
        &mut self,
        ns: &FakeNamespace,
        dir: &Path,
        name: &str,
        device_link: &str,
        block_link: &str,
        hidden: bool,
    ) -> io::Result<()> {
        fs::create_dir_all(dir)?;
        let minor = self.next_minor;
        self.next_minor += 1;
        write_attr(&dir.join("dev"), &format!("{FAKE_BLOCK_MAJOR}:{minor}"))?;
        write_attr(&dir.join("size"), &ns.size_sectors.to_string())?;
        write_attr(&dir.join("nsid"), &ns.nsid.to_string())?;
        write_attr(&dir.join("hidden"), if hidden { "1" } else { "0" })?;
        // nvme_ns_attrs_are_visible and uuid_show: uuid hidden only when both are unset, and the
        // NGUID printed in its place when only the UUID is unset; nguid hidden when zero.
        match (ns.uuid, ns.nguid) {
            (Some(u), _) => write_attr(&dir.join("uuid"), &u.hyphenated().to_string())?,
            (None, Some(n)) => write_attr(&dir.join("uuid"), &n.to_string())?,
            (None, None) => {}
        }
        if let Some(n) = ns.nguid {
            write_attr(&dir.join("nguid"), &n.to_string())?;
        }
        let wwid = match (ns.uuid, ns.nguid) {
            (Some(u), _) => format!("uuid.{}", u.hyphenated()),
            (None, Some(n)) => format!("eui.{}", n.to_string().replace('-', "")),
            (None, None) => format!("nvme.0000-{}", ns.nsid),
        };
        write_attr(&dir.join("wwid"), &wwid)?;
        symlink(device_link, dir.join("device"))?;
        symlink(block_link, self.paths.sys.join("block").join(name))?;
        if !hidden {
            crate::sys::mknod_block(&self.paths.dev.join(name), FAKE_BLOCK_MAJOR, minor)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The fake must resolve the way the kernel's tree does, or the sysfs tests prove nothing.
    #[test]
    fn links_resolve_like_the_kernel_tree() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = FakeSysfs::new(dir.path()).unwrap();
        f.add_subsystem(0, "nqn.2014-08.com.example:a").unwrap();
        f.add_controller(&FakeController {
            instance: 0,
            subsys_instance: 0,
            hostnqn: "nqn.2014-08.com.example:h".into(),
            traddr: "192.0.2.10".into(),
            trsvcid: 4420,
            state: "live".into(),
        })
        .unwrap();
        let ns = FakeNamespace {
            subsys_instance: 0,
            head_instance: 1,
            nsid: 1,
            multipath: true,
            ctrl_instances: vec![0],
            uuid: None,
            nguid: None,
            size_sectors: 8,
        };
        assert_eq!(f.add_namespace(&ns).unwrap(), ["nvme0n1"]);
        let sys = &f.paths().sys;
        let canon = |p: &str| fs::canonicalize(sys.join(p)).unwrap();
        assert_eq!(
            canon("block/nvme0n1/device"),
            canon("class/nvme-subsystem/nvme-subsys0")
        );
        assert_eq!(canon("block/nvme0c0n1/device"), canon("class/nvme/nvme0"));
        assert_eq!(
            canon("class/nvme-subsystem/nvme-subsys0/nvme0"),
            canon("class/nvme/nvme0")
        );
        assert_eq!(
            fs::read_to_string(sys.join("class/nvme/nvme0/subsysnqn")).unwrap(),
            "nqn.2014-08.com.example:a\n"
        );
        assert!(!sys.join("block/nvme0n1/uuid").exists());
        assert!(f.paths().dev.join("nvme0n1").exists());
        assert!(!f.paths().dev.join("nvme0c0n1").exists());
    }
}
