#!/usr/bin/env bash
# shellcheck disable=SC2317  # the functions that seem unused run in the phases' `bash -c` (declare -f)
# The GPU checks: one short, prepared run on a machine with one NVIDIA GPU (an H100 80 GB or an
# H200 141 GB; docs/gpu.md). The CUDA binaries are built beforehand on a machine with nvcc and the
# pinned LibTorch (--prepare) and travel with the working tree in .gpu-bin/; the GPU machine only
# runs them: the tests that need a GPU, the CLI on the GPU, then three short benchmarks, each
# phase time-boxed, in order of value. docs/gpu.md says how to use it.
#
#   scripts/gpu-check.sh --prepare        on the build machine: build, strip and stage .gpu-bin/
#   scripts/gpu-check.sh [--out DIR]      on the GPU machine: tests and benchmarks, results in DIR
#   scripts/gpu-check.sh --rerun-failed   on the same GPU machine right after: only what did not pass
#   scripts/gpu-check.sh --dry-run [--assume-gpu h100|h200|'NAME,MiB[,HOST_MiB]']
#                                         prints every command of a run and what would travel; with
#                                         --assume-gpu, with the figures that GPU would get (the
#                                         estimates run with build/bin/zerotrain, the CPU build)
#   scripts/gpu-check.sh --cli-on-cpu     the CLI phase's commands on this machine's CPU build
#                                         (--device cpu, ZT_HOST_STAGING=1), to check them first
#   scripts/gpu-check.sh --fetch-deps     fallback only: .deb files for a build on the GPU machine
#
# The run sizes itself from `nvidia-smi --query-gpu=name,memory.total`: the device memory the
# estimates hold the benchmarks against (the offload benchmark's preset, the GPT-2 micro-batch),
# the host memory (MemTotal of /proc/meminfo, or the cgroup's limit where lower) and the peak
# dense bf16 TFLOPS the report divides by (from the GPU's name). Phases, in order: environment,
# libraries, test kernels, test parity, cli (train, resume, generate per model and pinning), python
# (the Python package training a module on the GPU against the CPU), bench offload, bench
# gpt2-1.5b, bench bert-large, report. Each has its own limit and the limits add up to
# ZT_GPU_CHECK_SECONDS (default 440) and the report's 10 s, so the whole run ends within 7.5
# minutes; a phase that finds no time left is SKIPPED. Without .gpu-bin/ the run first builds on
# the GPU machine (slower: then the later phases may be skipped). Exit status 0 only when every
# phase passed.
# Results (7 files): env.txt, build.log, tests.log, bench.log, summaries.json, gpu-bench.md and
# gpu-check.txt (the verdicts), copied into DIR (default $OUT, else runs/gpu-check/out); the
# working state stays in runs/gpu-check/ for --rerun-failed.
# Settings (environment):
#   ZT_GPU_TEST_FILTER     gtest filter for the GPU tests (default: DeviceKernels.* and every test
#                          named *OnTheTestDevice*)
#   ZT_GPU_OFFLOAD_PRESET  the offload benchmark's preset (default: the largest that `zerotrain
#                          estimate` says fits the GPU's memory and the host's)
#   ZT_GPU_CHECK_SECONDS   the phases' time limit (default 440; the report has 10 s beyond it)
#   ZT_GPU_BUILD_DIR       the build directory of --prepare and of the fallback (default build-gpu)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

usage() { sed -n '3,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

mode=run
rerun=0
assume_gpu=""
out=${OUT:-}
while (($#)); do
  case $1 in
    --dry-run) mode=dry ;;
    --prepare) mode=prepare ;;
    --fetch-deps) mode=fetch ;;
    --cli-on-cpu) mode=cpu_cli ;;
    --rerun-failed) rerun=1 ;;
    --assume-gpu) [ $# -ge 2 ] || { echo "gpu-check: --assume-gpu needs h100, h200 or 'NAME,MiB[,HOST_MiB]'" >&2; exit 2; }
                  assume_gpu=$2; shift ;;
    --assume-gpu=*) assume_gpu=${1#--assume-gpu=} ;;
    --out) [ $# -ge 2 ] || { echo "gpu-check: --out needs a directory" >&2; exit 2; }; out=$2; shift ;;
    --out=*) out=${1#--out=} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (expected --prepare, --dry-run [--assume-gpu GPU], --rerun-failed, --cli-on-cpu, --fetch-deps, --out DIR or --help)" >&2
       exit 2 ;;
  esac
  shift
done
if [ -n "$assume_gpu" ] && [ "$mode" != dry ]; then
  echo "gpu-check: --assume-gpu is for --dry-run (a run sizes itself from nvidia-smi)" >&2
  exit 2
fi

build_dir=${ZT_GPU_BUILD_DIR:-build-gpu}
stage_dir=$root/.gpu-bin            # the staged binaries (git-ignored; carried to the GPU machine)
work=$root/runs/gpu-check           # logs and state of the last run on this machine
deps_dir=$root/.gpu-deps
deps_prefix=/tmp/zt-deps
test_filter=${ZT_GPU_TEST_FILTER:-'DeviceKernels.*:*OnTheTestDevice*-DeviceKernels.BuildFlagAndStubs'}
budget=${ZT_GPU_CHECK_SECONDS:-440}
torch_pinned=$(tr -d '[:space:]' < cmake/torch-version.txt)
offload_presets=(gpt3-13b gpt3-6.7b gpt3-2.7b gpt2-1.5b)  # largest first
travel_limit_mib=64
# The binaries the GPU machine runs: the CLI, the tests that need a GPU, and the Python package's
# extension (with its modules in python/zerotrain beside it).
cli_target=zerotrain_cli
test_targets=(device_kernels_test device_parity_test)
python_targets=(zerotrain_python zerotrain_python_modules)
# What the build needs from Debian beyond a GPU image (fallback build only).
deb_packages=(nlohmann-json3-dev libcli11-dev libgloo-dev libgtest-dev libgmock-dev zlib1g-dev zlib1g libpcre2-dev libpcre2-8-0)

configure_args() {  # TORCH_PREFIX [EXTRA_PREFIX]: the CUDA configuration both builds use
  local prefix=$1
  [ -n "${2:-}" ] && prefix="$1;$2"
  local args=(-S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DZT_CUDA=ON -DZT_BUILD_TESTS=ON -DZT_BUILD_BENCH=OFF
    -DCMAKE_CUDA_ARCHITECTURES=90 -DTORCH_CUDA_ARCH_LIST=9.0 "-DCMAKE_PREFIX_PATH=$prefix")
  command -v ninja >/dev/null 2>&1 && args=(-G Ninja "${args[@]}")
  command -v ccache >/dev/null 2>&1 &&
    args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  printf '%s\n' "${args[@]}"
}

# Bytes of the working tree that a copy to the GPU machine carries: tracked and untracked files
# that git does not ignore, and .gpu-bin/.
travel_bytes() {
  local tree bin=0
  tree=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null || true) |
          awk '{s += $1} END {print s + 0}')
  [ -d "$stage_dir" ] && bin=$(find "$stage_dir" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  echo "$tree $bin"
}

