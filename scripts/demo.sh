#!/usr/bin/env bash
# The README's main command: fetch the default model (once), build ternfleet, and answer a prompt
# on a single-node cluster (everything in one process). Extra arguments go to `ternfleet generate`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
prompt=${1:-"The three most useful things to know about distributed systems are"}
shift || true
./scripts/fetch-model.sh >&2
cargo build --release --quiet -p ternfleet-coordinator
exec ./target/release/ternfleet generate -m models/gemma-3-270m-q4_k_m.gguf -p "$prompt" -n 64 --temp 0 "$@"
