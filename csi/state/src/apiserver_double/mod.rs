//! A Kubernetes API server test double for pillar's four cluster-scoped custom resources.
//!
//! A real HTTP/1.1 server (hyper) on `127.0.0.1:0` implementing the REST subset kube-rs uses:
//! GET one, LIST, POST, PUT, PUT `/status`, DELETE, under
//! `/apis/pillar-csi.io/v1alpha1/{pillarvolumestates,pillarsnapshotstates,pillaragents,pillarprotocols}`. Point a
//! [`kube::Client`] at it with [`ApiServerDouble::client`].
//!
//! Its custom resources are kept by the [`core`](crate::core) rules, the same code the embedded
//! and in-memory stores run, on JSON records; this module adds HTTP, the server's answers
//! and what the core leaves to the server (schemas, names, finalizers). The rules, as read from
//! the Kubernetes source
//! (`apiextensions-apiserver/pkg/registry/customresource/{strategy,status_strategy}.go`,
//! `apiserver/pkg/registry/generic/registry/store.go`, `apiserver/pkg/registry/rest/{update,
//! delete}.go`, `apiserver/pkg/storage/errors/storage.go`):
//! - resourceVersion is one global counter (like etcd's revision), a decimal string; every
//!   create, effective update and delete takes the next value.
//! - POST assigns uid, resourceVersion, creationTimestamp and `metadata.generation = 1`, drops
//!   `status` when the kind has a status subresource, answers 409 `AlreadyExists` for a taken
//!   name and 500 for a body that carries a resourceVersion (the storage layer's plain error).
//! - PUT (main resource and `/status`):
//!   1. a `metadata.uid` in the body is a precondition: a different UID is 409 `Conflict`
//!      ("Precondition failed: UID in precondition: ..");
//!   2. custom resources do not allow unconditional updates: a body without
//!      `metadata.resourceVersion` is 422 `Invalid` ("metadata.resourceVersion: Invalid value:
//!      0x0: must be specified for an update");
//!   3. a stale resourceVersion is 409 `Conflict` ("the object has been modified; ...").
//!
//!   The main resource ignores `status` changes and bumps `metadata.generation` when anything
//!   outside `metadata` changes; `/status` applies only `status` and ignores everything else. A
//!   write that changes nothing keeps the resourceVersion. (An unparsable resourceVersion is
//!   answered 400 here; what the real server answers for it was not checked.)
//! - DELETE honours `DeleteOptions.preconditions` (`uid`, `resourceVersion`) with 409
//!   `Conflict` ("the UID in the precondition (..) does not match the UID in record (..)") and
//!   answers 404 for an absent name. Finalizers are not modelled: a POST or PUT that sets
//!   `metadata.finalizers` is refused with 501 so no test relies on semantics the double lacks.
//!
//! - Events: POST and LIST of `events.k8s.io/v1` Events under
//!   `/apis/events.k8s.io/v1/namespaces/<ns>/events`, with the API server's create validation of
//!   new-style events (`pkg/apis/core/validation/events.go`): `eventTime`,
//!   `reportingController` (a qualified name), `reportingInstance`, `action` and `reason` are
//!   required, the last three at most 128 characters, `note` at most 1 KiB, `type` Normal or
//!   Warning, and an event about a cluster-scoped object (no `regarding.namespace`) only in
//!   `default` or `kube-system`. [`ApiServerDouble::events`] reads them back.
//!
//! - Leases: GET, POST and PUT of `coordination.k8s.io/v1` Leases under
//!   `/apis/coordination.k8s.io/v1/namespaces/<ns>/leases`, as for a built-in kind: the same
//!   global resourceVersion, 409 `AlreadyExists` for a taken name, 409 `Conflict` for a stale
//!   resourceVersion, an update without one allowed (built-in kinds allow unconditional updates),
//!   404 for an update of a missing Lease, 422 for a non-positive `leaseDurationSeconds`.
//!   [`ApiServerDouble::lease`] reads one back.
//!
//! - Secrets: GET, POST and PUT of core `v1` Secrets under `/api/v1/namespaces/<ns>/secrets`,
//!   with the server's validation of them ([`secrets`]). [`ApiServerDouble::secret`] reads one
//!   back.
//!
//! - TokenReviews of the pod-bound ServiceAccount tokens the double issues
//!   ([`tokenreview`], [`ApiServerDouble::issue_pod_token`]).
//!
//! - Authentication and RBAC: every request carries a bearer token the double issued, for its
//!   administrator ([`ApiServerDouble::client`], allowed everything, as `system:masters` is) or for
//!   a ServiceAccount ([`ApiServerDouble::client_as`]); a request without a known token is 401.
//!   A ServiceAccount's request is authorised against the RBAC objects of pillar's
//!   `deploy/base/rbac.yaml` ([`rbac`]), and refused with the API server's 403 `Forbidden`.
//! - Transient 429s: [`ApiServerDouble::answer_too_many_requests`] makes the next requests fail
//!   as a real server does while its storage initialises (429 `TooManyRequests`, `Retry-After`).
//!
//! Errors are real `Status` objects (kind `Status`, apiVersion `v1`, status `Failure`, reason,
//! code), which kube-rs turns into [`kube::Error::Api`]. Every request is recorded (method, path,
//! query, JSON body) for request-shape assertions, and a failure can be injected for the next
//! matching request.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::core::Memory;
use crate::crd::{GROUP, VERSION};

