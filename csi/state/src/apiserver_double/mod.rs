//! A Kubernetes API server test double for pillar's four cluster-scoped custom resources.
//!
//! A real HTTP/1.1 server (hyper) on `127.0.0.1:0` implementing the REST subset kube-rs uses:
//! GET one, LIST, POST, PUT, PUT `/status`, DELETE, under
//! `/apis/pillar-csi.io/v1alpha1/{pillarvolumestates,pillarsnapshotstates,pillaragents,pillarprotocols}`. Point a
//! [`kube::Client`] at it with [`ApiServerDouble::client`].
//!
//! It follows the real API server's rules for custom resources, read from the Kubernetes source
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

use crate::crd::{API_VERSION, GROUP, VERSION};

pub mod rbac;
mod schema;

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

#[derive(Clone, Copy)]
struct KindInfo {
    plural: &'static str,
    kind: &'static str,
    has_status: bool,
}

const KINDS: [KindInfo; 4] = [
    KindInfo {
        plural: "pillarvolumestates",
        kind: "PillarVolumeState",
        has_status: true,
    },
    KindInfo {
        plural: "pillarsnapshotstates",
        kind: "PillarSnapshotState",
        has_status: true,
    },
    KindInfo {
        plural: "pillaragents",
        kind: "PillarAgent",
        has_status: true,
    },
    KindInfo {
        plural: "pillarprotocols",
        kind: "PillarProtocol",
        has_status: false,
    },
];

