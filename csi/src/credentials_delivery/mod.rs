//! Delivery of a node's DH-HMAC-CHAP pair to that node and to no other (W10), with the
//! Kubernetes store: the controller's side of the exchange.
//!
//! The node plugin proves which node it runs on with its projected ServiceAccount token
//! (audience [`AUDIENCE`], bound by kubelet to the plugin's pod and so to its node); the
//! controller has the API server review it (`authentication.k8s.io/v1` TokenReview, asking for
//! [`AUDIENCE`]) and answers the pair of the node the token is bound to, nothing else.
//!
//! Invariants:
//! - Answered only when the review says: authenticated; valid for [`AUDIENCE`] (checked in the
//!   answer's `audiences`, not only asked for: a server that ignores audiences answers none);
//!   the user is the node plugin's ServiceAccount; and the token is bound to a pod on exactly the
//!   node asked for (`user.extra` [`NODE_NAME_EXTRA`], one value). A legacy Secret-based token
//!   carries no node binding and is refused.
//! - Every refusal is decided before the store is read: a refused request makes or rotates
//!   nothing.
//! - A failed review (API server unreachable, RBAC) is UNAVAILABLE, never an answer; the node
//!   plugin then refuses its stage (fail closed).
//! - Errors name the node, the account and the audience, never the token or a secret.

use std::sync::Arc;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use kube::api::{Api, PostParams};
use pillar_state::credentials::NodeCredentials;
use pillar_state::store::{StateStore, StoreError};

/// The audience of the node plugin's projected token for this exchange.
pub const AUDIENCE: &str = "pillar-csi.io/node-credentials";
/// The extra a pod-bound token's review carries naming the pod's node (Kubernetes 1.30+).
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// The node plugin's ServiceAccount name (deploy/base/rbac.yaml).
pub const NODE_ACCOUNT: &str = "pillar-node";

/// Why a node's request for its pair was not answered.
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    /// The API server did not review the token.
    #[error("the API server did not review the node's token")]
    Review(#[source] kube::Error),
    /// The API server does not authenticate the token (forged, expired, its pod gone).
    #[error("the node's token is not authenticated: {0}")]
    NotAuthenticated(String),
    /// The token is not meant for this exchange.
    #[error("the node's token is not valid for audience {AUDIENCE}")]
    Audience,
    /// The token is another ServiceAccount's.
    #[error("the token belongs to {found}, not the node plugin's ServiceAccount {expected}")]
    Account {
        /// The reviewed user.
        found: String,
        /// The node plugin's ServiceAccount user name.
        expected: String,
    },
    /// The token is bound to no node (a legacy token, or an API server before 1.30).
    #[error("the token is bound to no node ({NODE_NAME_EXTRA} missing or ambiguous)")]
    NotNodeBound,
    /// The token is bound to another node than the one asked for.
    #[error("the token is bound to node {bound}, not to node {asked} whose pair was asked for")]
    OtherNode {
        /// The node the token is bound to.
        bound: String,
        /// The node asked for.
        asked: String,
    },
    /// The store could not give the pair.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl DeliveryError {
    /// The gRPC code the node plugin gets.
    pub fn code(&self) -> tonic::Code {
        match self {
            Self::Review(_) | Self::Store(_) => tonic::Code::Unavailable,
            Self::NotAuthenticated(_) | Self::Audience => tonic::Code::Unauthenticated,
            Self::Account { .. } | Self::NotNodeBound | Self::OtherNode { .. } => {
                tonic::Code::PermissionDenied
            }
        }
    }
}

/// The TokenReview asking whether `token` is valid for [`AUDIENCE`].
pub fn token_review(token: &str) -> TokenReview {
    TokenReview {
        spec: TokenReviewSpec {
            token: token.to_owned(),
            audiences: Some(vec![AUDIENCE.to_owned()]),
        },
        ..TokenReview::default()
    }
}