mod builtin;
mod custom;
pub mod rbac;
mod schema;
mod secrets;
mod tokenreview;

use rbac::{RbacPolicy, RequestAttributes, ServiceAccount};
use schema::CrdSchemas;

/// The token of the double's administrator, allowed everything (as `system:masters` is).
const ADMIN_TOKEN: &str = "pillar-double-admin";

/// The HTTP method type of [`InjectedFailure::method`], for crates without an `http` dependency.
pub use hyper::Method as HttpMethod;

/// Why the double could not start or build a client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DoubleError {
    /// Binding the listening socket failed.
    #[error("bind 127.0.0.1:0")]
    Bind(#[source] std::io::Error),
    /// Reading the bound address failed.
    #[error("read the listening address")]
    LocalAddr(#[source] std::io::Error),
    /// The URL did not parse (cannot happen for a socket address).
    #[error("parse the double's URL {url}")]
    Url {
        /// The URL.
        url: String,
        /// The parse error.
        #[source]
        source: http::uri::InvalidUri,
    },
    /// Building the kube client failed.
    #[error("build a kube client for the double")]
    Client(#[source] kube::Error),
    /// The RBAC policy could not be read.
    #[error("read the RBAC policy")]
    Policy(#[source] rbac::PolicyError),
}

/// Who a token belongs to.
#[derive(Clone, Debug)]
enum Identity {
    Admin,
    ServiceAccount(ServiceAccount),
}

/// One request the double received.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedRequest {
    /// HTTP method (`GET`, `POST`, `PUT`, `DELETE`, ...).
    pub method: String,
    /// URL path.
    pub path: String,
    /// Query string, if any.
    pub query: Option<String>,
    /// The body parsed as JSON; `None` when empty or not JSON.
    pub body: Option<Value>,
}

/// A failure the double answers with instead of handling a matching request.
#[derive(Clone, Debug)]
pub struct InjectedFailure {
    /// Only requests with this method match.
    pub method: Method,
    /// Only requests whose path ends with this match.
    pub path_suffix: String,
    /// HTTP code of the answer.
    pub code: u16,
    /// `Status.reason` of the answer (`InternalError`, `ServiceUnavailable`, `Conflict`, ...).
    pub reason: String,
    /// `Status.message` of the answer.
    pub message: String,
}

#[derive(Default)]
struct State {
    /// The custom resources and the one resourceVersion counter (Leases and Events take their
    /// versions from it too).
    core: Memory,
    log: Vec<RecordedRequest>,
    failures: Vec<InjectedFailure>,
    /// Events in the order they were created.
    events: Vec<Value>,
    /// `coordination.k8s.io/v1` Leases by (namespace, name).
    leases: BTreeMap<(String, String), Value>,
    /// Core `v1` Secrets by (namespace, name).
    secrets: BTreeMap<(String, String), Value>,
    /// Pod-bound ServiceAccount tokens the double issued, by token.
    pod_tokens: BTreeMap<String, tokenreview::PodToken>,
    /// Bearer token -> identity.
    tokens: BTreeMap<String, Identity>,
    /// What ServiceAccounts may do.
    policy: RbacPolicy,
    /// How many of the next requests are answered 429.
    too_many_requests: u32,
    /// The CRDs' structural schemas.
    schemas: CrdSchemas,
}

impl State {
    fn next_rv(&mut self) -> String {
        self.core.take_version().to_string()
    }
}

/// The running double. Dropping it stops the server.
#[derive(Debug)]
pub struct ApiServerDouble {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("rv", &self.core.last_version())
            .field("requests", &self.log.len())
            .finish_non_exhaustive()
    }
}

impl Drop for ApiServerDouble {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The kustomize base pillar ships, whose `rbac.yaml` the double enforces.
pub fn deploy_base() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/base")
}

impl ApiServerDouble {
    /// Starts the double on `127.0.0.1:0`, enforcing the RBAC of pillar's `deploy/base`.
    pub async fn start() -> Result<Self, DoubleError> {
        let policy =
            RbacPolicy::from_kustomize_base(&deploy_base()).map_err(DoubleError::Policy)?;
        Self::start_with_policy(policy).await
    }

    /// Starts the double enforcing `policy` for ServiceAccounts.
    pub async fn start_with_policy(policy: RbacPolicy) -> Result<Self, DoubleError> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(DoubleError::Bind)?;
        let addr = listener.local_addr().map_err(DoubleError::LocalAddr)?;
        let mut state = State {
            policy,
            schemas: CrdSchemas::shipped(),
            ..State::default()
        };
        state.tokens.insert(ADMIN_TOKEN.to_owned(), Identity::Admin);
        let state = Arc::new(Mutex::new(state));
        let task = tokio::spawn(serve(listener, Arc::clone(&state)));
        Ok(Self { addr, state, task })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client of the double's administrator, allowed everything: for fixtures (the
    /// PillarAgents and PillarProtocols an operator creates) and the stores' own tests.
    pub fn client(&self) -> Result<kube::Client, DoubleError> {
        self.client_with_token(ADMIN_TOKEN)
    }

    /// A kube client authenticated as `account`, whose every request the double authorises
    /// against the RBAC policy.
    pub fn client_as(&self, account: &ServiceAccount) -> Result<kube::Client, DoubleError> {
        let token = format!("serviceaccount-{}-{}", account.namespace, account.name);
        self.state()
            .tokens
            .insert(token.clone(), Identity::ServiceAccount(account.clone()));
        self.client_with_token(&token)
    }

    /// A kube client authenticated as pillar's controller ServiceAccount.
    pub fn controller_client(&self) -> Result<kube::Client, DoubleError> {
        self.client_as(&ServiceAccount::pillar_controller())
    }

    fn client_with_token(&self, token: &str) -> Result<kube::Client, DoubleError> {
        let url = self.url();
        let uri = url
            .parse::<http::Uri>()
            .map_err(|source| DoubleError::Url { url, source })?;
        let mut config = kube::Config::new(uri);
        config.auth_info.token = Some(token.to_owned().into());
        kube::Client::try_from(config).map_err(DoubleError::Client)
    }

    /// Answers the next `n` requests 429 `TooManyRequests` with `Retry-After: 1`, as a real API
    /// server does while its storage initialises or its priority-and-fairness queues are full.
    pub fn answer_too_many_requests(&self, n: u32) {
        self.state().too_many_requests = n;
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.state().log.clone()
    }

    /// Forgets the recorded requests.
    pub fn clear_requests(&self) {
        self.state().log.clear();
    }

    /// The stored object, as the server holds it.
    pub fn object(&self, plural: &str, name: &str) -> Option<Value> {
        self.state()
            .core
            .get(plural, name)
            .cloned()
            .map(Value::Object)
    }

    /// Every Event created so far (`events.k8s.io/v1`, as stored), oldest first.
    pub fn events(&self) -> Vec<Value> {
        self.state().events.clone()
    }

    /// The Lease `namespace/name`, as stored.
    pub fn lease(&self, namespace: &str, name: &str) -> Option<Value> {
        self.state()
            .leases
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// The Secret `namespace/name`, as stored (`data` base64).
    pub fn secret(&self, namespace: &str, name: &str) -> Option<Value> {
        self.state()
            .secrets
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// A projected ServiceAccount token of `account` for a pod `pod` on `node`, valid for
    /// `audiences`, as kubelet mounts one ([`tokenreview`] answers its reviews).
    pub fn issue_pod_token(
        &self,
        account: &ServiceAccount,
        pod: &str,
        node: &str,
        audiences: &[&str],
    ) -> String {
        let token = format!("pod-token-{}", uuid::Uuid::new_v4().simple());
        self.state().pod_tokens.insert(
            token.clone(),
            tokenreview::PodToken {
                account: account.clone(),
                pod: pod.to_owned(),
                pod_uid: uuid::Uuid::new_v4().to_string(),
                node: node.to_owned(),
                audiences: audiences.iter().map(|a| (*a).to_owned()).collect(),
                revoked: false,
                expired: false,
            },
        );
        token
    }

    /// Lets `token` expire (its `expirationSeconds` passed, kubelet did not refresh it).
    pub fn expire_token(&self, token: &str) {
        if let Some(t) = self.state().pod_tokens.get_mut(token) {
            t.expired = true;
        }
    }

    /// Invalidates every token bound to `pod` (the pod was deleted).
    pub fn delete_pod(&self, pod: &str) {
        for t in self.state().pod_tokens.values_mut() {
            if t.pod == pod {
                t.revoked = true;
            }
        }
    }

    /// The decoded `data[key]` of the Secret `namespace/name`, if both are there.
    pub fn secret_data(&self, namespace: &str, name: &str, key: &str) -> Option<Vec<u8>> {
        let secret = self.secret(namespace, name)?;
        let b64 = secret.get("data")?.get(key)?.clone();
        serde_json::from_value::<k8s_openapi::ByteString>(b64)
            .ok()
            .map(|b| b.0)
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.state().core.last_version()
    }

    /// Answers the next request matching `failure.method` and `failure.path_suffix` with the
    /// failure instead of handling it. Failures are matched in the order they were injected and
    /// each is used once.
    pub fn inject_failure(&self, failure: InjectedFailure) {
        self.state().failures.push(failure);
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding the lock leaves plain data behind; keep serving it.
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn serve(listener: TcpListener, state: Arc<Mutex<State>>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "api server double: accept failed");
                continue;
            }
        };
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(Arc::clone(&state), req));
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "api server double: connection ended");
            }
        });
    }
}

