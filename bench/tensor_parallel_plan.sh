#!/usr/bin/env bash
# The planner's tensor-parallel pick against its best unsplit configuration, measured: GPT-2 350M
# (vocabulary 50304) on 4 ranks x 1 thread, fp32, AdamW, global batch 4 of `seq` tokens.
# `zerotrain estimate --plan --json` (the cpu-box rates, 4 CPU devices) names both; each is then
# trained for `steps` steps. Prints the command, the CPU, and a markdown table of the predicted
# and measured seconds per step (median over the steps after the first) and their ratios, with
# each run's peak RSS per rank.
#
#   bench/tensor_parallel_plan.sh [steps=4] [seq=256]
#
# ZEROTRAIN=path selects the binary (default build/bin/zerotrain).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
steps=${1:-4}
seq=${2:-256}
command_line="bench/tensor_parallel_plan.sh $*"
zerotrain=${ZEROTRAIN:-build/bin/zerotrain}
work=$(mktemp -d "${TMPDIR:-/tmp}/zt-tensor-parallel-plan.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "command: $command_line"
echo "cpu: $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}'); flags:" \
  "$(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"

cat > "$work/base.json" <<EOF
{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
 "model": {"preset": "gpt2-350m", "vocab_size": 50304},
 "data": {"source": "embedded", "sequence_length": $seq},
 "train": {"steps": $steps, "seed": 1, "threads": 1}}
EOF
"$zerotrain" estimate "$work/base.json" --cluster cpu-box --devices-per-node 4 --device cpu --plan --json \
  > "$work/plan.json" 2> /dev/null
# The pick, and the fastest candidate without tensor parallelism: their keys and predictions.
python3 - "$work" <<'EOF' > "$work/choices"
import json, sys
plan = json.load(open(f"{sys.argv[1]}/plan.json"))
pick = plan["fitting"][0]
unsplit = min((c for c in plan["fitting"] if c["tensor_parallel"] == 1), key=lambda c: c["step_time"]["total_seconds"])
for name, c in (("pick", pick), ("unsplit", unsplit)):
    print(name, c["tensor_parallel"], c["stage"], c["micro_batch"], c["gradient_accumulation_steps"],
          str(c["overlap_comm"]).lower(), c["activation_checkpointing"], c["step_time"]["total_seconds"])
EOF
cat "$work/choices" >&2

while read -r name t stage micro accumulation overlap recompute predicted; do
  python3 - "$work" "$name" "$t" "$stage" "$micro" "$accumulation" "$overlap" "$recompute" <<'EOF'
import json, sys
work, name, t, stage, micro, accumulation, overlap, recompute = sys.argv[1:]
config = json.load(open(f"{work}/base.json"))
config.update({"train_micro_batch_size_per_gpu": int(micro), "gradient_accumulation_steps": int(accumulation),
               "zero_optimization": {"stage": int(stage), "overlap_comm": overlap == "true"},
               "tensor_parallel": {"autotp_size": int(t)},
               "activation_checkpointing": {"policy": recompute}})
config["train"]["log_dir"] = f"{work}/logs-{name}"
json.dump(config, open(f"{work}/{name}.config.json", "w"))
EOF
  echo "$name: T=$t, stage $stage, micro-batch $micro x $accumulation, $steps steps" >&2
  "$zerotrain" train "$work/$name.config.json" --nproc 4 --summary "$work/$name.json" > "$work/$name.log" 2>&1 ||
    { tail -5 "$work/$name.log" >&2; exit 1; }
done < "$work/choices"

python3 - "$work" <<'EOF'
import csv, json, sys, statistics
work = sys.argv[1]
choices = {line.split()[0]: line.split()[1:] for line in open(f"{work}/choices")}
rows = {}
for name in ("unsplit", "pick"):
    t, stage, micro, accumulation, overlap, recompute, predicted = choices[name]
    summary = json.load(open(f"{work}/{name}.json"))
    with open(f"{work}/logs-{name}/zerotrain.csv") as f:
        elapsed = [float(r["elapsed_seconds"]) for r in csv.DictReader(f)]
    measured = statistics.median(b - a for a, b in zip(elapsed, elapsed[1:]))
    peak = max(r["peak_rss_bytes"] for r in summary["ranks"])
    label = f"T = {t} x DP = {4 // int(t)}, stage {stage}, micro-batch {micro} x {accumulation}" + \
            (", overlap_comm" if overlap == "true" else "") + (f", {recompute} recomputation" if recompute != "none" else "")
    rows[name] = (label, float(predicted), measured, peak)
print("\n| plan | layout | predicted s/step | measured s/step | peak RSS per rank |")
print("|---|---|---|---|---|")
for name, (label, predicted, measured, peak) in rows.items():
    print(f"| {'pick' if name == 'pick' else 'fastest unsplit'} | {label} | {predicted:.2f} | {measured:.2f} | {peak / 2**30:.2f} GiB |")
p, u = rows["pick"], rows["unsplit"]
print(f"\npick / fastest unsplit: predicted {p[1] / u[1]:.2f}x, measured {p[2] / u[2]:.2f}x")
EOF
