//! Core `v1` Secrets as the API server keeps them, for what pillar does with them (nodes'
//! DH-HMAC-CHAP credentials, `kube_credentials`): GET, POST and PUT under
//! `/api/v1/namespaces/<ns>/secrets`, held to the server's rules for them
//! (`pkg/apis/core/validation` `ValidateSecret`, `ValidateSecretUpdate`; the v1 conversion):
//! - the name is a DNS subdomain; the body's namespace and (on PUT) name match the path's;
//! - `data` values are base64 (400 otherwise, as the JSON decoder into `[]byte` answers);
//!   `stringData` is merged into `data` and dropped; keys are config keys
//!   (`[-._a-zA-Z0-9]+`, not `.` or `..`, at most 253 characters); all data at most 1 MiB;
//! - `type` defaults to `Opaque` and is immutable; an `immutable: true` Secret's data and
//!   `immutable` cannot change (422);
//! - 409 `AlreadyExists` for a taken name, 409 `Conflict` for a stale resourceVersion, an
//!   update without one allowed (built-in kinds), 404 for a missing Secret.
//!
//! RBAC is applied before any of this (`mod.rs`), as the server does: a ServiceAccount without
//! `get` on secrets in the namespace learns nothing, not even whether the name exists.

use hyper::{Method, StatusCode};
use k8s_openapi::ByteString;
use serde_json::{Map, Value, json};

use super::{
    Answer, State, bad_request, failure_status, meta_str, method_not_allowed, stamp_created,
    unknown_path,
};

/// The largest a Secret's data may be (`MaxSecretSize`).
const MAX_SECRET_SIZE: usize = 1024 * 1024;

/// `rest`: the path after [`SECRETS_PREFIX`] (`<ns>/secrets[/<name>]`).
pub(super) fn route_secret(
    st: &mut State,
    rest: &str,
    method: &Method,
    body: Option<Value>,
) -> Answer {
    match (rest.split('/').collect::<Vec<_>>().as_slice(), method) {
        ([ns, "secrets"], &Method::POST) => create_secret(st, ns, body),
        ([ns, "secrets", name], &Method::GET) => st
            .secrets
            .get(&((*ns).to_owned(), (*name).to_owned()))
            .map_or_else(|| secret_not_found(name), |s| (StatusCode::OK, s.clone())),
        ([ns, "secrets", name], &Method::PUT) => update_secret(st, ns, name, body),
        ([_, "secrets"] | [_, "secrets", _], _) => method_not_allowed(),
        _ => unknown_path(),
    }
}

pub(super) const SECRETS_PREFIX: &str = "/api/v1/namespaces/";

fn secret_not_found(name: &str) -> Answer {
    failure_status(
        404,
        "NotFound",
        &format!("secrets \"{name}\" not found"),
        json!({ "name": name, "kind": "secrets" }),
    )
}

fn secret_invalid(name: &str, field: &str, detail: &str) -> Answer {
    failure_status(
        422,
        "Invalid",
        &format!("Secret \"{name}\" is invalid: {field}: {detail}"),
        json!({ "name": name, "kind": "Secret",
                "causes": [{ "field": field, "message": detail }] }),
    )
}

/// `IsConfigMapKey`.
fn is_config_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 253
        && k != "."
        && k != ".."
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
}