type Answer = (StatusCode, Value);

async fn handle(
    state: Arc<Mutex<State>>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query = req.uri().query().map(str::to_owned);
    let token = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    let (code, body) = match req.into_body().collect().await {
        Ok(collected) => {
            let bytes = collected.to_bytes();
            let body: Option<Value> = if bytes.is_empty() {
                None
            } else {
                serde_json::from_slice(&bytes).ok()
            };
            let mut st = lock(&state);
            st.log.push(RecordedRequest {
                method: method.to_string(),
                path: path.clone(),
                query: query.clone(),
                body: body.clone(),
            });
            if let Some(refused) =
                authorize(&st, token.as_deref(), &method, &path, query.as_deref())
            {
                refused
            } else if st.too_many_requests > 0 {
                st.too_many_requests -= 1;
                failure_status(
                    429,
                    "TooManyRequests",
                    "storage is (re)initializing",
                    json!({ "retryAfterSeconds": 1 }),
                )
            } else {
                answer(&mut st, &method, &path, body)
            }
        }
        Err(e) => bad_request(&format!("reading the body failed: {e}")),
    };
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    let mut resp = Response::new(Full::new(Bytes::from(bytes)));
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    if code == StatusCode::TOO_MANY_REQUESTS {
        resp.headers_mut().insert(
            hyper::header::RETRY_AFTER,
            hyper::header::HeaderValue::from_static("1"),
        );
    }
    Ok(resp)
}

