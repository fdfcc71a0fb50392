//! The LVM backend: one logical volume per volume, named by the volume ID and tagged
//! [`TAG`], in a volume group (linear) or a thin pool (thin).
//!
//! Every change is one `lvm` subcommand run by argv; every read is a JSON report
//! (`--reportformat json --units b --nosuffix`: sizes are exact byte counts, as strings).
//! Only LVs carrying the tag are listed, grown or removed; an LV of that name without the tag
//! (or of the other layout) is [`BackendError::NotOwned`].
//!
//! Snapshots (thin pools only) are thin snapshots named `snap+<snapshot-id>` and tagged
//! [`SNAPSHOT_TAG`]; restores and clones are thin snapshots of a snapshot or volume, tagged as
//! volumes. Linear pools refuse snapshots ([`LvmBackend::snapshots_supported`] says why).
//!
//! Sizes are rounded to the VG's extent size, read with `vgs` on [`LvmBackend::probe`] or
//! the first create/expand/capacity call and cached; before that [`LvmBackend::round_size`]
//! assumes [`DEFAULT_EXTENT_SIZE`] (LVM's default).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pillar_nvmet::VolumeId;

use super::command::CommandRunner;
use super::{
    BackendError, Capacity, ContentSource, SnapshotInfo, VolumeInfo, checked_size,
    wait_for_device,
};

/// The program run for every LVM operation (`lvm <subcommand> ...`).
pub const LVM: &str = "lvm";

/// The tag pillar puts on every LV it creates.
pub const TAG: &str = "pillar";

/// The tag pillar puts on every snapshot LV it creates.
pub const SNAPSHOT_TAG: &str = "pillar-snapshot";

const SNAPSHOT_FIELDS: &str = "lv_name,lv_size,lv_tags,lv_time";

/// LVM's default extent size, assumed until the VG's is known.
pub const DEFAULT_EXTENT_SIZE: u64 = 4 << 20;

/// Longest LV name LVM accepts (NAME_LEN - 1).
const LV_NAME_MAX: usize = 127;

/// Substrings LVM reserves for its internal LVs (lvm2 `apply_lvname_restrictions`).
const RESERVED_INFIXES: &[&str] = &[
    "_cdata", "_cmeta", "_corig", "_cpool", "_cvol", "_imeta", "_iorig", "_mimage", "_mlog",
    "_pmspare", "_rimage", "_rmeta", "_tdata", "_tmeta", "_vdata", "_vorigin", "_wcorig",
];

/// Prefixes LVM reserves.
const RESERVED_PREFIXES: &[&str] = &["snapshot", "pvmove"];

const LV_FIELDS: &str = "lv_name,lv_path,lv_size,lv_tags,lv_attr,pool_lv";

/// How long to wait for udev to create `/dev/<vg>/<lv>` after a create or activation.
const DEVICE_WAIT: Duration = Duration::from_secs(10);

/// Logical volumes of one volume group, linear or thin.
#[derive(Debug)]
pub struct LvmBackend {
    pool: String,
    vg: String,
    thin_pool: Option<String>,
    runner: Arc<dyn CommandRunner>,
    /// The VG's extent size in bytes; 0 until read.
    extent_size: AtomicU64,
    device_wait: Option<Duration>,
}

mod report;
mod snapshot;

use report::{
    LvRow, LvSection, Report, SnapshotSection, ThinPoolSection, VgRow, VgSection, is_lvm_name, parse_bytes, parse_report, percent_of, report_args, vg_capacity,
};

impl LvmBackend {
    /// A backend for volume group `vg`, with thin volumes in `thin_pool` if given.
    pub fn new(
        pool: &str,
        vg: &str,
        thin_pool: Option<&str>,
        runner: Arc<dyn CommandRunner>,
    ) -> Result<Self, BackendError> {
        let bad = |reason: String| BackendError::InvalidConfig {
            pool: pool.to_owned(),
            reason,
        };
        if !is_lvm_name(vg) {
            return Err(bad(format!("{vg:?} is not a valid volume group name")));
        }
        if let Some(tp) = thin_pool
            && !is_lvm_name(tp)
        {
            return Err(bad(format!("{tp:?} is not a valid thin pool name")));
        }
        Ok(Self {
            pool: pool.to_owned(),
            vg: vg.to_owned(),
            thin_pool: thin_pool.map(str::to_owned),
            runner,
            extent_size: AtomicU64::new(0),
            device_wait: Some(DEVICE_WAIT),
        })
    }

