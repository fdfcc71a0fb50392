//! What `deploy/` grants and wires, held against what each pinned sidecar needs
//! (`deploy/sidecar-rules.yaml`, written from the sidecars' own RBAC manifests and docs at their
//! pinned tags) and against what pillar advertises over CSI:
//! - every rule a sidecar needs under the arguments it runs with is granted to its pod's
//!   ServiceAccount, evaluated by the same RBAC code the API server double enforces;
//! - nothing is granted to the controller's ServiceAccount that neither a sidecar nor pillar's own
//!   code needs (least privilege);
//! - every sidecar image is pinned at the version its rules were read for;
//! - every capability pillar advertises is wired (GET_CAPACITY and storageCapacity with
//!   --enable-capacity, VOLUME_CONDITION and a health monitor, EXPAND_VOLUME and the resizer,
//!   snapshots and the snapshotter, topology and the provisioner's feature gate, publish and the
//!   attacher), and no sidecar runs for a capability pillar does not advertise.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use pillar_csi::csi;
use pillar_csi::csi::identity_server::Identity;
use pillar_csi::identity::IdentityService;
use pillar_state::apiserver_double::rbac::{RbacPolicy, RequestAttributes, ServiceAccount};
use serde::Deserialize;
use serde_yaml::Value;
use support::{Env, StoreKind};

#[derive(Debug, Deserialize)]
struct Rules {
    sidecars: Vec<Sidecar>,
}

#[derive(Debug, Deserialize)]
struct Sidecar {
    name: String,
    container: Option<String>,
    version: String,
    rules: Vec<Rule>,
}

#[derive(Debug, Deserialize)]
struct Rule {
    scope: String,
    group: String,
    resource: String,
    verbs: Vec<String>,
    when: Option<String>,
}

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn str_of<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    let mut v = v;
    for key in path {
        v = &v[*key];
    }
    v.as_str().unwrap_or_default()
}

/// A container of a pillar workload.
struct Container {
    workload: String,
    service_account: String,
    name: String,
    /// The image's last path component, without its tag.
    image: String,
    args: Vec<String>,
}

fn containers() -> Vec<Container> {
    let mut out = Vec::new();
    for file in ["controller.yaml", "node.yaml", "agent.yaml"] {
        for doc in yaml_docs(&deploy().join("base").join(file)) {
            let pod = &doc["spec"]["template"]["spec"];
            let Some(list) = pod["containers"].as_sequence() else {
                continue;
            };
            for c in list {
                let image = str_of(c, &["image"]);
                let image = image.rsplit('/').next().unwrap().split(':').next().unwrap();
                out.push(Container {
                    workload: str_of(&doc, &["metadata", "name"]).to_owned(),
                    service_account: str_of(pod, &["serviceAccountName"]).to_owned(),
                    name: str_of(c, &["name"]).to_owned(),
                    image: image.to_owned(),
                    args: c["args"]
                        .as_sequence()
                        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_owned()).collect())
                        .unwrap_or_default(),
                });
            }
        }
    }
    out
}

fn kustomization() -> Value {
    yaml_docs(&deploy().join("base/kustomization.yaml")).remove(0)
}

/// image name (last path component) -> pinned tag.
fn pins() -> BTreeMap<String, String> {
    kustomization()["images"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|i| {
            let name = str_of(i, &["name"]).rsplit('/').next().unwrap().to_owned();
            (name, str_of(i, &["newTag"]).to_owned())
        })
        .collect()
}

fn sidecar_rules() -> Rules {
    let text = std::fs::read_to_string(deploy().join("sidecar-rules.yaml")).unwrap();
    serde_yaml::from_str(&text).unwrap()
}

