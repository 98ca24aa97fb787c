#!/usr/bin/env bash
# The distributed runtime against llama.cpp's RPC backend, on the same MoE GGUF model, the same
# machine, in one invocation, every process on loopback:
#   - llama.cpp in one process (llama-bench) and with 2 and 3 ggml-rpc-servers (llama-bench
#     --rpc A,B[,C] -ngl 99: every layer, experts included, goes to the RPC devices, split by
#     their free memory, i.e. evenly here);
#   - ternfleet in one process (ternfleet bench -m BUNDLE) and with 2 and 3 node processes
#     (ternfleet node ..., then ternfleet bench -m BUNDLE --cluster FILE --certs DIR).
# pp = prefill tokens/s of a --pp-token prompt, tg = decode tokens/s of one sequence (llama-bench's
# pp/tg tests); agg tg = ternfleet's aggregate decode with P sequences at once for each P of
# --parallel (default 4,16; agg_tg_tps), against the same nodes.
# Nodes and RPC servers get --node-threads threads each; the coordinator / main llama-bench
# process and the single-process rows get --threads.
# Goals (the distributed-runtime issue): 3 nodes >= 1.5x llama.cpp RPC with 3 servers on decode,
# and >= 0.85x ternfleet single-process.
#
# usage: [TERNFLEET=bin] benches/cluster-vs-llama-rpc.sh --model FILE.gguf [--bundle DIR] [--reps N]
#          [--pp N] [--tg N] [--threads T] [--node-threads T] [--parallel P[,P...]] [--timeout SECS]
#          [--step-deadline MS] [--no-build]
# The bundle (default target/bundles/NAME) is made with `ternfleet convert` if DIR does not exist.
# Smoke run (numbers meaningless): --model tests/data/models/tiny-qwen3moe-q8_0.gguf --reps 1
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
usage="usage: $0 --model FILE.gguf [--bundle DIR] [--reps N] [--pp N] [--tg N] [--threads T] [--node-threads T] [--parallel P] [--timeout SECS] [--step-deadline MS] [--no-build]"
model="" bundle="" reps=3 pp=128 tg=32 threads=2 node_threads=2 parallel="4,16" limit=3600 deadline="" build=1
while [ $# -gt 0 ]; do
  case "$1" in
    --model|-m) model=$2; shift 2 ;;
    --bundle) bundle=$2; shift 2 ;;
    --reps|-r) reps=$2; shift 2 ;;
    --pp) pp=$2; shift 2 ;;
    --tg) tg=$2; shift 2 ;;
    --threads|-t) threads=$2; shift 2 ;;
    --node-threads) node_threads=$2; shift 2 ;;
    --parallel) parallel=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --step-deadline) deadline=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
[ -n "$model" ] || { echo "$usage" >&2; exit 2; }
[ -f "$model" ] || { echo "cluster bench: no model at $model" >&2; exit 1; }
[ -n "$bundle" ] || bundle="$root/target/bundles/$(basename "$model" .gguf)"
tf="${TERNFLEET:-$root/target/release/ternfleet}"
lbin="$root/target/llama.cpp/build-rpc/bin"
if [ "$build" = 1 ]; then
  "$root/scripts/build-llama-cpp.sh" --rpc >&2
  (cd "$root" && cargo build --release -p ternfleet-coordinator >&2)
fi
[ -x "$tf" ] || { echo "cluster bench: no ternfleet binary at $tf (cargo build --release)" >&2; exit 1; }
for b in ggml-rpc-server llama-bench; do
  [ -x "$lbin/$b" ] || { echo "cluster bench: $lbin/$b missing (scripts/build-llama-cpp.sh --rpc)" >&2; exit 1; }
done

