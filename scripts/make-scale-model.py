#!/usr/bin/env python3
"""Make a random-weight GGUF MoE model with a real architecture's shapes, fast.

usage: scripts/make-scale-model.py --shape qwen3-30b-a3b [--layers N] [--seed S] -o OUT.gguf
       scripts/make-scale-model.py --list

The quantized blocks are written directly (random quants with sane scales), not by quantizing
floats, so the full-size Qwen3-30B-A3B shape (~18 GB) takes about as long as the disk needs to
write it. Tensor types follow llama.cpp's Q4_K_M recipe (llama_tensor_get_type, src/llama-quant.cpp):
Q4_K everywhere except attn_v and ffn_down_exps in the "use_more_bits" layers (the first and last
eighth and every third in between: Q6_K) and output.weight (Q6_K); norms and routers F32.

Routing must spread like a trained model's, not collapse onto a few experts (which would make
every memory and prefetch figure meaningless). What keeps it spread: the hidden state stays
token-specific because each layer adds a modest, input-dependent update to the residual
(attention and expert output gains ATTN_GAIN and FFN_GAIN), the routers are independent
random matrices whose logits have a spread of ROUTER_STD, and nothing adds a shared direction
(no biases). `ternfleet routing -m OUT.gguf` reports distinct experts per layer and the
routing entropy over 1,000 tokens of text: quote those next to any figure measured on the file.

The vocabulary is a synthetic byte-level BPE (llama.cpp's "gpt2" model, pre-tokenizer "qwen2"):
merges trained on tests/data/text/gpl-3.txt first (so English text tokenizes into real
multi-byte pieces), then synthetic merges of existing tokens up to the shape's vocabulary size,
then <|endoftext|>, <|im_start|>, <|im_end|> as control tokens.

Never commit these files: benches make them on demand.
"""
import argparse
import importlib.util
import os
import sys
import time

try:
    import numpy as np

    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError as e:
    sys.exit(f"make-scale-model.py needs numpy and gguf ({e}): python3 -m pip install numpy gguf")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SHAPES = {
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": dict(
        arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
        n_expert=128, n_expert_used=8, n_ff_exp=768, n_ff=6144, n_vocab=151936,
        n_ctx=40960, rope_base=1000000.0, rms_eps=1e-6,
    ),
    # A small model of the same architecture for tests (seconds to make, MBs on disk).
    "qwen3moe-mini": dict(
        arch="qwen3moe", n_layer=4, n_embd=512, n_head=8, n_head_kv=2, head_dim=64,
        n_expert=32, n_expert_used=4, n_ff_exp=256, n_ff=1024, n_vocab=4096,
        n_ctx=4096, rope_base=1000000.0, rms_eps=1e-6,
    ),
}

EMBD_STD = 1.0     # token embeddings
ATTN_GAIN = 0.25   # rms of a layer's attention output relative to its normalised input
FFN_GAIN = 0.6     # rms of one expert's down projection relative to its normalised input
ROUTER_STD = 2.0   # spread of the router logits
LOGIT_STD = 4.0    # spread of the output logits (through output_norm.weight)

QK_K = 256


