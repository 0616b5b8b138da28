#!/usr/bin/env bash
# The GPU checks: one short, prepared run on a machine with one NVIDIA GPU (an H200 in the figures
# of docs/gpu.md). The CUDA binaries are built beforehand on a machine with nvcc and the pinned
# LibTorch (--prepare) and travel with the working tree in .gpu-bin/; the GPU machine only runs
# them: the tests that need a GPU, then three short benchmarks, each phase time-boxed, in order of
# value. docs/gpu.md says how to use it.
#
#   scripts/gpu-check.sh --prepare        on the build machine: build, strip and stage .gpu-bin/
#   scripts/gpu-check.sh [--out DIR]      on the GPU machine: tests and benchmarks, results in DIR
#   scripts/gpu-check.sh --rerun-failed   on the same GPU machine right after: only what did not pass
#   scripts/gpu-check.sh --dry-run        prints every command of a run and what would travel
#   scripts/gpu-check.sh --fetch-deps     fallback only: .deb files for a build on the GPU machine
#
# Phases, in order: environment, libraries, test kernels, test parity, bench offload, bench
# gpt2-1.5b, bench bert-large, report. Each has its own limit and the limits add up to
# ZT_GPU_CHECK_SECONDS (default 360), so the whole run ends within it; a phase that finds no time
# left is SKIPPED. Without .gpu-bin/ the run first builds on the GPU machine (slower: then the
# later phases may be skipped). Exit status 0 only when every phase passed.
# Results (at most 8 files): env.txt, build.log, tests.log, bench.log, summaries.json,
# gpu-bench.md and gpu-check.txt (the verdicts), copied into DIR (default $OUT, else
# runs/gpu-check/out); the working state stays in runs/gpu-check/ for --rerun-failed.
# Settings (environment):
#   ZT_GPU_TEST_FILTER     gtest filter for the GPU tests (default: the tests that use a GPU)
#   ZT_GPU_OFFLOAD_PRESET  the offload benchmark's preset (default: the largest that `zerotrain
#                          estimate` says fits one 141 GB GPU with 128 GB of host memory)
#   ZT_GPU_CHECK_SECONDS   the whole run's time limit (default 360)
#   ZT_GPU_BUILD_DIR       the build directory of --prepare and of the fallback (default build-gpu)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

