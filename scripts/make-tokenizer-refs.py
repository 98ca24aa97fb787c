#!/usr/bin/env python3
"""Reference token ids from llama.cpp's llama-tokenize, for coordinator/tests/tokenizer.rs.

    scripts/make-tokenizer-refs.py minis        # rebuild tests/data/tokenizer/*-mini.gguf
    scripts/make-tokenizer-refs.py refs [NAME…] # rerun llama-tokenize, rewrite <NAME>.json

Inputs: llama-tokenize in $LLAMA_BIN (default target/llama.cpp/build/bin, built by
scripts/build-llama-cpp.sh), the strings in tests/data/tokenizer/strings.json, and the models in
MODELS below. Models that are not present are skipped with a message.

How llama-tokenize is run (tools/tokenize/tokenize.cpp): the string is written to a file and
passed with -f, which the tool reads verbatim (a trailing newline stays part of the text);
--no-escape keeps it from turning "\\n" into a newline; --ids --log-disable leave only the id
list on stdout. The tool's own defaults are parse_special = true (LLAMA_EXAMPLE_TOKENIZE in
common/arg.cpp) and add_special = the model's add_bos flag (it calls
common_tokenize(vocab, text, add_bos, parse_special)), so a test must call
encode(text, add_special = tokenizer.add_bos() && !no_bos, parse_special). We record three
configurations per string: the defaults, --no-parse-special, and --no-bos --no-parse-special;
for the defaults also each token's piece (the tool's non---ids output prints
common_token_to_piece(ctx, id), i.e. llama_token_to_piece with special = true) as hex bytes.

The "mini" vocabularies are real byte-level BPE vocabularies cut down to < 1 MB so that a
committed fixture exercises the BPE path: llama.cpp's own models/ggml-vocab-{llama-bpe,qwen2}.gguf
(from the llama-cpp-python sdist) keep their first MINI_MERGES merges, the tokens those merges
and the 256 byte characters produce, and every non-normal (special) token; ids are renumbered
in the original order. No tensors: llama-tokenize loads vocab-only.
"""
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DATA = os.path.join(ROOT, "tests/data/tokenizer")
VOCABS = "target/llama.cpp/src/vendor/llama.cpp/models"
LLAMA_BIN = os.environ.get("LLAMA_BIN", os.path.join(ROOT, "target/llama.cpp/build/bin"))
MINI_MERGES = 6000

# name -> path relative to the repository root; `full` = all three configurations
MODELS = [
    ("gemma-3-270m", "models/gemma-3-270m-q4_k_m.gguf", True),
    ("llama-bpe-mini", "tests/data/tokenizer/llama-bpe-mini.gguf", True),
    ("qwen2-mini", "tests/data/tokenizer/qwen2-mini.gguf", True),
] + [
    (f"ggml-vocab-{v}", f"{VOCABS}/ggml-vocab-{v}.gguf", False)
    for v in ["llama-spm", "phi-3", "baichuan", "gpt-2", "llama-bpe", "qwen2", "qwen35",
              "starcoder", "refact", "command-r", "mpt", "gpt-neox", "falcon", "aquila"]
]

CONFIGS = [
    {"name": "default", "flags": [], "no_bos": False, "parse_special": True},
    {"name": "no-parse-special", "flags": ["--no-parse-special"], "no_bos": False,
     "parse_special": False},
    {"name": "raw", "flags": ["--no-bos", "--no-parse-special"], "no_bos": True,
     "parse_special": False},
]


def run_tokenize(model, text, flags):
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    try:
        cmd = [os.path.join(LLAMA_BIN, "llama-tokenize"), "-m", model, "-f", path,
               "--log-disable", "--no-escape"] + flags
        out = subprocess.run(cmd, capture_output=True, timeout=120)
        if out.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed: {out.stderr.decode(errors='replace')[-2000:]}")
        return out.stdout
    finally:
        os.unlink(path)


def tokenize(model, text, flags):
    """Token ids (--ids prints one Python-style list)."""
    line = run_tokenize(model, text, flags + ["--ids"]).decode().strip().splitlines()[-1]
    return json.loads(line)


def pieces(model, text, flags, ids):
    """Each token's piece as raw bytes, from the tool's `%6d -> '%s'` lines, which print
    common_token_to_piece(ctx, id) with special = true; `ids` (from --ids) delimit them."""
    out = run_tokenize(model, text, flags)
    result, pos = [], 0
    for k, tid in enumerate(ids):
        head = b"%6d -> '" % tid
        if not out.startswith(head, pos):
            sys.exit(f"unexpected llama-tokenize output at {pos}: {out[pos:pos + 40]!r}")
        pos += len(head)
        end_mark = b"'\n" + (b"%6d -> '" % ids[k + 1] if k + 1 < len(ids) else b"")
        end = out.find(end_mark, pos) if k + 1 < len(ids) else len(out) - 2
        if end < 0 or (k + 1 == len(ids) and not out.endswith(b"'\n")):
            sys.exit(f"cannot delimit piece {k} in {out!r}")
        result.append(out[pos:end].hex())
        pos = end + 2
    return result


