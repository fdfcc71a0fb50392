//! Stale-operation fencing: one durable mark per volume and the rules that check a request's
//! token against it.
//!
//! Invariants (`docs/rules.md` F4-F9):
//! - A mark holds the owning lifecycle UID, the highest generation applied, whether that
//!   lifecycle has ended, and the UIDs of earlier (retired) lifecycles.
//! - [`decide`] is pure: given the mark and a request it either rejects the request or says which
//!   mark must be durable before the change runs. The caller holds the volume's lock from the
//!   read of the mark until the change is applied (see `service`).
//! - A mark is written as temp file, fsync, rename, fsync of the directory, before the change.
//! - A mark that cannot be read or does not verify is an error for that volume; no default is
//!   ever substituted, since a guess could re-admit a stale request.
//! - Marks are never removed.

use std::collections::HashSet;
use std::io;
use std::sync::Arc;

use pillar_nvmet::VolumeId;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::engine::{DurableDir, Engine, EngineError};

/// A request's fencing token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Token {
    pub uid: String,
    pub generation: u64,
}

/// What a request does, as far as fencing cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Intent {
    Create,
    Expand,
    Export,
    Grant,
    Resync,
    Revoke,
    Unexport,
    Delete,
}

impl Intent {
    /// Builds or widens access: refused once the lifecycle ended.
    fn builds(self) -> bool {
        matches!(
            self,
            Self::Create | Self::Expand | Self::Export | Self::Grant | Self::Resync
        )
    }

    /// Ends the lifecycle.
    fn ends(self) -> bool {
        matches!(self, Self::Delete)
    }
}

/// The durable per-volume fencing mark.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mark {
    pub volume: String,
    pub owner_uid: String,
    pub generation: u64,
    pub ended: bool,
    pub retired_uids: Vec<String>,
}

/// Why a request was refused. Each maps to FAILED_PRECONDITION with this text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("request carries no fencing token (lifecycle UID and generation are required)")]
    NoToken,
    #[error(
        "stale request: generation {got} is older than generation {mark} already applied for \
         lifecycle {uid}"
    )]
    StaleGeneration { uid: String, got: u64, mark: u64 },
    #[error("volume is owned by live lifecycle {owner}; request from lifecycle {got} refused")]
    ForeignOwner { owner: String, got: String },
    #[error("lifecycle {uid} of this volume was retired; its requests are refused")]
    Retired { uid: String },
    #[error("lifecycle {uid} of this volume has ended (deleted); create, export or grant refused")]
    Ended { uid: String },
}

impl Rejection {
    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoToken => "no_token",
            Self::StaleGeneration { .. } => "stale_generation",
            Self::ForeignOwner { .. } => "foreign_owner",
            Self::Retired { .. } => "retired_lifecycle",
            Self::Ended { .. } => "ended_lifecycle",
        }
    }
}

/// The outcome of a check: `Some(mark)` must be made durable before the change runs; `None`
/// means the request is a retry of what the mark already records.
pub type Decision = Option<Mark>;

/// Checks `token` for `intent` against the volume's current mark (F6).
pub fn decide(
    volume: &VolumeId,
    mark: Option<&Mark>,
    token: Option<&Token>,
    intent: Intent,
) -> Result<Decision, Rejection> {
    let decision = decide_next(volume, mark, token, intent);
    if let Ok(Some(next)) = &decision {
        debug_assert!(
            follows(mark, next),
            "{volume}: mark {next:?} does not follow {mark:?}"
        );
    }
    decision
}

/// Whether `next` may replace `prev` (F4, F6): the same lifecycle's generation never goes down
/// and its end is never undone; another lifecycle takes over only an ended one, retiring it;
/// retired lifecycles stay retired and never own the mark again.
pub(crate) fn follows(prev: Option<&Mark>, next: &Mark) -> bool {
    if next.retired_uids.contains(&next.owner_uid) {
        return false;
    }
    let Some(prev) = prev else {
        return true;
    };
    let keeps_retired = prev
        .retired_uids
        .iter()
        .all(|uid| next.retired_uids.contains(uid));
    if next.owner_uid == prev.owner_uid {
        keeps_retired && next.generation >= prev.generation && (next.ended || !prev.ended)
    } else {
        keeps_retired && prev.ended && next.retired_uids.contains(&prev.owner_uid)
    }
}

