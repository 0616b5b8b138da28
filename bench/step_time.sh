#!/usr/bin/env bash
# The step-time model (docs/step_time.md) against measured runs on this machine: GPT-2 124M and
# 350M, 2 ranks × 1 thread, micro-batch 4 × 64 tokens, stages 0–3, fp32 unless given.
#
# 1. Measures this machine's rates: the Gloo collectives (bench/comm_bench.cpp), the fused Adam
#    with both cores busy (bench/optim_bench.cpp) and the device FLOP/s from the forward and
#    backward time of a stage-0 run (no communication inside them without overlap_comm).
# 2. Trains each preset at each stage and takes the median step time of the timed steps.
# 3. Predicts each with `zerotrain estimate --time`, once with the cpu-box preset's rates and once
#    with the rates just measured, and prints predicted beside measured with the error.
#
# Rounds alternate the stages so that machine noise hits all of them alike; each figure is the
# median over the rounds' timed steps.
#
# Usage: bench/step_time.sh [presets="gpt2-124m gpt2-350m"] [precision=fp32] [steps=5] [rounds=2]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
presets=${1:-gpt2-124m gpt2-350m} precision=${2:-fp32} steps=${3:-5} rounds=${4:-2}
warmup=2
bin=build/bin
# OUT_DIR keeps the measurements (logs, per-step CSVs); with REUSE=1 a kept OUT_DIR is only
# predicted again (after a change to the model), not measured again.
if [ -n "${OUT_DIR:-}" ]; then out=$OUT_DIR; mkdir -p "$out"; else out=$(mktemp -d); trap 'rm -rf "$out"' EXIT; fi
bf16=false; [ "$precision" = bf16 ] && bf16=true

if [ "${REUSE:-0}" != 1 ]; then
echo "measuring the collectives and the optimizer..." >&2
"$bin/comm_bench" 256 > "$out/comm.md"
"$bin/optim_bench" 100 3 > "$out/optim.md"

for preset in $presets; do
  cat > "$out/$preset.json" <<JSON
{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 1, "wall_clock_breakdown": true,
 "bf16": {"enabled": $bf16},
 "model": {"preset": "$preset"}, "data": {"source": "embedded", "sequence_length": 64},
 "train": {"steps": $((steps + warmup)), "threads": 1, "log_dir": "$out"}, "csv_monitor": {"enabled": true}}
JSON
  for round in $(seq "$rounds"); do
    for stage in 0 1 2 3; do
      echo "round $round: training $preset at stage $stage..." >&2
      "$bin/zerotrain" train "$out/$preset.json" --nproc 2 --set "zero_optimization.stage=$stage" \
        > "$out/log-$preset-$stage-$round.txt" 2>&1
      cp "$out/zerotrain.csv" "$out/steps-$preset-$stage-$round.csv"
    done
  done
done
fi

python3 - "$out" "$bin/zerotrain" "$precision" "$warmup" "$rounds" $presets <<'PY'
import csv, glob, json, re, statistics, subprocess, sys
out, cli, precision, warmup, rounds, presets = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:]

def table_rows(path):
    rows = []
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 3: rows.append(cells)
    return rows

# Gloo: a gather's bus bandwidth from the largest broadcast-per-rank all_gather; the reduction's
# from the largest native all_reduce of the run's dtype (2 ranks: bus = algorithm bandwidth).
dtype = "fp32" if precision == "fp32" else "bf16"
comm = table_rows(f"{out}/comm.md")
def algbw(op, path):
    vals = [(int(r[4]), float(r[6])) for r in comm if r[1] == op and r[2] == dtype and r[3] == path]
    return max(vals)[1] * 1e9
gather_bus = algbw("all_gather", "default: broadcast per rank") / 2
reduce_bus = algbw(f"all_reduce sum", "native")
reduce_factor = reduce_bus / gather_bus
# The fused Adam with 2 threads: what two ranks stepping at once get, shared.
optim = [r for r in table_rows(f"{out}/optim.md") if r[0] == "2" and r[1] == "zerotrain AdamW"]
adam_rate = float(optim[0][5]) * 1e9 / 2  # parameters/s per rank
memory_bandwidth = adam_rate * (28 if precision == "fp32" else 32)

def breakdown(preset, stage):
    # Medians of wall_clock_breakdown's forward, backward and step seconds over the timed steps.
    parts = ([], [], [])
    for r in range(1, rounds + 1):
        for line in open(f"{out}/log-{preset}-{stage}-{r}.txt"):
            m = re.search(r"step (\d+)/\d+ .*ms/step fwd (\d+) bwd (\d+) step (\d+)", line)
            if m and int(m.group(1)) > warmup:
                for k in range(3): parts[k].append(int(m.group(k + 2)) / 1e3)
    return [statistics.median(p) for p in parts]

