#!/usr/bin/env bash
# zerotrain against DeepSpeed 0.19.8 (CPU accelerator, Gloo) side by side on this CPU: the same GPT
# preset, initial weights, token batches, configuration file (AdamW, clipping 1.0), micro-batch,
# sequence length, 2 ranks of 1 intra-op thread each, at ZeRO stages 0-3 in fp32 and bf16. Rounds
# alternate between the two systems so that noise hits both alike; the table gives medians over
# rounds. The loss curves must agree: fp32 within 1e-5 relative at every step (the script exits 1
# otherwise), bf16 reported.
#
# Usage: bench/vs_deepspeed.sh [--preset gpt2-124m] [--stages "0 1 2 3"] [--precisions "fp32 bf16"]
#          [--rounds 2] [--steps 6] [--warmup 2] [--micro-batch 4] [--seq 64] [--fronts "cli deepspeed"]
#   --steps are the timed steps, after --warmup untimed ones.
#   --fronts: which of zerotrain's command line (cli), zerotrain's Python package running DeepSpeed's
#   script unchanged (python: bench/deepspeed_train.py with zerotrain standing in for DeepSpeed), the
#   same script training the command line's C++ GPT (cpp: zerotrain.models.GPT, whose losses must
#   equal the command line's bit for bit), and DeepSpeed run. --preset hf-llama-100m trains transformers' LlamaForCausalLM (~106M, seeded
#   weights) by the same script under python and deepspeed (the command line has no Llama).
#   ZEROTRAIN=path/to/zerotrain selects the binary (default build/bin/zerotrain).
# DeepSpeed is installed on first use into $ZT_DEPS_DIR (bench/deepspeed_env.sh); its side is
# bench/deepspeed_train.py, which takes zerotrain's initial weights (`zerotrain export --init`) and
# zerotrain's batch order from the DeepSpeed oracle (tests/oracle/deepspeed_oracle.py).
# bf16 runs only where /proc/cpuinfo has avx512_bf16 (else fp32 alone, said so on stderr).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
preset=gpt2-124m stages="0 1 2 3" precisions="fp32 bf16" rounds=2 steps=6 warmup=2 micro=4 seq=64 fronts="cli deepspeed"
world=2
command_line="bench/vs_deepspeed.sh${1+$(printf " %q" "$@")}"
die() { echo "vs_deepspeed: $*" >&2; exit 2; }
while (($#)); do
  case $1 in
    -h|--help) sed -n '2,23s/^# \{0,1\}//p' "$0"; exit 0 ;;
  esac
  (($# >= 2)) || die "$1 needs a value (see --help)"
  case $1 in
    --preset) preset=$2 ;; --stages) stages=$2 ;; --precisions) precisions=$2 ;; --rounds) rounds=$2 ;;
    --steps) steps=$2 ;; --warmup) warmup=$2 ;; --micro-batch) micro=$2 ;; --seq) seq=$2 ;; --fronts) fronts=$2 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift 2
done
for name in rounds steps micro seq; do
  [[ ${!name} =~ ^[1-9][0-9]*$ ]] || die "--${name/micro/micro-batch} must be a positive integer, got '${!name}'"
done
[[ $warmup =~ ^[0-9]+$ ]] || die "--warmup must be a non-negative integer, got '$warmup'"
for s in $stages; do [[ $s =~ ^[0-3]$ ]] || die "--stages: '$s' is not a ZeRO stage (0 1 2 3)"; done
for p in $precisions; do [[ $p =~ ^(fp32|bf16)$ ]] || die "--precisions: '$p' is neither fp32 nor bf16"; done
[ -n "${stages// /}" ] || die "--stages is empty"
for f in $fronts; do [[ $f =~ ^(cli|python|cpp|deepspeed)$ ]] || die "--fronts: '$f' is not one of cli python cpp deepspeed"; done
(($(wc -w <<<"$fronts") >= 2)) || die "--fronts needs two or more to compare"
hf=0
if [[ $preset == hf-* ]]; then
  hf=1
  [[ " $fronts " != *" cli "* ]] || die "--preset $preset is a transformers model: the command line cannot train it (--fronts \"python deepspeed\")"