/// What pillar advertises: plugin capabilities (from the Identity service) and controller
/// capabilities (over the controller's real gRPC socket), by their CSI names.
async fn advertised() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let plugin = IdentityService
        .get_plugin_capabilities(tonic::Request::new(csi::GetPluginCapabilitiesRequest {}))
        .await
        .unwrap()
        .into_inner();
    for cap in plugin.capabilities {
        if let Some(csi::plugin_capability::Type::Service(s)) = cap.r#type {
            names.insert(s.r#type().as_str_name().to_owned());
        }
    }
    let mut env = Env::start(StoreKind::Embedded, true).await;
    let controller = env
        .client
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    for cap in controller.capabilities {
        if let Some(csi::controller_service_capability::Type::Rpc(rpc)) = cap.r#type {
            names.insert(rpc.r#type().as_str_name().to_owned());
        }
    }
    names
}

/// StorageClass and VolumeSnapshotClass parameter keys of the shipped examples.
fn class_parameters() -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    for file in ["storageclass.yaml", "volumesnapshotclass.yaml"] {
        for doc in yaml_docs(&deploy().join("examples").join(file)) {
            if let Some(map) = doc["parameters"].as_mapping() {
                keys.extend(map.keys().filter_map(|k| k.as_str().map(str::to_owned)));
            }
        }
    }
    keys
}

fn condition_holds(
    when: &str,
    args: &[String],
    caps: &BTreeSet<String>,
    params: &BTreeSet<String>,
) -> bool {
    if let Some(cap) = when.strip_prefix("capability:") {
        return caps.contains(cap);
    }
    if let Some(key) = when.strip_prefix("class-param:") {
        return params.contains(key);
    }
    assert!(when.starts_with("--"), "unknown condition {when:?}");
    if let Some(gate) = when.strip_prefix("--feature-gates=") {
        return args
            .iter()
            .filter_map(|a| a.strip_prefix("--feature-gates="))
            .any(|gates| gates.split(',').any(|g| g == gate));
    }
    args.iter()
        .any(|a| a == when || (!when.contains('=') && *a == format!("{when}=true")))
}

/// (scope namespace, group, resource, verb) a sidecar or pillar needs, for the least-privilege
/// check.
type Need = (Option<String>, String, String, String);

fn needs(rule: &Rule, namespace: &str) -> Vec<Need> {
    let ns = (rule.scope == "namespace").then(|| namespace.to_owned());
    rule.verbs
        .iter()
        .map(|v| {
            (
                ns.clone(),
                rule.group.clone(),
                rule.resource.clone(),
                v.clone(),
            )
        })
        .collect()
}

// Every rule each sidecar needs, as it runs, is granted to its ServiceAccount; each sidecar
// image is pinned at the version its rules were read for; no sidecar of pillar's workloads is
// missing from the rules.
#[tokio::test]
async fn every_sidecar_has_the_api_access_it_needs_at_its_pinned_version() {
    let namespace = str_of(&kustomization(), &["namespace"]).to_owned();
    let policy = RbacPolicy::from_kustomize_base(&deploy().join("base")).unwrap();
    let rules = sidecar_rules();
    let pins = pins();
    let caps = advertised().await;
    let params = class_parameters();
    let mut missing = Vec::new();
    for c in containers() {
        if c.image.starts_with("pillar-") {
            continue;
        }
        let Some(sidecar) = rules.sidecars.iter().find(|s| s.name == c.image) else {
            panic!(
                "{}/{}: image {} has no entry in sidecar-rules.yaml",
                c.workload, c.name, c.image
            );
        };
        assert_eq!(
            c.name,
            sidecar
                .container
                .clone()
                .unwrap_or_else(|| sidecar.name.clone()),
            "container name of {}",
            sidecar.name
        );
        assert_eq!(
            pins.get(&c.image),
            Some(&sidecar.version),
            "{}: the pinned tag is not the version whose rules sidecar-rules.yaml holds",
            c.image
        );
        let account = ServiceAccount::new(&namespace, &c.service_account);
        for rule in &sidecar.rules {
            if let Some(when) = &rule.when
                && !condition_holds(when, &c.args, &caps, &params)
            {
                continue;
            }
            let (resource, sub) = match rule.resource.split_once('/') {
                Some((r, s)) => (r.to_owned(), Some(s.to_owned())),
                None => (rule.resource.clone(), None),
            };
            for verb in &rule.verbs {
                let req = RequestAttributes {
                    verb: verb.clone(),
                    group: rule.group.clone(),
                    resource: resource.clone(),
                    subresource: sub.clone(),
                    namespace: (rule.scope == "namespace").then(|| namespace.clone()),
                    name: None,
                };
                if !policy.allows(&account, &req) {
                    missing.push(format!(
                        "{}/{} ({}): {verb} {}.{} ({})",
                        c.workload,
                        c.name,
                        c.service_account,
                        rule.resource,
                        rule.group,
                        rule.scope
                    ));
                }
            }
        }
    }
    assert!(missing.is_empty(), "not granted:\n{}", missing.join("\n"));
}

