#!/usr/bin/env bash
# ZeRO stages side by side on 2 ranks: step time, tokens/s, peak RSS per rank and per-rank
# model-state bytes against the formula of docs/design.md "Memory per parameter". Rounds alternate
# the variants so that machine noise hits all of them alike; the table reports medians and ratios to
# the first variant.
# Usage: [VARIANTS="0 1 2"] bench/zero_stages.sh [rounds] [preset] [steps] [precision fp32|bf16] [--set overrides...]
# A variant is a stage, optionally with overrides of its own: "3:zero_optimization.stage3_prefetch_bucket_size=0".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=${1:-2} preset=${2:-gpt2-124m} steps=${3:-6} precision=${4:-fp32}
shift $(( $# < 4 ? $# : 4 ))
warmup=2
bin=build/bin
out=$(mktemp -d)
bf16=false; [ "$precision" = bf16 ] && bf16=true
cat > "$out/config.json" <<JSON
{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 1000,
 "bf16": {"enabled": $bf16},
 "model": {"preset": "$preset"}, "data": {"source": "embedded", "sequence_length": 64},
 "train": {"steps": $((steps + warmup)), "threads": 1, "log_dir": "$out"}, "csv_monitor": {"enabled": true}}
JSON
sets=()
for s in "$@"; do sets+=(--set "$s"); done
variants=(${VARIANTS:-0 1 2})
for r in $(seq "$rounds"); do
  for v in "${!variants[@]}"; do
    variant=${variants[$v]}
    stage=${variant%%:*}
    own=()
    if [[ $variant == *:* ]]; then IFS=',' read -ra extra <<< "${variant#*:}"; for e in "${extra[@]}"; do own+=(--set "$e"); done; fi
    "$bin/zerotrain" train "$out/config.json" --nproc 2 --set "zero_optimization.stage=$stage" "${sets[@]}" "${own[@]}" \
      --summary "$out/summary-$v-$r.json" >/dev/null
    cp "$out/zerotrain.csv" "$out/steps-$v-$r.csv"
    echo "round $r variant $variant done" >&2
  done
done
python3 - "$out" "$rounds" "$warmup" "$preset" "$precision" "${variants[@]}" <<'PY'
import csv, json, statistics, sys
out, rounds, warmup, preset, precision = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
variants = sys.argv[6:]
rows = {}
for stage in range(len(variants)):
    step_times, rates, peaks, summary = [], [], [], None
    for r in range(1, rounds + 1):
        summary = json.load(open(f"{out}/summary-{stage}-{r}.json"))
        steps = list(csv.DictReader(open(f"{out}/steps-{stage}-{r}.csv")))
        t0, t1 = float(steps[warmup - 1]["elapsed_seconds"]), float(steps[-1]["elapsed_seconds"])
        step_time = (t1 - t0) / (len(steps) - warmup)
        step_times.append(step_time)
        rates.append(2 * 4 * 64 / step_time)  # 2 ranks × micro-batch 4 × 64 tokens
        peaks.append(max(rank["peak_rss_bytes"] for rank in summary["ranks"]))
    rows[stage] = (statistics.median(step_times), statistics.median(rates), max(peaks), summary)
gib = 1024 ** 3
base = rows[0][0]
print(f"{preset}, {precision}, 2 ranks × 1 thread, micro-batch 4 × 64 tokens, median of {rounds} rounds "
      f"× {len(steps) - warmup} timed steps")
print()
print(f"| variant | step time (s) | vs {variants[0]} | tokens/s | peak RSS per rank (GiB) | model states per rank (GiB) | formula (GiB) | measured / formula |")
print("|---|---|---|---|---|---|---|---|")
for stage, (t, rate, peak, s) in rows.items():
    measured = s["ranks"][0]["model_state_bytes"]["total"]
    formula = s["model_state_formula_bytes"]["total"]
    print(f"| {variants[stage]} | {t:.3f} | {t / base:.3f} | {rate:.0f} | {peak / gib:.2f} | {measured / gib:.3f} | "
          f"{formula / gib:.3f} | {measured / formula:.4f} |")
PY
