//! `authentication.k8s.io/v1` TokenReviews, as the API server answers them for the projected,
//! audience-bound ServiceAccount tokens kubelet mounts into a pod: POST
//! `/apis/authentication.k8s.io/v1/tokenreviews` (cluster-scoped, `create`, RBAC applied first).
//!
//! The double issues such tokens itself ([`super::ApiServerDouble::issue_pod_token`]): each is
//! bound to a ServiceAccount, a pod, the node the pod runs on and its audiences, and can be
//! revoked (the pod deleted). A review answers as the server's authenticator does:
//! - an unknown, expired or revoked token: `authenticated: false` with an `error` (never a
//!   failure status: a TokenReview of a bad token succeeds and says so);
//! - a token none of whose audiences is in `spec.audiences` (when it names any): not
//!   authenticated (`token audiences ... is invalid for the target audiences`);
//! - otherwise `authenticated: true`, `user.username` `system:serviceaccount:<ns>:<name>`, its
//!   groups, `user.extra` `authentication.kubernetes.io/pod-name`, `pod-uid` and `node-name`
//!   (what a pod-bound token carries since Kubernetes 1.30), and `status.audiences` the
//!   intersection of the token's and the requested ones (the token's own when none were asked).

use hyper::StatusCode;
use serde_json::{Value, json};

use super::rbac::ServiceAccount;
use super::{Answer, State, bad_request};

pub(super) const TOKENREVIEWS_PATH: &str = "/apis/authentication.k8s.io/v1/tokenreviews";

/// A token the double issued for a pod.
#[derive(Clone, Debug)]
pub(super) struct PodToken {
    pub account: ServiceAccount,
    pub pod: String,
    pub pod_uid: String,
    pub node: String,
    pub audiences: Vec<String>,
    pub revoked: bool,
    pub expired: bool,
}

pub(super) fn review(st: &State, body: Option<Value>) -> Answer {
    let Some(body) = body else {
        return bad_request("the body of the request was in an unknown format");
    };
    let token = body
        .pointer("/spec/token")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let wanted: Vec<String> = body
        .pointer("/spec/audiences")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let status = match st.pod_tokens.get(token) {
        None => json!({ "authenticated": false, "error": "invalid bearer token" }),
        Some(t) if t.expired => json!({
            "authenticated": false,
            "error": "[invalid bearer token, service account token has expired]",
        }),
        Some(t) if t.revoked => json!({
            "authenticated": false,
            "error": "token has been invalidated: the pod it is bound to no longer exists",
        }),
        Some(t) => {
            let audiences: Vec<&String> = if wanted.is_empty() {
                t.audiences.iter().collect()
            } else {
                t.audiences.iter().filter(|a| wanted.contains(a)).collect()
            };
            if audiences.is_empty() {
                json!({
                    "authenticated": false,
                    "error": format!("token audiences {:?} is invalid for the target audiences {:?}", t.audiences, wanted),
                })
            } else {
                json!({
                    "authenticated": true,
                    "user": {
                        "username": t.account.user_name(),
                        "uid": uuid::Uuid::new_v4().to_string(),
                        "groups": ["system:serviceaccounts", format!("system:serviceaccounts:{}", t.account.namespace), "system:authenticated"],
                        "extra": {
                            "authentication.kubernetes.io/pod-name": [t.pod],
                            "authentication.kubernetes.io/pod-uid": [t.pod_uid],
                            "authentication.kubernetes.io/node-name": [t.node],
                        },
                    },
                    "audiences": audiences,
                })
            }
        }
    };
    let mut answer = body;
    if let Some(obj) = answer.as_object_mut() {
        obj.insert("status".into(), status);
    }
    (StatusCode::CREATED, answer)
}
