//! The node operations, synchronous and free of gRPC: the service calls them on a blocking
//! thread while holding the volume's lock.

use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use pillar_host::mountinfo::MountEntry;
use pillar_host::{Formatted, FsType, Probe, StageMode, StagePhase, StageRecord, StageStore};
use pillar_nvmet::VolumeId;

use super::NodeError;
use super::config::NodeConfig;
use super::device::{Condition, Device, wants_reservation};
use super::kernel::Kernel;
use super::request::{Access, AttachTarget, Capability, StageContext};

/// The filesystem used when neither the capability nor the context names one.
pub const DEFAULT_FS: FsType = FsType::Ext4;

/// The node's state: its configuration, its stage records, and its kernel.
#[derive(Debug)]
pub(crate) struct Engine {
    pub cfg: NodeConfig,
    pub store: StageStore,
    pub kernel: Arc<dyn Kernel>,
}

/// What NodeGetVolumeStats reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Usage {
    pub bytes_total: u64,
    pub bytes_available: Option<u64>,
    pub bytes_used: Option<u64>,
    /// `(total, free, used)`; `None` for a block volume.
    pub inodes: Option<(u64, u64, u64)>,
    pub condition: Condition,
}

pub(super) fn mode_name(mode: &StageMode) -> String {
    match mode {
        StageMode::Block => "a block volume".into(),
        StageMode::Filesystem { fs_type } => format!("a {fs_type} filesystem"),
    }
}

pub(super) fn create_dir(path: &Path) -> Result<(), NodeError> {
    fs::create_dir_all(path).map_err(|source| NodeError::PrepareTarget {
        path: path.to_path_buf(),
        source,
    })
}

