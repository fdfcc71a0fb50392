#!/usr/bin/env bash
# Builds pillar's two images from deploy/images/ with the first builder that runs here:
#
#   scripts/build-images.sh [TAG]          pillar-csi:TAG and pillar-agent:TAG (default 0.1.0)
#   scripts/build-images.sh --check        what can be checked without building
#   scripts/build-images.sh --from-host    build with buildah where no registry is reachable (CI)
#
# Builders tried in order: podman, buildah (both with the vfs storage driver and chroot
# isolation, so they run unprivileged-in-a-container too), docker (needs its daemon). Base
# images (rust:1-bookworm, debian:bookworm-slim) are pulled by the builder from the registries
# it is configured for; override with BUILDER_IMAGE / RUNTIME_IMAGE.
#
# --from-host, for machines that reach Debian's archive but no container registry (CI here):
# the runtime base is a debootstrap minbase bookworm imported into buildah
# (localhost/pillar-base:bookworm, kept in buildah's vfs storage for later runs), the build
# stage's image carries the binaries this machine's cargo built (target/debug, or
# target/release when PROFILE=release) in /out, which the Containerfiles' build stage then uses
# instead of compiling; the runtime stage runs as written (apt-get install from the archive).
# Each image is then started once: the binary answers --version and the programs it runs
# exist. Needs buildah and debootstrap (.ci/run installs them).
#
# --check, for machines where no builder can run: for each
# Containerfile, its runtime package list (the `# runtime-packages:` line, which must match its
# apt-get install) resolves with apt on this Debian release, and every shared library the
# binary it ships links against comes from a package the runtime stage has (that list, Debian's
# essential packages, and their dependencies); its ENTRYPOINT is /usr/bin/<image name>, the binary the manifests'
# checks assume (csi/tests/deploy_manifests.rs).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGES=(csi agent)  # deploy/images/Containerfile.<name> -> image pillar-<name>

check() {
  local name file image pkgs lib pkg stage essential problems=0 bin
  . /etc/os-release
  essential=$(dpkg-query -W -f '${Package} ${Essential}\n' | awk '$2 == "yes" { print $1 }' | tr '\n' ' ')
  [[ ${VERSION_CODENAME:-} == bookworm ]] ||
    echo "check-images: WARNING: this machine is $PRETTY_NAME, the images are bookworm: package names may differ"
  for name in "${IMAGES[@]}"; do
    file=deploy/images/Containerfile.$name
    image=pillar-$name
    pkgs=$(sed -n 's/^# runtime-packages: //p' "$file")
    [[ -n $pkgs ]] || { echo "FAIL $file: no '# runtime-packages:' line"; problems=1; continue; }
    # shellcheck disable=SC2086 # a word list
    if ! grep -q "apt-get install -y --no-install-recommends $pkgs" "$file"; then
      echo "FAIL $file: the apt-get install line does not install exactly: $pkgs"
      problems=1
    fi
    # shellcheck disable=SC2086
    if apt-get install --simulate -q --no-install-recommends $pkgs >/dev/null 2>"/tmp/check-images.$$"; then
      echo "ok   $image: runtime packages resolve: $pkgs"
    else
      echo "FAIL $image: apt cannot install $pkgs: $(tail -n 3 "/tmp/check-images.$$")"
      problems=1
    fi
    rm -f "/tmp/check-images.$$"
    grep -q "^ENTRYPOINT \[\"/usr/bin/$image\"\]" "$file" ||
      { echo "FAIL $file: ENTRYPOINT is not [\"/usr/bin/$image\"]"; problems=1; }
    bin=${CARGO_TARGET_DIR:-target}/debug/$image
    [[ $image == pillar-csi || $image == pillar-agent ]] || continue
    if [[ ! -x $bin ]]; then
      echo "FAIL $image: $bin not built (run the tests or cargo build first)"
      problems=1
      continue
    fi
    # The runtime stage's packages: Debian's essential set (every Debian image has it) and the
    # runtime list, with their dependencies.
    # shellcheck disable=SC2086
    stage=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
      --no-replaces --no-enhances $essential $pkgs 2>/dev/null | awk '/^[a-z0-9]/ { print $1 }' | sort -u | tr '\n' ' ')
    while read -r lib; do
      pkg=$(dpkg -S "$(readlink -f "$lib")" 2>/dev/null | head -n 1 | cut -d: -f1) ||
        pkg=$(dpkg -S "$lib" 2>/dev/null | head -n 1 | cut -d: -f1) || true
      [[ -n $pkg ]] || pkg=$(dpkg -S "$lib" 2>/dev/null | head -n 1 | cut -d: -f1) || true
      if [[ -z $pkg ]]; then
        echo "FAIL $image: $lib belongs to no Debian package"
        problems=1
        continue
      fi
      if [[ " $stage " == *" $pkg "* ]]; then
        echo "ok   $image: $(basename "$lib") from $pkg"
      else
        echo "FAIL $image: $(basename "$lib") comes from $pkg, not in the runtime stage"
        problems=1
      fi
    done < <(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')
  done
  return "$problems"
}

