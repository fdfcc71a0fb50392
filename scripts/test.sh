#!/usr/bin/env bash
# Runs pillar's test suite: every crate's unit and integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Python gRPC client scripts/setup.sh installs: its test must run, not skip.
venv="${PILLAR_PYTHON_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pillar/python-grpc}"
# The manifest test (kubectl and kubernetes-validate) must run too.
export PILLAR_PYTHON="$venv/bin/python" PILLAR_REQUIRE_PYTHON_GRPC=1 PILLAR_REQUIRE_MANIFEST_TOOLS=1
cargo test --workspace --locked