fi
context=$(python3 - "$preset" <<'PY'
import sys
sys.path.insert(0, "bench")
from offload_common import PRESETS
if sys.argv[1] == "hf-llama-100m":
    print(1024)
else:
    print(PRESETS[sys.argv[1]][1] if sys.argv[1] in PRESETS else "unknown hf-llama-100m " + " ".join(PRESETS))
PY
)
[[ $context =~ ^[0-9]+$ ]] || die "unknown preset '$preset' (one of: ${context#unknown })"
((seq <= context)) || die "--seq $seq exceeds the context length $context of preset $preset"
zerotrain=${ZEROTRAIN:-build/bin/zerotrain}
[ -x "$zerotrain" ] || die "no zerotrain binary at $zerotrain: build it (cmake --build build --target zerotrain_cli) or set ZEROTRAIN"
zerotrain=$(realpath "$zerotrain")

cpu="$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"  # before OMP_NUM_THREADS, which nproc obeys
echo "CPU: $cpu; flags: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')" >&2
if [[ " $precisions " == *" bf16 "* ]]; then
  if grep -qw avx512_bf16 /proc/cpuinfo; then
    echo "bf16: runs (avx512_bf16 present)" >&2
  else
    echo "bf16: not run: this CPU has no avx512_bf16, fp32 only" >&2
    precisions=$(tr ' ' '\n' <<<"$precisions" | { grep -vx bf16 || true; } | tr '\n' ' ')
  fi
else
  echo "bf16: not requested" >&2
fi
[ -n "${precisions// /}" ] || die "nothing left to run: --precisions had bf16 alone and this CPU cannot run it"

# Both systems on glibc's allocator as it ships, and one intra-op thread per rank.
unset LD_PRELOAD GLIBC_TUNABLES
for v in $(compgen -e | grep '^MALLOC_' || true); do unset "$v"; done
export OMP_NUM_THREADS=1

out=$(mktemp -d "${TMPDIR:-/tmp}/vs-deepspeed.XXXXXX")
trap 'rm -rf "$out"' EXIT
trap 'exit 130' INT TERM

source bench/deepspeed_env.sh
# fused_adam is the one op DeepSpeed's CPU accelerator builds its in-memory AdamW from; cpu_adam and
# async_io serve offload only and take minutes to build on a fresh machine.
if ! ds_install fused_adam >"$out/install.log" 2>&1; then
  echo "vs_deepspeed: DeepSpeed $ds_version could not be installed:" >&2
  tail -n 15 "$out/install.log" >&2
  exit 1
fi
ds_env

if [[ " $fronts " == *" python "* || " $fronts " == *" cpp "* ]]; then
  [ -f build/python/zerotrain/__init__.py ] || die "the Python package is not built (build/python): cmake --build build"
  python_path="$(pwd)/build/python"
fi
if ((hf)); then
  hf_site=$(scripts/python_deps.sh | tail -n 1) || die "transformers could not be installed (scripts/python_deps.sh)"
  export PYTHONPATH="$PYTHONPATH:$hf_site"
fi

python3 bench/deepspeed_train.py data --dir "$out/data"
# The weights every run of both systems starts from: they depend on the preset and train.seed only
# (the transformers models are built from a seed by the script itself).
mkdir -p "$out/init"
python3 bench/deepspeed_train.py config --out "$out/init/config.json" --data "$out/data" --stage 0 --precision fp32 \
  --preset "$preset" --micro-batch "$micro" --seq "$seq" --steps 1 --run-dir "$out/init"
init_args=(--model "$preset")
if ((!hf)); then
  "$zerotrain" export --init "$out/init/config.json" --out "$out/init/weights.safetensors" >"$out/init/export.log" 2>&1 || {
    echo "vs_deepspeed: zerotrain export --init failed:" >&2; tail -n 15 "$out/init/export.log" >&2; exit 1; }
  init_args=(--init "$out/init/weights.safetensors")
fi

