#!/usr/bin/env bash
# A model bigger than the memory it may use: decode speed of ternfleet's expert store against
# llama.cpp, each process in a memory cgroup (v1, /sys/fs/cgroup/memory) with the same limit,
# page cache dropped before every run, same file, same threads, same invocation.
#
#   llama.cpp   llama-bench --repack 0 (mmap). By default llama.cpp repacks Q4_K weights into
#               anonymous memory, which cannot exceed the limit: it is OOM-killed. --repack 0
#               is its only way to run there; its weights are then paged in and out of the page
#               cache, which the cgroup limit bounds.
#   ternfleet   bench --ram-budget B, with --prefetch none (demand reads only) and --prefetch
#               router (the shadow predictor's hints, 4 layers ahead).
#
# Prints tokens/s of each, the ratio to llama.cpp, the store's hit rate, bytes read and read
# latency, and each run's peak memory in the cgroup (memory.max_usage_in_bytes, page cache
# included). The routing spread of the model (ternfleet routing) comes first.
#
# usage: benches/moe-store-vs-llama-cpp.sh [--layers N] [-m MODEL] [--limit 8GiB] [--budget 6GiB]
#                                          [-t THREADS] [-p PROMPT] [-n GEN] [--skip-llama]
#   defaults: --layers 48 --limit 8GiB --budget (limit - 2GiB) -t 2 -p 16 -n 32. Needs root.
#   --skip-llama: ternfleet only (llama.cpp's mmap run under 8 GiB takes ~15 minutes).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
layers=48; model=""; limit="8GiB"; budget=""; threads=2; pp=16; tg=32; llama=1
while [ $# -gt 0 ]; do
  case "$1" in
    --layers) layers=$2; shift 2 ;;
    -m) model=$2; shift 2 ;;
    --limit) limit=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    -t) threads=$2; shift 2 ;;
    -p) pp=$2; shift 2 ;;
    -n) tg=$2; shift 2 ;;
    --skip-llama) llama=0; shift ;;
    *) echo "usage: $0 [--layers N] [-m MODEL] [--limit SIZE] [--budget SIZE] [-t T] [-p N] [-n N] [--skip-llama]" >&2; exit 2 ;;
  esac
done
bytes() { python3 -c "import re,sys; m=re.fullmatch(r'(\d+)\s*([KMGT]i?B?)?', sys.argv[1].strip(), re.I); u=(m.group(2) or '').upper()[:1]; print(int(m.group(1)) * 1024 ** ' KMGT'.index(u or ' '))" "$1"; }
limit_b=$(bytes "$limit")
[ -n "$budget" ] || budget=$((limit_b - 2 * 1024 * 1024 * 1024))
budget_b=$(bytes "$budget")
[ -n "$model" ] || model="$root/models/scale/qwen3-30b-a3b-l$layers.gguf"
bin="$root/target/llama.cpp/build/bin"
tf="${TERNFLEET:-$root/target/release/ternfleet}"
cgroot=/sys/fs/cgroup/memory
[ -w "$cgroot" ] || { echo "moe-store: $cgroot is not writable (needs root and cgroup v1)" >&2; exit 1; }
"$root/scripts/build-llama-cpp.sh" >&2 || true
(cd "$root" && cargo build --release -p ternfleet-coordinator >&2)
if [ ! -f "$model" ]; then
  python3 "$root/scripts/make-scale-model.py" --shape qwen3-30b-a3b --layers "$layers" -o "$model"