report_travel() {
  local tree bin total
  read -r tree bin <<<"$(travel_bytes)"
  total=$(((tree + bin) / 1048576))
  echo "gpu-check: what travels to the GPU machine: the tree $((tree / 1048576)) MiB + .gpu-bin $((bin / 1048576)) MiB = ${total} MiB (limit ${travel_limit_mib} MiB)"
  ((total < travel_limit_mib))
}

# ---------------------------------------------------------------------------------------------
if [ "$mode" = fetch ]; then
  set -e
  mkdir -p "$deps_dir"
  rm -f "$deps_dir"/*.deb
  (cd "$deps_dir" && apt-get download "${deb_packages[@]}") || {
    apt-get update -qq
    (cd "$deps_dir" && apt-get download "${deb_packages[@]}")
  }
  echo "gpu-check: ${#deb_packages[@]} packages, $(du -sm "$deps_dir" | cut -f1) MiB in .gpu-deps/ (copy it with the tree: the run unpacks them into $deps_prefix)"
  exit 0
fi

if [ "$mode" = prepare ]; then
  set -e
  export PATH="$PATH:/usr/local/cuda/bin"
  command -v nvcc >/dev/null || { echo "gpu-check --prepare: nvcc not found (install the CUDA toolkit)" >&2; exit 1; }
  torch_prefix=$(scripts/bootstrap.sh | tail -n 1)
  mapfile -t args < <(configure_args "$torch_prefix")
  echo "gpu-check: cmake ${args[*]}"
  cmake "${args[@]}" >/dev/null
  echo "gpu-check: building $cli_target ${test_targets[*]} ${python_targets[*]} (CUDA, sm_90)"
  cmake --build "$build_dir" -j"$(nproc)" --target "$cli_target" "${test_targets[@]}" "${python_targets[@]}"
  rm -rf "$stage_dir.partial"
  mkdir -p "$stage_dir.partial/bin" "$stage_dir.partial/tests" "$stage_dir.partial/lib"
  strip -o "$stage_dir.partial/bin/zerotrain" "$build_dir/bin/zerotrain"
  for t in "${test_targets[@]}"; do strip -o "$stage_dir.partial/tests/$t" "$build_dir/tests/$t"; done
  # The Python package as the build lays it out (python/CMakeLists.txt), its extension stripped.
  mkdir -p "$stage_dir.partial/python"
  cp -r "$build_dir/python/zerotrain" "$stage_dir.partial/python/zerotrain"
  find "$stage_dir.partial/python" \( -name '*.in' -o -name __pycache__ \) -prune -exec rm -rf {} +
  for so in "$stage_dir.partial"/python/zerotrain/_C*.so; do strip "$so"; done
  # Shared libraries the GPU machine may lack: everything the binaries load except LibTorch and
  # NVIDIA's (the GPU machine's python3 has the same pinned torch) and the C/C++ runtime.
  torch_lib=$(cd "$torch_prefix/../../lib" && pwd)
  for f in "$stage_dir.partial"/bin/* "$stage_dir.partial"/tests/* "$stage_dir.partial"/python/zerotrain/_C*.so; do
    ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
  done | sort -u | while read -r lib; do
    case $lib in
      "$torch_lib"/*|*/nvidia/*|/usr/local/cuda*) ;;
      */libc.so*|*/libm.so*|*/libdl.so*|*/librt.so*|*/libpthread.so*|*/ld-linux*|*/libstdc++.so*|*/libgcc_s.so*) ;;
      *) cp -L "$lib" "$stage_dir.partial/lib/" ;;
    esac
  done
  {
    echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD -- src include tests CMakeLists.txt || echo ' (with uncommitted changes)')"
    echo "built $(date -u +%FT%TZ) on $(uname -m), torch $torch_pinned, $(nvcc --version | tail -n 1), sm_90"
    (cd "$stage_dir.partial" && find . -type f | sort | xargs sha256sum)
  } >"$stage_dir.partial/manifest.txt"
  rm -rf "$stage_dir"
  mv "$stage_dir.partial" "$stage_dir"
  du -ah "$stage_dir" | sort -k2
  report_travel || { echo "gpu-check --prepare: over the ${travel_limit_mib} MiB that a copy to the GPU machine carries" >&2; exit 1; }
  exit 0
fi

# --- the GPU's figures ------------------------------------------------------------------------------
# The run takes from its GPU the memory that the estimates hold the benchmarks against and the
# peak that the report divides by; the host memory comes from /proc/meminfo.
declare -A known_gpus=(  # --assume-gpu NAME: the line `nvidia-smi --query-gpu=name,memory.total` prints
  [h100]="NVIDIA H100 80GB HBM3,81559" [h200]="NVIDIA H200,143771"
  [h100-pcie]="NVIDIA H100 PCIe,81559" [h100-nvl]="NVIDIA H100 NVL,95830")
assumed_host_mib=128000  # a dry run's host memory unless given: about the 125 GiB the rented machines report
gpu_sized=0 gpu_error="" gpu_name="" gpu_mib="" device_memory="" host_memory="" host_source=""
peak_tflops=989 peak_source="assumed: no GPU name"

trim() { local s=$1; s=${s#"${s%%[![:space:]]*}"}; echo "${s%"${s##*[![:space:]]}"}"; }

peak_of() {  # NAME: the dense bf16 peak of the datasheets (without sparsity) into peak_tflops/peak_source
  case $1 in
    *H100*[Pp][Cc][Ii][Ee]*) peak_tflops=756 peak_source="H100 PCIe datasheet" ;;
    *H100*NVL*) peak_tflops=835 peak_source="H100 NVL datasheet" ;;
    *H100*) peak_tflops=989 peak_source="H100 SXM datasheet" ;;
    *H200*NVL*) peak_tflops=835 peak_source="H200 NVL datasheet" ;;
    *H200*) peak_tflops=989 peak_source="H200 SXM datasheet" ;;
    *) peak_tflops=989 peak_source="assumed: '$1' is not in the table (989 is the H100 SXM's and the H200's)" ;;
  esac
}

host_of_this_machine() {  # host_memory: MemTotal, or the cgroup's memory.max where that is lower
  local kib limit
  kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo 2>/dev/null)
  [[ $kib =~ ^[0-9]+$ ]] || { host_memory="" host_source="no MemTotal in /proc/meminfo"; return 1; }
  host_memory="$((kib / 1024))MiB" host_source="MemTotal of /proc/meminfo"
  limit=$(cat /sys/fs/cgroup/memory.max 2>/dev/null || true)
  if [[ $limit =~ ^[0-9]+$ ]] && ((limit / 1024 < kib)); then
    host_memory="$((limit / 1048576))MiB" host_source="the cgroup's memory.max (below MemTotal)"
  fi
}

