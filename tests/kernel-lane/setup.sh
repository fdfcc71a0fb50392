#!/usr/bin/env bash
# Prepare the real-kernel test lane: host packages, Debian kernels, their initramfs.
#
#   tests/kernel-lane/setup.sh
#
# Kernels (never installed on the host: apt-get download + dpkg -x + depmod -b):
#   bookworm  linux-image-amd64 from the machine's own apt sources (Debian 12, 6.1)
#   sid       linux-image-amd64 from Debian sid, through a private apt state folder
#   trixie    linux-image-amd64 from Debian 13 (6.12), the same way; not in the default list
#             (CI's time): KERNEL_LANE_KERNELS=trixie tests/kernel-lane/run.sh
# Idempotent: with everything present a run only re-resolves the versions (a few seconds).
#
# Env:
#   KERNEL_LANE_KERNELS   labels to prepare (default "bookworm sid")
#   SID_LISTS_MAX_AGE_H   refresh a private suite's package lists when older (default 24 hours)
#   KERNEL_LANE_STATE     state folder (default <cargo target dir>/kernel-lane)
#   KERNEL_LANE_ZFS=0     do not prepare ZFS (scenario 13 then fails: nothing to test it on)
#   KERNEL_LANE_ZFS_CACHE where the ZFS builds are kept (default ~/.cache/pillar/kernel-lane-zfs)
#
# ZFS (scenario 13): Debian's zfs-dkms and zfsutils-linux from bookworm's contrib component,
# through a private apt state. The module is built on the host against each lane kernel's
# linux-headers (dpkg -x, never installed) when the ZFS release supports that kernel
# (META's Linux-Maximum), cached per kernel and ZFS version, and put into the kernel's module
# tree (updates/zfs, depmod); `zfs.ready` in the kernel's folder names the ZFS version. The
# userland is unpacked to $ZFS_DIR/userland-<version> (lib.sh: a cache outside the lane state,
# KERNEL_LANE_ZFS_CACHE); the guest runs it from there.
set -euo pipefail

LOG_TAG=setup
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# lvm2 and thin-provisioning-tools (thin_check, run by LVM when it activates a thin pool): the
# LVM backend's scenario (s8) runs the host's lvm binaries in the guest.
# make builds the ZFS module (s13) against the lane kernel's headers.
# tcpdump captures the NVMe/TCP traffic of the TLS scenario (s16); keyutils' keyctl shows the
# guest's keyrings in its logs.
HOST_PACKAGES=(qemu-system-x86 busybox-static kmod nvme-cli e2fsprogs xfsprogs util-linux iproute2 bc zstd xz-utils lvm2 thin-provisioning-tools make tcpdump keyutils)
DEBS_DIR=$LANE_STATE/debs
SID_LISTS_MAX_AGE_H=${SID_LISTS_MAX_AGE_H:-24}
read -r -a LABELS <<<"${KERNEL_LANE_KERNELS:-bookworm sid}"

export DEBIAN_FRONTEND=noninteractive

# ---------------------------------------------------------------- host packages

missing_host_packages() {
  local pkg
  for pkg in "${HOST_PACKAGES[@]}"; do
    if [[ $(dpkg-query -W -f '${db:Status-Status}' "$pkg" 2>/dev/null) != installed ]]; then
      printf '%s\n' "$pkg"
    fi
  done
}

