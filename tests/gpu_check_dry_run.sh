#!/usr/bin/env bash
# The GPU checks' dry run (scripts/gpu-check.sh --dry-run, docs/gpu.md "The GPU checks") for both
# GPUs the check is run on, an H100 80 GB and an H200 141 GB: each must succeed, list every phase
# with the figures of that GPU (the device memory the estimates hold the benchmarks against, the
# peak TFLOPS, the offload preset and the GPT-2 micro-batch the estimates pick) and fit what
# travels to the GPU machine. The estimates run with build/bin/zerotrain (the CPU build), which
# must be built. A few seconds. Run by scripts/test.sh.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

fail() { echo "tests/gpu_check_dry_run.sh: $*" >&2; exit 1; }

[ -x build/bin/zerotrain ] || fail "build/bin/zerotrain is not built: the dry run needs it for the estimates"

# GPU  DEVICE_MEMORY  PEAK  MICRO_BATCHES: the GPT-2 1.5B micro-batches that may be picked. On the
# H200 micro-batch 16 ran (77.3 GiB reserved of 140 GiB); on an 80 GB H100 it would not fit.
cases=("h100 81559MiB 989 8|4" "h200 143771MiB 989 16")
for c in "${cases[@]}"; do
  read -r gpu memory peak batches <<<"$c"
  if ! plan=$(scripts/gpu-check.sh --dry-run --assume-gpu "$gpu" 2>&1); then
    echo "$plan" >&2
    fail "scripts/gpu-check.sh --dry-run --assume-gpu $gpu failed (above)"
  fi
  grep "what travels" <<<"$plan"
  grep -E '^# (device|estimate|NVIDIA)' <<<"$plan"
  for expected in "what travels to the GPU machine" ".gpu-bin/bin/zerotrain" "ZT_TEST_DEVICE=cuda" "device_kernels_test" \
    "device_parity_test" "*OnTheTestDevice*" "estimate configs/gpu_offload.json" "train configs/gpu_offload.json" \
    "configs/gpu_gpt2_1.5b_stage0.json" "configs/gpu_bert_large.json" "gpu-bench.md" \
    "--device-memory $memory" "peak $peak TFLOPS" "[test parity, at most 90s]" "[python, at most 40s]" \
    "PYTHONPATH=.gpu-bin/python" "tests/python/scripts/device_parity.py --device cuda --reference cpu"; do
    grep -qF -- "$expected" <<<"$plan" || fail "--assume-gpu $gpu: the dry run does not mention '$expected'"
  done
  # The picks: a preset and a micro-batch in the commands, not the placeholders P and B.
  grep -qE -- "train configs/gpu_offload.json --device cuda --set model\.preset=(gpt3-13b|gpt3-6\.7b|gpt3-2\.7b|gpt2-1\.5b) " <<<"$plan" ||
    fail "--assume-gpu $gpu: no offload preset picked"
  picked=$(sed -nE 's/.*train configs\/gpu_gpt2_1\.5b_stage0\.json --device cuda --set train_micro_batch_size_per_gpu=([0-9]+) --set gradient_accumulation_steps=([0-9]+) .*/\1 \2/p' <<<"$plan")
  read -r batch accumulation <<<"$picked"
  [[ ${batch:-} =~ ^($batches)$ ]] || fail "--assume-gpu $gpu: GPT-2 micro-batch '${batch:-none}', expected one of $batches"
  ((batch * accumulation == 16)) || fail "--assume-gpu $gpu: micro-batch $batch x $accumulation is not the global batch 16"
  # The CLI phase: train and resume for each model and pinning, generate for the decoders.
  for model in gpt bert llama; do
    for pin in pageable pinned; do
      for step in train resume generate; do
        [ "$model/$step" = bert/generate ] && continue
        grep -qF -- "[cli $model $pin $step, at most" <<<"$plan" || fail "--assume-gpu $gpu: no 'cli $model $pin $step' step"
      done
    done
  done
  ! grep -qF -- "[cli bert pageable generate" <<<"$plan" || fail "--assume-gpu $gpu: a generate for the BERT (an encoder)"
  echo "tests/gpu_check_dry_run.sh: $gpu: passed (GPT-2 micro-batch $batch x $accumulation)"
done
