#!/usr/bin/env bash
# Guest side of pillar's xfstests harness (runs as root INSIDE the VM; see ../../../xfstests/run.sh).
#
#   tests/kernel-lane/vm.sh bookworm tests/kernel-lane/guest/xfstests.sh \
#       XFSTESTS_DIR LIST_FILE OUT_DIR PILLAR_CSI_BIN PILLARCTL_BIN [EXCLUDE_FILE]
#
# 1. modules (configfs nvmet nvmet-tcp nvme-tcp loop ext4 xfs), configfs, lo, /etc/nvme identity,
#    the users some tests want (fsgqa, fsgqa2, 123456-fsgqa), all in the guest's RAM overlay
# 2. `pillar-local --dir $XFS_PILLAR_DIR` (agent + controller + node plugin) on a tmpfs of its
#    own, so the volumes' backing files are sparse files in guest RAM
# 3. through pillarctl: two block volumes created (CreateVolume), attached (ControllerPublish,
#    NodeStage, NodePublish) over NVMe/TCP on 127.0.0.1; their /dev/nvmeXnY found by subsystem NQN
#    and checked to be NVMe/TCP namespaces (transport tcp, address 127.0.0.1)
# 4. xfstests' config (FSTYP, TEST_DEV, TEST_DIR, SCRATCH_DEV, SCRATCH_MNT, RESULT_BASE) written to
#    a local.config of this run (HOST_OPTIONS; the build tree is never written), TEST_DEV mkfs'ed,
#    `./check [-E EXCLUDE_FILE] <tests of LIST_FILE>` run from XFSTESTS_DIR
# 5. check's output, its results/ directory and the kernel log copied to OUT_DIR (on the share)
# 6. volumes detached and deleted through pillar, pillar stopped, nvmet state checked empty
# 7. one line per test, `XFSTESTS-RESULT test=generic/001 result=pass|fail|notrun|missing
#    seconds=N`, then `XFSTESTS-SUMMARY ...`; OUT_DIR/summary.txt holds `generic/NNN result` lines
#
# Exit code: 0 when check ran and no test failed, 1 when a test failed or was not reported,
# 2 when the harness itself could not run (modules, pillar, volumes, devices).
#
# Env: FSTYP (ext4), XFS_VOLUME_SIZE (bytes, default 1 GiB each), XFS_PILLAR_DIR (/tmp/pillar),
#      XFS_PILLAR_TMPFS_SIZE (tmpfs size for pillar's pool, default 75%), RUST_LOG (info),
#      PILLAR_ENGINE (io_uring; or sync).
set -uo pipefail

XFSTESTS_DIR=${1:?usage: xfstests.sh XFSTESTS_DIR LIST_FILE OUT_DIR PILLAR_LOCAL_BIN PILLARCTL_BIN [EXCLUDE_FILE]}
LIST_FILE=${2:?list file}
OUT_DIR=${3:?output directory}
PILLAR_LOCAL=${4:?pillar-local binary}
PILLARCTL=${5:?pillarctl binary}
EXCLUDE_FILE=${6:-}

FSTYP=${FSTYP:-ext4}
SIZE=${XFS_VOLUME_SIZE:-$((1 << 30))}
PDIR=${XFS_PILLAR_DIR:-/tmp/pillar}
WORK=/tmp/xfstests-run
ENGINE=${PILLAR_ENGINE:-io_uring}
VOLUMES=(xfs-test xfs-scratch)

say() { echo "[xfstests.sh +$(cut -d' ' -f1 /proc/uptime)s] $*"; }
fatal() { say "HARNESS ERROR: $*"; cleanup; say "XFSTESTS-SUMMARY status=harness-error"; exit 2; }

for f in "$PILLAR_LOCAL" "$PILLARCTL"; do [[ -x $f ]] || { say "missing binary $f"; exit 2; }; done
[[ -x $XFSTESTS_DIR/check && -x $XFSTESTS_DIR/ltp/fsstress ]] || { say "$XFSTESTS_DIR is not a built xfstests tree"; exit 2; }
[[ -f $LIST_FILE ]] || { say "no list file $LIST_FILE"; exit 2; }
mkdir -p "$OUT_DIR" || exit 2

