#!/usr/bin/env bash
# End-to-end suite, stage 2: pillar's controller and the controller-side CSI sidecars against a
# real API server and kube-controller-manager (attach-detach, PV binder, pod GC), each sidecar
# with its own token of the controller's ServiceAccount and the args deploy/base ships. Where no
# kubelet runs, this script plays kubelet (Node and CSINode from NodeGetInfo, NodeStage and
# NodePublish with the VolumeAttachment's metadata, volumesInUse) and the scheduler (the
# selected-node annotation of WaitForFirstConsumer). The agent runs on the configfs test double
# and the node plugins stage its local devices (a test-only attach mode): the NVMe/TCP data path
# and its fencing are the kernel lane's; this stage proves the Kubernetes side.
#
# Usage: KUBECONFIG=admin.kubeconfig PILLAR_E2E_SIDECARS=DIR tests/k8s/stage2.sh
#   DIR holds csi-provisioner, csi-attacher, csi-resizer and csi-snapshotter at the versions
#   deploy/base pins. The cluster needs the VolumeSnapshot CRDs and snapshot-controller, and no
#   kubelet on the nodes e2e-node-a and e2e-node-b this stage creates, and no Ready node (where a
#   kubelet runs, stage 3 is the stage). Needs root (mounts).
# Exit: 0 all passed; 1 some check failed; 77 skipped (what is missing is printed).
set -uo pipefail

KUBECTL=${KUBECTL:-kubectl}
export RUST_BACKTRACE=0
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
NS=pillar-system
SIDECARS=${PILLAR_E2E_SIDECARS:-}

skip() { echo "SKIPPED (stage 2): $*"; exit 77; }
[ -n "${KUBECONFIG:-}" ] || skip "no KUBECONFIG"
[ -n "$SIDECARS" ] || skip "no PILLAR_E2E_SIDECARS (a directory with the sidecar binaries)"
for c in csi-provisioner csi-attacher csi-resizer csi-snapshotter; do
  [ -x "$SIDECARS/$c" ] || skip "$SIDECARS/$c is missing"
done
command -v jq >/dev/null || skip "jq is not installed"
command -v curl >/dev/null || skip "curl is not installed"
[ "$(id -u)" = 0 ] || skip "needs root (the node plugins mount)"
"$KUBECTL" get --raw /readyz --request-timeout=5s >/dev/null 2>&1 || skip "cluster unreachable"
"$KUBECTL" get crd volumesnapshots.snapshot.storage.k8s.io >/dev/null 2>&1 ||
  skip "no VolumeSnapshot CRDs in the cluster"
# A real kubelet would run deploy/base's pods beside this stage's processes (two controllers,
# a second node plugin): stage 3 is the stage for a cluster with one.
"$KUBECTL" get nodes -o json | jq -e 'any(.items[]; any(.status.conditions[]?;
  .type == "Ready" and .status == "True"))' >/dev/null 2>&1 &&
  skip "the cluster has a Ready node (a kubelet runs there): stage 3 tests with it"

PASSED=0
FAILED=0
pass() { echo "PASS: $*"; PASSED=$((PASSED + 1)); }
fail() { echo "FAIL: $*"; FAILED=$((FAILED + 1)); }
check() { local what=$1; shift; if "$@"; then pass "$what"; else fail "$what"; fi; }

W=$(mktemp -d -t pillar-k8s.XXXXXX)
mkdir -p "$W/pids" "$W/pool"
# shellcheck source=tests/k8s/lib.sh
. "$ROOT/tests/k8s/lib.sh"