/// What pillar's controller code itself calls (csi/state: KubeStore, lease; resync loop).
fn pillar_needs(namespace: &str) -> Vec<Need> {
    let mut out = Vec::new();
    let mut add = |ns: Option<&str>, group: &str, resources: &[&str], verbs: &[&str]| {
        for r in resources {
            for v in verbs {
                out.push((
                    ns.map(str::to_owned),
                    group.to_owned(),
                    (*r).to_owned(),
                    (*v).to_owned(),
                ));
            }
        }
    };
    let records = ["pillarvolumestates", "pillarsnapshotstates"];
    add(
        None,
        "pillar-csi.io",
        &records,
        &["get", "list", "create", "update", "delete"],
    );
    let statuses = [
        "pillarvolumestates/status",
        "pillarsnapshotstates/status",
        "pillaragents/status",
    ];
    add(None, "pillar-csi.io", &statuses, &["get", "update"]);
    add(
        None,
        "pillar-csi.io",
        &["pillaragents", "pillarprotocols"],
        &["get", "list"],
    );
    add(None, "events.k8s.io", &["events"], &["create"]);
    // Reviews of node plugins' tokens (csi/src/credentials_delivery/mod.rs).
    add(
        None,
        "authentication.k8s.io",
        &["tokenreviews"],
        &["create"],
    );
    add(
        Some(namespace),
        "coordination.k8s.io",
        &["leases"],
        &["get", "create", "update"],
    );
    // Nodes' DH-HMAC-CHAP credentials (csi/state/src/kube_credentials.rs).
    add(
        Some(namespace),
        "",
        &["secrets"],
        &["get", "create", "update"],
    );
    out
}

fn covers(list: &[String], want: &str) -> bool {
    list.iter().any(|v| v == want)
}

// Least privilege: every verb on every resource granted to the controller's ServiceAccount is
// needed by a sidecar running with its arguments, or by pillar's own code (a wildcard is never
// granted). This is where a stale grant (PersistentVolume update, which no sidecar needs) fails.
#[tokio::test]
async fn the_controller_account_is_granted_nothing_nobody_needs() {
    let namespace = str_of(&kustomization(), &["namespace"]).to_owned();
    let policy = RbacPolicy::from_kustomize_base(&deploy().join("base")).unwrap();
    let caps = advertised().await;
    let params = class_parameters();
    let rules = sidecar_rules();
    let mut needed: BTreeSet<Need> = pillar_needs(&namespace).into_iter().collect();
    for c in containers()
        .iter()
        .filter(|c| c.workload == "pillar-controller")
    {
        let Some(sidecar) = rules.sidecars.iter().find(|s| s.name == c.image) else {
            continue;
        };
        for rule in &sidecar.rules {
            if rule
                .when
                .as_ref()
                .is_none_or(|w| condition_holds(w, &c.args, &caps, &params))
            {
                needed.extend(needs(rule, &namespace));
            }
        }
    }
    let account = ServiceAccount::new(&namespace, "pillar-controller");
    let mut extra = Vec::new();
    for grant in policy.grants(&account) {
        for list in [&grant.api_groups, &grant.resources, &grant.verbs] {
            assert!(!covers(list, "*"), "a wildcard grant: {grant:?}");
        }
        for group in &grant.api_groups {
            for resource in &grant.resources {
                for verb in &grant.verbs {
                    // A cluster-wide need is met by a cluster-wide grant; a namespaced need by
                    // either.
                    let cluster: Need = (None, group.clone(), resource.clone(), verb.clone());
                    let local: Need = (
                        grant.namespace.clone(),
                        group.clone(),
                        resource.clone(),
                        verb.clone(),
                    );
                    if !needed.contains(&cluster) && !needed.contains(&local) {
                        extra.push(format!(
                            "{verb} {resource}.{group} in {:?}",
                            grant.namespace
                        ));
                    }
                }
            }
        }
    }
    assert!(
        extra.is_empty(),
        "granted but needed by nothing:\n{}",
        extra.join("\n")
    );
}

