#!/usr/bin/env bash
# The bare-metal guide (deploy/GUIDE.md), run: four network namespaces on a bridge stand in
# for four machines (n1-n3 at 10.77.0.1-3, the coordinator at 10.77.0.9), each with its own
# /etc, /var/lib and /srv under a temporary root. The guide's commands, in its order:
# certificates with `certs init --issue`, `convert`, `cluster plan`, the nodes (`--init-cluster`,
# then `--join`), the coordinator from a serve.toml, then `ctl status`, a completion equal to
# the single process's, drain / recommission under a request, `placement plan`, a rolling
# restart of every node (SIGTERM, start again), snapshot save. Needs root (ip netns).
# Always kills its processes and removes namespaces, bridge and files.
#
#   deploy/test-guide.sh [BINARY]      # default target/debug/ternfleet
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${1:-target/debug/ternfleet}")
[ -x "$bin" ] || { echo "test-guide: $bin is not built" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "test-guide: needs root (ip netns)"; exit 0; }
command -v ip >/dev/null || { apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null; }

tag=tg$$
root=$(mktemp -d)
hosts=(n1 n2 n3 co)
declare -A ip=([n1]=10.77.0.1 [n2]=10.77.0.2 [n3]=10.77.0.3 [co]=10.77.0.9)
declare -A pid=()
cleanup() {
  # Every process of every namespace, whatever started it.
  for h in "${hosts[@]}"; do
    ip netns pids "$tag-$h" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  done
  wait 2>/dev/null || true
  for h in "${hosts[@]}"; do ip netns del "$tag-$h" 2>/dev/null || true; done
  ip link del "$tag-br" 2>/dev/null || true
  iptables -D FORWARD -i "$tag-br" -o "$tag-br" -j ACCEPT 2>/dev/null || true
  mkdir -p target/test-guide
  for h in "${hosts[@]}"; do cp "$root/$h"/*.log target/test-guide/ 2>/dev/null || true; done
  rm -rf "$root"
}
trap cleanup EXIT

# The "machines".
ip link add "$tag-br" type bridge
ip link set "$tag-br" up
# Docker's FORWARD policy (DROP, with bridge netfilter on) would drop the bridged packets.
if command -v iptables >/dev/null; then
  iptables -I FORWARD -i "$tag-br" -o "$tag-br" -j ACCEPT
fi
for h in "${hosts[@]}"; do
  ns=$tag-$h
  ip netns add "$ns"
  ip link add "$tag-$h-v" type veth peer name eth0 netns "$ns"
  ip link set "$tag-$h-v" master "$tag-br" up
  ip -n "$ns" addr add "${ip[$h]}/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  mkdir -p "$root/$h/etc/ternfleet/certs" "$root/$h/var/lib/ternfleet" "$root/$h/srv/ternfleet"
done
on() { local h=$1; shift; ip netns exec "$tag-$h" "$@"; }

# 2-3: certificates, bundle, first placement (the admin machine: here, the host).
admin=$root/admin
mkdir -p "$admin"
"$bin" certs init --dir "$admin/ca" --issue coordinator --issue operator \
  --issue n1 --issue n2 --issue n3 >/dev/null
"$bin" convert -m tests/data/models/tiny-qwen3moe-q8_0.gguf -o "$admin/bundle" >/dev/null
"$bin" cluster plan --bundle "$admin/bundle" --replicas 2 \
  --node n1=10.77.0.1:7400 --node n2=10.77.0.2:7400 --node n3=10.77.0.3:7400 \
  -o "$admin/cluster.toml" >/dev/null
for h in "${hosts[@]}"; do
  id=$h; [ "$h" = co ] && id=coordinator
  cp "$admin/ca/ca.pem" "$admin/ca/$id.pem" "$admin/ca/$id.key" "$root/$h/etc/ternfleet/certs/"
  cp -r "$admin/bundle" "$root/$h/srv/ternfleet/bundle"
  cp "$admin/cluster.toml" "$root/$h/etc/ternfleet/"
done
cp "$admin/ca/operator.pem" "$admin/ca/operator.key" "$root/co/etc/ternfleet/certs/"

# 4: start. The node's command line is the unit's ExecStart with its env file's values.
node() { # ID EXTRA...
  local h=$1; shift
  local r=$root/$h
  ip netns exec "$tag-$h" "$bin" node -m "$r/srv/ternfleet/bundle" --id "$h" --certs "$r/etc/ternfleet/certs" \
    --cluster "$r/etc/ternfleet/cluster.toml" --listen 0.0.0.0:7400 \
    --state-dir "$r/var/lib/ternfleet" "$@" >>"$r/node.out" 2>>"$r/$h.log" &
  pid[$h]=$!
}
node n1 --init-cluster
node n2 --join 10.77.0.1:7400
node n3 --join 10.77.0.1:7400
c=$root/co
cat >"$c/etc/ternfleet/serve.toml" <<EOF
model = "$c/srv/ternfleet/bundle"
certs = "$c/etc/ternfleet/certs"
join = "10.77.0.1:7400"
listen = "0.0.0.0:7500"
advertise = "10.77.0.9:7500"
http = "10.77.0.9:8080"
grpc = ""
listen_any = true
admin = "127.0.0.1:50052"
state_dir = "$c/var/lib/ternfleet"
EOF
coordinator() {
  ip netns exec "$tag-co" "$bin" serve --config "$c/etc/ternfleet/serve.toml" \
    >>"$c/serve.out" 2>>"$c/coordinator.log" &
  pid[co]=$!
}
coordinator
t0=$SECONDS
until on co "$bin" probe http://10.77.0.9:8080/ready 2>/dev/null; do
  if [ $((SECONDS - t0)) -gt 120 ]; then
    echo "test-guide: the coordinator is not ready after 120 s" >&2
    tail -n 5 "$c/coordinator.log" "$root"/n*/n*.log >&2
    exit 1
  fi
  sleep 0.5
done
echo "test-guide: four 'machines' up, the coordinator ready $((SECONDS - t0)) s after it started"
# Each node's readiness as a healthcheck sees it (its own certificate, from its own host).
for h in n1 n2 n3; do
  on "$h" "$bin" probe "quic://${ip[$h]}:7400" --certs "$root/$h/etc/ternfleet/certs" --id "$h" \
    || { echo "test-guide: probe quic:// $h failed" >&2; exit 1; }
done
# A node that is not there: a clear failure, exit 1.
if on n1 "$bin" probe quic://10.77.0.1:7409 --certs "$root/n1/etc/ternfleet/certs" --id n1 \
  --timeout 2 2>/dev/null; then
  echo "test-guide: probe quic:// of a closed port succeeded" >&2
  exit 1
fi
echo "test-guide: probe quic:// says n1-n3 ready, and fails on a closed port"

tfctl() { on co "$bin" ctl --addr 127.0.0.1:50052 --certs "$c/etc/ternfleet/certs" --id operator "$@"; }
complete() { # the greedy completion's text
  on co python3 - <<'PY'
import json, urllib.request
req = urllib.request.Request("http://10.77.0.9:8080/v1/completions", method="POST",
    headers={"content-type": "application/json"},
    data=json.dumps({"prompt": "This License applies to any program", "max_tokens": 24,
                     "temperature": 0}).encode())
direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
print(json.load(direct.open(req, timeout=60))["choices"][0]["text"])
PY
}
# The reference: the same bundle in one process.
want=$("$bin" generate -m "$admin/bundle" -p "This License applies to any program" -n 24 \
  --temp 0 --numerics invariant --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["text"])')
got=$(complete)
[ "$got" = "$want" ] || { echo "test-guide: the cluster's text differs from the single process's" >&2; echo " want: $want" >&2; echo " got:  $got" >&2; exit 1; }
echo "test-guide: completion equals the single process's"

# Waits (at most 60 s) until `ctl node list` shows node $1 up.
wait_up() {
  local t0=$SECONDS
  until tfctl node list --json 2>/dev/null | python3 -c '
import json, sys
sys.exit(0 if any(n["id"] == sys.argv[1] and n["status"] == "up" for n in json.load(sys.stdin)["nodes"]) else 1)' "$1" 2>/dev/null; do
    [ $((SECONDS - t0)) -le 60 ] || { echo "test-guide: $1 not up after 60 s" >&2; tfctl node list >&2; exit 1; }
    sleep 0.5
  done
}

# 5: day to day.
tfctl status >/dev/null
# The joiners are promoted from learners to voters once they caught up (bounded wait).
t0=$SECONDS
until [ "$(tfctl status --json 2>/dev/null | python3 -c 'import json,sys; print(sum(m["role"] == "voter" for m in json.load(sys.stdin)["members"]))' 2>/dev/null)" = 3 ]; do
  [ $((SECONDS - t0)) -le 60 ] || { echo "test-guide: not 3 voters after 60 s" >&2; tfctl status >&2; exit 1; }
  sleep 0.5
done
# Every node up before a drain (a node marked down a moment ago, e.g. while it joined, would
# make the drain refuse: the experts it shares with n2 would have no live holder).
for h in n1 n2 n3; do wait_up "$h"; done
tfctl node drain n2 >/dev/null
[ "$(complete)" = "$want" ] || { echo "test-guide: drained, the text differs" >&2; exit 1; }
tfctl node recommission n2 >/dev/null
tfctl placement plan >/dev/null
echo "test-guide: ctl status (3 voters after $((SECONDS - t0)) s), drain, recommission, placement plan: ok"

# 6: rolling restart of every node (SIGTERM, wait for its exit, start it again).
for h in n1 n2 n3; do
  kill -TERM "${pid[$h]}"
  for _ in $(seq 100); do kill -0 "${pid[$h]}" 2>/dev/null || break; sleep 0.2; done
  ! kill -0 "${pid[$h]}" 2>/dev/null || { echo "test-guide: $h ignored SIGTERM for 20 s" >&2; exit 1; }
  unset "pid[$h]"
  node "$h"                                  # no flag: it restarts from its Raft store
  wait_up "$h"
  [ "$(complete)" = "$want" ] || { echo "test-guide: after restarting $h the text differs" >&2; exit 1; }
done
echo "test-guide: rolling restart of n1, n2, n3: each back up, the text unchanged"

# 7: backup.
tfctl snapshot save -o "$root/placement.snapshot" >/dev/null
[ -s "$root/placement.snapshot" ] || { echo "test-guide: no snapshot written" >&2; exit 1; }
echo "test-guide: snapshot saved; ok"
