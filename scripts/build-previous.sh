#!/usr/bin/env bash
# Builds the previous release's `ternfleet` into target/previous/ternfleet: the rolling-upgrade
# test (coordinator/tests/control.rs) runs a cluster of its nodes, then upgrades them one by one
# to this build under load. The release is the commit in scripts/previous-release (it must be
# in this clone's history); its sources are exported with `git archive` and built beside ours
# (its own target directory: ~6 minutes on 2 cores, once).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rev=$(tr -d '[:space:]' <"$root/scripts/previous-release")
out=$root/target/previous
if [ -x "$out/ternfleet" ] && [ "$(cat "$out/rev" 2>/dev/null)" = "$rev" ]; then
  exit 0
fi
if ! git -C "$root" cat-file -e "$rev^{commit}" 2>/dev/null; then
  echo "build-previous: commit $rev is not in this clone's history (a shallow clone?)" >&2
  exit 1
fi
rm -rf "$out/src" "$out/ternfleet"
mkdir -p "$out/src"
git -C "$root" archive "$rev" | tar -x -C "$out/src"
echo "build-previous: building ternfleet at $rev (the previous release) ..." >&2
# Line tables only and no incremental cache, whatever that release's Cargo.toml says; its own
# crates unoptimised (opt-level 0: 6 minutes to build on 2 cores against 8.5 at its 3; the test
# runs a tiny model, and the output is the same bits at any level); its build directory goes
# once the binary is out (disk on CI machines is not plentiful).
CARGO_PROFILE_TEST_OPT_LEVEL=0 CARGO_PROFILE_TEST_DEBUG=line-tables-only CARGO_INCREMENTAL=0 \
  CARGO_TARGET_DIR="$out/target" cargo build --quiet --locked --profile test \
  --manifest-path "$out/src/Cargo.toml" --bin ternfleet
cp "$out/target/debug/ternfleet" "$out/ternfleet"
rm -rf "$out/target" "$out/src"
echo "$rev" >"$out/rev"
