//! Durable stage records: `<state_dir>/staged/<volume-id>.json`, one per staged volume.
//!
//! Rule N2: NodeStage writes the record (phase [`StagePhase::Connecting`]) before it connects,
//! and advances the phase as it goes, so NodeUnstage after a crash knows what to undo.
//! Rule C4: a record that cannot be read or parsed is an error, never "no record".
//!
//! Writes are atomic and durable: the new content goes to a temporary file in the same
//! directory (named `.<volume>.json.tmp-<pid>-<n>`; volume IDs never start with `.`), which is
//! fsynced, renamed over the record, and then the directory is fsynced. A crash leaves either
//! the old or the new record, plus at worst a stray temporary file, which readers ignore and
//! [`StageStore::open`] removes.
//!
//! The store does no locking: the caller serialises operations on one volume.

use std::fs;
use std::io::{self, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use pillar_durable::DurableFs;
use pillar_nvmet::{HostNqn, SubsystemNqn, VolumeId};
use serde::{Deserialize, Serialize};

use crate::fs::FsType;
use crate::{HostError, StageRecordError};

/// The record format this build writes and reads.
pub const STAGE_RECORD_VERSION: u32 = 1;
/// The subdirectory of the state directory that holds the records.
pub const STAGED_DIR: &str = "staged";
const SUFFIX: &str = ".json";
const TMP_MARK: &str = ".json.tmp-";

/// How far NodeStage got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StagePhase {
    /// Recorded before connecting: a controller may or may not exist.
    Connecting,
    /// Connected, the device found and its identity verified.
    Connected,
    /// The device holds the filesystem (formatted now or found so).
    Formatted,
    /// Mounted at the staging path (filesystem) or bound there (block).
    Mounted,
}

/// How the volume is presented.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StageMode {
    /// A raw block device.
    Block,
    /// A filesystem of this type.
    Filesystem { fs_type: FsType },
}

/// One staged volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageRecord {
    pub volume: VolumeId,
    pub nqn: SubsystemNqn,
    pub hostnqn: HostNqn,
    pub traddr: IpAddr,
    pub trsvcid: u16,
    /// The block device name (`nvme0n1`) once found; a hint for logs only, since names are
    /// reused after a disconnect: always find the device again by NQN.
    pub device: Option<String>,
    pub staging_path: PathBuf,
    pub mode: StageMode,
    pub phase: StagePhase,
    /// A single-writer read-write stage over NVMe: this node holds (or must take back after a
    /// target restart) the namespace's Write Exclusive reservation where the target has
    /// reservations, and releases it on unstage (rule W9).
    pub reservation: bool,
}

/// The on-disk form: names as validated strings, plus a version.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordFile {
    version: u32,
    volume: String,
    nqn: String,
    hostnqn: String,
    traddr: IpAddr,
    trsvcid: u16,
    device: Option<String>,
    staging_path: PathBuf,
    mode: StageMode,
    phase: StagePhase,
    /// Absent (false) in records written before W9, and left out when false, so such records
    /// read back unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    reservation: bool,
}

impl StageRecord {
    fn to_file(&self) -> RecordFile {
        RecordFile {
            version: STAGE_RECORD_VERSION,
            volume: self.volume.to_string(),
            nqn: self.nqn.to_string(),
            hostnqn: self.hostnqn.to_string(),
            traddr: self.traddr,
            trsvcid: self.trsvcid,
            device: self.device.clone(),
            staging_path: self.staging_path.clone(),
            mode: self.mode,
            phase: self.phase,
            reservation: self.reservation,
        }
    }

    /// The file's content: pretty JSON and a newline.
    fn to_bytes(&self) -> Result<Vec<u8>, serde_json::Error> {
        let mut bytes = serde_json::to_vec_pretty(&self.to_file())?;
        bytes.push(b'\n');
        Ok(bytes)
    }

    fn from_bytes(bytes: &[u8]) -> Result<Self, StageRecordError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(StageRecordError::Empty);
        }
        // Check the version before the shape, so a newer format says so instead of failing on
        // an unknown field.
        #[derive(Deserialize)]
        struct Version {
            version: u32,
        }
        let Version { version } = serde_json::from_slice(bytes)?;
        if version != STAGE_RECORD_VERSION {
            return Err(StageRecordError::UnsupportedVersion {
                found: version,
                supported: STAGE_RECORD_VERSION,
            });
        }
        let f: RecordFile = serde_json::from_slice(bytes)?;
        Ok(Self {
            volume: VolumeId::parse(&f.volume)?,
            nqn: SubsystemNqn::parse(&f.nqn)?,
            hostnqn: HostNqn::parse(&f.hostnqn)?,
            traddr: f.traddr,
            trsvcid: f.trsvcid,
            device: f.device,
            staging_path: f.staging_path,
            mode: f.mode,
            phase: f.phase,
            reservation: f.reservation,
        })
    }
}

