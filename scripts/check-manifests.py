#!/usr/bin/env python3
"""Renders every kustomize target under deploy/ and checks every object offline.

    scripts/check-manifests.py [--containers-json FILE]

- Each folder under deploy/ with a kustomization.yaml is rendered with `kubectl kustomize`, and
  so is each test-only overlay under tests/k8s/overlays/ (the end-to-end suite's); a test-only
  flag of a pillar binary (--test-local-device-attach, --target=test-double, plaintext, unsafe)
  anywhere else fails.
- Built-in kinds are validated (strict: unknown fields fail) against the Kubernetes schemas of
  every version in KUBERNETES_VERSIONS, with the `kubernetes-validate` package; objects of
  pillar's own CRDs against the CRD's openAPIV3Schema from deploy/base/crds.yaml; the examples in
  deploy/examples/ the same way. Kinds of other projects' CRDs (VolumeSnapshotClass) are checked
  for their required fields only: their schemas are not shipped here.
- With --containers-json, writes the containers running a pillar image (`pillar-csi`,
  `pillar-agent`) as JSON: the binary, its argv after the binary with `$(VAR)` references
  expanded as kubelet does, and the environment (downward-API values replaced by typical
  ones). csi/tests/deploy_manifests.rs parses those argvs with the binaries' own parsers.

Exit code 0 only when every target rendered and every object passed.
"""

import argparse
import json
import pathlib
import re
import subprocess
import sys

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import yaml

# Every Kubernetes version the installed kubernetes-validate knows, from 1.31 (the oldest pillar
# supports) on: a newer package brings newer versions in without an edit here.
OLDEST_SUPPORTED = (1, 31)
KUBERNETES_VERSIONS = sorted(
    {v for v in kubernetes_validate.utils.all_versions()
     if tuple(int(x) for x in v.split(".")[:2]) >= OLDEST_SUPPORTED},
    key=lambda v: tuple(int(x) for x in v.split(".")),
)
PILLAR_GROUP = "pillar-csi.io"
PILLAR_IMAGES = {"pillar-csi", "pillar-agent"}
# What the downward API would give, typed as the real values are.
FIELD_VALUES = {
    "spec.nodeName": "node-a",
    "status.hostIP": "192.0.2.10",
    "status.podIP": "192.0.2.20",
    "metadata.name": "pillar-pod-a",
    "metadata.namespace": "pillar-system",
}
# Required fields of kinds whose schemas ship with other projects.
FOREIGN_REQUIRED = {
    ("snapshot.storage.k8s.io", "VolumeSnapshotClass"): ["driver", "deletionPolicy"],
    ("snapshot.storage.k8s.io", "VolumeSnapshot"): ["spec"],
    ("monitoring.coreos.com", "PodMonitor"): ["spec"],
    ("monitoring.coreos.com", "PrometheusRule"): ["spec"],
}
# Where the metrics are registered: (source, prefix). Counters are exposed with `_total`,
# histograms with `_bucket`, `_count` and `_sum`.
METRIC_SOURCES = [
    ("csi/src/controller/metrics.rs", "pillar_controller_"),
    ("uring-agent/src/metrics.rs", "pillar_agent_"),
]


def exported_metrics():
    names = set()
    for source, prefix in METRIC_SOURCES:
        text = (ROOT / source).read_text()
        for m in re.finditer(r'register\(\s*"([a-z_]+)",\s*"[^"]*"(?:\s*\n?\s*"[^"]*")*,\s*(\w+)', text):
            base = prefix + m.group(1)
            names |= {base, base + "_total", base + "_bucket", base + "_count", base + "_sum"}
    return names


def check_metric_names(text, origin, known, problems):
    for name in sorted(set(re.findall(r"\bpillar_[a-z_]+", text))):
        if name not in known:
            problems.append(f"{origin}: {name} is not a metric pillar exports")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
# Test-only kustomize overlays (the end-to-end suite's): rendered and checked like deploy/'s, and
# the only place where the test-only flags below may appear.
TEST_OVERLAYS = ROOT / "tests" / "k8s" / "overlays"
TEST_ONLY_FLAGS = ("--test-local-device-attach", "--target=test-double", "--insecure-plaintext",
                   "--agent-insecure-plaintext", "--unsafe-")