fn controller_container<'a>(all: &'a [Container], image: &str) -> Option<&'a Container> {
    all.iter()
        .find(|c| c.workload == "pillar-controller" && c.image == image)
}

// Every capability pillar advertises is wired in deploy/, and every controller sidecar serves a
// capability pillar advertises.
#[tokio::test]
async fn every_advertised_capability_is_wired_in_deploy() {
    let caps = advertised().await;
    let all = containers();
    let driver = yaml_docs(&deploy().join("base/csidriver.yaml")).remove(0);
    let has = |c: &str| caps.contains(c);
    let args_of = |image: &str| controller_container(&all, image).map(|c| c.args.clone());

    // GET_CAPACITY: the provisioner publishes CSIStorageCapacity, the scheduler reads it.
    let provisioner = args_of("csi-provisioner").expect("csi-provisioner");
    assert_eq!(
        has("GET_CAPACITY"),
        driver["spec"]["storageCapacity"] == Value::Bool(true)
    );
    assert_eq!(
        has("GET_CAPACITY"),
        provisioner.contains(&"--enable-capacity".to_owned())
    );
    // VOLUME_ACCESSIBILITY_CONSTRAINTS: topology in the provisioner, and a StorageClass that
    // waits for the consumer (Immediate binding places a volume before its pod has a node).
    assert_eq!(
        has("VOLUME_ACCESSIBILITY_CONSTRAINTS"),
        provisioner
            .iter()
            .any(|a| a.starts_with("--feature-gates=") && a.contains("Topology=true"))
    );
    for class in yaml_docs(&deploy().join("examples/storageclass.yaml")) {
        if str_of(&class, &["kind"]) == "StorageClass" {
            assert_eq!(
                str_of(&class, &["volumeBindingMode"]),
                "WaitForFirstConsumer"
            );
        }
    }
    // The rest: a sidecar per capability, and none without one.
    let wired = [
        ("PUBLISH_UNPUBLISH_VOLUME", "csi-attacher"),
        ("EXPAND_VOLUME", "csi-resizer"),
        ("CREATE_DELETE_SNAPSHOT", "csi-snapshotter"),
        ("VOLUME_CONDITION", "csi-external-health-monitor-controller"),
    ];
    for (cap, image) in wired {
        assert_eq!(has(cap), args_of(image).is_some(), "{cap} and {image}");
    }
    assert_eq!(
        has("PUBLISH_UNPUBLISH_VOLUME"),
        driver["spec"]["attachRequired"] == Value::Bool(true)
    );
    // The health monitor needs a way to read a volume's condition.
    if has("VOLUME_CONDITION") {
        assert!(has("LIST_VOLUMES") || has("GET_VOLUME"));
    }
    // Liveness: every container serving CSI or a sidecar's health endpoint declares a probe.
    for doc in ["controller.yaml", "node.yaml"] {
        for w in yaml_docs(&deploy().join("base").join(doc)) {
            let Some(list) = w["spec"]["template"]["spec"]["containers"].as_sequence() else {
                continue;
            };
            let probed = list
                .iter()
                .filter(|c| !c["livenessProbe"].is_null())
                .count();
            // Every container but the livenessprobe sidecar itself.
            assert_eq!(
                probed,
                list.len() - 1,
                "{doc}: containers without a livenessProbe"
            );
        }
    }
}
