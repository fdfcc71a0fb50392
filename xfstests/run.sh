#!/usr/bin/env bash
# pillar's xfstests harness (host side):
#
#   XFSTESTS_DIR=/path/to/built/xfstests xfstests/run.sh [quick|long] [bookworm|sid|trixie]
#
# Runs a curated list of xfstests' generic tests on two pillar volumes (TEST_DEV and SCRATCH_DEV)
# attached over NVMe/TCP inside a kernel-lane VM, and compares the per-test results with
# xfstests/expected-<list>.txt. xfstests itself is third-party and not in this repository: the
# harness takes an existing build (see xfstests/README.md for how to make one).
#
# Without XFSTESTS_DIR, or when it is not a built xfstests tree (no ./check, no ltp/fsstress), it
# prints `skipped: no xfstests build` and exits 77 (EXIT_SKIP), never 0: a skip tests nothing and
# is not a pass. A caller that accepts a skip must test for exactly 77 (.ci/run does).
#
# 1. cargo test --workspace --no-run (the workspace test build also builds pillar-csi and
#    pillarctl, with the features the other scripts use: one build for all)
# 2. tests/kernel-lane/setup.sh when the kernel is not prepared yet
# 3. tests/kernel-lane/vm.sh KERNEL tests/kernel-lane/guest/xfstests.sh ... (the guest provisions,
#    attaches, runs ./check, detaches, deletes)
# 4. per-test table (expected, got, seconds); exit 1 when any result differs from the expected
#    file or the guest harness failed, 0 when every result matches
#
# Exit codes: 0 all results as expected; 77 skipped (no xfstests build, nothing ran); 1 a result
# differs or the harness failed; 2 usage.
#
# Env:
#   XFSTESTS_DIR        the built xfstests tree (required to run anything)
#   XFSTESTS_EXCLUDE    a file of tests to exclude (check -E)
#   XFSTESTS_PROFILE    cargo profile of pillar's binaries: dev (default) or release
#   XFSTESTS_SKIP_SETUP=1  never run setup.sh (the kernel must be prepared)
#   XFSTESTS_OUT        results folder (default $VM_SHARE/xfstests/<kernel>-<list>-<time>); must
#                       be inside VM_SHARE
#   VM_MEM (default 3072), VM_TIMEOUT (default 3600 quick, 21600 long), VM_SHARE, ... as for vm.sh
#   PILLAR_ENGINE       agent engine in the guest: io_uring (default) or sync
set -euo pipefail

HARNESS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck disable=SC2034 # read by log() in lib.sh
LOG_TAG=xfstests
# shellcheck source=SCRIPTDIR/../tests/kernel-lane/lib.sh
source "$HARNESS_DIR/../tests/kernel-lane/lib.sh"

usage() {
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
  exit 2
}

LIST=${1:-quick}
KERNEL=${2:-bookworm}
case $LIST in quick | long) ;; -h | --help) usage ;; *) echo "unknown list '$LIST' (quick or long)" >&2; usage ;; esac
LIST_FILE=$HARNESS_DIR/$LIST.list
[[ -f $LIST_FILE ]] || die "missing $LIST_FILE"

# ---------------------------------------------------------------- 0. is there an xfstests build?
# The exit code of a skip (automake's "skipped" convention): distinct from a pass and a failure.
EXIT_SKIP=77
skip() {
  echo "skipped: no xfstests build ($1)"
  echo "Nothing was tested: a skip is not a pass. Build xfstests from its public source and set"
  echo "XFSTESTS_DIR to the built tree (see xfstests/README.md)."
  echo "XFSTESTS: SKIPPED (exit code $EXIT_SKIP)"
  exit "$EXIT_SKIP"
}
[[ -n ${XFSTESTS_DIR:-} ]] || skip "XFSTESTS_DIR is not set"
[[ -d $XFSTESTS_DIR ]] || skip "XFSTESTS_DIR=$XFSTESTS_DIR is not a directory"
XFSTESTS_DIR=$(realpath "$XFSTESTS_DIR")
[[ -x $XFSTESTS_DIR/check ]] || skip "no executable $XFSTESTS_DIR/check"
[[ -x $XFSTESTS_DIR/ltp/fsstress ]] || skip "no $XFSTESTS_DIR/ltp/fsstress: the tree is not built (run make)"
if [[ -n ${XFSTESTS_EXCLUDE:-} ]]; then
  [[ -f $XFSTESTS_EXCLUDE ]] || die "XFSTESTS_EXCLUDE=$XFSTESTS_EXCLUDE is not a file"
  XFSTESTS_EXCLUDE=$(realpath "$XFSTESTS_EXCLUDE")
fi

T_START=$EPOCHREALTIME
secs_since() { local d=$((${EPOCHREALTIME/./} - ${1/./})); printf '%d.%d' $((d / 1000000)) $(((d / 100000) % 10)); }
cd "$PROJECT_DIR"

# ---------------------------------------------------------------- 1. pillar's binaries
PROFILE=${XFSTESTS_PROFILE:-dev}
t=$EPOCHREALTIME
log "cargo test --workspace --no-run (profile $PROFILE): pillar-local, pillarctl"
cargo test --locked --workspace --profile "$PROFILE" --no-run --quiet
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps --locked | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
case $PROFILE in dev | test) PROFILE_DIR=debug ;; release | bench) PROFILE_DIR=release ;; *) PROFILE_DIR=$PROFILE ;; esac
PILLAR_LOCAL=$TARGET_DIR/$PROFILE_DIR/pillar-local
PILLARCTL=$TARGET_DIR/$PROFILE_DIR/pillarctl
for b in "$PILLAR_LOCAL" "$PILLARCTL"; do [[ -x $b ]] || die "missing $b after the build"; done
T_BUILD=$(secs_since "$t")

