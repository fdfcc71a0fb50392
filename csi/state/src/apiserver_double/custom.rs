//! pillar's custom resources as the API server keeps them (the rules in the parent module's
//! documentation): list, get, create, update of the main resource or `/status`, delete. The
//! compare-and-swap rules are the [`core`](crate::core)'s; this module turns requests into its
//! calls and its refusals into the API server's answers.

use std::convert::Infallible;

use hyper::{Method, StatusCode};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Map, Value, json};

use super::{
    Answer, State, already_exists, bad_request, failure_status, meta_str, method_not_allowed,
    unknown_path, with_metadata,
};
use crate::core::{self, Half, Precondition, Refusal, Why};
use crate::crd::{API_VERSION, GROUP};
use crate::object::{KINDS, Kind};

type KindInfo = Kind;

/// Why a request failed: the core refused it, or the server answered before or after the core.
enum Fail {
    Refused(Refusal),
    Answer(Answer),
}

impl From<Refusal> for Fail {
    fn from(r: Refusal) -> Self {
        Self::Refused(r)
    }
}

impl From<Infallible> for Fail {
    fn from(never: Infallible) -> Self {
        match never {}
    }
}

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
        .core
        .records(info.plural)
        .cloned()
        .map(Value::Object)
        .collect();
    (
        StatusCode::OK,
        json!({
            "apiVersion": API_VERSION,
            "kind": format!("{}List", info.kind),
            "metadata": { "resourceVersion": st.core.last_version().to_string() },
            "items": items,
        }),
    )
}

fn get(st: &State, info: KindInfo, name: &str) -> Answer {
    match st.core.get(info.plural, name) {
        Some(obj) => (StatusCode::OK, Value::Object(obj.clone())),
        None => not_found(info, name),
    }
}

fn create(st: &mut State, info: KindInfo, body: Option<Value>) -> Answer {
    let Some(Value::Object(obj)) = body else {
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
    let uid = uuid::Uuid::new_v4().to_string();
    let schemas = &st.schemas;
    let admit = |obj: &mut Map<String, Value>| {
        schemas
            .admit(info.plural, obj)
            .map_err(|errors| Fail::Answer(invalid_fields(info, &name, &errors)))?;
        with_metadata(obj, |meta| {
            let now = Time(k8s_openapi::jiff::Timestamp::now());
            meta.insert(
                "creationTimestamp".into(),
                serde_json::to_value(now).unwrap_or(Value::Null),
            );
            meta.remove("deletionTimestamp");
            meta.remove("deletionGracePeriodSeconds");
        });
        Ok(())
    };
    match core::create(&mut st.core, info, &name, obj, uid, admit) {
        Ok(obj) => (StatusCode::CREATED, Value::Object(obj)),
        Err(Fail::Answer(answer)) => answer,
        Err(Fail::Refused(_)) => already_exists(info.plural, GROUP, &name),
    }
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
    let uid = meta_str(&body, "uid")
        .filter(|u| !u.is_empty())
        .map(str::to_owned);
    let rv = meta_str(&body, "resourceVersion")
        .filter(|v| !v.is_empty())
        .map(str::to_owned);
    let pre = Precondition {
        uid: uid.as_deref(),
        resource_version: rv.as_deref(),
    };
    let half = if status { Half::Status } else { Half::Spec };
    let schemas = &st.schemas;
    let admit = |next: &mut Map<String, Value>| {
        if !status && has_finalizers(next) {
            return Err(Fail::Answer(unsupported("metadata.finalizers")));
        }
        schemas
            .admit(info.plural, next)
            .map_err(|errors| Fail::Answer(invalid_fields(info, name, &errors)))
    };
    match core::replace(&mut st.core, info, name, pre, half, |_| body, admit) {
        Ok(next) => (StatusCode::OK, Value::Object(next)),
        Err(Fail::Answer(answer)) => answer,
        Err(Fail::Refused(r)) => update_refused(info, name, r),
    }
}

/// The API server's answer to an update the core refused.
fn update_refused(info: KindInfo, name: &str, refusal: Refusal) -> Answer {
    match refusal.why {
        Why::NotFound => not_found(info, name),
        // The UID in the body is a storage precondition (rest.defaultUpdatedObjectInfo).
        Why::UidMismatch { expected, current } => failure_status(
            409,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on {}.{GROUP} \"{name}\": StorageError: invalid \
                 object, Code: 4, Key: /{GROUP}/{}/{name}, ResourceVersion: 0, \
                 AdditionalErrorMsg: Precondition failed: UID in precondition: {expected}, UID in \
                 object meta: {current}",
                info.plural, info.plural
            ),
            details(info.plural, name),
        ),
        // Custom resources do not allow unconditional updates.
        Why::VersionRequired => invalid(
            info,
            name,
            "metadata.resourceVersion",
            "Invalid value: 0x0: must be specified for an update",
        ),
        Why::VersionInvalid { given } => bad_request(&format!("invalid resource version: {given}")),
        Why::Conflict { .. } | Why::AlreadyExists => conflict_modified(info, name),
    }
}

fn delete(st: &mut State, info: KindInfo, name: &str, body: Option<Value>) -> Answer {
    let preconditions = body
        .as_ref()
        .and_then(|b| b.get("preconditions"))
        .cloned()
        .unwrap_or(Value::Null);
    let pre = Precondition {
        uid: preconditions.get("uid").and_then(Value::as_str),
        resource_version: preconditions.get("resourceVersion").and_then(Value::as_str),
    };
    // rest.BeforeDelete: the resource in these messages is Kind.group.
    let resource = format!("{}.{GROUP}", info.kind);
    let refused = match core::delete::<_, _, Fail>(&mut st.core, info, name, pre) {
        Ok(current) => return (StatusCode::OK, Value::Object(current)),
        Err(Fail::Answer(answer)) => return answer,
        Err(Fail::Refused(r)) => r,
    };
    let message = match refused.why {
        Why::UidMismatch { expected, current } => format!(
            "Operation cannot be fulfilled on {resource} \"{name}\": the UID in the \
             precondition ({expected}) does not match the UID in record ({current}). The \
             object might have been deleted and then recreated"
        ),
        Why::Conflict { expected, current } => format!(
            "Operation cannot be fulfilled on {resource} \"{name}\": the ResourceVersion in \
             the precondition ({expected}) does not match the ResourceVersion in record \
             ({current}). The object might have been modified"
        ),
        _ => return not_found(info, name),
    };
    failure_status(409, "Conflict", &message, details(info.kind, name))
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
