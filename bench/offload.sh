#!/usr/bin/env bash
# zerotrain's ZeRO-Offload / ZeRO-Infinity figures, each mode printing its command, the
# CPU and a markdown table. Swap files go under a fresh directory in $NVME_DIR (default
# build/bench-swap in the checkout, on the disk that holds it; not /tmp, which may be memory),
# removed at the end; the disk's plain sequential O_DIRECT rate is measured there
# in the same invocation with dd (a $DD_GIB GiB file, default 2).
#
#   bench/offload.sh proof [preset=gpt-2.7b] [steps=5] [--set key=value ...]
#       2 ranks, stage 3, fp32, optimizer state, parameters and gradients on NVMe, micro-batch 1,
#       sequence 64, small sub-groups and buckets, nothing kept in memory beyond them. Peak RSS per rank against a third of RAM, the loss per step,
#       step time split into compute and I/O as the run reports it, peak disk bytes.
#   bench/offload.sh overhead [preset=gpt2-124m] [rounds=2] [steps=6] [--set key=value ...]
#       2 ranks, fp32, stages $STAGES (default "2 3"): no offload, offload_optimizer nvme, nvme +
#       delayed_update, rounds alternating the variants; the two bounds (compute-only step time
#       from the no-offload runs, the step's bytes at the dd rate) and the delayed-update step
#       time's ratio to the larger bound (target ≤ 1.15).
#   bench/offload.sh bytes-per-param [preset=gpt2-124m] [steps=4] [--with-deepspeed] [--set key=value ...]
#       2 ranks, stage 2, fp32: peak RSS per rank with offload_optimizer none, cpu and nvme divided
#       by the parameters, beside the ideal and DeepSpeed's 28 B/parameter; --with-deepspeed also
#       measures DeepSpeed's stage 2 CPU offload on the same preset here (bench/deepspeed_env.sh).
#
# ZEROTRAIN=path selects the binary (default build/bin/zerotrain); KEEP_RUNS=1 keeps the run
# directories. Every run is watched by
# bench/memwatch.py with a cap of $CAP_GIB (default 0.9 × RAM) for its process tree.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode=${1:-}
[ -n "$mode" ] && shift
command_line="bench/offload.sh $mode $*"
zerotrain=${ZEROTRAIN:-build/bin/zerotrain}
nvme_root=${NVME_DIR:-build/bench-swap}
ram_bytes=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) * 1024))
cap_gib=${CAP_GIB:-$(awk '/^MemTotal:/ {printf "%.1f", $2 * 0.9 / 1048576}' /proc/meminfo)}
cap_bytes=$(python3 -c "print(int(float('$cap_gib') * 2**30))")

positional=() sets=() with_deepspeed=0
while (($#)); do
  case $1 in
    --set) sets+=(--set "$2"); shift 2 ;;
    --with-deepspeed) with_deepspeed=1; shift ;;
    *) positional+=("$1"); shift ;;
  esac
done
set -- "${positional[@]}"

case $mode in
  proof|overhead|bytes-per-param) ;;
  *) sed -n '2,26p' "$0"; exit 2 ;;
esac
if [ ! -x "$zerotrain" ]; then
  echo "no zerotrain binary at $zerotrain: build it (cmake --build build --target zerotrain_cli) or set ZEROTRAIN" >&2
  exit 2
fi
mkdir -p "$nvme_root"
nvme_root=$(cd "$nvme_root" && pwd)  # absolute: the ranks and DeepSpeed get it in their configurations
out=$(mktemp -d -p "$nvme_root" offload-bench.XXXXXX)
# KEEP_RUNS=1 keeps the run directories (logs, summaries, CSVs) and prints where they are.
if [ "${KEEP_RUNS:-0}" = 1 ]; then
  trap 'echo "runs kept in $out" >&2' EXIT
else
  trap 'rm -rf "$out"' EXIT
fi