#[derive(Default)]
struct State {
    rv: u64,
    /// plural -> name -> object.
    objects: BTreeMap<&'static str, BTreeMap<String, Value>>,
    log: Vec<RecordedRequest>,
    failures: Vec<InjectedFailure>,
    /// Events in the order they were created.
    events: Vec<Value>,
    /// `coordination.k8s.io/v1` Leases by (namespace, name).
    leases: BTreeMap<(String, String), Value>,
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
        self.rv = self.rv.saturating_add(1);
        self.rv.to_string()
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
            .field("rv", &self.rv)
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
            .objects
            .get(plural)
            .and_then(|m| m.get(name))
            .cloned()
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

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.state().rv
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
    if let Some(rest) = path.strip_prefix(LEASES_PREFIX) {
        return match (rest.split('/').collect::<Vec<_>>().as_slice(), method) {
            ([ns, "leases"], &Method::POST) => create_lease(st, ns, body),
            ([ns, "leases", name], &Method::GET) => st
                .leases
                .get(&((*ns).to_owned(), (*name).to_owned()))
                .map_or_else(|| lease_not_found(name), |l| (StatusCode::OK, l.clone())),
            ([ns, "leases", name], &Method::PUT) => update_lease(st, ns, name, body),
            ([_, "leases"] | [_, "leases", _], _) => method_not_allowed(),
            _ => unknown_path(),
        };
    }
    if let Some(rest) = path.strip_prefix(EVENTS_PREFIX) {
        return match (rest.split('/').collect::<Vec<_>>().as_slice(), method) {
            ([ns, "events"], &Method::POST) => create_event(st, ns, body),
            ([ns, "events"], &Method::GET) => list_events(st, ns),
            ([_, "events"], _) => method_not_allowed(),
            _ => unknown_path(),
        };
    }
    let prefix = format!("/apis/{GROUP}/{VERSION}/");
    let Some(rest) = path.strip_prefix(&prefix) else {
        return unknown_path();
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let Some(info) = KINDS.iter().find(|k| Some(&k.plural) == parts.first()) else {
        return unknown_path();
    };
    match (parts.as_slice(), method) {
        ([_], &Method::GET) => list(st, *info),
        ([_], &Method::POST) => create(st, *info, body),
        ([_, name], &Method::GET) => get(st, *info, name),
        ([_, name], &Method::PUT) => update(st, *info, name, body, false),
        ([_, name], &Method::DELETE) => delete(st, *info, name, body),
        ([_, name, "status"], &Method::GET) if info.has_status => get(st, *info, name),
        ([_, name, "status"], &Method::PUT) if info.has_status => {
            update(st, *info, name, body, true)
        }
        ([_] | [_, _], _) => method_not_allowed(),
        ([_, _, "status"], _) if info.has_status => method_not_allowed(),
        _ => unknown_path(),
    }
}

fn list(st: &State, info: KindInfo) -> Answer {
    let items: Vec<Value> = st
        .objects
        .get(info.plural)
        .map(|m| m.values().cloned().collect())
        .unwrap_or_default();
    (
        StatusCode::OK,
        json!({
            "apiVersion": API_VERSION,
            "kind": format!("{}List", info.kind),
            "metadata": { "resourceVersion": st.rv.to_string() },
            "items": items,
        }),
    )
}

fn get(st: &State, info: KindInfo, name: &str) -> Answer {
    match st.objects.get(info.plural).and_then(|m| m.get(name)) {
        Some(obj) => (StatusCode::OK, obj.clone()),
        None => not_found(info, name),
    }
}

fn create(st: &mut State, info: KindInfo, body: Option<Value>) -> Answer {
    let Some(Value::Object(mut obj)) = body else {
        return bad_request("the body of the request was in an unknown format");
    };
    if let Some(answer) = check_type(info, &obj) {
        return answer;
    }
    let name = meta_str(&obj, "name").unwrap_or_default().to_owned();
    if name.is_empty() {
        return invalid(
            info,
            "",
            "metadata.name",
            "Required value: name or generateName is required",
        );
    }
    if crate::store::validate_name(info.kind, &name).is_err() {
        return invalid(
            info,
            &name,
            "metadata.name",
            &format!(
                "Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower \
                 case alphanumeric characters, '-' or '.', and must start and end with an \
                 alphanumeric character"
            ),
        );
    }
    if has_finalizers(&obj) {
        return unsupported("metadata.finalizers");
    }
    if meta_str(&obj, "resourceVersion").is_some_and(|rv| !rv.is_empty()) {
        // The storage layer's plain error, which the handler turns into a 500 with no reason
        // (apiserver/pkg/endpoints/handlers/responsewriters/status.go).
        return failure_status(
            500,
            "",
            "resourceVersion should not be set on objects to be created",
            json!({}),
        );
    }
    if st
        .objects
        .get(info.plural)
        .is_some_and(|m| m.contains_key(&name))
    {
        return failure_status(
            409,
            "AlreadyExists",
            &format!("{}.{GROUP} \"{name}\" already exists", info.plural),
            details(info.plural, &name),
        );
    }
    if info.has_status {
        obj.remove("status");
    }
    if let Err(errors) = st.schemas.admit(info.plural, &mut obj) {
        return invalid_fields(info, &name, &errors);
    }
    let rv = st.next_rv();
    with_metadata(&mut obj, |meta| {
        meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
        meta.insert("resourceVersion".into(), json!(rv));
        meta.insert("generation".into(), json!(1));
        meta.insert(
            "creationTimestamp".into(),
            serde_json::to_value(Time(k8s_openapi::jiff::Timestamp::now())).unwrap_or(Value::Null),
        );
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
    });
    let obj = Value::Object(obj);
    st.objects
        .entry(info.plural)
        .or_default()
        .insert(name, obj.clone());
    (StatusCode::CREATED, obj)
}

fn update(st: &mut State, info: KindInfo, name: &str, body: Option<Value>, status: bool) -> Answer {
    let Some(Value::Object(body)) = body else {
        return bad_request("the body of the request was in an unknown format");
    };
    if let Some(answer) = check_type(info, &body) {
        return answer;
    }
    let body_name = meta_str(&body, "name").unwrap_or_default();
    if body_name != name {
        return bad_request(&format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        ));
    }
    let Some(Value::Object(current)) = st.objects.get(info.plural).and_then(|m| m.get(name)) else {
        return not_found(info, name);
    };
    let current = current.clone();
    let current_uid = meta_str(&current, "uid").unwrap_or_default().to_owned();
    let current_rv = meta_str(&current, "resourceVersion")
        .unwrap_or_default()
        .to_owned();
    // 1. The UID in the body is a storage precondition (rest.defaultUpdatedObjectInfo).
    if let Some(uid) = meta_str(&body, "uid").filter(|u| !u.is_empty())
        && uid != current_uid
    {
        return failure_status(
            409,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on {}.{GROUP} \"{name}\": StorageError: invalid \
                 object, Code: 4, Key: /{GROUP}/{}/{name}, ResourceVersion: 0, \
                 AdditionalErrorMsg: Precondition failed: UID in precondition: {uid}, UID in \
                 object meta: {current_uid}",
                info.plural, info.plural
            ),
            details(info.plural, name),
        );
    }
    // 2. Custom resources do not allow unconditional updates.
    let body_rv = meta_str(&body, "resourceVersion").unwrap_or_default();
    if body_rv.is_empty() {
        return invalid(
            info,
            name,
            "metadata.resourceVersion",
            "Invalid value: 0x0: must be specified for an update",
        );
    }
    if body_rv.parse::<u64>().is_err() {
        return bad_request(&format!("invalid resource version: {body_rv}"));
    }
    // 3. Optimistic lock.
    if body_rv != current_rv {
        return conflict_modified(info, name);
    }
    if !status && has_finalizers(&body) {
        return unsupported("metadata.finalizers");
    }
    let mut next = if status {
        // Status strategy: the old object with the body's status.
        let mut next = current.clone();
        match body.get("status") {
            Some(s) => {
                next.insert("status".into(), s.clone());
            }
            None => {
                next.remove("status");
            }
        }
        next
    } else {
        let mut next = body.clone();
        if info.has_status {
            match current.get("status") {
                Some(s) => {
                    next.insert("status".into(), s.clone());
                }
                None => {
                    next.remove("status");
                }
            }
        }
        // System fields the request cannot change.
        let old_meta = current
            .get("metadata")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        with_metadata(&mut next, |meta| {
            for key in ["uid", "creationTimestamp", "generation"] {
                match old_meta.get(key) {
                    Some(v) => {
                        meta.insert(key.into(), v.clone());
                    }
                    None => {
                        meta.remove(key);
                    }
                }
            }
        });
        if without_metadata(&next) != without_metadata(&current) {
            let generation = old_meta
                .get("generation")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            meta_insert(&mut next, "generation", json!(generation.saturating_add(1)));
        }
        next
    };
    if let Err(errors) = st.schemas.admit(info.plural, &mut next) {
        return invalid_fields(info, name, &errors);
    }
    meta_insert(&mut next, "resourceVersion", json!(current_rv));
    if next == current {
        // No change: etcd is not written and the resourceVersion stays.
        return (StatusCode::OK, Value::Object(current));
    }
    let rv = st.next_rv();
    meta_insert(&mut next, "resourceVersion", json!(rv));
    let next = Value::Object(next);
    st.objects
        .entry(info.plural)
        .or_default()
        .insert(name.to_owned(), next.clone());
    (StatusCode::OK, next)
}

