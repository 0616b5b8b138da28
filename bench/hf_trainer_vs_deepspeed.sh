#!/usr/bin/env bash
# The Hugging Face Trainer on DeepSpeed 0.19.8 and on zerotrain (its companion distribution standing
# in for DeepSpeed), side by side: bench/hf_trainer_bench.py, a ~100M transformers Llama, 2 CPU ranks
# x 1 intra-op thread under torchrun, the same DeepSpeed configuration ("auto" values filled by the
# Trainer), data and seed. Prints one row per stage: tokens/s over the timed steps, the ratio, the
# step time, the largest rank's peak RSS (VmHWM) and the largest relative loss difference.
# Usage: bench/hf_trainer_vs_deepspeed.sh [--stages "2 3"] [--bf16 1] [--steps 4] [--warmup 1]
#        [--micro 4] [--seq 64] [--work-dir build/bench-hf-trainer]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stages="2 3" bf16=1 steps=4 warmup=1 micro=4 seq=64 work=build/bench-hf-trainer
while [ $# -gt 0 ]; do
  case $1 in
    --stages) stages=$2 ;; --bf16) bf16=$2 ;; --steps) steps=$2 ;; --warmup) warmup=$2 ;;
    --micro) micro=$2 ;; --seq) seq=$2 ;; --work-dir) work=$2 ;;
    *) echo "hf_trainer_vs_deepspeed: unknown argument $1" >&2; exit 2 ;;
  esac
  shift 2
done
[ -f build/python/zerotrain/__init__.py ] || { echo "hf_trainer_vs_deepspeed: build the Python package first (scripts/test.sh or cmake --build build)" >&2; exit 2; }
rm -rf "$work"; mkdir -p "$work"
source bench/deepspeed_env.sh
ds_install fused_adam >"$work/install.log" 2>&1 || { echo "DeepSpeed could not be installed (see $work/install.log)" >&2; exit 1; }
hf_site=$(scripts/python_deps.sh 2>>"$work/install.log" | tail -n 1); hf_site=${hf_site%%:*}
python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$work/companion" \
  python/deepspeed-companion >>"$work/install.log" 2>&1
deps=${ZT_DEPS_DIR:-$HOME/.cache/zerotrain}
cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
echo "Machine: \"$cpu\" ($(grep -m1 -o -w -e avx512_bf16 -e amx_bf16 /proc/cpuinfo | sort -u | tr '\n' ' ')), $(nproc) cores; $(date -u +%F)"
echo "| stage | precision | zerotrain tok/s | DeepSpeed tok/s | ratio | zerotrain step ms | DeepSpeed step ms | peak RSS/rank zerotrain GiB | DeepSpeed GiB | loss max rel diff |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for stage in $stages; do
  spec="{\"stage\": $stage, \"bf16\": $([ "$bf16" = 1 ] && echo true || echo false), \"steps\": $steps, \"warmup\": $warmup, \"micro\": $micro, \"seq\": $seq, \"out_dir\": \"$work/out\"}"
  for side in deepspeed zerotrain; do
    if [ $side = deepspeed ]; then path="$hf_site:$ds_dir/site:$ds_torch_dir"; else path="$work/companion:$PWD/build/python:$hf_site:$ds_torch_dir:$deps/python-tools"; fi
    PYTHONPATH=$path OMP_NUM_THREADS=1 python3 -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 \
      --master_port $((29500 + RANDOM % 2000)) bench/hf_trainer_bench.py "$spec" "$work/s$stage-$side.json" \
      >"$work/s$stage-$side.log" 2>&1 || { echo "stage $stage: $side failed (see $work/s$stage-$side.log)" >&2; exit 1; }
  done
  python3 - "$work/s$stage-deepspeed.json" "$work/s$stage-zerotrain.json" "$stage" "$bf16" "$micro" "$seq" <<'PY'
import json, sys
ds, zt = (json.load(open(p)) for p in sys.argv[1:3])
stage, bf16, micro, seq = sys.argv[3], sys.argv[4] == "1", int(sys.argv[5]), int(sys.argv[6])
def rate(r):
    step = sum(r["times"]) / len(r["times"])
    return r["world"] * micro * seq / step, step * 1000
(zt_tps, zt_ms), (ds_tps, ds_ms) = rate(zt), rate(ds)
diff = max(abs(ds["losses"][k] - zt["losses"][k]) / abs(ds["losses"][k]) for k in ds["losses"])
gib = lambda r: max(r["peak_rss"]) / 2**30
print(f"| {stage} | {'bf16' if bf16 else 'fp32'} | {zt_tps:.0f} | {ds_tps:.0f} | {zt_tps / ds_tps:.2f} | {zt_ms:.0f} | {ds_ms:.0f} "
      f"| {gib(zt):.2f} | {gib(ds):.2f} | {diff:.1e} |")
PY
done
