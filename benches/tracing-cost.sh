#!/usr/bin/env bash
# What exporting traces costs: decode (and prefill) tokens/s of `ternfleet bench` over three
# nodes on loopback, with every process exporting its spans over OTLP/gRPC to
# `ternfleet otlp-sink` (on) and without --otlp-endpoint (off), alternating off/on for --reps
# rounds in one invocation (the machine is noisy: the ratio of medians is the figure).
# Goal (the observability issue): on within 3 % of off on decode.
#
# usage: [TERNFLEET=bin] benches/tracing-cost.sh [--bundle DIR] [--reps N] [--pp N] [--tg N]
#          [--threads T] [--node-threads T] [--timeout SECS]
# Default bundle: the MoEfied Gemma 3 270M of the cluster tests (target/cluster-test/bundle-gemma-moe8,
# made by `ternfleet convert` from models/gemma-3-270m-q4_k_m.gguf if missing).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
usage="usage: $0 [--bundle DIR] [--reps N] [--pp N] [--tg N] [--threads T] [--node-threads T] [--timeout SECS]"
bundle="$root/target/cluster-test/bundle-gemma-moe8" reps=5 pp=32 tg=64 threads=1 node_threads=1 limit=600
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=$2; shift 2 ;;
    --reps|-r) reps=$2; shift 2 ;;
    --pp) pp=$2; shift 2 ;;
    --tg) tg=$2; shift 2 ;;
    --threads|-t) threads=$2; shift 2 ;;
    --node-threads) node_threads=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
tf="${TERNFLEET:-$root/target/release/ternfleet}"
[ -x "$tf" ] || { echo "tracing-cost: no ternfleet binary at $tf (cargo build --release, or TERNFLEET=...)" >&2; exit 1; }
work=$(mktemp -d)
pids=()
stop_all() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
fail() { echo "tracing-cost: $1" >&2; shift; local f; for f in "$@"; do [ -f "$f" ] && tail -n 15 "$f" >&2; done; exit 1; }
# Waits for a process's start-up line in FILE and prints the value of KEY.
startup() { # file key pid what
  local i
  for i in $(seq 1 300); do
    if [ -s "$1" ]; then python3 -c 'import json, sys; print(json.loads(open(sys.argv[1]).readline())[sys.argv[2]])' "$1" "$2"; return; fi
    kill -0 "$3" 2>/dev/null || fail "$4 exited" "${1%.out}.err"
    sleep 0.2
  done
  fail "$4: no start-up line in 60 s" "${1%.out}.err"
}

if [ ! -d "$bundle" ]; then
  gemma="$root/models/gemma-3-270m-q4_k_m.gguf"
  [ -f "$gemma" ] || fail "no bundle at $bundle and no $gemma (scripts/fetch-model.sh)"
  echo "making $bundle from $gemma" >&2
  timeout "$limit" "$tf" convert -m "$gemma" -o "$bundle" --experts 8 \
    --calib "$root/tests/data/text/python-reference.txt" >"$work/convert.log" 2>&1 || fail "convert failed" "$work/convert.log"
fi
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; binary: $tf"
echo "bundle: $bundle; pp $pp tg $tg; $reps rounds of off/on; coordinator $threads thread(s), nodes $node_threads each"
certs="$work/certs"
"$tf" certs init --dir "$certs" >/dev/null
for n in coordinator n1 n2 n3; do "$tf" certs issue --dir "$certs" --name "$n" >/dev/null; done
ports=$(python3 -c 'import socket
held = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
for s in held: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in held))')
read -r -a port <<<"$ports"
"$tf" cluster plan --bundle "$bundle" --node "n1=127.0.0.1:${port[0]}" --node "n2=127.0.0.1:${port[1]}" \
  --node "n3=127.0.0.1:${port[2]}" -o "$work/cluster.toml" >/dev/null

"$tf" otlp-sink --listen 127.0.0.1:0 >"$work/sink.out" 2>"$work/sink.err" &
pids+=($!)
sink_pid=$!
ep="http://$(startup "$work/sink.out" grpc "$sink_pid" otlp-sink)"

run() { # mode round
  local mode=$1 r=$2 otlp=() i
  [ "$mode" = on ] && otlp=(--otlp-endpoint "$ep")
  local node_pids=()
  for i in 1 2 3; do
    "$tf" node -m "$bundle" --id "n$i" --certs "$certs" --cluster "$work/cluster.toml" \
      --listen "127.0.0.1:${port[$((i - 1))]}" --metrics off -t "$node_threads" "${otlp[@]}" \
      >"$work/n$i.$mode.$r.out" 2>"$work/n$i.$mode.$r.err" &
    node_pids+=($!)
  done
  for i in 1 2 3; do startup "$work/n$i.$mode.$r.out" quic "${node_pids[$((i - 1))]}" "node n$i" >/dev/null; done
  timeout "$limit" "$tf" bench -m "$bundle" --cluster "$work/cluster.toml" --certs "$certs" \
    --prompt "$pp" --gen "$tg" --reps 1 --threads "$threads" --json "${otlp[@]}" \
    >"$work/bench.$mode.$r.json" 2>"$work/bench.$mode.$r.err" || fail "bench ($mode) failed" "$work/bench.$mode.$r.err"
  for p in "${node_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${node_pids[@]}"; do wait "$p" 2>/dev/null || true; done
  python3 -c 'import json, sys; v = json.load(open(sys.argv[1])); print(v["pp_tps"], v["tg_tps"])' "$work/bench.$mode.$r.json"
}
declare -A pp_of tg_of
for r in $(seq 1 "$reps"); do
  for mode in off on; do
    read -r a b < <(run "$mode" "$r")
    pp_of[$mode]+="$a " tg_of[$mode]+="$b "
    echo "round $r $mode: pp $a t/s, tg $b t/s"
  done
done
spans=$(($(wc -l <"$work/sink.out") - 1))
python3 - "${pp_of[off]}" "${pp_of[on]}" "${tg_of[off]}" "${tg_of[on]}" "$spans" <<'EOF'
import statistics, sys
f = lambda s: [float(x) for x in s.split()]
ppo, ppn, tgo, tgn, spans = f(sys.argv[1]), f(sys.argv[2]), f(sys.argv[3]), f(sys.argv[4]), int(sys.argv[5])
m = statistics.median
print(f"| | OTLP off | OTLP on (4 processes exporting) | on / off |")
print(f"|---|---|---|---|")
print(f"| prefill t/s (median) | {m(ppo):.2f} | {m(ppn):.2f} | {m(ppn)/m(ppo):.3f} |")
print(f"| decode t/s (median) | {m(tgo):.2f} | {m(tgn):.2f} | {m(tgn)/m(tgo):.3f} |")
print(f"spans received by the sink: {spans}; goal: decode on/off >= 0.97")
EOF
