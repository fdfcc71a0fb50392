//! The structural schemas of pillar's CRDs, applied to every object the double stores as the
//! API server applies them (`apiextensions-apiserver/pkg/apiserver/schema/{pruning,defaulting}`
//! and the OpenAPI validation of `customresource/validator.go`): unknown fields are pruned,
//! defaults filled in, then the object is validated, and a violation is 422 `Invalid` naming
//! each field. The schemas are the CRDs pillar ships (`crd::crds_yaml`, which a test holds equal
//! to `deploy/base/crds.yaml`).
//!
//! Modelled: `type` (with `nullable`), `properties`, `additionalProperties`,
//! `x-kubernetes-preserve-unknown-fields`, `items`, `required`, `enum`, `minimum`, `maximum`,
//! `default`. Not modelled (pillar's schemas use none of them): `pattern`, `maxLength`,
//! `x-kubernetes-validations` (CEL), `oneOf`/`anyOf`.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

/// The `openAPIV3Schema` of each kind, by plural.
#[derive(Debug, Default)]
pub(crate) struct CrdSchemas {
    by_plural: BTreeMap<String, Value>,
}

impl CrdSchemas {
    /// The schemas of the CRDs pillar ships.
    pub(crate) fn shipped() -> Self {
        let mut by_plural = BTreeMap::new();
        let text = crate::crd::crds_yaml().unwrap_or_default();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let Ok(crd) = <Value as serde::Deserialize>::deserialize(doc) else {
                continue;
            };
            let plural = crd
                .pointer("/spec/names/plural")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            if let Some(schema) = crd.pointer("/spec/versions/0/schema/openAPIV3Schema") {
                by_plural.insert(plural, schema.clone());
            }
        }
        Self { by_plural }
    }

    /// Prunes, defaults and validates `obj` (a whole object) as the kind `plural`; the field
    /// errors, each `(path, detail)`, when it is invalid.
    pub(crate) fn admit(
        &self,
        plural: &str,
        obj: &mut Map<String, Value>,
    ) -> Result<(), Vec<(String, String)>> {
        let Some(schema) = self.by_plural.get(plural) else {
            return Ok(());
        };
        // apiVersion, kind and metadata are the server's; everything else follows the schema,
        // the root object like any other.
        let server_fields: Vec<(String, Value)> = ["apiVersion", "kind", "metadata"]
            .into_iter()
            .filter_map(|k| obj.remove(k).map(|v| (k.to_owned(), v)))
            .collect();
        let mut root = Value::Object(std::mem::take(obj));
        prune_and_default(schema, &mut root);
        let mut errors = Vec::new();
        validate(schema, &root, "", &mut errors);
        if let Value::Object(map) = root {
            *obj = map;
        }
        obj.extend(server_fields);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// `path.key`, or `key` at the root.
fn field_path(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

fn preserves_unknown(schema: &Value) -> bool {
    schema
        .get("x-kubernetes-preserve-unknown-fields")
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// Drops the fields the schema does not name (unless it preserves unknown fields or has
/// `additionalProperties`), then fills the defaults of absent properties, depth first.
fn prune_and_default(schema: &Value, value: &mut Value) {
    match value {
        Value::Object(map) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            if let Some(props) = props {
                if additional.is_none() && !preserves_unknown(schema) {
                    map.retain(|k, _| props.contains_key(k));
                }
                for (key, sub) in props {
                    if !map.contains_key(key)
                        && let Some(default) = sub.get("default")
                    {
                        map.insert(key.clone(), default.clone());
                    }
                }
            } else if additional.is_none() && !preserves_unknown(schema) {
                map.clear();
            }
            for (key, item) in map.iter_mut() {
                let sub = props.and_then(|p| p.get(key)).or(additional);
                if let Some(sub) = sub {
                    prune_and_default(sub, item);
                }
            }
        }
        Value::Array(items) => {
            if let Some(sub) = schema.get("items") {
                items.iter_mut().for_each(|i| prune_and_default(sub, i));
            }
        }
        _ => {}
    }
}

fn type_matches(want: &str, value: &Value) -> bool {
    match want {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "boolean" => value.is_boolean(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        _ => true,
    }
}

fn validate(schema: &Value, value: &Value, path: &str, errors: &mut Vec<(String, String)>) {
    if value.is_null() {
        if !schema
            .get("nullable")
            .and_then(Value::as_bool)
            .unwrap_or(false)
            && schema.get("type").is_some()
        {
            errors.push((
                path.to_owned(),
                "Invalid value: \"null\": must not be null".into(),
            ));
        }
        return;
    }
    if let Some(want) = schema.get("type").and_then(Value::as_str)
        && !type_matches(want, value)
    {
        errors.push((
            path.to_owned(),
            format!("Invalid value: {value}: {path} in body must be of type {want}"),
        ));
        return;
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        let list: Vec<String> = allowed.iter().map(Value::to_string).collect();
        errors.push((
            path.to_owned(),
            format!(
                "Unsupported value: {value}: supported values: {}",
                list.join(", ")
            ),
        ));
    }
    validate_bounds(schema, value, path, errors);
    validate_children(schema, value, path, errors);
}

/// `minimum` and `maximum` of a number.
fn validate_bounds(schema: &Value, value: &Value, path: &str, errors: &mut Vec<(String, String)>) {
    if let Some(n) = value.as_f64() {
        if let Some(min) = schema.get("minimum").and_then(Value::as_f64)
            && n < min
        {
            errors.push((
                path.to_owned(),
                format!("Invalid value: {value}: {path} in body should be greater than or equal to {min}"),
            ));
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_f64)
            && n > max
        {
            errors.push((
                path.to_owned(),
                format!(
                    "Invalid value: {value}: {path} in body should be less than or equal to {max}"
                ),
            ));
        }
    }
}

/// The properties of an object (by `properties`, else `additionalProperties`, and `required`)
/// and the items of an array, each against its own schema.
fn validate_children(
    schema: &Value,
    value: &Value,
    path: &str,
    errors: &mut Vec<(String, String)>,
) {
    match value {
        Value::Object(map) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            for (key, item) in map {
                if let Some(sub) = props.and_then(|p| p.get(key)).or(additional) {
                    validate(sub, item, &field_path(path, key), errors);
                }
            }
            if let Some(required) = schema.get("required").and_then(Value::as_array) {
                for field in required.iter().filter_map(Value::as_str) {
                    if !map.contains_key(field) {
                        errors.push((field_path(path, field), "Required value".into()));
                    }
                }
            }
        }
        Value::Array(items) => {
            if let Some(sub) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    validate(sub, item, &format!("{path}[{i}]"), errors);
                }
            }
        }
        _ => {}
    }
}
