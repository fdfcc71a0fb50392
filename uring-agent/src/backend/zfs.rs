//! The ZFS backend: one zvol `<parent>/<volume-id>` per volume, thick (ZFS reserves the whole
//! size), `volmode=dev` (no partition scanning of guest data on the storage node), marked with
//! the user property [`OWNER_PROPERTY`]`=`[`OWNER_VALUE`].
//!
//! Reads use scripting output (`zfs list -H -p`: tab-separated, no header, exact numbers);
//! only zvols directly under the parent that carry the owner property are listed, grown or
//! destroyed. A zvol of that name without it is [`BackendError::NotOwned`].
//!
//! Snapshots are `<zvol>@<snapshot-id>` marked [`SNAPSHOT_OWNER`]; restores are `zfs clone`s
//! of them and clones `zfs clone`s of a hidden `<zvol>@clone:<clone>` snapshot, cut by the
//! attempt that makes the clone (one a failed attempt left is destroyed first). ZFS ties
//! them together: a zvol is destroyed only once no snapshot and no clone depends on it
//! ([`BackendError::HasDependents`] names which does), a deleted snapshot with restored
//! volumes stays (`defer_destroy`) until they are gone, invisible to lookups. Restored and
//! cloned zvols share blocks with their origin and are not thick: they reserve no space.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pillar_nvmet::VolumeId;

use super::command::{CommandError, CommandRunner};
use super::{
    BackendError, Capacity, ContentSource, SnapshotInfo, VolumeInfo, checked_size,
    wait_for_device,
};

/// The program run for every ZFS operation.
pub const ZFS: &str = "zfs";

/// The user property marking zvols pillar created.
pub const OWNER_PROPERTY: &str = "io.pillar-csi:owner";

/// The value of [`OWNER_PROPERTY`] on pillar's zvols.
pub const OWNER_VALUE: &str = "pillar";

/// The value of [`OWNER_PROPERTY`] on snapshots pillar cut for CreateSnapshot.
pub const SNAPSHOT_OWNER: &str = "pillar-snapshot";

/// The value of [`OWNER_PROPERTY`] on the hidden snapshot a clone is made from.
pub const CLONE_ORIGIN_OWNER: &str = "pillar-clone-origin";

/// Hidden clone origins are `<source>@clone:<clone>`, deleted snapshots moved aside to free
/// their name `<zvol>@deleted:<id>:<guid>`: ':' is valid in ZFS names and never in a volume
/// or snapshot ID, so neither can take a snapshot's name.
const CLONE_ORIGIN_PREFIX: &str = "clone:";
const RETIRED_PREFIX: &str = "deleted:";

/// Allocation granularity: 16 KiB, OpenZFS's default `volblocksize` since 2.2 and a multiple
/// of the 8 KiB default before it (`volsize` must be a multiple of `volblocksize`).
pub const GRANULARITY: u64 = 16 << 10;

/// Longest dataset name ZFS accepts (ZFS_MAX_DATASET_NAME_LEN - 1).
const DATASET_NAME_MAX: usize = 255;

/// A zvol destroy ZFS calls busy is tried this many times, [`BUSY_PAUSE`] apart.
const BUSY_ATTEMPTS: u32 = 10;
const BUSY_PAUSE: Duration = Duration::from_millis(300);

/// How long to wait for udev to create `/dev/zvol/...` after a create.
const DEVICE_WAIT: Duration = Duration::from_secs(10);

/// zvols under one parent dataset.
#[derive(Debug)]
pub struct ZfsBackend {
    pool: String,
    parent: String,
    runner: Arc<dyn CommandRunner>,
    device_wait: Option<Duration>,
}

/// One line of `zfs list -Hp -t snapshot` (see [`ZfsBackend::snapshots`]).
#[derive(Debug)]
struct SnapRow {
    /// The zvol the snapshot is of.
    zvol: String,
    /// The part after '@'.
    short: String,
    volsize: u64,
    /// Epoch seconds.
    creation: u64,
    guid: String,
    /// `defer_destroy=on`: deleted, kept by ZFS for its clones.
    deferred: bool,
    /// Full names of the zvols cloned from it.
    clones: Vec<String>,
    owner: String,
}

