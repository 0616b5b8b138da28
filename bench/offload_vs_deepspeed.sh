#!/usr/bin/env bash
# The largest GPT each system trains on this machine with ZeRO offload: zerotrain against
# DeepSpeed 0.19.8 (CPU accelerator, Gloo, its libaio async I/O), same preset, stage, precision,
# micro-batch, sequence length, offload settings and 2 ranks. Presets are tried in the order given
# (give them in increasing size); a system stops at its first failure (killed for memory, or an
# error). Each run is watched by bench/memwatch.py: killed when its process tree's RSS passes the
# cap, or reported as killed by the kernel's OOM killer. Systems alternate on each preset.
#
# Usage: bench/offload_vs_deepspeed.sh [--presets "tiny small"] [--steps 3] [--stage 3]
#          [--precision fp32|bf16] [--offload-optimizer nvme] [--offload-param nvme]
#          [--micro-batch 1] [--seq 64] [--threads 1] [--cap-gib 0.9×RAM] [--nvme-dir build/bench-swap]
#          [--systems "zerotrain deepspeed"] [--set key=value ...]
#   --set applies to both systems' configurations (zerotrain reads DeepSpeed's keys), e.g.
#   --set zero_optimization.sub_group_size=100000000
#   ZEROTRAIN=path/to/zerotrain selects the binary (default build/bin/zerotrain).
# DeepSpeed is installed on first use into $ZT_DEPS_DIR (bench/deepspeed_env.sh).
# Example (the figures in docs/benchmarks.md):
#   bench/offload_vs_deepspeed.sh --presets "gpt2-124m gpt2-350m gpt2-774m gpt2-1.5b gpt-2.7b" \
#     --precision bf16 --stage 3 --offload-optimizer nvme --offload-param nvme --cap-gib 22
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
presets="tiny small" steps=3 stage=3 precision=fp32 offload_optimizer=nvme offload_param=nvme
micro=1 seq=64 threads=1 nvme_root=build/bench-swap systems="zerotrain deepspeed"
cap_gib=$(awk '/^MemTotal:/ {printf "%.1f", $2 * 0.9 / 1048576}' /proc/meminfo)
sets=()
command_line="bench/offload_vs_deepspeed.sh $*"
while (($#)); do
  case $1 in
    --presets) presets=$2 ;; --steps) steps=$2 ;; --stage) stage=$2 ;; --precision) precision=$2 ;;
    --offload-optimizer) offload_optimizer=$2 ;; --offload-param) offload_param=$2 ;;
    --micro-batch) micro=$2 ;; --seq) seq=$2 ;; --threads) threads=$2 ;; --cap-gib) cap_gib=$2 ;;
    --nvme-dir) nvme_root=$2 ;; --systems) systems=$2 ;; --set) sets+=("$2") ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift 2
done
[ "$stage" = 3 ] || offload_param=none  # parameters are offloaded at stage 3 only, in both systems
zerotrain=${ZEROTRAIN:-build/bin/zerotrain}
cap_bytes=$(python3 -c "print(int(float('$cap_gib') * 2**30))")
mkdir -p "$nvme_root"
nvme_root=$(cd "$nvme_root" && pwd)  # absolute: the ranks and DeepSpeed get it in their configurations
out=$(mktemp -d -p "$nvme_root" offload-vs-ds.XXXXXX)
# KEEP_RUNS=1 keeps the run directories (each system's log) and prints where they are.
if [ "${KEEP_RUNS:-0}" = 1 ]; then
  trap 'echo "runs kept in $out" >&2' EXIT
else
  trap 'rm -rf "$out"' EXIT
fi
records="$out/records.jsonl"
: > "$records"

if [[ " $systems " == *" deepspeed "* ]]; then
  source bench/deepspeed_env.sh
  ds_install
fi
if [[ " $systems " == *" zerotrain "* ]] && [ ! -x "$zerotrain" ]; then
  echo "no zerotrain binary at $zerotrain: build it (cmake --build build --target zerotrain_cli) or set ZEROTRAIN" >&2
  exit 2
fi

