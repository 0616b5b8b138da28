#!/usr/bin/env bash
# Fine-tuning a Llama-shaped model with ZeRO-3 and offload on this machine: zerotrain's command line
# against DeepSpeed 0.19.8 fine-tuning transformers' LlamaForCausalLM, from the same Hugging Face
# directory, on the same jsonl file with the same tokenizer, with the same DeepSpeed configuration
# file (zerotrain reads DeepSpeed's keys; DeepSpeed's side drops zerotrain's "model", "data" and
# "train" blocks). 2 ranks, bf16, AdamW, micro-batch 1, sequence --seq, optimizer state on NVMe
# (files under the work directory, sub-groups of 2e7 parameters), parameters offloaded as
# --offload-param says. DeepSpeed's side loads the model whole on each rank in bf16, then
# deepspeed.initialize partitions it.
#
# What it makes, under the work directory (kept between runs; the model is made once per size):
#   model-SIZE/  config.json + model.safetensors (transformers' LlamaForCausalLM, seeded random
#                weights, fp32) and tokenizer.json (a byte-level BPE trained by `tokenizers` on
#                synthetic text, vocabulary within the model's). SIZE 1b is the shape of zerotrain's
#                llama-1b preset (Llama 3.2 1B: 16 layers of 2048, 32 heads over 8 kv heads, SwiGLU
#                8192, vocabulary 128256, tied, llama3 rope scaling); tiny is a 2-layer model of 64.
#   sft.jsonl    synthetic prompt/response pairs
#   runs/TIME/   config.json, each system's log, memwatch result and the records
# Each system runs under bench/memwatch.py: killed when its process tree's memory passes the cap,
# and recorded (killed at the cap, OOM killer, error with its line) instead of stopping the script.
# s/step is the median of the steps after the first (the warm-up).
#
# Usage: bench/llama_finetune.sh [--size 1b|tiny] [--steps 3] [--seq 256] [--threads 1]
#          [--offload-optimizer nvme|cpu] [--offload-param cpu|nvme|none] [--examples 400]
#          [--cap-gib 0.9×RAM] [--work-dir build/bench-llama] [--systems "zerotrain deepspeed"]
#          [--set key=value ...]
#   --set applies to the shared configuration file, e.g. --set zero_optimization.sub_group_size=100000000
#   ZEROTRAIN=path/to/zerotrain selects the binary (default build/bin/zerotrain).
# Example (the figures in the results): bench/llama_finetune.sh --size 1b --steps 3 --seq 256
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
size=1b steps=3 seq=256 threads=1 offload_optimizer=nvme offload_param=cpu examples=400
work=build/bench-llama systems="zerotrain deepspeed"
cap_gib=$(awk '/^MemTotal:/ {printf "%.1f", $2 * 0.9 / 1048576}' /proc/meminfo)
sets=()
command_line="bench/llama_finetune.sh $*"
die() { echo "llama_finetune: $*" >&2; exit 2; }
while (($#)); do
  case $1 in
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    --size|--steps|--seq|--threads|--offload-optimizer|--offload-param|--examples|--cap-gib|--work-dir|--systems|--set) ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  (($# >= 2)) || die "$1 needs a value (see --help)"
  case $1 in
    --size) size=$2 ;; --steps) steps=$2 ;; --seq) seq=$2 ;; --threads) threads=$2 ;;
    --offload-optimizer) offload_optimizer=$2 ;; --offload-param) offload_param=$2 ;;
    --examples) examples=$2 ;; --cap-gib) cap_gib=$2 ;; --work-dir) work=$2 ;; --systems) systems=$2 ;;
    --set) sets+=("$2") ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift 2
done
case $size in tiny|1b) ;; *) die "--size: expected 1b or tiny, found '$size'" ;; esac
case $offload_optimizer in cpu|nvme) ;; *) die "--offload-optimizer: expected nvme or cpu, found '$offload_optimizer'" ;; esac
case $offload_param in cpu|nvme|none) ;; *) die "--offload-param: expected cpu, nvme or none, found '$offload_param'" ;; esac
for v in steps seq threads examples; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "--$v: expected a positive integer, found '${!v}'"
done
((steps >= 2)) || die "--steps: expected at least 2 (1 warm-up + timed steps), found $steps"
[[ $cap_gib =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--cap-gib: expected a number of GiB, found '$cap_gib'"
for s in $systems; do
  case $s in zerotrain|deepspeed) ;; *) die "--systems: expected zerotrain and/or deepspeed, found '$s'" ;; esac
done
for s in "${sets[@]}"; do [[ $s == *=* ]] || die "--set expects key=value, found '$s'"; done
zerotrain=${ZEROTRAIN:-build/bin/zerotrain}
if [[ " $systems " == *" zerotrain "* ]] && [ ! -x "$zerotrain" ]; then
  die "no zerotrain binary at $zerotrain: build it (cmake --build build --target zerotrain_cli) or set ZEROTRAIN"
fi
cap_bytes=$(python3 -c "print(int(float('$cap_gib') * 2**30))")