# A run that fails is tried once more, so that one stray failure on a shared machine does not
# throw away an hour of rounds (seen once: a DeepSpeed rank aborted, and twelve reruns of the same
# run did not repeat it); a second failure stops the benchmark. Failed attempts' errors are shown.
show_errors() {  # log
  # torchrun's own report ends its log; the rank's error is above it.
  grep -E 'Error|error:|terminate called|what\(\)|Traceback|Killed' "$1" | head -n 15 >&2 || true
  echo "  ... last lines:" >&2
  grep -v '^\s*$' "$1" | tail -n 15 >&2 || true
}
all_present() { local f; for f; do [ -s "$f" ] || return 1; done; }
attempt() {  # system run_dir log command...
  local system=$1 run=$2 log=$3 try stale
  shift 3
  case $system in
    zerotrain) stale=("$run/zerotrain.csv" "$run/summary.json") ;;
    python) stale=("$run/python.json") ;;
    cpp) stale=("$run/cpp.json") ;;
    *) stale=("$run/deepspeed.json") ;;
  esac
  for try in 1 2; do
    rm -f "${stale[@]}"
    "$@" >"$log" 2>&1 && return 0
    # A rank that aborts after the run wrote its result (torch's Gloo teardown at exit: seen under
    # DeepSpeed and under zerotrain's Python package alike, docs/python.md) lost nothing measured.
    if all_present "${stale[@]}" && grep -q 'terminate called without an active exception' "$log"; then
      echo "vs_deepspeed: $system in ${run##*/}: a rank aborted at exit after the result was written; result kept" >&2
      return 0
    fi
    if ((try == 1)); then
      echo "vs_deepspeed: $system failed in ${run##*/} (errors below); trying once more" >&2
      show_errors "$log"
      mv "$log" "$log.1"
    fi
  done
  echo "vs_deepspeed: $system failed twice in ${run##*/}; errors of the second attempt:" >&2
  show_errors "$log"
  exit 1
}

run_zerotrain() {  # run_dir
  attempt zerotrain "$1" "$1/zerotrain.log" \
    "$zerotrain" train "$1/config.json" --nproc "$world" --device cpu --summary "$1/summary.json"
}

run_deepspeed() {  # run_dir [front]: DeepSpeed's script, under DeepSpeed or zerotrain's Python package
  local port front=${2:-deepspeed} name=DeepSpeed result=deepspeed
  [ "$front" != deepspeed ] && name=$front result=$front
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  PYTHONPATH="${python_path:+$python_path:}$PYTHONPATH" attempt "$name" "$1" "$1/$result.log" \
    python3 -m torch.distributed.run --nproc_per_node "$world" --master_addr 127.0.0.1 --master_port "$port" \
    bench/deepspeed_train.py train --config "$1/config.json" "${init_args[@]}" --front "$front" \
    --result "$1/$result.json"
}

runs=()
for stage in $stages; do
  for precision in $precisions; do
    for round in $(seq "$rounds"); do
      run="$out/s$stage-$precision-r$round"
      mkdir -p "$run"
      python3 bench/deepspeed_train.py config --out "$run/config.json" --data "$out/data" --stage "$stage" \
        --precision "$precision" --preset "$preset" --micro-batch "$micro" --seq "$seq" --steps $((warmup + steps)) \
        --run-dir "$run"
      printf '{"model": "%s", "stage": %d, "precision": "%s", "round": %d, "warmup": %d, "world": %d, "micro_batch": %d, "seq": %d}\n' \
        "$preset" "$stage" "$precision" "$round" "$warmup" "$world" "$micro" "$seq" >"$run/meta.json"
      times=""
      for front in $fronts; do
        t0=$SECONDS
        case $front in
          cli) run_zerotrain "$run" ;;
          python) run_deepspeed "$run" python ;;
          cpp) run_deepspeed "$run" cpp ;;
          deepspeed) run_deepspeed "$run" ;;
        esac
        times+=" $front $((SECONDS - t0)) s"
      done
      echo "$(date +%T) stage $stage $precision round $round/$rounds:$times (wall, start-up included)" >&2
      runs+=("$run")
    done
  done
done

echo "Command: \`$command_line\`"
echo
echo "CPU: $cpu; DeepSpeed $ds_version (CPU accelerator, Gloo); fronts: $fronts;" \
  "preset $preset, $world ranks × 1 thread, micro-batch $micro × $seq tokens, $warmup warm-up + $steps timed steps," \
  "medians of $rounds round(s); peak RSS: VmHWM, the largest rank"
echo
python3 bench/deepspeed_train.py table "${runs[@]}"
