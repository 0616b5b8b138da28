#!/usr/bin/env bash
# Tensor parallelism against data parallelism alone at the same global batch: GPT-2 350M (the
# vocabulary padded to 50304, a multiple of 128, so that it splits) on 4 ranks × 1 thread at
# ZeRO stage 3, fp32, AdamW, as T = 2 × DP = 2 (micro-batch 2 per rank: each tensor group reads
# one micro-batch) and as DP = 4 (micro-batch 1): peak RSS per rank, seconds per step over the
# steps after the first, and the collectives' bytes per step from the comms logger. Prints its
# command, the CPU and a markdown table.
#
#   bench/tensor_parallel.sh [steps=4] [seq=256]
#
# ZEROTRAIN=path selects the binary (default build/bin/zerotrain); PRESET (default gpt2-350m) and
# VOCAB (default 50304) change the model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
steps=${1:-4}
seq=${2:-256}
command_line="bench/tensor_parallel.sh $*"
zerotrain=${ZEROTRAIN:-build/bin/zerotrain}
preset=${PRESET:-gpt2-350m}
vocab=${VOCAB:-50304}
work=$(mktemp -d "${TMPDIR:-/tmp}/zt-tensor-parallel.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "command: $command_line"
echo "cpu: $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}'); flags:" \
  "$(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "model: $preset (vocabulary $vocab), sequence $seq; 4 ranks x 1 thread, stage 3, fp32, AdamW, global batch 4"

# run NAME T MICRO: one training run; leaves $work/NAME.json and $work/logs-NAME/.
run() {
  local name=$1 t=$2 micro=$3
  cat > "$work/$name.config.json" <<EOF
{"train_micro_batch_size_per_gpu": $micro, "gradient_accumulation_steps": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
 "zero_optimization": {"stage": 3},
 "tensor_parallel": {"autotp_size": $t},
 "comms_logger": {"enabled": true},
 "model": {"preset": "$preset", "vocab_size": $vocab},
 "data": {"source": "embedded", "sequence_length": $seq},
 "train": {"steps": $steps, "seed": 1, "threads": 1, "log_dir": "$work/logs-$name"}}
EOF
  echo "$name: T=$t, micro-batch $micro, $steps steps" >&2
  "$zerotrain" train "$work/$name.config.json" --nproc 4 --summary "$work/$name.json" > "$work/$name.log" 2>&1 ||
    { tail -5 "$work/$name.log" >&2; exit 1; }
}

run dp4 1 1
run tp2 2 2
python3 - "$work" "$steps" <<'EOF'
import csv, json, sys, statistics
work, steps = sys.argv[1], int(sys.argv[2])
rows = {}
for name, label in [("dp4", "DP = 4"), ("tp2", "T = 2 × DP = 2")]:
    summary = json.load(open(f"{work}/{name}.json"))
    with open(f"{work}/logs-{name}/zerotrain.csv") as f:
        elapsed = [float(r["elapsed_seconds"]) for r in csv.DictReader(f)]
    per_step = statistics.median(b - a for a, b in zip(elapsed, elapsed[1:]))  # the first step warms up
    peak = max(r["peak_rss_bytes"] for r in summary["ranks"])
    steps_peak = max(r.get("steps_peak_rss_bytes", -1) for r in summary["ranks"])
    # Rank 0's collectives over the run (comms_logger rows: one size of one operation each).
    sent = sum(row["message_bytes"] * row["count"] for row in summary.get("comms_logger", []))
    rows[label] = (peak, steps_peak, per_step, sent, summary["losses"][-1])
base = rows["DP = 4"][2]
print("\n| layout | peak RSS per rank (largest) | steps' peak RSS per rank | s/step | s/step vs DP = 4 | collective bytes (rank 0, run) | last loss |")
print("|---|---|---|---|---|---|---|")
for label, (peak, steps_peak, per_step, sent, loss) in rows.items():
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b and b > 0 else "n/a"
    print(f"| {label} | {gib(peak)} | {gib(steps_peak)} | {per_step:.2f} | {per_step / base:.2f} | "
          f"{gib(sent)} | {loss:.4f} |")
EOF