fn delete(st: &mut State, info: KindInfo, name: &str, body: Option<Value>) -> Answer {
    let Some(Value::Object(current)) = st.objects.get(info.plural).and_then(|m| m.get(name)) else {
        return not_found(info, name);
    };
    let current = current.clone();
    let preconditions = body
        .as_ref()
        .and_then(|b| b.get("preconditions"))
        .cloned()
        .unwrap_or(Value::Null);
    let current_uid = meta_str(&current, "uid").unwrap_or_default();
    let current_rv = meta_str(&current, "resourceVersion").unwrap_or_default();
    // rest.BeforeDelete: the resource in these messages is Kind.group.
    let resource = format!("{}.{GROUP}", info.kind);
    if let Some(uid) = preconditions.get("uid").and_then(Value::as_str)
        && uid != current_uid
    {
        return failure_status(
            409,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on {resource} \"{name}\": the UID in the \
                 precondition ({uid}) does not match the UID in record ({current_uid}). The \
                 object might have been deleted and then recreated"
            ),
            details(info.kind, name),
        );
    }
    if let Some(rv) = preconditions.get("resourceVersion").and_then(Value::as_str)
        && rv != current_rv
    {
        return failure_status(
            409,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on {resource} \"{name}\": the ResourceVersion in \
                 the precondition ({rv}) does not match the ResourceVersion in record \
                 ({current_rv}). The object might have been modified"
            ),
            details(info.kind, name),
        );
    }
    if let Some(m) = st.objects.get_mut(info.plural) {
        m.remove(name);
    }
    st.next_rv();
    (StatusCode::OK, Value::Object(current))
}

const LEASES_PREFIX: &str = "/apis/coordination.k8s.io/v1/namespaces/";

fn lease_not_found(name: &str) -> Answer {
    failure_status(
        404,
        "NotFound",
        &format!("leases.coordination.k8s.io \"{name}\" not found"),
        json!({ "name": name, "group": "coordination.k8s.io", "kind": "leases" }),
    )
}

