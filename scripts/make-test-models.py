#!/usr/bin/env python3
"""Make the tiny random-weight test models under tests/data/models/ (fixed seeds, reproducible).

Each model is small enough to commit (< 3 MB) and is loaded and run by llama.cpp, which produces
the reference outputs in tests/data/refs/ (scripts/make-references.sh). What each one covers:

  tiny-llama-f16.gguf    arch llama: GQA (8 q heads, 2 kv heads), rope NORM (adjacent pairs),
                         separate output.weight, SentencePiece vocab ("llama": ▁ pieces with
                         scores, byte fallback <0xNN>, <s> added as BOS).
  tiny-llama-q8_0.gguf   the same weights, every 2-D tensor Q8_0 (gguf-py's quantizer).
  tiny-llama-q4_k.gguf   the same weights, every 2-D tensor Q4_K (made by llama-quantize --pure
                         from the F16 file; make-references.sh does that step).
  tiny-qwen3-f16.gguf    arch qwen3: head_dim 64, 4 q / 2 kv heads, attn_q_norm/attn_k_norm,
                         rope NEOX, separate output.weight, GPT-2 byte-level BPE vocab
                         (pre "qwen2"), no BOS.
  tiny-qwen2-f16.gguf    arch qwen2: q/k/v biases, tied output (no output.weight, llama.cpp
                         uses token_embd), rope NEOX, the same BPE vocab.

Mixture-of-experts models (every 2-D/3-D weight Q8_0, routers F32 as llama.cpp's converter
writes them; stacked expert tensors ffn_{gate,up,down}_exps [n_embd, n_ff_exp, n_expert]):

  tiny-mixtral-q8_0.gguf   arch llama with llama.expert_count 8, top-2 (Mixtral): softmax, top-k,
                           weights renormalised; the llama SPM vocab.
  tiny-qwen3moe-q8_0.gguf  arch qwen3moe, 16 experts of width 64, top-4, renormalised; qk norms.
  tiny-qwen2moe-q8_0.gguf  arch qwen2moe, 20 experts of width 64, top-4, NOT renormalised, plus a
                           shared expert of width 256 gated by sigmoid(ffn_gate_inp_shexp . x);
                           q/k/v biases. 20 experts: ggml's softmax takes 16 with its vector exp
                           and 4 with libm's, both paths are exercised.

  tiny-qwen3moe-tq2_0.gguf the qwen3moe model with every matrix TQ2_0 (ternary, BitNet b1.58
                           storage), made by llama-quantize --allow-requantize --pure in
                           make-references.sh; the 64-wide expert ffn_down rows stay q8_0.

Router weights give logits with a std of about ROUTER_STD, so routing is decided by the input
and not a near-uniform tie.

Vocabularies are trained here by a few hundred BPE steps over tests/data/text/gpl-3.txt (so the
text tokenizes into real multi-byte pieces, while rarer characters such as "é" fall back to
bytes). Weights: normal(0, 1) embeddings (0.005 for the tied model, see make_weights),
normal(0, 1/sqrt(fan_in)) projections, norm weights 1 + normal(0, 0.1) and biases normal(0, 0.3)
so that every term visibly moves the logits; output_norm.weight is scaled so the logits have a
std of about LOGIT_STD and the greedy continuation is not one repeated token. The EOS row of the
output matrix is scaled by 0.1 so the references run the full 32 tokens instead of stopping.

usage: scripts/make-test-models.py [--out tests/data/models] [--text tests/data/text/gpl-3.txt]
"""
import argparse
import collections
import os
import re
import sys

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

N_VOCAB = 512
LOGIT_STD = 4.0  # target spread of the logits, set through output_norm.weight
ROUTER_STD = 1.5  # spread of the MoE router logits

