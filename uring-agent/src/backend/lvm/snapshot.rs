//! Thin snapshots, restores and clones: every snapshot operation of the LVM backend.
//!
//! A snapshot is the thin LV `snap+<snapshot-id>` tagged [`SNAPSHOT_TAG`]; restores and clones
//! are thin snapshots of it (or of a volume) tagged as volumes. Linear pools refuse all of it.

use super::*;

impl LvmBackend {
    /// Whether this pool takes snapshots and clones: thin pools do, linear ones do not.
    pub fn snapshots_supported(&self) -> Result<(), BackendError> {
        if self.thin_pool.is_some() {
            return Ok(());
        }
        // A snapshot of a linear LV is a dm-snapshot with a copy-on-write area sized in
        // advance: once the origin's changes fill it the snapshot becomes invalid, and every
        // write to the origin pays a copy. pillar offers no snapshot that can vanish.
        Err(BackendError::SnapshotsUnsupported {
            pool: self.pool.clone(),
            backend: self.kind_name(),
            reason: "a snapshot of a linear LV needs a preallocated copy-on-write area and \
                     becomes invalid when it fills; use an lvm-thin pool for snapshots",
        })
    }

    /// Cuts a thin snapshot `snap+<snapshot>` of `source`'s LV, tagged [`SNAPSHOT_TAG`]. A
    /// thin snapshot is atomic even of an LV being written (device-mapper suspends and flushes
    /// the origin for it), does not depend on its origin staying (dm-thin shares blocks, so
    /// the origin can be removed first), and keeps LVM's default activation skip flag: it is
    /// not activated at boot or by `vgchange -ay`.
    pub async fn create_snapshot(
        &self,
        source: &VolumeId,
        snapshot: &VolumeId,
    ) -> Result<SnapshotInfo, BackendError> {
        self.snapshots_supported()?;
        if let Some(existing) = self.lookup_snapshot(snapshot).await? {
            return Ok(existing);
        }
        let source_lv = self.lv_name(source)?;
        let name = self.snapshot_lv(snapshot)?;
        let Some(row) = self.find(source).await? else {
            return Err(BackendError::NotFound {
                volume: source.clone(),
            });
        };
        self.owned(source, row)?;
        let args = [
            "lvcreate",
            "--snapshot",
            "-n",
            &name,
            "--addtag",
            SNAPSHOT_TAG,
            "--yes",
            &self.full_name(source_lv),
        ]
        .map(String::from);
        self.run("lvcreate (snapshot)", &args).await?;
        tracing::info!(%source, %snapshot, vg = %self.vg, method = "lvm-thin", "cut snapshot");
        let mut info = self.lookup_snapshot(snapshot).await?.ok_or_else(|| {
            BackendError::SnapshotNotFound {
                snapshot: snapshot.clone(),
            }
        })?;
        info.method = Some("lvm-thin");
        Ok(info)
    }

    /// The snapshot, or `None` (always `None` in a linear pool).
    pub async fn lookup_snapshot(
        &self,
        snapshot: &VolumeId,
    ) -> Result<Option<SnapshotInfo>, BackendError> {
        if self.thin_pool.is_none() {
            return Ok(None);
        }
        let name = self.snapshot_lv(snapshot)?;
        let mut args = vec![
            "lvs".to_owned(),
            "--config".to_owned(),
            // Epoch seconds, not a local-time string.
            "report/time_format=\"%s\"".to_owned(),
        ];
        args.extend(
            report_args("lvs", SNAPSHOT_FIELDS, &self.vg)
                .into_iter()
                .skip(1),
        );
        let out = self.run("lvs (snapshots)", &args).await?;
        let report: Report<SnapshotSection> = parse_report("lvs (snapshots)", &out)?;
        let Some(row) = report
            .report
            .into_iter()
            .flat_map(|s| s.lv)
            .find(|r| r.lv_name == name)
        else {
            return Ok(None);
        };
        if !row.lv_tags.split(',').any(|t| t == SNAPSHOT_TAG) {
            return Err(BackendError::NotOwned {
                volume: snapshot.clone(),
                object: format!("LV {}", self.full_name(&name)),
                reason: "no pillar-snapshot tag",
            });
        }
        let seconds: u64 = row
            .lv_time
            .trim()
            .parse()
            .map_err(|_| BackendError::ReportValue {
                what: "lvs lv_time",
                value: row.lv_time.clone(),
            })?;
        Ok(Some(SnapshotInfo {
            snapshot: snapshot.clone(),
            size_bytes: parse_bytes("lvs lv_size", &row.lv_size)?,
            created: std::time::UNIX_EPOCH + Duration::from_secs(seconds),
            method: None,
        }))
    }

