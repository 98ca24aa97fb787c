#!/usr/bin/env bash
# End-to-end speed and memory of ternfleet against llama.cpp (the reference engine), measured in
# the same run on the same model and thread count:
#
#   throughput  llama-bench -p 512 -n 128 -t T  vs  ternfleet bench --prompt 512 --gen 128 -t T,
#               alternated R times (so drift and neighbours' load hit both alike); the table
#               gives the median of each and the ratio ternfleet / llama.cpp for pp and tg.
#   memory      peak RSS (/usr/bin/time -v "Maximum resident set size") while generating 128
#               tokens greedily: llama-simple -n 128  vs  ternfleet generate -n 128 --temp 0.
#
# A ternfleet command that fails is reported as FAILED with its exit status and the last lines of
# its stderr; the llama.cpp numbers are still printed. On a busy machine (load average above the
# thread count) the numbers are noisy, and llama.cpp's more than ours: its OpenMP workers spin at
# every barrier: on 2 shared cores under load, its -t 2 tg128 read 4.5 to 23 t/s while -t 1 read 50.
# The script prints the load before and after; trust only runs on an otherwise idle machine.
#
# usage: [TERNFLEET=bin] [LLAMA_BIN=dir] benches/compare-llama-cpp.sh [-m MODEL] [-t THREADS]
#          [-r REPS] [--no-build]
#   LLAMA_BIN: another llama.cpp build's bin/ (e.g. the AVX2-only one of
#   scripts/build-llama-cpp.sh --avx2, beside TERNFLEET_KERNELS=avx2)
#   defaults: -m models/gemma-3-270m-q4_k_m.gguf -t 2 -r 3
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
model="$root/models/gemma-3-270m-q4_k_m.gguf"
threads=2
reps=3
build=1
while [ $# -gt 0 ]; do
  case "$1" in
    -m) model=$2; shift 2 ;;
    -t) threads=$2; shift 2 ;;
    -r) reps=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "usage: $0 [-m MODEL] [-t THREADS] [-r REPS] [--no-build]" >&2; exit 2 ;;
  esac
done
[ -f "$model" ] || { echo "compare: no model at $model (scripts/fetch-model.sh fetches Gemma 3 270M)" >&2; exit 1; }

bin="${LLAMA_BIN:-$root/target/llama.cpp/build/bin}"
tf="${TERNFLEET:-$root/target/release/ternfleet}"  # TERNFLEET=path overrides the binary
if [ "$build" = 1 ]; then
  "$root/scripts/build-llama-cpp.sh" >&2 || true
  (cd "$root" && cargo build --release -p ternfleet-coordinator >&2) || echo "compare: cargo build failed; ternfleet columns will say FAILED" >&2
fi
for b in llama-bench llama-simple; do
  [ -x "$bin/$b" ] || { echo "compare: $bin/$b missing (scripts/build-llama-cpp.sh)" >&2; exit 1; }
done
if [ ! -x /usr/bin/time ]; then
  apt-get install -y -qq time >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq time >/dev/null; }
fi

work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
prompt="The capital of France is"
echo "model: $model ($(du -h "$model" | cut -f1)), threads $threads, $reps alternated runs; load before: $(cut -d' ' -f1-3 /proc/loadavg)"

for i in $(seq 1 "$reps"); do
  # llama-bench: one repetition per call, after its own warm-up run
  if timeout 600 "$bin/llama-bench" -m "$model" -p 512 -n 128 -t "$threads" -r 1 -o json \
      >"$work/llama.$i.json" 2>"$work/llama.$i.err"; then :; else
    echo "compare: llama-bench failed ($?):" >&2; tail -n 5 "$work/llama.$i.err" >&2; exit 1
  fi
  if [ -x "$tf" ] && timeout 600 "$tf" bench -m "$model" --prompt 512 --gen 128 --threads "$threads" --json \
      >"$work/tf.$i.json" 2>"$work/tf.$i.err"; then :; else
    echo "rc=$?" >"$work/tf.$i.failed"
  fi
done