install_host_packages() {
  local missing
  mapfile -t missing < <(missing_host_packages)
  if ((${#missing[@]} == 0)); then
    log "host packages: all present"
    return 0
  fi
  log "host packages: installing ${missing[*]}"
  if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >"$LANE_STATE/apt-install.log" 2>&1; then
    log "apt-get install failed; running apt-get update and retrying"
    apt-get update -q >>"$LANE_STATE/apt-install.log" 2>&1 || die "apt-get update failed (see $LANE_STATE/apt-install.log)"
    apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$LANE_STATE/apt-install.log" 2>&1 ||
      die "apt-get install failed (see $LANE_STATE/apt-install.log)"
  fi
  log "host packages: installed"
}

# ---------------------------------------------------------------- apt contexts
# An apt "context" is an array of extra options: for the machine's own apt only a package
# cache file of the lane's own (apt-cache then answers in milliseconds instead of rebuilding
# its cache from the lists on every call), for sid the whole private state.

APT_MACHINE=(
  -o "Dir::Cache::pkgcache=$LANE_STATE/apt-machine/pkgcache.bin"
  -o "Dir::Cache::srcpkgcache=$LANE_STATE/apt-machine/srcpkgcache.bin"
)
# Every other suite (sid, trixie) has a private state of its own, $LANE_STATE/apt-<suite>.
suite_dir() { printf '%s/apt-%s\n' "$LANE_STATE" "$1"; }
apt_suite_opts() {  # apt_suite_opts SUITE -> sets APT_OPTS to the suite's private state
  local dir
  dir=$(suite_dir "$1")
  APT_OPTS=(
    -o "Dir::Etc::SourceList=$dir/sources.list"
    -o "Dir::Etc::SourceParts=-"
    -o "Dir::State::Lists=$dir/lists"
    -o "Dir::Cache=$dir/cache"
    -o "Dir::Cache::pkgcache=pkgcache.bin"
    -o "Dir::Cache::srcpkgcache=srcpkgcache.bin"
  )
}

# machine_debian_uri, shared with scripts/build-images.sh.
# shellcheck source=../../scripts/debian-mirror.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/debian-mirror.sh"

prepare_suite_state() {  # prepare_suite_state SUITE
  local suite=$1 dir uri age_min=$((SID_LISTS_MAX_AGE_H * 60))
  dir=$(suite_dir "$suite")
  mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
  uri=$(machine_debian_uri)
  printf 'deb %s %s main\n' "$uri" "$suite" >"$dir/sources.list.new"
  if cmp -s "$dir/sources.list.new" "$dir/sources.list"; then
    rm "$dir/sources.list.new"
  else
    mv "$dir/sources.list.new" "$dir/sources.list"
    rm -f "$dir/updated"
  fi
  if [[ ! -f $dir/updated ]] || [[ -n $(find "$dir/updated" -mmin +"$age_min") ]]; then
    update_suite_lists "$suite"
  fi
}

update_suite_lists() {  # update_suite_lists SUITE
  local dir
  dir=$(suite_dir "$1")
  log "$1: apt-get update (private state)"
  apt_suite_opts "$1"
  apt-get "${APT_OPTS[@]}" update -q >"$dir/update.log" 2>&1 || die "$1 apt-get update failed (see $dir/update.log)"
  touch "$dir/updated"
}

update_lists() {  # update_lists CONTEXT
  if [[ $1 != bookworm ]]; then
    update_suite_lists "$1"
  else
    log "bookworm: apt-get update (machine's apt)"
    apt-get update -q >"$LANE_STATE/apt-update.log" 2>&1 || die "apt-get update failed (see $LANE_STATE/apt-update.log)"
  fi
}

apt_opts() {  # apt_opts CONTEXT -> sets the global APT_OPTS array
  if [[ $1 != bookworm ]]; then apt_suite_opts "$1"; else APT_OPTS=("${APT_MACHINE[@]}"); fi
}

# resolve_image CONTEXT -> concrete linux-image-<kver> package behind linux-image-amd64
resolve_image() {
  local pkg=linux-image-amd64 dep
  apt_opts "$1"
  while dep=$(apt-cache "${APT_OPTS[@]}" depends "$pkg" 2>/dev/null |
    awk '!found && $1 == "Depends:" && $2 ~ /^linux-image-/ { print $2; found = 1 }') && [[ -n $dep ]]; do
    pkg=$dep
  done
  [[ $pkg != linux-image-amd64 ]] || return 1
  printf '%s\n' "$pkg"
}

# kernel_parts CONTEXT IMAGE_PKG -> the image package plus, for split kernels (sid 7.x),
# linux-{binary,modules,base}-<kver> it depends on.
kernel_parts() {
  local image=$2 kver=${2#linux-image-}
  apt_opts "$1"
  printf '%s\n' "$image"
  apt-cache "${APT_OPTS[@]}" depends "$image" 2>/dev/null |
    awk -v k="$kver" '$1 == "Depends:" && ($2 == "linux-binary-" k || $2 == "linux-modules-" k || $2 == "linux-base-" k) { print $2 }' |
    sort -u
}

candidate_version() {  # candidate_version CONTEXT PKG
  apt_opts "$1"
  # awk reads to the end: an early exit would kill apt-cache with SIGPIPE, and with pipefail
  # the whole pipeline (and setup.sh, under set -e) fails with status 141.
  apt-cache "${APT_OPTS[@]}" policy "$2" 2>/dev/null | awk '!found && $1 == "Candidate:" { print $2; found = 1 }'
}

# deb_file PKG VERSION -> path of the downloaded .deb (apt encodes ':' in versions as %3a)
deb_file() { printf '%s/%s_%s_amd64.deb\n' "$DEBS_DIR" "$1" "${2//:/%3a}"; }

download_parts() {  # download_parts CONTEXT PKG...
  local ctx=$1 pkg ver
  shift
  apt_opts "$ctx"
  mkdir -p "$DEBS_DIR"
  for pkg in "$@"; do
    ver=$(candidate_version "$ctx" "$pkg")
    [[ -n $ver && $ver != "(none)" ]] || return 1
    [[ -f $(deb_file "$pkg" "$ver") ]] && continue
    log "$ctx: downloading $pkg $ver"
    (cd "$DEBS_DIR" && apt-get "${APT_OPTS[@]}" download -q "$pkg=$ver" >/dev/null 2>&1) || return 1
  done
}

# ---------------------------------------------------------------- ZFS

CONTRIB_DIR=$LANE_STATE/apt-contrib
APT_CONTRIB=(
  -o "Dir::Etc::SourceList=$CONTRIB_DIR/sources.list"
  -o "Dir::Etc::SourceParts=-"
  -o "Dir::State::Lists=$CONTRIB_DIR/lists"
  -o "Dir::Cache=$CONTRIB_DIR/cache"
  -o "Dir::Cache::pkgcache=pkgcache.bin"
  -o "Dir::Cache::srcpkgcache=srcpkgcache.bin"
)
ZFS_PACKAGES=(zfs-dkms zfsutils-linux libnvpair3linux libuutil3linux libzfs4linux libzpool5linux)

# prepare_zfs_sources: the private contrib state and the ZFS packages; sets ZFS_VERSION,
# ZFS_SRC (the unpacked zfs-dkms source) and ZFS_USERLAND.
prepare_zfs_sources() {
  local uri pkg ver debs=$ZFS_DIR/debs
  mkdir -p "$CONTRIB_DIR/lists/partial" "$CONTRIB_DIR/cache/archives/partial" "$debs"
  uri=$(machine_debian_uri)
  printf 'deb %s bookworm contrib\ndeb %s bookworm-updates contrib\n' "$uri" "$uri" >"$CONTRIB_DIR/sources.list.new"
  if ! cmp -s "$CONTRIB_DIR/sources.list.new" "$CONTRIB_DIR/sources.list"; then
    mv "$CONTRIB_DIR/sources.list.new" "$CONTRIB_DIR/sources.list"
    rm -f "$CONTRIB_DIR/updated"
  fi
  rm -f "$CONTRIB_DIR/sources.list.new"
  if [[ ! -f $CONTRIB_DIR/updated ]] || [[ -n $(find "$CONTRIB_DIR/updated" -mmin +$((SID_LISTS_MAX_AGE_H * 60))) ]]; then
    log "zfs: apt-get update (private contrib state)"
    apt-get "${APT_CONTRIB[@]}" update -q >"$CONTRIB_DIR/update.log" 2>&1 || die "contrib apt-get update failed (see $CONTRIB_DIR/update.log)"
    touch "$CONTRIB_DIR/updated"
  fi
  ZFS_VERSION=$(apt-cache "${APT_CONTRIB[@]}" policy zfs-dkms 2>/dev/null | awk '!f && $1 == "Candidate:" { print $2; f = 1 }')
  [[ -n $ZFS_VERSION && $ZFS_VERSION != "(none)" ]] || die "zfs: no zfs-dkms in bookworm contrib"
  for pkg in "${ZFS_PACKAGES[@]}"; do
    ver=$(apt-cache "${APT_CONTRIB[@]}" policy "$pkg" 2>/dev/null | awk '!f && $1 == "Candidate:" { print $2; f = 1 }')
    compgen -G "$debs/${pkg}_${ver//:/%3a}_*.deb" >/dev/null && continue
    log "zfs: downloading $pkg $ver"
    (cd "$debs" && apt-get "${APT_CONTRIB[@]}" download -q "$pkg=$ver" >/dev/null 2>&1) || die "zfs: download of $pkg $ver failed"
  done
  ZFS_SRC=$ZFS_DIR/src-$ZFS_VERSION
  ZFS_USERLAND=$ZFS_DIR/userland-$ZFS_VERSION
  if [[ ! -f $ZFS_SRC/.ready ]]; then
    rm -rf "$ZFS_SRC" && mkdir -p "$ZFS_SRC"
    dpkg -x "$debs/zfs-dkms_${ZFS_VERSION//:/%3a}_all.deb" "$ZFS_SRC"
    touch "$ZFS_SRC/.ready"
  fi
  if [[ ! -f $ZFS_USERLAND/.ready ]]; then
    rm -rf "$ZFS_USERLAND" && mkdir -p "$ZFS_USERLAND"
    for pkg in "${ZFS_PACKAGES[@]:1}"; do
      dpkg -x "$(compgen -G "$debs/${pkg}_*${ZFS_VERSION//:/%3a}_amd64.deb" | head -n 1)" "$ZFS_USERLAND"
    done
    touch "$ZFS_USERLAND/.ready"
  fi
}

# kernel_fits MAX KVER: whether KVER's major.minor is at most MAX (both "X.Y")
kernel_fits() {
  local max=$1 k=${2%%-*}
  local kmaj=${k%%.*} kmin=${k#*.}
  kmin=${kmin%%.*}
  ((kmaj < ${max%%.*} || (kmaj == ${max%%.*} && kmin <= ${max#*.})))
}

# prepare_zfs LABEL: the ZFS module for the label's kernel, built once per kernel and version.
prepare_zfs() {
  local label=$1 kver kdir src max built hdr series pkg ver
  kver=$(basename "$(readlink "$KERNELS_DIR/$label")")
  kdir=$(kernel_dir "$kver")
  src=$(compgen -G "$ZFS_SRC/usr/src/zfs-*" | head -n 1)
  max=$(awk '$1 == "Linux-Maximum:" { print $2 }' "$src/META")
  if ! kernel_fits "$max" "$kver"; then
    log "zfs: $ZFS_VERSION supports Linux up to $max: no ZFS on $label ($kver)"
    rm -f "$kdir/zfs.ready"
    printf 'ZFS %s supports Linux up to %s, not %s\n' "$ZFS_VERSION" "$max" "$kver" >"$kdir/zfs.unsupported"
    return 0
  fi
  if [[ $label != bookworm ]]; then
    log "zfs: headers come from the machine's apt (bookworm) only: no ZFS on $label ($kver)"
    rm -f "$kdir/zfs.ready"
    printf 'the lane builds ZFS against bookworm headers only, not for %s\n' "$kver" >"$kdir/zfs.unsupported"
    return 0
  fi
  rm -f "$kdir/zfs.unsupported"
  built=$ZFS_DIR/modules-$kver-$ZFS_VERSION
  if [[ ! -f $built/.ready ]]; then
    series=${kver%%-*}
    series=${series%.*}
    local parts=("linux-headers-$kver" "linux-headers-${kver%-amd64}-common" "linux-kbuild-$series")
    download_parts bookworm "${parts[@]}" || die "zfs: cannot download ${parts[*]}"
    hdr=$ZFS_DIR/build-$kver/root
    rm -rf "$ZFS_DIR/build-$kver" && mkdir -p "$hdr"
    for pkg in "${parts[@]}"; do
      ver=$(candidate_version bookworm "$pkg")
      dpkg -x "$(compgen -G "$DEBS_DIR/${pkg}_${ver//:/%3a}_*.deb" | head -n 1)" "$hdr"
    done
    # The arch headers' Makefile includes the common tree by absolute path.
    sed -i "s|/usr/src/|$hdr/usr/src/|" "$hdr/usr/src/linux-headers-$kver/Makefile"
    cp -a "$src" "$ZFS_DIR/build-$kver/zfs"
    log "zfs: building the $ZFS_VERSION module for $kver (a few minutes)"
    (
      cd "$ZFS_DIR/build-$kver/zfs" &&
        ./configure --with-config=kernel --with-linux="$hdr/usr/src/linux-headers-${kver%-amd64}-common" \
          --with-linux-obj="$hdr/usr/src/linux-headers-$kver" &&
        make -j"$(nproc)" -C module
    ) >"$ZFS_DIR/build-$kver.log" 2>&1 || die "zfs: module build for $kver failed (see $ZFS_DIR/build-$kver.log)"
    rm -rf "$built" && mkdir -p "$built"
    find "$ZFS_DIR/build-$kver/zfs/module" -name '*.ko' -exec cp {} "$built/" \;
    rm -rf "$ZFS_DIR/build-$kver"
    touch "$built/.ready"
  fi
  if [[ $(cat "$kdir/zfs.ready" 2>/dev/null) != "$ZFS_VERSION" ]]; then
    rm -rf "$kdir/root/lib/modules/$kver/updates/zfs"
    mkdir -p "$kdir/root/lib/modules/$kver/updates/zfs"
    cp "$built"/*.ko "$kdir/root/lib/modules/$kver/updates/zfs/"
    depmod -b "$kdir/root" "$kver"
    printf '%s\n' "$ZFS_VERSION" >"$kdir/zfs.ready"
  fi
  log "zfs: $ZFS_VERSION module ready for $label ($kver)"
}

# ---------------------------------------------------------------- tlshd (s16)
# The TLS handshake of NVMe/TCP is done by tlshd (ktls-utils), which Debian has from trixie on;
# the host's userland is bookworm's. Each kernel with TLS gets the tlshd of its own suite: a
# newer tlshd can need what an older kernel lacks (ktls-utils 1.4.0 from sid fails every
# handshake on trixie's 6.12: its setsockopt TLS_TX_MAX_PAYLOAD_LEN is "Protocol not
# available" there). The package and what it depends on come from the suite's private state,
# unpacked (never installed) to $LANE_STATE/tlshd-<suite>-<version>/root, and the guest runs it
# with the suite's own loader and libraries from there (`tlshd` in that folder: a wrapper).
# $LANE_STATE/tlshd-<suite>.ready names the folder; run.sh passes the kernel's own.

prepare_tlshd() {  # prepare_tlshd SUITE
  local suite=$1 ver pkgs dir wrapper
  prepare_suite_state "$suite"
  apt_opts "$suite"
  ver=$(candidate_version "$suite" ktls-utils)
  [[ -n $ver && $ver != "(none)" ]] || die "tlshd: $suite has no ktls-utils"
  dir=$LANE_STATE/tlshd-$suite-$ver
  if [[ -x $dir/tlshd ]]; then
    printf '%s\n' "$dir" >"$LANE_STATE/tlshd-$suite.ready"
    log "tlshd: ktls-utils $ver from $suite (unpacked)"
    return 0
  fi
  # The Depends closure, without recommendations and without virtual packages.
  mapfile -t pkgs < <(apt-cache "${APT_OPTS[@]}" depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances ktls-utils 2>/dev/null |
    awk '!/^ / && !/^</' | sort -u)
  ((${#pkgs[@]} > 0)) || die "tlshd: cannot resolve what ktls-utils depends on in $suite"
  log "tlshd: ktls-utils $ver and ${#pkgs[@]} packages from $suite"
  rm -rf "$dir.partial" && mkdir -p "$dir.partial/debs" "$dir.partial/root"
  (cd "$dir.partial/debs" && apt-get "${APT_OPTS[@]}" download -q "${pkgs[@]}" >/dev/null 2>&1) ||
    die "tlshd: download from $suite failed"
  local deb
  for deb in "$dir.partial"/debs/*.deb; do
    dpkg -x "$deb" "$dir.partial/root"
  done
  rm -rf "$dir.partial/debs"
  wrapper=$dir.partial/tlshd
  cat >"$wrapper" <<WRAPPER
#!/bin/sh
# tlshd from Debian $suite on another userland: $suite's loader and libraries (setup.sh).
root=\$(dirname "\$0")/root
lib=\$root/usr/lib/x86_64-linux-gnu
exec "\$lib/ld-linux-x86-64.so.2" --library-path "\$lib" "\$root/usr/sbin/tlshd" "\$@"
WRAPPER
  chmod +x "$wrapper"
  "$wrapper" --version >/dev/null 2>&1 || die "tlshd: the unpacked tlshd from $suite does not run here"
  mv "$dir.partial" "$dir"
  printf '%s\n' "$dir" >"$LANE_STATE/tlshd-$suite.ready"
}

# ---------------------------------------------------------------- kernel trees

# extract_vmlinux BZIMAGE OUT: decompress the payload of a bzImage to an ELF vmlinux
# (PVH direct boot then skips the slow in-guest decompression under TCG).
extract_vmlinux() {
  local img=$1 out=$2 magic tool off
  # compressed-stream magic (as a grep -P pattern) and the matching decompressor
  local -a formats=(
    '\x28\xb5\x2f\xfd|zstd -qdc'
    '\xfd\x37\x7a\x58\x5a\x00|xz -qdc'
    '\x1f\x8b\x08|gzip -qdc'
  )
  local fmt
  for fmt in "${formats[@]}"; do
    magic=${fmt%%|*}
    tool=${fmt#*|}
    while read -r off; do
      # a stream followed by trailing data makes the tools complain; only an ELF result counts
      tail -c +"$((off + 1))" "$img" | $tool >"$out.tmp" 2>/dev/null || true
      if [[ $(head -c 4 "$out.tmp" | od -An -tx1 | tr -d ' \n') == 7f454c46 ]]; then
        mv "$out.tmp" "$out"
        return 0
      fi
    done < <(LC_ALL=C grep -obUaP "$magic" "$img" | cut -d: -f1 | head -n 5)
  done
  rm -f "$out.tmp"
  return 1
}

find_bzimage() {  # find_bzimage ROOT KVER
  local f
  for f in "$1/boot/vmlinuz-$2" "$1/usr/lib/modules/$2/vmlinuz" "$1/lib/modules/$2/vmlinuz"; do
    [[ -f $f ]] && { printf '%s\n' "$f"; return 0; }
  done
  return 1
}

# unpack_kernel CONTEXT KVER PKG...: dpkg -x all parts into one tree, depmod, vmlinux
unpack_kernel() {
  local ctx=$1 kver=$2 kdir root pkg bz
  shift 2
  kdir=$(kernel_dir "$kver")
  root=$kdir/root
  rm -rf "$kdir"
  mkdir -p "$root"
  for pkg in "$@"; do
    dpkg -x "$(deb_file "$pkg" "$(candidate_version "$ctx" "$pkg")")" "$root"
  done
  # split (merged-/usr) packages ship /usr/lib/modules only: give depmod and the guest a lib/modules view
  if [[ ! -e $root/lib && -d $root/usr/lib/modules ]]; then
    ln -s usr/lib "$root/lib"
  fi
  [[ -d $root/lib/modules/$kver/kernel ]] || die "$kver: no modules in $*"
  depmod -b "$root" "$kver"
  bz=$(find_bzimage "$root" "$kver") || die "$kver: no vmlinuz in $*"
  ln -s "${bz#"$kdir"/}" "$kdir/bzImage"
  if extract_vmlinux "$bz" "$kdir/vmlinux"; then
    log "$kver: extracted ELF vmlinux ($(du -m "$kdir/vmlinux" | cut -f1) MB)"
  else
    log "$kver: WARNING: no ELF vmlinux extracted; vm.sh will boot the bzImage (slower)"
  fi
  touch "$kdir/.ready"
}

# prepare_kernel LABEL: resolve, download, unpack, build the initrd, point the label at it
prepare_kernel() {
  local label=$1 ctx=$1 image kver parts attempt
  case $label in
    bookworm) ;;
    sid | trixie) prepare_suite_state "$label" ;;
    *) die "unknown kernel label '$label' (known: bookworm sid trixie)" ;;
  esac
  for attempt in 1 2; do
    if image=$(resolve_image "$ctx"); then
      kver=${image#linux-image-}
      mapfile -t parts < <(kernel_parts "$ctx" "$image")
      if [[ -f $(kernel_dir "$kver")/.ready ]] || download_parts "$ctx" "${parts[@]}"; then
        break
      fi
      log "$ctx: download of ${parts[*]} failed"
    else
      log "$ctx: linux-image-amd64 not resolvable from the current package lists"
    fi
    ((attempt == 1)) || die "$ctx: cannot get a kernel (even after apt-get update)"
    update_lists "$ctx"
  done
  if [[ ! -f $(kernel_dir "$kver")/.ready ]]; then
    log "$label: unpacking ${parts[*]}"
    unpack_kernel "$ctx" "$kver" "${parts[@]}"
  fi
  build_initrd "$kver"
  ln -sfn "$kver" "$KERNELS_DIR/$label"
  RESOLVED+=("$label=$kver ($(candidate_version "$ctx" "$image"))")
}

# prune_stale: drop kernel trees and .debs that no label points at any more (after an update)
prune_stale() {
  local -a keep=()
  local entry kver deb
  for entry in "$KERNELS_DIR"/*; do
    [[ -L $entry ]] && keep+=("$(basename "$(readlink "$entry")")")
  done
  ((${#keep[@]} > 0)) || return 0
  for entry in "$KERNELS_DIR"/*; do
    [[ -L $entry || ! -d $entry ]] && continue
    if [[ " ${keep[*]} " != *" $(basename "$entry") "* ]]; then
      log "removing stale kernel $(basename "$entry")"
      rm -rf "$entry"
    fi
  done
  for deb in "$DEBS_DIR"/*.deb; do
    [[ -e $deb ]] || continue
    for kver in "${keep[@]}"; do
      [[ $(basename "$deb") == *"-${kver}_"* ]] && continue 2
    done
    log "removing stale $(basename "$deb")"
    rm -f "$deb"
  done
}

main() {
  mkdir -p "$LANE_STATE" "$KERNELS_DIR" "$LANE_STATE/share" "$LANE_STATE/logs" "$LANE_STATE/apt-machine"
  log "lane state: $LANE_STATE"
  install_host_packages
  RESOLVED=()
  local label
  for label in "${LABELS[@]}"; do
    prepare_kernel "$label"
  done
  if [[ ${KERNEL_LANE_ZFS:-1} != 0 ]]; then
    prepare_zfs_sources
    for label in "${LABELS[@]}"; do
      prepare_zfs "$label"
    done
  fi
  # Every kernel newer than bookworm's has TLS for NVMe/TCP: s16 needs its tlshd there.
  for label in "${LABELS[@]}"; do
    [[ $label == bookworm ]] || prepare_tlshd "$label"
  done
  prune_stale
  for label in "${RESOLVED[@]}"; do
    log "kernel $label"
  done
  log "done"
}

main "$@"
