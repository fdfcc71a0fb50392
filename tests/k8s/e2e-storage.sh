#!/usr/bin/env bash
# End-to-end suite, e): Kubernetes' own storage e2e suite against pillar, with the driver
# definition tests/k8s/e2e-driver.yaml. Run by tests/k8s/stage3.sh once pillar is deployed (the
# StorageClass and VolumeSnapshotClass `pillar-e2e` exist); prints the suite's counts.
#
# Usage: KUBECONFIG=... PILLAR_E2E_TEST=/path/to/e2e.test tests/k8s/e2e-storage.sh
#   PILLAR_E2E_FOCUS  ginkgo focus (default External.Storage)
#   PILLAR_E2E_SKIP   ginkgo skip (default \[Disruptive\]: those restart kubelet over SSH)
#   PILLAR_E2E_TIMEOUT  the whole run's bound (default 3h); specs not reached are counted as
#     not run, never as passed
#   PILLAR_E2E_REPORT_DIR  where the JUnit report and the log go (default a temporary directory)
#   PILLAR_E2E_SEED  ginkgo's seed: the specs run in a random order (default 1), so a run cut
#     short by the timeout is a random sample of the focus, not its first suites
#   PILLAR_E2E_GINKGO  the ginkgo CLI of e2e.test's ginkgo version: runs PILLAR_E2E_PROCS (4)
#     processes in parallel (the specs mostly wait on the cluster)
# The images e2e.test runs (registry.k8s.io/e2e-test-images/busybox, agnhost, pause, at the tags
# its test/utils/image/manifest.go names) must be on the nodes.
# Exit: 0 no spec failed; 1 some failed; 77 skipped.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
E2E=${PILLAR_E2E_TEST:-}
[ -n "$E2E" ] && [ -x "$E2E" ] || { echo "e2e SKIPPED (not tested): no executable PILLAR_E2E_TEST"; exit 77; }
[ -n "${KUBECONFIG:-}" ] || { echo "e2e SKIPPED (not tested): no KUBECONFIG"; exit 77; }
FOCUS=${PILLAR_E2E_FOCUS:-External.Storage}
SKIP=${PILLAR_E2E_SKIP:-'\[Disruptive\]'}
OUT=${PILLAR_E2E_REPORT_DIR:-$(mktemp -d -t pillar-e2e.XXXXXX)}
mkdir -p "$OUT"

SEED=${PILLAR_E2E_SEED:-1}
SUITE=(--ginkgo.focus="$FOCUS" --ginkgo.skip="$SKIP" --ginkgo.timeout="${PILLAR_E2E_TIMEOUT:-3h}"
  --ginkgo.randomize-all --ginkgo.seed="$SEED" --ginkgo.junit-report="$OUT/junit.xml"
  --ginkgo.no-color --ginkgo.poll-progress-after=10m)
DRIVER=(--kubeconfig="$KUBECONFIG" --storage.testdriver="$ROOT/tests/k8s/e2e-driver.yaml"
  --report-dir="$OUT")
if [ -n "${PILLAR_E2E_GINKGO:-}" ]; then
  # The ginkgo CLI (of the e2e.test's own ginkgo version) runs specs on several processes.
  PROCS=${PILLAR_E2E_PROCS:-4}
  echo "e2e: ginkgo --procs=$PROCS $E2E, focus '$FOCUS', skip '$SKIP', seed $SEED (log and JUnit report in $OUT)"
  "$PILLAR_E2E_GINKGO" --procs="$PROCS" "${SUITE[@]/--ginkgo./--}" "$E2E" -- "${DRIVER[@]}" \
    >"$OUT/e2e.log" 2>&1
else
  echo "e2e: $E2E, focus '$FOCUS', skip '$SKIP', seed $SEED (log and JUnit report in $OUT)"
  "$E2E" "${DRIVER[@]}" "${SUITE[@]}" >"$OUT/e2e.log" 2>&1
fi
rc=$?
# Ginkgo's own summary: "Ran N of M Specs ..." and "N Passed | N Failed | N Pending | N Skipped".
grep -E '^Ran [0-9]+ of [0-9]+ Specs|Passed \| [0-9]+ Failed' "$OUT/e2e.log" | tail -n 2
echo "failed specs:"
grep -E '^\s*\[FAIL\]' "$OUT/e2e.log" | sed 's/^/  /' | sort -u
[ "$rc" -eq 0 ] && exit 0
exit 1
