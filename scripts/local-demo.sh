#!/usr/bin/env bash
# pillar on one machine: builds the binaries, then runs agent (file backend), controller
# (embedded store) and node plugin together and drives one volume through the CSI calls kubelet
# makes: create, publish, stage (mkfs, mount), publish to a pod path, write and verify data,
# stats, and teardown. Needs root (loop devices, mounts).
# Usage: scripts/local-demo.sh [DIR]      (default: a fresh temporary directory)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-$(mktemp -d -t pillar-local.XXXXXX)}
# The workspace test build builds every binary too, with the features the tests use: one build
# serves this demo, scripts/test.sh and the kernel lane.
cargo test --locked --workspace --no-run --quiet
exec "${CARGO_TARGET_DIR:-./target}/debug/pillar-local" --dir "$dir" --demo