mkdir -p "$work"
work=$(cd "$work" && pwd)  # absolute: the configuration names its files
stamp=$(date -u +%Y%m%dT%H%M%S)
out="$work/runs/$size-$stamp"
mkdir -p "$out"
echo "$(date -u +%T) runs in $out" >&2

# Python: transformers + tokenizers (scripts/python_deps.sh) for every step, DeepSpeed's
# environment (bench/deepspeed_env.sh) in front when DeepSpeed runs.
hf_site=$(scripts/python_deps.sh 2>"$out/python_deps.log" | tail -n 1) || {
  tail -n 15 "$out/python_deps.log" >&2; die "transformers could not be installed (scripts/python_deps.sh)"; }
if [[ " $systems " == *" deepspeed "* ]]; then
  source bench/deepspeed_env.sh
  if ! ds_install cpu_adam async_io >"$out/ds_install.log" 2>&1; then
    tail -n 15 "$out/ds_install.log" >&2
    die "DeepSpeed $ds_version could not be installed (bench/deepspeed_env.sh)"
  fi
  ds_env
  export PYTHONPATH="$PYTHONPATH:$hf_site"
else
  export PYTHONPATH="$hf_site${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONNOUSERSITE=1
fi

# 1. The model directory, made once per size.
model="$work/model-$size"
if [ -s "$model/tokenizer.json" ] && [ -s "$model/config.json" ] && ls "$model"/*.safetensors >/dev/null 2>&1; then
  echo "$(date -u +%T) model: reusing $model" >&2
else
  echo "$(date -u +%T) model: making $model (transformers, seeded random weights)" >&2
  rm -rf "$model.tmp"
  OMP_NUM_THREADS=$(nproc) python3 bench/llama_finetune.py model --size "$size" --out "$model.tmp" >&2 \
    || die "making the model directory failed"
  mv "$model.tmp" "$model"
fi
params=$(python3 bench/llama_finetune.py params "$model")

# 2. The fine-tuning data.
data="$work/sft.jsonl"
python3 bench/llama_finetune.py data --out "$data" --examples "$examples"

# 3. One configuration for both systems; the swap files go under the work directory (on disk).
nvme="$work/swap"
set_args=()
for s in "${sets[@]}"; do set_args+=(--set "$s"); done
python3 bench/llama_finetune.py config --out "$out/config.json" --model-dir "$model" --data "$data" --seq "$seq" \
  --steps "$steps" --threads "$threads" --run-dir "$out/zerotrain" --nvme-dir "$nvme" \
  --offload-optimizer "$offload_optimizer" --offload-param "$offload_param" "${set_args[@]}"

# 4. Each system under the memory watch.
run_zerotrain() {  # run_dir
  OMP_NUM_THREADS=$threads python3 bench/memwatch.py --cap-bytes "$cap_bytes" --result "$1/watch.json" \
    --disk-dir "$nvme" --log "$1/log" -- \
    "$zerotrain" train "$out/config.json" --nproc 2 --device cpu --summary "$1/summary.json" > "$1/log" 2>&1 || true
}
run_deepspeed() {  # run_dir
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  OMP_NUM_THREADS=$threads python3 bench/memwatch.py --cap-bytes "$cap_bytes" --result "$1/watch.json" \
    --disk-dir "$nvme" --log "$1/log" -- \
    python3 -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$port" \
    bench/llama_finetune.py train --config "$out/config.json" > "$1/log" 2>&1 || true
}
records="$out/records.jsonl"
: > "$records"
for system in $systems; do
  run="$out/$system"
  mkdir -p "$run"
  rm -rf "$nvme" && mkdir -p "$nvme"
  echo "$(date -u +%T) $system: running ($steps steps)" >&2
  "run_$system" "$run"
  python3 bench/offload_common.py record "$system" --dir "$run" --meta model="llama-$size" params="$params" \
    cap_gib="$cap_gib" >> "$records"
  status=$(tail -n 1 "$records" | python3 -c 'import json,sys; print(json.load(sys.stdin)["status"])')
  echo "$(date -u +%T) $system: $status" >&2
  if [ "$status" != ok ]; then
    echo "---- last lines of the $system log ($run/log):" >&2
    grep -v '^[a-z_0-9.]* *= ' "$run/log" | tail -n 15 >&2 || true
  fi
  rm -rf "$nvme"
done

# 5. The table.
flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|avx512f|avx512_bf16|amx_tile' | tr '\n' ' ' | sed 's/ $//')
echo "Command: \`$command_line\`"
echo
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(awk '/^MemTotal:/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo) RAM;" \
  "flags: ${flags:-none of avx2/avx512f/avx512_bf16/amx_tile}"
echo
echo "Setup: llama-$size ($params parameters) from $model, 2 ranks × $threads thread(s), ZeRO stage 3, bf16, AdamW," \
  "micro-batch 1 × $seq tokens, optimizer $offload_optimizer, parameters $offload_param, $steps steps" \
  "(s/step: median without the first), memory cap $cap_gib GiB for the process tree${sets:+; --set ${sets[*]}}." \
  "Configuration and logs: $out"
echo
python3 bench/llama_finetune.py table "$records" | tee "$out/table.md"