run_zerotrain() {  # preset run_dir nvme_dir
  local preset=$1 run=$2 nvme=$3 bf16=false
  [ "$precision" = bf16 ] && bf16=true
  python3 - "$run/config.json" <<PY
import json, sys
zero = {"stage": $stage, "offload_optimizer": {"device": "$offload_optimizer"}}
if "$offload_optimizer" == "nvme": zero["offload_optimizer"]["nvme_path"] = "$nvme"
if $stage == 3:
    # As bench/deepspeed_offload.py sets it for DeepSpeed: the swap buffers hold the largest tensor.
    sys.path.insert(0, "bench")
    from offload_common import PRESETS
    v, _, _, _, c = PRESETS["$preset"]
    zero["offload_param"] = {"device": "$offload_param"}
    if "$offload_param" != "none": zero["offload_param"]["buffer_size"] = max(100_000_000, v * c)
    if "$offload_param" == "nvme": zero["offload_param"]["nvme_path"] = "$nvme"
json.dump({"train_micro_batch_size_per_gpu": $micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 1,
           "bf16": {"enabled": $( [ "$bf16" = true ] && echo True || echo False )}, "zero_optimization": zero,
           "model": {"preset": "$preset"}, "data": {"source": "embedded", "sequence_length": $seq},
           "train": {"steps": $steps, "threads": $threads, "log_dir": "$run"}, "csv_monitor": {"enabled": True}},
          open(sys.argv[1], "w"), indent=1)
PY
  local set_args=()
  for s in "${sets[@]}"; do set_args+=(--set "$s"); done
  python3 bench/memwatch.py --cap-bytes "$cap_bytes" --result "$run/watch.json" --disk-dir "$nvme" --log "$run/log" -- \
    "$zerotrain" train "$run/config.json" --nproc 2 --summary "$run/summary.json" "${set_args[@]}" > "$run/log" 2>&1 || true
}

run_deepspeed() {  # preset run_dir nvme_dir
  local preset=$1 run=$2 nvme=$3 port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local set_args=()
  for s in "${sets[@]}"; do set_args+=(--set "$s"); done
  OMP_NUM_THREADS=$threads python3 bench/memwatch.py --cap-bytes "$cap_bytes" --result "$run/watch.json" \
    --disk-dir "$nvme" --log "$run/log" -- \
    python3 -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$port" \
    bench/deepspeed_offload.py --preset "$preset" --steps "$steps" --stage "$stage" --precision "$precision" \
    --micro-batch "$micro" --seq "$seq" --threads "$threads" --offload-optimizer "$offload_optimizer" \
    --offload-param "$offload_param" --nvme-path "$nvme" "${set_args[@]}" > "$run/log" 2>&1 || true
}

declare -A stopped=()
for preset in $presets; do
  for system in $systems; do
    meta=(preset="$preset" stage="$stage" precision="$precision" offload_optimizer="$offload_optimizer"
          offload_param="$offload_param" cap_gib="$cap_gib")
    if [ -n "${stopped[$system]:-}" ]; then
      continue
    fi
    run="$out/$system-$preset"
    nvme="$run/nvme"
    mkdir -p "$nvme"
    echo "$(date +%T) $system $preset: running" >&2
    "run_$system" "$preset" "$run" "$nvme"
    python3 bench/offload_common.py record "$system" --dir "$run" --meta "${meta[@]}" >> "$records"
    status=$(tail -n 1 "$records" | python3 -c 'import json,sys; print(json.load(sys.stdin)["status"])')
    echo "$(date +%T) $system $preset: $status" >&2
    if [ "$status" != ok ]; then
      stopped[$system]=1
      echo "---- last lines of the $system $preset log:" >&2
      grep -v '^[a-z_0-9.]* *= ' "$run/log" | tail -n 15 >&2 || true
    fi
    rm -rf "$nvme"
  done
done

echo "Command: \`$command_line\`"
echo
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(awk '/^MemTotal:/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo) RAM;" \
  "swap files under $nvme_root ($(df -h --output=source "$nvme_root" | tail -n 1)); DeepSpeed ${ds_version:-not run}," \
  "2 ranks × $threads thread(s), micro-batch $micro × $seq tokens, $steps steps (s/step: median without the first)," \
  "memory cap ${cap_gib} GiB for the process tree${sets:+; --set ${sets[*]}}"
echo
python3 bench/offload_common.py peer-table "$records"
