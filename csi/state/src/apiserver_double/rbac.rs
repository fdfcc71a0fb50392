//! Kubernetes RBAC as the real API server evaluates it, for the double: the (Cluster)Roles and
//! (Cluster)RoleBindings are read from a manifest (pillar's `deploy/base/rbac.yaml`), never
//! restated in code, so a rule missing from what pillar ships is a 403 in the tests exactly as
//! it is in a cluster.
//!
//! The evaluation follows `plugin/pkg/auth/authorizer/rbac` (`rbac.go`, `validation.go` in
//! Kubernetes): a request is allowed when some binding names the user (or one of its groups) and
//! the role it refers to has a rule matching the request's verb, API group, resource (with its
//! subresource as `resource/subresource`) and, when the rule names any, the object's name. A
//! ClusterRoleBinding applies everywhere; a RoleBinding only inside its own namespace. There is
//! no deny rule: RBAC only adds.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

/// Why a policy could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// Reading a manifest file failed.
    #[error("read {path}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A YAML document did not parse as an RBAC object.
    #[error("parse {what}")]
    Parse {
        /// Which document.
        what: String,
        /// The parse error.
        #[source]
        source: serde_yaml::Error,
    },
    /// A namespaced object has no namespace and none was given as the default.
    #[error("{kind} {name} has no namespace")]
    NoNamespace {
        /// The object's kind.
        kind: String,
        /// The object's name.
        name: String,
    },
}

/// A Kubernetes ServiceAccount, the identity a client of the double authenticates as.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceAccount {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl ServiceAccount {
    /// `namespace/name`.
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }

    /// The ServiceAccount pillar's controller Deployment runs as (`deploy/base/controller.yaml`).
    pub fn pillar_controller() -> Self {
        Self::new("pillar-system", "pillar-controller")
    }

    /// The user name the API server gives it.
    pub fn user_name(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }

    /// The groups the API server puts it in.
    fn groups(&self) -> [String; 3] {
        [
            "system:serviceaccounts".to_owned(),
            format!("system:serviceaccounts:{}", self.namespace),
            "system:authenticated".to_owned(),
        ]
    }
}

/// What a request asks to do, as the API server's request-info resolver derives it from the
/// method and path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestAttributes {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`.
    pub verb: String,
    /// The API group (`""` for the core group).
    pub group: String,
    /// The resource's plural name.
    pub resource: String,
    /// The subresource (`status`), if any.
    pub subresource: Option<String>,
    /// The namespace of a namespaced request.
    pub namespace: Option<String>,
    /// The object's name, when the request names one.
    pub name: Option<String>,
}

