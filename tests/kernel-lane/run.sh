#!/usr/bin/env bash
# pillar's real-kernel lane, the one command:
#
#   tests/kernel-lane/run.sh [LIBTEST FILTER...]
#
# 1. setup.sh: host packages, the Debian kernels (downloaded and unpacked, never installed)
# 2. cargo: pillar-agent, pillar-csi and the test binary of csi/tests/kernel_lane/; the scenarios
#    the filter selects are listed on the host (`--list`, nothing runs there)
# 3. for each kernel (bookworm's 6.1, then sid's newest): boot it under qemu and run the
#    scenarios there (guest/pillar.sh), against the real nvmet target and NVMe/TCP host
# 4. a table of per-scenario times and results; exit code 0 only when, on every kernel, every
#    listed scenario printed exactly one result line and it is PASS, no other scenario reported,
#    nothing printed `SKIP:` and the VM's exit code is 0. A VM whose kernel dies before the
#    guest script starts is booted once more (its log kept as *.boot-failure).
#
# Arguments are passed to the test binary (libtest), e.g. `run.sh s3_` runs scenario 3 only.
# A filter that selects no scenario, or an empty kernel list, is a failure (nothing would be
# tested).
#
# Env:
#   KERNEL_LANE_KERNELS   kernel labels to run (default "bookworm sid"; set but empty: failure)
#   KERNEL_LANE_PROFILE   cargo profile: dev (default) or release
#   KERNEL_LANE_SKIP_SETUP=1  do not run setup.sh (the kernels must be prepared)
#   KERNEL_LANE_GUEST_SCRIPT  guest script (default guest/pillar.sh); only to check the lane's
#                         own verdict (a script that reports no scenario must fail the lane)
#   PILLAR_LANE_ENGINE    agent engine in the guest: io_uring (default) or sync
#   PILLAR_LANE_ATTACH_VOLUMES  volumes of the attach-path benchmark (b1_; default 50)
# The ZFS scenario (s13) runs on the kernels setup.sh built a ZFS module for; on a kernel the
# ZFS release does not support it is left out and the summary says so (NOT-RUN, with why).
# Controls of the harness itself (ONCE_SCENARIOS below: a deliberately broken build must be
# caught; the kernel plays no part in the verdict) run on the last kernel listed only; the
# others list them as NOT-RUN, with where they ran.
#   VM_MEM, VM_TIMEOUT, ... as for vm.sh (defaults here: VM_MEM 1024, VM_TIMEOUT 1200: fourteen
#   scenarios take 450-560 s per kernel under TCG on a busy two-core machine)
set -euo pipefail

