#!/usr/bin/env bash
# Activation checkpointing figures: GPT-2 124M at context 1024 on 2 ranks × 1 thread,
# stage 2, fp32, the head and loss in chunks of 1024 tokens, for activation_checkpointing.policy
# none / selective / full. Prints its command, the CPU and markdown tables.
#
#   bench/activation_checkpointing.sh speed [micro=4] [steps=3] [rounds=1]
#       The three policies at the same micro-batch, rounds alternating them so that noise hits
#       all alike: tokens/s over the steps after the first (from the per-step CSV), time per token
#       against none, peak RSS per rank.
#   bench/activation_checkpointing.sh capacity none:10,12 selective:12,14 full:40,48 ...
#       One step per (policy, micro-batch) under bench/memwatch.py with a cap of $CAP_GIB (default
#       0.9 × RAM) for the whole process tree: fits or not, peak memory of the tree and per rank,
#       the estimator's peak per rank, tokens/s of that step. The largest micro-batch that fits per
#       policy is the largest listed that ran; the next listed one that did not bounds it.
#
# ZEROTRAIN=path selects the binary (default build/bin/zerotrain); PRESET (default gpt2-124m),
# SEQ (default 1024) and CHUNK (model.loss_chunk_tokens, default 1024) change the model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode=${1:-}
[ -n "$mode" ] && shift
command_line="bench/activation_checkpointing.sh $mode $*"
zerotrain=${ZEROTRAIN:-build/bin/zerotrain}
preset=${PRESET:-gpt2-124m}
seq=${SEQ:-1024}
chunk=${CHUNK:-1024}
cap_gib=${CAP_GIB:-$(awk '/^MemTotal:/ {printf "%.1f", $2 * 0.9 / 1048576}' /proc/meminfo)}
cap_bytes=$(python3 -c "print(int(float('$cap_gib') * 2**30))")
work=$(mktemp -d "${TMPDIR:-/tmp}/zt-recompute.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "command: $command_line"
echo "cpu: $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}'); flags:" \
  "$(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "model: $preset, sequence $seq, loss chunks of $chunk tokens; 2 ranks x 1 thread, stage 2, fp32, AdamW"

# run NAME POLICY MICRO STEPS: one training run; leaves $work/NAME.{json,csv,watch.json,log}.
run() {
  local name=$1 policy=$2 micro=$3 steps=$4
  cat > "$work/$name.config.json" <<EOF
{"train_micro_batch_size_per_gpu": $micro, "gradient_accumulation_steps": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
 "zero_optimization": {"stage": 2},
 "activation_checkpointing": {"policy": "$policy"},
 "model": {"preset": "$preset", "loss_chunk_tokens": $chunk},
 "data": {"source": "embedded", "sequence_length": $seq},
 "csv_monitor": {"enabled": true, "output_path": "$work", "job_name": "$name"},
 "train": {"steps": $steps, "seed": 1, "threads": 1, "log_dir": "$work/logs-$name"}}
EOF
  python3 bench/memwatch.py --cap-bytes "$cap_bytes" --result "$work/$name.watch.json" --log "$work/$name.log" -- \
    "$zerotrain" train "$work/$name.config.json" --nproc 2 --summary "$work/$name.json" > "$work/$name.log" 2>&1 || true
}

case $mode in
  speed)
    micro=${1:-4} steps=${2:-3} rounds=${3:-1}
    for ((r = 0; r < rounds; ++r)); do
      for policy in none selective full; do
        echo "round $r: $policy, micro-batch $micro, $steps steps" >&2
        run "speed-$policy-$r" "$policy" "$micro" "$steps"
      done
    done
    python3 - "$work" "$micro" "$rounds" <<'EOF'
import csv, json, sys, statistics
work, micro, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = {}
for policy in ["none", "selective", "full"]:
    rates, peaks = [], []
    for r in range(rounds):
        name = f"speed-{policy}-{r}"
        with open(f"{work}/{name}.csv") as f:
            steps = list(csv.DictReader(f))
        rates += [float(s["tokens_per_second"]) for s in steps[1:]]  # the first step warms up
        summary = json.load(open(f"{work}/{name}.json"))
        peaks.append(max(rank["peak_rss_bytes"] for rank in summary["ranks"]))
    rows[policy] = (statistics.median(rates), max(peaks))
base = rows["none"][0]
print(f"\n| policy | micro-batch | tokens/s (2 ranks) | time per token vs none | peak RSS per rank |")
print("|---|---|---|---|---|")
for policy, (rate, peak) in rows.items():
    print(f"| {policy} | {micro} | {rate:.1f} | {base / rate:.3f}x | {peak / 2**30:.2f} GiB |")
EOF
    ;;
  capacity)
    for spec in "$@"; do
      policy=${spec%%:*}
      IFS=, read -r -a micros <<< "${spec#*:}"
      for micro in "${micros[@]}"; do
        echo "$policy, micro-batch $micro: one step" >&2
        run "cap-$policy-$micro" "$policy" "$micro" 1
      done
    done
    python3 - "$work" "$@" <<'EOF'
import json, os, sys
work, specs = sys.argv[1], sys.argv[2:]
print("\n| policy | micro-batch | fits | peak of the tree | peak RSS per rank (max) | estimate per rank | tokens/s (one step) |")
print("|---|---|---|---|---|---|---|")
largest = {}
for spec in specs:
    policy, micros = spec.split(":")
    for micro in map(int, micros.split(",")):
        name = f"cap-{policy}-{micro}"
        watch = json.load(open(f"{work}/{name}.watch.json"))
        ok = watch["status"] == "ok" and os.path.exists(f"{work}/{name}.json")
        rank_peak = estimate = rate = "-"
        if ok:
            s = json.load(open(f"{work}/{name}.json"))
            rank_peak = f"{max(r['peak_rss_bytes'] for r in s['ranks']) / 2**30:.2f} GiB"
            estimate = f"{s['memory']['estimate']['per_device']['total'] / 2**30:.2f} GiB"
            rate = f"{s['tokens_per_second']:.1f}"
            largest[policy] = max(largest.get(policy, 0), micro)
        print(f"| {policy} | {micro} | {'yes' if ok else watch['status']} | "
              f"{watch['peak_tree_memory_bytes'] / 2**30:.2f} GiB | {rank_peak} | {estimate} | {rate} |")
if "none" in largest:
    for policy, micro in largest.items():
        print(f"largest micro-batch run: {policy} {micro} ({micro / largest['none']:.1f}x none)")
EOF
    ;;
  *)
    echo "usage: bench/activation_checkpointing.sh speed [micro] [steps] [rounds] | capacity policy:m1,m2 ..." >&2
    exit 2
    ;;
esac
