#!/usr/bin/env bash
# Prefill-shaped GEMM per weight type: ternfleet's kernels against llama.cpp's ggml CPU backend,
# measured alternately in this one invocation at the same thread count, on the same matrices
# (M x K weights of random blocks with a fixed small scale, N = 512 f32 activation rows; both
# sides time converting the activations to the weight type's vec_dot type plus the product).
#
#   llama.cpp: a small harness over ggml's public API (written out below, compiled against the
#     static libraries of target/llama.cpp/build): ggml_mul_mat on the CPU backend with
#     ggml_backend_cpu_set_n_threads(THREADS). It times two paths where they differ:
#       plain   weights in the default CPU buffer (what test-backend-ops measures): llamafile's
#               tinyBLAS for f16/bf16/q8_0/q4_0/q5_0, the tiled K-quant matmul (ggml-cpu/tiled,
#               from 8 tokens) for q2_K/q3_K/q4_K/q5_K/q6_K and the IQ types, the vec_dot loop for q4_1/q5_1 (no GEMM
#               for them on x86) and tq1_0/tq2_0
#       repack  weights in the CPU_REPACK extra buffer type, which llama.cpp loads a model's
#               weights into by default (on x86: q4_0 -> q4_0_8x8, q4_K -> q4_K_8x8,
#               iq4_nl -> iq4_nl_8x8; on AVX-512 machines q2_K -> q2_K_8x8)
#     The reference column is the path llama.cpp's inference takes: repack where CPU_REPACK
#     takes the type, plain elsewhere.
#   ternfleet: kernels/examples/gemm_bench.rs (quantize_par + matmul_par as the engine runs
#     them), in Parity and Invariant numerics. tf2/tf1 are compared with llama.cpp's tq2_0.
#   cross-check: test-backend-ops perf for the same MUL_MAT case, which runs at
#     max(1, hardware_concurrency / 2) threads and has no option to change it; it is run only
#     when THREADS equals that number.
# Each of R rounds runs, per type, llama.cpp then ternfleet; a measurement is the median of
# RUNS timed runs after one warm-up, and the table prints the median over rounds.
# Ratio = llama.cpp time / ternfleet time (> 1: ternfleet faster). Both sides print output row 0
# of token 0 and the sum of all outputs (check=, sum=) so they can be seen to compute the same.
# The "CPU:" line says how much CPU other processes took during the run: on a 2-core machine a
# 2-thread comparison is only meaningful when that is ~0 (a preempted thread stalls ggml's
# spinning barrier far longer than rayon's work stealing, which flatters ternfleet).
#
# usage: benches/gemm-vs-llama-cpp.sh [-t THREADS] [-r REPS] [-n RUNS] [-m M] [-k K] [-b N]
#          [--types f16,bf16,...] [--no-build] [--no-tbo] [--llama-build DIR]
# --llama-build DIR links the harness against another llama.cpp build (default
# target/llama.cpp/build). To compare the AVX2 kernels on an AVX-512 machine:
#   scripts/build-llama-cpp.sh --avx2
#   TERNFLEET_KERNELS=avx2 benches/gemm-vs-llama-cpp.sh --llama-build target/llama.cpp/build-avx2
# (test-backend-ops is not run then: it belongs to the default build.)
# Needs: scripts/build-llama-cpp.sh run first (target/llama.cpp/build), g++, cargo. No network.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
threads=2 reps=3 runs=3 M=4096 K=14336 N=512 build=1 tbo_on=1 llama_build=
types=f16,bf16,q8_0,q4_0,q5_0,q4_K,q5_K,q6_K,tq1_0,tq2_0,tf2,tf1
usage() { echo "usage: $0 [-t THREADS] [-r REPS] [-n RUNS] [-m M] [-k K] [-b N] [--types LIST] [--no-build] [--no-tbo] [--llama-build DIR]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    -t) threads=$2; shift 2 ;;
    -r) reps=$2; shift 2 ;;
    -n) runs=$2; shift 2 ;;
    -m) M=$2; shift 2 ;;
    -k) K=$2; shift 2 ;;
    -b) N=$2; shift 2 ;;
    --types) types=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    --no-tbo) tbo_on=0; shift ;;
    --llama-build) llama_build=$2; shift 2 ;;
    *) usage ;;
  esac