    /// The same backend waiting up to `wait` for device nodes to appear after creating or
    /// activating an LV (`None`: do not check; for tests with a fake runner).
    #[must_use]
    #[cfg(any(test, feature = "test-seams"))]
    pub fn with_device_wait(mut self, wait: Option<Duration>) -> Self {
        self.device_wait = wait;
        self
    }

    /// `"lvm-linear"` or `"lvm-thin"`.
    pub fn kind_name(&self) -> &'static str {
        if self.thin_pool.is_some() {
            "lvm-thin"
        } else {
            "lvm-linear"
        }
    }

    /// The cached extent size, or [`DEFAULT_EXTENT_SIZE`] before it was read.
    pub fn extent_size(&self) -> u64 {
        match self.extent_size.load(Ordering::Relaxed) {
            0 => DEFAULT_EXTENT_SIZE,
            known => known,
        }
    }

    /// `size_bytes` rounded up to a multiple of the extent size.
    #[cfg(any(test, feature = "test-seams"))]
    pub fn round_size(&self, size_bytes: u64) -> u64 {
        super::round_up(size_bytes, self.extent_size())
    }

    /// Reads the VG (caching its extent size) and, for thin, the thin pool; returns the
    /// pool's capacity.
    pub async fn probe(&self) -> Result<Capacity, BackendError> {
        let vg = self.vg_report().await?;
        if self.thin_pool.is_some() {
            self.capacity().await
        } else {
            vg_capacity(&vg)
        }
    }

    pub async fn create(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
    ) -> Result<VolumeInfo, BackendError> {
        let lv = self.lv_name(volume)?;
        // Refuse absurd sizes before running anything; the extent rounding comes next.
        checked_size(size_bytes, 1)?;
        let extent = self.known_extent_size().await?;
        let size = checked_size(size_bytes, extent)?;
        if let Some(row) = self.find(volume).await? {
            let row = self.owned(volume, row)?;
            let existing = parse_bytes("lvs lv_size", &row.lv_size)?;
            if existing != size {
                return Err(BackendError::SizeMismatch {
                    volume: volume.clone(),
                    existing,
                    requested: size,
                });
            }
            return self.usable(volume, &row, existing).await;
        }
        let size_arg = format!("{size}b");
        let mut args: Vec<String> = vec!["lvcreate".into()];
        match &self.thin_pool {
            None => args.extend(
                [
                    "-L",
                    &size_arg,
                    "-n",
                    lv,
                    "--addtag",
                    TAG,
                    "--yes",
                    "--wipesignatures",
                    "y",
                ]
                .map(String::from),
            ),
            Some(tp) => args.extend(
                [
                    "-V",
                    &size_arg,
                    "--thinpool",
                    tp,
                    "-n",
                    lv,
                    "--addtag",
                    TAG,
                    "--yes",
                ]
                .map(String::from),
            ),
        }
        args.push(self.vg.clone());
        self.run("lvcreate", &args).await?;
        tracing::info!(%volume, size, vg = %self.vg, kind = self.kind_name(), "created LV");
        let device_path = self.default_device_path(lv);
        wait_for_device(&device_path, self.device_wait).await?;
        Ok(VolumeInfo {
            volume: volume.clone(),
            size_bytes: size,
            device_path,
        })
    }

    pub async fn expand(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
    ) -> Result<VolumeInfo, BackendError> {
        self.lv_name(volume)?;
        // Refuse absurd sizes before running anything; the extent rounding comes next.
        checked_size(size_bytes, 1)?;
        let extent = self.known_extent_size().await?;
        let size = checked_size(size_bytes, extent)?;
        let Some(row) = self.find(volume).await? else {
            return Err(BackendError::NotFound {
                volume: volume.clone(),
            });
        };
        let row = self.owned(volume, row)?;
        let current = parse_bytes("lvs lv_size", &row.lv_size)?;
        if size < current {
            return Err(BackendError::ShrinkRefused {
                volume: volume.clone(),
                current,
                requested: size,
            });
        }
        self.grow(volume, &row, current, size).await
    }

    /// Grows the owned LV `row` of `volume` from `current` to `size` bytes (nothing when equal),
    /// then answers as [`usable`](Self::usable).
    async fn grow(
        &self,
        volume: &VolumeId,
        row: &LvRow,
        current: u64,
        size: u64,
    ) -> Result<VolumeInfo, BackendError> {
        if size > current {
            // lvextend resizes the active device-mapper table itself: the kernel sees the
            // new size when the command returns.
            let args = [
                "lvextend",
                "-L",
                &format!("{size}b"),
                &self.full_name(&row.lv_name),
            ]
            .map(String::from);
            self.run("lvextend", &args).await?;
            tracing::info!(%volume, from = current, to = size, "extended LV");
        }
        self.usable(volume, row, size).await
    }

    pub async fn delete(&self, volume: &VolumeId) -> Result<(), BackendError> {
        let lv = self.lv_name(volume)?;
        let Some(row) = self.find(volume).await? else {
            return Ok(());
        };
        self.owned(volume, row)?;
        let args = ["lvremove", "-y", &self.full_name(lv)].map(String::from);
        self.run("lvremove", &args).await?;
        tracing::info!(%volume, vg = %self.vg, "removed LV");
        Ok(())
    }

    pub async fn lookup(&self, volume: &VolumeId) -> Result<Option<VolumeInfo>, BackendError> {
        self.lv_name(volume)?;
        let Some(row) = self.find(volume).await? else {
            return Ok(None);
        };
        let Ok(row) = self.owned(volume, row) else {
            return Ok(None);
        };
        let size = parse_bytes("lvs lv_size", &row.lv_size)?;
        self.usable(volume, &row, size).await.map(Some)
    }

    pub async fn list(&self) -> Result<Vec<VolumeInfo>, BackendError> {
        let rows = self.lv_report().await?;
        let mut volumes = Vec::new();
        for row in rows {
            if !row.tagged() || !self.same_layout(&row) {
                continue;
            }
            let Ok(volume) = VolumeId::parse(&row.lv_name) else {
                continue;
            };
            let size = parse_bytes("lvs lv_size", &row.lv_size)?;
            volumes.push(self.usable(&volume, &row, size).await?);
        }
        volumes.sort_by(|a, b| a.volume.cmp(&b.volume));
        Ok(volumes)
    }

    /// Linear: the VG's size and free space. Thin: the thin pool's data size and the part
    /// of it not yet used (`data_percent`); thin volumes may promise more than that.
    pub async fn capacity(&self) -> Result<Capacity, BackendError> {
        let Some(tp) = &self.thin_pool else {
            let vg = self.vg_report().await?;
            return vg_capacity(&vg);
        };
        let args = report_args("lvs", "lv_name,lv_size,data_percent", &self.full_name(tp));
        let out = self.run("lvs (thin pool)", &args).await?;
        let report: Report<ThinPoolSection> = parse_report("lvs (thin pool)", &out)?;
        let row = report
            .report
            .into_iter()
            .flat_map(|s| s.lv)
            .find(|r| r.lv_name == *tp)
            .ok_or_else(|| BackendError::PoolMissing {
                pool: self.pool.clone(),
                what: format!("thin pool {}", self.full_name(tp)),
            })?;
        let total = parse_bytes("lvs lv_size", &row.lv_size)?;
        let used =
            percent_of(total, &row.data_percent).ok_or_else(|| BackendError::ReportValue {
                what: "lvs data_percent",
                value: row.data_percent.clone(),
            })?;
        Ok(Capacity {
            total_bytes: total,
            available_bytes: total.saturating_sub(used),
        })
    }

    fn lv_name<'v>(&self, volume: &'v VolumeId) -> Result<&'v str, BackendError> {
        let name = volume.as_str();
        let refuse = |reason: String| BackendError::UnsupportedName {
            volume: volume.clone(),
            backend: self.kind_name(),
            reason,
        };
        if name.len() > LV_NAME_MAX {
            return Err(refuse(format!("LV names are at most {LV_NAME_MAX} bytes")));
        }
        if let Some(p) = RESERVED_PREFIXES.iter().find(|p| name.starts_with(*p)) {
            return Err(refuse(format!("LVM reserves names starting with {p:?}")));
        }
        if let Some(i) = RESERVED_INFIXES.iter().find(|i| name.contains(*i)) {
            return Err(refuse(format!("LVM reserves names containing {i:?}")));
        }
        Ok(name)
    }

    fn full_name(&self, lv: &str) -> String {
        format!("{}/{lv}", self.vg)
    }

    fn default_device_path(&self, lv: &str) -> PathBuf {
        PathBuf::from(format!("/dev/{}/{lv}", self.vg))
    }

    fn same_layout(&self, row: &LvRow) -> bool {
        match &self.thin_pool {
            None => row.pool_lv.is_empty(),
            Some(tp) => row.pool_lv == *tp,
        }
    }

    /// `row` if pillar created it in this pool's layout.
    fn owned(&self, volume: &VolumeId, row: LvRow) -> Result<LvRow, BackendError> {
        let reason = if !row.tagged() {
            "no pillar tag"
        } else if !self.same_layout(&row) {
            if self.thin_pool.is_some() {
                "not a thin volume of this pool's thin pool"
            } else {
                "a thin volume, not a linear LV"
            }
        } else {
            return Ok(row);
        };
        Err(BackendError::NotOwned {
            volume: volume.clone(),
            object: format!("LV {}", self.full_name(&row.lv_name)),
            reason,
        })
    }

    /// The info of an owned LV, activating it first if it is inactive.
    async fn usable(
        &self,
        volume: &VolumeId,
        row: &LvRow,
        size: u64,
    ) -> Result<VolumeInfo, BackendError> {
        if !row.active() {
            let args = ["lvchange", "-ay", &self.full_name(&row.lv_name)].map(String::from);
            self.run("lvchange (activate)", &args).await?;
            tracing::info!(%volume, "activated LV");
        }
        let device_path = if row.lv_path.is_empty() {
            self.default_device_path(&row.lv_name)
        } else {
            PathBuf::from(&row.lv_path)
        };
        wait_for_device(&device_path, self.device_wait).await?;
        Ok(VolumeInfo {
            volume: volume.clone(),
            size_bytes: size,
            device_path,
        })
    }

    /// The LV named after `volume` in this VG, tagged or not. The whole VG is listed and
    /// filtered here, so a missing LV is an empty answer rather than an error to recognise.
    async fn find(&self, volume: &VolumeId) -> Result<Option<LvRow>, BackendError> {
        Ok(self
            .lv_report()
            .await?
            .into_iter()
            .find(|r| r.lv_name == volume.as_str()))
    }

    async fn lv_report(&self) -> Result<Vec<LvRow>, BackendError> {
        let args = report_args("lvs", LV_FIELDS, &self.vg);
        let out = self.run("lvs", &args).await?;
        let report: Report<LvSection> = parse_report("lvs", &out)?;
        Ok(report.report.into_iter().flat_map(|s| s.lv).collect())
    }

    async fn vg_report(&self) -> Result<VgRow, BackendError> {
        let args = report_args("vgs", "vg_name,vg_extent_size,vg_size,vg_free", &self.vg);
        let out = self.run("vgs", &args).await?;
        let report: Report<VgSection> = parse_report("vgs", &out)?;
        let row = report
            .report
            .into_iter()
            .flat_map(|s| s.vg)
            .find(|r| r.vg_name == self.vg)
            .ok_or_else(|| BackendError::PoolMissing {
                pool: self.pool.clone(),
                what: format!("volume group {}", self.vg),
            })?;
        let extent = parse_bytes("vgs vg_extent_size", &row.vg_extent_size)?;
        if extent == 0 {
            return Err(BackendError::ReportValue {
                what: "vgs vg_extent_size",
                value: row.vg_extent_size,
            });
        }
        self.extent_size.store(extent, Ordering::Relaxed);
        Ok(row)
    }

    async fn known_extent_size(&self) -> Result<u64, BackendError> {
        match self.extent_size.load(Ordering::Relaxed) {
            0 => {
                self.vg_report().await?;
                Ok(self.extent_size())
            }
            known => Ok(known),
        }
    }

    async fn run(&self, step: &'static str, args: &[String]) -> Result<Vec<u8>, BackendError> {
        self.runner
            .run(LVM, args)
            .await
            .map(|out| out.stdout)
            .map_err(|source| BackendError::Command { step, source })
    }
}