impl RequestAttributes {
    /// Derives the attributes of a resource request; `None` for a path that names no resource
    /// (discovery, `/version`, ...), which the double serves to everyone.
    pub fn from_request(method: &str, path: &str, query: Option<&str>) -> Option<Self> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (group, rest) = match parts.as_slice() {
            ["api", _version, rest @ ..] => ("", rest),
            ["apis", group, _version, rest @ ..] => (*group, rest),
            _ => return None,
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_owned()), rest),
            _ => (None, rest),
        };
        let (resource, name, subresource) = match rest {
            [resource] => (*resource, None, None),
            [resource, name] => (*resource, Some((*name).to_owned()), None),
            [resource, name, sub] => (*resource, Some((*name).to_owned()), Some((*sub).to_owned())),
            _ => return None,
        };
        let watch =
            query.is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
        let verb = match (method, name.is_some()) {
            ("GET" | "HEAD", _) if watch => "watch",
            ("GET" | "HEAD", true) => "get",
            ("GET" | "HEAD", false) => "list",
            ("POST", _) => "create",
            ("PUT", _) => "update",
            ("PATCH", _) => "patch",
            ("DELETE", true) => "delete",
            ("DELETE", false) => "deletecollection",
            _ => return None,
        };
        Some(Self {
            verb: verb.to_owned(),
            group: group.to_owned(),
            resource: resource.to_owned(),
            subresource,
            namespace,
            name,
        })
    }

    /// `resource` or `resource/subresource`, as a rule names it.
    fn combined_resource(&self) -> String {
        match &self.subresource {
            Some(sub) => format!("{}/{sub}", self.resource),
            None => self.resource.clone(),
        }
    }

    /// The message a real API server puts in its 403.
    pub fn forbidden_message(&self, user: &str) -> String {
        let group = if self.group.is_empty() {
            String::new()
        } else {
            format!(".{}", self.group)
        };
        let object = match &self.name {
            Some(name) => format!("{}{group} \"{name}\" is forbidden", self.resource),
            None => format!("{}{group} is forbidden", self.resource),
        };
        let scope = match &self.namespace {
            Some(ns) => format!("in the namespace \"{ns}\""),
            None => "at the cluster scope".to_owned(),
        };
        format!(
            "{object}: User \"{user}\" cannot {} resource \"{}\" in API group \"{}\" {scope}",
            self.verb,
            self.combined_resource(),
            self.group
        )
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PolicyRule {
    #[serde(default)]
    api_groups: Vec<String>,
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    verbs: Vec<String>,
    #[serde(default)]
    resource_names: Vec<String>,
}

impl PolicyRule {
    /// `rbac/validation.go` RuleAllows.
    fn allows(&self, req: &RequestAttributes) -> bool {
        let any = |list: &[String], want: &str| list.iter().any(|v| v == "*" || v == want);
        let combined = req.combined_resource();
        let resource_matches = self.resources.iter().any(|r| {
            r == "*"
                || *r == combined
                || req
                    .subresource
                    .as_ref()
                    .is_some_and(|sub| *r == format!("*/{sub}"))
                || (req.subresource.is_some() && *r == format!("{}/*", req.resource))
        });
        let name_matches = self.resource_names.is_empty()
            || req
                .name
                .as_ref()
                .is_some_and(|n| self.resource_names.contains(n));
        any(&self.verbs, &req.verb)
            && any(&self.api_groups, &req.group)
            && resource_matches
            && name_matches
    }
}

#[derive(Debug, Deserialize)]
struct Metadata {
    #[serde(default)]
    name: String,
    namespace: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RoleRef {
    kind: String,
    name: String,
}

#[derive(Debug, Deserialize)]
struct Subject {
    kind: String,
    name: String,
    namespace: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RbacObject {
    #[serde(default)]
    kind: String,
    metadata: Option<Metadata>,
    #[serde(default)]
    rules: Vec<PolicyRule>,
    role_ref: Option<RoleRef>,
    #[serde(default)]
    subjects: Vec<Subject>,
}

#[derive(Debug)]
struct Binding {
    /// `None` for a ClusterRoleBinding.
    namespace: Option<String>,
    role_kind: String,
    role_name: String,
    subjects: Vec<Subject>,
}

impl Binding {
    /// Whether a subject of the binding is `user` or one of its groups.
    fn names(&self, user: &ServiceAccount) -> bool {
        let groups = user.groups();
        self.subjects.iter().any(|s| match s.kind.as_str() {
            "ServiceAccount" => {
                s.name == user.name
                    && s.namespace
                        .as_ref()
                        .or(self.namespace.as_ref())
                        .is_some_and(|ns| *ns == user.namespace)
            }
            "Group" => groups.contains(&s.name),
            "User" => s.name == user.user_name(),
            _ => false,
        })
    }
}

/// One rule as bound to an account.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The namespace of the RoleBinding that grants it; `None` for a ClusterRoleBinding.
    pub namespace: Option<String>,
    /// The rule's API groups.
    pub api_groups: Vec<String>,
    /// The rule's resources (`resource` or `resource/subresource`).
    pub resources: Vec<String>,
    /// The rule's verbs.
    pub verbs: Vec<String>,
}

/// The RBAC objects of one or more manifests.
#[derive(Debug, Default)]
pub struct RbacPolicy {
    cluster_roles: BTreeMap<String, Vec<PolicyRule>>,
    /// (namespace, name) -> rules.
    roles: BTreeMap<(String, String), Vec<PolicyRule>>,
    bindings: Vec<Binding>,
}

impl RbacPolicy {
    /// Reads the RBAC objects of the multi-document YAML `text`. Namespaced objects without a
    /// namespace get `default_namespace` (what kustomize's `namespace:` does). Other kinds are
    /// ignored.
    pub fn from_yaml(text: &str, default_namespace: &str) -> Result<Self, PolicyError> {
        let mut policy = Self::default();
        for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let value =
                serde_yaml::Value::deserialize(doc).map_err(|source| PolicyError::Parse {
                    what: format!("document {i}"),
                    source,
                })?;
            if value.is_null() {
                continue;
            }
            let obj: RbacObject =
                serde_yaml::from_value(value).map_err(|source| PolicyError::Parse {
                    what: format!("document {i}"),
                    source,
                })?;
            policy.add(obj, default_namespace)?;
        }
        Ok(policy)
    }

    /// The policy pillar ships: `rbac.yaml` of the kustomize base `dir`, with the namespace its
    /// `kustomization.yaml` sets.
    pub fn from_kustomize_base(dir: &Path) -> Result<Self, PolicyError> {
        let read = |file: &str| {
            let path = dir.join(file);
            std::fs::read_to_string(&path).map_err(|source| PolicyError::Read {
                path: path.display().to_string(),
                source,
            })
        };
        let kustomization: serde_yaml::Value = serde_yaml::from_str(&read("kustomization.yaml")?)
            .map_err(|source| PolicyError::Parse {
            what: "kustomization.yaml".into(),
            source,
        })?;
        let namespace = kustomization
            .get("namespace")
            .and_then(serde_yaml::Value::as_str)
            .unwrap_or("default")
            .to_owned();
        Self::from_yaml(&read("rbac.yaml")?, &namespace)
    }

    fn add(&mut self, obj: RbacObject, default_namespace: &str) -> Result<(), PolicyError> {
        let meta = obj.metadata.unwrap_or(Metadata {
            name: String::new(),
            namespace: None,
        });
        let namespace = || {
            meta.namespace
                .clone()
                .or_else(|| (!default_namespace.is_empty()).then(|| default_namespace.to_owned()))
                .ok_or_else(|| PolicyError::NoNamespace {
                    kind: obj.kind.clone(),
                    name: meta.name.clone(),
                })
        };
        match obj.kind.as_str() {
            "ClusterRole" => {
                self.cluster_roles.insert(meta.name.clone(), obj.rules);
            }
            "Role" => {
                self.roles
                    .insert((namespace()?, meta.name.clone()), obj.rules);
            }
            "ClusterRoleBinding" | "RoleBinding" => {
                let Some(role_ref) = obj.role_ref else {
                    return Ok(());
                };
                self.bindings.push(Binding {
                    namespace: if obj.kind == "RoleBinding" {
                        Some(namespace()?)
                    } else {
                        None
                    },
                    role_kind: role_ref.kind,
                    role_name: role_ref.name,
                    subjects: obj.subjects,
                });
            }
            _ => {}
        }
        Ok(())
    }

    /// Whether `user` may do what `req` asks.
    pub fn allows(&self, user: &ServiceAccount, req: &RequestAttributes) -> bool {
        self.bindings.iter().any(|binding| {
            // A RoleBinding grants only inside its namespace.
            if let Some(ns) = &binding.namespace
                && req.namespace.as_ref() != Some(ns)
            {
                return false;
            }
            binding.names(user)
                && self
                    .rules_of(binding)
                    .is_some_and(|rules| rules.iter().any(|r| r.allows(req)))
        })
    }

    fn rules_of(&self, binding: &Binding) -> Option<&Vec<PolicyRule>> {
        match (binding.role_kind.as_str(), &binding.namespace) {
            ("ClusterRole", _) => self.cluster_roles.get(&binding.role_name),
            ("Role", Some(ns)) => self.roles.get(&(ns.clone(), binding.role_name.clone())),
            _ => None,
        }
    }

    /// Every rule bound to `user`, with where it applies: what a least-privilege check walks.
    pub fn grants(&self, user: &ServiceAccount) -> Vec<Grant> {
        self.bindings
            .iter()
            .filter(|b| b.names(user))
            .flat_map(|b| {
                self.rules_of(b).into_iter().flatten().map(|r| Grant {
                    namespace: b.namespace.clone(),
                    api_groups: r.api_groups.clone(),
                    resources: r.resources.clone(),
                    verbs: r.verbs.clone(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const POLICY: &str = r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: reader}
rules:
  - apiGroups: ["pillar-csi.io"]
    resources: ["pillaragents"]
    verbs: ["get", "list"]
  - apiGroups: [""]
    resources: ["pods/*"]
    verbs: ["get"]
  - apiGroups: [""]
    resources: ["configmaps"]
    resourceNames: ["one"]
    verbs: ["update"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: reader}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: reader}
subjects: [{kind: ServiceAccount, name: sa, namespace: ns1}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: leases}
rules:
  - apiGroups: ["coordination.k8s.io"]
    resources: ["leases"]
    verbs: ["*"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: leases}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: leases}
subjects: [{kind: ServiceAccount, name: sa}]
"#;

    fn req(method: &str, path: &str) -> RequestAttributes {
        RequestAttributes::from_request(method, path, None).unwrap()
    }

    #[test]
    fn attributes_follow_the_request_info_resolver() {
        let r = req("PUT", "/apis/pillar-csi.io/v1alpha1/pillaragents/a/status");
        assert_eq!(r.verb, "update");
        assert_eq!(r.group, "pillar-csi.io");
        assert_eq!(r.combined_resource(), "pillaragents/status");
        assert_eq!(r.namespace, None);
        let r = req("GET", "/api/v1/namespaces/x/pods");
        assert_eq!((r.verb.as_str(), r.group.as_str()), ("list", ""));
        assert_eq!(r.namespace.as_deref(), Some("x"));
        let w = RequestAttributes::from_request("GET", "/api/v1/pods", Some("watch=true"));
        assert_eq!(w.unwrap().verb, "watch");
        assert_eq!(
            req("DELETE", "/api/v1/namespaces/x/pods").verb,
            "deletecollection"
        );
        assert!(RequestAttributes::from_request("GET", "/version", None).is_none());
    }

    #[test]
    fn a_rule_grants_its_verbs_resources_and_names_only() {
        let p = RbacPolicy::from_yaml(POLICY, "ns1").unwrap();
        let sa = ServiceAccount::new("ns1", "sa");
        assert!(p.allows(
            &sa,
            &req("GET", "/apis/pillar-csi.io/v1alpha1/pillaragents/a")
        ));
        // The main resource's rule does not cover its status subresource.
        assert!(!p.allows(
            &sa,
            &req("PUT", "/apis/pillar-csi.io/v1alpha1/pillaragents/a/status")
        ));
        assert!(!p.allows(
            &sa,
            &req("GET", "/apis/pillar-csi.io/v1alpha1/pillaragents/a/status")
        ));
        assert!(!p.allows(
            &sa,
            &req("PUT", "/apis/pillar-csi.io/v1alpha1/pillaragents/a")
        ));
        // pods/* covers the subresources, not pods itself.
        assert!(p.allows(&sa, &req("GET", "/api/v1/namespaces/x/pods/p/log")));
        assert!(!p.allows(&sa, &req("GET", "/api/v1/namespaces/x/pods/p")));
        // resourceNames restrict.
        assert!(p.allows(&sa, &req("PUT", "/api/v1/namespaces/x/configmaps/one")));
        assert!(!p.allows(&sa, &req("PUT", "/api/v1/namespaces/x/configmaps/two")));
        // Another ServiceAccount of the same name elsewhere gets nothing.
        let other = ServiceAccount::new("ns2", "sa");
        assert!(!p.allows(
            &other,
            &req("GET", "/apis/pillar-csi.io/v1alpha1/pillaragents/a")
        ));
    }

    #[test]
    fn a_role_binding_grants_in_its_own_namespace_only() {
        let p = RbacPolicy::from_yaml(POLICY, "ns1").unwrap();
        let sa = ServiceAccount::new("ns1", "sa");
        let lease = "/apis/coordination.k8s.io/v1/namespaces/ns1/leases/l";
        assert!(p.allows(&sa, &req("PUT", lease)));
        let elsewhere = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/l";
        assert!(!p.allows(&sa, &req("PUT", elsewhere)));
    }

    #[test]
    fn the_forbidden_message_is_the_api_servers() {
        let r = req("PUT", "/apis/pillar-csi.io/v1alpha1/pillaragents/a/status");
        assert_eq!(
            r.forbidden_message("system:serviceaccount:pillar-system:pillar-controller"),
            "pillaragents.pillar-csi.io \"a\" is forbidden: User \
             \"system:serviceaccount:pillar-system:pillar-controller\" cannot update resource \
             \"pillaragents/status\" in API group \"pillar-csi.io\" at the cluster scope"
        );
    }
}