done
L="$root/target/llama.cpp"
S="$L/src/vendor/llama.cpp"
B="$L/build"
if [ -n "$llama_build" ]; then B=$(cd "$llama_build" && pwd); tbo_on=0; fi
for lib in libggml.a libggml-cpu.a libggml-base.a; do
  [ -f "$B/ggml/src/$lib" ] || { echo "gemm: missing $B/ggml/src/$lib: run scripts/build-llama-cpp.sh" >&2; exit 1; }
done

# ---- llama.cpp side: the ggml harness -------------------------------------------------------
ref="$L/ref/ref-gemm-$(printf %s "$B" | md5sum | cut -c1-8)"  # one harness per llama.cpp build
refsrc="$L/ref/ref-gemm.cpp"
mkdir -p "$L/ref"
cat >"$refsrc.new" <<'CPP'
// Written by benches/gemm-vs-llama-cpp.sh. Usage: ref-gemm TYPE M K N THREADS RUNS
// Times ggml_mul_mat(W[M x K] of TYPE, X[N x K] f32) on ggml's CPU backend at THREADS threads,
// with W in the default CPU buffer ("plain") and, where the CPU_REPACK buffer type takes TYPE,
// also repacked ("repack"); runs of the two alternate. Prints per path:
//   ref TYPE MxK n=N t=T path=plain|repack median_us=.. min_us=.. gflops=.. check=y[0] sum=Σy
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// Same bytes as kernels/examples/gemm_bench.rs `weights`.
static std::vector<uint8_t> fill_weights(ggml_type type, size_t len) {
    std::vector<uint8_t> v(len + 8);
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < len; i += 8) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        memcpy(&v[i], &s, 8);
    }
    v.resize(len);
    auto small = [](uint8_t b) { return ((float) b - 127.5f) / 4096.0f; };
    if (type == GGML_TYPE_F16) {
        for (size_t i = 0; i < len; i += 2) { ggml_fp16_t h = ggml_fp32_to_fp16(small(v[i])); memcpy(&v[i], &h, 2); }
        return v;
    }
    if (type == GGML_TYPE_BF16) {
        for (size_t i = 0; i < len; i += 2) { ggml_bf16_t h = ggml_fp32_to_bf16(small(v[i])); memcpy(&v[i], &h, 2); }
        return v;
    }
    std::vector<size_t> offs;
    switch (type) {
        case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0: offs = {0}; break;
        case GGML_TYPE_IQ4_NL: case GGML_TYPE_IQ4_XS: case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ3_XXS: offs = {0}; break;
        case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ2_S: case GGML_TYPE_IQ3_S: case GGML_TYPE_IQ1_S: offs = {0}; break;
        case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_1: offs = {0, 2}; break;
        case GGML_TYPE_Q6_K: offs = {208}; break;
        case GGML_TYPE_Q3_K: offs = {108}; break;
        case GGML_TYPE_Q2_K: offs = {80, 82}; break;
        case GGML_TYPE_TQ1_0: offs = {52}; break;
        case GGML_TYPE_TQ2_0: offs = {64}; break;
        default: break;
    }
    const size_t bs = ggml_type_size(type);
    ggml_fp16_t one = ggml_fp32_to_fp16(0.01f);
    for (size_t b = 0; b + bs <= len; b += bs) {
        for (size_t o : offs) memcpy(&v[b + o], &one, 2);
        // IQ1_M: the f16 scale is the top nibbles of the four u16 scale words at 48.
        if (type == GGML_TYPE_IQ1_M)
            for (int i = 0; i < 4; i++)
                v[b + 49 + 2 * i] = (uint8_t) ((v[b + 49 + 2 * i] & 0x0F) | (((one >> (4 * i)) & 0xF) << 4));
    }
    return v;
}

struct Path {
    std::string name;
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t wbuf = nullptr, xbuf = nullptr;
    ggml_cgraph * gf = nullptr;
    ggml_tensor * y = nullptr;
    std::vector<double> us;
};

