//! [`EmbeddedError`]: why the [`EmbeddedStore`](crate::embedded::EmbeddedStore) failed on disk,
//! one variant per step. A leaf of its own, so that [`StoreError`](crate::StoreError) can carry
//! it without the store's traits importing the store that implements them.

use std::io;
use std::path::PathBuf;

/// Why the embedded store failed on disk.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EmbeddedError {
    /// A node's DH-HMAC-CHAP credentials (under `dhchap/`) could not be read or made.
    #[error(transparent)]
    Credentials(crate::credentials::CredentialsError),
    /// Creating the state directory or one of its subdirectories failed.
    #[error("create state directory {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Opening the lock file failed.
    #[error("open lock file {path}")]
    OpenLock {
        /// The lock file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Another process (or another store in this process) has the directory open.
    #[error("state directory {path} is in use: another process holds the lock on {path}/LOCK")]
    Locked {
        /// The state directory.
        path: PathBuf,
    },
    /// Taking the lock failed for a reason other than contention.
    #[error("lock {path}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Reading a file or directory failed.
    #[error("read {path}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A record does not parse as its kind.
    #[error("{path} is not a valid {kind} record")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The expected kind.
        kind: &'static str,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A record parses but contradicts its file name or lacks store-assigned metadata.
    #[error("{path} is not a valid {kind} record: {reason}")]
    Inconsistent {
        /// The file.
        path: PathBuf,
        /// The expected kind.
        kind: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The resourceVersion counter file does not hold a decimal number.
    #[error("{path} holds {found:?}, not a resourceVersion")]
    CorruptCounter {
        /// The counter file.
        path: PathBuf,
        /// What it holds.
        found: String,
    },
    /// Records exist but the counter file does not: the next resourceVersion cannot be proven
    /// higher than every one handed out before.
    #[error("{path} is missing although the state directory holds records")]
    MissingCounter {
        /// The counter file.
        path: PathBuf,
    },
    /// The counter reached `u64::MAX`.
    #[error("the resourceVersion counter is exhausted")]
    CounterExhausted,
    /// Serialising an object failed.
    #[error("encode {kind} {name:?}")]
    Encode {
        /// Kind.
        kind: &'static str,
        /// Name.
        name: String,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// Writing or fsyncing a temporary file failed.
    #[error("write {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Renaming a temporary file over its target failed.
    #[error("rename {from} to {to}")]
    Rename {
        /// The temporary file.
        from: PathBuf,
        /// The target.
        to: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Removing a record failed.
    #[error("remove {path}")]
    Remove {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Fsyncing a directory failed.
    #[error("fsync directory {path}")]
    SyncDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The blocking task running the file operations panicked or was cancelled.
    #[error("the state directory task failed")]
    Task(#[source] tokio::task::JoinError),
}
