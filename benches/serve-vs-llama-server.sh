#!/usr/bin/env bash
# Load bench: ternfleet serve against llama.cpp's llama-server on the same model, same machine,
# same invocation, loopback. Streaming /v1/completions clients at 1, 4 and 16 concurrent streams,
# 128-token prompts (token ids, identical for both servers) and 128 generated tokens
# (ignore_eos). Prints per level: aggregate generated tokens/s, TTFT p50/p99, inter-token
# latency p50/p99, errors, and the ratio to llama-server; then, for ternfleet, a burst above its
# admission limit (429s at once, admitted requests complete) and a shared 1,000-token prefix
# (TTFT of the second request against the first).
#
#   benches/serve-vs-llama-server.sh [-m MODEL] [-t THREADS] [-c 1,4,16] [-r REQS_PER_CLIENT]
#
# Goals (issue 13): aggregate tokens/s >= 1.3x llama-server at 1 stream and >= 1.2x at 16;
# TTFT p99 at 16 streams <= llama-server's; zero errors; prefix TTFT ratio <= 0.2.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model=models/gemma-3-270m-q4_k_m.gguf
threads=2
conc=1,4,16
reqs=2
numerics=invariant
while [ $# -gt 0 ]; do
  case "$1" in
    -m) model=$2; shift 2 ;;
    -t) threads=$2; shift 2 ;;
    -c) conc=$2; shift 2 ;;
    -r) reqs=$2; shift 2 ;;
    --numerics) numerics=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
python3 -c "import httpx" 2>/dev/null || python3 -m pip install --quiet httpx
./scripts/fetch-model.sh gemma >/dev/null
./scripts/build-llama-cpp.sh >/dev/null
cargo build --release --quiet
tf=target/release/ternfleet
ls=target/llama.cpp/build/bin/llama-server
out=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$out"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() { # url path
  for _ in $(seq 1 600); do
    if curl -sf "$1$2" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "server at $1 not ready in 120 s" >&2; return 1
}
maxc=$(echo "$conc" | tr ',' '\n' | sort -n | tail -1)

echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; threads $threads; model $model"

# llama-server: continuous batching (default), one slot per stream, 512 positions per slot.
port=$(free_port)
"$ls" -m "$model" --host 127.0.0.1 --port "$port" -t "$threads" -tb "$threads" -np "$maxc" \
  -c $((512 * maxc)) --no-webui >"$out/ls.log" 2>&1 &
pids+=($!)
wait_ready "http://127.0.0.1:$port" /health
python3 benches/serve_load.py "http://127.0.0.1:$port" --concurrency "$conc" \
  --requests-per-client "$reqs" --json "$out/ls.json" >/dev/null
kill "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true

# ternfleet serve, same slots, 512 positions per request.
"$tf" serve -m "$model" --http 127.0.0.1:0 --grpc "" -t "$threads" --parallel "$maxc" --max-queue "$maxc" \
  --ctx 1536 --numerics "$numerics" >"$out/tf.out" 2>"$out/tf.log" &
pids+=($!)
for _ in $(seq 1 300); do [ -s "$out/tf.out" ] && break; sleep 0.1; done
url="http://$(python3 -c "import json,sys; print(json.loads(open('$out/tf.out').readline())['http'])")"
wait_ready "$url" /ready
python3 benches/serve_load.py "$url" --concurrency "$conc" --requests-per-client "$reqs" \
  --overload $((3 * maxc)) --prefix-tokens 1000 --json "$out/tf.json" >/dev/null
kill -TERM "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true

python3 - "$out/ls.json" "$out/tf.json" "$numerics" <<'EOF'
import json, sys
ls, tf = (json.load(open(p)) for p in sys.argv[1:3])
print(f"\nternfleet serve (--numerics {sys.argv[3]}) vs llama-server, streaming /v1/completions, 128-token prompts, 128 generated")
print("| streams | server | agg tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors | ratio tok/s |")
print("|---|---|---|---|---|---|---|---|---|")
for a, b in zip(ls["levels"], tf["levels"]):
    for name, r in (("llama-server", a), ("ternfleet", b)):
        ratio = f"{b['agg_tps'] / a['agg_tps']:.2f}x" if name == "ternfleet" and a["agg_tps"] else ""
        print(f"| {r['concurrency']} | {name} | {r['agg_tps']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
              f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['errors']} | {ratio} |")
o = tf.get("overload")
if o:
    print(f"\noverload (ternfleet): {o['fired']} at once -> {o['refused_429']} refused with 429 "
          f"(slowest refusal {o['refused_max_ms']:.0f} ms), {o['completed']} completed, {o['other']} other")
p = tf.get("prefix")
if p:
    print(f"shared {p['prefix_tokens']}-token prefix (ternfleet): TTFT {p['ttft_first_ms']:.0f} ms then "
          f"{p['ttft_second_ms']:.0f} ms, ratio {p['ratio']:.2f} (goal <= 0.2)")
EOF
