#!/usr/bin/env bash
# Ternary GEMV (one token): ternfleet (kernels/benches/ternary_gemv.rs) against llama.cpp's
# ggml CPU backend (benches/ref/ref-gemv.cpp, linked against the static ggml libraries of
# target/llama.cpp/build), measured alternately in this one invocation; prints the medians of
# the per-round medians and the ratio llama time / our time against llama.cpp's TQ2_0 (and
# TQ1_0 against TQ1_0). Also records test-backend-ops' own MUL_MAT perf line as a cross-check.
#
# Usage: benches/ternary-vs-llama-cpp.sh [ROUNDS]   (env: TERN_RUNS runs per measurement)
# Needs: scripts/build-llama-cpp.sh run first (target/llama.cpp/build), g++, cargo.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-3}"
runs="${TERN_RUNS:-40}"
L="$root/target/llama.cpp"
S="$L/src/vendor/llama.cpp"
B="$L/build"
for lib in libggml.a libggml-cpu.a libggml-base.a; do
  [ -f "$B/ggml/src/$lib" ] || { echo "missing $B/ggml/src/$lib: run scripts/build-llama-cpp.sh" >&2; exit 1; }
done

ref="$L/ref/ref-gemv"
src="$root/benches/ref/ref-gemv.cpp"
if [ ! -x "$ref" ] || [ "$src" -nt "$ref" ] || [ "$B/ggml/src/libggml-cpu.a" -nt "$ref" ]; then
  mkdir -p "$L/ref"
  g++ -O2 -std=c++17 -I"$S/ggml/include" "$src" -o "$ref" \
    "$B/ggml/src/libggml.a" "$B/ggml/src/libggml-cpu.a" "$B/ggml/src/libggml-base.a" \
    -fopenmp -lpthread -ldl -lm
fi

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
(cd "$root" && cargo bench -p ternfleet-kernels --bench ternary_gemv --no-run >/dev/null 2>&1) || {
  echo "cargo bench --no-run failed" >&2; exit 1; }
ours="$(cd "$root" && cargo bench -p ternfleet-kernels --bench ternary_gemv --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("target",{}).get("name")=="ternary_gemv" and m.get("executable"):
        print(m["executable"])' | tail -n 1)"
[ -x "$ours" ] || { echo "bench binary not found" >&2; exit 1; }

shapes="4096x14336 2048x5632 5632x2048"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for r in $(seq 1 "$rounds"); do
  echo "round $r/$rounds" >&2
  for shape in $shapes; do
    rows="${shape%x*}"; cols="${shape#*x}"
    for t in 1 2; do
      for ty in tq2_0 tq1_0; do
        "$ref" "$ty" "$rows" "$cols" "$t" "$runs" >>"$log"
      done
      TERN_RUNS="$runs" TERN_SHAPES="$shape" TERN_THREADS="$t" TERN_TYPES=tq2_0,tq1_0,tf2,tf1,tf1l \
        "$ours" | grep '^ours' >>"$log"
    done
  done
done

tbo="$B/bin/test-backend-ops"
cross="(test-backend-ops not built)"
if [ -x "$tbo" ]; then
  cross="$("$tbo" perf -b CPU -o MUL_MAT -p 'type_a=tq2_0,type_b=f32,m=4096,n=1,k=14336' 2>&1 | grep -E 'MUL_MAT' | head -n 1 || true)"
fi

python3 - "$log" "$cross" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"(ours|ref) (\S+) (\d+x\d+) t=(\d) median_us=([\d.]+)", line)
    if m:
        who, ty, shape, t, us = m.groups()
        rows.setdefault((shape, int(t), who, ty), []).append(float(us))
med = {k: statistics.median(v) for k, v in rows.items()}
print(f"{'shape':<11} {'thr':>3} {'type':<6} {'ours us':>9} {'llama us':>9} {'vs tq2_0':>9} {'vs same':>8}")
for shape in ("4096x14336", "2048x5632", "5632x2048"):
    for t in (1, 2):
        l2 = med.get((shape, t, "ref", "tq2_0"))
        for ty in ("tq2_0", "tq1_0", "tf2", "tf1", "tf1l"):
            o = med.get((shape, t, "ours", ty))
            if o is None:
                continue
            same = med.get((shape, t, "ref", ty))
            r2 = f"{l2 / o:.2f}x" if l2 else "-"
            rs = f"{same / o:.2f}x" if same else "-"
            print(f"{shape:<11} {t:>3} {ty:<6} {o:>9.1f} {same if same else float('nan'):>9.1f} {r2:>9} {rs:>8}")
print()
print("test-backend-ops cross-check (llama.cpp tq2_0 4096x14336, its default threads):")
print("  " + sys.argv[2].strip())
PY