mode=run
rerun=0
out=${OUT:-}
while (($#)); do
  case $1 in
    --dry-run) mode=dry ;;
    --prepare) mode=prepare ;;
    --fetch-deps) mode=fetch ;;
    --rerun-failed) rerun=1 ;;
    --out) [ $# -ge 2 ] || { echo "gpu-check: --out needs a directory" >&2; exit 2; }; out=$2; shift ;;
    --out=*) out=${1#--out=} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (expected --prepare, --dry-run, --rerun-failed, --fetch-deps, --out DIR or --help)" >&2
       exit 2 ;;
  esac
  shift
done

build_dir=${ZT_GPU_BUILD_DIR:-build-gpu}
stage_dir=$root/.gpu-bin            # the staged binaries (git-ignored; carried to the GPU machine)
work=$root/runs/gpu-check           # logs and state of the last run on this machine
deps_dir=$root/.gpu-deps
deps_prefix=/tmp/zt-deps
test_filter=${ZT_GPU_TEST_FILTER:-'DeviceKernels.*:DeviceParity.StagesAndOffloadOnTheTestDeviceEqualTheCpu:DeviceParity.CpuCheckpointingIntoTheArenaOnTheTestDeviceEqualsTheCpu-DeviceKernels.BuildFlagAndStubs'}
budget=${ZT_GPU_CHECK_SECONDS:-360}
torch_pinned=$(tr -d '[:space:]' < cmake/torch-version.txt)
offload_presets=(gpt3-13b gpt3-6.7b gpt3-2.7b gpt2-1.5b)  # largest first
peak_tflops=989  # H200 SXM dense bf16, the datasheet's figure (docs/gpu.md)
travel_limit_mib=64
# The binaries the GPU machine runs: the CLI and the tests that need a GPU.
cli_target=zerotrain_cli
test_targets=(device_kernels_test device_parity_test)
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
  echo "gpu-check: building $cli_target ${test_targets[*]} (CUDA, sm_90)"
  cmake --build "$build_dir" -j"$(nproc)" --target "$cli_target" "${test_targets[@]}"
  rm -rf "$stage_dir.partial"
  mkdir -p "$stage_dir.partial/bin" "$stage_dir.partial/tests" "$stage_dir.partial/lib"
  strip -o "$stage_dir.partial/bin/zerotrain" "$build_dir/bin/zerotrain"
  for t in "${test_targets[@]}"; do strip -o "$stage_dir.partial/tests/$t" "$build_dir/tests/$t"; done
  # Shared libraries the GPU machine may lack: everything the binaries load except LibTorch and
  # NVIDIA's (the GPU machine's python3 has the same pinned torch) and the C/C++ runtime.
  torch_lib=$(cd "$torch_prefix/../../lib" && pwd)
  for f in "$stage_dir.partial"/bin/* "$stage_dir.partial"/tests/*; do
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

# --- run or dry run ---------------------------------------------------------------------------
prebuilt=0
[ -f "$stage_dir/manifest.txt" ] && prebuilt=1
if [ "$mode" = dry ]; then
  out=${out:-'$OUT'}
  bin_dir='.gpu-bin'
else
  mkdir -p "$work" || { echo "gpu-check: cannot create '$work'" >&2; exit 2; }
  out=${out:-$work/out}
  mkdir -p "$out" || { echo "gpu-check: cannot create '$out'" >&2; exit 2; }
  out=$(cd "$out" && pwd)
  if ((prebuilt)); then bin_dir=$stage_dir; else bin_dir=$root/$build_dir; fi
fi
cli=$bin_dir/bin/zerotrain

start=$(date +%s)
deadline=$((start + budget))
declare -A previous=()  # the last run's verdict per phase (--rerun-failed)
verdict_state=$work/verdicts.tsv
if ((rerun)) && [ "$mode" = run ]; then
  if [ -f "$verdict_state" ]; then
    while IFS=$'\t' read -r name verdict detail; do previous[$name]="$verdict"$'\t'"$detail"; done <"$verdict_state"
  else
    echo "gpu-check: --rerun-failed: no earlier run on this machine ($verdict_state): running everything" >&2
  fi
fi
if [ "$mode" = run ]; then
  ((rerun)) || rm -rf "$work"/*.log "$work"/*.json "$work"/*.md "$work"/*.txt "$verdict_state"
  : >"$verdict_state.new"
fi
failed=0

quote() {  # single quotes around an argument only where a shell needs them
  local a s="" plain='^[-A-Za-z0-9_./:=,+@%$*]+$'
  for a in "$@"; do if [[ $a =~ $plain ]]; then s+="$a "; else s+="'$a' "; fi; done
  echo "${s% }"
}

record() {  # NAME VERDICT DETAIL
  printf '%-28s %-8s %s\n' "$1" "$2" "$3" >>"$work/gpu-check.txt.new"
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$verdict_state.new"
  [ "$2" = PASS ] || failed=1
}

# phase NAME LIMIT LOG COMMAND...: COMMAND with its output appended to LOG, within LIMIT seconds
# (and the time left of the budget). Returns the command's status; 124 when it ran out of time,
# 125 when skipped, 0 without running when --rerun-failed finds it passed before.
shown=""
phase() {
  local name=$1 limit=$2 log=$3
  shift 3
  local what=${shown:-$(quote "$@")}
  shown=""
  if [ "$mode" = dry ]; then
    echo "+ [$name, at most ${limit}s] $what >>$(basename "$log") 2>&1"
    return 0
  fi
  if [[ ${previous[$name]:-} == PASS$'\t'* ]]; then
    record "$name" PASS "${previous[$name]#PASS$'\t'} (earlier run)"
    return 0
  fi
  local t=$((deadline - $(date +%s)))
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
  return $rc
}

env_txt=$work/env.txt build_log=$work/build.log tests_log=$work/tests.log bench_log=$work/bench.log
if [ "$mode" = run ]; then
  rm -f "$work/gpu-check.txt.new"
  for f in "$env_txt" "$build_log" "$tests_log" "$bench_log"; do
    ((rerun)) && echo "=== --rerun-failed at $(date -u +%T) ===" >>"$f" || : >"$f"
  done
  echo "gpu-check: results into $out; the run ends within ${budget}s; binaries: $( ((prebuilt)) && echo "$stage_dir (prebuilt: $(head -n 1 "$stage_dir/manifest.txt"))" || echo "built here into $build_dir")"
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

# --- LibTorch: the GPU machine's python3 torch (the pinned version) -----------------------------
if [ "$mode" = dry ]; then
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
[ "$mode" = dry ] && built=1
if [ "$mode" = run ] && ((!prebuilt)) && ((torch_ok)); then
  extra=""
  shopt -s nullglob
  debs=("$deps_dir"/*.deb)
  shopt -u nullglob
  if ((${#debs[@]})); then
    unpack='set -e; rm -rf "$0"; mkdir -p "$0"; for f in "$@"; do dpkg -x "$f" "$0"; done
      find "$0" -type l -lname "/*" | while read -r l; do ln -sfn "$0$(readlink "$l")" "$l"; done'
    phase "dependencies (dpkg -x)" 20 "$build_log" bash -c "$unpack" "$deps_prefix" "${debs[@]}" && extra=$deps_prefix/usr
  fi
  export PATH="$PATH:/usr/local/cuda/bin"
  mapfile -t args < <(configure_args "$torch_root/share/cmake" "$extra")
  phase "configure (fallback build)" 40 "$build_log" cmake "${args[@]}" &&
    phase "build (fallback build)" 240 "$build_log" cmake --build "$build_dir" -j"$(nproc)" --target "$cli_target" "${test_targets[@]}" &&
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
  return $missing
}
test_bins=()
for t in "${test_targets[@]}"; do test_bins+=("$bin_dir/tests/$t"); done
if ((built)) && { [ "$mode" = dry ] || ((torch_ok)); }; then
  shown="check_libraries $cli ${test_bins[*]}  # ldd: none 'not found'"
  phase "libraries" 10 "$build_log" bash -c "$(declare -f check_libraries); check_libraries \"\$@\"" _ "$cli" "${test_bins[@]}" || built=0
else
  record "libraries" SKIPPED "no binaries or no LibTorch $torch_pinned (see build.log)"
  built=0
fi

# --- 3. the tests that need a GPU ---------------------------------------------------------------
# Skipped tests count as failures here: on a GPU machine a skip means the GPU was not used.
run_gtest() {  # BINARY: gtest with the GPU filter; fails on a skip
  local log
  log=$(mktemp)
  "$1" "--gtest_filter=$test_filter" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
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
  shown="$(quote "${test_env[@]}") $bin_dir/tests/device_kernels_test --gtest_filter=$test_filter"
  phase "test kernels" 15 "$tests_log" "${test_env[@]}" bash -c "$(declare -f run_gtest); test_filter='$test_filter'; run_gtest \"\$0\"" "$bin_dir/tests/device_kernels_test"
  shown="$(quote "${test_env[@]}") $bin_dir/tests/device_parity_test --gtest_filter=$test_filter"
  phase "test parity" 50 "$tests_log" "${test_env[@]}" bash -c "$(declare -f run_gtest); test_filter='$test_filter'; run_gtest \"\$0\"" "$bin_dir/tests/device_parity_test"
else
  record "test kernels" SKIPPED "no binaries"
  record "test parity" SKIPPED "no binaries"
fi

# --- 4. benchmarks: ZeRO-Offload first (the headline), then GPT-2 1.5B and BERT-large ------------
summary_offload=$work/summary-offload.json summary_gpt2=$work/summary-gpt2-1.5b.json summary_bert=$work/summary-bert-large.json
choose_preset() {  # the largest preset that the estimate says fits, on stdout; the estimates on stderr
  local p fits
  for p in "${offload_presets[@]}"; do
    fits=$("$cli" estimate configs/gpu_offload.json --preset "$p" --device cuda --device-memory 141GB \
      --host-memory 128GB --offload-optimizer cpu --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["fits"])')
    echo "estimate $p: fits=$fits" >&2
    [ "$fits" = True ] && { echo "$p"; return 0; }
  done
  echo "no preset of ${offload_presets[*]} fits" >&2
  return 1
}
bench_offload() {
  local preset=${ZT_GPU_OFFLOAD_PRESET:-}
  if [ -z "$preset" ]; then preset=$(choose_preset) || return 1; fi
  echo "=== offload benchmark: $preset ==="
  "$cli" train configs/gpu_offload.json --device cuda --set "model.preset=$preset" --summary "$summary_offload"
  local rc=$?
  echo "=== offload benchmark end ==="
  return $rc
}
bench() {  # NAME CONFIG SUMMARY: one benchmark's training run between markers
  echo "=== $1 benchmark ==="
  "$cli" train "$2" --device cuda --summary "$3"
  local rc=$?
  echo "=== $1 benchmark end ==="
  return $rc
}
if ((built)); then
  shown="$(quote "$cli" estimate configs/gpu_offload.json --preset P --device cuda --device-memory 141GB --host-memory 128GB --offload-optimizer cpu --json) for P in ${offload_presets[*]} (the largest that fits); $(quote "$cli" train configs/gpu_offload.json --device cuda --set model.preset=P --summary summary-offload.json)"
  phase "bench offload" 200 "$bench_log" bash -c "$(declare -f choose_preset bench_offload); offload_presets=(${offload_presets[*]}); cli='$cli'; summary_offload='$summary_offload'; bench_offload"
  shown="$(quote "$cli" train configs/gpu_gpt2_1.5b_stage0.json --device cuda --summary summary-gpt2-1.5b.json)"
  phase "bench gpt2-1.5b" 40 "$bench_log" bash -c "$(declare -f bench); cli='$cli'; bench gpt2-1.5b configs/gpu_gpt2_1.5b_stage0.json '$summary_gpt2'"
  shown="$(quote "$cli" train configs/gpu_bert_large.json --device cuda --summary summary-bert-large.json)"
  phase "bench bert-large" 25 "$bench_log" bash -c "$(declare -f bench); cli='$cli'; bench bert-large configs/gpu_bert_large.json '$summary_bert'"
else
  for b in offload gpt2-1.5b bert-large; do record "bench $b" SKIPPED "no binaries"; done
fi

# --- 5. the report --------------------------------------------------------------------------------
report_py=$(cat <<'PY'
import json, os, re, sys
work, peak_tflops = sys.argv[1], float(sys.argv[2])
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
    found = re.findall(r'=== %s benchmark(?:: \S+)? ===\n(.*?)(?:=== %s benchmark end|^== \[|\Z)' % (name, name),
                       text, re.S | re.M)
    return found[-1] if found else ''
def rate(value, unit):
    return float(value) * {'': 1, 'k': 1e3, 'M': 1e6}[unit]
bench = read('bench.log')
env = read('env.txt')
gpu = re.search(r'^== GPU \(nvidia-smi --query-gpu\)\n[^\n]*\n([^\n]*)', env, re.M)
cpu = re.search(r'^Model name:\s*(.*)$', env, re.M)
preset = re.findall(r'=== offload benchmark: (\S+) ===', bench)
summaries = {}
rows = []
runs = [('offload', 'summary-offload.json', '%s: bf16, stage 2, optimizer on the CPU (pinned, delayed update)'
         % (preset[-1] if preset else 'offload')),
        ('gpt2-1.5b', 'summary-gpt2-1.5b.json', 'gpt2-1.5b: bf16, stage 0, all on the GPU'),
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
         'GPU: %s; host CPU: %s. Share of %.0f TFLOPS (dense bf16, datasheet).'
         % (gpu.group(1).strip() if gpu else 'see env.txt', cpu.group(1).strip() if cpu else '?', peak_tflops), '',
         '| run | parameters | step (profiled) | TFLOPS | share of peak | step() share of the step '
         '| GPU peak allocated / reserved | host peak RSS |',
         '|---|---|---|---|---|---|---|---|'] + rows
open(os.path.join(work, 'gpu-bench.md'), 'w').write('\n'.join(lines) + '\n')
print('\n'.join(lines))
PY
)
if [ "$mode" = dry ]; then
  echo "+ python3 - $work $peak_tflops  # writes gpu-bench.md and summaries.json: TFLOPS, share of ${peak_tflops} TFLOPS, step() share, memory"
  echo "# then gpu-check.txt (one verdict per phase) and the 7 result files copied into $out; exit 1 when a phase did not pass"
  exit 0
fi
deadline=$((deadline + 10))  # the report's own seconds, beyond the phases' budget
previous[report]=""          # the report is made anew on every run
shown="python3 -c '<the report script>' $work $peak_tflops"
phase "report" 10 "$bench_log" python3 -c "$report_py" "$work" "$peak_tflops"

# --- verdicts and results -------------------------------------------------------------------------
{
  echo "gpu-check: $(($(date +%s) - start))s of ${budget}s$( ((rerun)) && echo ' (--rerun-failed)'); binaries: $( ((prebuilt)) && echo prebuilt || echo 'built on this machine')"
  cat "$work/gpu-check.txt.new"
  if ((failed)); then echo "gpu-check: FAILED or incomplete (see the logs named above; --rerun-failed runs those phases again)"
  else echo "gpu-check: all passed"; fi
} >"$work/gpu-check.txt"
rm -f "$work/gpu-check.txt.new"
mv "$verdict_state.new" "$verdict_state"
for f in env.txt build.log tests.log bench.log summaries.json gpu-bench.md gpu-check.txt; do
  [ -f "$work/$f" ] && cp "$work/$f" "$out/"
done
cat "$work/gpu-check.txt"
exit $failed