set_gpu() {  # "NAME, MiB": the GPU's figures; 1 (with gpu_error) when the line is not that
  local name mib
  name=$(trim "${1%,*}") mib=$(trim "${1##*,}")
  if [[ $1 != *,* || -z $name || ! $mib =~ ^[0-9]+$ ]] || ((mib == 0)); then
    gpu_error="expected 'NAME, MiB' from nvidia-smi, found '$1'"
    return 1
  fi
  gpu_name=$name gpu_mib=$mib device_memory="${mib}MiB"
  peak_of "$name"
  gpu_sized=1
}

size_from_nvidia_smi() {
  local line
  if ! command -v nvidia-smi >/dev/null 2>&1; then gpu_error="nvidia-smi not found"; return 1; fi
  if ! line=$(timeout 10 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits 2>&1); then
    gpu_error="nvidia-smi failed: $(head -n 1 <<<"$line")"
    return 1
  fi
  set_gpu "$(head -n 1 <<<"$line")" || return 1
  host_of_this_machine || { gpu_sized=0; gpu_error=$host_source; return 1; }
}

size_from_assumption() {  # h100 | h200 | h100-pcie | h100-nvl | 'NAME,MiB[,HOST_MiB]'
  local spec=${known_gpus[${1,,}]:-$1} host=$assumed_host_mib
  if [[ $spec =~ ^(.*),[[:space:]]*([0-9]+),[[:space:]]*([0-9]+)$ ]]; then
    spec="${BASH_REMATCH[1]},${BASH_REMATCH[2]}" host=${BASH_REMATCH[3]}
  fi
  set_gpu "$spec" || { gpu_error="--assume-gpu: expected h100, h200, h100-pcie, h100-nvl or 'NAME,MiB[,HOST_MiB]', found '$1'"; return 1; }
  host_memory="${host}MiB" host_source="assumed by --assume-gpu"
}

describe_gpu() {  # one line: the device and the figures the run takes from it
  if ((gpu_sized)); then
    echo "$gpu_name, $gpu_mib MiB: --device-memory $device_memory, --host-memory $host_memory ($host_source), peak $peak_tflops TFLOPS dense bf16 ($peak_source)"
  else
    echo "no GPU figures: $gpu_error"
  fi
}

# --- run, dry run or the CLI phase on the CPU ----------------------------------------------------
prebuilt=0
[ -f "$stage_dir/manifest.txt" ] && prebuilt=1
live=1  # commands run (a run, or --cli-on-cpu); 0: printed (--dry-run)
cli_device=cuda
case $mode in
  dry)
    live=0
    # shellcheck disable=SC2016
    out=${out:-'$OUT'}
    bin_dir='.gpu-bin' ;;
  cpu_cli)
    work=$root/runs/gpu-check-cpu
    bin_dir=$root/build
    cli_device=cpu
    export ZT_HOST_STAGING=1 ;;
esac
if ((live)); then
  mkdir -p "$work" || { echo "gpu-check: cannot create '$work'" >&2; exit 2; }
  out=${out:-$work/out}
  mkdir -p "$out" || { echo "gpu-check: cannot create '$out'" >&2; exit 2; }
  out=$(cd "$out" && pwd)
  if [ "$mode" = run ]; then
    if ((prebuilt)); then bin_dir=$stage_dir; else bin_dir=$root/$build_dir; fi
  fi
fi
cli=$bin_dir/bin/zerotrain
if [ -n "$assume_gpu" ]; then
  size_from_assumption "$assume_gpu" || { echo "gpu-check: $gpu_error" >&2; exit 2; }
fi

start=$(date +%s)
deadline=$((start + budget))
declare -A previous=()  # the last run's verdict per phase (--rerun-failed)
declare -A verdicts=()  # this run's verdict per phase
verdict_state=$work/verdicts.tsv
if ((rerun)) && ((live)); then
  if [ -f "$verdict_state" ]; then
    while IFS=$'\t' read -r name verdict detail; do previous[$name]="$verdict"$'\t'"$detail"; done <"$verdict_state"
  else
    echo "gpu-check: --rerun-failed: no earlier run on this machine ($verdict_state): running everything" >&2
  fi