/// The body as the server stores it: `stringData` merged into `data`, `type` defaulted, data
/// checked. `Err` is the answer refusing it.
fn normalise(obj: &mut Map<String, Value>, name: &str) -> Result<(), Answer> {
    let mut data = match obj.remove("data") {
        Some(Value::Object(d)) => d,
        None | Some(Value::Null) => Map::new(),
        Some(_) => return Err(bad_request("data: expected an object")),
    };
    // Decoded as the server decodes `[]byte`: standard base64 (k8s-openapi's `ByteString`).
    let mut size = 0;
    for (k, v) in &data {
        let decoded: ByteString = serde_json::from_value(v.clone())
            .map_err(|_| bad_request(&format!("data[{k}]: illegal base64 data")))?;
        size += decoded.0.len();
    }
    if let Some(Value::Object(strings)) = obj.remove("stringData") {
        for (k, v) in strings {
            let bytes = v.as_str().unwrap_or_default().as_bytes().to_vec();
            size += bytes.len();
            let encoded = serde_json::to_value(ByteString(bytes)).unwrap_or(Value::Null);
            data.insert(k, encoded);
        }
    }
    if let Some(bad) = data.keys().find(|k| !is_config_key(k)) {
        return Err(secret_invalid(
            name,
            &format!("data[{bad}]"),
            "a valid config key must consist of alphanumeric characters, '-', '_' or '.'",
        ));
    }
    if size > MAX_SECRET_SIZE {
        return Err(secret_invalid(
            name,
            "data",
            &format!("Too long: must have at most {MAX_SECRET_SIZE} bytes"),
        ));
    }
    if !data.is_empty() {
        obj.insert("data".into(), Value::Object(data));
    }
    if obj
        .get("type")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        obj.insert("type".into(), json!("Opaque"));
    }
    Ok(())
}

/// The namespace in the body, if any, is the path's.
fn namespace_matches(obj: &Map<String, Value>, ns: &str) -> bool {
    meta_str(obj, "namespace").is_none_or(|n| n.is_empty() || n == ns)
}

fn create_secret(st: &mut State, ns: &str, body: Option<Value>) -> Answer {
    let Some(Value::Object(mut obj)) = body else {
        return bad_request("the body of the request was in an unknown format");
    };
    if !namespace_matches(&obj, ns) {
        return bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        );
    }
    let name = meta_str(&obj, "name").unwrap_or_default().to_owned();
    if name.is_empty() {
        return secret_invalid(
            "",
            "metadata.name",
            "Required value: name or generateName is required",
        );
    }
    if crate::store::validate_name("Secret", &name).is_err() {
        return secret_invalid(
            &name,
            "metadata.name",
            &format!("Invalid value: \"{name}\""),
        );
    }
    if let Err(answer) = normalise(&mut obj, &name) {
        return answer;
    }
    let key = (ns.to_owned(), name.clone());
    if st.secrets.contains_key(&key) {
        return failure_status(
            409,
            "AlreadyExists",
            &format!("secrets \"{name}\" already exists"),
            json!({ "name": name, "kind": "secrets" }),
        );
    }
    let rv = st.next_rv();
    stamp_created(&mut obj, rv, Some(ns));
    let obj = Value::Object(obj);
    st.secrets.insert(key, obj.clone());
    (StatusCode::CREATED, obj)
}

fn update_secret(st: &mut State, ns: &str, name: &str, body: Option<Value>) -> Answer {
    let Some(Value::Object(mut body)) = body else {
        return bad_request("the body of the request was in an unknown format");
    };
    if !namespace_matches(&body, ns) {
        return bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        );
    }
    if let Some(n) = meta_str(&body, "name").filter(|n| *n != name) {
        return bad_request(&format!(
            "the name of the object ({n}) does not match the name on the URL ({name})"
        ));
    }
    let key = (ns.to_owned(), name.to_owned());
    let Some(Value::Object(current)) = st.secrets.get(&key).cloned() else {
        return secret_not_found(name);
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
                "Operation cannot be fulfilled on secrets \"{name}\": the object has been \
                 modified; please apply your changes to the latest version and try again"
            ),
            json!({ "name": name, "kind": "secrets" }),
        );
    }
    if let Err(answer) = normalise(&mut body, name) {
        return answer;
    }
    if body.get("type") != current.get("type") {
        return secret_invalid(name, "type", "Invalid value: field is immutable");
    }
    if current.get("immutable") == Some(&json!(true))
        && (body.get("data") != current.get("data") || body.get("immutable") != Some(&json!(true)))
    {
        return secret_invalid(
            name,
            "data",
            "Forbidden: field is immutable when `immutable` is set",
        );
    }
    match super::builtin::replaced(st, name, body, &current, &current_rv) {
        None => (StatusCode::OK, Value::Object(current)),
        Some(body) => {
            st.secrets.insert(key, body.clone());
            (StatusCode::OK, body)
        }
    }
}
