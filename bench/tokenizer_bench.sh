#!/usr/bin/env bash
# Encoding throughput on one core: zt::HfTokenizer (bench/tokenizer_bench.cpp) against the Python
# `tokenizers` library's encode_batch with one thread (RAYON_NUM_THREADS=1), both pinned to CPU 0,
# on the same lines, for tokenizers trained by tests/support/hf_tokenizer_oracle.py (GPT-2's
# byte-level layout, Llama 3's split regex, Llama 2's SentencePiece layout) and two texts: the
# tests' mixed text (accents, CJK, emoji, whitespace runs, numbers) and English prose (this
# repository's documentation, repeated). Best of 5 passes each; both warm their word caches.
#   bench/tokenizer_bench.sh [BUILD_DIR]     (needs BUILD_DIR/bin/tokenizer_bench and
#                                             scripts/python_deps.sh's tokenizers)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build}
source "$root/scripts/python_deps.sh"
export PYTHONPATH="$(hf_pythonpath)" PYTHONNOUSERSITE=1 HF_HUB_OFFLINE=1 RAYON_NUM_THREADS=1
oracle="$root/tests/support/hf_tokenizer_oracle.py"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$oracle" cases "$work" 10 >/dev/null
python3 "$oracle" text "$work/mixed.txt" 40000
while [ "$(stat -c %s "$work/english.txt" 2>/dev/null || echo 0)" -lt 4000000 ]; do
  cat "$root"/docs/*.md "$root/README.md" >>"$work/english.txt"
done
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), flags: $(grep -o -w -E 'avx2|avx512[a-z_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
printf '%-14s %-8s %8s %12s %12s %8s\n' tokenizer text MB "zerotrain" "tokenizers" ratio
for kind in bytelevel llama3 sentencepiece; do
  for text in mixed english; do
    ours=$(taskset -c 0 "$build/bin/tokenizer_bench" "$work/$kind.json" "$work/$text.txt" 5)
    theirs=$(taskset -c 0 python3 "$oracle" bench "$work/$kind.json" "$work/$text.txt" 5)
    python3 - "$kind" "$text" "$ours" "$theirs" <<'PY'
import json, sys
kind, text, ours, theirs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
if ours["tokens"] != theirs["tokens"] or ours["bytes"] != theirs["bytes"]:
    sys.exit(f"{kind}/{text}: different work: {ours} against {theirs}")
mb = ours["bytes"] / 1e6
print(f"{kind:<14} {text:<8} {mb:8.2f} {mb / ours['seconds']:9.2f} MB/s {mb / theirs['seconds']:7.2f} MB/s "
      f"{theirs['seconds'] / ours['seconds']:7.2f}x")
PY
  done
done