# peak RSS while generating 128 tokens (llama-simple has no thread option: it uses 4)
/usr/bin/time -v "$bin/llama-simple" -m "$model" -n 128 "$prompt" >/dev/null 2>"$work/llama.rss" || true
if [ -x "$tf" ]; then
  if /usr/bin/time -v "$tf" generate -m "$model" -t "$threads" -n 128 --temp 0 -p "$prompt" \
      >"$work/tf.gen.out" 2>"$work/tf.rss"; then
    [ -s "$work/tf.gen.out" ] || echo "exit 0 but printed no text" >"$work/tf.rss.failed"
  else
    echo "rc=$?" >"$work/tf.rss.failed"
  fi
else
  echo "rc=missing" >"$work/tf.rss.failed"
fi
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$work" "$reps" "$tf" <<'EOF'
import json, os, re, statistics, sys
work, reps, tf = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def tail(path, n=5):
    try:  # the command's own stderr, without /usr/bin/time -v's report (tab-indented lines)
        lines = [l for l in open(path, errors="replace").readlines() if not l.startswith("\t")]
        return "".join(lines[-n:]).rstrip()
    except OSError:
        return ""

llama = {"pp": [], "tg": []}
for i in range(1, reps + 1):
    for t in json.load(open(f"{work}/llama.{i}.json")):
        key = "pp" if t["n_gen"] == 0 else "tg"
        llama[key].append(t["avg_ts"])

ours, failure = {"pp": [], "tg": []}, None
for i in range(1, reps + 1):
    if os.path.exists(f"{work}/tf.{i}.failed") or not os.path.exists(f"{work}/tf.{i}.json"):
        why = open(f"{work}/tf.{i}.failed").read().strip() if os.path.exists(f"{work}/tf.{i}.failed") else "no output"
        failure = failure or (f"{tf} bench: {'binary missing' if not os.path.exists(tf) else why}\n"
                              + tail(f"{work}/tf.{i}.err"))
        continue
    try:
        line = [l for l in open(f"{work}/tf.{i}.json").read().splitlines() if l.strip().startswith("{")][-1]
        r = json.loads(line)
        ours["pp"].append(float(r["pp_tps"]))
        ours["tg"].append(float(r["tg_tps"]))
    except (IndexError, KeyError, ValueError) as e:
        failure = failure or f"{tf} bench: unreadable output ({e}): {tail(f'{work}/tf.{i}.json')}"

def med(v):
    return statistics.median(v) if v else None

def fmt(v):
    return f"{v:9.2f}" if v is not None else "   FAILED"

print()
print(f"{'test':8} {'llama.cpp t/s':>14} {'ternfleet t/s':>14} {'ratio':>7}   runs llama.cpp | ternfleet")
for key, name in (("pp", "pp512"), ("tg", "tg128")):
    a, b = med(llama[key]), med(ours[key])
    ratio = f"{b / a:7.3f}" if a and b else "      -"
    runs = " ".join(f"{x:.1f}" for x in llama[key]) + " | " + (" ".join(f"{x:.1f}" for x in ours[key]) or "-")
    print(f"{name:8} {fmt(a):>14} {fmt(b):>14} {ratio}   {runs}")

def rss(path):
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(path).read()) if os.path.exists(path) else None
    return int(m.group(1)) / 1024 if m else None

a = rss(f"{work}/llama.rss")
b = None if os.path.exists(f"{work}/tf.rss.failed") else rss(f"{work}/tf.rss")
ratio = f"{b / a:7.3f}" if a and b else "      -"
mib = lambda v: f"{v:.1f} MiB" if v is not None else "FAILED"
print(f"{'peakRSS':8} {mib(a):>14} {mib(b):>14} {ratio}   (generate 128 tokens: llama-simple | ternfleet generate)")
if failure:
    print("\nternfleet bench FAILED:\n" + failure)
if os.path.exists(f"{work}/tf.rss.failed"):
    print("\nternfleet generate FAILED: " + open(f"{work}/tf.rss.failed").read().strip() + "\n" + tail(f"{work}/tf.rss"))
EOF