/// A Lease's spec as its validation checks it (`pkg/apis/coordination/validation`):
/// `leaseDurationSeconds` and `leaseTransitions`, when set, are positive / not negative.
fn invalid_lease_spec(obj: &Map<String, Value>) -> Option<String> {
    let spec = obj.get("spec").and_then(Value::as_object)?;
    if let Some(d) = spec.get("leaseDurationSeconds").and_then(Value::as_i64)
        && d <= 0
    {
        return Some(format!(
            "spec.leaseDurationSeconds: Invalid value: {d}: must be greater than 0"
        ));
    }
    if let Some(t) = spec.get("leaseTransitions").and_then(Value::as_i64)
        && t < 0
    {
        return Some(format!(
            "spec.leaseTransitions: Invalid value: {t}: must be greater than or equal to 0"
        ));
    }
    None
}

fn lease_invalid(name: &str, detail: &str) -> Answer {
    failure_status(
        422,
        "Invalid",
        &format!("Lease.coordination.k8s.io \"{name}\" is invalid: {detail}"),
        json!({ "name": name, "group": "coordination.k8s.io", "kind": "Lease" }),
    )
}

/// POST of a Lease: a built-in kind (no generation, no status subresource).
fn create_lease(st: &mut State, ns: &str, body: Option<Value>) -> Answer {
    let Some(Value::Object(mut obj)) = body else {
        return bad_request("the body of the request was in an unknown format");
    };
    let name = meta_str(&obj, "name").unwrap_or_default().to_owned();
    if name.is_empty() {
        return lease_invalid(
            "",
            "metadata.name: Required value: name or generateName is required",
        );
    }
    if let Some(detail) = invalid_lease_spec(&obj) {
        return lease_invalid(&name, &detail);
    }
    let key = (ns.to_owned(), name.clone());
    if st.leases.contains_key(&key) {
        return failure_status(
            409,
            "AlreadyExists",
            &format!("leases.coordination.k8s.io \"{name}\" already exists"),
            json!({ "name": name, "group": "coordination.k8s.io", "kind": "leases" }),
        );
    }
    let rv = st.next_rv();
    with_metadata(&mut obj, |meta| {
        meta.insert("namespace".into(), json!(ns));
        meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
        meta.insert("resourceVersion".into(), json!(rv));
        meta.insert(
            "creationTimestamp".into(),
            serde_json::to_value(Time(k8s_openapi::jiff::Timestamp::now())).unwrap_or(Value::Null),
        );
    });
    let obj = Value::Object(obj);
    st.leases.insert(key, obj.clone());
    (StatusCode::CREATED, obj)
}

/// PUT of a Lease. Built-in kinds allow unconditional updates (no resourceVersion in the
/// body); a stale one is 409 Conflict; a missing Lease is 404 (no create on update).
fn update_lease(st: &mut State, ns: &str, name: &str, body: Option<Value>) -> Answer {
    let Some(Value::Object(mut body)) = body else {
        return bad_request("the body of the request was in an unknown format");
    };
    let key = (ns.to_owned(), name.to_owned());
    let Some(Value::Object(current)) = st.leases.get(&key).cloned() else {
        return lease_not_found(name);
    };
    let current_rv = meta_str(&current, "resourceVersion")
        .unwrap_or_default()
        .to_owned();
    let body_rv = meta_str(&body, "resourceVersion").unwrap_or_default();
    if !body_rv.is_empty() && body_rv != current_rv {
        return failure_status(
            409,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on leases.coordination.k8s.io \"{name}\": the \
                 object has been modified; please apply your changes to the latest version and \
                 try again"
            ),
            json!({ "name": name, "group": "coordination.k8s.io", "kind": "leases" }),
        );
    }
    if let Some(detail) = invalid_lease_spec(&body) {
        return lease_invalid(name, &detail);
    }
    let old_meta = current
        .get("metadata")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    with_metadata(&mut body, |meta| {
        for key in ["uid", "creationTimestamp", "namespace"] {
            if let Some(v) = old_meta.get(key) {
                meta.insert(key.into(), v.clone());
            }
        }
    });
    meta_insert(&mut body, "resourceVersion", json!(current_rv));
    if body == current {
        return (StatusCode::OK, Value::Object(current));
    }
    let rv = st.next_rv();
    meta_insert(&mut body, "resourceVersion", json!(rv));
    let body = Value::Object(body);
    st.leases.insert(key, body.clone());
    (StatusCode::OK, body)
}

const EVENTS_PREFIX: &str = "/apis/events.k8s.io/v1/namespaces/";
const EVENTS_API_VERSION: &str = "events.k8s.io/v1";