# The programs each image's binary runs, checked inside the built image.
declare -A PROGRAMS=(
  [csi]="mkfs.ext4 mkfs.xfs resize2fs xfs_growfs mount umount blkid"
  [agent]="lvm thin_check"
)

from_host() {
  local tag=${1:-ci} name image bin ctr base=localhost/pillar-base:bookworm prog dir uri
  export STORAGE_DRIVER=vfs
  local profile=${PROFILE:-debug}
  command -v buildah >/dev/null || { echo "build-images: buildah is missing" >&2; return 1; }
  if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || { echo "build-images: debootstrap is missing" >&2; return 1; }
    # shellcheck source=debian-mirror.sh
    source "$(dirname "$0")/debian-mirror.sh"
    uri=$(machine_debian_uri)
    dir=$(mktemp -d)
    echo "build-images: debootstrap --variant=minbase bookworm -> $base"
    debootstrap --variant=minbase bookworm "$dir/root" "$uri" >"$dir/debootstrap.log" 2>&1 ||
      { tail -n 5 "$dir/debootstrap.log" >&2; rm -rf "$dir"; return 1; }
    tar -C "$dir/root" -cf "$dir/base.tar" .
    ctr=$(buildah from scratch)
    buildah add "$ctr" "$dir/base.tar" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
    buildah commit -q "$ctr" "$base" >/dev/null
    buildah rm "$ctr" >/dev/null
    rm -rf "$dir"
  fi
  for name in "${IMAGES[@]}"; do
    image=pillar-$name
    bin=${CARGO_TARGET_DIR:-target}/$profile/$image
    [[ -x $bin ]] || { echo "build-images: $bin not built (cargo build first)" >&2; return 1; }
    ctr=$(buildah from "$base")
    buildah copy "$ctr" "$bin" "/out/$image" >/dev/null
    buildah commit -q "$ctr" "localhost/pillar-prebuilt-$name" >/dev/null
    buildah rm "$ctr" >/dev/null
    echo "build-images: buildah bud $image:$tag (binary from $bin)"
    buildah bud -q --isolation chroot -f "deploy/images/Containerfile.$name" -t "$image:$tag" \
      --build-arg "BUILDER=localhost/pillar-prebuilt-$name" --build-arg "RUNTIME=$base" . >/dev/null
    ctr=$(buildah from "localhost/$image:$tag")
    buildah run --isolation chroot "$ctr" -- "/usr/bin/$image" --version
    for prog in ${PROGRAMS[$name]}; do
      buildah run --isolation chroot "$ctr" -- sh -c "command -v $prog" >/dev/null ||
        { echo "FAIL $image: $prog is not in the image" >&2; buildah rm "$ctr" >/dev/null; return 1; }
    done
    buildah rm "$ctr" >/dev/null
    echo "ok   $image:$tag built; runs; has ${PROGRAMS[$name]}"
  done
  # The carriers and the layers the new images replaced are not kept.
  buildah rmi localhost/pillar-prebuilt-csi localhost/pillar-prebuilt-agent >/dev/null 2>&1 || true
  buildah rmi --prune >/dev/null 2>&1 || true
  buildah images --filter reference='localhost/pillar-*' 2>/dev/null || true
}

build() {
  local tag=$1 name tool=() builder
  if command -v podman >/dev/null; then
    builder=podman
    tool=(podman --storage-driver vfs build --isolation chroot)
  elif command -v buildah >/dev/null; then
    builder=buildah
    tool=(buildah --storage-driver vfs bud --isolation chroot)
  elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    builder=docker
    tool=(docker build)
  else
    echo "build-images: no image builder can run here (podman, buildah, or docker with a daemon)" >&2
    echo "build-images: scripts/build-images.sh --check checks the Containerfiles without one" >&2
    return 1
  fi
  for name in "${IMAGES[@]}"; do
    echo "build-images: $builder: pillar-$name:$tag"
    "${tool[@]}" -f "deploy/images/Containerfile.$name" -t "pillar-$name:$tag" \
      --build-arg "BUILDER=${BUILDER_IMAGE:-rust:1-bookworm}" \
      --build-arg "RUNTIME=${RUNTIME_IMAGE:-debian:bookworm-slim}" .
  done
}

if [[ ${1:-} == --check ]]; then
  check
elif [[ ${1:-} == --from-host ]]; then
  from_host "${2:-ci}"
else
  build "${1:-0.1.0}"
fi
