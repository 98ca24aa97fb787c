#!/usr/bin/env bash
# MoEfication and ternary-expert quality on Gemma 3 270M (docs/moe.md): converts the model into
# MoE bundles with E = 8 and 16 experts per layer (calibration text: tests/data/text/
# python-reference.txt), then scores each with k = E, E/2, E/4 experts per token against the
# dense model on the evaluation text tests/data/text/gpl-3.txt (ctx 512, all chunks):
# perplexity and top-1 agreement. Then the ternary (tf2) version of each bundle against its
# source bundle: per-layer routing agreement and the perplexity cost.
#
# Bases: the Q4_K_M release as it is, and its f16 dequantization (scripts/dequantize-model.py).
# Writes target/moefy/*.json and prints markdown tables. About 40 minutes on 2 cores.
#
# usage: benches/moefy-quality.sh [q4|f16|both] [--chunks N]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
which=${1:-both}; shift || true
chunks=()
[ "${1:-}" = "--chunks" ] && chunks=(--chunks "$2")
B=target/release/ternfleet
out=target/moefy
mkdir -p "$out"
cargo build --release --quiet
./scripts/fetch-model.sh gemma >/dev/null
q4=models/gemma-3-270m-q4_k_m.gguf
f16=models/gemma-3-270m-f16.gguf
[ -f "$f16" ] || python3 scripts/dequantize-model.py "$q4" "$f16"
calib=tests/data/text/python-reference.txt
eval=tests/data/text/gpl-3.txt
bases=()
case "$which" in q4) bases=(q4) ;; f16) bases=(f16) ;; *) bases=(f16 q4) ;; esac
for base in "${bases[@]}"; do
  src=$q4; [ "$base" = f16 ] && src=$f16
  for E in 8 16; do
    b=$out/gemma-$base-e$E
    $B convert -m "$src" -o "$b" --experts "$E" --calib "$calib" 2>/dev/null
    for k in $E $((E / 2)) $((E / 4)); do
      $B compare -m "$b" --top-experts "$k" --ref "$src" -f "$eval" "${chunks[@]}" --json 2>/dev/null > "$out/$base-e$E-k$k.json"
    done
    $B convert -m "$src" -o "$b-tf2" --experts "$E" --calib "$calib" --expert-type tf2 2>/dev/null
    for k in $((E / 2)) $((E / 4)); do
      $B compare -m "$b-tf2" --top-experts "$k" --ref "$b" -f "$eval" "${chunks[@]}" --json 2>/dev/null > "$out/$base-e$E-k$k-tf2.json"
    done
  done
done
python3 - "$out" "${bases[@]}" <<'PY'
import json, sys, os
out, bases = sys.argv[1], sys.argv[2:]
for base in bases:
    print(f"\n### base: {base}\n")
    print("| E | k | ppl (MoE) | ppl (dense) | Δppl | top-1 agreement |")
    print("|---|---|---|---|---|---|")
    for E in (8, 16):
        for k in (E, E // 2, E // 4):
            p = os.path.join(out, f"{base}-e{E}-k{k}.json")
            if not os.path.exists(p): continue
            r = json.load(open(p))
            print(f"| {E} | {k} | {r['ppl']:.4f} | {r['ppl_ref']:.4f} | {100*(r['ppl']/r['ppl_ref']-1):+.2f} % | {100*r['top1_agreement']:.2f} % |")
    print("\nternary (tf2 experts) vs the same bundle with source-precision experts:\n")
    print("| E | k | ppl (tf2) | ppl (source experts) | Δppl | top-1 agreement | routing agreement per layer (min / mean / max) |")
    print("|---|---|---|---|---|---|---|")
    for E in (8, 16):
        for k in (E // 2, E // 4):
            p = os.path.join(out, f"{base}-e{E}-k{k}-tf2.json")
            if not os.path.exists(p): continue
            r = json.load(open(p))
            ra = r.get("routing_agreement") or []
            rs = f"{100*min(ra):.1f} / {100*sum(ra)/len(ra):.1f} / {100*max(ra):.1f} %" if ra else "-"
            print(f"| {E} | {k} | {r['ppl']:.4f} | {r['ppl_ref']:.4f} | {100*(r['ppl']/r['ppl_ref']-1):+.2f} % | {100*r['top1_agreement']:.2f} % | {rs} |")
PY
