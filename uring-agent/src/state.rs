//! The state directory's own identity (C6).
//!
//! `<state>/state-id` holds a random UUID, written durably (temp file, fsync, rename, fsync of
//! the directory) the first time the agent starts on a state directory. The agent checks it
//! whenever a request finds no fencing mark: a state directory deleted or replaced under the
//! running agent shows as a missing or different identity, and the agent then knows that "no
//! mark" means "mark lost", not "never seen".
//!
//! Invariants:
//! - The file is written only when absent at start ([`StateIdentity::open`]) and after a loss
//!   was detected ([`StateIdentity::renew`]); nothing else writes or removes it.
//! - [`StateIdentity::intact`] is true only while the file holds the UUID this process wrote
//!   or read: an unreadable or different file counts as lost, never as intact.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use pillar_durable::DurableFs;

/// The file's name in the state directory.
pub const FILE: &str = "state-id";

/// Why the identity could not be written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state identity {path} cannot be read")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("state identity {path} cannot be written")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What [`StateIdentity::open`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// A valid identity: the state directory is the one an earlier start initialised.
    Present,
    /// No identity file: a first start, a state directory from before the file existed, or a
    /// lost one; the agent's scan of what it holds tells which.
    Absent,
    /// A file that is not a UUID: treated as a lost state (a fresh identity is written).
    Corrupt,
}

/// The state directory's identity (see the module documentation).
#[derive(Debug)]
pub struct StateIdentity {
    dir: PathBuf,
    id: std::sync::Mutex<String>,
    /// The file operations of [`renew`](Self::renew) (`std::fs`; a recorder in the crash-state
    /// tests).
    fs: Arc<dyn DurableFs>,
}

impl StateIdentity {
    /// Reads the identity of `dir`, writing a fresh one when it is absent or corrupt.
    pub fn open(dir: &Path) -> Result<(Self, Found), StateError> {
        Self::open_with(dir, pillar_durable::std_fs())
    }

    /// [`open`](Self::open), writing through `fs`.
    pub fn open_with(dir: &Path, fs: Arc<dyn DurableFs>) -> Result<(Self, Found), StateError> {
        let path = dir.join(FILE);
        let found = match std::fs::read_to_string(&path) {
            Ok(text) => match uuid::Uuid::parse_str(text.trim()) {
                Ok(id) => {
                    let me = Self {
                        dir: dir.to_path_buf(),
                        id: std::sync::Mutex::new(id.to_string()),
                        fs,
                    };
                    return Ok((me, Found::Present));
                }
                Err(_) => Found::Corrupt,
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Found::Absent,
            Err(source) => return Err(StateError::Read { path, source }),
        };
        let me = Self {
            dir: dir.to_path_buf(),
            id: std::sync::Mutex::new(String::new()),
            fs,
        };
        me.renew()?;
        Ok((me, found))
    }

    fn current(&self) -> std::sync::MutexGuard<'_, String> {
        self.id
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the file still holds this process's identity.
    pub fn intact(&self) -> bool {
        std::fs::read_to_string(self.dir.join(FILE))
            .is_ok_and(|text| text.trim() == self.current().as_str())
    }

    /// Writes a fresh identity (creating the directory): the state starts anew.
    pub fn renew(&self) -> Result<(), StateError> {
        let id = uuid::Uuid::new_v4().to_string();
        let path = self.dir.join(FILE);
        let err = |source| StateError::Write {
            path: path.clone(),
            source,
        };
        let fs = &*self.fs;
        fs.create_dir_all(&self.dir).map_err(err)?;
        let temp = self.dir.join(format!(".{FILE}.{}.tmp", std::process::id()));
        let mut file = fs.create(&temp).map_err(err)?;
        file.write_all(format!("{id}\n").as_bytes()).map_err(err)?;
        file.sync_all().map_err(err)?;
        drop(file);
        fs.rename(&temp, &path).map_err(err)?;
        fs.sync_dir(&self.dir).map_err(err)?;
        *self.current() = id;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_is_kept_across_opens_and_a_lost_one_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let (first, found) = StateIdentity::open(&state).unwrap();
        assert_eq!(found, Found::Absent);
        assert!(first.intact());
        let (again, found) = StateIdentity::open(&state).unwrap();
        assert_eq!(found, Found::Present);
        assert!(again.intact() && first.intact());
        std::fs::remove_dir_all(&state).unwrap();
        assert!(!first.intact(), "a deleted state directory is seen");
        first.renew().unwrap();
        assert!(first.intact());
        assert!(!again.intact(), "another identity is not this process's");
        std::fs::write(state.join(FILE), "not a uuid").unwrap();
        assert_eq!(StateIdentity::open(&state).unwrap().1, Found::Corrupt);
    }
}