fn decide_next(
    volume: &VolumeId,
    mark: Option<&Mark>,
    token: Option<&Token>,
    intent: Intent,
) -> Result<Decision, Rejection> {
    let token = match token {
        Some(t) if !t.uid.is_empty() => t,
        _ => return Err(Rejection::NoToken),
    };
    let Some(mark) = mark else {
        return Ok(Some(Mark {
            volume: volume.to_string(),
            owner_uid: token.uid.clone(),
            generation: token.generation,
            ended: intent.ends(),
            retired_uids: Vec::new(),
        }));
    };
    if mark.retired_uids.contains(&token.uid) {
        return Err(Rejection::Retired {
            uid: token.uid.clone(),
        });
    }
    if token.uid != mark.owner_uid {
        if !mark.ended {
            return Err(Rejection::ForeignOwner {
                owner: mark.owner_uid.clone(),
                got: token.uid.clone(),
            });
        }
        // The owner's lifecycle ended (the volume was deleted): a new lifecycle of the same name
        // takes over and the old UID is retired for good.
        let mut retired = mark.retired_uids.clone();
        retired.push(mark.owner_uid.clone());
        return Ok(Some(Mark {
            volume: mark.volume.clone(),
            owner_uid: token.uid.clone(),
            generation: token.generation,
            ended: intent.ends(),
            retired_uids: retired,
        }));
    }
    if token.generation < mark.generation {
        return Err(Rejection::StaleGeneration {
            uid: token.uid.clone(),
            got: token.generation,
            mark: mark.generation,
        });
    }
    if mark.ended && intent.builds() {
        return Err(Rejection::Ended {
            uid: token.uid.clone(),
        });
    }
    let next = Mark {
        generation: token.generation,
        ended: mark.ended || intent.ends(),
        ..mark.clone()
    };
    Ok((next != *mark).then_some(next))
}

/// Why a mark could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum MarkError {
    #[error("fencing mark {path} cannot be read")]
    Unreadable { path: String, source: io::Error },
    #[error("fencing mark {path} is corrupt ({reason}); refusing to guess its value")]
    Corrupt { path: String, reason: String },
    #[error("fencing mark for {volume} could not be made durable")]
    Write { volume: String, source: EngineError },
}

/// The on-disk form: the mark plus a checksum over its canonical JSON.
#[derive(Deserialize)]
struct MarkFile {
    format: u32,
    mark: Mark,
    sha256: String,
}

/// [`MarkFile`] as written, borrowing the mark (the same fields in the same order, so the same
/// bytes: `a_marks_bytes_on_disk_are_fixed`).
#[derive(Serialize)]
struct MarkFileOut<'a> {
    format: u32,
    mark: &'a Mark,
    sha256: String,
}

const FORMAT: u32 = 1;

/// SHA-256 of the mark's compact JSON in lowercase hex, built in one string (every fenced call
/// checks one on read and makes one on write).
fn checksum(mark: &Mark) -> Result<String, serde_json::Error> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let body = serde_json::to_vec(mark)?;
    let digest = Sha256::digest(&body);
    let mut hex = String::with_capacity(2 * digest.len());
    for byte in digest {
        hex.push(char::from(HEX[usize::from(byte >> 4)]));
        hex.push(char::from(HEX[usize::from(byte & 0x0f)]));
    }
    Ok(hex)
}

/// Serialises a mark for disk.
pub fn encode(mark: &Mark) -> Result<Vec<u8>, serde_json::Error> {
    let file = MarkFileOut {
        format: FORMAT,
        mark,
        sha256: checksum(mark)?,
    };
    let mut out = serde_json::to_vec_pretty(&file)?;
    out.push(b'\n');
    Ok(out)
}

