#!/usr/bin/env bash
# End-to-end suite against a real Kubernetes. Stage 1 (this file): pillar's CRDs and RBAC
# against the real API server. Stage 2 (stage2.sh, run from here): the controller and the CSI
# sidecars against it, with the scenarios of PVC lifecycle, leader loss and node loss, where no
# kubelet runs. Stage 3 (stage3.sh, run from here): the shipped manifests run by a real kubelet,
# a kubelet restart under a mounted volume, and Kubernetes' storage e2e suite.
#
# Applies the cluster-scoped parts of deploy/base (Namespace, CRDs, ServiceAccounts, RBAC,
# CSIDriver; not the Deployment, DaemonSets or PDB, so no image is pulled), then checks, as the
# controller's ServiceAccount, every verb the controller needs (and some it must not have), and,
# as the admin, the CRD schema's validation and pruning.
#
# Usage: KUBECONFIG=/path/to/admin.kubeconfig [PILLAR_E2E_SIDECARS=DIR]
#          [PILLAR_E2E_KUBELET_RESTART=COMMAND [PILLAR_E2E_TEST=e2e.test]] tests/k8s/run.sh
# Exit: 0 all passed; 1 some check failed; 77 skipped (no KUBECONFIG, no kubectl, or the cluster
# is unreachable). 77 means "not run", never "passed".
set -uo pipefail

KUBECTL=${KUBECTL:-kubectl}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
NS=pillar-system
SA=pillar-controller

if [ -z "${KUBECONFIG:-}" ]; then
  echo "SKIPPED: no KUBECONFIG (set KUBECONFIG to a cluster admin kubeconfig to run)"
  exit 77
fi
if ! command -v "$KUBECTL" >/dev/null 2>&1; then
  echo "SKIPPED: no KUBECONFIG usable: kubectl ($KUBECTL) not found"
  exit 77
fi
if ! "$KUBECTL" get --raw /readyz --request-timeout=5s >/dev/null 2>&1; then
  echo "SKIPPED: no KUBECONFIG usable: cluster at $KUBECONFIG is unreachable"
  exit 77
fi

PASSED=0
FAILED=0
pass() { echo "PASS: $*"; PASSED=$((PASSED + 1)); }
fail() { echo "FAIL: $*"; FAILED=$((FAILED + 1)); }

TMP=$(mktemp -d)
cleanup() {
  "$KUBECTL" delete pillarvolumestates.pillar-csi.io e2e-negative-size e2e-unknown-field \
    --ignore-not-found >/dev/null 2>&1
  rm -rf "$TMP"
}
trap cleanup EXIT

# ---------- apply the cluster-scoped parts of deploy/base ----------
if ! "$KUBECTL" kustomize "$ROOT/deploy/base" >"$TMP/all.yaml" 2>"$TMP/kustomize.err"; then
  fail "kubectl kustomize deploy/base: $(cat "$TMP/kustomize.err")"
  echo "$PASSED passed, $FAILED failed"; exit 1
fi
# Split into documents; drop the workloads (top-level kind Deployment, DaemonSet, PDB).
awk -v out="$TMP/base.yaml" '
  function flush() { if (doc != "" && !skip) printf "---\n%s", doc >> out; doc = ""; skip = 0 }
  /^---/ { flush(); next }
  /^kind: (Deployment|DaemonSet|PodDisruptionBudget)[[:space:]]*$/ { skip = 1 }
  { doc = doc $0 "\n" }
  END { flush() }
' "$TMP/all.yaml"
kinds=$(grep -E '^kind: ' "$TMP/base.yaml" | sort | uniq -c | awk '{printf "%s%s x%s", sep, $3, $1; sep=", "}')
echo "applying: $kinds"
if "$KUBECTL" apply --server-side --force-conflicts --field-manager=pillar-e2e -f "$TMP/base.yaml" \
    >"$TMP/apply.out" 2>"$TMP/apply.err"; then
  pass "server-side apply of deploy/base (without workloads)"
else
  fail "server-side apply of deploy/base: $(cat "$TMP/apply.err")"
fi
# The API server's warnings while applying (e.g. "unrecognized format" in a CRD schema).
if grep -qi 'warning' "$TMP/apply.err"; then
  echo "kube-apiserver warnings while applying:"
  grep -i 'warning' "$TMP/apply.err" | sed 's/^/  /'
  fail "apply printed $(grep -ci warning "$TMP/apply.err") API server warning(s)"