def crd_schemas():
    schemas = {}
    for doc in yaml.safe_load_all((DEPLOY / "base" / "crds.yaml").read_text()):
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc["spec"]
        for version in spec["versions"]:
            api = f"{spec['group']}/{version['name']}"
            schemas[(api, spec["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    return schemas


def check_object(obj, origin, schemas, problems):
    api, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    group = api.split("/")[0] if "/" in api else ""
    name = f"{origin}: {kind}/{obj.get('metadata', {}).get('name', '?')}"
    if group == PILLAR_GROUP:
        schema = schemas.get((api, kind))
        if schema is None:
            problems.append(f"{name}: no CRD in deploy/base/crds.yaml for {api} {kind}")
            return
        try:
            jsonschema.validate(obj, schema)
        except jsonschema.ValidationError as e:
            problems.append(f"{name}: {e.message} at {list(e.absolute_path)}")
        return
    if (group, kind) in FOREIGN_REQUIRED:
        missing = [f for f in FOREIGN_REQUIRED[(group, kind)] if f not in obj]
        if missing:
            problems.append(f"{name}: missing {missing}")
        return
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{name}: Kubernetes {version}: {e.message} at {list(e.path)}")
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
            problems.append(f"{name}: Kubernetes {version}: no schema: {e}")


def check_images(obj, origin, problems):
    """Every image is fully qualified (a registry host, never the default registry's library
    namespace) and pinned by tag or digest."""
    pod = obj.get("spec", {}).get("template", {}).get("spec")
    if not pod:
        return
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        image = c.get("image", "")
        first = image.split("/")[0]
        qualified = "/" in image and ("." in first or ":" in first or first == "localhost")
        pinned = "@" in image or ":" in image.rsplit("/", 1)[-1]
        if not (qualified and pinned):
            problems.append(f"{origin}: {obj['kind']}/{obj['metadata']['name']} container "
                            f"{c.get('name')}: image {image!r} is not a registry-qualified, "
                            "tagged name")


def expand(value, env):
    # kubelet: $(VAR) becomes VAR's value when VAR is defined; $$ escapes.
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def check_test_only_flags(obj, origin, problems):
    """No manifest under deploy/ runs a pillar binary with a test-only flag."""
    pod = obj.get("spec", {}).get("template", {}).get("spec")
    if not pod:
        return
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        for arg in c.get("command", []) + c.get("args", []):
            if any(arg.startswith(flag) for flag in TEST_ONLY_FLAGS):
                problems.append(f"{origin}: {obj['kind']}/{obj['metadata']['name']} container "
                                f"{c.get('name')}: test-only flag {arg} outside {TEST_OVERLAYS.relative_to(ROOT)}")


def pillar_containers(obj, origin):
    pod = obj.get("spec", {}).get("template", {}).get("spec")
    if not pod:
        return []
    found = []
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        image = c.get("image", "").split("@")[0].rsplit(":", 1)[0].rsplit("/", 1)[-1]
        if image not in PILLAR_IMAGES:
            continue
        env = {}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            elif "fieldRef" in e.get("valueFrom", {}):
                env[e["name"]] = FIELD_VALUES.get(e["valueFrom"]["fieldRef"]["fieldPath"], "x")
            else:
                env[e["name"]] = "x"
        command = c.get("command") or [image]
        argv = [expand(a, env) for a in command[1:] + c.get("args", [])]
        found.append({
            "origin": origin,
            "workload": f"{obj['kind']}/{obj['metadata']['name']}",
            "container": c["name"],
            "binary": pathlib.PurePath(command[0]).name,
            "image": image,
            "argv": argv,
            "env": env,
        })
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--containers-json")
    args = parser.parse_args()
    schemas = crd_schemas()
    problems, containers, rendered = [], [], []
    targets = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))
    test_targets = sorted(p.parent for p in TEST_OVERLAYS.rglob("kustomization.yaml"))
    for target in targets + test_targets:
        rel = target.relative_to(ROOT)
        out = subprocess.run(["kubectl", "kustomize", str(target)], capture_output=True, text=True)
        if out.returncode != 0:
            problems.append(f"{rel}: kubectl kustomize failed: {out.stderr.strip()}")
            continue
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        rendered.append(f"{rel} ({len(docs)} objects)")
        for obj in docs:
            check_object(obj, str(rel), schemas, problems)
            check_images(obj, str(rel), problems)
            if target in targets:
                check_test_only_flags(obj, str(rel), problems)
            containers += pillar_containers(obj, str(rel))
    for example in sorted((DEPLOY / "examples").glob("*.yaml")):
        rel = example.relative_to(ROOT)
        for obj in (d for d in yaml.safe_load_all(example.read_text()) if d):
            check_object(obj, str(rel), schemas, problems)
            check_test_only_flags(obj, str(rel), problems)
            containers += pillar_containers(obj, str(rel))
        rendered.append(str(rel))
    # Alerts and dashboards name only metrics the binaries export.
    known = exported_metrics()
    if not known:
        problems.append("no registered metric found in " + ", ".join(s for s, _ in METRIC_SOURCES))
    for rule in sorted(DEPLOY.rglob("prometheusrule*.yaml")):
        check_metric_names(rule.read_text(), str(rule.relative_to(ROOT)), known, problems)
        rendered.append(f"{rule.relative_to(ROOT)} (metric names)")
    for dashboard in sorted(DEPLOY.rglob("*.json")):
        rel = dashboard.relative_to(ROOT)
        try:
            panels = json.loads(dashboard.read_text()).get("panels", [])
        except json.JSONDecodeError as e:
            problems.append(f"{rel}: not JSON: {e}")
            continue
        exprs = [t.get("expr", "") for p in panels for t in p.get("targets", [])]
        if not exprs:
            problems.append(f"{rel}: no panel queries anything")
        check_metric_names("\n".join(exprs), str(rel), known, problems)
        rendered.append(f"{rel} ({len(panels)} panels, metric names)")
    print(f"rendered and checked against Kubernetes {', '.join(KUBERNETES_VERSIONS)}:")
    for r in rendered:
        print(f"  {r}")
    if args.containers_json:
        pathlib.Path(args.containers_json).write_text(json.dumps(containers, indent=1))
    if not targets:
        problems.append("no kustomize target under deploy/")
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
