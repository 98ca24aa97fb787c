#!/usr/bin/env bash
# Make the reference outputs of llama.cpp (the reference engine) that ternfleet is tested against:
#
#   tests/data/models/tiny-*.gguf            random-weight test models (scripts/make-test-models.py;
#                                            tiny-llama-q4_k, -q4_0, -q4_1, -q5_1, -q2_k, -q3_k,
#                                            -iq4_nl, -iq4_xs by llama-quantize --pure; -iq2_xxs, -iq2_xs,
#                                            -iq2_s, -iq3_xxs, -iq3_s, -iq1_s, -iq1_m with an importance
#                                            matrix from llama-imatrix)
#   tests/data/refs/<model>.greedy.json      greedy continuations: token ids, text, top-5 logits
#                                            per step (benches/ref/ref-greedy.cpp), checked against
#                                            llama-simple's text and against 1 thread
#   tests/data/refs/<model>.ppl.json         llama-perplexity over tests/data/text/gpl-3.txt
#
# Only numbers produced by llama.cpp are written; none of its code. Needs the build of
# scripts/build-llama-cpp.sh (run first if missing), g++, python3 with numpy and gguf.
# Takes about 10 minutes on 2 cores, most of it Gemma's perplexity runs.
#
# usage: scripts/make-references.sh [--models-only | --refs-only | --harness-only] [--skip-gemma] [--only NAME,NAME]
#   --harness-only: just build benches/ref/ref-greedy (target/llama.cpp/ref/ref-greedy)
#   --only: make the references of these test models only (e.g. tiny-qwen3moe-q8_0)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
L="$root/target/llama.cpp"
B="$L/build"
S="$L/src/vendor/llama.cpp"
bin="$B/bin"

models=1; refs=1; gemma=1; only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --models-only) refs=0 ;;
    --refs-only) models=0 ;;
    --skip-gemma) gemma=0 ;;
    --harness-only) models=0; refs=0 ;;
    --only) only="${2:-}"; gemma=0; shift ;;
    *) echo "usage: $0 [--models-only | --refs-only] [--skip-gemma] [--only NAME,NAME]" >&2; exit 2 ;;
  esac
  shift
done

# The reference engine. build-llama-cpp.sh exits early once its binaries exist.
"$root/scripts/build-llama-cpp.sh" >&2 || true
for b in llama-simple llama-perplexity llama-tokenize; do
  [ -x "$bin/$b" ] || { echo "make-references: $bin/$b missing: scripts/build-llama-cpp.sh failed" >&2; exit 1; }
done
if [ ! -x "$bin/llama-quantize" ]; then
  cmake --build "$B" --target llama-quantize -j"$(nproc)" 2>&1 | tail -n 1 >&2
fi

# Our harness, against the static libraries; same link line as llama.cpp's own tools.
ref="$L/ref/ref-greedy"
src="$root/benches/ref/ref-greedy.cpp"
if [ ! -x "$ref" ] || [ "$src" -nt "$ref" ] || [ "$B/src/libllama.a" -nt "$ref" ]; then
  mkdir -p "$L/ref"
  g++ -O2 -std=c++17 -I"$S/include" -I"$S/ggml/include" "$src" -o "$ref" \
    "$B/src/libllama.a" "$B/ggml/src/libggml.a" "$B/ggml/src/libggml-cpu.a" "$B/ggml/src/libggml-base.a" \
    -ldl -lm -fopenmp -lpthread
fi

