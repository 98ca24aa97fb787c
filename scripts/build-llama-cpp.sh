#!/usr/bin/env bash
# Build the reference engine (llama.cpp, from the llama-cpp-python 0.3.36 sdist on PyPI) outside
# the source tree, under target/llama.cpp/. Produces llama-simple, llama-tokenize,
# llama-perplexity, llama-bench and test-backend-ops in target/llama.cpp/build/bin.
# Only used to make reference outputs and benchmark baselines; none of its code is committed.
# With --source-only it only downloads and unpacks the source (the tokenizer tests read the
# vocabulary files models/ggml-vocab-*.gguf that ship in it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/target/llama.cpp"
bin="$dir/build/bin"
source_only=0
[ "${1:-}" = "--source-only" ] && source_only=1
if [ "$source_only" = 0 ] && [ -x "$bin/llama-simple" ] && [ -x "$bin/llama-bench" ] && [ -x "$bin/test-backend-ops" ]; then
  echo "llama.cpp: $bin"; exit 0
fi
mkdir -p "$dir"
if [ ! -d "$dir/src/vendor/llama.cpp" ]; then
  python3 -m pip download --no-deps --no-binary llama-cpp-python --quiet -d "$dir/dl" llama-cpp-python==0.3.36
  rm -rf "$dir/src"; mkdir -p "$dir/src"
  tar -xzf "$dir"/dl/llama_cpp_python-0.3.36.tar.gz -C "$dir/src" --strip-components=1
fi
if [ "$source_only" = 1 ]; then
  echo "llama.cpp source: $dir/src/vendor/llama.cpp"; exit 0
fi
command -v cmake >/dev/null || python3 -m pip install --quiet cmake
cmake -S "$dir/src/vendor/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$dir/build" -j"$(nproc)" --target llama-simple llama-tokenize llama-perplexity \
  llama-bench test-backend-ops llama-quantize 2>&1 | tail -n 3
echo "llama.cpp: $bin"