/// Authentication, then RBAC: `Some` with the 401 or 403 answer when the request may not go on.
fn authorize(
    st: &State,
    token: Option<&str>,
    method: &Method,
    path: &str,
    query: Option<&str>,
) -> Option<Answer> {
    let Some(identity) = token.and_then(|t| st.tokens.get(t)) else {
        return Some(failure_status(
            401,
            "Unauthorized",
            "Unauthorized",
            json!({}),
        ));
    };
    let Identity::ServiceAccount(account) = identity else {
        return None;
    };
    let attrs = RequestAttributes::from_request(method.as_str(), path, query)?;
    if st.policy.allows(account, &attrs) {
        return None;
    }
    let mut details = json!({ "kind": attrs.resource });
    if let Some(name) = &attrs.name {
        details["name"] = json!(name);
    }
    if !attrs.group.is_empty() {
        details["group"] = json!(attrs.group);
    }
    Some(failure_status(
        403,
        "Forbidden",
        &attrs.forbidden_message(&account.user_name()),
        details,
    ))
}

/// An authorised request: an injected failure, or the route's answer.
fn answer(st: &mut State, method: &Method, path: &str, body: Option<Value>) -> Answer {
    let injected = st
        .failures
        .iter()
        .position(|f| f.method == method && path.ends_with(&f.path_suffix));
    match injected {
        Some(i) => {
            let f = st.failures.remove(i);
            failure_status(f.code, &f.reason, &f.message, json!({}))
        }
        None => route(st, method, path, body),
    }
}