cpu_line() {
  echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(awk '/^MemTotal:/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo) RAM;" \
    "swap directory on $(df --output=source "$nvme_root" | tail -n 1) ($(df -h --output=avail "$nvme_root" | tail -n 1 | tr -d ' ') free); zerotrain $zerotrain"
}

# Plain sequential O_DIRECT write then read of a DD_GIB file in the swap directory's file system.
measure_dd() {  # result.json
  local f="$out/dd.bin" gib=${DD_GIB:-2}
  local w r
  w=$(dd if=/dev/zero of="$f" bs=1M count=$((gib * 1024)) oflag=direct conv=fsync 2>&1 | tail -n 1)
  r=$(dd if="$f" of=/dev/null bs=1M iflag=direct 2>&1 | tail -n 1)
  rm -f "$f"
  python3 - "$1" "$w" "$r" <<'PY'
import json, re, sys
def rate(line):
    m = re.match(r"(\d+) bytes .* copied, ([0-9.]+) s", line)
    if not m:
        sys.exit(f"dd printed '{line}'")
    return int(m.group(1)) / float(m.group(2))
json.dump({"write_bps": rate(sys.argv[2]), "read_bps": rate(sys.argv[3])}, open(sys.argv[1], "w"))
print(f"dd O_DIRECT: write {rate(sys.argv[2]) / 1e9:.2f} GB/s, read {rate(sys.argv[3]) / 1e9:.2f} GB/s", file=sys.stderr)
PY
}

# A zerotrain configuration: preset stage precision micro seq steps [extra JSON merged into
# zero_optimization] [extra JSON merged into the top level]
write_config() {  # path preset stage micro seq steps zero_extra_json [top_extra_json]
  python3 - "$@" <<'PY'
import json, sys
path, preset, stage, micro, seq, steps, extra = sys.argv[1:8]
top = json.loads(sys.argv[8]) if len(sys.argv) > 8 else {}
zero = {"stage": int(stage)}
zero.update(json.loads(extra))
config = {"train_micro_batch_size_per_gpu": int(micro), "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 1, "wall_clock_breakdown": True,
          "bf16": {"enabled": False}, "zero_optimization": zero,
          "model": {"preset": preset}, "data": {"source": "embedded", "sequence_length": int(seq)},
          "train": {"steps": int(steps), "threads": 1}, "csv_monitor": {"enabled": True}}
config.update(top)
json.dump(config, open(path, "w"), indent=1)
PY
}

# Runs zerotrain on 2 ranks under the watchdog and appends its record to a JSONL file.
run_zt() {  # run_dir config records meta... [-- extra zerotrain args]
  local run=$1 config=$2 records=$3
  shift 3
  local meta=() extra=()
  while (($#)) && [ "$1" != -- ]; do meta+=("$1"); shift; done
  (($#)) && shift
  extra=("$@")
  mkdir -p "$run/nvme"
  python3 bench/memwatch.py --cap-bytes "$cap_bytes" --result "$run/watch.json" --disk-dir "$run/nvme" --log "$run/log" -- \
    "$zerotrain" train "$config" --nproc 2 --summary "$run/summary.json" --set "train.log_dir=$run" \
    "${sets[@]}" "${extra[@]}" > "$run/log" 2>&1 || true
  python3 bench/offload_common.py record zerotrain --dir "$run" --meta "${meta[@]}" cap_gib="$cap_gib" >> "$records"
  local status
  status=$(tail -n 1 "$records" | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["status"], r.get("detail", "")[:200])')
  echo "$(date +%T) $(basename "$run"): $status" >&2
  rm -rf "$run/nvme"
}

header() {
  echo "Command: \`$command_line\`"
  echo
  cpu_line
  echo
}

case $mode in
proof)
  preset=${1:-gpt-2.7b} steps=${2:-5}
  nvme="$out/proof/nvme"
  mkdir -p "$out/proof"
  measure_dd "$out/dd-before.json"
  # What stays in memory is what the proof is about: parameter shards all on NVMe (max_in_cpu 0)
  # read ahead through two shard buffers that must hold the largest tensor (the token
  # embedding), gradients written to NVMe as each bucket is reduced, the optimizer streaming
  # small sub-groups with reads and writes pipelined, and each block released after its use.
  # AdamW at 2e-5 after a linear warm-up over three steps: from random weights the first full
  # Adam steps at that rate raise the loss of a 2.7B model before it falls.
  largest=$(python3 -c "
import sys; sys.path.insert(0, 'bench'); from offload_common import PRESETS
v, t, l, h, c = PRESETS['$preset']; print(max(100_000_000, v * c))")
  write_config "$out/proof/config.json" "$preset" 3 1 64 "$steps" "{
    \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"$nvme\", \"nvme_gradients\": true,
      \"pipeline_read\": true, \"pipeline_write\": true},
    \"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \"$nvme\", \"buffer_size\": $largest,
      \"buffer_count\": 2, \"max_in_cpu\": 0},
    \"sub_group_size\": ${SUB_GROUP_SIZE:-5000000}, \"reduce_bucket_size\": ${BUCKET_SIZE:-20000000},
    \"allgather_bucket_size\": ${BUCKET_SIZE:-20000000}, \"stage3_prefetch_bucket_size\": ${BUCKET_SIZE:-20000000},
    \"stage3_max_reuse_distance\": 0}" '{
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5,
      "warmup_num_steps": 3, "warmup_type": "linear"}}}'
  run_zt "$out/proof" "$out/proof/config.json" "$out/records.jsonl" preset="$preset" stage=3 precision=fp32 \
    offload_optimizer=nvme offload_param=nvme
  measure_dd "$out/dd-after.json"
  header
  echo "$preset, 2 ranks × 1 thread, stage 3, fp32 AdamW (lr 2e-5 after a 3-step linear warm-up), micro-batch 1 × 64" \
    "tokens; optimizer state, parameters and gradients on NVMe (sub_group_size ${SUB_GROUP_SIZE:-5000000}, buckets" \
    "${BUCKET_SIZE:-20000000} elements, 2 parameter buffers, max_in_cpu 0, pipelined reads and writes), $steps steps"
  echo
  python3 bench/offload_common.py proof-table "$out/records.jsonl" "$ram_bytes" "$out/dd-before.json" "$out/dd-after.json"
  ;;

overhead)
  preset=${1:-gpt2-124m} rounds=${2:-2} steps=${3:-6} warmup=1
  stages=(${STAGES:-2 3})
  # nvme+delayed: the delayed parameter update from the second (first timed) step on.
  variants=(${VARIANTS:-none nvme nvme+delayed})
  measure_dd "$out/dd-0.json"
  for r in $(seq "$rounds"); do
    for stage in "${stages[@]}"; do
      for v in "${variants[@]}"; do
        run="$out/s$stage-$v-$r"
        mkdir -p "$run"
        case $v in
          none) zero='{}' ;;
          nvme) zero="{\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"$run/nvme\", \"pipeline_read\": true, \"pipeline_write\": true}, \"sub_group_size\": ${SUB_GROUP_SIZE:-10000000}}" ;;
          nvme+delayed) zero="{\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"$run/nvme\", \"pipeline_read\": true, \"pipeline_write\": true, \"delayed_update\": true, \"delayed_update_after\": $warmup}, \"sub_group_size\": ${SUB_GROUP_SIZE:-10000000}}" ;;
        esac
        write_config "$run/config.json" "$preset" "$stage" 4 64 $((steps + warmup)) "$zero"
        run_zt "$run" "$run/config.json" "$out/records.jsonl" preset="$preset" stage="$stage" precision=fp32 \
          variant="$v" round="$r" offload_optimizer="${v%%+*}"
      done
    done
    measure_dd "$out/dd-$r.json"
  done
  header
  echo "$preset, 2 ranks × 1 thread, fp32, micro-batch 4 × 64 tokens, median of $rounds rounds × $steps timed steps" \
    "(the first step of each run untimed), variants alternating within each round"
  echo
  python3 bench/offload_common.py overhead-table "$out/records.jsonl" "$out"/dd-*.json
  ;;