/// The record's codec, for the fuzz targets (`fuzz/`); not part of the crate's API.
#[doc(hidden)]
pub mod fuzzing {
    use super::{StageRecord, StageRecordError};

    /// Parses a record file's content as [`super::StageStore::read`] does.
    pub fn decode(bytes: &[u8]) -> Result<StageRecord, StageRecordError> {
        StageRecord::from_bytes(bytes)
    }

    /// A record file's content as [`super::StageStore::write`] writes it.
    pub fn encode(record: &StageRecord) -> Result<Vec<u8>, serde_json::Error> {
        record.to_bytes()
    }
}

/// The directory of stage records.
#[derive(Debug)]
pub struct StageStore {
    dir: PathBuf,
    /// Every file operation that changes the records goes through it: `std::fs` in
    /// production, a recorder in the crash-state tests.
    fs: Arc<dyn DurableFs>,
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> HostError + '_ {
    move |source| HostError::StageIo {
        path: path.to_path_buf(),
        source,
    }
}

fn fsync_dir(fs: &dyn DurableFs, dir: &Path) -> Result<(), HostError> {
    fs.sync_dir(dir).map_err(io_err(dir))
}

impl StageStore {
    /// Opens (creating if needed) `<state_dir>/staged`, and removes temporary files a crash
    /// left behind.
    pub fn open(state_dir: &Path) -> Result<Self, HostError> {
        Self::open_with(state_dir, pillar_durable::std_fs())
    }

    /// [`open`](Self::open), with every change to the records made through `fs`.
    pub fn open_with(state_dir: &Path, fs: Arc<dyn DurableFs>) -> Result<Self, HostError> {
        let dir = state_dir.join(STAGED_DIR);
        if !dir.is_dir() {
            fs.create_dir_all(&dir).map_err(io_err(&dir))?;
            fsync_dir(&*fs, state_dir)?;
        }
        let store = Self { dir, fs };
        let mut removed = false;
        for entry in fs::read_dir(&store.dir).map_err(io_err(&store.dir))? {
            let entry = entry.map_err(io_err(&store.dir))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with('.') && name.contains(TMP_MARK) {
                tracing::info!(
                    file = name,
                    "removing a stage record temporary file left by a crash"
                );
                store
                    .fs
                    .remove_file(&entry.path())
                    .map_err(io_err(&entry.path()))?;
                removed = true;
            }
        }
        if removed {
            fsync_dir(&*store.fs, &store.dir)?;
        }
        Ok(store)
    }

    /// The directory holding the records.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the record of `volume` lives.
    pub fn path_of(&self, volume: &VolumeId) -> PathBuf {
        self.dir.join(format!("{volume}{SUFFIX}"))
    }

    /// Atomically and durably replaces the record of `record.volume`.
    pub fn write(&self, record: &StageRecord) -> Result<(), HostError> {
        let bytes = record
            .to_bytes()
            .map_err(|source| HostError::EncodeStageRecord {
                volume: record.volume.to_string(),
                source,
            })?;
        let path = self.path_of(&record.volume);
        let tmp = self.dir.join(format!(
            ".{}{TMP_MARK}{}-{}",
            record.volume,
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let fs = &*self.fs;
        let result = (|| {
            let mut f = fs.create_new(&tmp, 0o600).map_err(io_err(&tmp))?;
            f.write_all(&bytes).map_err(io_err(&tmp))?;
            f.sync_all().map_err(io_err(&tmp))?;
            drop(f);
            fs.rename(&tmp, &path).map_err(io_err(&path))
        })();
        if let Err(e) = result {
            let _ = fs.remove_file(&tmp);
            return Err(e);
        }
        fsync_dir(fs, &self.dir)?;
        tracing::debug!(volume = %record.volume, phase = ?record.phase, "stage record written");
        Ok(())
    }

    /// The record of `volume`; `None` only when there is no file. A file that cannot be parsed
    /// is [`HostError::CorruptStageRecord`] (rule C4).
    pub fn read(&self, volume: &VolumeId) -> Result<Option<StageRecord>, HostError> {
        let path = self.path_of(volume);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(HostError::StageIo { path, source }),
        };
        let record =
            StageRecord::from_bytes(&bytes).map_err(|source| HostError::CorruptStageRecord {
                path: path.clone(),
                source,
            })?;
        if &record.volume != volume {
            return Err(HostError::CorruptStageRecord {
                path,
                source: StageRecordError::VolumeMismatch {
                    file: volume.to_string(),
                    record: record.volume.to_string(),
                },
            });
        }
        Ok(Some(record))
    }

    /// Removes the record of `volume` durably. Idempotent.
    pub fn remove(&self, volume: &VolumeId) -> Result<(), HostError> {
        let path = self.path_of(volume);
        match self.fs.remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(HostError::StageIo { path, source }),
        }
        fsync_dir(&*self.fs, &self.dir)?;
        tracing::debug!(volume = %volume, "stage record removed");
        Ok(())
    }

