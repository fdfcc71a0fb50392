//! Growing a staged filesystem to its device: NodeExpandVolume after the target grew the
//! namespace, and NodeStage of a filesystem made smaller than its device (a restore or clone
//! larger than its source carries the source's filesystem).
//!
//! Invariant: only a read-write stage's filesystem is ever grown (a read-only one is never
//! written, N5: NodeExpandVolume of a read-only stage answers FAILED_PRECONDITION before it
//! touches the device); a filesystem that cannot be grown is an error with the tool's words, never a
//! volume silently smaller than asked.

use std::path::Path;
use std::thread;
use std::time::Instant;

use pillar_host::{FsType, POLL_INTERVAL, StageMode, StagePhase};
use pillar_nvmet::VolumeId;

use super::NodeError;
use super::device::Device;
use super::engine::{Engine, exists};

/// How much larger than its filesystem a device must be for a stage to grow it: less is a tail
/// mkfs itself leaves unused (ext4 drops a last block group too small to hold its metadata).
const GROW_ON_STAGE_SLACK: u64 = 1 << 20;

impl Engine {
    /// NodeExpandVolume: returns the device's size after the expansion.
    pub(crate) fn expand(
        &self,
        volume: &VolumeId,
        volume_path: &Path,
        required_bytes: u64,
    ) -> Result<u64, NodeError> {
        let rec = match self.read_record(volume)? {
            Some(r) if r.phase == StagePhase::Mounted => r,
            _ => {
                return Err(NodeError::NotStagedHere {
                    volume: volume.to_string(),
                });
            }
        };
        if !exists(volume_path)? {
            return Err(NodeError::VolumePathMissing {
                path: volume_path.to_path_buf(),
            });
        }
        // Where a filesystem is grown, and that it may be: before the device is touched.
        let grow_at = match rec.mode {
            StageMode::Filesystem { fs_type } => Some((
                self.writable_mount(volume, &rec.staging_path, volume_path)?,
                fs_type,
            )),
            StageMode::Block => None,
        };
        let device = self.find_device(&rec)?;
        self.rescan(&rec.nqn)?;
        let size = self.wait_for_size(&device.path, required_bytes)?;
        if let Some((mount_path, fs_type)) = grow_at {
            self.kernel
                .grow_filesystem(&device.path, &mount_path, fs_type)
                .map_err(|source| NodeError::Grow {
                    device: device.path.clone(),
                    source: Box::new(source),
                })?;
        }
        tracing::info!(size, "expanded");
        Ok(size)
    }

    /// The mount a NodeExpandVolume grows the filesystem through: the staging path, else the
    /// volume path. A read-only one is refused (FAILED_PRECONDITION, the CSI code kubelet takes
    /// as "not on this node" without failing the pod's mount): a reader's filesystem is never
    /// written (N5); the read-write stage that comes next grows it (`grow_to_device`).
    fn writable_mount(
        &self,
        volume: &VolumeId,
        staging: &Path,
        volume_path: &Path,
    ) -> Result<std::path::PathBuf, NodeError> {
        // One read of the mount table per candidate: the mount found is the one checked.
        let (path, mount) = match self.check_mount(staging)? {
            Some(m) => (staging, m),
            None => match self.check_mount(volume_path)? {
                Some(m) => (volume_path, m),
                None => {
                    return Err(NodeError::NotMounted {
                        volume: volume.to_string(),
                        path: staging.to_path_buf(),
                    });
                }
            },
        };
        if mount.is_readonly() {
            return Err(NodeError::ExpandReadOnly {
                volume: volume.to_string(),
                path: path.to_path_buf(),
            });
        }
        Ok(path.to_path_buf())
    }

    /// The size of `device`, waiting up to the connect timeout for it to reach `wanted` bytes.
    fn wait_for_size(&self, device: &Path, wanted: u64) -> Result<u64, NodeError> {
        let start = Instant::now();
        let timeout = self.cfg.connect_timeout;
        loop {
            let size = self
                .kernel
                .device_size(device)
                .map_err(|source| NodeError::DeviceSize {
                    device: device.to_path_buf(),
                    source: Box::new(source),
                })?;
            if size >= wanted {
                return Ok(size);
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(NodeError::SizeNotReached {
                    device: device.to_path_buf(),
                    wanted,
                    found: size,
                    waited,
                });
            }
            thread::sleep(POLL_INTERVAL.min(timeout - waited));
        }
    }

    /// NodeStage of an existing filesystem, mounted read-write at `staging`: grows it when its
    /// device is larger than the filesystem's superblock says.
    pub(super) fn grow_to_device(
        &self,
        device: &Device,
        staging: &Path,
        fs_type: FsType,
    ) -> Result<(), NodeError> {
        let grow_err = |source| NodeError::Grow {
            device: device.path.clone(),
            source: Box::new(source),
        };
        let fs_bytes = self
            .kernel
            .filesystem_bytes(&device.path, fs_type)
            .map_err(grow_err)?;
        let device_bytes =
            self.kernel
                .device_size(&device.path)
                .map_err(|source| NodeError::DeviceSize {
                    device: device.path.clone(),
                    source: Box::new(source),
                })?;
        if device_bytes <= fs_bytes.saturating_add(GROW_ON_STAGE_SLACK) {
            return Ok(());
        }
        tracing::info!(
            fs_bytes,
            device_bytes,
            "filesystem smaller than its device: growing it"
        );
        self.kernel
            .grow_filesystem(&device.path, staging, fs_type)
            .map_err(grow_err)
    }
}