impl SnapRow {
    fn full(&self) -> String {
        format!("{}@{}", self.zvol, self.short)
    }

    /// What this snapshot keeps its zvol for, named for the operator; `None` for a hidden
    /// one nothing depends on (a deleted snapshot or clone origin without clones).
    fn blocks_destroy(&self) -> Option<String> {
        let hidden = self.deferred || self.owner == CLONE_ORIGIN_OWNER;
        if hidden && self.clones.is_empty() {
            return None;
        }
        let clones = || {
            self.clones
                .iter()
                .map(|c| c.rsplit('/').next().unwrap_or(c))
                .collect::<Vec<_>>()
                .join(", ")
        };
        Some(if self.owner == CLONE_ORIGIN_OWNER {
            format!("volume {} (cloned from it)", clones())
        } else if self.deferred {
            format!(
                "volume {} (restored from its deleted snapshot {})",
                clones(),
                self.short
            )
        } else if self.owner == SNAPSHOT_OWNER {
            format!("snapshot {}", self.short)
        } else {
            format!("snapshot {} (not pillar's)", self.full())
        })
    }
}

/// One line of `zfs list -Hp -o name,volsize,<owner>`.
#[derive(Debug)]
struct ZvolRow {
    name: String,
    volsize: u64,
    owner: String,
}