fi
if ((live)); then
  ((rerun)) || rm -rf "$work"/*.log "$work"/*.json "$work"/*.md "$work"/*.txt "$verdict_state" "$work/cli"
  : >"$verdict_state.new"
fi
failed=0

quote() {  # single quotes around an argument only where a shell needs them
  local a s="" plain='^[-A-Za-z0-9_./:=,+@%$*]+$'
  for a in "$@"; do if [[ $a =~ $plain ]]; then s+="$a "; else s+="'$a' "; fi; done
  echo "${s% }"
}

record() {  # NAME VERDICT DETAIL
  verdicts[$1]=$2
  ((live)) || return 0
  printf '%-28s %-8s %s\n' "$1" "$2" "$3" >>"$work/gpu-check.txt.new"
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$verdict_state.new"
  [ "$2" = PASS ] || failed=1
}

# phase NAME LIMIT LOG COMMAND...: COMMAND with its output appended to LOG, within LIMIT seconds
# and the time left of the budget, less `keep` seconds kept for the phases after it. Returns the
# command's status; 124 when it ran out of time, 125 when skipped, 0 without running when
# --rerun-failed finds it passed before. `shown`, when set, is what a dry run prints instead of
# the command.
shown=""
keep=0
phase() {
  local name=$1 limit=$2 log=$3
  shift 3
  local what=${shown:-$(quote "$@")}
  shown=""
  if ((!live)); then
    echo "+ [$name, at most ${limit}s$( ((keep)) && echo ", less what the ${keep}s of the phases after it need")] $what >>$(basename "$log") 2>&1"
    verdicts[$name]=PASS  # a dry run shows the commands that depend on this one
    return 0
  fi
  if [[ ${previous[$name]:-} == PASS$'\t'* ]]; then
    record "$name" PASS "${previous[$name]#PASS$'\t'} (earlier run)"
    return 0
  fi
  local t=$((deadline - keep - $(date +%s)))
  ((t > limit)) && t=$limit
  if ((t < 5)); then
    record "$name" SKIPPED "no time left of the ${budget}s"
    return 125
  fi
  echo "== [$(date +%H:%M:%S)] $name (at most ${t}s): $what" | tee -a "$log"
  local begin rc=0
  begin=$(date +%s)
  timeout -k 5 "$t" "$@" >>"$log" 2>&1 || rc=$?
  local took=$(($(date +%s) - begin))
  case $rc in
    0) record "$name" PASS "${took}s" ;;
    124|137) record "$name" TIMEOUT "stopped after ${took}s (limit ${t}s), see $(basename "$log")" ;;
    *) record "$name" FAIL "exit $rc after ${took}s, see $(basename "$log")" ;;
  esac
  echo "== [$(date +%H:%M:%S)] $name: exit $rc after ${took}s" | tee -a "$log"
  return "$rc"
}

# The verdicts into gpu-check.txt, the result files into $out; exits 0 only when all passed.
finish() {
  {
    echo "gpu-check: $(($(date +%s) - start))s of ${budget}s$( ((rerun)) && echo ' (--rerun-failed)'); $( [ "$mode" = cpu_cli ] && echo "the CLI phase on the CPU (--cli-on-cpu)" || echo "binaries: $( ((prebuilt)) && echo prebuilt || echo 'built on this machine')")"
    cat "$work/gpu-check.txt.new"
    if ((failed)); then echo "gpu-check: FAILED or incomplete (see the logs named above; --rerun-failed runs those phases again)"
    else echo "gpu-check: all passed"; fi
  } >"$work/gpu-check.txt"
  rm -f "$work/gpu-check.txt.new"
  mv "$verdict_state.new" "$verdict_state"
  local f
  for f in env.txt build.log tests.log bench.log summaries.json gpu-bench.md gpu-check.txt; do
    [ -f "$work/$f" ] && cp "$work/$f" "$out/"
  done
  cat "$work/gpu-check.txt"
  exit $failed
}

# --- the CLI on the GPU -----------------------------------------------------------------------------
# `zerotrain train` at ZeRO stage 3 with the parameters and the optimizer state in host memory
# (offload_param and offload_optimizer "cpu": parameter offload needs the optimizer's), once
# pageable (pin_memory false in both) and once pinned (true), with wall_clock_breakdown, for the
# GPT, the BERT and the Llama of the tiny configs (tensor_parallel 1): 2 steps saved with
# --save-dir, a resume from that checkpoint that continues to step 4 and saves again, and
# `zerotrain generate` from the resumed run's checkpoint (the BERT has no generate: an encoder, no
# decoder to continue a prompt with). Each step is its own verdict, so that one failure hides
# none of the others; a step whose input did not pass is SKIPPED. The steps share the phase's 60 s
# (a few seconds each on a GPU: the process start, a tiny model and a few steps), each within its
# own cap. --cli-on-cpu runs the same commands on the CPU build, with ZT_HOST_STAGING=1 so that
# the CPU run takes the GPU path's host copies, and five times the time (2 cores).
cli_models=(gpt:configs/tiny.json bert:configs/bert_tiny.json llama:configs/llama_tiny.json)
cli_seconds=60 cli_caps=(20 20 10)  # the phase; a train, a resume, a generate
if [ "$mode" = cpu_cli ]; then cli_seconds=300 cli_caps=(100 100 50); fi
cli_prompt="The "

cli_check() {  # SUMMARY FIRST_STEP STEPS LOG: the run saved, printed the breakdown and ran FIRST_STEP+1..STEPS
  local summary=$1 first=$2 steps=$3 log=$4
  grep -q 'ms/step fwd' "$log" || { echo "gpu-check: no wall_clock_breakdown times (ms/step fwd ...) in the output"; return 1; }
  python3 - "$summary" "$first" "$steps" <<'PY'
import json, math, sys
s = json.load(open(sys.argv[1]))
first, steps = int(sys.argv[2]), int(sys.argv[3])
got = (s.get('first_step'), s.get('steps'), len(s.get('losses', [])))
ok = got == (first, steps, steps - first) and all(math.isfinite(l) for l in s['losses'])
print('gpu-check: steps %d..%d, losses %s: %s' % (first + 1, steps, s.get('losses'), 'as expected' if ok else
      'expected first_step %d, steps %d and %d finite losses, found %s' % (first, steps, steps - first, got)))
sys.exit(0 if ok else 1)
PY
}

cli_train() {  # SAVE_DIR FIRST_STEP STEPS TRAIN_COMMAND...: a training run that saves into SAVE_DIR, checked
  local save=$1 first=$2 steps=$3 log rc
  shift 3
  rm -rf "$save" "$save.json"
  log=$(mktemp)
  "$@" --save-dir "$save" --summary "$save.json" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if ((rc == 0)); then
    if [ ! -e "$save/latest" ]; then echo "gpu-check: no checkpoint in $save (latest is missing)"; rc=5
    else cli_check "$save.json" "$first" "$steps" "$log" || rc=6; fi
  fi
  rm -f "$log"
  return "$rc"
}

cli_step() {  # NAME CAP COMMAND...: one step within CAP and what is left of the phase's seconds
  local name=$1 cap=$2
  shift 2
  if ((live)) && [[ ${previous[$name]:-} != PASS$'\t'* ]]; then
    local left=$((cli_deadline - $(date +%s)))
    ((cap > left)) && cap=$left
    if ((cap < 5)); then record "$name" SKIPPED "no time left of the CLI phase's ${cli_seconds}s"; return 125; fi
  fi
  phase "$name" "$cap" "$tests_log" "$@"
}

cli_phase() {
  local entry model config pinned pin dir source
  local funcs
  funcs="$(declare -f cli_check cli_train)"
  cli_deadline=$(($(date +%s) + cli_seconds))
  if ((!live)); then
    echo "# the CLI phase: the steps below share ${cli_seconds}s, each within its own cap; a train or a resume passes when it"
    echo "# exits 0, saves a checkpoint, prints the wall_clock_breakdown times and its summary has steps 1..2 (3..4) with finite losses"
  fi
  for entry in "${cli_models[@]}"; do
    model=${entry%%:*} config=${entry#*:}
    for pinned in false true; do
      pin=$([ "$pinned" = true ] && echo pinned || echo pageable)
      dir=$work/cli/$model-$pin
      local args=(--device "$cli_device" --set zero_optimization.stage=3
        --set zero_optimization.offload_param.device=cpu --set "zero_optimization.offload_param.pin_memory=$pinned"
        --set zero_optimization.offload_optimizer.device=cpu --set "zero_optimization.offload_optimizer.pin_memory=$pinned"
        --set wall_clock_breakdown=true --set steps_per_print=1 --set "train.log_dir=$dir/log")
      shown="$(quote "$cli" train "$config" "${args[@]}" --set train.steps=2) --save-dir $dir/saved --summary $dir/saved.json"
      cli_step "cli $model $pin train" "${cli_caps[0]}" \
        bash -c "$funcs; cli_train \"\$@\"" _ "$dir/saved" 0 2 "$cli" train "$config" "${args[@]}" --set train.steps=2
      if [ "${verdicts["cli $model $pin train"]:-}" = PASS ]; then
        shown="$(quote "$cli" train "$config" "${args[@]}" --set train.steps=4 --resume "$dir/saved") --save-dir $dir/resumed --summary $dir/resumed.json"
        cli_step "cli $model $pin resume" "${cli_caps[1]}" \
          bash -c "$funcs; cli_train \"\$@\"" _ "$dir/resumed" 2 4 "$cli" train "$config" "${args[@]}" --set train.steps=4 --resume "$dir/saved"
      else
        record "cli $model $pin resume" SKIPPED "its train did not pass"
      fi
      [ "$model" = bert ] && continue  # BERT is an encoder: `zerotrain generate` refuses it
      # A resume that ran now (--rerun-failed) gives generate a new checkpoint to read.
      [[ ${previous["cli $model $pin resume"]:-} == PASS$'\t'* ]] || unset 'previous["cli $model $pin generate"]'
      source=$dir/resumed
      [ "${verdicts["cli $model $pin resume"]:-}" = PASS ] || source=$dir/saved
      if [ "${verdicts["cli $model $pin train"]:-}" = PASS ]; then
        cli_step "cli $model $pin generate" "${cli_caps[2]}" "$cli" generate "$source" --prompt "$cli_prompt" --max-new-tokens 16
      else
        record "cli $model $pin generate" SKIPPED "no checkpoint: its train did not pass"
      fi
    done
  done
}

env_txt=$work/env.txt build_log=$work/build.log tests_log=$work/tests.log bench_log=$work/bench.log
if ((live)); then
  rm -f "$work/gpu-check.txt.new"
  for f in "$env_txt" "$build_log" "$tests_log" "$bench_log"; do
    if ((rerun)); then echo "=== --rerun-failed at $(date -u +%T) ===" >>"$f"; else : >"$f"; fi
  done
fi
if [ "$mode" = cpu_cli ]; then
  [ -x "$cli" ] || { echo "gpu-check --cli-on-cpu: $cli is not built (cmake --build build --target zerotrain_cli)" >&2; exit 2; }
  echo "gpu-check: the CLI phase on the CPU ($cli, --device cpu, ZT_HOST_STAGING=1); logs in $tests_log"
  gpu_error="--cli-on-cpu: no GPU"
  cli_phase
  finish
fi
if ((live)); then
  echo "gpu-check: results into $out; the run ends within $((budget + 10))s; binaries: $( ((prebuilt)) && echo "$stage_dir (prebuilt: $(head -n 1 "$stage_dir/manifest.txt"))" || echo "built here into $build_dir")"
else
  echo "# what travels to the GPU machine: the tree with .gpu-bin/ (git-ignored; scripts/gpu-check.sh --prepare stages it)"
  if ! travel=$(report_travel); then
    echo "$travel" >&2
    echo "gpu-check: over the ${travel_limit_mib} MiB that a copy to the GPU machine carries" >&2
    exit 1
  fi
  echo "# $travel"
  ((prebuilt)) || echo "# .gpu-bin/ is not staged: the GPU machine would build first (the fallback)"
fi

# --- 1. the machine -----------------------------------------------------------------------------
# shellcheck disable=SC2016  # expanded by the phase's bash
env_script='echo "== date"; date -u
echo "== nvidia-smi"; nvidia-smi || echo "nvidia-smi failed"
echo "== GPU (nvidia-smi --query-gpu)"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv || true
echo "== torch (python3)"; python3 -c "import torch; print(torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available())" || echo "python3 cannot import torch"
echo "== cpu"; lscpu | grep -E "Model name|^CPU\\(s\\)|Thread|Socket|NUMA node\\(s\\)" || true
echo "flags that matter: $(grep -o -w -E "avx2|avx512f|avx512_bf16|amx_tile|amx_bf16" /proc/cpuinfo | sort -u | tr "\\n" " ")"
echo "== memory"; free -g || true
echo "== disk"; df -h . /tmp | tail -n 2 || true
echo "== system"; uname -a; cat /etc/os-release 2>/dev/null | head -2
echo "== binaries"; cat .gpu-bin/manifest.txt 2>/dev/null || echo "none staged (fallback build)"'
shown="bash -c '<date; nvidia-smi; python3 -c \"import torch ...\"; lscpu; free -g; df -h; uname -a; .gpu-bin/manifest.txt>'"
phase "environment" 10 "$env_txt" bash -c "$env_script"

# The GPU's figures (sized anew on every run, --rerun-failed too: a few milliseconds).
if ((live)); then
  size_from_nvidia_smi
  {
    echo "== device sizing (scripts/gpu-check.sh)"
    describe_gpu
    ((gpu_sized)) || echo "the benchmarks that the GPU's memory sizes are skipped; the report's peak is $peak_tflops TFLOPS ($peak_source)"
  } >>"$env_txt"
  if ((gpu_sized)); then record "device" PASS "$(describe_gpu)"
  else
    echo "gpu-check: $gpu_error: the benchmarks that the GPU's memory sizes are skipped"
    record "device" FAIL "$gpu_error"
  fi
elif [ -n "$assume_gpu" ]; then
  echo "# device (--assume-gpu): $(describe_gpu)"
else
  echo "# device: sized on the GPU machine from \`nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits\` (--device-memory <MiB>MiB), /proc/meminfo (--host-memory) and the peak of its name; --assume-gpu h100|h200 shows a device's figures"
  device_memory='<GPU MiB>MiB' host_memory='<host MiB>MiB' peak_tflops='<peak>'
fi

# --- LibTorch: the GPU machine's python3 torch (the pinned version) -----------------------------
if ((!live)); then
  echo "+ torch_lib=\$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib  # torch.__version__ must be $torch_pinned"
  echo "+ export LD_LIBRARY_PATH=.gpu-bin/lib:\$torch_lib:<site-packages>/nvidia/*/lib"