fi
work=$(mktemp -d)
cg="$cgroot/ternfleet-bench.$$"
cleanup() {
  if [ -d "$cg" ]; then
    for p in $(cat "$cg/cgroup.procs" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    rmdir "$cg" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# run NAME CMD...: CMD in a fresh cgroup with the limit, page cache dropped first; records the
# exit status, peak usage and OOM kills.
run() {
  local name=$1; shift
  cleanup_cg() { [ -d "$cg" ] && rmdir "$cg" 2>/dev/null || true; }
  cleanup_cg
  mkdir "$cg"
  echo "$limit_b" >"$cg/memory.limit_in_bytes"
  sync; echo 3 >/proc/sys/vm/drop_caches
  set +e
  timeout 3600 sh -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' sh "$cg" "$@" \
    >"$work/$name.out" 2>"$work/$name.err"
  echo $? >"$work/$name.rc"
  set -e
  cat "$cg/memory.max_usage_in_bytes" >"$work/$name.peak"
  grep -s oom_kill "$cg/memory.oom_control" | awk '{print $2}' >"$work/$name.oom" || echo 0 >"$work/$name.oom"
  cleanup_cg
}

echo "model: $model ($(du -h "$model" | cut -f1)); cgroup limit $limit ($limit_b bytes), ternfleet --ram-budget $budget_b bytes, threads $threads"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') (family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' '), model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | tr -d ' '))"
"$tf" routing -m "$model" -t "$threads" --json >"$work/routing.json" 2>/dev/null || echo '{}' >"$work/routing.json"
[ "$llama" = 1 ] && run llama "$bin/llama-bench" -m "$model" -p "$pp" -n "$tg" -t "$threads" -r 1 --repack 0 -o json
run none "$tf" bench -m "$model" --prompt "$pp" --gen "$tg" --reps 1 -t "$threads" --ram-budget "$budget_b" --prefetch none --json
run router "$tf" bench -m "$model" --prompt "$pp" --gen "$tg" --reps 1 -t "$threads" --ram-budget "$budget_b" --prefetch router --json

python3 - "$work" <<'EOF'
import json, sys
work = sys.argv[1]
def rd(n, ext):
    try:
        return open(f"{work}/{n}.{ext}", errors="replace").read().strip()
    except OSError:
        return ""
r = json.loads(rd("routing", "json") or "{}")
if r:
    rec = ", ".join("n/a" if v is None else f"{100 * v:.1f} %" for v in r["recall"])
    print(f"routing over {r['tokens']} tokens: distinct experts per layer min {r['distinct_min']} mean "
          f"{r['distinct_mean']:.1f} of {r['n_expert']}; entropy mean {r['entropy_mean_bits']:.2f} bits "
          f"(max {r['entropy_max_bits']:.2f}); router predictor recall at lookahead 1..4: {rec}")
res = {}
for n in ("llama", "none", "router"):
    rc, peak, oom = rd(n, "rc"), rd(n, "peak"), rd(n, "oom")
    out = rd(n, "out")
    pp = tg = None
    store = None
    try:
        if n == "llama":
            for t in json.loads(out):
                if t["n_gen"] == 0: pp = t["avg_ts"]
                else: tg = t["avg_ts"]
        else:
            o = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
            pp, tg, store = o["pp_tps"], o["tg_tps"], o.get("store")
    except (ValueError, IndexError, KeyError, TypeError):
        pass
    res[n] = (rc, peak, oom, pp, tg, store)
base = res["llama"][4] if res["llama"][0] == "0" else None
names = {"llama": "llama.cpp --repack 0 (mmap)", "none": "ternfleet store, no prefetch",
         "router": "ternfleet store, router hints"}
print(f"\n{'run':32} {'pp t/s':>8} {'tg t/s':>8} {'tg ratio':>9} {'peak GiB':>9}  store")
for n, (rc, peak, oom, pp, tg, store) in res.items():
    if n == "llama" and rc == "":
        print(f"{names[n]:32} skipped (--skip-llama)")
        continue
    if rc != "0" or tg is None:
        err = rd(n, "err").splitlines()[-3:]
        print(f"{names[n]:32} FAILED (exit {rc}, oom kills {oom}): {' | '.join(err)}")
        continue
    ratio = f"{tg / base:8.2f}x" if base else "      n/a"
    s = ""
    if store:
        d = store["hits"] + store["waits"] + store["misses"]
        hr = (store["hits"] + store["waits"]) / d if d else 0
        s = (f"hit rate {100 * hr:.1f} %, {store['bytes_read'] / 1e9:.1f} GB read, mean read "
             f"{store['read_ns'] / max(store['reads'], 1) / 1e6:.1f} ms, prefetches {store['prefetches']} "
             f"({store['prefetch_used']} used, {store['prefetch_wasted']} wasted)")
    print(f"{names[n]:32} {pp:8.2f} {tg:8.2f} {ratio} {int(peak or 0) / 2**30:9.2f}  {s}")
EOF