impl ZfsBackend {
    /// Whether this pool takes snapshots and clones: ZFS pools always do.
    pub fn snapshots_supported(&self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Cuts `<parent>/<source>@<snapshot>`, marked [`OWNER_PROPERTY`]`=`[`SNAPSHOT_OWNER`].
    /// A ZFS snapshot is atomic (taken at a transaction group boundary), so a snapshot of a
    /// zvol being written is crash-consistent.
    pub async fn create_snapshot(
        &self,
        source: &VolumeId,
        snapshot: &VolumeId,
    ) -> Result<SnapshotInfo, BackendError> {
        // One listing answers both: does it exist, and does a kept deleted one hold its name.
        let rows = self.snapshots().await?;
        if let Some(i) = owned_snapshot(snapshot, &rows)? {
            return Ok(snapshot_info(snapshot, &rows[i]));
        }
        let zvol = self.dataset(source)?;
        let full = self.snapshot_name(&zvol, snapshot.as_str(), snapshot)?;
        let Some(row) = self.find(&zvol).await? else {
            return Err(BackendError::NotFound {
                volume: source.clone(),
            });
        };
        self.owned(source, row)?;
        // A deleted snapshot that ZFS keeps for its restored volumes may still hold the name.
        for old in &rows {
            if old.zvol == zvol && old.short == snapshot.as_str() && old.deferred {
                let aside = format!("{zvol}@{RETIRED_PREFIX}{}:{}", old.short, old.guid);
                let args = ["rename", &old.full(), &aside].map(String::from);
                self.run("zfs rename (deleted snapshot)", &args).await?;
            }
        }
        let args = [
            "snapshot",
            "-o",
            &format!("{OWNER_PROPERTY}={SNAPSHOT_OWNER}"),
            &full,
        ]
        .map(String::from);
        self.run("zfs snapshot", &args).await?;
        tracing::info!(%source, %snapshot, %full, method = "zfs", "cut snapshot");
        let mut info = self.lookup_snapshot(snapshot).await?.ok_or_else(|| {
            BackendError::SnapshotNotFound {
                snapshot: snapshot.clone(),
            }
        })?;
        info.method = Some("zfs");
        Ok(info)
    }

    /// The snapshot, or `None` (a deleted one that ZFS keeps for its clones is `None`).
    pub async fn lookup_snapshot(
        &self,
        snapshot: &VolumeId,
    ) -> Result<Option<SnapshotInfo>, BackendError> {
        Ok(self
            .find_snapshot(snapshot)
            .await?
            .map(|row| snapshot_info(snapshot, &row)))
    }

    /// `zfs destroy -d`: with no restored volumes the snapshot goes at once; with some, ZFS
    /// marks it `defer_destroy` and removes it when the last of them is destroyed. Either way
    /// it is gone for CSI. `Ok` if it does not exist.
    pub async fn delete_snapshot(&self, snapshot: &VolumeId) -> Result<(), BackendError> {
        let Some(row) = self.find_snapshot(snapshot).await? else {
            return Ok(());
        };
        let args = ["destroy", "-d", &row.full()].map(String::from);
        self.run("zfs destroy (snapshot)", &args).await?;
        if row.clones.is_empty() {
            tracing::info!(%snapshot, full = %row.full(), "destroyed snapshot");
        } else {
            tracing::info!(%snapshot, full = %row.full(), clones = ?row.clones,
                "snapshot deleted; ZFS keeps it until the volumes restored from it are deleted");
        }
        Ok(())
    }

    /// Creates `volume` as a `zfs clone` of a snapshot (restore) or of a hidden snapshot
    /// `<source>@clone:<volume>` (clone, destroyed with `-d` at once so it goes with the
    /// clone), grown to `size_bytes` if larger. A clone shares its origin's blocks: the
    /// origin zvol cannot be destroyed while it lives ([`BackendError::HasDependents`]).
    pub async fn create_from(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
        source: &ContentSource,
    ) -> Result<VolumeInfo, BackendError> {
        let name = self.dataset(volume)?;
        let size = checked_size(size_bytes, GRANULARITY)?;
        if let Some(row) = self.find(&name).await? {
            // A retry: finish what the first call may have left undone.
            let row = self.owned(volume, row)?;
            if let ContentSource::Volume(id) = source {
                self.defer_clone_origin(&self.dataset(id)?, volume).await?;
            }
            if row.volsize < size {
                return self.expand(volume, size).await;
            }
            return self.create(volume, size).await;
        }
        // Checked before anything is cut: a refused clone leaves no hidden origin behind.
        let refuse_smaller = |source_bytes: u64| {
            if size < source_bytes {
                return Err(BackendError::SmallerThanSource {
                    volume: volume.clone(),
                    source_bytes,
                    requested: size,
                });
            }
            Ok(source_bytes)
        };
        let (origin, source_bytes) = match source {
            ContentSource::Snapshot(id) => {
                let row = self.find_snapshot(id).await?.ok_or_else(|| {
                    BackendError::SnapshotNotFound {
                        snapshot: id.clone(),
                    }
                })?;
                (row.full(), refuse_smaller(row.volsize)?)
            }
            ContentSource::Volume(id) => {
                let zvol = self.dataset(id)?;
                let row = self
                    .find(&zvol)
                    .await?
                    .ok_or_else(|| BackendError::NotFound { volume: id.clone() })?;
                let row = self.owned(id, row)?;
                let source_bytes = refuse_smaller(row.volsize)?;
                (self.clone_origin(&zvol, volume).await?, source_bytes)
            }
        };
        let args = [
            "clone",
            "-o",
            "volmode=dev",
            "-o",
            &format!("{OWNER_PROPERTY}={OWNER_VALUE}"),
            &origin,
            &name,
        ]
        .map(String::from);
        self.run("zfs clone", &args).await?;
        tracing::info!(%volume, source = %source.id(), %origin, "cloned zvol from its source");
        if let ContentSource::Volume(id) = source {
            self.defer_clone_origin(&self.dataset(id)?, volume).await?;
        }
        if size > source_bytes {
            let args = ["set", &format!("volsize={size}"), &name].map(String::from);
            self.run("zfs set volsize", &args).await?;
        }
        self.info(volume, size).await
    }

    /// The hidden snapshot `<zvol>@clone:<clone>` a clone is made from, cut now. Called only
    /// while the clone does not exist: one found is left by an attempt whose `zfs clone`
    /// failed, maybe long ago (or by an earlier lifecycle of the same volume ID), and holds the
    /// source as it was then; it is destroyed and cut anew, so the clone holds the source as it
    /// is when the clone is made. A snapshot of that name that is not pillar's hidden origin,
    /// or one something was cloned from, is left alone and refused.
    async fn clone_origin(&self, zvol: &str, clone: &VolumeId) -> Result<String, BackendError> {
        let short = format!("{CLONE_ORIGIN_PREFIX}{clone}");
        let full = self.snapshot_name(zvol, &short, clone)?;
        let found = self
            .snapshots()
            .await?
            .into_iter()
            .find(|s| s.zvol == zvol && s.short == short);
        if let Some(stale) = found {
            if stale.owner != CLONE_ORIGIN_OWNER || !stale.clones.is_empty() || stale.deferred {
                return Err(BackendError::NotOwned {
                    volume: clone.clone(),
                    object: format!("snapshot {full}"),
                    reason: "not an unused hidden clone origin pillar cut",
                });
            }
            let args = ["destroy", &full].map(String::from);
            self.run("zfs destroy (stale clone origin)", &args).await?;
            tracing::info!(%clone, origin = %full, "destroyed the hidden origin of a failed clone attempt");
        }
        let args = [
            "snapshot",
            "-o",
            &format!("{OWNER_PROPERTY}={CLONE_ORIGIN_OWNER}"),
            &full,
        ]
        .map(String::from);
        self.run("zfs snapshot (clone origin)", &args).await?;
        Ok(full)
    }

    /// Marks the clone's hidden origin snapshot for destruction with its clone.
    async fn defer_clone_origin(&self, zvol: &str, clone: &VolumeId) -> Result<(), BackendError> {
        let short = format!("{CLONE_ORIGIN_PREFIX}{clone}");
        for row in self.snapshots().await? {
            if row.zvol == zvol && row.short == short && !row.deferred {
                let args = ["destroy", "-d", &row.full()].map(String::from);
                self.run("zfs destroy -d (clone origin)", &args).await?;
            }
        }
        Ok(())
    }

    /// The live snapshot `snapshot` of any zvol under the parent; [`BackendError::NotOwned`]
    /// if it is not one pillar cut.
    async fn find_snapshot(&self, snapshot: &VolumeId) -> Result<Option<SnapRow>, BackendError> {
        let mut rows = self.snapshots().await?;
        Ok(owned_snapshot(snapshot, &rows)?.map(|i| rows.swap_remove(i)))
    }

    /// Why `volume` cannot be destroyed yet, if it cannot: a snapshot of it, or a clone made
    /// from it (directly, or restored from one of its deleted snapshots). No changes.
    pub async fn deletion_blocked_by(
        &self,
        volume: &VolumeId,
    ) -> Result<Option<String>, BackendError> {
        let zvol = self.dataset(volume)?;
        Ok(self
            .snapshots()
            .await?
            .iter()
            .filter(|row| row.zvol == zvol)
            .find_map(SnapRow::blocks_destroy))
    }

    /// `<zvol>@<short>`, refused past ZFS's name length limit.
    fn snapshot_name(
        &self,
        zvol: &str,
        short: &str,
        id: &VolumeId,
    ) -> Result<String, BackendError> {
        let name = format!("{zvol}@{short}");
        if name.len() > DATASET_NAME_MAX {
            return Err(BackendError::UnsupportedName {
                volume: id.clone(),
                backend: "zfs",
                reason: format!("snapshot name {name:?} exceeds {DATASET_NAME_MAX} bytes"),
            });
        }
        Ok(name)
    }

    /// Snapshots of the zvols directly under the parent.
    async fn snapshots(&self) -> Result<Vec<SnapRow>, BackendError> {
        let fields = format!("name,volsize,creation,guid,defer_destroy,clones,{OWNER_PROPERTY}");
        let args = [
            "list",
            "-Hp",
            "-t",
            "snapshot",
            "-o",
            &fields,
            "-d",
            "2",
            &self.parent,
        ]
        .map(String::from);
        let out = self.run("zfs list (snapshots)", &args).await?;
        let text = report_text("zfs list (snapshots)", &out)?;
        let prefix = format!("{}/", self.parent);
        let mut rows = Vec::new();
        for line in text.lines().filter(|l| !l.is_empty()) {
            let fields: Vec<&str> = line.split('\t').collect();
            let bad = || BackendError::ReportValue {
                what: "zfs list (snapshots)",
                value: line.to_owned(),
            };
            let [name, volsize, creation, guid, deferred, clones, owner] = fields.as_slice() else {
                return Err(bad());
            };
            let (zvol, short) = name.split_once('@').ok_or_else(bad)?;
            if zvol
                .strip_prefix(&prefix)
                .is_none_or(|rest| rest.contains('/'))
            {
                continue;
            }
            rows.push(SnapRow {
                zvol: zvol.to_owned(),
                short: short.to_owned(),
                volsize: parse_number("zfs list volsize (snapshot)", volsize)?,
                creation: parse_number("zfs list creation", creation)?,
                guid: (*guid).to_owned(),
                deferred: *deferred == "on",
                clones: clones
                    .split(',')
                    .filter(|c| !c.is_empty() && *c != "-")
                    .map(str::to_owned)
                    .collect(),
                owner: (*owner).to_owned(),
            });
        }
        Ok(rows)
    }

    /// A backend for zvols directly under dataset `parent`.
    pub fn new(
        pool: &str,
        parent: &str,
        runner: Arc<dyn CommandRunner>,
    ) -> Result<Self, BackendError> {
        let valid = !parent.is_empty()
            && parent.len() < DATASET_NAME_MAX
            && parent.split('/').all(|c| {
                !c.is_empty()
                    && c != "."
                    && c != ".."
                    && c.bytes().all(|b| {
                        b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b':' | b'.' | b' ')
                    })
            });
        if !valid {
            return Err(BackendError::InvalidConfig {
                pool: pool.to_owned(),
                reason: format!("{parent:?} is not a valid ZFS dataset name"),
            });
        }
        Ok(Self {
            pool: pool.to_owned(),
            parent: parent.to_owned(),
            runner,
            device_wait: Some(DEVICE_WAIT),
        })
    }