def refs(names):
    strings = json.load(open(os.path.join(DATA, "strings.json"), encoding="utf-8"))["strings"]
    for name, rel, full in MODELS:
        if names and name not in names:
            continue
        model = os.path.join(ROOT, rel)
        if not os.path.exists(model):
            print(f"{name}: skipped, {rel} not present")
            continue
        configs = CONFIGS if full else CONFIGS[:1]
        jobs = [(i, c) for i in range(len(strings)) for c in configs]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            ids = list(pool.map(lambda j: tokenize(model, strings[j[0]], j[1]["flags"]), jobs))
        cases = [{"string": i, "config": c["name"], "ids": t} for (i, c), t in zip(jobs, ids)]
        # pieces (token_to_piece with special = true) for the default configuration's ids
        default = [c for c in cases if c["config"] == "default"]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            hexes = list(pool.map(lambda c: pieces(model, strings[c["string"]], [], c["ids"]),
                                  default))
        for c, h in zip(default, hexes):
            c["pieces_hex"] = h
        doc = {
            "model": name,
            "path": rel,
            "reference": "llama-tokenize -m <path> -f <string file> --ids --log-disable "
                         "--no-escape <config flags>; llama.cpp from llama-cpp-python 0.3.36",
            "configs": [{k: c[k] for k in ("name", "flags", "no_bos", "parse_special")}
                        for c in configs],
            "cases": cases,
        }
        out = os.path.join(DATA, f"{name}.json")
        with open(out, "w", encoding="utf-8") as f:
            # one case per line keeps diffs readable
            f.write("{\n")
            for k in ("model", "path", "reference", "configs"):
                f.write(f" {json.dumps(k)}: {json.dumps(doc[k], ensure_ascii=False)},\n")
            f.write(' "cases": [\n')
            f.write(",\n".join("  " + json.dumps(c) for c in cases))
            f.write("\n ]\n}\n")
        print(f"{name}: {len(cases)} cases -> {os.path.relpath(out, ROOT)}")


def mini(src_name, dst_name):
    import gguf  # gguf-py (pip install gguf)

    src = os.path.join(ROOT, VOCABS, src_name)
    r = gguf.GGUFReader(src)
    f = r.fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    merges = f["tokenizer.ggml.merges"].contents()[:MINI_MERGES]

    # GPT-2 byte characters (unicode.cpp: unicode_byte_to_utf8_map)
    keep_bytes = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b]
    chars, n = {}, 0
    for b in range(256):
        if b in keep_bytes:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    keep = set(chars.values())
    for m in merges:
        a, b = m.split(" ", 1)
        keep.update((a, b, a + b))
    ids = [i for i, t in enumerate(tokens) if t in keep or types[i] != 1]
    remap = {old: new for new, old in enumerate(ids)}

    arch = f["general.architecture"].contents()
    w = gguf.GGUFWriter(os.path.join(DATA, dst_name), arch)
    w.add_name(f"{src_name} cut to its first {MINI_MERGES} merges")
    w.add_tokenizer_model(f["tokenizer.ggml.model"].contents())
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"].contents())
    w.add_token_list([tokens[i] for i in ids])
    w.add_token_types([types[i] for i in ids])
    w.add_token_merges(merges)
    for key, add in [("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                     ("padding", w.add_pad_token_id), ("unknown", w.add_unk_token_id)]:
        field = f.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            add(remap[field.contents()])
    for key, add in [("add_bos_token", w.add_add_bos_token), ("add_eos_token", w.add_add_eos_token)]:
        field = f.get(f"tokenizer.ggml.{key}")
        if field is not None:
            add(field.contents())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = os.path.getsize(os.path.join(DATA, dst_name))
    print(f"{dst_name}: {len(ids)} tokens, {len(merges)} merges, {size} bytes")


def main():
    cmd = sys.argv[1] if len(sys.argv) > 1 else "refs"
    if cmd == "minis":
        mini("ggml-vocab-llama-bpe.gguf", "llama-bpe-mini.gguf")
        mini("ggml-vocab-qwen2.gguf", "qwen2-mini.gguf")
    elif cmd == "refs":
        refs(set(sys.argv[2:]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
