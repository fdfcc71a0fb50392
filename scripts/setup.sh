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
# Python tools of the tests, in a venv outside the checkout, reused by later runs: a gRPC client
# (grpcio) for the test that calls the CSI socket as C-core clients do, and kubernetes-validate
# for the offline check of the deploy manifests (scripts/check-manifests.py; kubectl renders).
venv="${PILLAR_PYTHON_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pillar/python-grpc}"
if ! "$venv/bin/python" -c 'import grpc, kubernetes_validate' 2>/dev/null; then
  echo "setup: python venv with grpcio and kubernetes-validate at $venv"
  if ! python3 -m venv --clear "$venv" >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv >/dev/null \
      || { apt-get update >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv >/dev/null; }
    python3 -m venv --clear "$venv"
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check grpcio kubernetes-validate
fi
command -v kubectl >/dev/null || echo "setup: WARNING: no kubectl: the manifest test fails (it renders deploy/ with kubectl kustomize)"
echo "setup: done"