fn list_events(st: &State, ns: &str) -> Answer {
    let items: Vec<Value> = st
        .events
        .iter()
        .filter(|e| e.pointer("/metadata/namespace").and_then(Value::as_str) == Some(ns))
        .cloned()
        .collect();
    (
        StatusCode::OK,
        json!({
            "apiVersion": EVENTS_API_VERSION,
            "kind": "EventList",
            "metadata": { "resourceVersion": st.rv.to_string() },
            "items": items,
        }),
    )
}

/// `metav1.Validate QualifiedName`: an optional DNS-subdomain prefix and `/`, then a name of at
/// most 63 characters of `[A-Za-z0-9_.-]` starting and ending alphanumeric.
fn is_qualified_name(s: &str) -> bool {
    let (prefix, name) = match s.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    if prefix.is_some_and(|p| crate::store::validate_name("prefix", p).is_err()) {
        return false;
    }
    let alnum = |c: char| c.is_ascii_alphanumeric();
    !name.is_empty()
        && name.len() <= 63
        && name.starts_with(alnum)
        && name.ends_with(alnum)
        && name
            .chars()
            .all(|c| alnum(c) || c == '-' || c == '_' || c == '.')
}

fn create_event(st: &mut State, ns: &str, body: Option<Value>) -> Answer {
    let Some(Value::Object(mut obj)) = body else {
        return bad_request("the body of the request was in an unknown format");
    };
    let api_version = obj
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let kind = obj.get("kind").and_then(Value::as_str).unwrap_or_default();
    if api_version != EVENTS_API_VERSION || kind != "Event" {
        return bad_request(&format!(
            "the object's apiVersion/kind {api_version}/{kind} does not match \
             {EVENTS_API_VERSION}/Event"
        ));
    }
    if meta_str(&obj, "namespace").is_some_and(|n| !n.is_empty() && n != ns) {
        return bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        );
    }
    let name = meta_str(&obj, "name").unwrap_or_default().to_owned();
    let field = |key: &str| obj.get(key).and_then(Value::as_str).unwrap_or_default();
    let mut errors: Vec<(&str, String)> = Vec::new();
    if name.is_empty() {
        errors.push((
            "metadata.name",
            "Required value: name or generateName is required".into(),
        ));
    } else if crate::store::validate_name("Event", &name).is_err() {
        errors.push(("metadata.name", format!("Invalid value: \"{name}\"")));
    }
    if obj.get("eventTime").is_none_or(Value::is_null) {
        errors.push(("eventTime", "Required value".into()));
    }
    let regarding_ns = obj
        .get("regarding")
        .and_then(|r| r.get("namespace"))
        .and_then(Value::as_str)
        .unwrap_or_default();
    if regarding_ns.is_empty() && ns != "default" && ns != "kube-system" {
        errors.push((
            "regarding.namespace",
            "Invalid value: \"\": does not match event.namespace".into(),
        ));
    }
    if !regarding_ns.is_empty() && regarding_ns != ns {
        errors.push((
            "regarding.namespace",
            format!("Invalid value: \"{regarding_ns}\": does not match event.namespace"),
        ));
    }
    let controller = field("reportingController");
    if controller.is_empty() {
        errors.push(("reportingController", "Required value".into()));
    } else if !is_qualified_name(controller) {
        errors.push((
            "reportingController",
            format!("Invalid value: \"{controller}\""),
        ));
    }
    for key in ["reportingInstance", "action", "reason"] {
        let v = field(key);
        if v.is_empty() {
            errors.push((key, "Required value".into()));
        } else if v.len() > 128 {
            errors.push((key, "Too long: may not be more than 128 bytes".into()));
        }
    }
    if field("note").len() > 1024 {
        errors.push(("note", "Too long: may not be more than 1024 bytes".into()));
    }
    let type_ = field("type");
    if type_ != "Normal" && type_ != "Warning" {
        errors.push((
            "type",
            format!("Unsupported value: \"{type_}\": supported values: \"Normal\", \"Warning\""),
        ));
    }
    if let Some((f, detail)) = errors.first() {
        return failure_status(
            422,
            "Invalid",
            &format!("Event.events.k8s.io \"{name}\" is invalid: {f}: {detail}"),
            json!({ "name": name, "group": "events.k8s.io", "kind": "Event",
                    "causes": [{ "message": detail, "field": f }] }),
        );
    }
    if st.events.iter().any(|e| {
        e.pointer("/metadata/namespace").and_then(Value::as_str) == Some(ns)
            && e.pointer("/metadata/name").and_then(Value::as_str) == Some(name.as_str())
    }) {
        return failure_status(
            409,
            "AlreadyExists",
            &format!("events.events.k8s.io \"{name}\" already exists"),
            json!({ "name": name, "group": "events.k8s.io", "kind": "events" }),
        );
    }
    let rv = st.next_rv();
    with_metadata(&mut obj, |meta| {
        meta.insert("namespace".into(), json!(ns));
        meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
        meta.insert("resourceVersion".into(), json!(rv));
        meta.insert(
            "creationTimestamp".into(),
            serde_json::to_value(Time(k8s_openapi::jiff::Timestamp::now())).unwrap_or(Value::Null),
        );
    });
    let obj = Value::Object(obj);
    st.events.push(obj.clone());
    (StatusCode::CREATED, obj)
}