else
  torch_info=$(timeout 60 python3 -c 'import torch, os, site; print(torch.__version__); print(os.path.dirname(torch.__file__))' 2>/dev/null || true)
  torch_version=$(sed -n 1p <<<"$torch_info")
  torch_root=$(sed -n 2p <<<"$torch_info")
  torch_ok=0
  if [ -z "$torch_version" ]; then
    echo "gpu-check: python3 cannot import torch: the binaries need LibTorch $torch_pinned" | tee -a "$build_log"
  elif [[ $torch_version != "$torch_pinned" && $torch_version != "$torch_pinned+"* ]]; then
    echo "gpu-check: python3's torch is $torch_version, not $torch_pinned (cmake/torch-version.txt)" | tee -a "$build_log"
  else
    torch_ok=1
    lib_path="$torch_root/lib"
    for d in "$torch_root"/../nvidia/*/lib "$torch_root"/../nvidia/cu*/lib; do [ -d "$d" ] && lib_path+=":$(cd "$d" && pwd)"; done
    ((prebuilt)) && lib_path="$stage_dir/lib:$lib_path"
    export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
# --- fallback: build here when nothing was staged -----------------------------------------------
built=$prebuilt
((live)) || built=1
if ((live)) && ((!prebuilt)) && ((torch_ok)); then
  extra=""
  shopt -s nullglob
  debs=("$deps_dir"/*.deb)
  shopt -u nullglob
  if ((${#debs[@]})); then
    # shellcheck disable=SC2016  # expanded by the phase's bash
    unpack='set -e; rm -rf "$0"; mkdir -p "$0"; for f in "$@"; do dpkg -x "$f" "$0"; done
      find "$0" -type l -lname "/*" | while read -r l; do ln -sfn "$0$(readlink "$l")" "$l"; done'
    phase "dependencies (dpkg -x)" 20 "$build_log" bash -c "$unpack" "$deps_prefix" "${debs[@]}" && extra=$deps_prefix/usr
  fi
  export PATH="$PATH:/usr/local/cuda/bin"
  mapfile -t args < <(configure_args "$torch_root/share/cmake" "$extra")
  phase "configure (fallback build)" 40 "$build_log" cmake "${args[@]}" &&
    phase "build (fallback build)" 240 "$build_log" cmake --build "$build_dir" -j"$(nproc)" --target "$cli_target" "${test_targets[@]}" "${python_targets[@]}" &&
    built=1
fi

# --- 2. every library the binaries load resolves --------------------------------------------------
check_libraries() {
  local f missing=0
  for f in "$@"; do
    echo "== ldd $f"
    ldd "$f" | grep -E 'not found|torch|cuda|nccl|uring|libz' || true
    if ldd "$f" | grep -q 'not found'; then missing=1; fi
  done
  return "$missing"
}
test_bins=()
for t in "${test_targets[@]}"; do test_bins+=("$bin_dir/tests/$t"); done
if ((built)) && { ((!live)) || ((torch_ok)); }; then
  shown="check_libraries $cli ${test_bins[*]}  # ldd: none 'not found'"
  phase "libraries" 10 "$build_log" bash -c "$(declare -f check_libraries); check_libraries \"\$@\"" _ "$cli" "${test_bins[@]}" || built=0
else
  record "libraries" SKIPPED "no binaries or no LibTorch $torch_pinned (see build.log)"
  built=0
fi

# --- 3. the tests that need a GPU ---------------------------------------------------------------
# Skipped tests count as failures here: on a GPU machine a skip means the GPU was not used. gtest
# prints each test's time ("[       OK ] Suite.Test (N ms)"); the list of them closes each phase's
# part of tests.log.
run_gtest() {  # BINARY: gtest with the GPU filter; fails on a skip
  local log
  log=$(mktemp)
  "$1" "--gtest_filter=$test_filter" --gtest_print_time=1 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  echo "gpu-check: per-test times:"
  grep -E '^\[ +(OK|FAILED|SKIPPED) +\] .* \([0-9]+ ms\)$' "$log" || echo "  (none finished)"
  if grep -q '^\[  SKIPPED \]' "$log"; then echo "gpu-check: a test skipped: the GPU was not used"; rc=3; fi
  if ! grep -q '^\[  PASSED  \] [1-9]' "$log"; then
    echo "gpu-check: no test passed under --gtest_filter=$test_filter"
    [ "$rc" = 0 ] && rc=4
  fi
  rm -f "$log"
  return "$rc"
}
test_env=(env ZT_TEST=1 ZT_TEST_DEVICE=cuda "ZT_TEST_BIN_DIR=$bin_dir/bin" "ZT_TEST_BUILD_DIR=$work")
if ((built)); then
  shown="$(quote "${test_env[@]}") $bin_dir/tests/device_kernels_test --gtest_filter=$test_filter --gtest_print_time=1"
  phase "test kernels" 15 "$tests_log" "${test_env[@]}" bash -c "$(declare -f run_gtest); test_filter='$test_filter'; run_gtest \"\$0\"" "$bin_dir/tests/device_kernels_test"
  # Every parity variant is a test of its own; 90 s for them all (stages, offload tiers, precisions).
  shown="$(quote "${test_env[@]}") $bin_dir/tests/device_parity_test --gtest_filter=$test_filter --gtest_print_time=1"
  phase "test parity" 90 "$tests_log" "${test_env[@]}" bash -c "$(declare -f run_gtest); test_filter='$test_filter'; run_gtest \"\$0\"" "$bin_dir/tests/device_parity_test"
else
  record "test kernels" SKIPPED "no binaries"
  record "test parity" SKIPPED "no binaries"
fi

# --- 4. the CLI on the GPU (cli_phase above) --------------------------------------------------------
if ((built)); then
  cli_phase
else
  record "cli" SKIPPED "no binaries"
fi

# --- 4b. the Python package on the GPU: a module on cuda through zerotrain.initialize, stages 0-3,
# offload, fp32 and bf16, against the same on the CPU (tests/python/scripts/device_parity.py) -----
python_dir=$bin_dir/python
if [ "$mode" = cpu_cli ]; then
  record "python" SKIPPED "--cli-on-cpu runs the CLI phase only (the test suite runs the script on the CPU)"
elif ((built)) && { ((!live)) || [ -f "$python_dir/zerotrain/__init__.py" ]; }; then
  python_env=(env "PYTHONPATH=$python_dir" OMP_NUM_THREADS=4)
  phase "python" 40 "$tests_log" "${python_env[@]}" python3 tests/python/scripts/device_parity.py --device cuda \
    --reference cpu --out "$work/python-parity.json"
else
  record "python" SKIPPED "no binaries (or no python/zerotrain beside them)"
fi

# --- 5. benchmarks: ZeRO-Offload first (the headline), then GPT-2 1.5B and BERT-large ------------
summary_offload=$work/summary-offload.json summary_gpt2=$work/summary-gpt2-1.5b.json summary_bert=$work/summary-bert-large.json
# One estimate's verdict in a line: "fits (device X GiB, host Y GiB)" or "does not fit (...)".
fits_py='import json, sys
e = json.load(sys.stdin)
gib = lambda b: "%.1f GiB" % (b / 2**30)
print("%s (device %s, host %s)" % ("fits" if e["fits"] else "does not fit", gib(e["per_device"]["total"]), gib(e["per_host"]["total"])))'
choose_preset() {  # the largest preset that the estimate says fits, on stdout; the estimates on stderr
  local p line
  for p in "${offload_presets[@]}"; do
    line=$("$cli" estimate configs/gpu_offload.json --preset "$p" --device cuda --device-memory "$device_memory" \
      --host-memory "$host_memory" --offload-optimizer cpu --json | python3 -c "$fits_py") || return 1
    echo "estimate offload $p: $line" >&2
    [[ $line == fits* ]] && { echo "$p"; return 0; }
  done
  echo "no preset of ${offload_presets[*]} fits $device_memory of GPU memory and $host_memory of host memory" >&2
  return 1
}
# GPT-2 1.5B at stage 0: the largest micro-batch of 16, 8, 4 that fits the GPU, the global batch
# kept at 16 sequences through gradient_accumulation_steps. The estimate is held against the
# GPU's memory less 15%, not its default 10%: on the H200 micro-batch 16 was estimated at
# 72.1 GiB and reserved 77.3 GiB (the caching allocator's blocks beyond the 70.2 GiB allocated),
# 7% more. A run estimated just within 90% of an 80 GB H100 (79.6 GiB) would then reserve about
# 76.9 GiB, too close to all of it; within 85%, about 72.6 GiB.
gpt2_batches=(16 8 4) gpt2_global_batch=16 gpt2_headroom=0.15
choose_gpt2_batch() {  # the micro-batch on stdout; the estimates on stderr
  local b line
  for b in "${gpt2_batches[@]}"; do
    line=$("$cli" estimate configs/gpu_gpt2_1.5b_stage0.json --device cuda --device-memory "$device_memory" \
      --host-memory "$host_memory" --headroom "$gpt2_headroom" --json --set "train_micro_batch_size_per_gpu=$b" \
      --set "gradient_accumulation_steps=$((gpt2_global_batch / b))" | python3 -c "$fits_py") || return 1
    echo "estimate gpt2-1.5b micro-batch $b x $((gpt2_global_batch / b)): $line (with ${gpt2_headroom} of the GPU kept free)" >&2
    [[ $line == fits* ]] && { echo "$b"; return 0; }
  done
  echo "no micro-batch of ${gpt2_batches[*]} fits $device_memory" >&2
  return 1
}
bench_offload() {
  local preset=${ZT_GPU_OFFLOAD_PRESET:-}
  if [ -z "$preset" ]; then preset=$(choose_preset) || return 1; fi
  echo "=== offload benchmark: $preset ==="
  "$cli" train configs/gpu_offload.json --device cuda --set "model.preset=$preset" --summary "$summary_offload"
  local rc=$?
  echo "=== offload benchmark end ==="
  return "$rc"
}
bench_gpt2() {
  local b
  b=$(choose_gpt2_batch) || return 1
  echo "=== gpt2-1.5b benchmark: micro-batch $b x $((gpt2_global_batch / b)) micro-steps ==="
  "$cli" train configs/gpu_gpt2_1.5b_stage0.json --device cuda --set "train_micro_batch_size_per_gpu=$b" \
    --set "gradient_accumulation_steps=$((gpt2_global_batch / b))" --summary "$summary_gpt2"
  local rc=$?
  echo "=== gpt2-1.5b benchmark end ==="
  return "$rc"
}
bench() {  # NAME CONFIG SUMMARY: one benchmark's training run between markers
  echo "=== $1 benchmark ==="
  "$cli" train "$2" --device cuda --summary "$3"
  local rc=$?
  echo "=== $1 benchmark end ==="
  return "$rc"
}
bench_vars=(cli device_memory host_memory fits_py offload_presets gpt2_batches gpt2_global_batch gpt2_headroom
  summary_offload summary_gpt2)
in_bash() {  # FUNCTION: the command line that runs FUNCTION in `bash -c` with what it needs
  echo "$(declare -f choose_preset choose_gpt2_batch bench_offload bench_gpt2 bench); $(declare -p "${bench_vars[@]}"); $1"
}

# The dry run shows the picks: the estimates run with the CPU build's CLI (build/bin/zerotrain).
preset_pick=${ZT_GPU_OFFLOAD_PRESET:-P} gpt2_pick=B
if ((!live)) && [ -n "$assume_gpu" ]; then
  if [ -x "$root/build/bin/zerotrain" ]; then
    estimates=$(mktemp)
    dry_pick() {  # FUNCTION: its pick with the CPU build's CLI; the estimates into $estimates
      local cli=$root/build/bin/zerotrain
      "$1" 2>>"$estimates"
    }
    [ -n "${ZT_GPU_OFFLOAD_PRESET:-}" ] || preset_pick=$(dry_pick choose_preset)
    gpt2_pick=$(dry_pick choose_gpt2_batch)
    sed 's/^/# /' "$estimates"
    rm -f "$estimates"
    if [ -z "$preset_pick" ] || [ -z "$gpt2_pick" ]; then
      echo "gpu-check: the estimates for $(describe_gpu) chose no offload preset or no GPT-2 micro-batch (above)" >&2
      exit 1
    fi
    echo "# $gpu_name: offload preset $preset_pick, gpt2-1.5b micro-batch $gpt2_pick x $((gpt2_global_batch / gpt2_pick)) micro-steps, peak $peak_tflops TFLOPS"
  else
    echo "# build/bin/zerotrain is not built: the estimates' picks are shown as P (the offload preset) and B (the GPT-2 micro-batch)"
  fi
fi
if ((built)) && { ((gpu_sized || !live)) || [ -n "${ZT_GPU_OFFLOAD_PRESET:-}" ]; }; then
  # The offload run's set-up (the model built on the CPU, moved, the host state page-locked) took
  # 85-140 s on H200 machines, its 4 steps 15-20 s: 150 s in the worst case, and up to 200 s of
  # the seconds the phases before it left over; the 65 s of the two after it are kept for them.
  shown="$(quote "$cli" estimate configs/gpu_offload.json --preset P --device cuda --device-memory "$device_memory" --host-memory "$host_memory" --offload-optimizer cpu --json) for P in ${offload_presets[*]} (the largest that fits); $(quote "$cli" train configs/gpu_offload.json --device cuda --set "model.preset=$preset_pick" --summary summary-offload.json)"
  keep=65
  phase "bench offload" 200 "$bench_log" bash -c "$(in_bash bench_offload)"
  keep=0
elif ((built)); then
  record "bench offload" SKIPPED "no GPU figures to size it by: $gpu_error"
fi
if ((built)) && ((gpu_sized || !live)); then
  shown="$(quote "$cli" estimate configs/gpu_gpt2_1.5b_stage0.json --device cuda --device-memory "$device_memory" --host-memory "$host_memory" --headroom "$gpt2_headroom" --json) --set train_micro_batch_size_per_gpu=B --set gradient_accumulation_steps=16/B for B in ${gpt2_batches[*]} (the largest that fits); $(quote "$cli" train configs/gpu_gpt2_1.5b_stage0.json --device cuda --set "train_micro_batch_size_per_gpu=$gpt2_pick" --set "gradient_accumulation_steps=$( [ "$gpt2_pick" = B ] && echo 16/B || echo $((gpt2_global_batch / gpt2_pick)))" --summary summary-gpt2-1.5b.json)"
  phase "bench gpt2-1.5b" 40 "$bench_log" bash -c "$(in_bash bench_gpt2)"
elif ((built)); then
  record "bench gpt2-1.5b" SKIPPED "no GPU figures to size it by: $gpu_error"
fi
if ((built)); then
  shown="$(quote "$cli" train configs/gpu_bert_large.json --device cuda --summary summary-bert-large.json)"
  phase "bench bert-large" 25 "$bench_log" bash -c "$(in_bash "bench bert-large configs/gpu_bert_large.json '$summary_bert'")"
else
  for b in offload gpt2-1.5b bert-large; do record "bench $b" SKIPPED "no binaries"; done
fi
# --- 5. the report --------------------------------------------------------------------------------
report_py=$(cat <<'PY'
import json, os, re, sys
work, peak_tflops, device, peak_source = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
def read(name):
    path = os.path.join(work, name)
    return open(path).read() if os.path.exists(path) else ''
def load(name):
    try:
        return json.loads(read(name))
    except Exception:
        return None
def gib(b):
    return '%.1f GiB' % (b / 2**30) if b else '-'
def section(text, name):  # the last run's lines; up to the next phase when it was stopped
    found = re.findall(r'=== %s benchmark(?:: [^\n]*)? ===\n(.*?)(?:=== %s benchmark end|^== \[|\Z)' % (name, name),
                       text, re.S | re.M)
    return found[-1] if found else ''
def rate(value, unit):
    return float(value) * {'': 1, 'k': 1e3, 'M': 1e6}[unit]
bench = read('bench.log')
env = read('env.txt')
gpu = re.search(r'^== GPU \(nvidia-smi --query-gpu\)\n[^\n]*\n([^=\n][^\n]*)', env, re.M)
cpu = re.search(r'^Model name:\s*(.*)$', env, re.M)
preset = re.findall(r'=== offload benchmark: (\S+) ===', bench)
gpt2_batch = re.findall(r'=== gpt2-1.5b benchmark: micro-batch (\d+) x (\d+) micro-steps ===', bench)
offload_estimate = re.findall(r'^estimate offload (\S+): fits \(([^)]*)\)', bench, re.M)
summaries = {}
rows = []
runs = [('offload', 'summary-offload.json', '%s: bf16, stage 2, optimizer on the CPU (pinned, delayed update)'
         % (preset[-1] if preset else 'offload')),
        ('gpt2-1.5b', 'summary-gpt2-1.5b.json', 'gpt2-1.5b: bf16, stage 0, all on the GPU, %s'
         % ('micro-batch %s x 1024, %s micro-steps' % gpt2_batch[-1] if gpt2_batch else 'micro-batch: see bench.log')),
        ('bert-large', 'summary-bert-large.json', 'bert-large: bf16, LAMB, stage 0, micro-batch %s x 128'
         % json.load(open('configs/gpu_bert_large.json')).get('train_micro_batch_size_per_gpu'))]
# BERT-large: model FLOPs per token of one training step = 3 x forward; the forward per token: per
# layer 2(4H^2 + 2HI) for the projections and 4TH for the attention scores and weighted sum; the
# MLM head 2(H^2 + HV) on the masked share only (max_predictions of T).
L, H, I, V, T, masked = 24, 1024, 4096, 30522, 128, 20
bert_per_token = 3 * (L * (2 * (4 * H * H + 2 * H * I) + 4 * T * H) + masked / T * 2 * (H * H + H * V))
for key, name, label in runs:
    s = load(name)
    text = section(bench, key)
    if s is None:
        rows.append('| %s | no summary (see bench.log) | | | | | |' % label)
        continue
    summaries[key] = s
    params = s.get('parameters', 0)
    dev = s.get('device', {})
    rss = max((r.get('peak_rss_bytes', 0) for r in s.get('ranks', [])), default=0)
    share = '-'
    times = re.findall(r'ms/step fwd (\d+) bwd (\d+) step (\d+)', text)
    if times:
        f, b, st = map(float, times[-1])
        share = '%.0f%% (fwd %.0f, bwd %.0f, step %.0f ms)' % (100 * st / max(1.0, f + b + st), f, b, st)
    fp = s.get('flops_profiler')
    if fp:
        achieved = fp.get('achieved_flops_per_second_per_rank', 0) / 1e12
        step = '%.3f s' % fp.get('step_seconds', 0)
        source = 'flops profiler; measured matmul peak %.0f' % (fp.get('peak_flops_per_rank', 0) / 1e12)
    else:
        rates = [rate(v, u) for v, u in re.findall(r'\| (\d+(?:\.\d+)?)([kM]?) tok/s', text)]
        if len(rates) < 4:
            rows.append('| %s | no step lines (see bench.log) | | | | | |' % label)
            continue
        last = sorted(rates[-4:])
        tokens = (last[1] + last[2]) / 2  # the median of the last four steps
        achieved = tokens * bert_per_token / 1e12
        step = '%.0f tokens/s' % tokens
        source = 'analytic FLOPs x tokens/s'
    rows.append('| %s | %.2f B | %s | %.1f | %.1f%% (%s) | %s | %s / %s | %s, %.1f B/parameter |' % (
        label, params / 1e9, step, achieved, 100 * achieved / peak_tflops, source, share,
        gib(dev.get('peak_allocated_bytes', 0)), gib(dev.get('peak_reserved_bytes', 0)), gib(rss),
        rss / max(1, params)))
json.dump(summaries, open(os.path.join(work, 'summaries.json'), 'w'), indent=1)
lines = ['# GPU benchmarks (scripts/gpu-check.sh)', '',
         'GPU: %s; host CPU: %s. Share of %.0f TFLOPS (dense bf16, %s).'
         % (gpu.group(1).strip() if gpu else 'see env.txt', cpu.group(1).strip() if cpu else '?', peak_tflops,
            peak_source), '',
         'Sized by: %s.' % device,
         'Picks: offload preset %s%s; gpt2-1.5b micro-batch %s (the global batch 16 sequences).'
         % (preset[-1] if preset else '-',
            ' (estimated %s)' % offload_estimate[-1][1] if offload_estimate and preset and offload_estimate[-1][0] == preset[-1] else '',
            '%s x %s micro-steps' % gpt2_batch[-1] if gpt2_batch else '-'), '',
         '| run | parameters | step (profiled) | TFLOPS | share of peak | step() share of the step '
         '| GPU peak allocated / reserved | host peak RSS |',
         '|---|---|---|---|---|---|---|---|'] + rows
open(os.path.join(work, 'gpu-bench.md'), 'w').write('\n'.join(lines) + '\n')
print('\n'.join(lines))
PY
)
if ((!live)); then
  echo "+ python3 -c '<the report script>' $work $peak_tflops '<the device line>' '<the peak's source>'  # writes gpu-bench.md and summaries.json: TFLOPS, share of ${peak_tflops} TFLOPS, step() share, memory, the device and the picks"
  echo "# then gpu-check.txt (one verdict per phase) and the 7 result files copied into $out; exit 1 when a phase did not pass"
  exit 0
fi
deadline=$((deadline + 10))  # the report's own seconds, beyond the phases' budget
previous[report]=""          # the report is made anew on every run
shown="python3 -c '<the report script>' $work $peak_tflops $(quote "$(describe_gpu)" "$peak_source")"
phase "report" 10 "$bench_log" python3 -c "$report_py" "$work" "$peak_tflops" "$(describe_gpu)" "$peak_source"
finish
