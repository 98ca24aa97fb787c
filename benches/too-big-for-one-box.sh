#!/usr/bin/env bash
# "Too big for one box", shown with memory-limited containers on one host: a MoE model larger
# than any one box's memory, run four ways, one engine at a time, the page cache dropped
# before each run (the limits emulate smaller machines on this one host; every container
# shares its cores):
#   - ternfleet, 3 nodes: `ternfleet node` containers with --mem each (every node's shard
#     resident) and a coordinator container with --coordinator-mem (`ternfleet bench
#     --cluster`), over QUIC with mutual TLS on a Docker network;
#   - ternfleet, one container with --mem (the expert store keeps --ram-budget of experts in
#     RAM and reads the rest from disk);
#   - llama.cpp, one container with --mem (`llama-bench --repack 0`: the weights mmapped; its
#     default repacks Q4_K into anonymous memory, which a box this size cannot hold);
#   - llama.cpp RPC: three `ggml-rpc-server` containers with --mem each and llama-bench
#     (`--rpc A,B,C -ngl N`) in a container with --coordinator-mem. llama.cpp splits the
#     offloaded layers evenly over the servers; with all 48 layers of the 18.6 GB model there
#     (-ngl 99) each server needs 6.2 GB and a 6 GiB one is OOM-killed, so by default the
#     main process keeps the first 4 layers (--rpc-ngl 45) — llama.cpp's own way to use the
#     memory of the box it runs on.
# Each run reports prefill (pp) and decode (tg) tokens/s of one sequence (llama-bench's
# tests and `ternfleet bench`, the same --pp / --tg / --reps) and time to first token from a
# cold start (page cache dropped: servers started, model loaded, a 1-token prompt answered
# with 1 token), and every container's peak memory (cgroup v1 max_usage: page cache
# included) and whether the kernel OOM-killed it. ternfleet's nodes are timed twice: their
# first start hashes every blob (SHA-256 against the manifest) and remembers it; a restart
# does not.
#
# --node-threads sets each ternfleet node's threads and, unless --rpc-threads is given, each
# ggml-rpc-server's: the three nodes compute at once on the host's shared cores (on a 2-core
# Zen 5, session 43, one thread each decoded 1.09-1.11x two in two alternated rounds), where
# llama.cpp's servers run one after another (its layer split) and are faster with every core.
#
# Needs root (drop_caches), Docker, the ternfleet image (docker/build-image.sh) and
# llama.cpp's RPC build (scripts/build-llama-cpp.sh --rpc), both built here unless
# --no-build. The model is made by scripts/make-scale-model.py --shape qwen3-30b-a3b (18.6
# GB); its bundle by `ternfleet convert` when --bundle does not exist.
#
# usage: benches/too-big-for-one-box.sh --model FILE.gguf [--bundle DIR] [--mem 6g]
#          [--coordinator-mem 3g] [--ram-budget 4GiB] [--pp 64] [--tg 16] [--reps 2]
#          [--threads 2] [--node-threads 2] [--rpc-threads T] [--rpc-ngl 45] [--runs tf3,tf1,llama1,rpc3] [--timeout SECS] [--no-build]
# Smoke run (numbers meaningless): --model tests/data/models/tiny-qwen3moe-q8_0.gguf
#   --mem 512m --coordinator-mem 512m --ram-budget 1MiB --reps 1
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
usage="usage: $0 --model FILE.gguf [--bundle DIR] [--mem 6g] [--coordinator-mem 3g] [--ram-budget 4GiB] [--pp N] [--tg N] [--reps N] [--threads T] [--node-threads T] [--rpc-threads T] [--rpc-ngl N] [--runs tf3,tf1,llama1,rpc3] [--timeout SECS] [--no-build]"
model="" bundle="" mem=6g cmem=3g budget=4GiB pp=64 tg=16 reps=2 threads=2 runs="tf3,tf1,llama1,rpc3" limit=1800 build=1 ngl=45 node_threads=2 rpc_threads=""
while [ $# -gt 0 ]; do
  case "$1" in
    --model|-m) model=$2; shift 2 ;;
    --bundle) bundle=$2; shift 2 ;;
    --mem) mem=$2; shift 2 ;;
    --coordinator-mem) cmem=$2; shift 2 ;;
    --ram-budget) budget=$2; shift 2 ;;
    --pp) pp=$2; shift 2 ;;
    --tg) tg=$2; shift 2 ;;
    --reps|-r) reps=$2; shift 2 ;;
    --threads|-t) threads=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --rpc-ngl) ngl=$2; shift 2 ;;
    --node-threads) node_threads=$2; shift 2 ;;
    --rpc-threads) rpc_threads=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
