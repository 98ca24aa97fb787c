#!/usr/bin/env bash
# Chaos on the docker-compose cluster (issue 17). Each scenario hurts the cluster while
# greedy requests run, checks every text equals the one the healthy cluster gave, and
# prints its figure: requests completed / failed, the longest pause between two streamed
# tokens (the failover stall), detection and recovery times.
#
#   docker/chaos.sh             # builds the image; always removes its containers and volumes
#
#   kill   `docker kill` a node mid-generation: a replica of its experts answers.
#   pause  `docker pause` a node past the step deadline (0.75 s): detected, rerouted; then
#          unpaused, and routed to again.
#   cut    `docker network disconnect` a voter: the majority keeps serving and commits (a
#          drain and recommission of another node), the voter catches up when reconnected.
#   roll   `docker restart` every node in turn under load: zero failed requests.
#   restart  every container restarted at once: the committed placement (no version lost,
#          every node's experts) and the same answer.
set -euo pipefail
cd "$(dirname "$0")/.."
project=tfchaos$$
. docker/common.sh
prepare
"${dc[@]}" up -d >&2
healthy 900

# stream PROMPT N [HOOK_AT HOOK_CMD]: a greedy completion of N tokens, streamed; after
# HOOK_AT tokens runs HOOK_CMD (a shell command). Prints one JSON line: text, tokens,
# longest gap between tokens (s), error.
stream() {
  python3 - "$(http_port)" "$@" <<'PY'
import json, subprocess, sys, time, openai
port, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
hook_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
hook = sys.argv[5] if len(sys.argv) > 5 else ""
c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
text, toks, gap, err, last = "", 0, 0.0, None, None
try:
    for ev in c.completions.create(model="ternfleet", prompt=prompt, max_tokens=n,
                                   temperature=0, stream=True):
        now = time.monotonic()
        if last is not None:
            gap = max(gap, now - last)
        last = now
        text += ev.choices[0].text or ""
        toks += 1
        if toks == hook_at:
            subprocess.run(hook, shell=True, check=True, capture_output=True)
except Exception as e:  # the figure counts it as a failed request
    err = f"{type(e).__name__}: {e}"
print(json.dumps({"text": text, "tokens": toks, "gap": gap, "error": err}))
PY
}

field() { python3 -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }

prompt="The history of the printing press begins"
want=$(stream "$prompt" 48)
[ "$(field "$want" error)" = None ] || { echo "chaos: the healthy cluster failed: $want" >&2; exit 1; }
echo "chaos: reference: $(field "$want" tokens) tokens, longest gap $(field "$want" gap) s"

check() { # NAME RESULT
  local err text
  err=$(field "$2" error)
  text=$(field "$2" text)
  if [ "$err" != None ]; then echo "chaos: $1: the request failed: $err" >&2; exit 1; fi
  if [ "$text" != "$(field "$want" text)" ]; then
    echo "chaos: $1: the text differs from the healthy cluster's" >&2
    echo "  want: $(field "$want" text)" >&2
    echo "  got:  $text" >&2
    exit 1
  fi
}

# Waits (at most $3 s) until `ctl node list` shows node $1 with status $2; prints the
# seconds it took.
node_is() {
  local t0=$SECONDS
  until ctl node list 2>/dev/null | python3 -c '
import json, sys
nodes = json.load(sys.stdin)["nodes"]
sys.exit(0 if any(n["id"] == sys.argv[1] and n["status"] == sys.argv[2] for n in nodes) else 1)' "$1" "$2"; do
    [ $((SECONDS - t0)) -le "$3" ] || { echo "chaos: $1 not $2 after $3 s" >&2; exit 1; }
    sleep 0.5
  done
  echo $((SECONDS - t0))
}

# kill: n2 dies after 8 streamed tokens.
got=$(stream "$prompt" 48 8 "docker kill $(cid n2)")
check kill "$got"
echo "chaos: kill n2 mid-generation: 1 completed, 0 failed, identical text; longest gap $(field "$got" gap) s"
down=$(node_is n2 down 60)
echo "chaos: kill: the control plane marked n2 down ${down} s after the request ended (missed heartbeats)"
docker start "$(cid n2)" >/dev/null
back=$(node_is n2 up 120)
echo "chaos: kill: n2 restarted, up again in ${back} s"

