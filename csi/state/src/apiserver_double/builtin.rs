//! The built-in kinds the controller writes, as the API server keeps them: `coordination.k8s.io/v1`
//! Leases (GET, POST, PUT) and `events.k8s.io/v1` Events (POST, LIST), in their namespaces.

use hyper::{Method, StatusCode};
use serde_json::{Map, Value, json};

use super::{
    Answer, State, already_exists, bad_request, failure_status, meta_insert, meta_str,
    method_not_allowed, stamp_created, unknown_path, with_metadata,
};

/// `rest`: the path after [`LEASES_PREFIX`].
pub(super) fn route_lease(
    st: &mut State,
    rest: &str,
    method: &Method,
    body: Option<Value>,
) -> Answer {
    match (rest.split('/').collect::<Vec<_>>().as_slice(), method) {
        ([ns, "leases"], &Method::POST) => create_lease(st, ns, body),
        ([ns, "leases", name], &Method::GET) => st
            .leases
            .get(&((*ns).to_owned(), (*name).to_owned()))
            .map_or_else(|| lease_not_found(name), |l| (StatusCode::OK, l.clone())),
        ([ns, "leases", name], &Method::PUT) => update_lease(st, ns, name, body),
        ([_, "leases"] | [_, "leases", _], _) => method_not_allowed(),
        _ => unknown_path(),
    }
}

/// `rest`: the path after [`EVENTS_PREFIX`].
pub(super) fn route_event(
    st: &mut State,
    rest: &str,
    method: &Method,
    body: Option<Value>,
) -> Answer {
    match (rest.split('/').collect::<Vec<_>>().as_slice(), method) {
        ([ns, "events"], &Method::POST) => create_event(st, ns, body),
        ([ns, "events"], &Method::GET) => list_events(st, ns),
        ([_, "events"], _) => method_not_allowed(),
        _ => unknown_path(),
    }
}

pub(super) const LEASES_PREFIX: &str = "/apis/coordination.k8s.io/v1/namespaces/";

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
        return already_exists("leases", "coordination.k8s.io", &name);
    }
    let rv = st.next_rv();
    stamp_created(&mut obj, rv, Some(ns));
    let obj = Value::Object(obj);
    st.leases.insert(key, obj.clone());
    (StatusCode::CREATED, obj)
}

/// PUT of a Lease. Built-in kinds allow unconditional updates (no resourceVersion in the
/// body); a stale one is 409 Conflict; a missing Lease is 404 (no create on update).
fn update_lease(st: &mut State, ns: &str, name: &str, body: Option<Value>) -> Answer {
    let Some(Value::Object(body)) = body else {
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
    match replaced(st, name, body, &current, &current_rv) {
        None => (StatusCode::OK, Value::Object(current)),
        Some(body) => {
            st.leases.insert(key, body.clone());
            (StatusCode::OK, body)
        }
    }
}

/// The end of a replace of a built-in object, as the API server does it: the name and the
/// server's fields (`uid`, `creationTimestamp`, `namespace`) kept from `current`; a write that
/// changes nothing keeps its resourceVersion and is `None` (answer `current`), any other takes
/// the next one and is the object to store.
pub(super) fn replaced(
    st: &mut State,
    name: &str,
    mut body: Map<String, Value>,
    current: &Map<String, Value>,
    current_rv: &str,
) -> Option<Value> {
    let old_meta = current
        .get("metadata")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    with_metadata(&mut body, |meta| {
        meta.insert("name".into(), json!(name));
        for key in ["uid", "creationTimestamp", "namespace"] {
            if let Some(v) = old_meta.get(key) {
                meta.insert(key.into(), v.clone());
            }
        }
    });
    meta_insert(&mut body, "resourceVersion", json!(current_rv));
    if body == *current {
        return None;
    }
    let rv = st.next_rv();
    meta_insert(&mut body, "resourceVersion", json!(rv));
    Some(Value::Object(body))
}

pub(super) const EVENTS_PREFIX: &str = "/apis/events.k8s.io/v1/namespaces/";
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
            "metadata": { "resourceVersion": st.core.last_version().to_string() },
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

/// An Event's apiVersion and kind are events.k8s.io/v1 Event, and its namespace (if set) the
/// request's: 400 otherwise, as the server answers before validating fields.
fn event_kind_and_namespace(obj: &Map<String, Value>, ns: &str) -> Result<(), Answer> {
    let api_version = obj
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let kind = obj.get("kind").and_then(Value::as_str).unwrap_or_default();
    if api_version != EVENTS_API_VERSION || kind != "Event" {
        return Err(bad_request(&format!(
            "the object's apiVersion/kind {api_version}/{kind} does not match \
             {EVENTS_API_VERSION}/Event"
        )));
    }
    if meta_str(obj, "namespace").is_some_and(|n| !n.is_empty() && n != ns) {
        return Err(bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    Ok(())
}

/// The field errors of an Event named `name`, in the order they are checked (the answer names
/// the first): name, eventTime, regarding's namespace, the reporting controller and instance,
/// action, reason, note and type.
fn event_errors(obj: &Map<String, Value>, ns: &str, name: &str) -> Vec<(&'static str, String)> {
    let field = |key: &str| obj.get(key).and_then(Value::as_str).unwrap_or_default();
    let mut errors: Vec<(&'static str, String)> = Vec::new();
    if name.is_empty() {
        errors.push((
            "metadata.name",
            "Required value: name or generateName is required".into(),
        ));
    } else if crate::store::validate_name("Event", name).is_err() {
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
    errors
}

fn create_event(st: &mut State, ns: &str, body: Option<Value>) -> Answer {
    let Some(Value::Object(mut obj)) = body else {
        return bad_request("the body of the request was in an unknown format");
    };
    if let Err(answer) = event_kind_and_namespace(&obj, ns) {
        return answer;
    }
    let name = meta_str(&obj, "name").unwrap_or_default().to_owned();
    let errors = event_errors(&obj, ns, &name);
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
        return already_exists("events", "events.k8s.io", &name);
    }
    let rv = st.next_rv();
    stamp_created(&mut obj, rv, Some(ns));
    let obj = Value::Object(obj);
    st.events.push(obj.clone());
    (StatusCode::CREATED, obj)
}