fn route(st: &mut State, method: &Method, path: &str, body: Option<Value>) -> Answer {
    if let Some(rest) = path.strip_prefix(builtin::LEASES_PREFIX) {
        return builtin::route_lease(st, rest, method, body);
    }
    if let Some(rest) = path.strip_prefix(builtin::EVENTS_PREFIX) {
        return builtin::route_event(st, rest, method, body);
    }
    if path == tokenreview::TOKENREVIEWS_PATH {
        return if *method == Method::POST {
            tokenreview::review(st, body)
        } else {
            method_not_allowed()
        };
    }
    if let Some(rest) = path.strip_prefix(secrets::SECRETS_PREFIX) {
        return secrets::route_secret(st, rest, method, body);
    }
    match path.strip_prefix(&format!("/apis/{GROUP}/{VERSION}/")) {
        Some(rest) => custom::route(st, rest, method, body),
        None => unknown_path(),
    }
}

/// The fields the server sets on every new object: uid, resourceVersion `rv`,
/// creationTimestamp, and the namespace of a namespaced one.
fn stamp_created(obj: &mut Map<String, Value>, rv: String, namespace: Option<&str>) {
    with_metadata(obj, |meta| {
        if let Some(ns) = namespace {
            meta.insert("namespace".into(), json!(ns));
        }
        meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
        meta.insert("resourceVersion".into(), json!(rv));
        meta.insert(
            "creationTimestamp".into(),
            serde_json::to_value(Time(k8s_openapi::jiff::Timestamp::now())).unwrap_or(Value::Null),
        );
    });
}

/// 409 `AlreadyExists` for a POST of a taken name.
fn already_exists(plural: &str, group: &str, name: &str) -> Answer {
    failure_status(
        409,
        "AlreadyExists",
        &format!("{plural}.{group} \"{name}\" already exists"),
        json!({ "name": name, "group": group, "kind": plural }),
    )
}

fn meta_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(key)?.as_str()
}

/// Runs `f` on the object's metadata map, creating it when absent or not a map.
fn with_metadata<T>(
    obj: &mut Map<String, Value>,
    f: impl FnOnce(&mut Map<String, Value>) -> T,
) -> T {
    let mut meta = match obj.remove("metadata") {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    };
    let out = f(&mut meta);
    obj.insert("metadata".into(), Value::Object(meta));
    out
}

fn meta_insert(obj: &mut Map<String, Value>, key: &str, value: Value) {
    with_metadata(obj, |meta| meta.insert(key.to_owned(), value));
}

fn failure_status(code: u16, reason: &str, message: &str, details: Value) -> Answer {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "code": code,
    });
    if !reason.is_empty()
        && let Some(obj) = body.as_object_mut()
    {
        obj.insert("reason".into(), json!(reason));
    }
    if details.as_object().is_some_and(|d| !d.is_empty())
        && let Some(obj) = body.as_object_mut()
    {
        obj.insert("details".into(), details);
    }
    (status, body)
}

fn bad_request(message: &str) -> Answer {
    failure_status(400, "BadRequest", message, json!({}))
}

fn method_not_allowed() -> Answer {
    failure_status(
        405,
        "MethodNotAllowed",
        "the server does not allow this method on the requested resource",
        json!({}),
    )
}

fn unknown_path() -> Answer {
    failure_status(
        404,
        "NotFound",
        "the server could not find the requested resource",
        json!({}),
    )
}