/// Whether `path` exists (without following a final symlink).
pub(super) fn exists(path: &Path) -> Result<bool, NodeError> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(NodeError::VolumePath {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The kernel's mount views and actions, with the engine's errors.
impl Engine {
    pub(super) fn check_mount(&self, path: &Path) -> Result<Option<MountEntry>, NodeError> {
        self.kernel
            .find_mount(path)
            .map_err(|source| NodeError::CheckMount {
                path: path.to_path_buf(),
                source: Box::new(source),
            })
    }

    /// Every mount of the node, to find a volume's other publications.
    pub(super) fn mount_table(&self, target: &Path) -> Result<Vec<MountEntry>, NodeError> {
        self.kernel
            .mount_table()
            .map_err(|source| NodeError::CheckMount {
                path: target.to_path_buf(),
                source: Box::new(source),
            })
    }

    pub(super) fn mounted(&self, path: &Path) -> Result<bool, NodeError> {
        self.kernel
            .is_mountpoint(path)
            .map_err(|source| NodeError::CheckMount {
                path: path.to_path_buf(),
                source: Box::new(source),
            })
    }

    pub(super) fn do_unmount(&self, path: &Path) -> Result<(), NodeError> {
        self.kernel
            .unmount(path)
            .map_err(|source| NodeError::Unmount {
                target: path.to_path_buf(),
                source: Box::new(source),
            })
    }

    /// `(major, minor)` of the block device node at `path`.
    fn devnum(&self, path: &Path) -> Result<(u32, u32), NodeError> {
        self.kernel
            .device_number(path)
            .map_err(|source| NodeError::VolumePath {
                path: path.to_path_buf(),
                source,
            })
    }
}

impl Engine {
    pub(super) fn read_record(&self, volume: &VolumeId) -> Result<Option<StageRecord>, NodeError> {
        // Rule C4: a corrupt record is an error, never "not staged".
        self.store
            .read(volume)
            .map_err(|source| NodeError::ReadRecord {
                volume: volume.to_string(),
                source: Box::new(source),
            })
    }

    fn write_record(&self, record: &StageRecord) -> Result<(), NodeError> {
        self.store
            .write(record)
            .map_err(|source| NodeError::WriteRecord {
                volume: record.volume.to_string(),
                source: Box::new(source),
            })
    }

    /// NodeStageVolume.
    pub(crate) fn stage(
        &self,
        volume: &VolumeId,
        staging: &Path,
        cap: &Capability,
        ctx: &StageContext,
    ) -> Result<(), NodeError> {
        let mode = cap.stage_mode(ctx.fs_type.unwrap_or(DEFAULT_FS));
        let read_only = super::request::stage_read_only(cap, ctx);
        if read_only && mode == StageMode::Block {
            return Err(NodeError::ReadonlyBlock {
                volume: volume.to_string(),
            });
        }
        if let Some(rec) = self.read_record(volume)?
            && self.already_staged(volume, staging, &rec, mode, read_only)?
        {
            return Ok(());
        }

        // Rule N2: the record exists, durably, before anything is attached.
        let mut record = self.new_record(volume, staging, cap, ctx, mode, read_only);
        self.write_record(&record)?;

        let device = self.attach(volume, &ctx.target)?;
        record.device = Some(device.hint.clone());
        record.phase = StagePhase::Connected;
        self.write_record(&record)?;
        // W9: hold the Write Exclusive reservation before anything is written to the device.
        if record.reservation {
            self.reserve(volume, &device)?;
        }

        if let StageMode::Filesystem { fs_type } = mode {
            let (flags, existing) =
                self.prepare_filesystem(&device, fs_type, cap, ctx, read_only)?;
            record.phase = StagePhase::Formatted;
            self.write_record(&record)?;
            self.mount_staging(volume, &device, staging, fs_type, read_only, &flags)?;
            // A restore or clone larger than its source holds the source's filesystem: grown to
            // the volume's size here, as no NodeExpandVolume follows a restore.
            if existing {
                self.grow_to_device(&device, staging, fs_type)?;
            }
        }
        // For a block volume nothing is mounted at the staging path: `Mounted` means "staged".
        record.phase = StagePhase::Mounted;
        self.write_record(&record)?;
        tracing::info!(device = %device.path.display(), "staged");
        Ok(())
    }

    /// A stage over an existing record: `true` when the volume is already staged as asked
    /// (nothing to do), `false` when the stage runs (again); an error when it is staged
    /// otherwise, or still in use at another staging path.
    fn already_staged(
        &self,
        volume: &VolumeId,
        staging: &Path,
        rec: &StageRecord,
        mode: StageMode,
        read_only: bool,
    ) -> Result<bool, NodeError> {
        if rec.staging_path != staging {
            let in_use = match rec.mode {
                StageMode::Block => rec.phase == StagePhase::Mounted,
                StageMode::Filesystem { .. } => self.mounted(&rec.staging_path)?,
            };
            if in_use {
                return Err(NodeError::StagedElsewhere {
                    volume: volume.to_string(),
                    staged: rec.staging_path.clone(),
                });
            }
            tracing::info!(old = %rec.staging_path.display(),
                "replacing a stage record whose staging path is no longer in use");
            return Ok(false);
        }
        if rec.phase != StagePhase::Mounted {
            return Ok(false);
        }
        if rec.mode != mode {
            return Err(NodeError::StagedIncompatibly {
                volume: volume.to_string(),
                staged: mode_name(&rec.mode),
                requested: mode_name(&mode),
            });
        }
        if let StageMode::Filesystem { fs_type } = mode
            && let Some(m) = self.check_mount(staging)?
            && m.fs_type == fs_type.as_str()
        {
            if !access_matches(&m, read_only) {
                return Err(NodeError::StagedIncompatibly {
                    volume: volume.to_string(),
                    staged: access(m.is_readonly()).into(),
                    requested: access(read_only).into(),
                });
            }
            self.reassert_on_restage(rec);
            tracing::info!("already staged");
            return Ok(true);
        }
        if mode == StageMode::Block {
            // Staged if the device is still there (found by NQN and verified); after a reboot
            // it is not, and the stage runs again.
            match self.find_device(rec) {
                Ok(_) => {
                    self.reassert_on_restage(rec);
                    tracing::info!("already staged");
                    return Ok(true);
                }
                Err(e) => tracing::info!(reason = %super::describe(&e),
                    "block volume recorded as staged but its device is gone; attaching again"),
            }
        }
        Ok(false)
    }

    /// The record a stage writes first (N2): phase `Connecting`, no device yet.
    fn new_record(
        &self,
        volume: &VolumeId,
        staging: &Path,
        cap: &Capability,
        ctx: &StageContext,
        mode: StageMode,
        read_only: bool,
    ) -> StageRecord {
        let (traddr, trsvcid) = match &ctx.target {
            AttachTarget::Nvme(o) => (o.traddr, o.trsvcid),
            AttachTarget::Local {
                traddr, trsvcid, ..
            } => (
                traddr.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
                trsvcid.unwrap_or(0),
            ),
        };
        StageRecord {
            volume: volume.clone(),
            nqn: ctx.nqn.clone(),
            hostnqn: self.cfg.host_nqn.clone(),
            traddr,
            trsvcid,
            device: None,
            staging_path: staging.to_path_buf(),
            mode,
            phase: StagePhase::Connecting,
            reservation: self.cfg.reservations
                && matches!(ctx.target, AttachTarget::Nvme(_))
                && wants_reservation(cap, read_only),
        }
    }

    /// The filesystem of a stage before its mount: formatted if blank (N3), or required as it
    /// is for a read-only stage (N5); returns the mount flags and whether the device already
    /// held the filesystem.
    fn prepare_filesystem(
        &self,
        device: &Device,
        fs_type: FsType,
        cap: &Capability,
        ctx: &StageContext,
        read_only: bool,
    ) -> Result<(Vec<String>, bool), NodeError> {
        let mut flags: Vec<String> = match &cap.access {
            Access::Mount { flags, .. } => flags.clone(),
            Access::Block => Vec::new(),
        };
        let mut existing = false;
        if read_only {
            // N5: never written, not even by a log replay; and never formatted.
            self.require_filesystem(device, fs_type)?;
            flags.push(fs_type.no_log_replay_option().to_owned());
        } else {
            existing = matches!(self.format(device, fs_type, ctx)?, Formatted::AlreadyHad(_));
        }
        // A clone or restore staged next to its source carries the source's UUID.
        if let Some(option) = fs_type.duplicate_uuid_option()
            && !flags.iter().any(|f| f == option)
        {
            flags.push(option.to_owned());
        }
        Ok((flags, existing))
    }

    /// A repeated NodeStage of a staged volume takes the reservation back if the target forgot
    /// it (W9), without preempting; a failure is logged, the stage stays as it is.
    fn reassert_on_restage(&self, rec: &StageRecord) {
        if let Some(message) = self.reassert(rec) {
            tracing::warn!(%message, "already staged, but without the NVMe reservation");
        }
    }

    /// A read-only stage never formats: the device must already hold `fs_type`.
    fn require_filesystem(&self, device: &Device, fs_type: FsType) -> Result<(), NodeError> {
        let found = self
            .kernel
            .probe(&device.path)
            .map_err(|source| NodeError::Format {
                device: device.path.clone(),
                fs: fs_type.to_string(),
                source: Box::new(source),
            })?;
        match found {
            Probe::Found(sig) if sig.as_fs() == Some(fs_type) => Ok(()),
            other => Err(NodeError::ReadOnlyWithoutFilesystem {
                device: device.path.clone(),
                fs: fs_type.to_string(),
                found: match other {
                    Probe::Found(sig) => sig.to_string(),
                    Probe::Blank => "a blank device".into(),
                },
            }),
        }
    }

    /// A read-only stage mounts without replaying the log (N5), so a log that needs recovery
    /// would show the filesystem as of its last checkpoint, without the changes its writer
    /// made durable just before a snapshot: refused (failing closed, C), never mounted stale.
    /// The check only reads the device.
    fn require_clean_log(
        &self,
        volume: &VolumeId,
        device: &Device,
        fs_type: FsType,
    ) -> Result<(), NodeError> {
        let dirty = self
            .kernel
            .log_needs_recovery(&device.path, fs_type)
            .map_err(|source| NodeError::CheckLog {
                device: device.path.clone(),
                fs: fs_type.to_string(),
                source: Box::new(source),
            })?;
        if dirty {
            return Err(NodeError::LogNeedsRecovery {
                volume: volume.to_string(),
                fs: fs_type.to_string(),
            });
        }
        Ok(())
    }

    /// Rule N3: formats the device only if it is blank.
    fn format(
        &self,
        device: &Device,
        fs_type: FsType,
        ctx: &StageContext,
    ) -> Result<Formatted, NodeError> {
        // Rule N3: format_if_blank formats only a blank device. The start of each step that
        // may block for long (probe and mkfs, mount, connect) is logged: where a stage hangs,
        // and what each step costs (the lane's attach-path benchmark reads these lines).
        tracing::info!(%fs_type, "formatting");
        let done = self
            .kernel
            .format_if_blank(&device.path, fs_type, &ctx.mkfs_options)
            .map_err(|source| NodeError::Format {
                device: device.path.clone(),
                fs: fs_type.to_string(),
                source: Box::new(source),
            })?;
        match &done {
            Formatted::Formatted => tracing::info!(%fs_type, "formatted a blank device"),
            Formatted::AlreadyHad(_) => {
                tracing::info!(%fs_type, "device already holds the filesystem")
            }
        }
        Ok(done)
    }

    /// Mounts the device at the staging path, or accepts the mount already there if it is this
    /// device's (a crash after mounting, before the record said so).
    fn mount_staging(
        &self,
        volume: &VolumeId,
        device: &Device,
        staging: &Path,
        fs_type: FsType,
        readonly: bool,
        flags: &[String],
    ) -> Result<(), NodeError> {
        create_dir(staging)?;
        if let Some(entry) = self.check_mount(staging)? {
            let want = self.devnum(&device.path)?;
            if (entry.major, entry.minor) != want {
                return Err(NodeError::StagingPathBusy {
                    path: staging.to_path_buf(),
                    found: format!("{}:{} ({})", entry.major, entry.minor, entry.source),
                    expected: format!("{}:{}", want.0, want.1),
                });
            }
            // N5: a read-only stage never takes a read-write mount of the device for its own
            // (nor a read-write stage a read-only one).
            if !access_matches(&entry, readonly) {
                return Err(NodeError::StagedIncompatibly {
                    volume: volume.to_string(),
                    staged: access(entry.is_readonly()).into(),
                    requested: access(readonly).into(),
                });
            }
            tracing::info!("already mounted at the staging path");
            return Ok(());
        }
        // Checked right before mounting, after a mount already there was judged: a read-write
        // mount found at the path is the refusal to report, and its log is dirty by nature.
        if readonly {
            self.require_clean_log(volume, device, fs_type)?;
        }
        tracing::info!(device = %device.path.display(), "mounting");
        self.kernel
            .mount(&device.path, staging, fs_type, readonly, flags)
            .map_err(|source| NodeError::Mount {
                target: staging.to_path_buf(),
                source: Box::new(source),
            })
    }

    /// NodeUnstageVolume.
    pub(crate) fn unstage(&self, volume: &VolumeId, staging: &Path) -> Result<(), NodeError> {
        let Some(rec) = self.read_record(volume)? else {
            // No record: never staged, or a crash after attach before the record was updated
            // (a mount exists then). The record is written before attaching, so without a mount
            // there is nothing of this volume's to undo.
            if self.mounted(staging)? {
                tracing::warn!("no stage record but the staging path is mounted; cleaning up");
                self.refuse_if_published(volume, staging)?;
                self.do_unmount(staging)?;
                self.detach(&volume.subsystem_nqn())?;
            } else {
                tracing::info!("not staged; nothing to do");
            }
            return Ok(());
        };
        if rec.staging_path != staging {
            // A volume is staged at one path per node, so the CO asks for this volume to leave
            // the node: a CO whose staging path changed (a kubelet upgrade) must not get OK
            // while the device stays mounted and connected, or the revoke that follows pulls it
            // from under the mount. Undo what the record holds.
            tracing::warn!(staged = %rec.staging_path.display(),
                "unstage names another path than the recorded one; unstaging the recorded path");
        }
        let staging = rec.staging_path.as_path();
        self.refuse_if_published(volume, staging)?;
        self.do_unmount(staging)?;
        // W9: best effort; the records and the ACL stay the durable fence.
        self.unreserve(&rec);
        self.detach(&rec.nqn)?;
        self.store
            .remove(volume)
            .map_err(|source| NodeError::RemoveRecord {
                volume: volume.to_string(),
                source: Box::new(source),
            })?;
        tracing::info!(phase = ?rec.phase, "unstaged");
        Ok(())
    }

    /// Refuses to unstage while the staged filesystem is still mounted elsewhere (a publish
    /// target): disconnecting would pull the device from under a running workload.
    fn refuse_if_published(&self, volume: &VolumeId, staging: &Path) -> Result<(), NodeError> {
        let Some(entry) = self.check_mount(staging)? else {
            return Ok(());
        };
        let table = self.mount_table(staging)?;
        let others: Vec<PathBuf> = table
            .into_iter()
            .filter(|m| (m.major, m.minor) == (entry.major, entry.minor))
            .filter(|m| m.mount_point != entry.mount_point)
            .map(|m| m.mount_point)
            .collect();
        if others.is_empty() {
            Ok(())
        } else {
            Err(NodeError::StillPublished {
                volume: volume.to_string(),
                mounts: others,
            })
        }
    }

    /// NodeGetVolumeStats.
    ///
    /// After a target restart the reservation is gone and is taken back here (W9, never
    /// preempting), but only under the volume's lock, taken with `lock` without waiting: an
    /// unstage releasing the reservation holds it, and a take-back racing that release would
    /// leave this host holding the reservation of a volume it no longer uses. When another
    /// operation holds the volume the reservation is left alone this time; kubelet asks again.
    pub(crate) fn stats<G>(
        &self,
        volume: &VolumeId,
        path: &Path,
        lock: impl FnOnce() -> Option<G>,
    ) -> Result<Usage, NodeError> {
        let meta = match fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(NodeError::VolumePathMissing {
                    path: path.to_path_buf(),
                });
            }
            Err(source) => {
                return Err(NodeError::VolumePath {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        let Some(rec) = self.read_record(volume)? else {
            return Err(NodeError::NotStagedHere {
                volume: volume.to_string(),
            });
        };
        let mut condition = self.condition(&rec);
        if !condition.abnormal && rec.phase == StagePhase::Mounted && rec.reservation {
            match lock() {
                None => tracing::debug!(
                    "another operation holds the volume; its NVMe reservation is not checked this time"
                ),
                Some(_held) => {
                    // Under the lock, the record as it is now: an unstage that finished in
                    // between removed it.
                    let now = self.read_record(volume)?;
                    if let Some(now) = now.filter(|r| r.phase == StagePhase::Mounted)
                        && let Some(message) = self.reassert(&now)
                    {
                        condition = Condition {
                            abnormal: true,
                            message,
                        };
                    }
                }
            }
        }
        if meta.file_type().is_block_device() {
            let total = self
                .kernel
                .device_size(path)
                .map_err(|source| NodeError::DeviceSize {
                    device: path.to_path_buf(),
                    source: Box::new(source),
                })?;
            return Ok(Usage {
                bytes_total: total,
                bytes_available: None,
                bytes_used: None,
                inodes: None,
                condition,
            });
        }
        if !self.mounted(path)? {
            return Err(NodeError::NotMounted {
                volume: volume.to_string(),
                path: path.to_path_buf(),
            });
        }
        let s = self
            .kernel
            .volume_stats(path)
            .map_err(|source| NodeError::Stats {
                path: path.to_path_buf(),
                source: Box::new(source),
            })?;
        Ok(Usage {
            bytes_total: s.bytes_total,
            bytes_available: Some(s.bytes_available),
            bytes_used: Some(s.bytes_used),
            inodes: Some((s.inodes_total, s.inodes_free, s.inodes_used)),
            condition,
        })
    }
}

pub(super) fn not_staged(volume: &VolumeId, staging: &Path) -> NodeError {
    NodeError::NotStaged {
        volume: volume.to_string(),
        staging: staging.to_path_buf(),
    }
}

/// Whether a mount found at a staging path gives the access a stage asks for. A read-only
/// stage takes only a mount that is read-only and whose filesystem is mounted read-only (so
/// nothing writes the device through it, N5); a read-write stage only a writable one.
pub(super) fn access_matches(entry: &MountEntry, read_only: bool) -> bool {
    if read_only {
        entry.is_readonly() && entry.super_options.split(',').any(|o| o == "ro")
    } else {
        !entry.is_readonly()
    }
}

/// How a mount's access is named in errors.
pub(super) fn access(read_only: bool) -> &'static str {
    if read_only { "read-only" } else { "read-write" }
}