fn check_type(info: KindInfo, obj: &Map<String, Value>) -> Option<Answer> {
    let api_version = obj
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let kind = obj.get("kind").and_then(Value::as_str).unwrap_or_default();
    if api_version != API_VERSION || kind != info.kind {
        return Some(bad_request(&format!(
            "the object's apiVersion/kind {api_version}/{kind} does not match {API_VERSION}/{}",
            info.kind
        )));
    }
    None
}

fn has_finalizers(obj: &Map<String, Value>) -> bool {
    obj.get("metadata")
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty())
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

fn without_metadata(obj: &Map<String, Value>) -> Map<String, Value> {
    obj.iter()
        .filter(|(k, _)| k.as_str() != "metadata")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn details(kind: &str, name: &str) -> Value {
    json!({ "name": name, "group": GROUP, "kind": kind })
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

fn not_found(info: KindInfo, name: &str) -> Answer {
    failure_status(
        404,
        "NotFound",
        &format!("{}.{GROUP} \"{name}\" not found", info.plural),
        details(info.plural, name),
    )
}

fn conflict_modified(info: KindInfo, name: &str) -> Answer {
    failure_status(
        409,
        "Conflict",
        &format!(
            "Operation cannot be fulfilled on {}.{GROUP} \"{name}\": the object has been \
             modified; please apply your changes to the latest version and try again",
            info.plural
        ),
        details(info.plural, name),
    )
}

fn invalid(info: KindInfo, name: &str, field: &str, detail: &str) -> Answer {
    let (code, mut body) = failure_status(
        422,
        "Invalid",
        &format!(
            "{}.{GROUP} \"{name}\" is invalid: {field}: {detail}",
            info.plural
        ),
        details(info.plural, name),
    );
    if let Some(d) = body.get_mut("details").and_then(Value::as_object_mut) {
        let reason = if detail.starts_with("Required value") {
            "FieldValueRequired"
        } else {
            "FieldValueInvalid"
        };
        d.insert(
            "causes".into(),
            json!([{ "reason": reason, "message": detail, "field": field }]),
        );
    }
    (code, body)
}

/// 422 for the schema's field errors, each a cause, as the API server answers them.
fn invalid_fields(info: KindInfo, name: &str, errors: &[(String, String)]) -> Answer {
    let list: Vec<String> = errors.iter().map(|(f, d)| format!("{f}: {d}")).collect();
    let joined = match list.as_slice() {
        [one] => one.clone(),
        many => format!("[{}]", many.join(", ")),
    };
    let causes: Vec<Value> = errors
        .iter()
        .map(|(f, d)| {
            let reason = if d.starts_with("Required value") {
                "FieldValueRequired"
            } else if d.starts_with("Unsupported value") {
                "FieldValueNotSupported"
            } else {
                "FieldValueInvalid"
            };
            json!({ "reason": reason, "message": d, "field": f })
        })
        .collect();
    failure_status(
        422,
        "Invalid",
        &format!("{}.{GROUP} \"{name}\" is invalid: {joined}", info.kind),
        json!({ "name": name, "group": GROUP, "kind": info.kind, "causes": causes }),
    )
}

fn bad_request(message: &str) -> Answer {
    failure_status(400, "BadRequest", message, json!({}))
}

fn unsupported(what: &str) -> Answer {
    failure_status(
        501,
        "NotImplemented",
        &format!("{what} is not modelled by the API server test double"),
        json!({}),
    )
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