// Builds W in `buft`; returns false (and frees) when `require_extra` and the buffer type did not
// take the tensor (tensor->extra == NULL: no repacked layout for this type/shape).
static bool make_path(Path & p, ggml_backend_t be, ggml_backend_buffer_type_t buft, bool require_extra,
                      ggml_type type, int64_t M, int64_t K, int64_t N,
                      const std::vector<uint8_t> & wdata, const std::vector<float> & xdata) {
    ggml_init_params ip = { ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true };
    p.ctx = ggml_init(ip);
    ggml_tensor * w = ggml_new_tensor_2d(p.ctx, type, K, M);
    p.wbuf = ggml_backend_buft_alloc_buffer(buft, ggml_backend_buft_get_alloc_size(buft, w));
    if (!p.wbuf) { fprintf(stderr, "alloc failed\n"); exit(1); }
    ggml_tallocr ta = ggml_tallocr_new(p.wbuf);
    if (ggml_tallocr_alloc(&ta, w) != GGML_STATUS_SUCCESS) { fprintf(stderr, "tallocr failed\n"); exit(1); }
    if (require_extra && w->extra == nullptr) {
        ggml_backend_buffer_free(p.wbuf); ggml_free(p.ctx); p.wbuf = nullptr; p.ctx = nullptr;
        return false;
    }
    ggml_backend_buffer_set_usage(p.wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_tensor_set(w, wdata.data(), 0, wdata.size());
    ggml_tensor * x = ggml_new_tensor_2d(p.ctx, GGML_TYPE_F32, K, N);
    p.y = ggml_mul_mat(p.ctx, w, x);
    p.xbuf = ggml_backend_alloc_ctx_tensors(p.ctx, be);
    ggml_backend_tensor_set(x, xdata.data(), 0, xdata.size() * sizeof(float));
    p.gf = ggml_new_graph(p.ctx);
    ggml_build_forward_expand(p.gf, p.y);
    return true;
}

int main(int argc, char ** argv) {
    if (argc != 7) { fprintf(stderr, "usage: %s TYPE M K N THREADS RUNS\n", argv[0]); return 2; }
    const std::string tname = argv[1];
    ggml_type type = GGML_TYPE_COUNT;
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * n = ggml_type_name((ggml_type) t);
        if (n && tname == n && ggml_type_size((ggml_type) t) > 0) type = (ggml_type) t;
    }
    if (type == GGML_TYPE_COUNT) { fprintf(stderr, "unknown type %s\n", tname.c_str()); return 2; }
    const int64_t M = atoll(argv[2]), K = atoll(argv[3]), N = atoll(argv[4]);
    const int threads = atoi(argv[5]), runs = std::max(1, atoi(argv[6]));
    if (M <= 0 || K <= 0 || N <= 0 || K % ggml_blck_size(type) != 0 || threads <= 0) { fprintf(stderr, "bad args\n"); return 2; }

    ggml_backend_t be = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(be, threads);
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_buffer_type_t repack = nullptr;
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (get_extra) {
        for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b; ++b)
            if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) repack = *b;
    }

    const std::vector<uint8_t> wdata = fill_weights(type, ggml_row_size(type, K) * M);
    std::vector<float> xdata(K * N);
    {   // same activations as gemm_bench.rs `activations`
        uint64_t s = 0x2545F4914F6CDD1Dull;
        auto u = [&]() { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return (float) (s >> 40) / (float) (1u << 24); };
        for (auto & v : xdata) { float a = 0; for (int j = 0; j < 4; ++j) a += u(); v = a * 1.732f - 3.464f; }
    }

    std::vector<Path> paths(1);
    paths[0].name = "plain";
    make_path(paths[0], be, ggml_backend_cpu_buffer_type(), false, type, M, K, N, wdata, xdata);
    if (repack) {
        Path p; p.name = "repack";
        if (make_path(p, be, repack, true, type, M, K, N, wdata, xdata)) paths.push_back(p);
    }
    for (int i = 0; i < runs + 1; ++i) {
        for (auto & p : paths) {
            auto t0 = std::chrono::steady_clock::now();
            if (ggml_backend_graph_compute(be, p.gf) != GGML_STATUS_SUCCESS) { fprintf(stderr, "compute failed\n"); return 1; }
            auto t1 = std::chrono::steady_clock::now();
            if (i > 0) p.us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        }
    }
    const double flops = 2.0 * M * N * K;
    for (auto & p : paths) {
        std::sort(p.us.begin(), p.us.end());
        const double med = p.us[p.us.size() / 2];
        std::vector<float> y(M * N);
        ggml_backend_tensor_get(p.y, y.data(), 0, y.size() * sizeof(float));
        double sum = 0;
        for (float v : y) sum += v;
        printf("ref %s %lldx%lld n=%lld t=%d path=%s median_us=%.1f min_us=%.1f gflops=%.2f check=%g sum=%g\n", tname.c_str(),
               (long long) M, (long long) K, (long long) N, threads, p.name.c_str(), med, p.us[0], flops / med / 1e3,
               (double) y[0], sum);
        ggml_backend_buffer_free(p.xbuf); ggml_backend_buffer_free(p.wbuf); ggml_free(p.ctx);
    }
    ggml_backend_free(be);
    return 0;
}
CPP
if ! cmp -s "$refsrc.new" "$refsrc"; then mv "$refsrc.new" "$refsrc"; else rm -f "$refsrc.new"; fi
if [ ! -x "$ref" ] || [ "$refsrc" -nt "$ref" ] || [ "$B/ggml/src/libggml-cpu.a" -nt "$ref" ]; then
  echo "gemm: compiling $ref" >&2
  g++ -O2 -std=c++17 -I"$S/ggml/include" "$refsrc" -o "$ref" \
    "$B/ggml/src/libggml.a" "$B/ggml/src/libggml-cpu.a" "$B/ggml/src/libggml-base.a" \
    -fopenmp -lpthread -ldl -lm
