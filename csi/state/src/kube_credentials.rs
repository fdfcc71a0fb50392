//! Nodes' DH-HMAC-CHAP credentials in the Kubernetes store (W10): one Secret per node in
//! pillar's namespace, readable by the controller's ServiceAccount only.
//!
//! Invariants:
//! - A node's pair lives in Secret `pillar-dhchap-<first 16 bytes of SHA-256(node), hex>` (any
//!   node name makes one valid, bounded Secret name), type [`SECRET_TYPE`], data `node`,
//!   `hostNqn`, `dhchapSecret`, `dhchapCtrlSecret`, annotation [`NODE_ANNOTATION`] naming the
//!   node (for an operator; the data's `node` is what is checked).
//! - Made on first use by a create: a replica that loses the race (AlreadyExists) reads the
//!   winner's. Replaced (rotation, a changed host NQN) by an update conditional on the
//!   resourceVersion read: a replica that loses (Conflict) reads again. Two replicas never hand
//!   out two pairs for one node.
//! - A Secret that does not hold a well-formed pair of this node fails closed (corrupt): it is
//!   never overwritten silently.
//! - The RBAC that reaches it: a Role in pillar's namespace granting the controller's
//!   ServiceAccount `get`, `create`, `update` on secrets; no `list` or `watch` (a list would
//!   read every Secret of the namespace), nothing for the node plugin's ServiceAccount.
//! - The delivery of a node's pair to that node only reads ([`KubeStore::stored_credentials`]):
//!   a request naming another host NQN than the stored pair's gets nothing and changes nothing.
//! - Nothing here logs a secret; errors name the node and the Secret, never its data.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use pillar_nvmet::DhchapSecret;
use sha2::{Digest as _, Sha256};

use crate::credentials::{CredentialsError, NodeCredentials};
use crate::kube_store::KubeStore;
use crate::store::StoreError;

/// The `type` of a node's credentials Secret.
pub const SECRET_TYPE: &str = "pillar-csi.io/dhchap";
/// The annotation naming the node whose pair a Secret holds.
pub const NODE_ANNOTATION: &str = "pillar-csi.io/node";
/// The prefix of every credentials Secret's name.
pub const SECRET_PREFIX: &str = "pillar-dhchap-";

const KIND: &str = "Secret";
const KEY_NODE: &str = "node";
const KEY_HOST_NQN: &str = "hostNqn";
const KEY_SECRET: &str = "dhchapSecret";
const KEY_CTRL_SECRET: &str = "dhchapCtrlSecret";
/// Reads and writes before a contended node's credentials are given up on (each lost race
/// means another replica wrote them, so the next read normally settles it).
const ATTEMPTS: usize = 5;

/// The Secret holding `node`'s credentials.
pub fn secret_name(node: &str) -> String {
    let digest = Sha256::digest(node.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{SECRET_PREFIX}{hex}")
}

/// The Secret for `creds` in `namespace`; `resource_version` makes its update conditional.
pub fn secret_object(
    namespace: &str,
    creds: &NodeCredentials,
    resource_version: Option<String>,
) -> Secret {
    let data = [
        (KEY_NODE, &creds.node),
        (KEY_HOST_NQN, &creds.host_nqn),
        (KEY_SECRET, &creds.secret),
        (KEY_CTRL_SECRET, &creds.ctrl_secret),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), ByteString(v.as_bytes().to_vec())))
    .collect();
    Secret {
        metadata: ObjectMeta {
            name: Some(secret_name(&creds.node)),
            namespace: Some(namespace.to_owned()),
            annotations: Some(BTreeMap::from([(
                NODE_ANNOTATION.to_owned(),
                creds.node.clone(),
            )])),
            resource_version,
            ..ObjectMeta::default()
        },
        type_: Some(SECRET_TYPE.to_owned()),
        data: Some(data),
        ..Secret::default()
    }
}

/// `node`'s credentials as `secret` holds them; an error when it holds anything else.
pub fn credentials_of(secret: &Secret, node: &str) -> Result<NodeCredentials, CredentialsError> {
    let name = secret.metadata.name.clone().unwrap_or_default();
    let corrupt = |reason: String| CredentialsError::CorruptSecret {
        node: node.to_owned(),
        secret: name.clone(),
        reason,
    };
    if secret.type_.as_deref() != Some(SECRET_TYPE) {
        return Err(corrupt(format!("its type is not {SECRET_TYPE}")));
    }
    let field = |key: &str| -> Result<String, CredentialsError> {
        let bytes = secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .ok_or_else(|| corrupt(format!("no {key}")))?;
        String::from_utf8(bytes.0.clone()).map_err(|_| corrupt(format!("{key} is not UTF-8")))
    };
    let creds = NodeCredentials {
        node: field(KEY_NODE)?,
        host_nqn: field(KEY_HOST_NQN)?,
        secret: field(KEY_SECRET)?,
        ctrl_secret: field(KEY_CTRL_SECRET)?,
    };
    if creds.node != node {
        return Err(corrupt(format!("names node {:?}", creds.node)));
    }
    for (key, s) in [
        (KEY_SECRET, &creds.secret),
        (KEY_CTRL_SECRET, &creds.ctrl_secret),
    ] {
        // The parse error says what is wrong with the form, never the secret.
        DhchapSecret::parse(s).map_err(|e| corrupt(format!("{key}: {e}")))?;
    }
    Ok(creds)
}

