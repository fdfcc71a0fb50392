#!/bin/sh
# Folds what longer fuzz runs found into the checked-in corpus of a target (fuzz/corpus/TARGET):
# libFuzzer's set-cover merge of the corpus and the given directories keeps the smallest set of
# inputs it finds that reaches every feature any of them reached; the inputs it keeps that are
# not checked in yet are added under their SHA-1 (the named seeds stay). The test run replays
# every file (fuzz/oracles/tests/corpus_replay.rs), so what one machine's runs found is checked
# on every later one.
#
#   scripts/fuzz-merge.sh records ~/.cache/pillar/fuzz/records
#
# Needs cargo-fuzz, as scripts/fuzz-smoke.sh does (FUZZ_SANITIZER as there).
set -eu
target=${1:?usage: scripts/fuzz-merge.sh TARGET DIR...}
shift
cd "$(dirname "$0")/../fuzz"
merged=$(mktemp -d)
trap 'rm -rf "$merged"' EXIT
RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer "${FUZZ_SANITIZER:-address}" "$target" \
    "$merged" "corpus/$target" "$@" -- -set_cover_merge=1 -max_len=20000 -rss_limit_mb=1024
sha1sum "corpus/$target"/* | cut -d' ' -f1 >"$merged.sums"
trap 'rm -rf "$merged" "$merged.sums"' EXIT
added=0
for f in "$merged"/*; do
    [ -f "$f" ] || continue
    sum=$(sha1sum "$f" | cut -d' ' -f1)
    if ! grep -qx "$sum" "$merged.sums"; then
        cp "$f" "corpus/$target/$sum"
        echo "$sum" >>"$merged.sums"
        added=$((added + 1))
    fi
done
echo "$target: $added inputs added to corpus/$target"