fi

# ---- ternfleet side ---------------------------------------------------------------------------
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
ours="$CARGO_TARGET_DIR/release/examples/gemm_bench"
if [ "$build" = 1 ]; then
  (cd "$root" && cargo build --release -p ternfleet-kernels --example gemm_bench >&2)
fi
[ -x "$ours" ] || { echo "gemm: $ours missing (cargo build --release -p ternfleet-kernels --example gemm_bench)" >&2; exit 1; }

tbo="$B/bin/test-backend-ops"
tbo_threads=$(( $(getconf _NPROCESSORS_ONLN) / 2 )); [ "$tbo_threads" -ge 1 ] || tbo_threads=1
run_tbo=0
if [ "$tbo_on" = 1 ] && [ -x "$tbo" ] && [ "$tbo_threads" = "$threads" ]; then run_tbo=1; fi

log=$(mktemp); trap 'rm -f "$log" "$log.err" "$log.t0" "$log.t1"' EXIT
# CPU seconds used by everything on the machine (/proc/stat) and by this script's children (the
# benchmarks; bash `times`), so the table can say how much CPU other processes took meanwhile.
machine_cpu() { awk -v hz="$(getconf CLK_TCK)" '/^cpu /{print ($2+$3+$4+$7+$8)/hz, $9/hz; exit}' /proc/stat; }
# (`times` must run in this shell, not in a $(...) subshell, to see its children.)
children_cpu() { tail -n 1 "$1" | awk '{ s = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); s += a[1] * 60 + a[2] } print s }'; }
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
times >"$log.t0"; read -r mc0 st0 < <(machine_cpu); wall0=$(date +%s.%N)
ref_types=$(echo "$types" | tr ',' '\n' | sed 's/^tf[12]$/tq2_0/' | awk '!seen[$0]++' | tr '\n' ' ')
echo "gemm: M=$M K=$K N=$N threads=$threads rounds=$reps runs=$runs types=$types; load before: $load_before" >&2
for r in $(seq 1 "$reps"); do
  for ty in $ref_types; do
    echo "gemm: round $r/$reps $ty" >&2
    "$ref" "$ty" "$M" "$K" "$N" "$threads" "$runs" >>"$log" 2>"$log.err" \
      || { echo "gemm: ref-gemm $ty failed:" >&2; tail -n 5 "$log.err" >&2; exit 1; }
    if [ "$run_tbo" = 1 ]; then
      "$tbo" perf -b CPU -o MUL_MAT -p "type_a=$ty,type_b=f32,m=$M,n=$N,k=$K,bs=\\[1,1\\],nr=\\[1,1\\],per=\\[0,1,2,3\\]" 2>&1 \
        | grep -E '^ *MUL_MAT.* us/run' | sed "s/^ */tbo $ty /" >>"$log" || true
    fi
    ours_types=$ty
    [ "$ty" = tq2_0 ] && ours_types=$(echo "$types" | tr ',' '\n' | grep -E '^(tq2_0|tf2|tf1)$' | paste -sd, -)
    if [ -n "$ours_types" ]; then
      "$ours" "$ours_types" "$M" "$K" "$N" "$threads" "$runs" >>"$log" 2>"$log.err" \
        || { echo "gemm: gemm_bench $ours_types failed:" >&2; tail -n 5 "$log.err" >&2; exit 1; }
    fi
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
times >"$log.t1"; read -r mc1 st1 < <(machine_cpu); wall1=$(date +%s.%N)
cc0=$(children_cpu "$log.t0"); cc1=$(children_cpu "$log.t1")
others=$(awk -v a="$mc0" -v b="$mc1" -v c="$cc0" -v d="$cc1" -v w0="$wall0" -v w1="$wall1" -v s0="$st0" -v s1="$st1" \
  'BEGIN { o = (b - a) - (d - c); if (o < 0) o = 0; w = w1 - w0; if (w <= 0) w = 1e-9;
    printf "%.1f s wall; this benchmark used %.1f CPU-s, other processes %.1f CPU-s (%.2f cores on average), hypervisor steal %.1f s", w, d - c, o, o / w, s1 - s0 }')

