//! Nodes' DH-HMAC-CHAP credentials (W10), kept by the controller's store.
//!
//! Invariants:
//! - One pair per node: the secret the node proves and the controller secret the node checks
//!   the target with (bidirectional authentication); made from the kernel's CSPRNG the first
//!   time the node is admitted, and again when its host NQN changed or on rotation.
//! - Only the controller reads them. The embedded store keeps each node's pair in its own file
//!   under `<store>/dhchap/`, mode 0600, written atomically and durably; the Kubernetes store in
//!   a Secret per node in pillar's namespace (`kube_credentials`). Nothing here logs a secret,
//!   and `Debug` redacts both.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use pillar_nvmet::DhchapSecret;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// A node's credentials.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeCredentials {
    /// The node (its CSI node name).
    pub node: String,
    /// The host NQN they were made for.
    pub host_nqn: String,
    /// The secret the node proves (`DHHC-1:...`).
    pub secret: String,
    /// The secret the target proves back.
    pub ctrl_secret: String,
}

impl fmt::Debug for NodeCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeCredentials")
            .field("node", &self.node)
            .field("host_nqn", &self.host_nqn)
            .finish_non_exhaustive()
    }
}

/// Why credentials could not be read or made.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("cannot create the credentials directory {path}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the credentials of node {node} at {path}")]
    Read {
        node: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the credentials of node {node} at {path} are corrupt: {reason}")]
    Corrupt {
        node: String,
        path: PathBuf,
        reason: String,
    },
    #[error("cannot write the credentials of node {node} at {path}")]
    Write {
        node: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the credentials of node {node} in Secret {secret} are corrupt: {reason}")]
    CorruptSecret {
        node: String,
        secret: String,
        reason: String,
    },
    #[error("cannot make a secret")]
    Generate(#[source] pillar_nvmet::AuthError),
}

impl NodeCredentials {
    /// New credentials for `node` presenting `host_nqn`.
    pub fn generate(node: &str, host_nqn: &str) -> Result<Self, CredentialsError> {
        Ok(Self {
            node: node.to_owned(),
            host_nqn: host_nqn.to_owned(),
            secret: DhchapSecret::generate()
                .map_err(CredentialsError::Generate)?
                .expose()
                .to_owned(),
            ctrl_secret: DhchapSecret::generate()
                .map_err(CredentialsError::Generate)?
                .expose()
                .to_owned(),
        })
    }
}

/// The file of `node`'s credentials under `dir`: named by a digest of the node name, so any
/// node name makes one plain file name.
pub fn file_of(dir: &Path, node: &str) -> PathBuf {
    let digest = Sha256::digest(node.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("{hex}.json"))
}

/// Reads `node`'s credentials from `dir`: `None` when there are none.
pub fn read(dir: &Path, node: &str) -> Result<Option<NodeCredentials>, CredentialsError> {
    let path = file_of(dir, node);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CredentialsError::Read {
                node: node.to_owned(),
                path,
                source,
            });
        }
    };
    let corrupt = |reason: String| CredentialsError::Corrupt {
        node: node.to_owned(),
        path: path.clone(),
        reason,
    };
    let creds: NodeCredentials =
        serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
    if creds.node != node {
        return Err(corrupt(format!("names node {:?}", creds.node)));
    }
    for s in [&creds.secret, &creds.ctrl_secret] {
        DhchapSecret::parse(s).map_err(|e| corrupt(e.to_string()))?;
    }
    Ok(Some(creds))
}

/// Writes `creds` into `dir` atomically and durably, readable by the owner only.
pub fn write(dir: &Path, creds: &NodeCredentials) -> Result<(), CredentialsError> {
    let err = |path: &Path| {
        let node = creds.node.clone();
        let path = path.to_owned();
        move |source| CredentialsError::Write { node, path, source }
    };
    fs::create_dir_all(dir).map_err(|source| CredentialsError::CreateDir {
        path: dir.to_owned(),
        source,
    })?;
    let target = file_of(dir, &creds.node);
    let tmp = target.with_extension("json.tmp");
    let bytes = serde_json::to_vec(creds).map_err(|e| CredentialsError::Write {
        node: creds.node.clone(),
        path: target.clone(),
        source: std::io::Error::other(e),
    })?;
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(err(&tmp))?;
    f.write_all(&bytes).map_err(err(&tmp))?;
    f.sync_all().map_err(err(&tmp))?;
    fs::rename(&tmp, &target).map_err(err(&target))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(err(dir))?;
    Ok(())
}

/// `node`'s credentials in `dir`, made when missing or made for another host NQN.
pub fn get_or_create(
    dir: &Path,
    node: &str,
    host_nqn: &str,
) -> Result<NodeCredentials, CredentialsError> {
    if let Some(c) = read(dir, node)?
        && c.host_nqn == host_nqn
    {
        return Ok(c);
    }
    let c = NodeCredentials::generate(node, host_nqn)?;
    write(dir, &c)?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    // proves W10
    #[test]
    fn credentials_are_made_once_per_node_owner_only_and_never_in_debug() {
        let dir = tempfile::tempdir().unwrap();
        let a = get_or_create(dir.path(), "node-a", "nqn.h:a").unwrap();
        let again = get_or_create(dir.path(), "node-a", "nqn.h:a").unwrap();
        assert_eq!(a, again);
        let b = get_or_create(dir.path(), "node-b", "nqn.h:b").unwrap();
        assert_ne!(a.secret, b.secret);
        assert_ne!(a.secret, a.ctrl_secret);
        let mode = fs::metadata(file_of(dir.path(), "node-a"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let shown = format!("{a:?}");
        assert!(!shown.contains(&a.secret[10..]), "{shown}");
        // A new host NQN: new credentials.
        let moved = get_or_create(dir.path(), "node-a", "nqn.h:a2").unwrap();
        assert_ne!(moved.secret, a.secret);
        // Corrupt: an error, never new credentials over it.
        fs::write(file_of(dir.path(), "node-b"), b"{").unwrap();
        assert!(matches!(
            get_or_create(dir.path(), "node-b", "nqn.h:b"),
            Err(CredentialsError::Corrupt { .. })
        ));
    }
}