# shellcheck disable=SC2034 # read by log() in lib.sh
LOG_TAG=lane
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# `-`, not `:-`: a list set but empty is an error, not the default.
read -r -a KERNELS <<<"${KERNEL_LANE_KERNELS-bookworm sid}"
((${#KERNELS[@]} > 0)) || die "KERNEL_LANE_KERNELS is empty: no kernel to run the scenarios on (KERNEL LANE: FAILED)"
declare -A SEEN_KERNEL=()
for k in "${KERNELS[@]}"; do
  [[ -z ${SEEN_KERNEL[$k]:-} ]] || die "kernel $k is listed twice in KERNEL_LANE_KERNELS (KERNEL LANE: FAILED)"
  SEEN_KERNEL[$k]=1
done
GUEST_SCRIPT=${KERNEL_LANE_GUEST_SCRIPT:-$LANE_DIR/guest/pillar.sh}
PROFILE=${KERNEL_LANE_PROFILE:-dev}
export VM_MEM=${VM_MEM:-1024}
export VM_TIMEOUT=${VM_TIMEOUT:-1200}
export VM_PASS_ENV="${VM_PASS_ENV:-} PILLAR_LANE_ENGINE PILLAR_LANE_RUST_LOG PILLAR_LANE_ATTACH_VOLUMES"

# Benchmarks (`b*` scenarios: the attach path) measure and print, they test nothing new, and
# cost minutes under TCG: a run without a filter leaves them out and says so; `run.sh b1_` runs
# one.
BENCH_NOTE=
if (($# == 0)); then
  set -- --skip b1_
  BENCH_NOTE="benchmarks not run (b1_attach_path: tests/kernel-lane/run.sh b1_)"
fi

T_START=$EPOCHREALTIME
# The console lines of one scenario (from its "=== scenario" line to its result line): around
# its first panic (25 lines before, 10 after), or its last 40 lines when it did not panic.
scenario_excerpt() {
  local block
  block=$(tr -d '\r' <"$1" | awk -v s="$2" '
    index($0, "=== scenario " s " on kernel") { on = 1 }
    on { print }
    on && index($0, "KERNEL-LANE-RESULT scenario=" s " ") { exit }')
  if [[ -z $block ]]; then
    echo "(it printed nothing: it never started; the console's last lines:)"
    tr -d '\r' <"$1" | tail -n 20
  elif grep -q 'panicked at' <<<"$block"; then
    grep -m1 -B25 -A10 'panicked at' <<<"$block" | head -n 80
  else
    tail -n 40 <<<"$block"
  fi
}
secs_since() { local d=$((${EPOCHREALTIME/./} - ${1/./})); printf '%d.%d' $((d / 1000000)) $(((d / 100000) % 10)); }

cd "$PROJECT_DIR"

# ---------------------------------------------------------------- 1. kernels
if [[ ${KERNEL_LANE_SKIP_SETUP:-0} != 1 ]]; then
  t=$EPOCHREALTIME
  KERNEL_LANE_KERNELS="${KERNELS[*]}" "$LANE_DIR/setup.sh"
  T_SETUP=$(secs_since "$t")s
else
  T_SETUP=skipped
fi

# ---------------------------------------------------------------- 2. binaries
t=$EPOCHREALTIME
# The same command as the workspace test build (scripts/test.sh), so after the tests everything
# is already built: the test builds also build pillar-agent and pillar-csi, with the same
# features (a `-p` build would resolve features differently and rebuild the dependencies).
log "cargo test --workspace --no-run (profile $PROFILE): the kernel_lane test, pillar-agent, pillar-csi"
BUILD_JSON=$(mktemp)
mkdir -p "$LANE_STATE"
RUN_BINS=$(mktemp -d "$LANE_STATE/bin.XXXXXX")
trap 'rm -rf "$RUN_BINS" "$BUILD_JSON"' EXIT
cargo test --locked --workspace --profile "$PROFILE" --no-run --message-format=json-render-diagnostics >"$BUILD_JSON"
# The VMs run copies of the binaries this build reported, taken right after it: nothing that
# later rebuilds the target directory can change what a running VM executes.
python3 - "$BUILD_JSON" "$RUN_BINS" <<'PY' || die "the build did not report the pillar-agent, pillar-csi and kernel_lane binaries"
import json, shutil, sys

build, out = sys.argv[1:3]
paths = {}
for line in open(build):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    name, test = m["target"]["name"], m["profile"]["test"]
    if name == "kernel_lane" and test:
        paths[name] = m["executable"]
    elif name in ("pillar-agent", "pillar-csi") and "bin" in m["target"]["kind"] and not test:
        paths[name] = m["executable"]
missing = [n for n in ("kernel_lane", "pillar-agent", "pillar-csi") if n not in paths]
for n in missing:
    print(f"run.sh: the build reported no {n} binary", file=sys.stderr)
for name, path in paths.items():
    shutil.copy2(path, f"{out}/{name}")
sys.exit(1 if missing else 0)
PY
TEST_BIN=$RUN_BINS/kernel_lane
export PILLAR_AGENT_BIN=$RUN_BINS/pillar-agent PILLAR_CSI_BIN=$RUN_BINS/pillar-csi
VM_PASS_ENV="$VM_PASS_ENV PILLAR_AGENT_BIN PILLAR_CSI_BIN"
T_BUILD=$(secs_since "$t")
log "test binary: $TEST_BIN (copies of the build's binaries in $RUN_BINS)"

# The scenarios this run must report, as the guest's libtest selects them: the same binary and
# arguments, listed on the host (listing runs no test). The result line names a scenario by its
# function name, the last part of the libtest path.
listing=$("$TEST_BIN" --list --include-ignored "$@") || die "cannot list the scenarios (libtest arguments: $*)"
mapfile -t EXPECTED < <(sed -n 's/^\(.*\): test$/\1/p' <<<"$listing" | sed 's/.*:://' | sort -u)
((${#EXPECTED[@]} > 0)) || die "no scenario matches the libtest arguments '$*': nothing would be tested (KERNEL LANE: FAILED)"
log "scenarios to run on each of ${KERNELS[*]}: ${EXPECTED[*]}"

# ---------------------------------------------------------------- 3. kernels
# NOT_RUN["kernel/scenario"]: why a listed scenario is left out on that kernel.
declare -A RC VM_TIME LOGS NOT_RUN
# s14's control drops the agent's file fsync and checks that the replay finds the lost mark:
# what it proves is that the replay can fail, which the file system and the harness decide, not
# the NVMe target. One kernel is enough; it costs ~2 minutes per kernel under TCG.
ONCE_SCENARIOS=(s14_control_skipped_fsync_caught)
LAST_KERNEL=${KERNELS[${#KERNELS[@]} - 1]}
VM_PASS_ENV="$VM_PASS_ENV PILLAR_LANE_ZFS_USERLAND PILLAR_LANE_TLSHD"
for k in "${KERNELS[@]}"; do
  log "=== kernel $k"
  logfile=$LANE_STATE/logs/pillar-$k-$(date +%Y%m%d-%H%M%S).log
  LOGS[$k]=$logfile
  # ZFS (s13): run where setup.sh built the module; left out, with setup's reason, where the
  # ZFS release does not support the kernel; with neither, s13 runs and fails (nothing to test).
  kdir=$(kernel_dir "$(resolve_kernel "$k" || echo none)")
  extra=()
  # tlshd (s16): the kernel's own suite's, unpacked by setup.sh; without it s16 fails on a
  # kernel with TLS.
  unset PILLAR_LANE_TLSHD
  if [[ -f $LANE_STATE/tlshd-$k.ready ]]; then
    export PILLAR_LANE_TLSHD
    PILLAR_LANE_TLSHD=$(cat "$LANE_STATE/tlshd-$k.ready")/tlshd
  fi
  unset PILLAR_LANE_ZFS_USERLAND
  if [[ -f $kdir/zfs.ready ]]; then
    export PILLAR_LANE_ZFS_USERLAND=$ZFS_DIR/userland-$(cat "$kdir/zfs.ready")
  elif [[ -f $kdir/zfs.unsupported && " ${EXPECTED[*]} " == *" s13_zfs "* ]]; then
    NOT_RUN[$k/s13_zfs]=$(cat "$kdir/zfs.unsupported")
    extra=(--skip s13_zfs)
    log "$k: s13_zfs left out: ${NOT_RUN[$k/s13_zfs]}"
  fi
  if [[ $k != "$LAST_KERNEL" ]]; then
    for scen in "${ONCE_SCENARIOS[@]}"; do
      [[ " ${EXPECTED[*]} " == *" $scen "* ]] || continue
      NOT_RUN[$k/$scen]="a control of the harness: runs once, on $LAST_KERNEL"
      extra+=(--skip "$scen")
      log "$k: $scen left out: ${NOT_RUN[$k/$scen]}"
    done
  fi
  t=$EPOCHREALTIME
  set +e
  VM_LOG=$logfile "$LANE_DIR/vm.sh" "$k" "$GUEST_SCRIPT" "$TEST_BIN" "$@" "${extra[@]}"
  rc=$?
  # A guest kernel that dies while booting, before the guest script starts, tested nothing: boot
  # it once more (seen once: sid's 7.2 oopsed at 1 s, int3 in the scheduler under TCG). Anything
  # after the guest script started counts as it is.
  if ((rc != 0)) && ! grep -aq '\[init\] guest script starting' "$logfile"; then
    log "$k: the VM ended before the guest script started (rc=$rc; $(grep -a -m1 -E 'Oops|panic' "$logfile" | tr -d '\r' || echo 'no oops line')); booting it once more"
    mv "$logfile" "$logfile.boot-failure"
    VM_LOG=$logfile "$LANE_DIR/vm.sh" "$k" "$GUEST_SCRIPT" "$TEST_BIN" "$@" "${extra[@]}"
    rc=$?
  fi
  set -e
  RC[$k]=$rc
  VM_TIME[$k]=$(secs_since "$t")
done

# ---------------------------------------------------------------- 4. summary
# Per kernel: every listed scenario has exactly one result line and it says PASS; no result line
# for a scenario that was not listed; no `SKIP:` anywhere in the console (libtest prints
# `test NAME ... ` without a newline before the scenario's own output, so a skip is mid-line);
# the VM's exit code is 0.
echo
echo "== kernel lane summary"
printf '%-10s %-24s %-44s %-8s %9s\n' kernel version scenario result seconds
problems=()
FAILED_SCENARIOS=()
for k in "${KERNELS[@]}"; do
  kver=$(resolve_kernel "$k" || echo "?")
  declare -A COUNT=() RES=() SEC=()
  while read -r line; do
    [[ -n $line ]] || continue
    scen=$(sed -n 's/.*scenario=\([^ ]*\).*/\1/p' <<<"$line")
    COUNT[$scen]=$((${COUNT[$scen]:-0} + 1))
    RES[$scen]=$(sed -n 's/.*result=\([^ ]*\).*/\1/p' <<<"$line")
    SEC[$scen]=$(sed -n 's/.*seconds=\([^ ]*\).*/\1/p' <<<"$line")
  done < <(grep -a -o 'KERNEL-LANE-RESULT .*' "${LOGS[$k]}" | tr -d '\r' || true)
  for scen in "${EXPECTED[@]}"; do
    n=${COUNT[$scen]:-0}
    if [[ -n ${NOT_RUN[$k/$scen]:-} ]]; then
      printf '%-10s %-24s %-44s %-8s %9s\n' "$k" "$kver" "$scen" "NOT-RUN" "-"
      echo "           ($scen on $k: ${NOT_RUN[$k/$scen]})"
      ((n == 0)) || problems+=("$k: $scen was left out but reported a result")
      continue
    fi
    if ((n == 0)); then
      printf '%-10s %-24s %-44s %-8s %9s\n' "$k" "$kver" "$scen" "MISSING" "-"
      problems+=("$k: $scen printed no result line")
      FAILED_SCENARIOS+=("$k $scen")
      continue
    fi
    printf '%-10s %-24s %-44s %-8s %9s\n' "$k" "$kver" "$scen" "${RES[$scen]}" "${SEC[$scen]}"
    ((n == 1)) || problems+=("$k: $scen printed $n result lines")
    [[ ${RES[$scen]} == PASS ]] || {
      problems+=("$k: $scen result ${RES[$scen]}")
      FAILED_SCENARIOS+=("$k $scen")
    }
  done
  for scen in "${!COUNT[@]}"; do
    [[ " ${EXPECTED[*]} " == *" $scen "* ]] || problems+=("$k: $scen reported a result but was not listed")
  done
  skips=$(grep -a -c 'SKIP:' "${LOGS[$k]}" || true)
  ((skips == 0)) || problems+=("$k: $skips line(s) with SKIP: in the console: a skipped scenario tested nothing")
  [[ ${RC[$k]} == 0 ]] || problems+=("$k: VM exit code ${RC[$k]}")
  printf '%-10s %-24s %-44s %-8s %9s\n' "$k" "$kver" "(whole VM: boot, modules, scenarios)" "rc=${RC[$k]}" "${VM_TIME[$k]}"
  unset COUNT RES SEC
done
echo "setup ${T_SETUP}, build ${T_BUILD}s, total $(secs_since "$T_START")s"
[[ -z $BENCH_NOTE ]] || echo "$BENCH_NOTE"
for k in "${KERNELS[@]}"; do echo "console log $k: ${LOGS[$k]}"; done
# CI keeps only the tail of its output, and the console logs stay on the machine that ran it:
# a failed scenario's panic and the steps before it are repeated here, at the end.
for failed in "${FAILED_SCENARIOS[@]}"; do
  read -r k scen <<<"$failed"
  echo
  echo "== why $scen failed on $k (from its console log)"
  scenario_excerpt "${LOGS[$k]}" "$scen"
done
if ((${#problems[@]} > 0)); then
  printf '  %s\n' "${problems[@]}"
  echo "KERNEL LANE: FAILED"
  exit 1
fi
echo "KERNEL LANE: PASSED (${#EXPECTED[@]} scenario(s) x ${#KERNELS[@]} kernel(s))"