    /// The volumes that have a record, sorted. Temporary files are skipped, and so (with a
    /// warning) are files whose names are not `<volume-id>.json`: pillar never writes those.
    pub fn list(&self) -> Result<Vec<VolumeId>, HostError> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io_err(&self.dir))? {
            let entry = entry.map_err(io_err(&self.dir))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                tracing::warn!(file = ?name, "ignoring a non-UTF-8 file among stage records");
                continue;
            };
            if name.starts_with('.') {
                continue;
            }
            match name.strip_suffix(SUFFIX).map(VolumeId::parse) {
                Some(Ok(v)) => out.push(v),
                _ => tracing::warn!(file = name, "ignoring a file that is not a stage record"),
            }
        }
        out.sort();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(volume: &str, phase: StagePhase) -> StageRecord {
        let volume = VolumeId::parse(volume).unwrap();
        StageRecord {
            nqn: volume.subsystem_nqn(),
            volume,
            hostnqn: HostNqn::parse(
                "nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6",
            )
            .unwrap(),
            traddr: "192.0.2.10".parse().unwrap(),
            trsvcid: 4420,
            device: None,
            staging_path: "/var/lib/kubelet/plugins/kubernetes.io/csi/pillar/x/globalmount".into(),
            mode: StageMode::Filesystem {
                fs_type: FsType::Ext4,
            },
            phase,
            reservation: false,
        }
    }

    fn vol(s: &str) -> VolumeId {
        VolumeId::parse(s).unwrap()
    }

    // proves N2: what was written is what a restarted plugin reads back.
    #[test]
    fn round_trip_and_phase_advance() {
        let dir = tempfile::tempdir().unwrap();
        let store = StageStore::open(dir.path()).unwrap();
        assert_eq!(store.read(&vol("pvc-1")).unwrap(), None);
        let mut r = record("pvc-1", StagePhase::Connecting);
        store.write(&r).unwrap();
        assert_eq!(store.read(&vol("pvc-1")).unwrap(), Some(r.clone()));
        r.phase = StagePhase::Mounted;
        r.device = Some("nvme0n1".into());
        r.mode = StageMode::Block;
        store.write(&r).unwrap();
        let reopened = StageStore::open(dir.path()).unwrap();
        assert_eq!(reopened.read(&vol("pvc-1")).unwrap(), Some(r));
        assert!(dir.path().join("staged/pvc-1.json").is_file());
    }

    #[test]
    fn on_disk_form_is_stable() {
        let dir = tempfile::tempdir().unwrap();
        let store = StageStore::open(dir.path()).unwrap();
        store
            .write(&record("pvc-1", StagePhase::Formatted))
            .unwrap();
        let text = fs::read_to_string(store.path_of(&vol("pvc-1"))).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["version"], 1);
        assert_eq!(v["phase"], "formatted");
        assert_eq!(v["mode"]["kind"], "filesystem");
        assert_eq!(v["mode"]["fs_type"], "ext4");
        assert_eq!(v["nqn"], "nqn.2026-11.io.pillar-csi:vol:pvc-1");
    }

    // proves C4: a corrupt record is an error, never "no record".
    #[test]
    fn corrupt_records_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let store = StageStore::open(dir.path()).unwrap();
        store.write(&record("pvc-1", StagePhase::Mounted)).unwrap();
        let path = store.path_of(&vol("pvc-1"));
        let good = fs::read_to_string(&path).unwrap();
        let other_volume = {
            let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
            v["volume"] = "pvc-2".into();
            v.to_string()
        };
        type Expect = fn(&StageRecordError) -> bool;
        let cases: Vec<(String, Expect)> = vec![
            (String::new(), |e| matches!(e, StageRecordError::Empty)),
            ("\n".into(), |e| matches!(e, StageRecordError::Empty)),
            (good[..good.len() / 2].to_owned(), |e| {
                matches!(e, StageRecordError::Json(_))
            }),
            ("{\"version\": 2}".into(), |e| {
                matches!(e, StageRecordError::UnsupportedVersion { found: 2, .. })
            }),
            (good.replace("\"mounted\"", "\"exploded\""), |e| {
                matches!(e, StageRecordError::Json(_))
            }),
            (
                good.replace("nqn.2014-08.org.nvmexpress:uuid:", "bogus:"),
                |e| matches!(e, StageRecordError::Name(_)),
            ),
            (other_volume, |e| {
                matches!(e, StageRecordError::VolumeMismatch { .. })
            }),
        ];
        for (content, expected) in cases {
            fs::write(&path, &content).unwrap();
            match store.read(&vol("pvc-1")) {
                Err(HostError::CorruptStageRecord { source, .. }) => {
                    assert!(expected(&source), "{content:?} gave {source:?}")
                }
                other => panic!("{content:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn crash_leftovers_are_ignored_and_cleaned() {
        let dir = tempfile::tempdir().unwrap();
        let store = StageStore::open(dir.path()).unwrap();
        store
            .write(&record("pvc-1", StagePhase::Connecting))
            .unwrap();
        // A crash between creating the temporary file and renaming it.
        let stray = store.dir().join(".pvc-1.json.tmp-999-0");
        fs::write(&stray, "{\"half\":").unwrap();
        let stray2 = store.dir().join(".pvc-2.json.tmp-999-1");
        fs::write(&stray2, "").unwrap();
        assert_eq!(store.list().unwrap(), [vol("pvc-1")]);
        assert_eq!(
            store.read(&vol("pvc-1")).unwrap().unwrap().phase,
            StagePhase::Connecting
        );
        assert_eq!(store.read(&vol("pvc-2")).unwrap(), None);
        let reopened = StageStore::open(dir.path()).unwrap();
        assert!(!stray.exists() && !stray2.exists());
        assert_eq!(reopened.list().unwrap(), [vol("pvc-1")]);
    }

    #[test]
    fn remove_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let store = StageStore::open(dir.path()).unwrap();
        store.write(&record("pvc-1", StagePhase::Mounted)).unwrap();
        store.remove(&vol("pvc-1")).unwrap();
        assert_eq!(store.read(&vol("pvc-1")).unwrap(), None);
        store.remove(&vol("pvc-1")).unwrap();
        store.remove(&vol("never-staged")).unwrap();
        assert!(store.list().unwrap().is_empty());
    }

    #[test]
    fn list_skips_foreign_files() {
        let dir = tempfile::tempdir().unwrap();
        let store = StageStore::open(dir.path()).unwrap();
        store.write(&record("b.json", StagePhase::Mounted)).unwrap();
        store.write(&record("a", StagePhase::Mounted)).unwrap();
        fs::write(store.dir().join("notes.txt"), "").unwrap();
        fs::write(store.dir().join("-bad.json"), "{}").unwrap();
        assert_eq!(store.list().unwrap(), [vol("a"), vol("b.json")]);
        assert!(store.read(&vol("b.json")).unwrap().is_some());
    }

    #[test]
    fn write_failure_leaves_the_old_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = StageStore::open(dir.path()).unwrap();
        let old = record("pvc-1", StagePhase::Connecting);
        store.write(&old).unwrap();
        // A non-UTF-8 staging path cannot be encoded: nothing may change on disk.
        let mut bad = record("pvc-1", StagePhase::Mounted);
        bad.staging_path = PathBuf::from(
            <std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(vec![0xff]),
        );
        assert!(matches!(
            store.write(&bad),
            Err(HostError::EncodeStageRecord { .. })
        ));
        assert_eq!(store.read(&vol("pvc-1")).unwrap(), Some(old));
        assert_eq!(fs::read_dir(store.dir()).unwrap().count(), 1);
    }
}
