#!/usr/bin/env bash
# Checkpoint save and load time and throughput at N = 1 and 2 ranks, against a plain sequential
# write (with fsync) and read of the same number of bytes by one process.
# Usage: bench/checkpoint_io.sh [preset] [stage]       (files go under build/, removed at the end)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
preset=${1:-gpt2-350m} stage=${2:-2}
out=$(mktemp -d -p "$PWD/build" checkpoint-io.XXXXXX)
trap 'rm -rf "$out"' EXIT
cat > "$out/config.json" <<JSON
{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 1000,
 "zero_optimization": {"stage": $stage},
 "model": {"preset": "$preset"}, "data": {"source": "embedded", "sequence_length": 64},
 "train": {"threads": 1, "log_dir": "$out"}, "csv_monitor": {"enabled": false}}
JSON
echo "$preset, stage $stage, files under build/ (same disk as the baseline)"
echo
echo "| ranks | checkpoint (GB) | save (s) | save GB/s | load (s) | load GB/s | plain write+fsync (s) | write GB/s | plain read (s) | read GB/s | save / plain write | load / plain read |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
for n in 1 2; do
  build/bin/zerotrain train "$out/config.json" --nproc "$n" --steps 1 --save-dir "$out/ckpt-$n" > "$out/save-$n.log"
  build/bin/zerotrain train "$out/config.json" --nproc "$n" --steps 2 --resume "$out/ckpt-$n" > "$out/load-$n.log"
  save=$(sed -n 's/.*GB in \([0-9.]*\) s.*/\1/p' "$out/save-$n.log")
  load=$(sed -n 's/.*loaded in \([0-9.]*\) s.*/\1/p' "$out/load-$n.log")
  bytes=$(du -sb "$out/ckpt-$n/step-1" | cut -f1)
  rm -rf "$out/ckpt-$n"
  python3 - "$out/plain" "$bytes" "$n" "$save" "$load" <<'PY'
import os, sys, time
path, size, n, save, load = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
chunk = b"\x5a" * (64 << 20)
t0 = time.perf_counter()
with open(path, "wb") as f:
    left = size
    while left > 0:
        f.write(chunk[:min(left, len(chunk))])
        left -= min(left, len(chunk))
    f.flush()
    os.fsync(f.fileno())
write = time.perf_counter() - t0
t0 = time.perf_counter()
with open(path, "rb") as f:
    while f.read(64 << 20):
        pass
read = time.perf_counter() - t0
os.remove(path)
gb = size / 1e9
print(f"| {n} | {gb:.2f} | {save:.2f} | {gb / save:.2f} | {load:.2f} | {gb / load:.2f} | {write:.2f} | {gb / write:.2f} | "
      f"{read:.2f} | {gb / read:.2f} | {save / write:.2f} | {load / read:.2f} |")
PY
done