[ -n "$model" ] || { echo "$usage" >&2; exit 2; }
[ -n "$rpc_threads" ] || rpc_threads=$node_threads
[ -f "$model" ] || { echo "too-big: no model at $model" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "too-big: run as root (the page cache is dropped between runs)" >&2; exit 1; }
command -v docker >/dev/null || { echo "too-big: docker is not installed" >&2; exit 1; }
model=$(cd "$(dirname "$model")" && pwd)/$(basename "$model")
[ -n "$bundle" ] || bundle="$root/target/bundles/$(basename "$model" .gguf)"
# Docker bind-mounts it: a relative path would name a volume, not a directory.
case "$bundle" in /*) ;; *) bundle="$PWD/$bundle" ;; esac
tf="$root/target/release/ternfleet"
lbin="$root/target/llama.cpp/build-rpc/bin"
image=${TERNFLEET_IMAGE:-ternfleet:latest}
limage=ternfleet-bench-llama-rpc:local
if [ "$build" = 1 ]; then
  "$root/scripts/build-llama-cpp.sh" --rpc >&2
  (cd "$root" && docker/build-image.sh >&2)
fi
[ -x "$tf" ] || { echo "too-big: no ternfleet binary at $tf (cargo build --release)" >&2; exit 1; }
docker image inspect "$image" >/dev/null 2>&1 || { echo "too-big: no image $image (docker/build-image.sh)" >&2; exit 1; }
for b in ggml-rpc-server llama-bench; do
  [ -x "$lbin/$b" ] || { echo "too-big: $lbin/$b missing (scripts/build-llama-cpp.sh --rpc)" >&2; exit 1; }
done

tag="tb$$"
work=$(mktemp -d)
net="$tag-net"
cleanup() {
  docker ps -aq --filter "label=ternfleet.bench=$tag" | xargs -r docker rm -f >/dev/null 2>&1 || true
  docker network rm "$net" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
fail() { # message log-file...
  echo "too-big: $1" >&2; shift
  local f; for f in "$@"; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 20 "$f" >&2; }; done
  exit 1
}
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
now() { date +%s.%N; }

# llama.cpp's image: llama-bench and ggml-rpc-server (built here, statically linked to
# ggml) on scratch, like ternfleet's. Nothing of llama.cpp is committed.
if ! docker image inspect "$limage" >/dev/null 2>&1 || [ "$build" = 1 ]; then
  ctx="$work/llama-image"
  # shellcheck source=../docker/rootfs.sh
  . "$root/docker/rootfs.sh"
  stage_rootfs "$ctx/rootfs" "$lbin/llama-bench" "$lbin/ggml-rpc-server"
  printf 'FROM scratch\nCOPY rootfs/ /\nUSER 10001:10001\nENV HOME=/tmp\nWORKDIR /tmp\n' >"$ctx/Dockerfile"
  docker build -q -t "$limage" "$ctx" >/dev/null
fi

echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) (family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs) model $(grep -m1 '^model' /proc/cpuinfo | cut -d: -f2 | xargs)), $(nproc) cores, $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
echo "model: $model ($(du -b "$model" | cut -f1) bytes); bundle: $bundle"
echo "limits: each node / RPC server / single box $mem, coordinator / llama-bench main $cmem; ternfleet single box --ram-budget $budget"
echo "pp $pp, tg $tg, reps $reps; threads: $node_threads per node, $rpc_threads per RPC server, $threads per other process"

if [ ! -d "$bundle" ]; then
  echo "making the bundle: ternfleet convert -m $model -o $bundle" >&2
  mkdir -p "$(dirname "$bundle")"
  timeout "$limit" "$tf" convert -m "$model" -o "$bundle" >"$work/convert.out" 2>"$work/convert.err" \
    || fail "ternfleet convert failed" "$work/convert.err"
fi
docker network create "$net" >/dev/null

# The cgroup (v1) memory directory of a running container.
cgroup_of() {
  local id
  id=$(docker inspect -f '{{.Id}}' "$1")
  for d in "/sys/fs/cgroup/memory/docker/$id" "/sys/fs/cgroup/memory/system.slice/docker-$id.scope"; do
    [ -d "$d" ] && { echo "$d"; return; }
  done
}
peak_of() { # container: bytes, or ? when not found
  local d; d=$(cgroup_of "$1" 2>/dev/null || true)
  if [ -n "$d" ] && [ -r "$d/memory.max_usage_in_bytes" ]; then cat "$d/memory.max_usage_in_bytes"; else echo "?"; fi
}
record() { # run container: appends "run name peak oom" to the memory table
  local peak oom
  peak=$(peak_of "$2")
  oom=$(docker inspect -f '{{.State.OOMKilled}}' "$2" 2>/dev/null || echo "?")
  echo "$1 $2 $peak $oom" >>"$work/memory.txt"
}
base_args() { # name limit
  echo --name "$1" --label "ternfleet.bench=$tag" --network "$net" --memory "$2" --memory-swap "$2"
}

# A server container, detached: name alias limit image args...
server() {
  local name=$1 alias=$2 lim=$3 img=$4
  shift 4
  # shellcheck disable=SC2046
  docker run -d $(base_args "$name" "$lim") --network-alias "$alias" \
    -v "$bundle:/bundle:ro" -v "$(dirname "$model"):/models:ro" -v "$work/certs:/certs:ro" \
    -v "$work/state/$alias:/state" "$img" "$@" >/dev/null
}

# A one-shot container: name run limit image args...; waits (bounded) while sampling its
# peak memory, then keeps its stdout in $work/NAME.out and stderr in $work/NAME.err.
once() {
  local name=$1 run=$2 lim=$3 img=$4 t0 d peak=0 p rc
  shift 4
  # shellcheck disable=SC2046
  docker run -d $(base_args "$name" "$lim") \
    -v "$bundle:/bundle:ro" -v "$(dirname "$model"):/models:ro" -v "$work/certs:/certs:ro" \
    "$img" "$@" >/dev/null
  d=$(cgroup_of "$name" || true)
  t0=$SECONDS
  while [ "$(docker inspect -f '{{.State.Running}}' "$name")" = true ]; do
    if [ -n "$d" ] && p=$(cat "$d/memory.max_usage_in_bytes" 2>/dev/null); then [ "$p" -gt "$peak" ] && peak=$p; fi
    if [ $((SECONDS - t0)) -gt "$limit" ]; then docker kill "$name" >/dev/null 2>&1 || true; fi
    sleep 0.5
  done
  rc=$(docker inspect -f '{{.State.ExitCode}}' "$name")
  docker logs "$name" >"$work/$name.out" 2>"$work/$name.err" || true
  echo "$run $name $peak $(docker inspect -f '{{.State.OOMKilled}}' "$name")" >>"$work/memory.txt"
  docker rm "$name" >/dev/null
  [ "$rc" = 0 ] || fail "$name exited with status $rc (limit $lim; OOM-killed: $(tail -n1 "$work/memory.txt" | cut -d' ' -f4))" "$work/$name.err"
}
elapsed() { python3 -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.1f}")' "$1" "$2"; }

# ---- ternfleet ----------------------------------------------------------------------------------
mkdir -p "$work/certs" "$work/state"
timeout 60 "$tf" certs init --dir "$work/certs" --issue coordinator --issue n1 --issue n2 --issue n3 >/dev/null
timeout 120 "$tf" cluster plan --bundle "$bundle" --node n1=n1:7400 --node n2=n2:7400 --node n3=n3:7400 \
  --replicas 1 -o "$work/certs/cluster.toml" >"$work/plan.out" 2>&1 || fail "ternfleet cluster plan failed" "$work/plan.out"
for n in n1 n2 n3; do mkdir -p "$work/state/$n"; done
chown -R 10001:10001 "$work/certs" "$work/state"
tf_bench=(bench -m /bundle --prompt "$pp" --gen "$tg" --reps "$reps" --threads "$threads" --json)
tf_first=(generate -m /bundle -p "Hello" -n 1 --temp 0 --threads "$threads")
cluster=(--cluster /certs/cluster.toml --certs /certs)

# Nodes started, then waited for (bounded) until each answers Hello with its shard loaded.
nodes_up() {
  local n t0=$SECONDS
  for n in n1 n2 n3; do
    server "$tag-$n" "$n" "$mem" "$image" node -m /bundle --id "$n" --certs /certs \
      --cluster /certs/cluster.toml --listen 0.0.0.0:7400 -t "$node_threads" --state-dir /state
  done
  for n in n1 n2 n3; do
    until docker exec "$tag-$n" /usr/local/bin/ternfleet probe quic://127.0.0.1:7400 --certs /certs --id coordinator --node "$n" >/dev/null 2>&1; do
      [ "$(docker inspect -f '{{.State.Running}}' "$tag-$n")" = true ] \
        || { docker logs "$tag-$n" >"$work/$n.log" 2>&1; fail "node $n exited (OOM-killed: $(docker inspect -f '{{.State.OOMKilled}}' "$tag-$n"))" "$work/$n.log"; }
      [ $((SECONDS - t0)) -lt "$limit" ] || fail "node $n not ready after $limit s"
      sleep 0.5
    done
  done
}
nodes_down() {
  local n
  for n in n1 n2 n3; do
    record "$1" "$tag-$n"
    docker logs "$tag-$n" >"$work/$1.$n.log" 2>&1 || true
    docker rm -f "$tag-$n" >/dev/null
  done
}

ready=()
case ",$runs," in *,tf3,*)
  echo "ternfleet, 3 nodes: first start (blobs hashed)" >&2
  drop_caches; t0=$(now)
  nodes_up; t1=$(now)
  once "$tag-tf3-first" tf3 "$cmem" "$image" "${tf_first[@]}" "${cluster[@]}"
  t2=$(now)
  nodes_down tf3-first
  echo "tf3 first $(elapsed "$t0" "$t2") $(elapsed "$t0" "$t1")" >>"$work/ready.txt"
  echo "ternfleet, 3 nodes: restart" >&2
  drop_caches; t0=$(now)
  nodes_up; t1=$(now)
  once "$tag-tf3-ready" tf3 "$cmem" "$image" "${tf_first[@]}" "${cluster[@]}"
  t2=$(now)
  echo "tf3 restart $(elapsed "$t0" "$t2") $(elapsed "$t0" "$t1")" >>"$work/ready.txt"
  echo "ternfleet, 3 nodes: bench" >&2
  drop_caches # the coordinator's own page cache counted in its limit (the nodes' pages are mapped)
  once "$tag-tf3" tf3 "$cmem" "$image" "${tf_bench[@]}" "${cluster[@]}"
  nodes_down tf3
;; esac

case ",$runs," in *,tf1,*)
  echo "ternfleet, one box: first token" >&2
  drop_caches; t0=$(now)
  once "$tag-tf1-ready" tf1 "$mem" "$image" "${tf_first[@]}" --ram-budget "$budget"
  echo "tf1 cold $(elapsed "$t0" "$(now)")" >>"$work/ready.txt"
  echo "ternfleet, one box: bench" >&2
  drop_caches
  once "$tag-tf1" tf1 "$mem" "$image" "${tf_bench[@]}" --ram-budget "$budget"
;; esac

# ---- llama.cpp ----------------------------------------------------------------------------------
lm=/models/$(basename "$model")
case ",$runs," in *,llama1,*)
  echo "llama.cpp, one box: first token" >&2
  drop_caches; t0=$(now)
  once "$tag-llama1-ready" llama1 "$mem" "$limage" /usr/local/bin/llama-bench -m "$lm" -p 1 -n 0 -r 1 \
    --no-warmup -t "$threads" --repack 0 -o json
  echo "llama1 cold $(elapsed "$t0" "$(now)")" >>"$work/ready.txt"
  echo "llama.cpp, one box: bench" >&2
  drop_caches
  once "$tag-llama1" llama1 "$mem" "$limage" /usr/local/bin/llama-bench -m "$lm" -p "$pp" -n "$tg" \
    -r "$reps" -t "$threads" --repack 0 -o json
;; esac

case ",$runs," in *,rpc3,*)
  rpc_list=""
  for n in r1 r2 r3; do
    server "$tag-$n" "$n" "$mem" "$limage" /usr/local/bin/ggml-rpc-server -H 0.0.0.0 -p 50052 -t "$rpc_threads"
    rpc_list="${rpc_list:+$rpc_list,}$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$tag-$n"):50052"
  done
  sleep 1
  echo "llama.cpp RPC, 3 servers: first token" >&2
  drop_caches; t0=$(now)
  once "$tag-rpc3-ready" rpc3 "$cmem" "$limage" /usr/local/bin/llama-bench -m "$lm" --rpc "$rpc_list" -ngl "$ngl" \
    -p 1 -n 0 -r 1 --no-warmup -t "$threads" -o json
  echo "rpc3 cold $(elapsed "$t0" "$(now)")" >>"$work/ready.txt"
  echo "llama.cpp RPC, 3 servers: bench" >&2
  drop_caches
  once "$tag-rpc3" rpc3 "$cmem" "$limage" /usr/local/bin/llama-bench -m "$lm" --rpc "$rpc_list" -ngl "$ngl" \
    -p "$pp" -n "$tg" -r "$reps" -t "$threads" -o json -v
  for n in r1 r2 r3; do record rpc3 "$tag-$n"; docker rm -f "$tag-$n" >/dev/null; done
  echo "llama.cpp RPC: layers per device: $(grep -o 'layer *[0-9]* assigned to device [A-Za-z0-9]*' "$work/$tag-rpc3.err" \
    | sort -u | awk '{print $NF}' | sort | uniq -c | awk '{printf "%s %s  ", $2, $1}')"
;; esac

echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$work" "$tag" "$pp" "$tg" "$runs" "$mem" "$cmem" "$ngl" <<'PY'
import json, sys
work, tag, pp, tg, runs, mem, cmem, ngl = sys.argv[1:9]
runs = runs.split(",")
ready = {}
for line in open(f"{work}/ready.txt"):
    run, kind, *secs = line.split()
    ready[(run, kind)] = secs
peaks = {}
for line in open(f"{work}/memory.txt"):
    run, name, peak, oom = line.split()
    peaks.setdefault(run, []).append((name.removeprefix(tag + "-"), peak, oom))
each = {}
def tern(name):
    v = json.loads(open(f"{work}/{tag}-{name}.out").read().strip().splitlines()[-1])
    each[name] = v.get("tg_tps_runs") or []
    return v["pp_tps"], v["tg_tps"]
def llama(name):
    rows = json.load(open(f"{work}/{tag}-{name}.out"))
    # ternfleet's mean is tokens over total time, the harmonic mean of its runs' rates;
    # llama-bench's avg_ts is their arithmetic mean, so take the same mean of its samples.
    def mean(r):
        ts = r.get("samples_ts") or []
        return len(ts) / sum(1 / x for x in ts) if ts and all(x > 0 for x in ts) else r["avg_ts"]
    pp = next(mean(r) for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tgr = next(r for r in rows if r["n_prompt"] == 0 and r["n_gen"] > 0)
    each[name] = tgr.get("samples_ts") or []
    return pp, mean(tgr)
names = {"tf3": f"ternfleet, 3 nodes ({mem} each) + coordinator ({cmem})",
         "tf1": f"ternfleet, 1 box ({mem}, expert store)",
         "llama1": f"llama.cpp, 1 box ({mem}, --repack 0, mmap)",
         "rpc3": f"llama.cpp RPC, 3 servers ({mem} each) + main ({cmem}), -ngl {ngl}"}
res = {}
for r in runs:
    res[r] = tern(r) if r.startswith("tf") else llama(r)
def ready_s(r):
    if r == "tf3":
        first, restart = ready[("tf3", "first")], ready[("tf3", "restart")]
        return f"{restart[0]} s (nodes ready {restart[1]} s); first start {first[0]} s (hashing, nodes {first[1]} s)"
    return f"{ready[(r, 'cold')][0]} s"
def gib(b):
    return "?" if b == "?" else f"{int(b) / 2**30:.2f}"
base = res.get("llama1")
rpc = res.get("rpc3")
print(f"\npp{pp} / tg{tg} tokens/s, one sequence; cold start to first token with the page cache dropped")
print(f"| run | pp{pp} t/s | tg{tg} t/s | tg vs llama.cpp 1 box | tg vs llama.cpp RPC | cold start to first token | peak memory per container, GiB (OOM-killed) |")
print("|---|---:|---:|---:|---:|---|---|")
q = lambda a, b: f"{a / b:.2f}x" if b else ""
for r in runs:
    p, t = res[r]
    # The benched run's containers (the first-token runs only fail the script when killed).
    mems = ", ".join(f"{n.removeprefix(r + '-') if n != r else 'bench'} {gib(pk)}{' OOM' if o == 'true' else ''}"
                     for n, pk, o in peaks.get(r, []) if not n.endswith(("-ready", "-first")))
    print(f"| {names[r]} | {p:.2f} | {t:.2f} | {q(t, base[1]) if base else ''} | {q(t, rpc[1]) if rpc else ''} | {ready_s(r)} | {mems} |")
# Every run's decode rate: the hosts move, and one slow run moves a mean.
print(f"\ntg{tg} of each run, t/s: " + "; ".join(
    f"{names[r].split(' (')[0]} " + " / ".join(f"{x:.2f}" for x in each.get(r, [])) for r in runs))
if "tf3" in res:
    # The coordinator's exit line: calls, bytes and mean round trip of the benched run.
    import re
    try:
        m = re.search(r"cluster: \d+ calls .*$", open(f"{work}/{tag}-tf3.err").read(), re.M)
        if m:
            print(m.group(0))
    except OSError:
        pass
    print()
    for label, ref, want in (("llama.cpp in one box", base, 3.0), ("llama.cpp RPC with three servers", rpc, 1.5)):
        if ref:
            x = res["tf3"][1] / ref[1]
            print(f"decode, ternfleet 3 nodes / {label}: {x:.2f}x (goal >= {want}x) {'met' if x >= want else 'NOT met'}")
PY