/// What became of a write that lost to another writer.
enum Lost {
    /// Another replica wrote the Secret first: read it again.
    Race,
    /// Any other failure.
    Failed(StoreError),
}

fn map_err(verb: &'static str, name: &str, err: kube::Error) -> Lost {
    match err {
        kube::Error::Api(status)
            if (status.is_already_exists() && verb == "create")
                || (status.is_conflict() && verb == "update") =>
        {
            Lost::Race
        }
        kube::Error::Api(status) => Lost::Failed(StoreError::Refused {
            verb,
            kind: KIND,
            name: name.to_owned(),
            source: status,
        }),
        source => Lost::Failed(StoreError::Kube {
            verb,
            kind: KIND,
            name: name.to_owned(),
            source,
        }),
    }
}

impl KubeStore {
    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.client().clone(), self.credentials_namespace())
    }

    /// `node`'s stored credentials when they were made for `host_nqn`; `None` when there are
    /// none or they are another host NQN's. Only reads (a `get`): never makes or replaces a
    /// pair. A Secret that does not hold this node's well-formed pair fails closed.
    pub(crate) async fn stored_credentials(
        &self,
        node: &str,
        host_nqn: &str,
    ) -> Result<Option<NodeCredentials>, StoreError> {
        crate::validate_name("node", node)?;
        let name = secret_name(node);
        let stored =
            self.secrets()
                .get_opt(&name)
                .await
                .map_err(|e| match map_err("get", &name, e) {
                    Lost::Failed(e) => e,
                    // Only a create or an update loses a race; a read never does.
                    Lost::Race => StoreError::Conflict {
                        kind: KIND,
                        name: name.clone(),
                        expected: String::new(),
                        message: "a read reported a lost race".into(),
                    },
                })?;
        match stored {
            None => Ok(None),
            Some(s) => {
                let current = credentials_of(&s, node)?;
                Ok((current.host_nqn == host_nqn).then_some(current))
            }
        }
    }

    /// `node`'s credentials for `host_nqn`: the stored ones, or new ones when there are none,
    /// they were made for another host NQN, or `rotate` asks for new ones.
    pub(crate) async fn credentials(
        &self,
        node: &str,
        host_nqn: &str,
        rotate: bool,
    ) -> Result<NodeCredentials, StoreError> {
        crate::validate_name("node", node)?;
        let name = secret_name(node);
        let api = self.secrets();
        for _ in 0..ATTEMPTS {
            let stored = match api.get_opt(&name).await {
                Ok(s) => s,
                Err(e) => match map_err("get", &name, e) {
                    Lost::Race => continue,
                    Lost::Failed(e) => return Err(e),
                },
            };
            let written = match stored {
                Some(s) => {
                    let current = credentials_of(&s, node)?;
                    if !rotate && current.host_nqn == host_nqn {
                        return Ok(current);
                    }
                    let fresh = NodeCredentials::generate(node, host_nqn)?;
                    let object = secret_object(
                        self.credentials_namespace(),
                        &fresh,
                        s.metadata.resource_version.clone(),
                    );
                    api.replace(&name, &PostParams::default(), &object)
                        .await
                        .map(|_| fresh)
                        .map_err(|e| map_err("update", &name, e))
                }
                None => {
                    let fresh = NodeCredentials::generate(node, host_nqn)?;
                    let object = secret_object(self.credentials_namespace(), &fresh, None);
                    api.create(&PostParams::default(), &object)
                        .await
                        .map(|_| fresh)
                        .map_err(|e| map_err("create", &name, e))
                }
            };
            match written {
                Ok(c) => return Ok(c),
                // Another replica wrote them: a create reads theirs, a rotation rotates theirs.
                Err(Lost::Race) => continue,
                Err(Lost::Failed(e)) => return Err(e),
            }
        }
        Err(StoreError::Conflict {
            kind: KIND,
            name,
            expected: String::new(),
            message: format!("still contended after {ATTEMPTS} attempts"),
        })
    }
}
