#!/usr/bin/env bash
# pillar's real-kernel lane, the one command:
#
#   tests/kernel-lane/run.sh [LIBTEST FILTER...]
#
# 1. setup.sh: host packages, the Debian kernels (downloaded and unpacked, never installed)
# 2. cargo: pillar-agent, pillar-csi and the test binary of csi/tests/kernel_lane/
# 3. for each kernel (bookworm's 6.1, then sid's newest): boot it under qemu and run the
#    scenarios there (guest/pillar.sh), against the real nvmet target and NVMe/TCP host
# 4. a table of per-scenario times and results; exit code 0 only when every scenario passed on
#    every kernel
#
# Arguments are passed to the test binary (libtest), e.g. `run.sh s3_` runs scenario 3 only.
#
# Env:
#   KERNEL_LANE_KERNELS   kernel labels to run (default "bookworm sid")
#   KERNEL_LANE_PROFILE   cargo profile: dev (default) or release
#   KERNEL_LANE_SKIP_SETUP=1  do not run setup.sh (the kernels must be prepared)
#   PILLAR_LANE_ENGINE    agent engine in the guest: io_uring (default) or sync
#   VM_MEM, VM_TIMEOUT, ... as for vm.sh (defaults here: VM_MEM 1024, VM_TIMEOUT 600)
set -euo pipefail

# shellcheck disable=SC2034 # read by log() in lib.sh
LOG_TAG=lane
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

read -r -a KERNELS <<<"${KERNEL_LANE_KERNELS:-bookworm sid}"
PROFILE=${KERNEL_LANE_PROFILE:-dev}
export VM_MEM=${VM_MEM:-1024}
export VM_TIMEOUT=${VM_TIMEOUT:-600}
export VM_PASS_ENV="${VM_PASS_ENV:-} PILLAR_LANE_ENGINE PILLAR_LANE_RUST_LOG"

T_START=$EPOCHREALTIME
secs_since() { local d=$((${EPOCHREALTIME/./} - ${1/./})); printf '%d.%d' $((d / 1000000)) $(((d / 100000) % 10)); }

cd "$PROJECT_DIR"

# ---------------------------------------------------------------- 1. kernels
if [[ ${KERNEL_LANE_SKIP_SETUP:-0} != 1 ]]; then
  t=$EPOCHREALTIME
  KERNEL_LANE_KERNELS="${KERNELS[*]}" "$LANE_DIR/setup.sh"
  T_SETUP=$(secs_since "$t")
else
  T_SETUP=skipped
fi

# ---------------------------------------------------------------- 2. binaries
t=$EPOCHREALTIME
# The same command as the workspace test build (scripts/test.sh), so after the tests everything
# is already built: the test builds also build pillar-agent and pillar-csi, with the same
# features (a `-p` build would resolve features differently and rebuild the dependencies).
log "cargo test --workspace --no-run (profile $PROFILE): the kernel_lane test, pillar-agent, pillar-csi"
cargo test --locked --workspace --profile "$PROFILE" --no-run
TEST_BIN=$(cargo test --locked --workspace --profile "$PROFILE" --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "kernel_lane" and m.get("executable"):
        print(m["executable"])' | tail -n 1)
[[ -n $TEST_BIN && -x $TEST_BIN ]] || die "cannot find the kernel_lane test binary"
BIN_DIR=$(dirname "$(dirname "$TEST_BIN")")
export PILLAR_AGENT_BIN=$BIN_DIR/pillar-agent PILLAR_CSI_BIN=$BIN_DIR/pillar-csi
VM_PASS_ENV="$VM_PASS_ENV PILLAR_AGENT_BIN PILLAR_CSI_BIN"
for b in "$PILLAR_AGENT_BIN" "$PILLAR_CSI_BIN"; do [[ -x $b ]] || die "missing $b"; done
T_BUILD=$(secs_since "$t")
log "test binary: $TEST_BIN"

# ---------------------------------------------------------------- 3. kernels
declare -A RC VM_TIME LOGS
failed=0
for k in "${KERNELS[@]}"; do
  log "=== kernel $k"
  logfile=$LANE_STATE/logs/pillar-$k-$(date +%Y%m%d-%H%M%S).log
  LOGS[$k]=$logfile
  t=$EPOCHREALTIME
  set +e
  VM_LOG=$logfile "$LANE_DIR/vm.sh" "$k" "$LANE_DIR/guest/pillar.sh" "$TEST_BIN" "$@"
  rc=$?
  set -e
  RC[$k]=$rc
  VM_TIME[$k]=$(secs_since "$t")
  ((rc == 0)) || failed=1
done

# ---------------------------------------------------------------- 4. summary
echo
echo "== kernel lane summary"
printf '%-10s %-24s %-44s %-6s %9s\n' kernel version scenario result seconds
for k in "${KERNELS[@]}"; do
  kver=$(resolve_kernel "$k" || echo "?")
  found=0
  while read -r line; do
    found=1
    scen=$(sed -n 's/.*scenario=\([^ ]*\).*/\1/p' <<<"$line")
    res=$(sed -n 's/.*result=\([^ ]*\).*/\1/p' <<<"$line")
    sec=$(sed -n 's/.*seconds=\([^ ]*\).*/\1/p' <<<"$line")
    printf '%-10s %-24s %-44s %-6s %9s\n' "$k" "$kver" "$scen" "$res" "$sec"
  done < <(grep -a -o 'KERNEL-LANE-RESULT .*' "${LOGS[$k]}" | tr -d '\r' || true)
  ((found)) || printf '%-10s %-24s %-44s %-6s %9s\n' "$k" "$kver" "(no scenario result)" "-" "-"
  skips=$(grep -a -c '^SKIP:' "${LOGS[$k]}" || true)
  if ((skips > 0)); then
    echo "$k: $skips scenario(s) printed SKIP inside the VM: that is a failure of the lane"
    failed=1
  fi
  printf '%-10s %-24s %-44s %-6s %9s\n' "$k" "$kver" "(whole VM: boot, modules, scenarios)" "rc=${RC[$k]}" "${VM_TIME[$k]}"
done
echo "setup ${T_SETUP}s, build ${T_BUILD}s, total $(secs_since "$T_START")s"
for k in "${KERNELS[@]}"; do echo "console log $k: ${LOGS[$k]}"; done
if ((failed)); then
  echo "KERNEL LANE: FAILED"
  exit 1
fi
echo "KERNEL LANE: PASSED"