/// Parses and verifies a mark read from disk for `volume`.
pub fn decode(volume: &VolumeId, bytes: &[u8]) -> Result<Mark, String> {
    let file: MarkFile = serde_json::from_slice(bytes).map_err(|e| format!("not a mark: {e}"))?;
    if file.format != FORMAT {
        return Err(format!("unknown format {}", file.format));
    }
    let sum = checksum(&file.mark).map_err(|e| e.to_string())?;
    if sum != file.sha256 {
        return Err("checksum mismatch".into());
    }
    if file.mark.volume != volume.as_str() {
        return Err(format!("mark belongs to volume {:?}", file.mark.volume));
    }
    if file.mark.owner_uid.is_empty() {
        return Err("empty owner".into());
    }
    Ok(file.mark)
}

/// The marks directory, `<state>/generations/`.
#[derive(Debug)]
pub struct MarkStore {
    /// Replaced only by [`reopen`](Self::reopen), after the state directory was lost under the
    /// running agent: the old descriptor names a directory that no longer exists.
    dir: std::sync::RwLock<Arc<DurableDir>>,
}

impl MarkStore {
    /// Opens (creating) the marks directory.
    pub fn open(state_dir: &std::path::Path) -> Result<Self, EngineError> {
        Ok(Self {
            dir: std::sync::RwLock::new(DurableDir::open(state_dir.join("generations"))?),
        })
    }

    /// Opens (creating) the snapshots' marks directory, `<state>/snapshot-generations/`:
    /// apart from volumes', so a snapshot and a volume of the same ID never share a mark.
    pub fn open_snapshots(state_dir: &std::path::Path) -> Result<Self, EngineError> {
        Ok(Self {
            dir: std::sync::RwLock::new(DurableDir::open(state_dir.join("snapshot-generations"))?),
        })
    }

