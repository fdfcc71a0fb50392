#!/usr/bin/env bash
# Guest smoke test of the real-kernel lane (runs as root INSIDE the VM; see vm.sh).
#
#   tests/kernel-lane/vm.sh bookworm tests/kernel-lane/guest/smoke.sh
#
# The kernel NVMe-oF/TCP target and host on one machine, over 127.0.0.1:
# nvmet subsystem (serial, host ACL) with one namespace on a loop device with explicit
# device_uuid/device_nguid, TCP port 4420, nvme connect with explicit --hostnqn/--hostid,
# identity checks through sysfs, ext4 mkfs + mount + write + read back, disconnect, teardown.
# Prints PASS/FAIL lines; exit code = number of failures.

# functions below are called indirectly (check, wait_for, try)
# shellcheck disable=SC2317
set -euo pipefail

NQN=nqn.2024-01.io.pillar:smoke
HOST_ID=5c0ffee0-0000-4000-8000-00000000a001
HOST_NQN=nqn.2014-08.org.nvmexpress:uuid:$HOST_ID
NS_UUID=3f2a1b0c-9d8e-4f7a-a6b5-c4d3e2f1a0b9
NS_NGUID=3f2a1b0c-9d8e-4f7a-a6b5-c4d3e2f1a0b9
SERIAL=PILLARSMOKE0001
PORT_ID=1
TRADDR=127.0.0.1
TRSVCID=4420
BACKING=/tmp/smoke-backing.img
BACKING_SIZE=128M
MNT=/tmp/smoke-mnt
MODULES=(configfs nvmet nvmet-tcp nvme-tcp loop ext4 xfs)

CFG=/sys/kernel/config/nvmet
SUBSYS=$CFG/subsystems/$NQN
PORT=$CFG/ports/$PORT_ID

PASSED=0
FAILED=0
LOOP_DEV=""
T0=$EPOCHREALTIME

secs() { local d=$((${EPOCHREALTIME/./} - ${1/./})); printf '%d.%02d' $((d / 1000000)) $(((d / 10000) % 100)); }
pass() { echo "PASS: $* [+$(secs "$T0")s]"; PASSED=$((PASSED + 1)); }
fail() { echo "FAIL: $* [+$(secs "$T0")s]"; FAILED=$((FAILED + 1)); }
info() { echo "INFO: $*"; }

# check DESCRIPTION COMMAND...: PASS/FAIL on the command's status; returns that status
check() {
  local desc=$1 out
  shift
  if out=$("$@" 2>&1); then
    pass "$desc"
  else
    fail "$desc"
    [[ -z $out ]] || printf '  | %s\n' "${out//$'\n'/$'\n'  | }"
    return 1
  fi
}

# expect_eq DESCRIPTION ACTUAL EXPECTED
expect_eq() {
  if [[ $2 == "$3" ]]; then
    pass "$1 ($2)"
  else
    fail "$1: got '$2', want '$3'"
    return 1
  fi
}

# wait_for SECONDS COMMAND...: poll every 0.1 s until the command succeeds
wait_for() {
  local tries=$(($1 * 10))
  shift
  until "$@" 2>/dev/null; do
    ((--tries > 0)) || return 1
    sleep 0.1
  done
}

finish() {
  echo "smoke: kernel $(uname -r), $PASSED passed, $FAILED failed, $(secs "$T0")s"
  echo "$PASSED passed, $FAILED failed"
  exit "$FAILED"
}

# abort DESCRIPTION: a failure the rest of the test cannot continue after
abort() {
  fail "$1"
  teardown || true
  finish
}

# ---------------------------------------------------------------- target side

write_attr() { printf '%s' "$2" >"$1"; }

load_modules() {
  check "modprobe ${MODULES[*]}" modprobe -a "${MODULES[@]}" || return 1
  if ! mountpoint -q /sys/kernel/config; then
    check "mount configfs" mount -t configfs configfs /sys/kernel/config || return 1
  fi
  [[ -d $CFG ]] || { fail "$CFG missing"; return 1; }
}

