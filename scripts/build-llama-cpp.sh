#!/usr/bin/env bash
# Build the reference engine (llama.cpp, from the llama-cpp-python 0.3.36 sdist on PyPI) outside
# the source tree, under target/llama.cpp/. Produces llama-simple, llama-tokenize,
# llama-perplexity, llama-bench, llama-batched-bench and test-backend-ops in target/llama.cpp/build/bin.
# Only used to make reference outputs and benchmark baselines; none of its code is committed.
# With --source-only it only downloads and unpacks the source (the tokenizer tests read the
# vocabulary files models/ggml-vocab-*.gguf that ship in it).
# With --rpc it builds, in the separate dir target/llama.cpp/build-rpc with the same instruction
# sets plus -DGGML_RPC=ON, only ggml-rpc-server and llama-bench (the baseline of
# benches/cluster-vs-llama-rpc.sh); the default build is left as it is.
# With --avx2 it builds, in target/llama.cpp/build-avx2, the ggml libraries (what
# benches/gemm-vs-llama-cpp.sh --llama-build links), llama-bench and llama-simple with
# AVX2/FMA/F16C and no AVX-512: the reference for ternfleet's AVX2 kernels
# (TERNFLEET_KERNELS=avx2) on a machine that has AVX-512 (benches/compare-llama-cpp.sh takes it
# as LLAMA_BIN=target/llama.cpp/build-avx2/bin).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/target/llama.cpp"
bin="$dir/build/bin"
source_only=0 rpc=0 avx2=0
case "${1:-}" in
  --source-only) source_only=1 ;;
  --rpc) rpc=1 ;;
  --avx2) avx2=1 ;;
  "") ;;
  *) echo "usage: $0 [--source-only | --rpc | --avx2]" >&2; exit 2 ;;
esac
if [ "$avx2" = 1 ] && [ -f "$dir/build-avx2/ggml/src/libggml-cpu.a" ] && [ -x "$dir/build-avx2/bin/llama-bench" ] \
  && [ -x "$dir/build-avx2/bin/llama-simple" ]; then
  echo "llama.cpp (AVX2): $dir/build-avx2"; exit 0
fi
if [ "$rpc" = 1 ] && [ -x "$dir/build-rpc/bin/ggml-rpc-server" ] && [ -x "$dir/build-rpc/bin/llama-bench" ]; then
  echo "llama.cpp (RPC): $dir/build-rpc/bin"; exit 0
fi
if [ "$source_only" = 0 ] && [ "$rpc" = 0 ] && [ "$avx2" = 0 ] && [ -x "$bin/llama-simple" ] && [ -x "$bin/llama-bench" ] && [ -x "$bin/test-backend-ops" ] && [ -x "$bin/llama-batched-bench" ] && [ -x "$bin/llama-server" ]; then
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
# The CPU kernels llama.cpp runs depend on the machine: a native build on an Intel CPU with AMX
# routes q4_0/q8_0/q4_K/q5_K/q6_K matmuls through its AMX code (which also crashed here,
# SIGSEGV in ggml_backend_amx_mul_mat under llama-bench), while AMD EPYC (Zen 4) runs the
# AVX-512 ones. So the reference is built for the same instruction sets everywhere: AVX2/FMA/F16C,
# plus AVX-512 (F/BW/VL/DQ, VNNI, VBMI, BF16) where the CPU has it, never AMX or AVX-VNNI. Its
# outputs then do not depend on which x86 machine made them (tests/data/refs).
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { case " $flags " in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
avx512=OFF
if [ "$(has avx512f)$(has avx512bw)$(has avx512vl)$(has avx512dq)$(has avx512_vnni)" = ONONONONON ]; then avx512=ON; fi
isa="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=$avx512"
if [ "$avx512" = ON ]; then
  isa="$isa -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_BF16=$(has avx512_bf16)"
fi
if [ "$avx2" = 1 ]; then
  echo "llama.cpp: building the ggml libraries for AVX2/FMA/F16C, no AVX-512" >&2
  cmake -S "$dir/src/vendor/llama.cpp" -B "$dir/build-avx2" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
    -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
  cmake --build "$dir/build-avx2" -j"$(nproc)" --target ggml ggml-cpu ggml-base llama-bench \
    llama-simple 2>&1 | tail -n 3
  echo "llama.cpp (AVX2): $dir/build-avx2"; exit 0
fi
echo "llama.cpp: building for $isa (no AMX, no AVX-VNNI)" >&2
if [ "$rpc" = 1 ]; then
  # shellcheck disable=SC2086
  cmake -S "$dir/src/vendor/llama.cpp" -B "$dir/build-rpc" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF $isa -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
    -DGGML_AMX_BF16=OFF -DGGML_RPC=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF \
    -DBUILD_SHARED_LIBS=OFF >/dev/null
  cmake --build "$dir/build-rpc" -j"$(nproc)" --target ggml-rpc-server llama-bench 2>&1 | tail -n 3
  echo "llama.cpp (RPC): $dir/build-rpc/bin"; exit 0
fi
# shellcheck disable=SC2086
cmake -S "$dir/src/vendor/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF $isa -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
  -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$dir/build" -j"$(nproc)" --target llama-simple llama-tokenize llama-perplexity \
  llama-bench llama-batched-bench test-backend-ops llama-quantize llama-server 2>&1 | tail -n 3
echo "llama.cpp: $bin"