    fn dir(&self) -> Arc<DurableDir> {
        Arc::clone(
            &self
                .dir
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Opens the directory again by its path (creating it): after the state directory was
    /// deleted under the agent, marks go to the new one.
    pub fn reopen(&self) -> Result<(), EngineError> {
        let path = self.dir().path().to_path_buf();
        let fresh = DurableDir::open(path)?;
        *self
            .dir
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
        Ok(())
    }

    fn file_name(volume: &VolumeId) -> String {
        format!("{volume}.json")
    }

    /// The mark of `volume`; `None` only when no mark file exists.
    pub fn read(&self, volume: &VolumeId) -> Result<Option<Mark>, MarkError> {
        let path = self.dir().path().join(Self::file_name(volume));
        let shown = path.display().to_string();
        match std::fs::read(&path) {
            Ok(bytes) => decode(volume, &bytes)
                .map(Some)
                .map_err(|reason| MarkError::Corrupt {
                    path: shown,
                    reason,
                }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(MarkError::Unreadable {
                path: shown,
                source,
            }),
        }
    }

    /// `volumes` without those that have a mark file, from one listing of the directory on a
    /// blocking thread. What [`read`](Self::read) answers `Ok(None)` for (the file is not
    /// found) is exactly a volume whose `<volume>.json` is not listed, so this needs no read and
    /// decode of every mark (a corrupt mark is listed: it is a mark), and no second set as large
    /// as the listing. Each name is looked up as it is: the engine's hidden temporary files
    /// start with a dot, which no volume ID does, and match nothing.
    pub async fn retain_unmarked(
        &self,
        mut volumes: HashSet<VolumeId>,
    ) -> Result<HashSet<VolumeId>, MarkError> {
        let dir = self.dir();
        let unreadable = {
            let path = dir.path().display().to_string();
            move |source| MarkError::Unreadable { path, source }
        };
        let listing = crate::blocking::spawn(move || -> io::Result<HashSet<VolumeId>> {
            for entry in std::fs::read_dir(dir.path())? {
                let name = entry?.file_name();
                if let Some(volume) = name.to_str().and_then(|n| n.strip_suffix(".json")) {
                    volumes.remove(volume);
                }
            }
            Ok(volumes)
        });
        match listing.await {
            Ok(left) => left.map_err(unreadable),
            Err(join) => Err(unreadable(io::Error::other(join))),
        }
    }

    /// Makes `mark` durable (temp, fsync, rename, fsync dir) through `engine`.
    pub async fn write(
        &self,
        engine: &Engine,
        volume: &VolumeId,
        mark: &Mark,
    ) -> Result<(), MarkError> {
        let bytes = encode(mark).map_err(|e| MarkError::Corrupt {
            path: volume.to_string(),
            reason: e.to_string(),
        })?;
        engine
            .replace_file(&self.dir(), &Self::file_name(volume), bytes)
            .await
            .map_err(|source| MarkError::Write {
                volume: volume.to_string(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol() -> VolumeId {
        VolumeId::parse("v1").unwrap()
    }
    fn tok(uid: &str, generation: u64) -> Token {
        Token {
            uid: uid.into(),
            generation,
        }
    }
    fn mark(uid: &str, generation: u64, ended: bool, retired: &[&str]) -> Mark {
        Mark {
            volume: "v1".into(),
            owner_uid: uid.into(),
            generation,
            ended,
            retired_uids: retired.iter().map(|s| s.to_string()).collect(),
        }
    }

    // proves F6 (no token)
    #[test]
    fn missing_or_empty_token_is_refused() {
        assert_eq!(
            decide(&vol(), None, None, Intent::Create),
            Err(Rejection::NoToken)
        );
        assert_eq!(
            decide(&vol(), None, Some(&tok("", 1)), Intent::Create),
            Err(Rejection::NoToken)
        );
    }

    #[test]
    fn first_request_creates_the_mark() {
        let d = decide(&vol(), None, Some(&tok("a", 3)), Intent::Create).unwrap();
        assert_eq!(d, Some(mark("a", 3, false, &[])));
        let d = decide(&vol(), None, Some(&tok("a", 3)), Intent::Delete).unwrap();
        assert_eq!(
            d,
            Some(mark("a", 3, true, &[])),
            "a delete of an unknown volume still ends it"
        );
    }

    // proves F6 (lower generation), and that an equal generation is an idempotent retry
    #[test]
    fn generations_only_move_forward() {
        let m = mark("a", 5, false, &[]);
        assert!(matches!(
            decide(&vol(), Some(&m), Some(&tok("a", 4)), Intent::Revoke),
            Err(Rejection::StaleGeneration {
                got: 4,
                mark: 5,
                ..
            })
        ));
        assert_eq!(
            decide(&vol(), Some(&m), Some(&tok("a", 5)), Intent::Grant),
            Ok(None)
        );
        assert_eq!(
            decide(&vol(), Some(&m), Some(&tok("a", 6)), Intent::Grant),
            Ok(Some(mark("a", 6, false, &[])))
        );
    }

    // proves F6 (foreign owner, retired lifecycle)
    #[test]
    fn other_lifecycles_are_refused_until_the_owner_ended() {
        let live = mark("a", 5, false, &[]);
        assert!(matches!(
            decide(&vol(), Some(&live), Some(&tok("b", 9)), Intent::Create),
            Err(Rejection::ForeignOwner { .. })
        ));
        let ended = mark("a", 6, true, &[]);
        let taken = decide(&vol(), Some(&ended), Some(&tok("b", 1)), Intent::Create)
            .unwrap()
            .unwrap();
        assert_eq!(taken, mark("b", 1, false, &["a"]));
        // The old lifecycle can never come back, whatever its generation.
        assert_eq!(
            decide(&vol(), Some(&taken), Some(&tok("a", 100)), Intent::Revoke),
            Err(Rejection::Retired { uid: "a".into() })
        );
    }

    // proves F6 (create or grant on an ended lifecycle)
    #[test]
    fn an_ended_lifecycle_cannot_build_but_can_tear_down() {
        let ended = mark("a", 6, true, &[]);
        for intent in [
            Intent::Create,
            Intent::Grant,
            Intent::Export,
            Intent::Expand,
            Intent::Resync,
        ] {
            assert_eq!(
                decide(&vol(), Some(&ended), Some(&tok("a", 7)), intent),
                Err(Rejection::Ended { uid: "a".into() })
            );
        }
        for intent in [Intent::Revoke, Intent::Unexport, Intent::Delete] {
            assert!(decide(&vol(), Some(&ended), Some(&tok("a", 7)), intent).is_ok());
        }
        assert_eq!(
            decide(
                &vol(),
                Some(&mark("a", 6, false, &[])),
                Some(&tok("a", 6)),
                Intent::Delete
            ),
            Ok(Some(ended))
        );
    }

    // proves F8
    // proves F4, F6: the assertion `decide` makes of its own answers holds for every answer it
    // gives, and refuses each way a successor could go wrong
    #[test]
    fn every_decided_mark_follows_the_one_it_replaces() {
        let marks = [
            None,
            Some(mark("a", 3, false, &[])),
            Some(mark("a", 3, true, &["z"])),
            Some(mark("b", 1, false, &["a"])),
        ];
        let intents = [
            Intent::Create,
            Intent::Expand,
            Intent::Export,
            Intent::Grant,
            Intent::Resync,
            Intent::Revoke,
            Intent::Unexport,
            Intent::Delete,
        ];
        let mut decided = 0;
        for prev in &marks {
            for uid in ["a", "b", "c", "z"] {
                for generation in [0, 2, 3, 4] {
                    for intent in intents {
                        let token = tok(uid, generation);
                        if let Ok(Some(next)) = decide(&vol(), prev.as_ref(), Some(&token), intent) {
                            assert!(follows(prev.as_ref(), &next), "{prev:?} -> {next:?}");
                            decided += 1;
                        }
                    }
                }
            }
        }
        assert!(decided > 20, "{decided}");
        let prev = mark("a", 3, true, &["z"]);
        for bad in [
            mark("a", 2, true, &["z"]),       // generation down
            mark("a", 3, false, &["z"]),      // an end undone
            mark("a", 3, true, &[]),          // a retired lifecycle forgotten
            mark("z", 9, false, &["z", "a"]), // a retired lifecycle owns again
            mark("b", 1, false, &["z"]),      // a takeover that does not retire the owner
        ] {
            assert!(!follows(Some(&prev), &bad), "{bad:?}");
        }
        assert!(!follows(
            Some(&mark("a", 3, false, &[])),
            &mark("b", 1, false, &["a"])
        ));
    }

    /// The on-disk bytes of a mark, fixed: a mark written by any build of the agent is read by
    /// every later one (the checksum is SHA-256 of the mark's compact JSON, in lowercase hex).
    #[test]
    fn a_marks_bytes_on_disk_are_fixed() {
        let m = Mark {
            volume: "pvc-1".into(),
            owner_uid: "uid-a".into(),
            generation: 5,
            ended: false,
            retired_uids: vec!["z".into(), "y".into()],
        };
        let golden = "{\n  \"format\": 1,\n  \"mark\": {\n    \"volume\": \"pvc-1\",\n    \
                      \"owner_uid\": \"uid-a\",\n    \"generation\": 5,\n    \"ended\": false,\n    \
                      \"retired_uids\": [\n      \"z\",\n      \"y\"\n    ]\n  },\n  \"sha256\": \
                      \"d22f839972152f0aacb72aa23089a9625e1908ef919ec15fd3fb31847dce2226\"\n}\n";
        assert_eq!(String::from_utf8(encode(&m).unwrap()).unwrap(), golden);
        assert_eq!(
            decode(&VolumeId::parse("pvc-1").unwrap(), golden.as_bytes()).unwrap(),
            m
        );
    }

    #[test]
    fn a_damaged_mark_never_decodes() {
        let m = mark("a", 5, false, &["z"]);
        let bytes = encode(&m).unwrap();
        assert_eq!(decode(&vol(), &bytes).unwrap(), m);
        let text = String::from_utf8(bytes.clone()).unwrap();
        let tampered = text.replace("\"generation\": 5", "\"generation\": 50");
        assert!(
            decode(&vol(), tampered.as_bytes())
                .unwrap_err()
                .contains("checksum")
        );
        assert!(
            decode(&vol(), &bytes[..bytes.len() / 2]).is_err(),
            "truncated"
        );
        assert!(decode(&vol(), b"").is_err());
        assert!(
            decode(&VolumeId::parse("v2").unwrap(), &bytes)
                .unwrap_err()
                .contains("belongs")
        );
    }
}
