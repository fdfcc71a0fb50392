//! The mount table of a host's kernel double: one mount per device (one superblock, never two
//! read-write mounts of a volume on a host, N5), a mount needs the device, an existing
//! directory, the filesystem its header names and nothing mounted there yet.

use std::path::{Path, PathBuf};

use pillar_host::{FsType, HostError, MountEntry};

use super::{NVME_MAJOR, SimKernel, mount_err};

impl SimKernel {
    pub(super) fn add_mount(&self, m: MountEntry) {
        let mut state = self.lock();
        state.next_mount += 1;
        let mount_id = state.next_mount;
        state.mounts.push(MountEntry { mount_id, ..m });
    }

    /// A mount of the filesystem on `dev`: the device node, its filesystem, the rules.
    pub(super) fn mount_fs(
        &self,
        dev: &Path,
        target: &Path,
        fs: FsType,
        readonly: bool,
        options: &[String],
    ) -> Result<MountEntry, HostError> {
        let fail = |e| mount_err(dev, target, fs.as_str(), e);
        let c = self.ctrl_of(dev).ok_or_else(|| fail(libc::ENXIO))?;
        if !target.is_dir() {
            return Err(fail(libc::ENOENT));
        }
        let devnum = (NVME_MAJOR, c.instance);
        {
            let state = self.lock();
            if state.mounts.iter().any(|m| m.mount_point == target) {
                return Err(fail(libc::EBUSY));
            }
            // One superblock per device: never a second mount of it (N5 at the host).
            if state.mounts.iter().any(|m| (m.major, m.minor) == devnum) {
                return Err(fail(libc::EBUSY));
            }
        }
        let found = self.read_fs(dev).map_err(|_| fail(libc::EIO))?;
        let Some(mut on_disk) = found.filter(|f| f.fs == fs) else {
            return Err(fail(libc::EINVAL));
        };
        let no_replay = options
            .iter()
            .any(|o| o == fs.no_log_replay_option() || o == "noload" || o == "norecovery");
        if !readonly {
            on_disk.dirty = true;
            self.write_fs(dev, on_disk).map_err(|_| fail(libc::EROFS))?;
        } else if on_disk.dirty && !no_replay {
            // A read-only mount replays a dirty log: a write all the same.
            on_disk.dirty = false;
            self.write_fs(dev, on_disk).map_err(|_| fail(libc::EROFS))?;
        }
        let access = if readonly { "ro" } else { "rw" };
        Ok(MountEntry {
            mount_id: 0,
            parent_id: 1,
            major: devnum.0,
            minor: devnum.1,
            root: PathBuf::from("/"),
            mount_point: target.to_path_buf(),
            mount_options: access.into(),
            fs_type: fs.as_str().into(),
            source: dev.display().to_string(),
            super_options: access.into(),
        })
    }
}