# GPT-2 / Qwen2 pre-tokenizer (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN2), with the Unicode
# classes narrowed to ASCII (the training text is ASCII). Only used to train the merges.
QWEN2_PRE = re.compile(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def bpe_train(words, n_merges):
    """Plain BPE: words is {tuple(symbols): count}; returns merges [(a, b)] in rank order."""
    words = {w: c for w, c in words.items() if len(w) > 1}
    merges = []
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, c in words.items():
            for i in range(len(w) - 1):
                pairs[(w[i], w[i + 1])] += c
        if not pairs:
            break
        # most frequent, ties broken by the pair itself so the result does not depend on hashing
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        joined = best[0] + best[1]
        new = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            if len(out) > 1:
                new[tuple(out)] = new.get(tuple(out), 0) + c
        words = new
    return merges


def spm_vocab(text):
    """SentencePiece-style vocab for llama.cpp's "llama" tokenizer (llm_tokenizer_spm).

    Pieces are whole-word fragments with "▁" for a space; llama.cpp merges adjacent symbols whose
    concatenation is a token, highest score first, and falls back to <0xNN> byte tokens."""
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # UNKNOWN, CONTROL, CONTROL, BYTE...
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    counts = collections.Counter(re.findall(r"\S+", text))
    # chars: everything frequent; rarer ones (and all non-ASCII) are left to byte fallback
    chars = collections.Counter()
    for w, c in counts.items():
        for ch in "▁" + w:
            chars[ch] += c
    singles = sorted(ch for ch, c in chars.items() if c >= 20 and ord(ch) < 128 or ch == "▁")
    words = {tuple("▁" + w): c for w, c in counts.items()}
    n_merges = N_VOCAB - len(tokens) - len(singles)
    merges = bpe_train(words, n_merges)
    for i, ch in enumerate(singles):
        tokens.append(ch)
        types.append(1)
        scores.append(-1000.0 - i)  # below every merged piece
    for i, (a, b) in enumerate(merges):
        tokens.append(a + b)
        types.append(1)
        scores.append(-float(i))  # earlier merge = higher score, as SentencePiece BPE
    assert len(tokens) == len(set(tokens)), "duplicate piece"
    return tokens, types, scores


def bytes_to_unicode():
    """GPT-2's byte <-> printable-char table (openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def gpt2_vocab(text):
    """Byte-level BPE vocab + merges for llama.cpp's "gpt2" tokenizer with pre-tokenizer qwen2."""
    b2u = bytes_to_unicode()
    base = [b2u[b] for b in range(256)]
    counts = collections.Counter(QWEN2_PRE.findall(text))
    words = {tuple(b2u[b] for b in w.encode("utf-8")): c for w, c in counts.items()}
    merges = bpe_train(words, N_VOCAB - 256 - 1)
    tokens = base + [a + b for a, b in merges] + ["<|endoftext|>"]
    types = [1] * (len(tokens) - 1) + [3]  # NORMAL..., CONTROL
    assert len(tokens) == len(set(tokens)), "duplicate token"
    return tokens, types, [f"{a} {b}" for a, b in merges]


class Weights:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def normal(self, shape, std):
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def norm(self, n, scale=1.0):
        return (scale * (1.0 + self.rng.standard_normal(n) * 0.1)).astype(np.float32)


def make_weights(cfg, seed):
    """Tensors as numpy arrays in (rows, cols) = ggml (ne[1], ne[0]) order, keyed by GGUF name."""
    w = Weights(seed)
    E, F, V = cfg["n_embd"], cfg["n_ff"], N_VOCAB
    hd = cfg["head_dim"]
    nq, nkv = cfg["n_head"] * hd, cfg["n_head_kv"] * hd
    # Tied output: logit_j = e_j . norm(x), and x holds the current token's own embedding, so a
    # tied model predicts its input token again unless the layers' outputs dwarf the embedding
    # (ratio sqrt(n_embd) * emb_std / residual_std); hence a small embedding there.
    emb_std = 0.005 if cfg.get("tied_output") else 1.0
    t = {"token_embd.weight": w.normal((V, E), emb_std)}
    for i in range(cfg["n_layer"]):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = w.norm(E)
        t[p + "attn_q.weight"] = w.normal((nq, E), E ** -0.5)
        t[p + "attn_k.weight"] = w.normal((nkv, E), E ** -0.5)
        t[p + "attn_v.weight"] = w.normal((nkv, E), E ** -0.5)
        if cfg.get("tied_output"):
            # The tiny embedding leaves the current token's identity to the attention; a key
            # projection equal to the query projection of the first query head of each KV group
            # makes that head attend mostly to its own position (RoPE cancels at distance 0), so
            # the next token depends on the current one and the continuation varies.
            g = cfg["n_head"] // cfg["n_head_kv"]
            q = t[p + "attn_q.weight"]
            t[p + "attn_k.weight"] = np.concatenate([q[h * g * hd:(h * g + 1) * hd] for h in range(cfg["n_head_kv"])])
        if cfg.get("qkv_bias"):
            t[p + "attn_q.bias"] = w.normal(nq, 0.3)
            t[p + "attn_k.bias"] = w.normal(nkv, 0.3)
            t[p + "attn_v.bias"] = w.normal(nkv, 0.3)
        if cfg.get("qk_norm"):
            t[p + "attn_q_norm.weight"] = w.norm(hd)
            t[p + "attn_k_norm.weight"] = w.norm(hd)
        t[p + "attn_output.weight"] = w.normal((E, nq), nq ** -0.5)
        t[p + "ffn_norm.weight"] = w.norm(E)
        t[p + "ffn_gate.weight"] = w.normal((F, E), E ** -0.5)
        t[p + "ffn_up.weight"] = w.normal((F, E), E ** -0.5)
        t[p + "ffn_down.weight"] = w.normal((E, F), F ** -0.5)
    # |norm(x)| = sqrt(E), so logits have std ~ out_std * sqrt(E) * output_norm scale
    out_std = emb_std if cfg.get("tied_output") else E ** -0.5
    t["output_norm.weight"] = w.norm(E, LOGIT_STD / (out_std * E ** 0.5))
    if not cfg.get("tied_output"):
        out = w.normal((V, E), out_std)
        out[cfg["eos"]] *= 0.1
        t["output.weight"] = out
    else:
        t["token_embd.weight"][cfg["eos"]] *= 0.1
    return t


def make_moe_weights(cfg, seed):
    """make_weights with each layer's FFN replaced by routed experts (and a shared expert)."""
    t = make_weights(dict(cfg, n_ff=8), seed)
    w = Weights(seed + 100)
    E, NE, FE = cfg["n_embd"], cfg["n_expert"], cfg["n_ff_exp"]
    for i in range(cfg["n_layer"]):
        p = f"blk.{i}."
        for k in ("ffn_gate", "ffn_up", "ffn_down"):
            del t[p + k + ".weight"]
        t[p + "ffn_gate_inp.weight"] = w.normal((NE, E), ROUTER_STD * E ** -0.5)
        t[p + "ffn_gate_exps.weight"] = w.normal((NE, FE, E), E ** -0.5)
        t[p + "ffn_up_exps.weight"] = w.normal((NE, FE, E), E ** -0.5)
        # down: each token mixes k experts, so scale like one FFN of width k * FE
        t[p + "ffn_down_exps.weight"] = w.normal((NE, E, FE), (cfg["n_expert_used"] * FE) ** -0.5)
        if cfg.get("n_ff_shexp"):
            S = cfg["n_ff_shexp"]
            t[p + "ffn_gate_inp_shexp.weight"] = w.normal(E, E ** -0.5)
            t[p + "ffn_gate_shexp.weight"] = w.normal((S, E), E ** -0.5)
            t[p + "ffn_up_shexp.weight"] = w.normal((S, E), E ** -0.5)
            t[p + "ffn_down_shexp.weight"] = w.normal((E, S), S ** -0.5)
    return t


F32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def write(path, cfg, vocab, tensors, qtype):
    arch = cfg["arch"]
    wr = gguf.GGUFWriter(path, arch)
    wr.add_name(os.path.basename(path)[: -len(".gguf")])
    wr.add_description("ternfleet test model: random weights (scripts/make-test-models.py), not a trained model")
    wr.add_file_type({None: gguf.LlamaFileType.MOSTLY_F16, QT.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
    wr.add_context_length(cfg["n_ctx"])
    wr.add_embedding_length(cfg["n_embd"])
    wr.add_block_count(cfg["n_layer"])
    if "n_expert" in cfg:
        wr.add_feed_forward_length(cfg["n_ff_exp"] if arch == "llama" else cfg["n_ff"])
        wr.add_expert_count(cfg["n_expert"])
        wr.add_expert_used_count(cfg["n_expert_used"])
        if arch != "llama":
            wr.add_expert_feed_forward_length(cfg["n_ff_exp"])
        if cfg.get("n_ff_shexp"):
            wr.add_expert_shared_feed_forward_length(cfg["n_ff_shexp"])
    else:
        wr.add_feed_forward_length(cfg["n_ff"])
    wr.add_head_count(cfg["n_head"])
    wr.add_head_count_kv(cfg["n_head_kv"])
    wr.add_layer_norm_rms_eps(cfg["rms_eps"])
    wr.add_rope_freq_base(cfg["rope_base"])
    wr.add_vocab_size(N_VOCAB)
    if arch == "llama":
        wr.add_rope_dimension_count(cfg["head_dim"])
    if arch in ("qwen3", "qwen3moe"):
        wr.add_key_length(cfg["head_dim"])
        wr.add_value_length(cfg["head_dim"])
    if vocab["model"] == "llama":
        wr.add_tokenizer_model("llama")
        wr.add_tokenizer_pre("default")
        wr.add_token_list(vocab["tokens"])
        wr.add_token_scores(vocab["scores"])
        wr.add_token_types(vocab["types"])
        wr.add_unk_token_id(0)
        wr.add_bos_token_id(1)
        wr.add_eos_token_id(2)
        wr.add_add_bos_token(True)
        wr.add_add_eos_token(False)
        wr.add_add_space_prefix(True)
    else:
        eot = vocab["tokens"].index("<|endoftext|>")
        wr.add_tokenizer_model("gpt2")
        wr.add_tokenizer_pre("qwen2")
        wr.add_token_list(vocab["tokens"])
        wr.add_token_types(vocab["types"])
        wr.add_token_merges(vocab["merges"])
        wr.add_bos_token_id(eot)
        wr.add_eos_token_id(eot)
        wr.add_pad_token_id(eot)
        wr.add_add_bos_token(False)
    for name, a in tensors.items():
        if a.ndim == 1 or name.endswith(F32_TENSORS):
            wr.add_tensor(name, a.astype(np.float32))
        elif qtype is None:
            wr.add_tensor(name, a.astype(np.float16))
        else:
            # from the F16-rounded values, as llama-quantize would from the F16 file
            wr.add_tensor(name, quantize(a.astype(np.float16).astype(np.float32), qtype), raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    print(f"{path}: {os.path.getsize(path)} bytes", file=sys.stderr)


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(root, "tests/data/models"))
    ap.add_argument("--text", default=os.path.join(root, "tests/data/text/gpl-3.txt"))
    args = ap.parse_args()
    text = open(args.text, encoding="utf-8").read()
    os.makedirs(args.out, exist_ok=True)

    stoks, stypes, sscores = spm_vocab(text)
    spm = {"model": "llama", "tokens": stoks, "types": stypes, "scores": sscores}
    btoks, btypes, bmerges = gpt2_vocab(text)
    bpe = {"model": "gpt2", "tokens": btoks, "types": btypes, "merges": bmerges}
    eot = btoks.index("<|endoftext|>")

    common = {"n_ctx": 2048, "n_embd": 256, "n_layer": 2, "n_ff": 512}
    llama = dict(common, arch="llama", n_head=8, n_head_kv=2, head_dim=32, rms_eps=1e-5,
                 rope_base=10000.0, eos=2)
    qwen3 = dict(common, arch="qwen3", n_head=4, n_head_kv=2, head_dim=64, rms_eps=1e-6,
                 rope_base=1000000.0, qk_norm=True, eos=eot)
    qwen2 = dict(common, arch="qwen2", n_head=4, n_head_kv=2, head_dim=64, rms_eps=1e-6,
                 rope_base=1000000.0, qkv_bias=True, tied_output=True, eos=eot)

    lw = make_weights(llama, seed=1)
    write(os.path.join(args.out, "tiny-llama-f16.gguf"), llama, spm, lw, None)
    write(os.path.join(args.out, "tiny-llama-q8_0.gguf"), llama, spm, lw, QT.Q8_0)
    write(os.path.join(args.out, "tiny-qwen3-f16.gguf"), qwen3, bpe, make_weights(qwen3, seed=3), None)
    write(os.path.join(args.out, "tiny-qwen2-f16.gguf"), qwen2, bpe, make_weights(qwen2, seed=2), None)

    mixtral = dict(llama, n_expert=8, n_expert_used=2, n_ff_exp=128)
    qwen3moe = dict(qwen3, arch="qwen3moe", n_expert=16, n_expert_used=4, n_ff_exp=64, n_ff=256)
    qwen2moe = dict(qwen2, arch="qwen2moe", n_expert=20, n_expert_used=4, n_ff_exp=64, n_ff=256,
                    n_ff_shexp=256, tied_output=False)
    write(os.path.join(args.out, "tiny-mixtral-q8_0.gguf"), mixtral, spm, make_moe_weights(mixtral, seed=11), QT.Q8_0)
    write(os.path.join(args.out, "tiny-qwen3moe-q8_0.gguf"), qwen3moe, bpe, make_moe_weights(qwen3moe, seed=13), QT.Q8_0)
    write(os.path.join(args.out, "tiny-qwen2moe-q8_0.gguf"), qwen2moe, bpe, make_moe_weights(qwen2moe, seed=12), QT.Q8_0)


if __name__ == "__main__":
    main()
