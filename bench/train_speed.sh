#!/usr/bin/env bash
# Training speed: the plain LibTorch loop (bench/plain_loop_bench.cpp) against `zerotrain train`
# at stage 0 with one rank, same model and shape (default GPT-2 124M, batch 4, context 64,
# 2 threads), alternating runs in one invocation, each in its default environment.
# Usage: bench/train_speed.sh [rounds] [preset] [steps]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=${1:-2} preset=${2:-gpt2-124m} steps=${3:-8} warmup=2
bin=build/bin
out=$(mktemp -d)
cat > "$out/config.json" <<JSON
{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 1000,
 "model": {"preset": "$preset"}, "data": {"source": "embedded", "sequence_length": 64},
 "train": {"steps": $((steps + warmup)), "threads": 2, "log_dir": "$out"}, "csv_monitor": {"enabled": true}}
JSON
plain=() ours=()
for r in $(seq "$rounds"); do
  p=$("$bin/plain_loop_bench" "$preset" 4 64 "$warmup" "$steps" 2 | tail -n 1)
  plain+=("$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["tokens_per_second"])' "$p")")
  "$bin/zerotrain" train "$out/config.json" --nproc 1 --summary "$out/summary.json" >/dev/null
  # Skip the warm-up steps: rate over the timed steps from the per-step CSV's elapsed column.
  ours+=("$(python3 - "$out/zerotrain.csv" "$warmup" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
w = int(sys.argv[2])
t0, t1 = float(rows[w - 1]["elapsed_seconds"]), float(rows[-1]["elapsed_seconds"])
print(4 * 64 * (len(rows) - w) / (t1 - t0))
PY
)")
  echo "round $r: plain ${plain[-1]} tok/s, zerotrain ${ours[-1]} tok/s" >&2
done
python3 - "$preset" "${plain[*]}" "${ours[*]}" <<'PY'
import sys, statistics
preset, plain, ours = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
p, o = statistics.median(plain), statistics.median(ours)
print(f"| program | {preset} tokens/s (median of {len(plain)}) | ratio |")
print("|---|---|---|")
print(f"| plain LibTorch loop (torch::optim::AdamW) | {p:.0f} | 1.00 |")
print(f"| zerotrain train, stage 0, 1 rank | {o:.0f} | {o/p:.2f} |")
PY