setup_backing() {
  truncate -s "$BACKING_SIZE" "$BACKING"
  LOOP_DEV=$(losetup -f --show "$BACKING") || { fail "losetup $BACKING"; return 1; }
  pass "loop device $LOOP_DEV ($BACKING_SIZE)"
}

# (errexit does not apply inside a tested function: every step is chained with &&)
create_subsystem() {
  mkdir "$SUBSYS" &&
    printf '%s' "$SERIAL" >"$SUBSYS/attr_serial" &&
    echo 0 >"$SUBSYS/attr_allow_any_host" &&
    mkdir -p "$CFG/hosts/$HOST_NQN" &&
    ln -s "$CFG/hosts/$HOST_NQN" "$SUBSYS/allowed_hosts/$HOST_NQN" &&
    mkdir "$SUBSYS/namespaces/1" &&
    printf '%s' "$LOOP_DEV" >"$SUBSYS/namespaces/1/device_path" &&
    printf '%s' "$NS_UUID" >"$SUBSYS/namespaces/1/device_uuid" &&
    printf '%s' "$NS_NGUID" >"$SUBSYS/namespaces/1/device_nguid" &&
    echo 1 >"$SUBSYS/namespaces/1/enable"
}

create_port() {
  mkdir "$PORT" &&
    echo tcp >"$PORT/addr_trtype" &&
    echo ipv4 >"$PORT/addr_adrfam" &&
    echo "$TRADDR" >"$PORT/addr_traddr" &&
    echo "$TRSVCID" >"$PORT/addr_trsvcid" &&
    ln -s "$SUBSYS" "$PORT/subsystems/$NQN"
}

# ---------------------------------------------------------------- host side

CTRL=""
BDEV=""

# the controller connected to our subsystem, e.g. nvme0
find_ctrl() {
  local c
  for c in /sys/class/nvme/nvme*; do
    [[ -e $c/subsysnqn && $(<"$c/subsysnqn") == "$NQN" ]] || continue
    CTRL=$(basename "$c")
    return 0
  done
  return 1
}

# the namespace block device of our subsystem, e.g. nvme0n1 (multipath heads included,
# hidden per-path nvmeXcYnZ excluded)
find_bdev() {
  local b
  for b in /sys/block/nvme*n*; do
    [[ $(basename "$b") =~ ^nvme[0-9]+n[0-9]+$ ]] || continue
    [[ -e $b/device/subsysnqn && $(<"$b/device/subsysnqn") == "$NQN" ]] ||
      [[ -e $b/device/device/subsysnqn && $(<"$b/device/device/subsysnqn") == "$NQN" ]] ||
      [[ -e $b/uuid && $(<"$b/uuid") == "$NS_UUID" ]] || continue
    BDEV=$(basename "$b")
    [[ -b /dev/$BDEV ]] && return 0
  done
  return 1
}

connect() {
  local t=$EPOCHREALTIME
  check "nvme connect tcp $TRADDR:$TRSVCID $NQN" \
    nvme connect -t tcp -a "$TRADDR" -s "$TRSVCID" -n "$NQN" --hostnqn="$HOST_NQN" --hostid="$HOST_ID" || return 1
  wait_for 10 find_ctrl || { fail "no controller for $NQN in /sys/class/nvme"; return 1; }
  wait_for 10 find_bdev || { fail "no block device for $NQN"; return 1; }
  pass "controller $CTRL, block device /dev/$BDEV after $(secs "$t")s"
}

