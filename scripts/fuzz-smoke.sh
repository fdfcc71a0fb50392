#!/bin/sh
# Runs a cargo-fuzz target (fuzz/fuzz_targets/TARGET.rs) for SECONDS, starting from its checked-in
# seed corpus (fuzz/corpus/TARGET), as CI does briefly for each target. New inputs go to a
# scratch directory; a crash leaves its input in fuzz/artifacts/TARGET and fails the script.
#
#   scripts/fuzz-smoke.sh rewriter 30
#
# Needs cargo-fuzz (cargo install cargo-fuzz). On a stable toolchain RUSTC_BOOTSTRAP=1 lets it
# use the sanitizer flags; FUZZ_SANITIZER=none where the ASan runtime is missing.
set -eu
target=${1:?usage: scripts/fuzz-smoke.sh TARGET [SECONDS]}
seconds=${2:-30}
cd "$(dirname "$0")/../fuzz"
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "cargo-fuzz is not installed: cargo install cargo-fuzz" >&2
    exit 1
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer "${FUZZ_SANITIZER:-address}" "$target" \
    "$scratch" "corpus/$target" -- -max_total_time="$seconds" -max_len=20000
