//! The ZFS backend: one zvol `<parent>/<volume-id>` per volume, thick (ZFS reserves the whole
//! size), `volmode=dev` (no partition scanning of guest data on the storage node), marked with
//! the user property [`OWNER_PROPERTY`]`=`[`OWNER_VALUE`].
//!
//! Reads use scripting output (`zfs list -H -p`: tab-separated, no header, exact numbers);
//! only zvols directly under the parent that carry the owner property are listed, grown or
//! destroyed. A zvol of that name without it is [`BackendError::NotOwned`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pillar_nvmet::VolumeId;

use super::command::CommandRunner;
use super::{
    BackendError, Capacity, ContentSource, SnapshotInfo, VolumeInfo, checked_size, round_up,
    wait_for_device,
};

/// The program run for every ZFS operation.
pub const ZFS: &str = "zfs";

/// The user property marking zvols pillar created.
pub const OWNER_PROPERTY: &str = "io.pillar-csi:owner";

/// The value of [`OWNER_PROPERTY`] on pillar's zvols.
pub const OWNER_VALUE: &str = "pillar";

/// Allocation granularity: 16 KiB, OpenZFS's default `volblocksize` since 2.2 and a multiple
/// of the 8 KiB default before it (`volsize` must be a multiple of `volblocksize`).
pub const GRANULARITY: u64 = 16 << 10;

/// Longest dataset name ZFS accepts (ZFS_MAX_DATASET_NAME_LEN - 1).
const DATASET_NAME_MAX: usize = 255;

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

/// One line of `zfs list -Hp -o name,volsize,<owner>`.
#[derive(Debug)]
struct ZvolRow {
    name: String,
    volsize: u64,
    owner: String,
}

impl ZfsBackend {
    // `zfs snapshot` and clones (a clone depends on its snapshot, which depends on its zvol)
    // are the plan; not built yet, so every snapshot call says so.
    fn no_snapshots(&self) -> BackendError {
        BackendError::SnapshotsUnsupported {
            pool: self.pool.clone(),
            backend: "zfs",
            reason: "snapshots of zfs pools are not built yet",
        }
    }

    /// Whether this pool takes snapshots and clones.
    pub fn snapshots_supported(&self) -> Result<(), BackendError> {
        Err(self.no_snapshots())
    }

    pub async fn create_snapshot(
        &self,
        _source: &VolumeId,
        _snapshot: &VolumeId,
    ) -> Result<SnapshotInfo, BackendError> {
        Err(self.no_snapshots())
    }

    pub async fn lookup_snapshot(
        &self,
        _snapshot: &VolumeId,
    ) -> Result<Option<SnapshotInfo>, BackendError> {
        Ok(None)
    }

    pub async fn delete_snapshot(&self, _snapshot: &VolumeId) -> Result<(), BackendError> {
        Ok(())
    }

    pub async fn create_from(
        &self,
        _volume: &VolumeId,
        _size_bytes: u64,
        _source: &ContentSource,
    ) -> Result<VolumeInfo, BackendError> {
        Err(self.no_snapshots())
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
    pub fn with_device_wait(mut self, wait: Option<Duration>) -> Self {
        self.device_wait = wait;
        self
    }

    /// `size_bytes` rounded up to a multiple of 16 KiB.
    pub fn round_size(&self, size_bytes: u64) -> u64 {
        round_up(size_bytes, GRANULARITY)
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
        let args = ["destroy", &name].map(String::from);
        self.run("zfs destroy", &args).await?;
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

    async fn run(&self, step: &'static str, args: &[String]) -> Result<Vec<u8>, BackendError> {
        self.runner
            .run(ZFS, args)
            .await
            .map(|out| out.stdout)
            .map_err(|source| BackendError::Command { step, source })
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
