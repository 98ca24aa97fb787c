#!/usr/bin/env bash
# Aggregate decode throughput of the batched engine against llama.cpp's llama-batched-bench, in
# the same run, same model, same threads: PL sequences each prefill PP tokens, then decode TG
# tokens together; the figure is PL*TG / decode seconds (llama-batched-bench's S_TG, ternfleet
# bench --parallel's agg_tg_tps), for PL = 1, 4, 16, in ternfleet's parity and invariant modes.
# Runs alternate (llama.cpp, parity, invariant) R times; the table prints medians and ratios.
# Goals (the batched-engine issue): >= 1.3x llama.cpp at 1 sequence, >= 1.2x at 16, and
# invariant within 10 % of parity.
#
# usage: [TERNFLEET=bin] benches/batched-vs-llama-cpp.sh [-m MODEL] [-t THREADS] [-r REPS]
#          [--pp N] [--tg N] [--npl 1,4,16] [--no-build]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
model="$root/models/gemma-3-270m-q4_k_m.gguf"
threads=2 reps=3 pp=128 tg=64 npl=1,4,16 build=1
while [ $# -gt 0 ]; do
  case "$1" in
    -m) model=$2; shift 2 ;;
    -t) threads=$2; shift 2 ;;
    -r) reps=$2; shift 2 ;;
    --pp) pp=$2; shift 2 ;;
    --tg) tg=$2; shift 2 ;;
    --npl) npl=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "usage: $0 [-m MODEL] [-t THREADS] [-r REPS] [--pp N] [--tg N] [--npl 1,4,16] [--no-build]" >&2; exit 2 ;;
  esac
done
[ -f "$model" ] || { echo "batched: no model at $model (scripts/fetch-model.sh)" >&2; exit 1; }
bin="$root/target/llama.cpp/build/bin"
tf="${TERNFLEET:-$root/target/release/ternfleet}"
if [ "$build" = 1 ]; then
  "$root/scripts/build-llama-cpp.sh" >&2
  (cd "$root" && cargo build --release -p ternfleet-coordinator >&2)
fi
[ -x "$bin/llama-batched-bench" ] || { echo "batched: $bin/llama-batched-bench missing (scripts/build-llama-cpp.sh)" >&2; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
maxpl=$(echo "$npl" | tr ',' '\n' | sort -n | tail -1)
ctx=$(( maxpl * (pp + tg) + 64 ))
echo "model: $model, threads $threads, pp $pp tg $tg, sequences $npl, $reps alternated runs; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq 1 "$reps"); do
  timeout 900 "$bin/llama-batched-bench" -m "$model" -c "$ctx" -b 2048 -ub 512 -npp "$pp" -ntg "$tg" \
    -npl "$npl" -t "$threads" -fa on --output-format jsonl >"$work/llama.$i.jsonl" 2>"$work/llama.$i.err" \
    || { echo "batched: llama-batched-bench failed:" >&2; tail -n 5 "$work/llama.$i.err" >&2; exit 1; }
  for pl in $(echo "$npl" | tr ',' ' '); do
    for mode in parity invariant; do
      timeout 900 "$tf" bench -m "$model" --prompt "$pp" --gen "$tg" --reps 1 --parallel "$pl" \
        --numerics "$mode" --threads "$threads" --json >"$work/tf.$mode.$pl.$i.json" 2>"$work/tf.$mode.$pl.$i.err" \
        || { echo "batched: ternfleet bench failed:" >&2; tail -n 5 "$work/tf.$mode.$pl.$i.err" >&2; exit 1; }
    done
  done
done
python3 - "$work" "$reps" "$npl" <<'PY'
import json, statistics, sys
work, reps, npl = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
def med(xs): return statistics.median(xs)
llama = {pl: [] for pl in npl}
for i in range(1, reps + 1):
    for line in open(f"{work}/llama.{i}.jsonl"):
        line = line.strip()
        if line.startswith("{"):
            v = json.loads(line)
            if v.get("pl") in llama:
                llama[v["pl"]].append(v["speed_tg"])
print("| sequences | llama.cpp S_TG t/s | ternfleet parity | ratio | ternfleet invariant | ratio | invariant/parity |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for pl in npl:
    tf = {m: med([json.load(open(f"{work}/tf.{m}.{pl}.{i}.json"))["agg_tg_tps"] for i in range(1, reps + 1)]) for m in ("parity", "invariant")}
    l = med(llama[pl])
    print(f"| {pl} | {l:.1f} | {tf['parity']:.1f} | {tf['parity']/l:.2f}x | {tf['invariant']:.1f} | {tf['invariant']/l:.2f}x | {tf['invariant']/tf['parity']:.2f} |")
# Every run, in the order they ran: this host's speed moves between runs, and the medians hide it.
for pl in npl:
    runs = {m: [json.load(open(f"{work}/tf.{m}.{pl}.{i}.json"))["agg_tg_tps"] for i in range(1, reps + 1)] for m in ("parity", "invariant")}
    fmt = lambda xs: " ".join(f"{x:.1f}" for x in xs)
    print(f"runs, {pl} sequences: llama.cpp {fmt(llama[pl])} | parity {fmt(runs['parity'])} | invariant {fmt(runs['invariant'])}")
PY
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