# The tests of the list: one per line, '#' starts a comment.
mapfile -t TESTS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST_FILE" | grep -v '^$')
((${#TESTS[@]} > 0)) || { say "the list $LIST_FILE is empty"; exit 2; }

PILLAR_PID=
declare -A CREATED=() ATTACHED=()
ctl() { "$PILLARCTL" --controller "$PDIR/controller.sock" --node "$PDIR/node.sock" "$@"; }

# Idempotent teardown: unmount what xfstests left, detach and delete both volumes, stop pillar.
CLEANED=0
cleanup() {
  ((CLEANED)) && return 0
  CLEANED=1
  local v
  for m in "$WORK/test" "$WORK/scratch"; do
    mountpoint -q "$m" 2>/dev/null && { umount "$m" || umount -l "$m"; }
  done
  if [[ -n $PILLAR_PID ]] && kill -0 "$PILLAR_PID" 2>/dev/null; then
    for v in "${VOLUMES[@]}"; do
      if [[ -n ${ATTACHED[$v]:-} ]]; then
        if ctl detach "$v" --staging "$PDIR/stage/$v" --target "$PDIR/publish/$v" >>"$OUT_DIR/pillarctl.log" 2>&1; then
          say "volume $v detached (NodeUnpublish, NodeUnstage, ControllerUnpublish)"
        else
          say "detach $v failed (see pillarctl.log)"
        fi
      fi
      if [[ -n ${CREATED[$v]:-} ]]; then
        if ctl delete "$v" >>"$OUT_DIR/pillarctl.log" 2>&1; then
          say "volume $v deleted"
        else
          say "delete $v failed (see pillarctl.log)"
        fi
      fi
    done
    kill -TERM "$PILLAR_PID" 2>/dev/null
    for _ in $(seq 1 100); do kill -0 "$PILLAR_PID" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$PILLAR_PID" 2>/dev/null && { say "pillar-csi did not stop on SIGTERM; killing it"; kill -KILL "$PILLAR_PID"; }
    wait "$PILLAR_PID" 2>/dev/null
    PILLAR_PID=
  fi
  local left
  left=$(find /sys/kernel/config/nvmet/subsystems -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
  say "after teardown: nvmet subsystems left: $left, nvmet ports left: $(find /sys/kernel/config/nvmet/ports -mindepth 1 -maxdepth 1 2>/dev/null | wc -l), NVMe controllers left: $(find /sys/class/nvme -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)"
  cp "$PDIR/pillar.log" "$OUT_DIR/pillar.log" 2>/dev/null
  dmesg >"$OUT_DIR/dmesg.txt" 2>/dev/null
}

T0=$(cut -d' ' -f1 /proc/uptime)

# ---------------------------------------------------------------- 1. kernel and guest setup
modprobe -a configfs nvmet nvmet-tcp nvme-tcp nvme-fabrics loop ext4 xfs || fatal "modprobe failed"
mountpoint -q /sys/kernel/config || mount -t configfs configfs /sys/kernel/config || fatal "mount configfs failed"
[[ -d /sys/kernel/config/nvmet ]] || fatal "no /sys/kernel/config/nvmet"
[[ -c /dev/nvme-fabrics ]] || fatal "no /dev/nvme-fabrics"
ip link set lo up
say "kernel $(uname -r); modules loaded, nvme_core multipath=$(cat /sys/module/nvme_core/parameters/multipath 2>/dev/null)"

# Debian's host identity files (pillar's local node keeps its own in $PDIR/node/hostid).
mkdir -p /etc/nvme
if [[ ! -s /etc/nvme/hostid ]]; then
  cat /proc/sys/kernel/random/uuid >/etc/nvme/hostid
fi
[[ -s /etc/nvme/hostnqn ]] || printf 'nqn.2014-08.org.nvmexpress:uuid:%s\n' "$(cat /etc/nvme/hostid)" >/etc/nvme/hostnqn

# Users some tests need (otherwise [not run]); only in the guest's RAM overlay of /etc.
getent group fsgqa >/dev/null || groupadd fsgqa
getent passwd fsgqa >/dev/null || useradd -M -g fsgqa fsgqa
getent passwd fsgqa2 >/dev/null || useradd -M fsgqa2
getent passwd 123456-fsgqa >/dev/null || useradd -M 123456-fsgqa

# pillar's directory on a tmpfs of its own, not the overlay on /: on 6.1 a loop device over an
# overlayfs file accepts direct I/O and then fails every read (see guest/pillar.sh).
mkdir -p "$PDIR"
mountpoint -q "$PDIR" || mount -t tmpfs -o "size=${XFS_PILLAR_TMPFS_SIZE:-75%},mode=0755" pillar-xfstests "$PDIR" ||
  fatal "mount tmpfs on $PDIR failed"
mkdir -p "$PDIR/stage" "$PDIR/publish" "$WORK/test" "$WORK/scratch" "$WORK/results"

# ---------------------------------------------------------------- 2. pillar
RUST_LOG=${RUST_LOG:-info} "$PILLAR_LOCAL" --dir "$PDIR" --engine "$ENGINE" >"$PDIR/pillar.log" 2>&1 &
PILLAR_PID=$!
for _ in $(seq 1 600); do
  grep -q '^  node: ' "$PDIR/pillar.log" 2>/dev/null && break
  kill -0 "$PILLAR_PID" 2>/dev/null || { cat "$PDIR/pillar.log"; PILLAR_PID=; fatal "pillar-local exited"; }
  sleep 0.1
done
grep -q '^  node: ' "$PDIR/pillar.log" || { tail -n 20 "$PDIR/pillar.log"; fatal "pillar-local did not come up in 60 s"; }
grep -q 'target: *Linux kernel nvmet' "$PDIR/pillar.log" ||
  { grep -i 'target' "$PDIR/pillar.log"; fatal "pillar-local is not on the kernel target (test double?)"; }
say "pillar-local up (pid $PILLAR_PID, engine $ENGINE): $(grep -o 'target: .*' "$PDIR/pillar.log" | head -n 1)"

# ---------------------------------------------------------------- 3. volumes
declare -A DEV
for v in "${VOLUMES[@]}"; do
  out=$(ctl create "$v" --size "$SIZE" --block 2>&1) || { echo "$out"; fatal "create $v failed"; }
  echo "$out" >>"$OUT_DIR/pillarctl.log"
  CREATED[$v]=1
  mkdir -p "$PDIR/stage/$v" # kubelet creates the staging directory; NodePublish creates the target file
  ATTACHED[$v]=1
  out=$(ctl attach "$v" --staging "$PDIR/stage/$v" --target "$PDIR/publish/$v" --block 2>&1) ||
    { echo "$out"; fatal "attach $v failed"; }
  echo "$out" >>"$OUT_DIR/pillarctl.log"
  out=$(ctl device "$v" 2>&1) || { echo "$out"; fatal "device $v failed"; }
  echo "$out" >>"$OUT_DIR/pillarctl.log"
  dev=$(jq -r '.devices[0] // empty' <<<"$out")
  nqn=$(jq -r '.nqn' <<<"$out")
  [[ -n $dev && -b $dev ]] || fatal "volume $v: no block device ($out)"
  # It must be an NVMe/TCP namespace: every controller of its subsystem is transport tcp to 127.0.0.1.
  nctrl=0
  for c in /sys/class/nvme/nvme*; do
    [[ $(cat "$c/subsysnqn" 2>/dev/null) == "$nqn" ]] || continue
    nctrl=$((nctrl + 1))
    tr=$(cat "$c/transport")
    addr=$(cat "$c/address" 2>/dev/null)
    [[ $tr == tcp && $addr == *traddr=127.0.0.1* ]] || fatal "volume $v: controller $(basename "$c") is '$tr' '$addr', not NVMe/TCP on 127.0.0.1"
    say "volume $v: $dev, controller $(basename "$c") transport=$tr $addr state=$(cat "$c/state")"
  done
  ((nctrl > 0)) || fatal "volume $v: no NVMe controller for $nqn"
  # The published target must be the same device (NodePublish bind of the device node).
  [[ $(stat -L -c '%t:%T' "$PDIR/publish/$v") == $(stat -L -c '%t:%T' "$dev") ]] ||
    fatal "volume $v: published $PDIR/publish/$v is not $dev"
  DEV[$v]=$dev
  say "volume $v: $(($(blockdev --getsize64 "$dev") >> 20)) MiB, nqn $nqn"
done
TEST_DEV=${DEV[xfs-test]}
SCRATCH_DEV=${DEV[xfs-scratch]}

# ---------------------------------------------------------------- 4. xfstests
CONFIG=$WORK/local.config
cat >"$CONFIG" <<EOF
# written by tests/kernel-lane/guest/xfstests.sh: pillar volumes over NVMe/TCP
export FSTYP=$FSTYP
export TEST_DEV=$TEST_DEV
export TEST_DIR=$WORK/test
export SCRATCH_DEV=$SCRATCH_DEV
export SCRATCH_MNT=$WORK/scratch
export RESULT_BASE=$WORK/results
EOF
cp "$CONFIG" "$OUT_DIR/local.config"
say "local.config: $(grep -v '^#' "$CONFIG" | sed 's/^export //' | tr '\n' ' ')"

case $FSTYP in
  ext4) mkfs.ext4 -q -F "$TEST_DEV" ;;
  xfs) mkfs.xfs -q -f "$TEST_DEV" ;;
  *) "mkfs.$FSTYP" "$TEST_DEV" ;;
esac || fatal "mkfs.$FSTYP $TEST_DEV failed"

check_args=()
[[ -n $EXCLUDE_FILE ]] && check_args+=(-E "$EXCLUDE_FILE")
say "running: ./check ${check_args[*]} ${TESTS[*]}"
T_CHECK=$(cut -d' ' -f1 /proc/uptime)
(cd "$XFSTESTS_DIR" && HOST_OPTIONS=$CONFIG ./check "${check_args[@]}" "${TESTS[@]}") 2>&1 | tee "$OUT_DIR/check.out"
check_rc=${PIPESTATUS[0]}
T_END=$(cut -d' ' -f1 /proc/uptime)
say "check exit code $check_rc after $(echo "$T_END - $T_CHECK" | bc) s"
rm -rf "$OUT_DIR/results"
cp -r "$WORK/results" "$OUT_DIR/results" 2>/dev/null

# ---------------------------------------------------------------- 5. teardown
cleanup

# ---------------------------------------------------------------- 6. per-test results
# check's closing lines: "Ran: t...", "Not run: t...", "Failures: t..." (each may wrap? no: one line each).
tr -d '\r' <"$OUT_DIR/check.out" >"$WORK/check.clean"
summary_list() { grep -a "^$1" "$WORK/check.clean" | tail -n 1 | sed "s/^$1//"; }
RAN=" $(summary_list 'Ran: ') "
NOTRUN=" $(summary_list 'Not run: ') "
FAILED=" $(summary_list 'Failures: ') "
: >"$OUT_DIR/summary.txt"
n_pass=0 n_fail=0 n_notrun=0 n_missing=0
for t in "${TESTS[@]}"; do
  secs=-
  if [[ $FAILED == *" $t "* ]]; then
    r=fail
    n_fail=$((n_fail + 1))
  elif [[ $NOTRUN == *" $t "* ]]; then
    r=notrun
    n_notrun=$((n_notrun + 1))
  elif [[ $RAN == *" $t "* ]]; then
    r=pass
    n_pass=$((n_pass + 1))
    # "generic/001 12s ...  13s" (with a previous time) or "generic/001       13s": the last Ns.
    secs=$(grep -a "^$t " "$WORK/check.clean" | tail -n 1 | grep -o '[0-9]\+s' | tail -n 1 | tr -d s)
  else
    r=missing
    n_missing=$((n_missing + 1))
  fi
  reason=
  [[ $r == notrun ]] && reason=$(grep -a "^$t " "$WORK/check.clean" | tail -n 1 | sed -n 's/.*\[not run\] *//p' | tr ' ' '_')
  echo "XFSTESTS-RESULT test=$t result=$r seconds=${secs:--}${reason:+ reason=$reason}"
  echo "$t $r" >>"$OUT_DIR/summary.txt"
done
echo "XFSTESTS-SUMMARY status=done kernel=$(uname -r) fstyp=$FSTYP tests=${#TESTS[@]} pass=$n_pass fail=$n_fail notrun=$n_notrun missing=$n_missing check_seconds=$(echo "$T_END - $T_CHECK" | bc) total_seconds=$(echo "$(cut -d' ' -f1 /proc/uptime) - $T0" | bc) check_rc=$check_rc"
((n_fail == 0 && n_missing == 0)) || exit 1
exit 0