check_identity() {
  local c=/sys/class/nvme/$CTRL b=/sys/block/$BDEV serial
  expect_eq "namespace uuid" "$(<"$b/uuid")" "$NS_UUID" || true
  expect_eq "namespace nguid" "$(<"$b/nguid")" "$NS_NGUID" || true
  serial=$(<"$c/serial")
  expect_eq "controller serial" "${serial%"${serial##*[! ]}"}" "$SERIAL" || true
  expect_eq "controller hostnqn" "$(<"$c/hostnqn")" "$HOST_NQN" || true
  expect_eq "controller hostid" "$(<"$c/hostid")" "$HOST_ID" || true
  expect_eq "controller transport" "$(<"$c/transport")" tcp || true
  info "wwid $(<"$b/wwid"), size $(($(<"$b/size") * 512 / 1048576)) MiB, attrs: $(cd "$SUBSYS/namespaces/1" && echo *)"
}

filesystem_io() {
  local dev=/dev/$BDEV sum_w sum_r
  check "mkfs.ext4 $dev" mkfs.ext4 -q -F "$dev" || return 1
  mkdir -p "$MNT"
  check "mount ext4" mount -t ext4 "$dev" "$MNT" || return 1
  head -c 4M /dev/urandom >/tmp/smoke-data
  sum_w=$(sha256sum </tmp/smoke-data)
  check "write 4 MiB + fsync" dd if=/tmp/smoke-data of="$MNT/data" bs=1M conv=fsync status=none || true
  check "umount ext4" umount "$MNT" || return 1
  # drop the page cache so the read comes from the target
  echo 3 >/proc/sys/vm/drop_caches
  check "remount ext4" mount -t ext4 -o ro "$dev" "$MNT" || return 1
  sum_r=$(sha256sum <"$MNT/data" 2>/dev/null || echo unreadable)
  expect_eq "data read back after remount" "${sum_r%% *}" "${sum_w%% *}" || true
  check "umount ext4 (ro)" umount "$MNT" || true
}

disconnect() {
  check "nvme disconnect -n $NQN" nvme disconnect -n "$NQN" || return 1
  if wait_for 10 bash -c "! test -e /sys/class/nvme/$CTRL"; then
    pass "controller $CTRL gone"
  else
    fail "controller $CTRL still present after disconnect"
  fi
  CTRL=""
}

# ---------------------------------------------------------------- teardown

# teardown: undo everything that exists, in reverse order; returns non-zero if a step failed
teardown() {
  local failed=0
  try() { "$@" || { echo "  teardown step failed: $*"; failed=1; }; }
  ! mountpoint -q "$MNT" 2>/dev/null || try umount "$MNT"
  [[ -z $CTRL ]] || try nvme disconnect -n "$NQN"
  [[ ! -L $PORT/subsystems/$NQN ]] || try rm "$PORT/subsystems/$NQN"
  [[ ! -d $PORT ]] || try rmdir "$PORT"
  if [[ -d $SUBSYS/namespaces/1 ]]; then
    try write_attr "$SUBSYS/namespaces/1/enable" 0
    try rmdir "$SUBSYS/namespaces/1"
  fi
  [[ ! -L $SUBSYS/allowed_hosts/$HOST_NQN ]] || try rm "$SUBSYS/allowed_hosts/$HOST_NQN"
  [[ ! -d $SUBSYS ]] || try rmdir "$SUBSYS"
  [[ ! -d $CFG/hosts/$HOST_NQN ]] || try rmdir "$CFG/hosts/$HOST_NQN"
  [[ -z $LOOP_DEV ]] || try losetup -d "$LOOP_DEV"
  LOOP_DEV=""
  rm -f "$BACKING" /tmp/smoke-data
  return "$failed"
}

configfs_leftovers() {
  find "$CFG/subsystems" "$CFG/ports" "$CFG/hosts" -mindepth 1 -maxdepth 1
}

main() {
  info "kernel $(uname -r), nvme-cli $(nvme version | awk '{print $3; exit}'), guest uptime $(cut -d' ' -f1 /proc/uptime)s"
  load_modules || abort "kernel modules / configfs"
  setup_backing || abort "backing device"
  check "nvmet subsystem $NQN with namespace 1 (uuid, nguid, serial, host ACL)" create_subsystem ||
    abort "create subsystem"
  check "nvmet port $PORT_ID tcp $TRADDR:$TRSVCID" create_port || abort "create port"
  connect || abort "connect"
  check_identity
  filesystem_io || true
  disconnect || true
  check "teardown" teardown || true
  local left
  left=$(configfs_leftovers)
  if [[ -z $left ]]; then
    pass "configfs clean"
  else
    fail "configfs not clean: ${left//$'\n'/ }"
  fi
  finish
}

main "$@"