    /// The same backend waiting up to `wait` for `/dev/zvol/...` to appear after a create
    /// (`None`: do not check; for tests with a fake runner).
    #[must_use]
    #[cfg(any(test, feature = "test-seams"))]
    pub fn with_device_wait(mut self, wait: Option<Duration>) -> Self {
        self.device_wait = wait;
        self
    }

    /// `size_bytes` rounded up to a multiple of 16 KiB.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn round_size(&self, size_bytes: u64) -> u64 {
        super::round_up(size_bytes, GRANULARITY)
    }

    pub async fn create(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
    ) -> Result<VolumeInfo, BackendError> {
        let name = self.dataset(volume)?;
        let size = checked_size(size_bytes, GRANULARITY)?;
        if let Some(row) = self.find(&name).await? {
            let row = self.owned(volume, row)?;
            if row.volsize != size {
                return Err(BackendError::SizeMismatch {
                    volume: volume.clone(),
                    existing: row.volsize,
                    requested: size,
                });
            }
            return self.info(volume, row.volsize).await;
        }
        let args = [
            "create",
            "-V",
            &size.to_string(),
            "-o",
            "volmode=dev",
            "-o",
            &format!("{OWNER_PROPERTY}={OWNER_VALUE}"),
            &name,
        ]
        .map(String::from);
        self.run("zfs create", &args).await?;
        tracing::info!(pool = %self.pool, %volume, size, dataset = %name, "created zvol");
        self.info(volume, size).await
    }

    pub async fn expand(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
    ) -> Result<VolumeInfo, BackendError> {
        let name = self.dataset(volume)?;
        let size = checked_size(size_bytes, GRANULARITY)?;
        let Some(row) = self.find(&name).await? else {
            return Err(BackendError::NotFound {
                volume: volume.clone(),
            });
        };
        let row = self.owned(volume, row)?;
        if size < row.volsize {
            return Err(BackendError::ShrinkRefused {
                volume: volume.clone(),
                current: row.volsize,
                requested: size,
            });
        }
        if size > row.volsize {
            // ZFS resizes the zvol's block device itself when volsize changes.
            let args = ["set", &format!("volsize={size}"), &name].map(String::from);
            self.run("zfs set volsize", &args).await?;
            tracing::info!(%volume, from = row.volsize, to = size, "grew zvol");
        }
        self.info(volume, size).await
    }

    pub async fn delete(&self, volume: &VolumeId) -> Result<(), BackendError> {
        let name = self.dataset(volume)?;
        let Some(row) = self.find(&name).await? else {
            return Ok(());
        };
        self.owned(volume, row)?;
        let snapshots: Vec<SnapRow> = self
            .snapshots()
            .await?
            .into_iter()
            .filter(|row| row.zvol == name)
            .collect();
        if let Some(dependent) = snapshots.iter().find_map(SnapRow::blocks_destroy) {
            return Err(BackendError::HasDependents {
                volume: volume.clone(),
                dependent,
            });
        }
        // Hidden clone origins whose clone is gone (a crash before their `destroy -d`):
        // nothing depends on them.
        for row in snapshots.iter().filter(|r| !r.deferred) {
            let args = ["destroy", &row.full()].map(String::from);
            self.run("zfs destroy (unused clone origin)", &args).await?;
        }
        self.destroy_zvol(&name).await?;
        tracing::info!(%volume, dataset = %name, "destroyed zvol");
        Ok(())
    }

    pub async fn lookup(&self, volume: &VolumeId) -> Result<Option<VolumeInfo>, BackendError> {
        let name = self.dataset(volume)?;
        let Some(row) = self.find(&name).await? else {
            return Ok(None);
        };
        let Ok(row) = self.owned(volume, row) else {
            return Ok(None);
        };
        self.info(volume, row.volsize).await.map(Some)
    }

    pub async fn list(&self) -> Result<Vec<VolumeInfo>, BackendError> {
        let prefix = format!("{}/", self.parent);
        let mut volumes = Vec::new();
        for row in self.zvols().await? {
            let Some(volume) = row
                .name
                .strip_prefix(&prefix)
                .filter(|rest| !rest.contains('/'))
                .and_then(|rest| VolumeId::parse(rest).ok())
            else {
                continue;
            };
            if row.owner == OWNER_VALUE {
                volumes.push(self.info(&volume, row.volsize).await?);
            }
        }
        volumes.sort_by(|a, b| a.volume.cmp(&b.volume));
        Ok(volumes)
    }

    /// The parent's `used + available` and `available` (thick zvols count fully as used).
    pub async fn capacity(&self) -> Result<Capacity, BackendError> {
        let args = ["list", "-Hp", "-o", "used,available", &self.parent].map(String::from);
        let out = self.run("zfs list (capacity)", &args).await?;
        let text = report_text("zfs list (capacity)", &out)?;
        let line = text.lines().next().unwrap_or_default();
        let fields: Vec<&str> = line.split('\t').collect();
        let [used, available] = fields.as_slice() else {
            return Err(BackendError::ReportValue {
                what: "zfs list used,available",
                value: line.to_owned(),
            });
        };
        let used = parse_number("zfs list used", used)?;
        let available = parse_number("zfs list available", available)?;
        Ok(Capacity {
            total_bytes: used.saturating_add(available),
            available_bytes: available,
        })
    }

    fn dataset(&self, volume: &VolumeId) -> Result<String, BackendError> {
        let name = format!("{}/{}", self.parent, volume.as_str());
        if name.len() > DATASET_NAME_MAX {
            return Err(BackendError::UnsupportedName {
                volume: volume.clone(),
                backend: "zfs",
                reason: format!("dataset name {name:?} exceeds {DATASET_NAME_MAX} bytes"),
            });
        }
        Ok(name)
    }

    fn device_path(&self, volume: &VolumeId) -> PathBuf {
        PathBuf::from(format!("/dev/zvol/{}/{}", self.parent, volume.as_str()))
    }

    fn owned(&self, volume: &VolumeId, row: ZvolRow) -> Result<ZvolRow, BackendError> {
        if row.owner == OWNER_VALUE {
            return Ok(row);
        }
        Err(BackendError::NotOwned {
            volume: volume.clone(),
            object: format!("zvol {}", row.name),
            reason: "no io.pillar-csi:owner=pillar property",
        })
    }

    async fn info(&self, volume: &VolumeId, size: u64) -> Result<VolumeInfo, BackendError> {
        let device_path = self.device_path(volume);
        wait_for_device(&device_path, self.device_wait).await?;
        Ok(VolumeInfo {
            volume: volume.clone(),
            size_bytes: size,
            device_path,
        })
    }

    /// The zvol `name` if it exists. The parent's children are listed and filtered here, so
    /// a missing zvol is an empty answer rather than an error message to recognise.
    async fn find(&self, name: &str) -> Result<Option<ZvolRow>, BackendError> {
        Ok(self.zvols().await?.into_iter().find(|r| r.name == name))
    }

    /// zvols directly under the parent.
    async fn zvols(&self) -> Result<Vec<ZvolRow>, BackendError> {
        let fields = format!("name,volsize,{OWNER_PROPERTY}");
        let args = [
            "list",
            "-Hp",
            "-o",
            &fields,
            "-t",
            "volume",
            "-d",
            "1",
            &self.parent,
        ]
        .map(String::from);
        let out = self.run("zfs list", &args).await?;
        let text = report_text("zfs list", &out)?;
        let mut rows = Vec::new();
        for line in text.lines().filter(|l| !l.is_empty()) {
            let fields: Vec<&str> = line.split('\t').collect();
            let [name, volsize, owner] = fields.as_slice() else {
                return Err(BackendError::ReportValue {
                    what: "zfs list name,volsize,owner",
                    value: line.to_owned(),
                });
            };
            rows.push(ZvolRow {
                name: (*name).to_owned(),
                volsize: parse_number("zfs list volsize", volsize)?,
                owner: (*owner).to_owned(),
            });
        }
        Ok(rows)
    }

    /// `zfs destroy` of a zvol, retried a few times while ZFS says it is busy: udev probes a
    /// block device after the last writer closes it (the inotify watch of the persistent
    /// storage rules), so a zvol just released by nvmet can be open for a moment.
    async fn destroy_zvol(&self, name: &str) -> Result<(), BackendError> {
        let args = ["destroy", name].map(String::from);
        let mut attempt = 1;
        loop {
            match self.runner.run(ZFS, &args).await {
                Ok(_) => return Ok(()),
                Err(CommandError::Failed { stderr, .. })
                    if stderr.contains("dataset is busy") && attempt < BUSY_ATTEMPTS =>
                {
                    tracing::info!(dataset = %name, attempt, "zvol busy; retrying the destroy");
                    attempt += 1;
                    tokio::time::sleep(BUSY_PAUSE).await;
                }
                Err(source) => {
                    return Err(BackendError::Command {
                        step: "zfs destroy",
                        source,
                    });
                }
            }
        }
    }

    async fn run(&self, step: &'static str, args: &[String]) -> Result<Vec<u8>, BackendError> {
        self.runner
            .run(ZFS, args)
            .await
            .map(|out| out.stdout)
            .map_err(|source| BackendError::Command { step, source })
    }
}

