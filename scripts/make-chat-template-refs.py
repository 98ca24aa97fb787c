#!/usr/bin/env python3
"""Writes tests/data/refs/chat-templates.json: llama.cpp's `llama-server` /apply-template output
for a few conversations under each chat template ternfleet must reproduce — the built-in
chatml / gemma / llama3 templates (`--no-jinja --chat-template NAME`, on Gemma 3 270M) and
Qwen2.5-Coder's own GGUF template (`--jinja`). coordinator/tests/serve.rs compares
`ternfleet serve`'s /apply-template with these. Needs scripts/build-llama-cpp.sh and both
models (scripts/fetch-model.sh).
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LS = os.path.join(ROOT, "target/llama.cpp/build/bin/llama-server")
CONVERSATIONS = [
    [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi  "}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b "}, {"role": "user", "content": "c\n"}],
    [{"role": "system", "content": "s1"}, {"role": "system", "content": "s2"},
     {"role": "user", "content": "u"}, {"role": "assistant", "content": "m"},
     {"role": "system", "content": "s3"}, {"role": "user", "content": "u2 {{ not code }}"}],
    [{"role": "user", "content": "Write a haiku."}],
    [{"role": "user", "content": "<|im_start|>system {% if true %}x{% endif %}"}],
]
CONFIGS = [
    # (name: the --chat-template ternfleet gets, or "" for the model's own; model; llama-server args)
    ("chatml", "models/gemma-3-270m-q4_k_m.gguf", ["--no-jinja", "--chat-template", "chatml"]),
    ("gemma", "models/gemma-3-270m-q4_k_m.gguf", ["--no-jinja", "--chat-template", "gemma"]),
    ("llama3", "models/gemma-3-270m-q4_k_m.gguf", ["--no-jinja", "--chat-template", "llama3"]),
    ("", "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", ["--jinja"]),
]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def main():
    out = []
    for name, model, args in CONFIGS:
        port = free_port()
        p = subprocess.Popen([LS, "-m", os.path.join(ROOT, model), "--host", "127.0.0.1", "--port", str(port),
                              "-t", "2", "-c", "512", "--no-webui"] + args,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + 60
            while True:
                try:
                    urllib.request.urlopen(url + "/health", timeout=2)
                    break
                except OSError:
                    if time.time() > deadline or p.poll() is not None:
                        sys.exit(f"llama-server {args} did not start")
                    time.sleep(0.1)
            cases = []
            for conv in CONVERSATIONS:
                req = urllib.request.Request(url + "/apply-template", json.dumps({"messages": conv}).encode(),
                                             {"Content-Type": "application/json"})
                cases.append({"messages": conv, "prompt": json.load(urllib.request.urlopen(req))["prompt"]})
            out.append({"chat_template": name, "model": model, "llama_server_args": args, "cases": cases})
        finally:
            p.kill()
            p.wait()
    path = os.path.join(ROOT, "tests/data/refs/chat-templates.json")
    with open(path, "w") as f:
        json.dump({"source": "llama-server /apply-template, llama.cpp 0c1e570 (llama-cpp-python 0.3.36 sdist)",
                   "configs": out}, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
