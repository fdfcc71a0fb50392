#!/usr/bin/env bash
# Guest side of pillar's real-kernel scenarios (runs as root INSIDE the VM; see ../run.sh).
#
#   tests/kernel-lane/vm.sh bookworm tests/kernel-lane/guest/pillar.sh TEST_BINARY [LIBTEST ARGS...]
#
# Prepares the kernel for the scenarios of csi/tests/kernel_lane/ and runs that compiled test
# binary with --test-threads=1 --nocapture (any further arguments go to libtest, e.g. a name
# filter). Exit code: the test binary's.
#
# - nvme_core is loaded with multipath=N first, so every controller gets its own block device
#   (two host identities in one guest see two devices; scenario 5).
# - configfs, nvmet, nvmet-tcp, nvme-tcp, loop, ext4, xfs; configfs mounted; lo up.
# - zfs (PILLAR_LANE_ZFS_USERLAND set by run.sh) for the ZFS scenario (s13).
# - dm-mod and dm-thin-pool for the LVM scenario (s8; the host's lvm binaries run in the guest),
#   dm-log-writes for the crash-state scenario (s14; the host's dmsetup runs in the guest).
#   There is no udevd in the guest: DM_DISABLE_UDEV=1 (inherited by the test binary, the agent
#   and its lvm commands) makes libdevmapper and LVM create /dev/mapper/* and /dev/<vg>/<lv>
#   themselves. Without it lvcreate fails ("/dev/<vg>/<lv>: not found: device not cleared").
# - /etc/nvme/hostnqn and /etc/nvme/hostid are written into the guest's tmpfs overlay (the host's
#   own files, if any, are never touched: / is the host's, read-only, under a tmpfs overlay).
# - The scenarios' work directory ($PILLAR_LANE_DIR, default /tmp/pillar-lane) is in guest RAM:
#   loop backing files live there.
# - PILLAR_KERNEL_LANE=1 tells the test binary it may tear down all nvmet state: without it
#   every scenario prints SKIP.
# - After the run, process logs of the scenarios (not the backing files) are copied to
#   $VM_SHARE/pillar-logs/<kernel>/ for the host.
set -uo pipefail

TEST_BIN=${1:?usage: pillar.sh TEST_BINARY [LIBTEST ARGS...]}
shift

say() { echo "[pillar.sh +$(cut -d' ' -f1 /proc/uptime)s] $*"; }

[[ -x $TEST_BIN ]] || { say "test binary $TEST_BIN is missing or not executable"; exit 2; }

# nvme_core first, with multipath off: nvme-tcp would otherwise pull it in with the default.
if [[ -d /sys/module/nvme_core ]]; then
  say "nvme_core already loaded (multipath=$(cat /sys/module/nvme_core/parameters/multipath 2>/dev/null))"
else
  modprobe nvme_core multipath=N || { say "modprobe nvme_core multipath=N failed"; exit 2; }
fi
modprobe -a configfs nvmet nvmet-tcp nvme-tcp nvme-fabrics loop ext4 xfs || { say "modprobe failed"; exit 2; }
say "modules loaded; nvme_core multipath=$(cat /sys/module/nvme_core/parameters/multipath)"
# Only scenarios 8 and 12 (LVM) and 14 (dm-log-writes) need device-mapper: a kernel without it
# fails those scenarios, not the others.
modprobe -a dm-mod dm-thin-pool || say "WARNING: modprobe dm-mod dm-thin-pool failed: the LVM scenario will fail"
modprobe dm-log-writes || say "WARNING: modprobe dm-log-writes failed: the crash-state scenario (s14) will fail"

# ZFS for scenario 13, where run.sh found a module for this kernel: the userland unpacked by
# setup.sh runs from the lane state; the ARC is kept small in the guest's 1 GiB.
if [[ -n ${PILLAR_LANE_ZFS_USERLAND:-} ]]; then
  if modprobe zfs zfs_arc_max=$((64 << 20)); then
    export PATH=$PILLAR_LANE_ZFS_USERLAND/sbin:$PATH
    export LD_LIBRARY_PATH=$PILLAR_LANE_ZFS_USERLAND/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    say "zfs $(cat /sys/module/zfs/version) loaded; userland from $PILLAR_LANE_ZFS_USERLAND"
  else
    say "WARNING: modprobe zfs failed: the ZFS scenario will fail"
  fi
fi

mountpoint -q /sys/kernel/config || mount -t configfs configfs /sys/kernel/config || { say "mount configfs failed"; exit 2; }
[[ -d /sys/kernel/config/nvmet ]] || { say "no /sys/kernel/config/nvmet"; exit 2; }
[[ -c /dev/nvme-fabrics ]] || { say "no /dev/nvme-fabrics"; exit 2; }
ip link set lo up

# The node's host identity, as Debian's nvme-cli keeps it.
mkdir -p /etc/nvme
HOSTID=5c0ffee0-0000-4000-8000-0000000000a1
printf '%s\n' "$HOSTID" >/etc/nvme/hostid
printf 'nqn.2014-08.org.nvmexpress:uuid:%s\n' "$HOSTID" >/etc/nvme/hostnqn

export PILLAR_KERNEL_LANE=1
export DM_DISABLE_UDEV=1
export PILLAR_LANE_DIR=${PILLAR_LANE_DIR:-/tmp/pillar-lane}
export RUST_BACKTRACE=${RUST_BACKTRACE:-1}
# A tmpfs of its own, not the overlay on /: a loop device over an overlayfs file accepts direct
# I/O on 6.1 (overlayfs claims it) and then fails every read with EIO, because the tmpfs under
# the overlay cannot do O_DIRECT there. On a plain tmpfs the kernel refuses direct I/O up front
# (6.1) or does it (7.x), and the agent binds buffered or direct accordingly.
mkdir -p "$PILLAR_LANE_DIR"
mountpoint -q "$PILLAR_LANE_DIR" || mount -t tmpfs -o "size=${PILLAR_LANE_TMPFS_SIZE:-60%},mode=0755" pillar-lane "$PILLAR_LANE_DIR" ||
  { say "mount tmpfs on $PILLAR_LANE_DIR failed"; exit 2; }

say "kernel $(uname -r); running $TEST_BIN --include-ignored --test-threads=1 --nocapture $*"
"$TEST_BIN" --include-ignored --test-threads=1 --nocapture "$@"
rc=$?
say "test binary exit code $rc"

if [[ -n ${VM_SHARE:-} && -d $VM_SHARE ]]; then
  out=$VM_SHARE/pillar-logs/$(uname -r)
  rm -rf "$out"
  mkdir -p "$out"
  (cd "$PILLAR_LANE_DIR" && find . -name '*.log' -exec cp --parents {} "$out/" \;) 2>/dev/null || true
  dmesg >"$out/dmesg.txt" 2>/dev/null || true
  say "process logs and dmesg copied to $out"
fi
exit "$rc"