/// Where the live snapshot `snapshot` is among `rows`; [`BackendError::NotOwned`] if it is
/// not one pillar cut.
fn owned_snapshot(snapshot: &VolumeId, rows: &[SnapRow]) -> Result<Option<usize>, BackendError> {
    let Some(i) = rows
        .iter()
        .position(|r| r.short == snapshot.as_str() && !r.deferred)
    else {
        return Ok(None);
    };
    let row = &rows[i];
    if row.owner != SNAPSHOT_OWNER {
        return Err(BackendError::NotOwned {
            volume: snapshot.clone(),
            object: format!("snapshot {}", row.full()),
            reason: "no io.pillar-csi:owner=pillar-snapshot property",
        });
    }
    Ok(Some(i))
}

fn snapshot_info(snapshot: &VolumeId, row: &SnapRow) -> SnapshotInfo {
    SnapshotInfo {
        snapshot: snapshot.clone(),
        size_bytes: row.volsize,
        created: std::time::UNIX_EPOCH + Duration::from_secs(row.creation),
        method: None,
    }
}

fn report_text<'a>(what: &'static str, stdout: &'a [u8]) -> Result<&'a str, BackendError> {
    std::str::from_utf8(stdout).map_err(|_| BackendError::ReportValue {
        what,
        value: String::from_utf8_lossy(stdout).into_owned(),
    })
}

fn parse_number(what: &'static str, value: &str) -> Result<u64, BackendError> {
    value.parse().map_err(|_| BackendError::ReportValue {
        what,
        value: value.to_owned(),
    })
}
