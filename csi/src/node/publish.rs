//! NodePublishVolume and NodeUnpublishVolume: a staged volume bind-mounted (or its device
//! bind-mounted as a file, for raw block) at the workload's path, read-only when asked (N5),
//! and at most one workload's path at a time for SINGLE_NODE_SINGLE_WRITER.

use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use pillar_host::mountinfo::{self, MountEntry};
use pillar_host::{StageMode, StagePhase, StageRecord};
use pillar_nvmet::VolumeId;
use pillar_state::crd::AccessMode;

use super::NodeError;
use super::engine::{Engine, access, create_dir, exists, mode_name, not_staged};
use super::request::Capability;

/// Whether a publish found the publication already there or made it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Published {
    Already,
    Now,
}

/// SINGLE_NODE_SINGLE_WRITER: one publication (one workload) at a time on the node.
fn refuse_second_publication(volume: &VolumeId, other: Option<PathBuf>) -> Result<(), NodeError> {
    match other {
        Some(other) => Err(NodeError::PublishedAtAnotherPath {
            volume: volume.to_string(),
            other,
        }),
        None => Ok(()),
    }
}

impl Engine {
    /// NodePublishVolume.
    pub(crate) fn publish(
        &self,
        volume: &VolumeId,
        staging: &Path,
        target: &Path,
        cap: &Capability,
        readonly: bool,
    ) -> Result<(), NodeError> {
        let rec = match self.read_record(volume)? {
            Some(r) if r.phase == StagePhase::Mounted && r.staging_path == staging => r,
            _ => return Err(not_staged(volume, staging)),
        };
        let requested = if cap.is_block() {
            "a block volume".to_owned()
        } else {
            "a filesystem".to_owned()
        };
        let readonly = readonly || cap.reader_only();
        match (rec.mode, cap.is_block()) {
            (StageMode::Filesystem { .. }, false) => {
                let published = self.publish_filesystem(volume, staging, target, cap, readonly)?;
                if published == Published::Already {
                    return Ok(());
                }
            }
            (StageMode::Block, true) => {
                let published = self.publish_block(volume, &rec, target, cap, readonly)?;
                if published == Published::Already {
                    return Ok(());
                }
            }
            (staged, _) => {
                return Err(NodeError::PublishModeMismatch {
                    volume: volume.to_string(),
                    staged: mode_name(&staged),
                    requested,
                });
            }
        }
        tracing::info!(target = %target.display(), readonly, "published");
        Ok(())
    }

    /// NodePublish of a staged filesystem: a bind mount of the staging path at `target`.
    fn publish_filesystem(
        &self,
        volume: &VolumeId,
        staging: &Path,
        target: &Path,
        cap: &Capability,
        readonly: bool,
    ) -> Result<Published, NodeError> {
        let Some(staged) = self.check_mount(staging)? else {
            return Err(not_staged(volume, staging));
        };
        if let Some(existing) = self.check_mount(target)? {
            self.already_published(&staged, &existing, target, readonly)?;
            return Ok(Published::Already);
        }
        if cap.mode == AccessMode::SingleNodeSingleWriter {
            let table = self.mount_table(target)?;
            let other = mountinfo::binds_of(&table, &staged)
                .find(|p| *p != staged.mount_point && *p != target)
                .map(Path::to_path_buf);
            refuse_second_publication(volume, other)?;
        }
        create_dir(target)?;
        self.kernel
            .bind_mount(staging, target, readonly)
            .map_err(|source| NodeError::Mount {
                target: target.to_path_buf(),
                source: Box::new(source),
            })?;
        Ok(Published::Now)
    }

    /// NodePublish of a staged block volume: a bind mount of its device on a file at `target`.
    fn publish_block(
        &self,
        volume: &VolumeId,
        rec: &StageRecord,
        target: &Path,
        cap: &Capability,
        readonly: bool,
    ) -> Result<Published, NodeError> {
        if readonly {
            return Err(NodeError::ReadonlyBlock {
                volume: volume.to_string(),
            });
        }
        let device = self.find_device(rec)?;
        if self.mounted(target)? {
            tracing::info!("already published");
            return Ok(Published::Already);
        }
        if cap.mode == AccessMode::SingleNodeSingleWriter
            && let Some(name) = device.path.file_name().and_then(|n| n.to_str())
        {
            let table = self.mount_table(target)?;
            let other = mountinfo::device_binds(&table, name)
                .find(|p| *p != target)
                .map(Path::to_path_buf);
            refuse_second_publication(volume, other)?;
        }
        if let Some(parent) = target.parent() {
            create_dir(parent)?;
        }
        let created = !exists(target)?;
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(target)
            .map_err(|source| NodeError::PrepareTarget {
                path: target.to_path_buf(),
                source,
            })?;
        if let Err(source) = self.kernel.bind_mount(&device.path, target, false) {
            if created {
                let _ = fs::remove_file(target);
            }
            return Err(NodeError::Mount {
                target: target.to_path_buf(),
                source: Box::new(source),
            });
        }
        Ok(Published::Now)
    }

    fn already_published(
        &self,
        staged: &MountEntry,
        existing: &MountEntry,
        target: &Path,
        readonly: bool,
    ) -> Result<(), NodeError> {
        if (existing.major, existing.minor) != (staged.major, staged.minor) {
            return Err(NodeError::PublishedIncompatibly {
                path: target.to_path_buf(),
                found: format!("with device {}:{}", existing.major, existing.minor),
                requested: format!("this volume ({}:{})", staged.major, staged.minor),
            });
        }
        if existing.is_readonly() != readonly {
            return Err(NodeError::PublishedIncompatibly {
                path: target.to_path_buf(),
                found: access(existing.is_readonly()).into(),
                requested: access(readonly).into(),
            });
        }
        tracing::info!("already published");
        Ok(())
    }

    /// NodeUnpublishVolume.
    pub(crate) fn unpublish(&self, target: &Path) -> Result<(), NodeError> {
        self.do_unmount(target)?;
        let removed = match fs::symlink_metadata(target) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
            Ok(m) if m.is_dir() => fs::remove_dir(target),
            Ok(_) => fs::remove_file(target),
        };
        removed.map_err(|source| NodeError::RemoveTarget {
            path: target.to_path_buf(),
            source,
        })?;
        tracing::info!(target = %target.display(), "unpublished");
        Ok(())
    }
}