    /// Removes the snapshot's LV; `Ok` if it does not exist.
    pub async fn delete_snapshot(&self, snapshot: &VolumeId) -> Result<(), BackendError> {
        if self.lookup_snapshot(snapshot).await?.is_none() {
            return Ok(());
        }
        let name = self.snapshot_lv(snapshot)?;
        let args = ["lvremove", "-y", &self.full_name(&name)].map(String::from);
        self.run("lvremove (snapshot)", &args).await?;
        tracing::info!(%snapshot, vg = %self.vg, "removed snapshot LV");
        Ok(())
    }

    /// Creates `volume` as a thin snapshot of a snapshot (restore) or of a volume (clone),
    /// activation skip off and tagged as a volume, grown to `size_bytes` if larger.
    pub async fn create_from(
        &self,
        volume: &VolumeId,
        size_bytes: u64,
        source: &ContentSource,
    ) -> Result<VolumeInfo, BackendError> {
        self.snapshots_supported()?;
        let lv = self.lv_name(volume)?;
        checked_size(size_bytes, 1)?;
        let extent = self.known_extent_size().await?;
        let size = checked_size(size_bytes, extent)?;
        if let Some(row) = self.find(volume).await? {
            // A retry: finish what the first call may have left undone. A restore or clone
            // interrupted between its lvcreate and its lvextend (the thin pool full, a timeout,
            // the agent killed) left the LV at its source's size; grow it as the first call
            // would have. The agent's fencing admits this call only for the lifecycle that owns
            // the volume ID, and the tag says pillar made the LV.
            let row = self.owned(volume, row)?;
            let existing = parse_bytes("lvs lv_size", &row.lv_size)?;
            if existing < size {
                return self.grow(volume, &row, existing, size).await;
            }
            return self.create(volume, size).await;
        }
        let (origin, source_bytes) = match source {
            ContentSource::Snapshot(id) => {
                let info = self.lookup_snapshot(id).await?.ok_or_else(|| {
                    BackendError::SnapshotNotFound {
                        snapshot: id.clone(),
                    }
                })?;
                (self.snapshot_lv(id)?, info.size_bytes)
            }
            ContentSource::Volume(id) => {
                let row = self
                    .find(id)
                    .await?
                    .ok_or_else(|| BackendError::NotFound { volume: id.clone() })?;
                let row = self.owned(id, row)?;
                let bytes = parse_bytes("lvs lv_size", &row.lv_size)?;
                (row.lv_name, bytes)
            }
        };
        if size < source_bytes {
            return Err(BackendError::SmallerThanSource {
                volume: volume.clone(),
                source_bytes,
                requested: size,
            });
        }
        let args = [
            "lvcreate",
            "--snapshot",
            "-n",
            lv,
            "--addtag",
            TAG,
            "--setactivationskip",
            "n",
            "--yes",
            &self.full_name(&origin),
        ]
        .map(String::from);
        self.run("lvcreate (from a source)", &args).await?;
        tracing::info!(%volume, source = %source.id(), vg = %self.vg, "created LV from its source");
        if size > source_bytes {
            let args =
                ["lvextend", "-L", &format!("{size}b"), &self.full_name(lv)].map(String::from);
            self.run("lvextend", &args).await?;
        }
        self.lookup(volume)
            .await?
            .ok_or_else(|| BackendError::NotFound {
                volume: volume.clone(),
            })
    }

    /// `snap+<snapshot>`: '+' is valid in LV names and never in a volume ID, so no volume's LV
    /// can take a snapshot's name.
    fn snapshot_lv(&self, snapshot: &VolumeId) -> Result<String, BackendError> {
        let name = format!("snap+{snapshot}");
        let refuse = |reason: String| BackendError::UnsupportedName {
            volume: snapshot.clone(),
            backend: self.kind_name(),
            reason,
        };
        if name.len() > LV_NAME_MAX {
            return Err(refuse(format!(
                "snapshot LV names are at most {LV_NAME_MAX} bytes"
            )));
        }
        if let Some(i) = RESERVED_INFIXES.iter().find(|i| name.contains(*i)) {
            return Err(refuse(format!("LVM reserves names containing {i:?}")));
        }
        Ok(name)
    }
}