bytes-per-param)
  preset=${1:-gpt2-124m} steps=${2:-4}
  for dev in none cpu nvme; do
    run="$out/bpp-$dev"
    mkdir -p "$run"
    zero='{}'
    [ "$dev" = cpu ] && zero='{"offload_optimizer": {"device": "cpu"}}'
    [ "$dev" = nvme ] && zero="{\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"$run/nvme\", \"pipeline_read\": true, \"pipeline_write\": true}, \"sub_group_size\": ${SUB_GROUP_SIZE:-10000000}}"
    write_config "$run/config.json" "$preset" 2 4 64 "$steps" "$zero"
    run_zt "$run" "$run/config.json" "$out/records.jsonl" preset="$preset" stage=2 precision=fp32 offload_optimizer="$dev"
  done
  if ((with_deepspeed)); then
    source bench/deepspeed_env.sh
    ds_install
    run="$out/bpp-deepspeed-cpu"
    mkdir -p "$run"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    OMP_NUM_THREADS=1 python3 bench/memwatch.py --cap-bytes "$cap_bytes" --result "$run/watch.json" --log "$run/log" -- \
      python3 -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$port" \
      bench/deepspeed_offload.py --preset "$preset" --steps "$steps" --stage 2 --micro-batch 4 --seq 64 \
      --offload-optimizer cpu > "$run/log" 2>&1 || true
    python3 bench/offload_common.py record deepspeed --dir "$run" --meta preset="$preset" stage=2 precision=fp32 \
      offload_optimizer=cpu cap_gib="$cap_gib" >> "$out/records.jsonl"
  fi
  header
  echo "$preset, 2 ranks × 1 thread, stage 2, fp32, micro-batch 4 × 64 tokens, $steps steps"
  echo
  python3 bench/offload_common.py bpp-table "$out/records.jsonl" 2
  ;;
esac
# A refused or failed run has been shown in its table; say so in the exit status too.
if python3 -c 'import json, sys; sys.exit(any(json.loads(l)["status"] != "ok" for l in open(sys.argv[1]) if l.strip()))' "$out/records.jsonl"; then
  exit 0
fi
echo "bench/offload.sh $mode: some runs failed (see the status column)" >&2
exit 1
