#!/bin/sh
# Runs a cargo-fuzz target (fuzz/fuzz_targets/TARGET.rs), or every target with `all`, for
# SECONDS each, starting from its checked-in corpus (fuzz/corpus/TARGET). New inputs go to a
# scratch directory; a crash leaves its input in fuzz/artifacts/TARGET and fails the script.
#
#   scripts/fuzz-smoke.sh rewriter 30
#   scripts/fuzz-smoke.sh all 600
#
# CI does not run this (a build instrumented for libFuzzer of every pillar crate costs more than
# CI can spend); the test run replays every corpus file through the same checks
# (fuzz/oracles/tests/corpus_replay.rs).
#
# Needs cargo-fuzz (cargo install cargo-fuzz). On a stable toolchain RUSTC_BOOTSTRAP=1 lets it
# use the sanitizer flags; FUZZ_SANITIZER=none where the ASan runtime is missing (the targets'
# code is safe Rust; none runs several times faster).
set -eu
target=${1:?usage: scripts/fuzz-smoke.sh TARGET|all [SECONDS]}
seconds=${2:-30}
cd "$(dirname "$0")/../fuzz"
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "cargo-fuzz is not installed: cargo install cargo-fuzz" >&2
    exit 1
fi
if [ "$target" = all ]; then
    targets=$(ls fuzz_targets | sed 's/\.rs$//')
else
    targets=$target
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for t in $targets; do
    mkdir -p "$scratch/$t"
    RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer "${FUZZ_SANITIZER:-address}" "$t" \
        "$scratch/$t" "corpus/$t" -- -max_total_time="$seconds" -max_len=20000 -rss_limit_mb=1024
done
