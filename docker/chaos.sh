#!/usr/bin/env bash
# Chaos on the docker-compose cluster (issue 17; scenarios so far: kill, pause). Each runs a
# greedy streamed completion while it hurts a node, checks the text equals the one the
# healthy cluster gave, and prints its figure: requests completed / failed, the longest
# pause between two streamed tokens (the failover stall) and the recovery time.
#
#   docker/chaos.sh             # builds the image; always removes its containers and volumes
#
#   kill   `docker kill` a node mid-generation: a replica of its experts answers.
#   pause  `docker pause` a node past the step deadline (0.75 s): detected, rerouted; then
#          unpaused, and routed to again.
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

# Waits (at most $2 s) until `ctl node list` shows node $1 up; prints the seconds.
node_up() {
  local t0=$SECONDS
  until ctl node list 2>/dev/null | python3 -c '
import json, sys
nodes = json.load(sys.stdin)["nodes"]
sys.exit(0 if any(n["id"] == sys.argv[1] and n["status"] == "up" for n in nodes) else 1)' "$1"; do
    [ $((SECONDS - t0)) -le "$2" ] || { echo "chaos: $1 not up after $2 s" >&2; exit 1; }
    sleep 0.5
  done
  echo $((SECONDS - t0))
}

# kill: n2 dies after 8 streamed tokens.
got=$(stream "$prompt" 48 8 "docker kill $(cid n2)")
check kill "$got"
echo "chaos: kill n2 mid-generation: 1 completed, 0 failed, identical text; longest gap $(field "$got" gap) s"
docker start "$(cid n2)" >/dev/null
back=$(node_up n2 120)
echo "chaos: kill: n2 restarted and up again in ${back} s"

# pause: n3 frozen after 8 tokens, past the step deadline, then thawed.
got=$(stream "$prompt" 48 8 "docker pause $(cid n3)")
check pause "$got"
echo "chaos: pause n3 mid-generation: 1 completed, 0 failed, identical text; longest gap $(field "$got" gap) s (step deadline 0.75 s)"
docker unpause "$(cid n3)" >/dev/null
t0=$SECONDS
got=$(stream "$prompt" 48)
check unpause "$got"
echo "chaos: pause: n3 thawed; the next request identical ($((SECONDS - t0)) s)"
echo "chaos: ok"