echo "llama.cpp: $B; ternfleet kernels: $(sed -n 's/^gemm_bench: kernels //p' "$log.err" 2>/dev/null | head -n 1)"
python3 - "$log" "$types" "$M" "$K" "$N" "$threads" "$reps" "$runs" "$load_before" "$load_after" "$run_tbo" "$tbo_threads" "$others" <<'PY'
import re, statistics, sys
log, types, M, K, N, T, reps, runs, lb, la, run_tbo, tbo_t, others = sys.argv[1:]
types = types.split(","); M, K, N = int(M), int(K), int(N)
flops = 2.0 * M * N * K
med = statistics.median
ref, ours, tbo, sums = {}, {}, {}, {}
for line in open(log):
    sm = re.search(r" sum=(\S+)", line)
    m = re.match(r"ref (\S+) \S+ n=\d+ t=\d+ path=(\S+) median_us=([\d.]+)", line)
    if m:
        ref.setdefault((m[1], m[2]), []).append(float(m[3]))
        if sm: sums[("ref", m[1], m[2])] = float(sm[1])
        continue
    m = re.match(r"ours (\S+) \S+ n=\d+ t=\d+ numerics=(\S+) median_us=([\d.]+)", line)
    if m:
        ours.setdefault((m[1], m[2]), []).append(float(m[3]))
        if sm: sums[("ours", m[1], m[2])] = float(sm[1])
        continue
    m = re.match(r"tbo (\S+) .* ([\d.]+) us/run", line)
    if m:
        tbo.setdefault(m[1], []).append(float(m[2]))
# Same matrices, same product: the output sums of the two sides must agree (f32 rounding aside).
for (who, ty, var), v in sums.items():
    if who != "ours" or ty in ("tf2", "tf1"):
        continue
    r = sums.get(("ref", ty, "plain"))
    if r is not None and abs(v - r) > 1e-3 * max(abs(r), 1.0):
        print(f"WARNING: {ty} {var}: output sum {v:g} differs from llama.cpp's {r:g}")
def ms(us): return f"{us / 1e3:.1f}"
def gf(us): return f"{flops / us / 1e3:.0f}"
print(f"GEMM M={M} (weight rows) x K={K} (columns), N={N} tokens, {T} thread(s); median of {reps} rounds x {runs} runs; load average before {lb}, after {la}")
print(f"CPU: {others}")
print()
hdr = ("| weights | llama.cpp path | llama.cpp ms | GFLOP/s | ours parity ms | GFLOP/s | ratio "
       "| ours invariant ms | GFLOP/s | ratio | llama.cpp plain ms | ratio vs faster llama.cpp path (parity / invariant) |")
if run_tbo == "1":
    hdr += f" test-backend-ops ms (t={tbo_t}) |"
print(hdr)
print("|" + "---|" * (hdr.count("|") - 1))
for ty in types:
    rty = "tq2_0" if ty in ("tf2", "tf1") else ty
    plain = ref.get((rty, "plain")); rep = ref.get((rty, "repack"))
    if not plain or (ty, "parity") not in ours:
        print(f"| {ty} | (missing) |"); continue
    lpath = "repack" if rep else "plain"
    l = med(rep or plain); lp = med(plain); best = min(l, lp)
    p = med(ours[(ty, "parity")]); i = med(ours[(ty, "invariant")])
    name = ty if rty == ty else f"{ty} (vs tq2_0)"
    row = (f"| {name} | {lpath} | {ms(l)} | {gf(l)} | {ms(p)} | {gf(p)} | {l / p:.2f}x | {ms(i)} | {gf(i)} | {l / i:.2f}x "
           f"| {ms(lp) if rep else '='} | {best / p:.2f}x / {best / i:.2f}x |")
    if run_tbo == "1":
        row += f" {ms(med(tbo[rty])) if rty in tbo else '-'} |"
    print(row)
PY