/// Whether a review's `status` lets the token's holder have `node`'s pair: see the module's
/// invariants. `node_user` is the node plugin's ServiceAccount user name.
pub fn check_review(
    status: &TokenReviewStatus,
    node: &str,
    node_user: &str,
) -> Result<(), DeliveryError> {
    if status.authenticated != Some(true) {
        return Err(DeliveryError::NotAuthenticated(
            status.error.clone().unwrap_or_default(),
        ));
    }
    if !status
        .audiences
        .as_ref()
        .is_some_and(|a| a.iter().any(|a| a == AUDIENCE))
    {
        return Err(DeliveryError::Audience);
    }
    let user = status.user.clone().unwrap_or_default();
    let found = user.username.unwrap_or_default();
    if found != node_user {
        return Err(DeliveryError::Account {
            found,
            expected: node_user.to_owned(),
        });
    }
    let bound = match user.extra.as_ref().and_then(|e| e.get(NODE_NAME_EXTRA)) {
        Some(v) if v.len() == 1 && !v[0].is_empty() => v[0].clone(),
        _ => return Err(DeliveryError::NotNodeBound),
    };
    if bound != node {
        return Err(DeliveryError::OtherNode {
            bound,
            asked: node.to_owned(),
        });
    }
    Ok(())
}

/// The controller's side: reviews a node's token, then answers that node's pair.
#[derive(Clone)]
pub struct Delivery {
    store: Arc<dyn StateStore>,
    client: kube::Client,
    node_user: String,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("node_user", &self.node_user)
            .finish_non_exhaustive()
    }
}

impl Delivery {
    /// Delivery from `store`, reviewing tokens with `client` (the controller's ServiceAccount:
    /// it needs `create` on `tokenreviews`), for the node plugin's ServiceAccount in
    /// `namespace`.
    pub fn new(store: Arc<dyn StateStore>, client: kube::Client, namespace: &str) -> Self {
        Self {
            store,
            client,
            node_user: format!("system:serviceaccount:{namespace}:{NODE_ACCOUNT}"),
        }
    }

    /// `node`'s pair (for its host NQN `host_nqn`), for the holder of `token`.
    pub async fn credentials_for(
        &self,
        token: &str,
        node: &str,
        host_nqn: &str,
    ) -> Result<NodeCredentials, DeliveryError> {
        let reviewed = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &token_review(token))
            .await
            .map_err(DeliveryError::Review)?;
        let status = reviewed.status.unwrap_or_default();
        if let Err(e) = check_review(&status, node, &self.node_user) {
            tracing::warn!(%node, error = %e, "a request for a node's DH-HMAC-CHAP pair was refused");
            return Err(e);
        }
        Ok(self.store.node_credentials(node, host_nqn).await?)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::authentication::v1::UserInfo;

    use super::*;

    const USER: &str = "system:serviceaccount:pillar-system:pillar-node";

    fn status(audiences: Option<&[&str]>, nodes: Option<&[&str]>) -> TokenReviewStatus {
        TokenReviewStatus {
            authenticated: Some(true),
            audiences: audiences.map(|a| a.iter().map(|s| (*s).to_owned()).collect()),
            user: Some(UserInfo {
                username: Some(USER.into()),
                extra: nodes.map(|n| {
                    BTreeMap::from([(
                        NODE_NAME_EXTRA.to_owned(),
                        n.iter().map(|s| (*s).to_owned()).collect(),
                    )])
                }),
                ..UserInfo::default()
            }),
            error: None,
        }
    }

    // proves W10 (delivery to its node only): a review that does not name the audience in its
    // answer (a server that ignores audiences), carries no node binding or two, or names
    // another node, lets nothing through; the one that names this node does.
    #[test]
    fn only_a_review_bound_to_the_node_asked_for_passes() {
        let ok = status(Some(&[AUDIENCE]), Some(&["node-1"]));
        check_review(&ok, "node-1", USER).unwrap();
        assert!(matches!(
            check_review(&ok, "node-2", USER),
            Err(DeliveryError::OtherNode { .. })
        ));
        assert!(matches!(
            check_review(&status(None, Some(&["node-1"])), "node-1", USER),
            Err(DeliveryError::Audience)
        ));
        assert!(matches!(
            check_review(&status(Some(&[AUDIENCE]), None), "node-1", USER),
            Err(DeliveryError::NotNodeBound)
        ));
        assert!(matches!(
            check_review(
                &status(Some(&[AUDIENCE]), Some(&["node-1", "node-2"])),
                "node-1",
                USER
            ),
            Err(DeliveryError::NotNodeBound)
        ));
        let mut other = ok.clone();
        if let Some(u) = other.user.as_mut() {
            u.username = Some("system:serviceaccount:pillar-system:pillar-controller".into());
        }
        assert!(matches!(
            check_review(&other, "node-1", USER),
            Err(DeliveryError::Account { .. })
        ));
        let mut unauth = ok;
        unauth.authenticated = Some(false);
        assert_eq!(
            check_review(&unauth, "node-1", USER).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }
}