if [ "$models" = 1 ]; then
  python3 "$root/scripts/make-test-models.py"
  "$bin/llama-quantize" --pure "$root/tests/data/models/tiny-llama-f16.gguf" \
    "$root/tests/data/models/tiny-llama-q4_k.gguf" Q4_K 2 >/dev/null 2>&1
  # q4_0 (repacked by llama.cpp), the legacy types with a min (q4_1, q5_1: q8_1 activations),
  # q2_K (repacked on AVX-512 machines), q3_K and the non-linear 4-bit types (iq4_nl, iq4_xs: no importance matrix needed), every
  # matrix of that type.
  for t in q4_0 q4_1 q5_1 q2_k q3_k iq4_nl iq4_xs; do
    "$bin/llama-quantize" --pure "$root/tests/data/models/tiny-llama-f16.gguf" \
      "$root/tests/data/models/tiny-llama-$t.gguf" "${t^^}" 2 >/dev/null 2>&1
  done
  # The IQ grid types need an importance matrix (llama-imatrix over the test text, the output
  # matrix included); the token embeddings stay q8_0 (a lookup table: no imatrix entry).
  [ -x "$bin/llama-imatrix" ] || cmake --build "$B" --target llama-imatrix -j"$(nproc)" 2>&1 | tail -n 1 >&2
  imat="$L/tiny-llama.imatrix.gguf"
  "$bin/llama-imatrix" -m "$root/tests/data/models/tiny-llama-f16.gguf" -f "$root/tests/data/text/gpl-3.txt" \
    -o "$imat" -c 128 --chunks 32 -t 2 --process-output >/dev/null 2>&1
  # (llama-quantize's file type IQ2_S is a mix whose default tensor type is IQ2_XS; its IQ2_M
  # defaults to IQ2_S tensors.)
  for t in iq2_xxs iq3_xxs iq2_xs iq2_s iq3_s iq1_s iq1_m; do
    ft=${t^^}; [ "$t" = iq2_s ] && ft=IQ2_M
    "$bin/llama-quantize" --pure --imatrix "$imat" --token-embedding-type q8_0 \
      "$root/tests/data/models/tiny-llama-f16.gguf" "$root/tests/data/models/tiny-llama-$t.gguf" "$ft" 2 >/dev/null 2>&1
  done
  # A ternary model made by llama.cpp: every matrix TQ2_0 but the experts' 64-wide ffn_down
  # (TQ2_0 rows need multiples of 256; kept q8_0), to show llama.cpp's ternary tensors run
  # token-identically here.
  "$bin/llama-quantize" --allow-requantize --pure --tensor-type ffn_down_exps=q8_0 \
    "$root/tests/data/models/tiny-qwen3moe-q8_0.gguf" \
    "$root/tests/data/models/tiny-qwen3moe-tq2_0.gguf" TQ2_0 2 >/dev/null 2>&1
  ls -l "$root"/tests/data/models/*.gguf >&2
fi
[ "$refs" = 1 ] || exit 0

export REF_ROOT="$root" REF_BIN="$bin" REF_GREEDY="$ref" REF_GEMMA="$gemma" REF_ONLY="$only"
python3 - <<'EOF'
import hashlib, json, os, re, subprocess, sys

root, bin_, ref = os.environ["REF_ROOT"], os.environ["REF_BIN"], os.environ["REF_GREEDY"]
refs = os.path.join(root, "tests/data/refs")
os.makedirs(refs, exist_ok=True)
text_file = os.path.join(root, "tests/data/text/gpl-3.txt")

def rel(p):
    return os.path.relpath(p, root)

def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, timeout=1800, **kw)
    if r.returncode != 0:
        sys.exit(f"make-references: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr.decode(errors='replace')[-3000:]}")
    return r

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()

def changelog_commit():
    p = os.path.join(root, "target/llama.cpp/src/CHANGELOG.md")
    m = re.search(r"ggml-org/llama\.cpp@([0-9a-f]+)", open(p).read())
    return m.group(1) if m else "unknown"

ENGINE = {
    "source": "llama-cpp-python 0.3.36 sdist from PyPI, vendor/llama.cpp (scripts/build-llama-cpp.sh)",
    "llama_cpp_commit": "ggml-org/llama.cpp@" + changelog_commit() + " (the sdist's CHANGELOG, first entry)",
    "llama_cpp_version": "0.5.0 (CMake LLAMA_VERSION)",
    "build": "CMAKE_BUILD_TYPE=Release, GGML_NATIVE=OFF with explicit AVX2/AVX-512 flags and no AMX (scripts/build-llama-cpp.sh), CPU backend only (OpenMP, repack on)",
    "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
}

def greedy(model, n, threads, prompt, fa="auto"):
    cmd = [ref, "-m", model, "-n", str(n), "-t", str(threads), "--fa", fa, prompt]
    return json.loads(run(cmd).stdout)

def llama_simple(model, n, prompt):
    return run([os.path.join(bin_, "llama-simple"), "-m", model, "-n", str(n), prompt]).stdout

def greedy_refs(name, model, prompts, n=32):
    out = []
    for p in prompts:
        r2 = greedy(model, n, 2, p)
        r1 = greedy(model, n, 1, p)
        rnofa = greedy(model, n, 2, p, fa="off")
        simple = llama_simple(model, n, p)
        expect = bytes.fromhex(r2["prompt_special_hex"]) + bytes.fromhex(r2["text_special_hex"]) + b"\n"
        pre = bytes.fromhex(r2["prompt_special_hex"])
        simple_cont = simple[len(pre):-1] if simple.startswith(pre) and simple.endswith(b"\n") else simple
        gaps = [t[0][1] - t[1][1] for t in r2["top"][: len(r2["tokens"])]]
        e = {
            "prompt": p,
            "n": n,
            "prompt_tokens": r2["prompt_tokens"],
            "tokens": r2["tokens"],
            "text": r2["text"],
            "llama_simple_text": simple_cont.decode("utf-8", errors="replace"),
            "llama_simple_matches": simple == expect,
            "same_with_1_thread": r1["tokens"] == r2["tokens"],
            "same_with_flash_attn_off": rnofa["tokens"] == r2["tokens"],
            "eog": r2["eog"],
            "min_top1_top2_gap": round(min(gaps), 6) if gaps else None,
        }
        if not r2["text_valid_utf8"]:
            e["text_hex"] = r2["text_hex"]
        e["top"] = r2["top"]
        if not e["llama_simple_matches"]:
            print(f"  NOTE {name}: llama-simple differs for {p!r}", file=sys.stderr)
        for k in ("same_with_1_thread", "same_with_flash_attn_off"):
            if not e[k]:
                print(f"  NOTE {name}: {k} is false for {p!r}", file=sys.stderr)
        out.append(e)
        print(f"  {name}: {p!r}: {len(e['tokens'])} tokens, min gap {e['min_top1_top2_gap']}", file=sys.stderr)
    doc = {
        "model": rel(model),
        "model_sha256": sha256(model),
        "engine": ENGINE,
        "harness": "benches/ref/ref-greedy.cpp (llama.h only): tokenize(add_special=true, parse_special=true); "
                   "the whole prompt in one llama_decode; llama_sampler_init_greedy; stop at llama_vocab_is_eog; "
                   "context defaults otherwise (n_ctx = n_prompt + n, padded by llama.cpp to 256; "
                   "flash_attn auto = on for CPU; KV cache F16; weights repacked where llama.cpp does)",
        "command": f"{rel(ref)} -m {rel(model)} -n N -t 2 PROMPT",
        "llama_simple_command": f"target/llama.cpp/build/bin/llama-simple -m {rel(model)} -n N PROMPT "
                                "(its default 4 threads; stdout = prompt pieces with special=true + continuation + newline)",
        "fields": {
            "tokens": "generated ids, EOG excluded",
            "text": "continuation, llama_token_to_piece(special=false) pieces; U+FFFD for invalid UTF-8, exact bytes in text_hex",
            "top": "per generated step, the 5 largest logits [id, logit] of the distribution that step's token was drawn from "
                   "(one extra entry when generation stopped at EOG)",
            "min_top1_top2_gap": "smallest top1 - top2 logit gap over the steps: a divergence at a step with a tiny gap is a near-tie",
        },
        "cases": out,
    }
    path = os.path.join(refs, f"{name}.greedy.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {rel(path)}", file=sys.stderr)

def text_tokens(model):
    # llama-perplexity reads the file and drops one trailing '\n', no escape processing,
    # tokenizes with add_special=true, parse_special=false.
    raw = open(text_file, "rb").read()
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    tmp = os.path.join(root, "target/llama.cpp/ref/ppl-input.txt")
    open(tmp, "wb").write(raw)
    r = run([os.path.join(bin_, "llama-tokenize"), "-m", model, "-f", tmp, "--ids", "--no-escape",
             "--no-parse-special", "--log-disable"])
    return json.loads(r.stdout.decode().strip().splitlines()[-1])

def perplexity(model, ctx, threads=2, batch=None):
    cmd = [os.path.join(bin_, "llama-perplexity"), "-m", model, "-f", text_file, "-c", str(ctx), "-t", str(threads)]
    if batch:
        cmd += ["-b", str(batch)]
    # llama.cpp logs from a background thread and now and then loses the last line at exit:
    # run again when the final estimate or a chunk value is missing.
    for attempt in range(10):
        r = run(cmd)
        out, err = r.stdout.decode(), r.stderr.decode()
        chunks = [float(v) for _, v in re.findall(r"\[(\d+)\]([0-9.]+|nan|inf)", out)]
        m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", err)
        info = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)", err)
        if m and info and len(chunks) == int(info.group(1)):
            break
        print(f"  llama-perplexity output incomplete, running again: {' '.join(cmd)}", file=sys.stderr)
    else:
        sys.exit(f"make-references: cannot parse llama-perplexity output of {' '.join(cmd)}:\n{err[-2000:]}")
    return {"cmd": cmd, "ppl": float(m.group(1)), "ppl_err": float(m.group(2)), "chunks": int(info.group(1)),
            "batch_size": int(info.group(3)), "n_seq": int(info.group(4)), "ppl_chunks": chunks}

METHOD = (
    "llama-perplexity perplexity() (tools/perplexity/perplexity.cpp), no --ppl-stride: "
    "(1) text = the file's bytes minus ONE trailing '\\n', no escape processing; "
    "tokens = llama_tokenize(text, add_special=true, parse_special=false) (adds BOS iff tokenizer.ggml.add_bos_token; "
    "asserts no add_eos). (2) Needs tokens >= 2*n_ctx. n_chunk = floor(n_tokens / n_ctx); the tail is dropped. "
    "Chunk i = tokens[i*n_ctx, (i+1)*n_ctx). (3) Each chunk is evaluated from an empty KV cache "
    "(llama_memory_clear), positions 0..n_ctx-1, sequence-independent: with -b 2048 and -c 512 four chunks go in one "
    "batch as seq ids 0..3 (n_seq = n_batch/n_ctx; context n_ctx*n_seq, ubatch 512): mathematically one chunk at a "
    "time (check_batch holds the -b n_ctx run, n_seq 1, to show the numerical difference). If add_bos, the FIRST token of every chunk is REPLACED by BOS (not prepended) for the forward pass; "
    "the original id is restored afterwards (it is never a scored target, so this only changes the context). "
    "(4) first = n_ctx/2. Logits are requested for positions >= first; the logits at positions first..n_ctx-2 score "
    "the targets tokens[start+first+1 .. start+n_ctx-1]: n_ctx-1-first = n_ctx/2-1 scored tokens per chunk "
    "(255 at n_ctx 512, 63 at n_ctx 128). (5) Per scored position: max = max(logits) in float; "
    "sum = sum_j (double) expf(logit_j - max) accumulated in double; log_prob = logit_tok - max - log(sum) "
    "(float - float, then minus a double log); nll += -log_prob and nll2 += log_prob^2, both double, summed by "
    "hardware_concurrency() threads in nondeterministic order. (6) After each chunk it prints [k]exp(nll/count), "
    "count = scored tokens so far (ppl_chunks). Final PPL = exp(nll/count); "
    "+/- = sqrt((nll2/count - (nll/count)^2)/(count-1)) * PPL."
)

def ppl_ref(name, model, ctx, check_batch=None):
    toks = text_tokens(model)
    main = perplexity(model, ctx)
    n_chunk = len(toks) // ctx
    if n_chunk != main["chunks"]:
        sys.exit(f"make-references: {name}: llama-tokenize gives {len(toks)} tokens = {n_chunk} chunks, "
                 f"llama-perplexity reports {main['chunks']}")
    doc = {
        "model": rel(model),
        "model_sha256": sha256(model),
        "engine": ENGINE,
        "text": rel(text_file),
        "text_sha256": sha256(text_file),
        "command": " ".join([rel(main["cmd"][0])] + [rel(c) if c.startswith(root) else c for c in main["cmd"][1:]]),
        "ctx": ctx,
        "batch_size": main["batch_size"],
        "n_seq": main["n_seq"],
        "threads": 2,
        "ppl": main["ppl"],
        "ppl_err": main["ppl_err"],
        "chunks": main["chunks"],
        "tokens": len(toks),
        "scored_tokens": main["chunks"] * (ctx - 1 - ctx // 2),
        "ppl_chunks": main["ppl_chunks"],
        "method": METHOD,
        "note": "llama-perplexity prints 4 decimals: compare ppl and ppl_chunks to a relative 1e-4. "
                "text_tokens: the tokenization of the text as llama-perplexity sees it (llama-tokenize --no-parse-special "
                "on the file minus its trailing newline), BOS included when the model adds one.",
    }
    if check_batch:
        alt = perplexity(model, ctx, batch=check_batch)
        doc["check_batch"] = {"batch_size": alt["batch_size"], "n_seq": alt["n_seq"], "ppl": alt["ppl"],
                              "ppl_chunks_equal": alt["ppl_chunks"] == main["ppl_chunks"]}
    doc["text_tokens"] = toks
    path = os.path.join(refs, f"{name}.ppl.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {rel(path)}: PPL {doc['ppl']} over {doc['chunks']} chunks, {doc['tokens']} tokens", file=sys.stderr)

tiny_prompts = ["The capital of France is", "This License applies to any program", "Le café de la gare était"]
only = [n for n in os.environ.get("REF_ONLY", "").split(",") if n]
for name in ["tiny-llama-f16", "tiny-llama-q8_0", "tiny-llama-q4_k", "tiny-llama-q4_1", "tiny-llama-q5_1",
             "tiny-llama-q3_k", "tiny-llama-iq4_nl", "tiny-llama-iq4_xs", "tiny-llama-q4_0",
             "tiny-llama-q2_k", "tiny-llama-iq2_xxs", "tiny-llama-iq3_xxs",
             "tiny-llama-iq2_xs", "tiny-llama-iq2_s", "tiny-llama-iq3_s", "tiny-llama-iq1_s", "tiny-llama-iq1_m",
             "tiny-qwen3-f16", "tiny-qwen2-f16",
             "tiny-mixtral-q8_0", "tiny-qwen3moe-q8_0", "tiny-qwen2moe-q8_0", "tiny-qwen3moe-tq2_0"]:
    if only and name not in only:
        continue
    model = os.path.join(root, "tests/data/models", name + ".gguf")
    greedy_refs(name, model, tiny_prompts)
    # The IQ grid models: llama-perplexity's own results move with its batch size on them
    # (IQ3_XXS: 544373.3538 at the default -b 2048, 544997.1688 at -b 512, 256 and 128), so no
    # second batch is checked; ternfleet equals the default run (docs/quant-types.md).
    grid = name.startswith("tiny-llama-iq") and name not in ("tiny-llama-iq4_nl", "tiny-llama-iq4_xs")
    ppl_ref(name, model, 128, check_batch=None if grid else 128)

if os.environ.get("REF_GEMMA") == "1":
    name = "gemma-3-270m-q4_k_m"
    model = os.path.join(root, "models", name + ".gguf")
    if not os.path.exists(model):
        sys.exit(f"make-references: {rel(model)} missing: run scripts/fetch-model.sh")
    greedy_refs(name, model, [
        "The capital of France is",
        "def fibonacci(n):\n",
        "Once upon a time, in a small village,",
        "Explain photosynthesis in simple terms:",
        "1, 1, 2, 3, 5, 8,",
        "Le café de la gare était",
    ])
    ppl_ref(name, model, 512, check_batch=512)
EOF
