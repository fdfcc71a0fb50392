#!/usr/bin/env bash
# Runs pillar's test suite: every crate's unit and integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked
