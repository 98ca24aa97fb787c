#!/usr/bin/env bash
# A test model made of Q5_0 and Q8_0 matrices, the types llama.cpp's Q4_K_M recipe falls back to
# when rows are not a multiple of 256 (most matrices of several 0.5B-1.5B models): Gemma 3 270M
# with every matrix Q5_0 (llama-quantize --pure) and the token embedding / tied LM head Q8_0.
# Made from the f16 dequantization scripts/test.sh writes, by the llama.cpp build of
# scripts/build-llama-cpp.sh. Used by benches (compare-llama-cpp.sh -m ...), not by tests.
#
#   scripts/make-q5_0-model.sh    -> models/gemma-3-270m-q5_0.gguf
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=models/gemma-3-270m-q5_0.gguf
[ -f "$out" ] && { echo "model: $root/$out (exists)"; exit 0; }
./scripts/fetch-model.sh gemma
[ -f models/gemma-3-270m-f16.gguf ] || python3 scripts/dequantize-model.py \
  models/gemma-3-270m-q4_k_m.gguf models/gemma-3-270m-f16.gguf
./scripts/build-llama-cpp.sh >&2
target/llama.cpp/build/bin/llama-quantize --pure --token-embedding-type q8_0 \
  models/gemma-3-270m-f16.gguf "$out.tmp" Q5_0 >&2
mv "$out.tmp" "$out"
echo "model: $root/$out"