work=$(mktemp -d)
pids=()
# Stop every child we started (SIGTERM, then SIGKILL after 5 s) and reap it.
stop_all() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$p" 2>/dev/null; then kill -KILL "$p" 2>/dev/null || true; fi
    wait "$p" 2>/dev/null || true
  done
  pids=()
}
# Run a command under the time limit in the background and wait for it: bash runs a trap only
# after a foreground child ends, but interrupts `wait` at once; cleanup stops it.
fg=""
bounded() {
  local rc=0
  timeout "$limit" "$@" &
  fg=$!
  wait "$fg" || rc=$?
  fg=""
  return "$rc"
}
cleanup() {
  if [ -n "$fg" ]; then pids+=("$fg"); fi
  stop_all; rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
fail() { # message log-file...
  echo "cluster bench: $1" >&2; shift
  local f; for f in "$@"; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }; done
  exit 1
}
# N distinct free loopback ports of a kind (tcp for ggml-rpc-server, udp for QUIC nodes), one a line.
free_ports() { # kind N
  python3 -c 'import socket, sys
kind = socket.SOCK_DGRAM if sys.argv[1] == "udp" else socket.SOCK_STREAM
held = [socket.socket(socket.AF_INET, kind) for _ in range(int(sys.argv[2]))]
for s in held: s.bind(("127.0.0.1", 0))
print("\n".join(str(s.getsockname()[1]) for s in held))' "$1" "$2"
}
tcp_ready() { python3 -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close()' "$1" 2>/dev/null; }

echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
echo "model: $model; bundle: $bundle; pp $pp tg $tg, reps $reps; threads $threads (nodes / RPC servers: $node_threads each), parallel $parallel"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"

if [ ! -d "$bundle" ]; then
  echo "making the bundle: $tf convert -m $model -o $bundle" >&2
  mkdir -p "$(dirname "$bundle")"
  bounded "$tf" convert -m "$model" -o "$bundle" >"$work/convert.out" 2>"$work/convert.err" \
    || fail "ternfleet convert failed" "$work/convert.out" "$work/convert.err"
fi

# ---- llama.cpp ----------------------------------------------------------------------------------
# args: label, then RPC ports (none: one process).
llama_run() {
  local label=$1; shift
  local rpc=() p list=""
  for p in "$@"; do
    "$lbin/ggml-rpc-server" -H 127.0.0.1 -p "$p" -t "$node_threads" >"$work/rpc.$p.log" 2>&1 &
    pids+=($!)
  done
  for p in "$@"; do
    local ok=0
    for _ in $(seq 1 300); do
      if tcp_ready "$p"; then ok=1; break; fi
      sleep 0.2
    done
    [ "$ok" = 1 ] || fail "ggml-rpc-server on port $p not listening after 60 s" "$work/rpc.$p.log"
    list="${list:+$list,}127.0.0.1:$p"
  done
  if [ -n "$list" ]; then rpc=(--rpc "$list" -ngl 99); fi
  echo "+ llama-bench -m $model ${rpc[*]} -t $threads -p $pp -n $tg -r $reps -o json" >&2
  # -v: its log says which device each layer was assigned to (printed below for the RPC runs).
  bounded "$lbin/llama-bench" -m "$model" "${rpc[@]}" -t "$threads" -p "$pp" -n "$tg" \
    -r "$reps" -o json -v >"$work/$label.json" 2>"$work/$label.err" \
    || fail "llama-bench ($label) failed" "$work/$label.err" "$work"/rpc.*.log
  if [ -n "$list" ]; then
    echo "llama.cpp $label: layers per device: $(grep -o 'layer *[0-9]* assigned to device [A-Za-z0-9]*' "$work/$label.err" \
      | sort -u | awk '{print $NF}' | sort | uniq -c | awk '{printf "%s %s  ", $2, $1}')$(grep -m1 -o 'offloaded [0-9]*/[0-9]* layers' "$work/$label.err" || true)"
  fi
  stop_all
}
llama_run llama-1
mapfile -t ports < <(free_ports tcp 2)
[ "${#ports[@]}" = 2 ] || fail "no free TCP ports"
llama_run llama-rpc2 "${ports[@]}"
mapfile -t ports < <(free_ports tcp 3)
[ "${#ports[@]}" = 3 ] || fail "no free TCP ports"
llama_run llama-rpc3 "${ports[@]}"

# ---- ternfleet ----------------------------------------------------------------------------------
certs="$work/certs"
timeout 60 "$tf" certs init --dir "$certs" >/dev/null
for n in coordinator n1 n2 n3; do timeout 60 "$tf" certs issue --dir "$certs" --name "$n" >/dev/null; done
tf_args=(--prompt "$pp" --gen "$tg" --reps "$reps" --threads "$threads" --json)
IFS=',' read -r -a par_list <<<"$parallel"
# args: label, number of nodes (0: one process).
tf_run() {
  local label=$1 nodes=$2 cluster=() plan=() i
  if [ "$nodes" -gt 0 ]; then
    local file="$work/cluster.$nodes.toml" ports=()
    mapfile -t ports < <(free_ports udp "$nodes")
    [ "${#ports[@]}" = "$nodes" ] || fail "no free UDP ports"
    for i in $(seq 1 "$nodes"); do plan+=(--node "n$i=127.0.0.1:${ports[$((i - 1))]}"); done
    timeout 120 "$tf" cluster plan --bundle "$bundle" "${plan[@]}" --replicas 1 -o "$file" >"$work/plan.$nodes.out" 2>&1 \
      || fail "ternfleet cluster plan failed" "$work/plan.$nodes.out"
    for i in $(seq 1 "$nodes"); do
      "$tf" node -m "$bundle" --id "n$i" --certs "$certs" --cluster "$file" --listen "127.0.0.1:${ports[$((i - 1))]}" \
        -t "$node_threads" >"$work/node.$label.n$i.out" 2>"$work/node.$label.n$i.err" &
      pids+=($!)
    done
    # Each node prints one start-up line once bound: {"ternfleet":"listening","role":"node","id":..,"quic":ADDR}.
    for i in $(seq 1 "$nodes"); do
      local out="$work/node.$label.n$i.out" pid=${pids[$((${#pids[@]} - nodes + i - 1))]} ok=0 addr
      for _ in $(seq 1 600); do
        if [ -s "$out" ]; then ok=1; break; fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
      done
      if [ "$ok" = 0 ]; then
        kill -0 "$pid" 2>/dev/null || fail "node n$i exited before its start-up line" "$work/node.$label.n$i.err"
        fail "node n$i printed no start-up line in 120 s" "$work/node.$label.n$i.err"
      fi
      addr=$(python3 -c 'import json, sys; v = json.loads(open(sys.argv[1]).readline())
assert v["ternfleet"] == "listening" and v["role"] == "node" and v["id"] == sys.argv[2], v
print(v["quic"])' "$out" "n$i") || fail "node n$i: bad start-up line" "$out"
      echo "node n$i listening on $addr (QUIC)" >&2
    done
    cluster=(--cluster "$file" --certs "$certs")
    if [ -n "$deadline" ]; then cluster+=(--step-deadline "$deadline"); fi
  fi
  echo "+ ternfleet bench -m $bundle ${cluster[*]} ${tf_args[*]}" >&2
  bounded "$tf" bench -m "$bundle" "${cluster[@]}" "${tf_args[@]}" >"$work/$label.json" 2>"$work/$label.err" \
    || fail "ternfleet bench ($label) failed" "$work/$label.err" "$work"/node."$label".*.err
  # Aggregate decode with P sequences at once (16-token prompts), against the same nodes.
  local p
  for p in "${par_list[@]}"; do
    [ "$p" -gt 0 ] || continue
    echo "+ ternfleet bench -m $bundle ${cluster[*]} --prompt 16 --gen $tg --parallel $p" >&2
    bounded "$tf" bench -m "$bundle" "${cluster[@]}" --prompt 16 --gen "$tg" --reps "$reps" --threads "$threads" \
      --parallel "$p" --json >"$work/$label.agg$p.json" 2>"$work/$label.agg$p.err" \
      || fail "ternfleet bench --parallel $p ($label) failed" "$work/$label.agg$p.err"
  done
  stop_all
}
tf_run tf-1 0
tf_run tf-2 2
tf_run tf-3 3

echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$work" "$pp" "$tg" "$parallel" <<'PY'
import json, re, sys
work, pp, tg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pars = [int(p) for p in sys.argv[4].split(",") if p.strip() and int(p) > 0]
def llama(label):
    rows = json.load(open(f"{work}/{label}.json"))
    r = {"pp": None, "tg": None, "agg": None, "backends": rows[0].get("backends", "?") if rows else "?"}
    for v in rows:
        # ternfleet's mean is tokens over total time, the harmonic mean of its runs' rates;
        # llama-bench's avg_ts is their arithmetic mean, so take the same mean of its samples.
        ts = v.get("samples_ts") or []
        mean = len(ts) / sum(1 / x for x in ts) if ts and all(x > 0 for x in ts) else v["avg_ts"]
        if v["n_prompt"] > 0 and v["n_gen"] == 0: r["pp"] = mean
        if v["n_prompt"] == 0 and v["n_gen"] > 0: r["tg"], r["tg_runs"] = mean, ts
    return r
def tern(label):
    v = json.load(open(f"{work}/{label}.json"))
    r = {"pp": v["pp_tps"], "tg": v["tg_tps"], "tg_runs": v.get("tg_tps_runs"), "backends": v.get("kernels", "?")}
    for p in pars:
        r[f"agg{p}"] = json.load(open(f"{work}/{label}.agg{p}.json")).get("agg_tg_tps")
    # The coordinator's exit line: "cluster: N calls to M nodes (...), X MB sent, Y MB received, round trip mean Z ms"
    m = re.search(r"cluster: (\d+) calls to (\d+) nodes .*?([\d.]+) MB sent, ([\d.]+) MB received, round trip mean ([\d.]+) ms",
                  open(f"{work}/{label}.err", errors="replace").read())
    r["wire"] = m.groups() if m else None
    return r
rows = [("llama.cpp, 1 process", llama("llama-1")),
        ("llama.cpp RPC, 2 servers", llama("llama-rpc2")),
        ("llama.cpp RPC, 3 servers", llama("llama-rpc3")),
        ("ternfleet, 1 process", tern("tf-1")),
        ("ternfleet, 2 nodes", tern("tf-2")),
        ("ternfleet, 3 nodes", tern("tf-3"))]
for name, r in rows[1:3]:
    if "RPC" not in r["backends"]:
        sys.exit(f"{name}: llama-bench reports backends {r['backends']!r}, not RPC")
d = dict(rows)
for r in d.values():
    for p in pars:
        r.setdefault(f"agg{p}", None)
f = lambda x: "" if x is None else f"{x:.1f}"
q = lambda a, b: "" if a is None or not b else f"{a / b:.2f}x"
ref = {"ternfleet, 2 nodes": d["llama.cpp RPC, 2 servers"], "ternfleet, 3 nodes": d["llama.cpp RPC, 3 servers"],
       "ternfleet, 1 process": d["llama.cpp, 1 process"]}
aggs = "".join(f" agg tg, {p} seqs |" for p in pars)
print(f"\npp{pp} / tg{tg} tokens/s (both engines: tokens over total time of their runs); ratios against llama.cpp with the same number of processes")
print(f"| run | pp{pp} t/s | tg{tg} t/s |{aggs} pp vs llama.cpp | tg vs llama.cpp | tg vs ternfleet 1 process |")
print("|---|---:|---:|" + "---:|" * len(pars) + "---:|---:|---:|")
for name, r in rows:
    l = ref.get(name)
    ag = "".join(f" {f(r[f'agg{p}'])} |" for p in pars)
    print(f"| {name} | {f(r['pp'])} | {f(r['tg'])} |{ag} {q(r['pp'], l['pp']) if l else ''} | "
          f"{q(r['tg'], l['tg']) if l else ''} | {q(r['tg'], d['ternfleet, 1 process']['tg']) if name.startswith('ternfleet') else ''} |")
# Each run's decode rate: on a shared or noisy host one slow run moves a mean of few runs.
each = [f"{name} {' / '.join(f'{x:.1f}' for x in r['tg_runs'])}" for name, r in rows if r.get("tg_runs")]
if each:
    print(f"\ntg{tg} of each run, t/s: " + "; ".join(each))
for name in ("ternfleet, 2 nodes", "ternfleet, 3 nodes"):
    w = d[name].get("wire")
    if w:
        calls, nodes, sent, recv, rtt = w
        print(f"{name}: {calls} calls ({sent} MB sent, {recv} MB received) in its pp/tg bench, mean call round trip {rtt} ms; "
              "round trips per token = MoE layers (a layer's calls go out together)")
t3, l3, t1 = d["ternfleet, 3 nodes"], d["llama.cpp RPC, 3 servers"], d["ternfleet, 1 process"]
def goal(label, a, b, want):
    if a is None or not b: return
    r = a / b
    print(f"{label}: {r:.2f}x (goal >= {want}x) {'met' if r >= want else 'NOT met'}")
print()
goal("decode, ternfleet 3 nodes / llama.cpp RPC 3 servers (tg, one sequence)", t3["tg"], l3["tg"], 1.5)
for p in pars:
    goal(f"decode, ternfleet 3 nodes agg tg ({p} seqs) / llama.cpp RPC 3 servers tg", t3[f"agg{p}"], l3["tg"], 1.5)
goal("decode, ternfleet 3 nodes / ternfleet 1 process (tg, one sequence)", t3["tg"], t1["tg"], 0.85)
for p in pars:
    goal(f"decode, ternfleet 3 nodes / ternfleet 1 process (agg tg, {p} seqs)", t3[f"agg{p}"], t1[f"agg{p}"], 0.85)
PY
