#!/usr/bin/env bash
# MoE speed at real scale: ternfleet against llama.cpp on a random-weight model with
# Qwen3-30B-A3B's shapes (scripts/make-scale-model.py; made here on first use, never committed),
# same file, same thread count, same run:
#
#   routing     `ternfleet routing` over 1,000 tokens: distinct experts per layer and routing
#               entropy (quote them with every figure: collapsed routing would make them
#               meaningless), and the router predictor's recall.
#   throughput  llama-bench -p P -n N -t T  vs  ternfleet bench --prompt P --gen N -t T,
#               alternated R times; medians and the ratio ternfleet / llama.cpp.
#   bytes       weight bytes a decode token reads (dense layers, routers, top-k experts, LM head:
#               counted from the file) and the GB/s both engines reach at their tg speed,
#               against the machine's read bandwidth measured here (sysbench, all threads).
#   greedy      token ids of 16 greedy tokens on three prompts: ternfleet generate --temp 0
#               (parity numerics) against llama.cpp (benches/ref/ref-greedy.cpp).
#
# All in RAM: llama.cpp repacks the Q4_K weights into anonymous memory at load (its warm-up run
# follows); ternfleet maps the file, which is read into the page cache before each of its runs.
# One engine runs at a time.
#
# usage: benches/moe-scale-vs-llama-cpp.sh [--layers N] [-m MODEL] [-t THREADS] [-r REPS]
#                                          [-p PROMPT_TOKENS] [-n GEN_TOKENS] [--no-greedy]
#   defaults: --layers 48 (full size, ~18.5 GB; 24 for the half-depth variant) -t 2 -r 3 -p 512 -n 32
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
layers=48; model=""; threads=2; reps=3; pp=512; tg=32; greedy=1
while [ $# -gt 0 ]; do
  case "$1" in
    --layers) layers=$2; shift 2 ;;
    -m) model=$2; shift 2 ;;
    -t) threads=$2; shift 2 ;;
    -r) reps=$2; shift 2 ;;
    -p) pp=$2; shift 2 ;;
    -n) tg=$2; shift 2 ;;
    --no-greedy) greedy=0; shift ;;
    *) echo "usage: $0 [--layers N] [-m MODEL] [-t THREADS] [-r REPS] [-p N] [-n N] [--no-greedy]" >&2; exit 2 ;;
  esac
done
[ -n "$model" ] || model="$root/models/scale/qwen3-30b-a3b-l$layers.gguf"
bin="$root/target/llama.cpp/build/bin"
tf="${TERNFLEET:-$root/target/release/ternfleet}"
"$root/scripts/build-llama-cpp.sh" >&2 || true
(cd "$root" && cargo build --release -p ternfleet-coordinator >&2)
[ -x "$bin/llama-bench" ] || { echo "moe-scale: $bin/llama-bench missing (scripts/build-llama-cpp.sh)" >&2; exit 1; }
if [ ! -f "$model" ]; then
  python3 "$root/scripts/make-scale-model.py" --shape qwen3-30b-a3b --layers "$layers" -o "$model"
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT

echo "model: $model ($(du -h "$model" | cut -f1)), threads $threads, $reps alternated runs"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') (family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' '), model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | tr -d ' '))"
"$tf" routing -m "$model" -t "$threads" --json >"$work/routing.json" 2>"$work/routing.err" \
  || { echo "moe-scale: ternfleet routing failed:" >&2; tail -n 5 "$work/routing.err" >&2; exit 1; }

bw=""
if command -v sysbench >/dev/null || { apt-get install -y -qq sysbench >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq sysbench >/dev/null 2>&1; }; }; then
  bw=$(sysbench memory --memory-block-size=64M --memory-total-size=64G --memory-oper=read \
        --threads="$threads" --time=5 run 2>/dev/null | sed -n 's/.*(\([0-9.]*\) MiB\/sec).*/\1/p')
fi
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq 1 "$reps"); do
  timeout 1800 "$bin/llama-bench" -m "$model" -p "$pp" -n "$tg" -t "$threads" -r 1 -o json \
    >"$work/llama.$i.json" 2>"$work/llama.$i.err" \
    || { echo "moe-scale: llama-bench failed:" >&2; tail -n 5 "$work/llama.$i.err" >&2; exit 1; }
  cat "$model" >/dev/null  # all in RAM: the page cache llama.cpp's repacked copy pushed out
  timeout 1800 "$tf" bench -m "$model" --prompt "$pp" --gen "$tg" --reps 1 --threads "$threads" --json \
    >"$work/tf.$i.json" 2>"$work/tf.$i.err" \
    || { echo "moe-scale: ternfleet bench failed:" >&2; tail -n 5 "$work/tf.$i.err" >&2; exit 1; }
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

