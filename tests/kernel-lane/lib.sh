# shellcheck shell=bash
# Shared helpers for the real-kernel test lane (sourced by setup.sh and vm.sh).
#
# Layout of the lane's state (all git-ignored, under cargo's target dir):
#   $LANE_STATE/debs/                  downloaded kernel .deb files
#   $LANE_STATE/apt-sid/               private apt state for Debian sid (never the machine's own)
#   $LANE_STATE/kernels/<kver>/root/   dpkg -x tree of the kernel packages (+ depmod output)
#   $LANE_STATE/kernels/<kver>/vmlinux ELF kernel for PVH direct boot
#   $LANE_STATE/kernels/<kver>/initrd.cpio.gz
#   $LANE_STATE/kernels/<label>        symlink label (bookworm, sid) -> <kver>
#   $LANE_STATE/share/                 default read-write share for the guest
#   $LANE_STATE/logs/                  serial console logs
#   $ZFS_DIR/                          ZFS packages, module builds and userland (see setup.sh)

LANE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROJECT_DIR=$(cd "$LANE_DIR/../.." && pwd)
LANE_STATE=${KERNEL_LANE_STATE:-${CARGO_TARGET_DIR:-$PROJECT_DIR/target}/kernel-lane}
KERNELS_DIR=$LANE_STATE/kernels
# The ZFS module builds (minutes each) and userland, per kernel and ZFS version: outside the lane
# state so a fresh checkout on this machine reuses them (CI works without them: they are built).
ZFS_DIR=${KERNEL_LANE_ZFS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pillar/kernel-lane-zfs}
GUEST_DIR=$LANE_DIR/guest

# Modules the initramfs needs to reach the 9p root and build the overlay.
INITRD_MODULES=(virtio_pci 9pnet_virtio 9p overlay)

LOG_TAG=${LOG_TAG:-kernel-lane}
_LANE_T0=$EPOCHREALTIME

elapsed() {  # seconds since the script started, one decimal
  local now=${EPOCHREALTIME/./} start=${_LANE_T0/./}
  local ds=$(( (now - start) / 100000 ))
  printf '%d.%d' $((ds / 10)) $((ds % 10))
}

log() { printf '[%s +%ss] %s\n' "$LOG_TAG" "$(elapsed)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# kernel_dir KVER -> directory of a prepared kernel
kernel_dir() { printf '%s/%s\n' "$KERNELS_DIR" "$1"; }

# resolve_kernel LABEL_OR_KVER -> concrete kernel version of a prepared kernel
resolve_kernel() {
  local want=$1 dir
  dir=$(kernel_dir "$want")
  [[ -e $dir ]] || return 1
  if [[ -L $dir ]]; then
    basename "$(readlink "$dir")"
  else
    printf '%s\n' "$want"
  fi
}

# modules_dir KVER -> the real directory holding lib/modules/<kver> (what the guest mounts on /lib/modules)
modules_dir() {
  realpath "$(kernel_dir "$1")/root/lib/modules"
}

# build_initrd KVER: busybox + the modules in INITRD_MODULES (with their dependencies) + guest/init.
# Rebuilt when missing or older than guest/init.
build_initrd() {
  local kver=$1 kdir out tmp mod f base
  kdir=$(kernel_dir "$kver")
  out=$kdir/initrd.cpio.gz
  if [[ -f $out && $out -nt $GUEST_DIR/init ]]; then
    return 0
  fi
  [[ -x /bin/busybox ]] || die "/bin/busybox missing (busybox-static); run setup.sh"
  tmp=$(mktemp -d)
  mkdir -p "$tmp"/{bin,dev,proc,sys,mods,lower,upper,newroot}
  cp /bin/busybox "$tmp/bin/busybox"
  install -m 0755 "$GUEST_DIR/init" "$tmp/init"
  : >"$tmp/mods/order"
  # modprobe --show-depends lists "insmod <path>" in load order ("builtin <name>" for built-ins)
  for mod in "${INITRD_MODULES[@]}"; do
    modprobe -d "$kdir/root" -S "$kver" --show-depends "$mod" ||
      die "initrd: module $mod not found for $kver"
  done | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' >"$tmp/mods/paths"
  while read -r f; do
    base=$(basename "$f")
    base=${base%.xz}
    base=${base%.zst}
    base=${base%.gz}
    # busybox insmod wants plain .ko files
    case $f in
      *.xz) xz -dc "$f" >"$tmp/mods/$base" ;;
      *.zst) zstd -qdc "$f" >"$tmp/mods/$base" ;;
      *.gz) gzip -dc "$f" >"$tmp/mods/$base" ;;
      *) cp "$f" "$tmp/mods/$base" ;;
    esac
    printf '%s\n' "$base" >>"$tmp/mods/order"
  done <"$tmp/mods/paths"
  rm "$tmp/mods/paths"
  (cd "$tmp" && find . | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1 >"$out.tmp")
  mv "$out.tmp" "$out"
  log "initrd for $kver: $(du -k "$out" | cut -f1) KB, modules: $(tr '\n' ' ' <"$tmp/mods/order")"
  rm -rf "$tmp"
}
