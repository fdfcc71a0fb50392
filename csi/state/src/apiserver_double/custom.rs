//! pillar's custom resources as the API server keeps them (the rules in the parent module's
//! documentation): list, get, create, update of the main resource or `/status`, delete.

use hyper::{Method, StatusCode};
use serde_json::{Map, Value, json};

use super::{
    Answer, KINDS, KindInfo, State, already_exists, bad_request, failure_status, meta_insert,
    meta_str, method_not_allowed, stamp_created, unknown_path, with_metadata,
};
use crate::crd::{API_VERSION, GROUP};

/// `rest`: the path after `/apis/<group>/<version>/`.
pub(super) fn route(st: &mut State, rest: &str, method: &Method, body: Option<Value>) -> Answer {
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
        return already_exists(info.plural, GROUP, &name);
    }
    if info.has_status {
        obj.remove("status");
    }
    if let Err(errors) = st.schemas.admit(info.plural, &mut obj) {
        return invalid_fields(info, &name, &errors);
    }
    let rv = st.next_rv();
    stamp_created(&mut obj, rv, None);
    with_metadata(&mut obj, |meta| {
        meta.insert("generation".into(), json!(1));
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

fn without_metadata(obj: &Map<String, Value>) -> Map<String, Value> {
    obj.iter()
        .filter(|(k, _)| k.as_str() != "metadata")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn details(kind: &str, name: &str) -> Value {
    json!({ "name": name, "group": GROUP, "kind": kind })
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

fn unsupported(what: &str) -> Answer {
    failure_status(
        501,
        "NotImplemented",
        &format!("{what} is not modelled by the API server test double"),
        json!({}),
    )
}