# ---------------------------------------------------------------- 2. the kernel
t=$EPOCHREALTIME
if kver=$(resolve_kernel "$KERNEL") && [[ -f $(kernel_dir "$kver")/.ready ]]; then
  T_SETUP="not needed"
elif [[ ${XFSTESTS_SKIP_SETUP:-0} == 1 ]]; then
  die "kernel '$KERNEL' is not prepared and XFSTESTS_SKIP_SETUP=1"
else
  KERNEL_LANE_KERNELS=$KERNEL "$LANE_DIR/setup.sh"
  kver=$(resolve_kernel "$KERNEL") || die "setup.sh did not prepare '$KERNEL'"
  T_SETUP=$(secs_since "$t")s
fi

# ---------------------------------------------------------------- 3. the VM
export VM_MEM=${VM_MEM:-3072}
if [[ $LIST == quick ]]; then export VM_TIMEOUT=${VM_TIMEOUT:-3600}; else export VM_TIMEOUT=${VM_TIMEOUT:-21600}; fi
export VM_SHARE=${VM_SHARE:-$LANE_STATE/share}
mkdir -p "$VM_SHARE"
VM_SHARE=$(realpath "$VM_SHARE")
export VM_PASS_ENV="${VM_PASS_ENV:-} PILLAR_ENGINE"
OUT=${XFSTESTS_OUT:-$VM_SHARE/xfstests/$kver-$LIST-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
[[ $OUT == "$VM_SHARE"/* ]] || die "XFSTESTS_OUT=$OUT is not inside VM_SHARE=$VM_SHARE (the guest could not write it)"
CONSOLE=$OUT/console.log

log "xfstests $LIST list ($(sed -e 's/#.*//' "$LIST_FILE" | grep -c '[^[:space:]]') tests) on $KERNEL ($kver), xfstests at $XFSTESTS_DIR"
log "results: $OUT"
t=$EPOCHREALTIME
set +e
VM_LOG=$CONSOLE "$LANE_DIR/vm.sh" "$KERNEL" "$LANE_DIR/guest/xfstests.sh" \
  "$XFSTESTS_DIR" "$LIST_FILE" "$OUT" "$PILLAR_LOCAL" "$PILLARCTL" ${XFSTESTS_EXCLUDE:+"$XFSTESTS_EXCLUDE"}
vm_rc=$?
set -e
T_VM=$(secs_since "$t")

# ---------------------------------------------------------------- 4. compare
# The expected file of this kernel when there is one, else the list's.
EXPECTED=$HARNESS_DIR/expected-$LIST-$KERNEL.txt
[[ -f $EXPECTED ]] || EXPECTED=$HARNESS_DIR/expected-$LIST.txt
[[ -f $EXPECTED ]] || die "missing $EXPECTED"

declare -A WANT GOT SECS
mapfile -t TESTS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST_FILE" | grep -v '^$')
while read -r name result _; do
  WANT[$name]=$result
done < <(sed -e 's/#.*//' "$EXPECTED" | awk 'NF >= 2')
if [[ -f $OUT/summary.txt ]]; then
  while read -r name result; do GOT[$name]=$result; done <"$OUT/summary.txt"
fi
while read -r line; do
  name=$(sed -n 's/.*test=\([^ ]*\).*/\1/p' <<<"$line")
  SECS[$name]=$(sed -n 's/.*seconds=\([^ ]*\).*/\1/p' <<<"$line")
done < <(grep -a -o 'XFSTESTS-RESULT .*' "$CONSOLE" 2>/dev/null | tr -d '\r' || true)

echo
echo "== xfstests $LIST on $KERNEL ($kver), pillar volumes over NVMe/TCP"
printf '%-13s %-9s %-9s %8s\n' test expected got seconds
differ=0
declare -A COUNT=()
for name in "${TESTS[@]}"; do
  want=${WANT[$name]:-"(none)"}
  got=${GOT[$name]:-"(none)"}
  mark=
  if [[ $want != "$got" ]]; then
    mark="  <-- differs"
    differ=$((differ + 1))
  fi
  COUNT[$got]=$((${COUNT[$got]:-0} + 1))
  printf '%-13s %-9s %-9s %8s%s\n' "$name" "$want" "$got" "${SECS[$name]:--}" "$mark"
done
for name in "${!WANT[@]}"; do
  [[ " ${TESTS[*]} " == *" $name "* ]] || { echo "$name is in $(basename "$EXPECTED") but not in $LIST.list"; differ=$((differ + 1)); }
done
summary=$(grep -a -o 'XFSTESTS-SUMMARY .*' "$CONSOLE" 2>/dev/null | tr -d '\r' | tail -n 1 || true)
echo "${summary:-XFSTESTS-SUMMARY (none: the guest did not finish)}"
counts=
for k in pass fail notrun missing "(none)"; do [[ -n ${COUNT[$k]:-} ]] && counts+="$k ${COUNT[$k]}, "; done
echo "results: ${counts%, }; vm exit code $vm_rc"
echo "build ${T_BUILD}s, setup ${T_SETUP}, VM ${T_VM}s, total $(secs_since "$T_START")s"
echo "check output, results/, pillar log, dmesg: $OUT"
if [[ ! -f $OUT/summary.txt ]] || ((vm_rc >= 2)); then
  echo "XFSTESTS: HARNESS FAILED (vm exit code $vm_rc; see $CONSOLE)"
  exit 1
fi
if ((differ)); then
  echo "XFSTESTS: $differ result(s) differ from $(basename "$EXPECTED")"
  exit 1
fi
echo "XFSTESTS: results match $(basename "$EXPECTED")"