def use_more_bits(i, n):
    """llama-quant.cpp: the layers Q4_K_M gives more bits to."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_blocks(rng, n_blocks, std):
    """n_blocks random block_q4_K (d, dmin: f16; scales: 12 bytes of 6-bit sc/m; qs: 128 bytes).

    Weights are d*sc*q - dmin*m with sc, m in 0..63 and q in 0..15 uniform: their rms is about
    256*d when dmin = 7.5*d, so d = std / 256 gives weights of rms `std` and mean about 0."""
    b = np.frombuffer(rng.bytes(n_blocks * 144), dtype=np.uint8).reshape(n_blocks, 144).copy()
    d = (std / 256.0) * rng.uniform(0.75, 1.25, n_blocks)
    b[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    b[:, 2:4] = (7.5 * d).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return b


def q6_k_blocks(rng, n_blocks, std):
    """n_blocks random block_q6_K (ql: 128, qh: 64, scales: 16 int8, d: f16).

    Weights are d*sc*(q-32) with q in 0..63 uniform (rms 18.5) and sc in 1..16 (rms 9.8): about
    181*d, so d = std / 181."""
    b = np.frombuffer(rng.bytes(n_blocks * 210), dtype=np.uint8).reshape(n_blocks, 210).copy()
    b[:, 192:208] = (b[:, 192:208] & 15) + 1
    d = (std / 181.0) * rng.uniform(0.75, 1.25, n_blocks)
    b[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return b


BLOCK = {QT.Q4_K: (144, q4_k_blocks), QT.Q6_K: (210, q6_k_blocks)}


class Tensor:
    """One tensor to write: name, numpy shape (outermost first), type, and how to make it."""

    def __init__(self, name, shape, qtype, make):
        self.name, self.shape, self.qtype, self.make = name, shape, qtype, make

    def byte_shape(self):
        if self.qtype == QT.F32:
            return self.shape
        size, _ = BLOCK[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // QK_K * size)

    def nbytes(self):
        if self.qtype == QT.F32:
            return int(np.prod(self.shape)) * 4
        return int(np.prod(self.byte_shape()))


def quantized(shape, qtype, std):
    def make(rng):
        size, gen = BLOCK[qtype]
        rows = int(np.prod(shape[:-1]))
        return gen(rng, rows * (shape[-1] // QK_K), std).reshape(*shape[:-1], shape[-1] // QK_K * size)
    return make


def f32(shape, fn):
    return lambda rng: fn(rng, shape).astype(np.float32)


def tensors(c):
    """Every tensor of the model in llama.cpp's order, with its type and generator."""
    d, L = c["n_embd"], c["n_layer"]
    qd, kvd = c["n_head"] * c["head_dim"], c["n_head_kv"] * c["head_dim"]
    ne, ff = c["n_expert"], c["n_ff_exp"]
    norm = lambda rng, s: 1.0 + 0.05 * rng.standard_normal(s)
    out = [Tensor("token_embd.weight", (c["n_vocab"], d), QT.Q4_K, quantized((c["n_vocab"], d), QT.Q4_K, EMBD_STD))]
    for i in range(L):
        p = f"blk.{i}."
        more = use_more_bits(i, L)
        vt = QT.Q6_K if more else QT.Q4_K
        dt = QT.Q6_K if more else QT.Q4_K
        out += [
            Tensor(p + "attn_norm.weight", (d,), QT.F32, f32((d,), norm)),
            Tensor(p + "attn_q.weight", (qd, d), QT.Q4_K, quantized((qd, d), QT.Q4_K, 1 / np.sqrt(d))),
            Tensor(p + "attn_k.weight", (kvd, d), QT.Q4_K, quantized((kvd, d), QT.Q4_K, 1 / np.sqrt(d))),
            Tensor(p + "attn_v.weight", (kvd, d), vt, quantized((kvd, d), vt, 1 / np.sqrt(d))),
            Tensor(p + "attn_output.weight", (d, qd), QT.Q4_K, quantized((d, qd), QT.Q4_K, ATTN_GAIN / np.sqrt(qd))),
            Tensor(p + "attn_q_norm.weight", (c["head_dim"],), QT.F32, f32((c["head_dim"],), norm)),
            Tensor(p + "attn_k_norm.weight", (c["head_dim"],), QT.F32, f32((c["head_dim"],), norm)),
            Tensor(p + "ffn_norm.weight", (d,), QT.F32, f32((d,), norm)),
            Tensor(p + "ffn_gate_inp.weight", (ne, d), QT.F32,
                   f32((ne, d), lambda rng, s: rng.standard_normal(s) * (ROUTER_STD / np.sqrt(d)))),
            Tensor(p + "ffn_gate_exps.weight", (ne, ff, d), QT.Q4_K, quantized((ne, ff, d), QT.Q4_K, 1 / np.sqrt(d))),
            Tensor(p + "ffn_up_exps.weight", (ne, ff, d), QT.Q4_K, quantized((ne, ff, d), QT.Q4_K, 1 / np.sqrt(d))),
            Tensor(p + "ffn_down_exps.weight", (ne, d, ff), dt, quantized((ne, d, ff), dt, FFN_GAIN / np.sqrt(ff))),
        ]
    out += [
        Tensor("output_norm.weight", (d,), QT.F32, f32((d,), lambda rng, s: LOGIT_STD * norm(rng, s))),
        Tensor("output.weight", (c["n_vocab"], d), QT.Q6_K, quantized((c["n_vocab"], d), QT.Q6_K, 1 / np.sqrt(d))),
    ]
    return out