def measured_step(preset, stage):
    times = []
    for r in range(1, rounds + 1):
        steps = list(csv.DictReader(open(f"{out}/steps-{preset}-{stage}-{r}.csv")))
        times += [float(steps[i]["elapsed_seconds"]) - float(steps[i - 1]["elapsed_seconds"]) for i in range(warmup, len(steps))]
    return statistics.median(times)

def estimate(preset, stage, extra):
    cmd = [cli, "estimate", "--cluster", "cpu-box", "--preset", preset, "--seq", "64", "--micro-batch", "4",
           "--stage", str(stage), "--precision", precision, "--time", "--json"] + extra
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

# Device FLOP/s from the first preset at stage 0: forward and backward's FLOPs (the model's own
# count: the estimate at 1 FLOP/s and unbounded memory) over their measured time less the
# elementwise kernels' share at the measured memory bandwidth.
first = presets[0]
flops = estimate(first, 0, ["--rate", "device_flops_fp32=1", "--rate", "device_flops_16bit=1",
                            "--rate", "device_memory_bandwidth=1e18"])
forward_flops = next(t["seconds"] for t in flops["step_time"]["terms"] if t["name"] == "forward compute")
with_bw = estimate(first, 0, ["--rate", "device_flops_fp32=1e18", "--rate", "device_flops_16bit=1e18",
                              "--rate", f"device_memory_bandwidth={memory_bandwidth}"])
elementwise = next(t["seconds"] for t in with_bw["step_time"]["terms"] if t["name"] == "forward compute")
# Forward and backward together (the model's 3 passes): on some kernels backward runs slower per
# FLOP than forward (bf16 here), and the step needs both.
fwd, bwd, _ = breakdown(first, 0)
device_flops = 3 * forward_flops / (fwd + bwd - 3 * elementwise)
flops_key = "device_flops_fp32" if precision == "fp32" else "device_flops_16bit"
measured_rates = [a for kv in [f"{flops_key}={device_flops}", f"device_memory_bandwidth={memory_bandwidth}",
                               f"intra_node_bandwidth={gather_bus}", f"reduce_bandwidth_factor={reduce_factor}",
                               f"host_adam_rate={2 * adam_rate}"] for a in ("--rate", kv)]
preset_rates = estimate(first, 0, [])["rates"]

print(f"Rates measured here (2 ranks × 1 thread): device {device_flops / 1e9:.1f} GFLOP/s ({precision}), "
      f"memory {memory_bandwidth / 1e9:.1f} GB/s per rank (fused Adam {adam_rate / 1e9:.2f} G parameters/s), "
      f"Gloo gather {gather_bus / 1e9:.2f} GB/s bus, all-reduce {reduce_bus / 1e9:.2f} GB/s "
      f"(reduce factor {reduce_factor:.2f}); the cpu-box preset has "
      f"{preset_rates['device_flops_fp32' if precision == 'fp32' else 'device_flops_16bit'] / 1e9:.0f} GFLOP/s, "
      f"{preset_rates['device_memory_bandwidth'] / 1e9:.0f} GB/s, {preset_rates['intra_node_bandwidth'] / 1e9:.2f} GB/s "
      f"and factor {preset_rates['reduce_bandwidth_factor']:.2f}.")
print()
print(f"| model | stage | measured step (s) | measured forward / backward / step (s) | predicted, cpu-box preset (s) | error | "
      f"predicted, rates measured here (s) | error | predicted compute / optimizer / exposed communication (s) |")
print("|---|---|---|---|---|---|---|---|---|")
worst = 0
for preset in presets:
    for stage in range(4):
        m = measured_step(preset, stage)
        p = estimate(preset, stage, [])["step_time"]
        h = estimate(preset, stage, measured_rates)["step_time"]
        worst = max(worst, abs(p["total_seconds"] / m - 1))
        f, b, st = breakdown(preset, stage)
        print(f"| {preset} | {stage} | {m:.3f} | {f:.2f} / {b:.2f} / {st:.2f} | {p['total_seconds']:.3f} | {100 * (p['total_seconds'] / m - 1):+.1f}% | "
              f"{h['total_seconds']:.3f} | {100 * (h['total_seconds'] / m - 1):+.1f}% | "
              f"{p['compute']:.2f} / {p['optimizer']:.2f} / {p['exposed']:.2f} |")
print()
print(f"largest error of the preset's prediction: {100 * worst:.1f}%")
PY
