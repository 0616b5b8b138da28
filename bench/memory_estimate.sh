#!/usr/bin/env bash
# The memory estimate (zerotrain estimate, docs/memory.md) against measured runs: for each case,
# `zerotrain train --summary` reports the estimated peak per rank and the largest peak RSS above
# the pre-model baseline; this prints them side by side with the error, for both allocator
# policies (train.retain_freed_memory never/always; "default" leaves the key at its default) and
# several micro-batches. The last lines name the CPU it ran on.
# Usage: [CASES="stage:world:precision:micro ..."] [HEAPS="never always default"] [MODEL='{"preset": "gpt2-124m"}']
#        [SEQ=128] bench/memory_estimate.sh [steps]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
steps=${1:-2}
bin=build/bin
out=$(mktemp -d)
default_model='{"preset": "tiny", "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 256, "context_length": 128, "dropout": 0.0}'
model=${MODEL:-$default_model}
cat > "$out/config.json" <<JSON
{"gradient_accumulation_steps": 1, "steps_per_print": 1000,
 "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
 "model": $model,
 "data": {"source": "embedded", "sequence_length": ${SEQ:-128}},
 "train": {"steps": $steps, "seed": 7, "threads": 1, "log_dir": "$out"}}
JSON
cases=(${CASES:-0:1:fp32:4 0:1:fp32:8 0:1:fp32:16 0:1:bf16:8 0:1:bf16:16 1:2:fp32:8 2:2:bf16:8 2:2:bf16:16 3:3:fp32:8 3:2:bf16:16})
echo "| stage | N | precision | micro-batch | heap | estimated MiB | measured MiB | error |"
echo "|---|---|---|---|---|---|---|---|"
for c in "${cases[@]}"; do
  IFS=: read -r stage world precision micro <<< "$c"
  for heap in ${HEAPS:-never always}; do
    bf16=false; [ "$precision" = bf16 ] && bf16=true
    heap_set=(--set "train.retain_freed_memory=$heap")
    [ "$heap" = default ] && heap_set=()
    "$bin/zerotrain" train "$out/config.json" --nproc "$world" --set "zero_optimization.stage=$stage" \
      --set "bf16.enabled=$bf16" --set "train_micro_batch_size_per_gpu=$micro" \
      "${heap_set[@]}" --summary "$out/summary.json" >/dev/null
    python3 - "$out/summary.json" "$stage" "$world" "$precision" "$micro" "$heap" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
m = s["memory"]
est = m["estimate"]["per_device"]["total"] / 2**20
meas = m["measured_peak_above_baseline_bytes"] / 2**20
print(f"| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4]} | {sys.argv[5]} | {sys.argv[6]} | {est:.1f} | {meas:.1f} | {100 * (est - meas) / meas:+.1f}% |")
PY
  done
done
rm -rf "$out"
echo
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'); flags:$(for f in avx2 avx512f amx_tile amx_bf16; do grep -qw "$f" /proc/cpuinfo && printf ' %s' "$f"; done)"