if [ "$greedy" = 1 ]; then
  "$root/scripts/make-references.sh" --harness-only >&2
  i=0
  for p in "The capital of France is" "def fibonacci(n):" "Once upon a time, in a land far away,"; do
    i=$((i + 1))
    timeout 900 "$root/target/llama.cpp/ref/ref-greedy" -m "$model" -n 16 -t "$threads" "$p" >"$work/ref.$i.json" 2>/dev/null
    timeout 900 "$tf" generate -m "$model" -n 16 --temp 0 -t "$threads" --json -p "$p" >"$work/gen.$i.json" 2>/dev/null
  done
fi

python3 - "$work" "$reps" "$model" "$bw" "$greedy" <<'EOF'
import json, statistics, sys
import gguf
work, reps, model, bw, greedy = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1"

r = json.load(open(f"{work}/routing.json"))
rec = ", ".join("n/a" if v is None else f"{100 * v:.1f} %" for v in r["recall"])
print(f"routing over {r['tokens']} tokens: distinct experts per layer min {r['distinct_min']} mean "
      f"{r['distinct_mean']:.1f} of {r['n_expert']}; entropy mean {r['entropy_mean_bits']:.2f} bits "
      f"(max {r['entropy_max_bits']:.2f}); router predictor recall at lookahead 1..4: {rec}")

# Weight bytes one decode token reads: every dense matrix and router, k of n experts per layer,
# one embedding row, the LM head.
rd = gguf.GGUFReader(model)
arch = rd.fields["general.architecture"].contents()
n_expert = int(rd.fields[f"{arch}.expert_count"].contents())
k = int(rd.fields[f"{arch}.expert_used_count"].contents())
per_tok = 0
for t in rd.tensors:
    if t.name.endswith("_exps.weight"):
        per_tok += t.n_bytes * k / n_expert
    elif t.name == "token_embd.weight":
        per_tok += t.n_bytes / int(t.shape[-1])
    else:
        per_tok += t.n_bytes

llama, ours = {"pp": [], "tg": []}, {"pp": [], "tg": []}
for i in range(1, reps + 1):
    for t in json.load(open(f"{work}/llama.{i}.json")):
        llama["pp" if t["n_gen"] == 0 else "tg"].append(t["avg_ts"])
    line = [l for l in open(f"{work}/tf.{i}.json").read().splitlines() if l.startswith("{")][-1]
    o = json.loads(line)
    ours["pp"].append(o["pp_tps"]); ours["tg"].append(o["tg_tps"])
med = statistics.median
print(f"\n{'test':8} {'llama.cpp t/s':>14} {'ternfleet t/s':>14} {'ratio':>7}   runs llama.cpp | ternfleet")
for key in ("pp", "tg"):
    a, b = med(llama[key]), med(ours[key])
    runs = " ".join(f"{v:.2f}" for v in llama[key]) + " | " + " ".join(f"{v:.2f}" for v in ours[key])
    print(f"{key:8} {a:14.2f} {b:14.2f} {b / a:6.2f}x   {runs}")
bw_s = f"{float(bw) * 1.048576 / 1000:.1f} GB/s measured (sysbench read)" if bw else "not measured"
print(f"\ndecode reads {per_tok / 1e9:.3f} GB of weights per token; at tg speed: llama.cpp "
      f"{per_tok * med(llama['tg']) / 1e9:.1f} GB/s, ternfleet {per_tok * med(ours['tg']) / 1e9:.1f} GB/s; "
      f"memory bandwidth {bw_s}")

if greedy:
    same = 0
    for i in range(1, 4):
        try:
            a = json.loads(open(f"{work}/ref.{i}.json", errors="replace").read())["tokens"]
            b = json.loads([l for l in open(f"{work}/gen.{i}.json", errors="replace").read().splitlines()
                            if l.startswith("{")][-1])["tokens"]
        except (OSError, ValueError, IndexError, KeyError) as e:
            print(f"greedy prompt {i}: no result ({e})"); continue
        ok = a == b
        same += ok
        print(f"greedy prompt {i}: {'identical' if ok else 'DIFFERENT'} ({len(a)} tokens){'' if ok else f' llama.cpp {a} ternfleet {b}'}")
    print(f"greedy: {same}/3 prompts token-identical to llama.cpp")
EOF
