#!/usr/bin/env bash
# Installs what pillar's build and tests need on a Debian machine with Rust. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v mkfs.xfs >/dev/null || need+=(xfsprogs)
command -v losetup >/dev/null || need+=(mount)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need[*]}"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; then
    apt-get update >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null
  fi
fi
cargo fetch --locked >/dev/null
# A Python gRPC client (grpcio) for the test that calls the CSI socket as C-core clients do; in
# a venv outside the checkout, reused by later runs.
venv="${PILLAR_PYTHON_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pillar/python-grpc}"
if ! "$venv/bin/python" -c 'import grpc' 2>/dev/null; then
  echo "setup: python venv with grpcio at $venv"
  if ! python3 -m venv --clear "$venv" >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv >/dev/null \
      || { apt-get update >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv >/dev/null; }
    python3 -m venv --clear "$venv"
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check grpcio
fi
echo "setup: done"
