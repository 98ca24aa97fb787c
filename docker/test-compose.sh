#!/usr/bin/env bash
# The docker-compose quick start, tested: builds the image, brings docker/docker-compose.yml
# up under a project name of its own (host ports chosen by Docker), waits (bounded) for the
# coordinator to be healthy, asks it a chat completion with the `openai` Python client,
# then `down` and `up` again: the placement version is the one committed before, and it
# answers again. Always removes its containers, network and volumes. Prints the image size,
# the time to healthy and the answers.
set -euo pipefail
cd "$(dirname "$0")/.."
project=tftest$$
. docker/common.sh

ask() {
  python3 - "$(http_port)" <<'PY'
import sys, openai
c = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="none", timeout=120)
r = c.chat.completions.create(model="ternfleet", max_tokens=16, temperature=0,
    messages=[{"role": "user", "content": "Name three colours."}])
text = r.choices[0].message.content
assert text, r
print(text.replace("\n", " "))
PY
}

prepare
t0=$SECONDS
"${dc[@]}" up -d >&2
healthy 900
echo "compose: healthy $((SECONDS - t0)) s after \`up -d\` began (first start: certificates, bundle conversion, plan included)"
for n in n1 n2 n3; do # the nodes' own healthchecks (probe quic://) pass too
  t=$SECONDS
  until [ "$(docker inspect -f '{{.State.Health.Status}}' "$(cid $n)")" = healthy ]; do
    [ $((SECONDS - t)) -le 60 ] || { echo "compose: $n is not healthy" >&2; exit 1; }
    sleep 1
  done
done
echo "compose: n1, n2, n3 healthy (ternfleet probe quic://)"
first=$(ask)
echo "compose: answer: $first"
v1=$(placement_version)
"${dc[@]}" down -t 20 >&2
t1=$SECONDS
"${dc[@]}" up -d >&2
healthy 300
again=$((SECONDS - t1))
v2=$(placement_version)
second=$(ask)
echo "compose: after down + up: healthy in ${again} s, placement version $v1 -> $v2, answer: $second"
[ "$v2" -ge "$v1" ] || { echo "compose: the placement went back ($v1 -> $v2)" >&2; exit 1; }
[ "$first" = "$second" ] || { echo "compose: greedy answers differ" >&2; exit 1; }
echo "compose: ok"
