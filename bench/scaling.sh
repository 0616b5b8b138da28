#!/usr/bin/env bash
# The scaling picture (docs/benchmarks.md "Scaling with model size"): tokens/s and peak RSS per
# rank against model size, at each ZeRO stage, on 2 local ranks × 1 thread, micro-batch 4 × 64
# tokens. A configuration runs when the memory estimate (zerotrain estimate, the same one the run
# prints) says two ranks of it fit in 90% of this machine's memory: with the default heap policy
# when a quarter above the estimate still fits (a margin for the heap beyond the estimate,
# docs/memory.md "The heap policy"), else with train.retain_freed_memory "never".
# Otherwise its row gives the estimate alone: where that stage stops fitting. Writes
# docs/scaling.csv (rows of presets not measured in this run are kept from the previous file) and
# draws docs/scaling.png from it (bench/scaling_plot.py, matplotlib pinned beside the torch wheel).
# Usage: [PRESETS="tiny small gpt2-124m gpt2-350m gpt2-774m"] [STAGES="0 1 2 3"] bench/scaling.sh [timed steps] [fp32|bf16]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
steps=${1:-2} precision=${2:-fp32}
warmup=1
bin=build/bin
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bf16=false; [ "$precision" = bf16 ] && bf16=true
mem_total=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) * 1024 ))
budget=$(python3 -c "print(int(0.9 * $mem_total / 2))")  # bytes per rank
csv=docs/scaling.csv
echo "preset,parameters,stage,precision,fits,heap,tokens_per_second,step_seconds,peak_rss_bytes,estimate_bytes" > "$csv.partial"
for preset in ${PRESETS:-tiny small gpt2-124m gpt2-350m gpt2-774m}; do
  cat > "$out/config.json" <<JSON
{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 1000,
 "bf16": {"enabled": $bf16},
 "model": {"preset": "$preset"}, "data": {"source": "embedded", "sequence_length": 64},
 "train": {"steps": $((steps + warmup)), "threads": 1, "log_dir": "$out"}, "csv_monitor": {"enabled": true}}
JSON
  for stage in ${STAGES:-0 1 2 3}; do
    "$bin/zerotrain" estimate "$out/config.json" --stage "$stage" --device cpu --devices-per-node 2 --json \
      > "$out/estimate.json"
    read -r params estimate < <(python3 -c "
import json, sys
e = json.load(open('$out/estimate.json'))
print(e['inputs']['parameters'], e['per_device']['total'])")
    if [ "$estimate" -gt "$budget" ]; then
      echo "$preset,$params,$stage,$precision,false,,,,,$estimate" >> "$csv.partial"
      echo "$preset stage $stage: estimated $((estimate >> 20)) MiB per rank, over the $((budget >> 20)) MiB budget: not run" >&2
      continue
    fi
    heap=bounded
    [ $((estimate + estimate / 4)) -gt "$budget" ] && heap=never
    "$bin/zerotrain" train "$out/config.json" --nproc 2 --set "zero_optimization.stage=$stage" \
      --set "train.retain_freed_memory=$heap" --summary "$out/summary.json" > "$out/train.log" 2>&1 ||
      { tail -n 20 "$out/train.log" >&2; exit 1; }
    python3 - "$out" "$preset" "$params" "$stage" "$precision" "$warmup" "$estimate" "$heap" >> "$csv.partial" <<'PY'
import csv, json, sys
out, preset, params, stage, precision, warmup, estimate, heap = sys.argv[1:9]
warmup = int(warmup)
summary = json.load(open(f"{out}/summary.json"))
steps = list(csv.DictReader(open(f"{out}/zerotrain.csv")))
t0, t1 = float(steps[warmup - 1]["elapsed_seconds"]), float(steps[-1]["elapsed_seconds"])
step = (t1 - t0) / (len(steps) - warmup)
peak = max(rank["peak_rss_bytes"] for rank in summary["ranks"])
print(f"{preset},{params},{stage},{precision},true,{heap},{2 * 4 * 64 / step:.1f},{step:.3f},{peak},{estimate}")
PY
    echo "$preset stage $stage: $(tail -n 1 "$csv.partial")" >&2
  done
done
# Rows of the presets and stages not measured now come from the previous file.
python3 - "$csv" "$csv.partial" <<'PY'
import csv, os, sys
old_path, new_path = sys.argv[1], sys.argv[2]
new_rows = list(csv.DictReader(open(new_path)))
fields = list(new_rows[0].keys()) if new_rows else None
measured = {(r["preset"], r["stage"], r["precision"]) for r in new_rows}
kept = []
if os.path.exists(old_path):
    for r in csv.DictReader(open(old_path)):
        if (r["preset"], r["stage"], r["precision"]) not in measured:
            kept.append(r)
rows = sorted(kept + new_rows, key=lambda r: (int(r["parameters"]), r["precision"], int(r["stage"])))
with open(new_path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields or list(rows[0].keys()))
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in w.fieldnames})
PY
mv "$csv.partial" "$csv"
cpu="$(lscpu | sed -n 's/^Model name: *//p'); flags:$(for f in avx2 avx512f avx512_bf16 amx_tile; do grep -qw "$f" /proc/cpuinfo && printf ' %s' "$f"; done; true)"
source bench/plot_env.sh
plot_install
plot_env
python3 bench/scaling_plot.py "$csv" docs/scaling.png "$cpu, 2 ranks × 1 thread, $precision, micro-batch 4 × 64; budget $((budget >> 20)) MiB per rank"
python3 - "$csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
gib = 2 ** 30
print("| preset | parameters | stage | heap policy | tokens/s | step (s) | peak RSS per rank (GiB) | estimate per rank (GiB) |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    size = f"| {r['preset']} | {int(r['parameters']) / 1e6:.1f}M | {r['stage']} |"
    if r["fits"] == "true":
        print(f"{size} {r['heap']} | {r['tokens_per_second']} | {r['step_seconds']} | "
              f"{int(r['peak_rss_bytes']) / gib:.2f} | {int(r['estimate_bytes']) / gib:.2f} |")
    else:
        print(f"{size} - | does not fit | - | - | {int(r['estimate_bytes']) / gib:.2f} |")
PY
echo
echo "CPU: $cpu; memory $((mem_total >> 30)) GiB"