else
  echo "kube-apiserver warnings while applying: none"
  pass "no API server warnings while applying"
fi

CRDS="pillarvolumestates.pillar-csi.io pillarsnapshotstates.pillar-csi.io pillaragents.pillar-csi.io pillarprotocols.pillar-csi.io"
for crd in $CRDS; do
  if out=$("$KUBECTL" wait --for=condition=Established --timeout=60s "crd/$crd" 2>&1); then
    pass "CRD $crd Established"
  else
    fail "CRD $crd not Established: $out"
  fi
done

# ---------- a token kubeconfig for the controller's ServiceAccount ----------
SAKC="$TMP/$SA.kubeconfig"
make_sa_kubeconfig() {
  local server ca_data ca_file token
  server=$("$KUBECTL" config view --minify --raw -o jsonpath='{.clusters[0].cluster.server}') || return 1
  ca_data=$("$KUBECTL" config view --minify --raw -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')
  ca_file=$("$KUBECTL" config view --minify --raw -o jsonpath='{.clusters[0].cluster.certificate-authority}')
  if [ -n "$ca_data" ]; then
    echo "$ca_data" | base64 -d >"$TMP/ca.crt" || return 1
  elif [ -n "$ca_file" ]; then
    cp "$ca_file" "$TMP/ca.crt" || return 1
  else
    echo "admin kubeconfig has no CA" >&2; return 1
  fi
  token=$("$KUBECTL" create token "$SA" -n "$NS" --duration=1h) || return 1
  "$KUBECTL" --kubeconfig="$SAKC" config set-cluster e2e --server="$server" \
    --certificate-authority="$TMP/ca.crt" --embed-certs=true >/dev/null &&
  "$KUBECTL" --kubeconfig="$SAKC" config set-credentials "$SA" --token="$token" >/dev/null &&
  "$KUBECTL" --kubeconfig="$SAKC" config set-context e2e --cluster=e2e --user="$SA" \
    --namespace="$NS" >/dev/null &&
  "$KUBECTL" --kubeconfig="$SAKC" config use-context e2e >/dev/null
}
if err=$(make_sa_kubeconfig 2>&1); then
  who=$("$KUBECTL" --kubeconfig="$SAKC" auth whoami -o jsonpath='{.status.userInfo.username}' 2>&1)
  if [ "$who" = "system:serviceaccount:$NS:$SA" ]; then
    pass "token kubeconfig authenticates as $who"
  else
    fail "token kubeconfig authenticates as: $who"
  fi
else
  fail "token kubeconfig for $NS/$SA: $err"
fi

# ---------- the operator's objects, as the admin ----------
for ex in pillaragent pillarprotocol; do
  if out=$("$KUBECTL" apply -f "$ROOT/deploy/examples/$ex.yaml" 2>&1); then
    pass "admin creates deploy/examples/$ex.yaml ($out)"
  else
    fail "admin creates deploy/examples/$ex.yaml: $out"
  fi
done

# ---------- RBAC, as the controller's ServiceAccount ----------
# can EXPECT VERB RESOURCE [kubectl args...]. Cluster-scoped resources are asked with -A (no
# namespace in the SelfSubjectAccessReview; kubectl warns when one is given).
can() {
  local expect=$1 verb=$2 res=$3; shift 3
  local out err
  out=$("$KUBECTL" --kubeconfig="$SAKC" auth can-i "$verb" "$res" "$@" 2>"$TMP/can.err")
  err=$(tr '\n' ' ' <"$TMP/can.err")
  if [ "$out" = "$expect" ] && [ -z "$err" ]; then
    pass "$SA can-i $verb $res $* -> $out"
  else
    fail "$SA can-i $verb $res $*: expected $expect, got: $out${err:+ (stderr: $err)}"
  fi
}
for res in pillarvolumestates pillarsnapshotstates; do
  for verb in get list create update delete; do can yes "$verb" "$res.pillar-csi.io" -A; done
done
for res in pillarvolumestates pillarsnapshotstates pillaragents; do
  for verb in get update; do can yes "$verb" "$res.pillar-csi.io" -A --subresource=status; done
done
for res in pillaragents pillarprotocols; do
  for verb in get list; do can yes "$verb" "$res.pillar-csi.io" -A; done
done
can yes create events.events.k8s.io -n default
for verb in get create update; do can yes "$verb" leases.coordination.k8s.io -n "$NS"; done
# What it must not do.
can no update pillaragents.pillar-csi.io -A
can no create pillarprotocols.pillar-csi.io -A
can no update persistentvolumes -A
can no create leases.coordination.k8s.io -n kube-system

# ---------- the CRD schema, as the admin ----------
pvs() { # name sizeBytes [extra spec line]
  cat <<YAML
apiVersion: pillar-csi.io/v1alpha1
kind: PillarVolumeState
metadata:
  name: $1
spec:
  volumeId: $1
  agent: storage-1
  pool: default
  protocol: nvme-tcp
  accessMode: SingleNodeWriter
  volumeMode: Filesystem
  sizeBytes: $2
${3:-}
YAML
}
pvs e2e-negative-size -1 >"$TMP/neg.yaml"
"$KUBECTL" create -f "$TMP/neg.yaml" -v=6 >"$TMP/neg.out" 2>"$TMP/neg.err"
rc=$?
msg=$(grep -v '^I[0-9]' "$TMP/neg.err")
if [ $rc -ne 0 ] && grep -qE '(verb="POST".*pillarvolumestates.*status="422|POST .*pillarvolumestates.* 422 )' "$TMP/neg.err" && grep -q 'Invalid' <<<"$msg"; then
  pass "negative spec.sizeBytes refused 422 Unprocessable Entity: $msg"
else
  fail "negative spec.sizeBytes: exit $rc, expected 422 + Invalid, got: $msg $(grep -E 'POST' "$TMP/neg.err")"
fi

pvs e2e-unknown-field 4096 "  notAField: surprise" >"$TMP/unknown.yaml"
# --validate=false: no strict field validation, so the server prunes (the default, Strict,
# refuses the object instead).
if out=$("$KUBECTL" create --validate=false -f "$TMP/unknown.yaml" 2>&1); then
  back=$("$KUBECTL" get pillarvolumestates.pillar-csi.io e2e-unknown-field -o json 2>&1)
  if grep -q notAField <<<"$back"; then
    fail "unknown field spec.notAField kept: $(grep notAField <<<"$back")"
  elif grep -q '"sizeBytes": 4096' <<<"$back"; then
    pass "unknown field spec.notAField pruned (object stored without it)"
  else
    fail "unknown field: could not read the object back: $back"
  fi
else
  fail "create with spec.notAField: $out"
fi
# Strict field validation (kubectl's default) refuses it outright.
pvs e2e-unknown-field-strict 4096 "  notAField: surprise" >"$TMP/strict.yaml"
if out=$("$KUBECTL" create --validate=strict -f "$TMP/strict.yaml" 2>&1); then
  "$KUBECTL" delete pillarvolumestates.pillar-csi.io e2e-unknown-field-strict >/dev/null 2>&1
  fail "create with spec.notAField under --validate=strict accepted: $out"
elif grep -q 'unknown field' <<<"$out"; then
  pass "unknown field refused under strict field validation: $out"
else
  fail "create with spec.notAField under --validate=strict: $out"
fi

echo "stage 1: $PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ] || exit 1

# Stage 2: the controller, the sidecars and the scenarios (tests/k8s/stage2.sh), where no
# kubelet runs. Stage 3: the shipped manifests run by a real kubelet, its restart, and
# Kubernetes' storage e2e suite (tests/k8s/stage3.sh). Each one's own skip (what it needs is not
# there) is reported as such: not tested, never passed.
outcome() { case $1 in 0) echo passed ;; 77) echo "SKIPPED (not tested)" ;; *) echo FAILED ;; esac; }
rc2=0
"$ROOT/tests/k8s/stage2.sh" || rc2=$?
rc3=0
"$ROOT/tests/k8s/stage3.sh" || rc3=$?
echo "stage 1 passed; stage 2 $(outcome $rc2); stage 3 $(outcome $rc3)"
for rc in $rc2 $rc3; do
  case $rc in 0 | 77) ;; *) exit "$rc" ;; esac
done