def vocab(n_vocab, text, seed):
    """Byte-level BPE: 256 byte tokens, merges trained on `text`, synthetic merges, 3 specials."""
    spec = importlib.util.spec_from_file_location("mtm", os.path.join(HERE, "make-test-models.py"))
    mtm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mtm)
    b2u = mtm.bytes_to_unicode()
    base = [b2u[b] for b in range(256)]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    n_merges = n_vocab - 256 - len(specials)
    counts = {}
    for w in mtm.QWEN2_PRE.findall(text):
        k = tuple(b2u[b] for b in w.encode("utf-8"))
        counts[k] = counts.get(k, 0) + 1
    merges = mtm.bpe_train(counts, min(n_merges, 1500))
    tokens = base + [a + b for a, b in merges]
    seen = set(tokens)
    # Synthetic merges: pairs of existing letter-ish tokens, deterministic, unique, short.
    rng = np.random.default_rng(seed)
    pool = [t for t in tokens if t.isalpha() or t.startswith("Ġ")]
    while len(merges) < n_merges:
        for i, j in rng.integers(0, len(pool), size=(1 << 16, 2)):
            a, b = pool[i], pool[j]
            if b.startswith("Ġ") or a + b in seen:
                continue
            merges.append((a, b))
            tokens.append(a + b)
            seen.add(a + b)
            if len(a) + len(b) <= 8:
                pool.append(a + b)
            if len(merges) == n_merges:
                break
    tokens += specials
    types = [1] * (len(tokens) - len(specials)) + [3] * len(specials)
    assert len(tokens) == n_vocab and len(seen) + len(specials) == n_vocab
    return tokens, types, [f"{a} {b}" for a, b in merges]


def write(path, c, seed, text):
    t0 = time.time()
    toks, types, merges = vocab(c["n_vocab"], text, seed)
    eot = toks.index("<|endoftext|>")
    wr = gguf.GGUFWriter(path, c["arch"])
    wr.add_name(f"ternfleet scale model {c['shape']} ({c['n_layer']} layers)")
    wr.add_description("random weights with real shapes (scripts/make-scale-model.py), not a trained model")
    wr.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    wr.add_context_length(c["n_ctx"])
    wr.add_embedding_length(c["n_embd"])
    wr.add_block_count(c["n_layer"])
    wr.add_feed_forward_length(c["n_ff"])
    wr.add_expert_count(c["n_expert"])
    wr.add_expert_used_count(c["n_expert_used"])
    wr.add_expert_feed_forward_length(c["n_ff_exp"])
    wr.add_head_count(c["n_head"])
    wr.add_head_count_kv(c["n_head_kv"])
    wr.add_key_length(c["head_dim"])
    wr.add_value_length(c["head_dim"])
    wr.add_layer_norm_rms_eps(c["rms_eps"])
    wr.add_rope_freq_base(c["rope_base"])
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("qwen2")
    wr.add_token_list(toks)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(eot)
    wr.add_eos_token_id(toks.index("<|im_end|>"))
    wr.add_pad_token_id(eot)
    wr.add_add_bos_token(False)
    ts = tensors(c)
    for t in ts:
        raw = None if t.qtype == QT.F32 else t.qtype
        dtype = np.float32 if t.qtype == QT.F32 else np.uint8
        wr.add_tensor_info(t.name, t.byte_shape(), np.dtype(dtype), t.nbytes(), raw_dtype=raw)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_ti_data_to_file()
    total = sum(t.nbytes() for t in ts)
    done = 0
    rng = np.random.default_rng(seed)
    tty = sys.stderr.isatty()
    for i, t in enumerate(ts):
        a = t.make(rng)
        assert a.nbytes == t.nbytes(), t.name
        wr.write_tensor_data(a)
        done += a.nbytes
        if tty or i + 1 == len(ts) or t.name.endswith("ffn_down_exps.weight"):
            el = time.time() - t0
            msg = f"{path}: {done / 1e9:6.2f} / {total / 1e9:.2f} GB  {el:5.1f} s"
            print(("\r" if tty else "") + msg, end="" if tty else "\n", file=sys.stderr, flush=True)
    if tty:
        print(file=sys.stderr)
    wr.close()
    print(f"{path}: {os.path.getsize(path)} bytes, {c['n_layer']} layers, {len(ts)} tensors, "
          f"{time.time() - t0:.1f} s", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), help="architecture and shapes")
    ap.add_argument("--layers", type=int, help="layer count (default: the shape's)")
    ap.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    ap.add_argument("--text", default=os.path.join(ROOT, "tests/data/text/gpl-3.txt"),
                    help="text the first BPE merges are trained on")
    ap.add_argument("-o", "--out", help="output .gguf")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    a = ap.parse_args()
    if a.list:
        for k, v in SHAPES.items():
            print(k, " ".join(f"{kk}={vv}" for kk, vv in v.items()))
        return
    if not a.shape or not a.out:
        ap.error("--shape and -o are required")
    c = dict(SHAPES[a.shape], shape=a.shape)
    if a.layers is not None:
        if not 1 <= a.layers <= 1000:
            ap.error("--layers must be 1..1000")
        c["n_layer"] = a.layers
    text = open(a.text, encoding="utf-8").read()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    write(a.out, c, a.seed, text)


if __name__ == "__main__":
    main()
