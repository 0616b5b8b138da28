#!/usr/bin/env bash
# BERT MLM pre-training speed: `zerotrain train` (model.type bert) against Hugging Face
# transformers' BertForPreTraining trained in PyTorch (bench/hf_bert_train.py: DDP over Gloo,
# torch.optim.AdamW, bf16 through torch.autocast), same preset, micro-batch, sequence length,
# ranks and threads per rank, and the same work per step: both mask 15% and predict the NSP label.
# Rounds alternate between the two programs so that noise hits both alike; the table gives the
# median tokens/s of each and the ratio. bf16 runs only where the CPU has avx512_bf16 (else fp32
# alone, said so).
# Usage: bench/bert_vs_transformers.sh [rounds] [preset] [micro_batch] [steps]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=${1:-2} preset=${2:-bert-base} micro=${3:-8} steps=${4:-6}
warmup=2 seq=128 world=2 threads=1
source scripts/python_deps.sh
hf_install >/dev/null || { echo "bert_vs_transformers: transformers could not be installed (scripts/python_deps.sh)" >&2; exit 1; }
bin=build/bin
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
precisions=(fp32)
grep -qw avx512_bf16 /proc/cpuinfo && precisions+=(bf16) || echo "this CPU has no avx512_bf16: fp32 only" >&2
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'); flags: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')" >&2

zerotrain_rate() {  # precision -> tokens/s over the timed steps (the per-step CSV's elapsed column)
  local precision=$1
  cat > "$out/config.json" <<JSON
{"train_micro_batch_size_per_gpu": $micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}, "steps_per_print": 1000,
 "bf16": {"enabled": $([ "$precision" = bf16 ] && echo true || echo false)},
 "model": {"type": "bert", "preset": "$preset"}, "data": {"source": "embedded", "sequence_length": $seq},
 "train": {"steps": $((steps + warmup)), "threads": $threads, "log_dir": "$out"}, "csv_monitor": {"enabled": true}}
JSON
  "$bin/zerotrain" train "$out/config.json" --nproc "$world" --device cpu >"$out/zerotrain.log" 2>&1 ||
    { cat "$out/zerotrain.log" >&2; exit 1; }
  python3 - "$out/zerotrain.csv" "$warmup" "$((world * micro * seq))" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
w, tokens = int(sys.argv[2]), int(sys.argv[3])
t0, t1 = float(rows[w - 1]["elapsed_seconds"]), float(rows[-1]["elapsed_seconds"])
print(tokens * (len(rows) - w) / (t1 - t0))
PY
}

transformers_rate() {
  PYTHONPATH=$(hf_pythonpath) PYTHONNOUSERSITE=1 HF_HUB_OFFLINE=1 python3 bench/hf_bert_train.py --preset "$preset" \
    --micro-batch "$micro" --seq "$seq" --steps "$steps" --warmup "$warmup" --threads "$threads" --world "$world" \
    --precision "$1" | tail -n 1 | python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["tokens_per_second"])'
}

declare -A zt hf
for precision in "${precisions[@]}"; do
  for r in $(seq "$rounds"); do
    zt[$precision]+="$(zerotrain_rate "$precision") "
    hf[$precision]+="$(transformers_rate "$precision") "
    echo "round $r $precision: zerotrain $(echo ${zt[$precision]} | awk '{print $NF}') tok/s, transformers $(echo ${hf[$precision]} | awk '{print $NF}') tok/s" >&2
  done
done
args=()
for precision in "${precisions[@]}"; do args+=("$precision" "${zt[$precision]}" "${hf[$precision]}"); done
python3 - "$preset" "$micro" "$seq" "$world" "$threads" "${args[@]}" <<'PY'
import statistics, sys
preset, micro, seq, world, threads = sys.argv[1:6]
rest = sys.argv[6:]
print(f"| {preset} MLM+NSP, {world} ranks × {threads} thread, micro-batch {micro} × {seq} | zerotrain tokens/s | transformers tokens/s | ratio |")
print("|---|---|---|---|")
for i in range(0, len(rest), 3):
    precision = rest[i]
    z = statistics.median(float(x) for x in rest[i + 1].split())
    h = statistics.median(float(x) for x in rest[i + 2].split())
    print(f"| {precision} | {z:.0f} | {h:.0f} | {z / h:.2f} |")
PY
