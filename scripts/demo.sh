#!/usr/bin/env bash
# The README's main command: fetch the default model (Qwen2.5-Coder 0.5B Instruct, once), build
# ternfleet, start `ternfleet serve` on it (a single-node cluster in one process), ask one chat
# question through the OpenAI-compatible HTTP API, print the answer, stop the server.
#   scripts/demo.sh ["your question"] [extra `ternfleet serve` flags...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
question=${1:-"Explain why the sky is blue in one sentence."}
shift || true
model=models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
./scripts/fetch-model.sh qwen >&2
cargo build --release --quiet -p ternfleet-coordinator
tmp=$(mktemp -d)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
RUST_LOG=${RUST_LOG:-warn} ./target/release/ternfleet serve -m "$model" --http 127.0.0.1:0 --grpc 127.0.0.1:0 "$@" \
  >"$tmp/startup" 2>"$tmp/log" &
pid=$!
python3 - "$tmp/startup" "$tmp/log" "$question" <<'EOF'
import json, sys, time, urllib.error, urllib.request

startup, log, question = sys.argv[1:4]
deadline = time.time() + 60
line = ""
while not line.endswith("\n"):
    if time.time() > deadline:
        sys.exit("demo: no start-up line from ternfleet serve in 60 s:\n" + open(log).read())
    time.sleep(0.05)
    line = open(startup).read()
url = "http://" + json.loads(line)["http"]
deadline = time.time() + 120
while True:
    try:
        urllib.request.urlopen(url + "/ready", timeout=5)
        break
    except (urllib.error.URLError, OSError):
        if time.time() > deadline:
            sys.exit("demo: the server was not ready in 120 s:\n" + open(log).read())
        time.sleep(0.1)
body = json.dumps({
    "messages": [{"role": "user", "content": question}],
    "max_tokens": 160,
    "temperature": 0,
}).encode()
req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
try:
    resp = json.load(urllib.request.urlopen(req, timeout=300))
except urllib.error.HTTPError as e:
    sys.exit(f"demo: HTTP {e.code}: {e.read().decode(errors='replace')}")
print(resp["choices"][0]["message"]["content"].strip())
u = resp["usage"]
print(f"[{u['prompt_tokens']} prompt + {u['completion_tokens']} generated tokens via {url}/v1/chat/completions]",
      file=sys.stderr)
EOF