cleanup() {
  local f
  for f in "$W"/pids/*; do [ -e "$f" ] && kill -CONT "$(cat "$f")" 2>/dev/null; done
  for f in "$W"/pids/*; do [ -e "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
  wait 2>/dev/null
  grep -h "$W" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount 2>/dev/null
  losetup -a | grep -F "$W/pool" | cut -d: -f1 | xargs -r -n1 losetup -d 2>/dev/null
  umount "$W/pool" 2>/dev/null
  [ -n "${KEEP:-}" ] || reset_cluster
  if [ -n "${KEEP:-}" ]; then echo "kept $W"; else rm -rf "$W"; fi
}
trap cleanup EXIT
trap "exit 143" TERM INT

# ---------- build and deploy ----------
reset_cluster
pool_on_xfs || { fail "XFS pool image"; exit 1; }
FS_TYPE=$(choose_fs_type)
echo "volumes' file system: $FS_TYPE"
echo "building pillar (debug)"
(cd "$ROOT" && cargo build --quiet --locked -p pillar-agent -p pillar-csi --bins) || {
  fail "cargo build"; exit 1; }
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/debug

k kustomize "$ROOT/deploy/base" >"$W/base.yaml" || { fail "kustomize"; exit 1; }
k apply --server-side --force-conflicts --field-manager=pillar-e2e -f "$W/base.yaml" >/dev/null ||
  { fail "apply deploy/base"; exit 1; }
k -n "$NS" get deployment pillar-controller -o json >"$W/controller-deployment.json"
# Two replicas: two pod objects to run as (they stay Pending: no kubelet runs them).
k -n "$NS" scale deployment pillar-controller --replicas=2 >/dev/null
two_pods() { [ "$(k -n "$NS" get pods -l app=pillar-controller -o name | wc -l)" -ge 2 ]; }
wait_for 60 "two controller pods" two_pods || { fail "controller pods"; exit 1; }
mapfile -t PODS < <(k -n "$NS" get pods -l app=pillar-controller -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}')

start agent "$BIN/pillar-agent" --state-dir "$W/agent" --listen "unix://$W/agent.sock" \
  --target test-double --pool "$POOL=file:$W/pool" --insecure-plaintext --nvme-address 127.0.0.1
wait_for 30 "agent socket" test -S "$W/agent.sock" || { fail "agent start"; exit 1; }
jq -n --arg a "unix://$W/agent.sock" --arg zk "$ZONE_KEY" --arg z "$ZONE" --arg p "$POOL" '{
  apiVersion: "pillar-csi.io/v1alpha1", kind: "PillarAgent", metadata: {name: "e2e-storage"},
  spec: {node: "e2e-storage", address: $a, nvmeAddress: "127.0.0.1",
    pools: [{name: $p, kind: "file"}], topology: {($zk): $z}}}' | k apply -f - >/dev/null
k apply -f "$ROOT/deploy/examples/pillarprotocol.yaml" >/dev/null
jq -n --arg p "$POOL" --arg fs "$FS_TYPE" '{apiVersion: "storage.k8s.io/v1", kind: "StorageClass",
  metadata: {name: "pillar-e2e"}, provisioner: "pillar.csi.io",
  parameters: {"pillar.io/pool": $p, "pillar.io/protocol": "nvme-tcp",
    "csi.storage.k8s.io/fstype": $fs},
  allowVolumeExpansion: true, volumeBindingMode: "WaitForFirstConsumer", reclaimPolicy: "Delete"}' |
  k apply -f - >/dev/null
jq '.metadata.name = "pillar-e2e"' <(k create --dry-run=client -o json \
  -f "$ROOT/deploy/examples/volumesnapshotclass.yaml") | k apply -f - >/dev/null

for n in e2e-node-a e2e-node-b; do
  check "node plugin $n registered (Node and CSINode from NodeGetInfo)" start_node "$n"
done
check "replica 1 started as pod ${PODS[0]}" start_replica 1 "${PODS[0]}"
if [ ! -x "$SIDECARS/csi-external-health-monitor-controller" ]; then
  echo "SKIPPED: csi-external-health-monitor-controller not in $SIDECARS: four sidecars, not five"
fi
check "every sidecar of replica 1 answers its liveness probe URL" wait_for 30 "healthz" sidecars_healthy 1

# ---------- scenarios ----------
. "$ROOT/tests/k8s/scenarios.sh"
scenario_a
scenario_b
scenario_c
scenario_d

echo
echo "stage 2: $PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ]
