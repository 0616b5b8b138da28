#!/usr/bin/env bash
# The step-time model (docs/step_time.md) against figures DeepSpeed's ZeRO publications report,
# each with the inputs the publication states (and, where it does not, the assumption named in
# the table). Predictions only: no GPU is needed. Prints a markdown table.
#
# Usage: [RATES="overlap=0.5 device_flops_16bit=50T"] bench/step_time_published.sh
#   RATES changes the presets' rates for every row (to see how a figure depends on one).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 - build/bin/zerotrain "${RATES:-}" <<'PY'
import json, subprocess, sys
cli = sys.argv[1]
extra = [a for kv in sys.argv[2].split() for a in ("--rate", kv)]

def predict(args):
    out = subprocess.run([cli, "estimate", "--time", "--json"] + args + extra, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)["step_time"]

def gpt(layers, hidden, heads, seq, vocab=50257):
    return ["--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads), "--seq", str(seq),
            "--vocab", str(vocab), "--set", f"model.context_length={seq}"]

# Each row: what, published TFLOP/s per GPU, arguments, inputs in words.
gbps = lambda line_rate: f"inter_node_bandwidth={0.85 * line_rate / 8:.4g}GB/s"  # 85% of the line rate, as the presets
rows = [
    ("ZeRO-2, 100B on 400 V100 (25 DGX-2, 800 Gb/s)", 38,
     ["--cluster", "dgx2-v100", "--nodes", "25"] + gpt(125, 8192, 64, 1024) +
     ["--stage", "2", "--precision", "fp16", "--micro-batch", "32", "--activation-checkpointing", "full",
      "--tensor-parallel", "16"],
     "125 × 8192, seq 1024, Megatron tensor parallel 16 within a node, micro-batch 32 per data-parallel rank, full recomputation (DeepSpeed's 100B script)"),
    ("ZeRO-2, 170B on 400 V100", 21,
     ["--cluster", "dgx2-v100", "--nodes", "25"] + gpt(212, 8192, 64, 1024) +
     ["--stage", "2", "--precision", "fp16", "--micro-batch", "32", "--activation-checkpointing", "full",
      "--tensor-parallel", "16"],
     "212 × 8192; batch not published (assumed as at 100B); activation checkpoints offloaded to CPU in the published run, not modelled"),
    ("ZeRO-Offload, 10B on one V100", 40,
     ["--cluster", "dgx2-v100", "--devices-per-node", "1"] + gpt(50, 4096, 32, 1024) +
     ["--stage", "2", "--precision", "fp16", "--micro-batch", "10", "--set", "gradient_accumulation_steps=51",
      "--offload-optimizer", "cpu", "--activation-checkpointing", "full"],
     "50 × 4096, seq 1024, micro-batch 10, accumulation to ~512 sequences, optimizer on the DGX-2's CPUs"),
    ("ZeRO-Offload, 13B on one V100", 34.5,
     ["--cluster", "dgx2-v100", "--devices-per-node", "1"] + gpt(65, 4096, 32, 1024) +
     ["--stage", "2", "--precision", "fp16", "--micro-batch", "4", "--set", "gradient_accumulation_steps=128",
      "--offload-optimizer", "cpu", "--activation-checkpointing", "full"],
     "65 × 4096, micro-batch 4, accumulation to 512 (34.5 read off the paper's chart)"),
    ("DeepSpeed BERT-large, one V100, seq 128", 64,
     ["--cluster", "dgx2-v100", "--devices-per-node", "1"] + gpt(24, 1024, 16, 128, 30522) +
     ["--stage", "0", "--precision", "fp16", "--micro-batch", "140", "--set", "gradient_accumulation_steps=10"],
     "24 × 1024, micro-batch 140, accumulation 10; DeepSpeed's fused transformer kernels"),
    ("DeepSpeed BERT-large, one V100, seq 512", 52.7,
     ["--cluster", "dgx2-v100", "--devices-per-node", "1"] + gpt(24, 1024, 16, 512, 30522) +
     ["--stage", "0", "--precision", "fp16", "--micro-batch", "20", "--set", "gradient_accumulation_steps=10"],
     "micro-batch 20, accumulation 10"),
]
for tokens, micro in (("2K", 4), ("1K", 2)):
    for rate, published in ((800, {"2K": 47}), (400, {"2K": 40, "1K": 25}), (200, {"2K": 37}), (100, {"2K": 26, "1K": 14})):
        if tokens not in published: continue
        rows.append((f"ZeRO-3, 18B on 384 V100 (24 DGX-2), {rate} Gb/s, {tokens} tokens/GPU", published[tokens],
                     ["--cluster", "dgx2-v100", "--nodes", "24", "--rate", gbps(rate)] + gpt(40, 6144, 32, 512) +
                     ["--stage", "3", "--precision", "fp16", "--micro-batch", str(micro), "--activation-checkpointing", "full"],
                     f"40 × 6144, seq 512, micro-batch {micro}, full recomputation (ZeRO++'s published baseline)"))

print("| published run | published TFLOP/s per GPU | predicted (recomputation counted) | error | predicted without recomputation | inputs |")
print("|---|---|---|---|---|---|")
for what, published, args, inputs in rows:
    t = predict(args)
    executed, model = t["executed_flops_per_device"] / 1e12, t["model_flops_per_device"] / 1e12
    print(f"| {what} | {published} | {executed:.1f} | {100 * (executed / published - 1):+.0f}% | {model:.1f} | {inputs} |")

# Does hpZ pay? ZeRO-3 with its backward gathers within the node, on the networks above.
print()
print("| ZeRO-3, 18B on 384 V100, 1K tokens/GPU | ZeRO-3 (TFLOP/s) | with hpZ over 16 ranks of a node | gain |")
print("|---|---|---|---|")
for rate in (800, 400, 200, 100):
    base = ["--cluster", "dgx2-v100", "--nodes", "24", "--rate", gbps(rate)] + gpt(40, 6144, 32, 512) + \
           ["--stage", "3", "--precision", "fp16", "--micro-batch", "2", "--activation-checkpointing", "full"]
    a = predict(base)["executed_flops_per_device"] / 1e12
    b = predict(base + ["--hpz-partition-size", "16"])["executed_flops_per_device"] / 1e12
    print(f"| {rate} Gb/s | {a:.1f} | {b:.1f} | {b / a:.2f}× |")
PY