# pause: n3 frozen after 8 tokens, past the step deadline, then thawed.
got=$(stream "$prompt" 48 8 "docker pause $(cid n3)")
check pause "$got"
echo "chaos: pause n3 mid-generation: 1 completed, 0 failed, identical text; longest gap $(field "$got" gap) s (step deadline 0.75 s)"
docker unpause "$(cid n3)" >/dev/null
t0=$SECONDS
got=$(stream "$prompt" 48)
check unpause "$got"
echo "chaos: pause: n3 thawed; the next request identical ($((SECONDS - t0)) s)"
# load SECONDS THREADS: greedy completions of the reference prompt for SECONDS from THREADS
# clients; prints "completed failed differing".
load() {
  python3 - "$(http_port)" "$1" "$2" "$prompt" "$(field "$want" text)" <<'PY'
import sys, threading, time, openai
port, secs, threads, prompt, want = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
done, failed, differ, lock = 0, [], 0, threading.Lock()
end = time.monotonic() + secs
def client():
    global done, differ
    while time.monotonic() < end:
        try:
            r = c.completions.create(model="ternfleet", prompt=prompt, max_tokens=48, temperature=0)
            with lock:
                done += 1
                differ += r.choices[0].text != want
        except Exception as e:
            with lock:
                failed.append(f"{type(e).__name__}: {e}")
ts = [threading.Thread(target=client) for _ in range(threads)]
[t.start() for t in ts]; [t.join() for t in ts]
for f in failed[:3]:
    print("failed:", f, file=sys.stderr)
print(done, len(failed), differ)
PY
}

# cut: n3 off the network (a follower or the leader alike); the majority goes on.
net=$(docker inspect -f '{{range $k, $v := .NetworkSettings.Networks}}{{$k}}{{end}}' "$(cid n3)")
out=target/chaos-$project.out
load 20 2 >"$out" &
loader=$!
sleep 2
docker network disconnect "$net" "$(cid n3)"
down=$(node_is n3 down 60)
# Draining a healthy node now would leave the experts it shares with n3 on no live node:
# refused, naming n3.
if refusal=$(ctl node drain n1 2>&1); then
  echo "chaos: cut: draining n1 while n3 is down was accepted" >&2; exit 1
fi
case "$refusal" in
  *"no live holder (n3 marked down)"*) ;;
  *) echo "chaos: cut: draining n1 refused for another reason: $refusal" >&2; exit 1 ;;
esac
# A write through the majority: drain the cut node.
ctl node drain n3 >/dev/null
wait $loader
read -r done failed differ <"$out"
echo "chaos: cut n3 off: marked down in ${down} s; $done completed, $failed failed, $differ differing over 20 s; a drain of n1 refused (n3 down), the majority committed a drain of n3"
[ "$failed" = 0 ] && [ "$differ" = 0 ] || exit 1
docker network connect --alias n3 "$net" "$(cid n3)"
ctl node recommission n3 >/dev/null
back=$(node_is n3 up 120)
lag=$(ctl status | python3 -c '
import json, sys
m = {x["id"]: x for x in json.load(sys.stdin)["members"]}
print(m["n3"]["lag"])')
echo "chaos: cut: reconnected, n3 up in ${back} s, its Raft lag now $lag"

# roll: every node restarted in turn (SIGTERM, then start) under load.
( for n in n1 n2 n3; do
    sleep 4
    docker restart -t 20 "$(cid $n)" >/dev/null
    node_is $n up 120 >/dev/null
  done ) &
roller=$!
load 60 2 >"$out"
read -r done failed differ <"$out"
wait $roller || { echo "chaos: roll: a node did not come back" >&2; exit 1; }
echo "chaos: rolling restart of n1, n2, n3 under load: $done completed, $failed failed, $differ differing"
[ "$failed" = 0 ] && [ "$differ" = 0 ] || exit 1
# restart: every container at once (coordinator and nodes); the committed state is back.
# Each node's experts in the placement.
holdings() { ctl placement show | python3 -c 'import json, sys; print(json.dumps({n["id"]: n["experts"] for n in json.load(sys.stdin)["nodes"]}, sort_keys=True))'; }
before=$(placement_version)
held=$(holdings)
t0=$SECONDS
"${dc[@]}" restart -t 20 >/dev/null 2>&1
healthy 300
for n in n1 n2 n3; do node_is $n up 120 >/dev/null; done
after=$(placement_version)
got=$(stream "$prompt" 48)
check restart "$got"
echo "chaos: restart of every container: healthy and every node up in $((SECONDS - t0)) s; placement version $before -> $after, every node's experts unchanged; the next request identical"
[ "$after" -ge "$before" ] || { echo "chaos: restart: the placement version went back" >&2; exit 1; }
[ "$(holdings)" = "$held" ] || { echo "chaos: restart: the experts held changed: $held -> $(holdings)" >&2; exit 1; }
rm -f "$out"
echo "chaos: ok"
