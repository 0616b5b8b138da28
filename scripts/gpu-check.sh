#!/usr/bin/env bash
# The GPU checks, as one prepared run on a machine with one NVIDIA GPU (an H200 in the figures of
# docs/gpu.md): builds the CUDA configuration, runs the tests that need a GPU, three short
# benchmarks (GPT-2 1.5B, BERT-large pre-training, ZeRO-Offload), and writes every result under $OUT (or --out DIR). Made for a bare machine without
# network: the Debian packages the build needs travel with the tree (--fetch-deps, run where apt
# works) and are unpacked into a private prefix, never into /. docs/gpu.md says how to use it.
#
#   scripts/gpu-check.sh --fetch-deps   here, where apt works: .deb files into .gpu-deps/
#   scripts/gpu-check.sh [--out DIR]    on the GPU machine: deps, build, tests, benchmarks
#   scripts/gpu-check.sh --dry-run      prints every command of a run, runs none (no GPU needed)
#
# Each phase has a time limit, and all of them together end within ZT_GPU_CHECK_SECONDS (default
# 470 s) of the start, the build included; a phase without time left is skipped and says so.
# Exit status 0 only when every phase passed; 1 when one failed, ran out of time or was skipped.
# Results (at most 8 files, for machines that hand back only a few): env.txt, build.log, tests.log, bench.log,
# summary-gpt2-1.5b.json, summary-offload.json, gpu-bench.md and gpu-check.txt (the verdicts).
# Settings (environment):
#   ZT_GPU_TEST_FILTER     gtest filter for the tests/device_*_test.cpp binaries (default '*': all of
#                          them; those are the tests that use ZT_TEST_DEVICE)
#   ZT_GPU_OFFLOAD_PRESET  the offload benchmark's preset (default: the largest that
#                          `zerotrain estimate` says fits one 141 GB GPU with 128 GB of host memory)
#   ZT_GPU_BUILD_DIR       build directory (default build-gpu); ZT_GPU_DEPS_PREFIX (default /tmp/zt-deps)
#   ZT_GPU_CHECK_SECONDS   the whole run's time limit (default 470)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

mode=run
out=${OUT:-}
while (($#)); do
  case $1 in
    --dry-run) mode=dry ;;
    --fetch-deps) mode=fetch ;;
    --out) [ $# -ge 2 ] || { echo "gpu-check: --out needs a directory" >&2; exit 2; }; out=$2; shift ;;
    --out=*) out=${1#--out=} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (expected --dry-run, --fetch-deps, --out DIR or --help)" >&2; exit 2 ;;
  esac
  shift
done

# What the build needs from Debian beyond the machine's image (README "Dependencies"). liburing is
# left out: without it the NVMe tiers use pread/pwrite threads, and these checks use no NVMe.
# zlib1g brings the library that zlib1g-dev's libz.so points at.
deb_packages=(nlohmann-json3-dev libcli11-dev libgloo-dev libgtest-dev libgmock-dev zlib1g-dev zlib1g)
deps_dir=$root/.gpu-deps
deps_prefix=${ZT_GPU_DEPS_PREFIX:-/tmp/zt-deps}
build_dir=${ZT_GPU_BUILD_DIR:-build-gpu}
test_filter=${ZT_GPU_TEST_FILTER:-'*'}
budget=${ZT_GPU_CHECK_SECONDS:-470}
torch_pinned=$(tr -d '[:space:]' < cmake/torch-version.txt)
offload_presets=(gpt3-13b gpt3-6.7b gpt3-2.7b gpt2-1.5b)  # largest first
peak_tflops=989  # H200 SXM dense bf16, the datasheet's figure (docs/gpu.md)

if [ "$mode" = fetch ]; then
  # Where apt works: the packages as .deb files, carried to the GPU machine with the tree.
  set -e
  mkdir -p "$deps_dir"
  rm -f "$deps_dir"/*.deb
  if ! (cd "$deps_dir" && apt-get download "${deb_packages[@]}"); then
    echo "gpu-check: apt-get download failed; refreshing the package lists (apt-get update) and trying again" >&2
    apt-get update -qq
    (cd "$deps_dir" && apt-get download "${deb_packages[@]}")
  fi
  size_kib=$(du -sk "$deps_dir" | cut -f1)
  ls -l "$deps_dir"
  echo "gpu-check: ${#deb_packages[@]} packages, $((size_kib / 1024)) MiB in .gpu-deps/ (they travel with the working tree)"
  if ((size_kib > 48 * 1024)); then
    echo "gpu-check: .gpu-deps/ is over 48 MiB: too large to carry beside the tree" >&2
    exit 1
  fi
  exit 0
fi

if [ "$mode" = dry ]; then
  out=${out:-'$OUT'}
  torch_prefix='$torch_prefix'
else
  out=${out:-$root/runs/gpu-check}
  mkdir -p "$out" || { echo "gpu-check: cannot create '$out'" >&2; exit 2; }
  out=$(cd "$out" && pwd)
fi

start=$(date +%s)
deadline=$((start + budget))
reserve=15  # seconds kept for the report and the verdicts
verdicts=()
failed=0
shown=""  # what the next phase shows (dry run and logs) instead of its command: a long script

# Single quotes around an argument only where a shell would need them, for the printed commands.
quote() {
  local a s="" plain='^[-A-Za-z0-9_./:=,+@%$]+$'
  for a in "$@"; do
    if [[ $a =~ $plain ]]; then s+="$a "; else s+="'$a' "; fi
  done
  echo "${s% }"
}

record() {  # NAME VERDICT DETAIL
  verdicts+=("$(printf '%-28s %-8s %s' "$1" "$2" "$3")")
  [ "$2" = PASS ] || failed=1  # a phase skipped for want of time or of a build leaves the run incomplete
}

# phase NAME LIMIT LOG COMMAND...: COMMAND with its output appended to LOG, within LIMIT seconds
# and the time left. Returns the command's status (124 when it ran out of time, 125 when skipped).
phase() {
  local name=$1 limit=$2 log=$3
  shift 3
  if [ "$mode" = dry ]; then
    echo "+ [$name, at most ${limit}s] ${shown:-$(quote "$@")} >>$log 2>&1"
    shown=""
    return 0
  fi
  local what=${shown:-$(quote "$@")}
  shown=""
  local t=$((deadline - reserve - $(date +%s)))
  ((t > limit)) && t=$limit
  if ((t < 5)); then
    record "$name" SKIPPED "no time left of the ${budget}s"
    return 125
  fi
  echo "== [$(date +%H:%M:%S)] $name (at most ${t}s): $what" | tee -a "$log"
  local begin rc=0
  begin=$(date +%s)
  timeout -k 10 "$t" "$@" >>"$log" 2>&1 || rc=$?
  local took=$(($(date +%s) - begin))
  case $rc in
    0) record "$name" PASS "${took}s" ;;
    124|137) record "$name" TIMEOUT "stopped after ${took}s (limit ${t}s), see $(basename "$log")" ;;
    *) record "$name" FAIL "exit $rc after ${took}s, see $(basename "$log")" ;;
  esac
  echo "== [$(date +%H:%M:%S)] $name: exit $rc after ${took}s" >>"$log"
  return $rc
}

note() { if [ "$mode" = dry ]; then echo "# $*"; else echo "gpu-check: $*"; fi; }

env_txt=$out/env.txt build_log=$out/build.log tests_log=$out/tests.log bench_log=$out/bench.log
summary_a=$out/summary-gpt2-1.5b.json summary_b=$out/summary-offload.json report=$out/gpu-bench.md
verdict_file=$out/gpu-check.txt
if [ "$mode" = run ]; then
  : >"$build_log"; : >"$tests_log"; : >"$bench_log"
  rm -f "$summary_a" "$summary_b" "$report" "$verdict_file"
fi
note "results into $out; the run ends within ${budget}s"

# --- the machine --------------------------------------------------------------------------------
env_script='echo "== date"; date -u
echo "== nvidia-smi"; nvidia-smi || echo "nvidia-smi failed"
echo "== GPU (nvidia-smi --query-gpu)"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv || true
echo "== nvcc"; nvcc --version || /usr/local/cuda/bin/nvcc --version || echo "nvcc not found"
echo "== torch (python3)"; python3 -c "import torch; print(torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"\"); print(torch.utils.cmake_prefix_path)" || echo "python3 cannot import torch"
echo "== cmake"; cmake --version | head -1
echo "== compiler"; c++ --version | head -1
echo "== ninja"; ninja --version || echo "ninja not found"
echo "== ccache"; ccache --version 2>/dev/null | head -1 || echo "ccache not found"
echo "== cpu"; lscpu | grep -E "Model name|^CPU\\(s\\)|Thread|Socket|NUMA node\\(s\\)" || true; echo "nproc $(nproc)"
echo "== memory"; free -g || true
echo "== system"; uname -a; cat /etc/os-release 2>/dev/null | head -2'
if [ "$mode" = run ]; then : >"$env_txt"; fi
shown="bash -c '<date; nvidia-smi; nvidia-smi --query-gpu=...; nvcc --version; python3 -c \"import torch ...\"; cmake --version; c++ --version; ninja --version; ccache --version; lscpu; free -g; uname -a>'"
phase "environment" 30 "$env_txt" bash -c "$env_script"

# --- torch from the machine's python3 -----------------------------------------------------------
if [ "$mode" = dry ]; then
  echo "+ torch_prefix=\$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')  # torch.__version__ must be $torch_pinned"
else
  torch_version=$(timeout 60 python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
  torch_prefix=$(timeout 60 python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
  if [ -z "$torch_version" ]; then
    record "torch $torch_pinned" FAIL "python3 cannot import torch: the build needs LibTorch $torch_pinned"
  elif [[ $torch_version != "$torch_pinned" && $torch_version != "$torch_pinned+"* ]]; then
    record "torch $torch_pinned" FAIL "python3's torch is $torch_version, not $torch_pinned (cmake/torch-version.txt): the build refuses it"
  else
    record "torch $torch_pinned" PASS "$torch_version at $torch_prefix"
  fi
  echo "== torch: ${torch_version:-none} at ${torch_prefix:-?}" >>"$build_log"
fi

# --- dependencies: the carried .deb files, unpacked into a private prefix -----------------------
debs=()
if [ "$mode" = dry ]; then
  debs=("${deb_packages[@]/%/_*.deb}")
  debs=("${debs[@]/#/.gpu-deps/}")
else
  shopt -s nullglob
  debs=("$deps_dir"/*.deb)
  shopt -u nullglob
fi
prefix_path="$torch_prefix"
if ((${#debs[@]})); then
  # Absolute links (zlib1g-dev's libz.so -> /lib/...) are pointed into the prefix.
  unpack_script='set -e; rm -rf "$0"; mkdir -p "$0"; for f in "$@"; do dpkg -x "$f" "$0"; done
    find "$0" -type l -lname "/*" | while read -r l; do ln -sfn "$0$(readlink "$l")" "$l"; done
    ls "$0/usr/include" "$0/usr/share/cmake"'
  shown="rm -rf $deps_prefix; mkdir -p $deps_prefix; for f in ${debs[*]}; do dpkg -x \$f $deps_prefix; done; (absolute links re-pointed into $deps_prefix)"
  phase "dependencies (dpkg -x)" 30 "$build_log" bash -c "$unpack_script" "$deps_prefix" "${debs[@]}"
  prefix_path="$torch_prefix;$deps_prefix/usr"
else
  note "no .gpu-deps/*.deb (scripts/gpu-check.sh --fetch-deps makes them): relying on the machine's own packages"
fi

# --- configure and build ------------------------------------------------------------------------
export PATH="$PATH:/usr/local/cuda/bin"
generator=()
launcher=()
if [ "$mode" = dry ] || command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
if [ "$mode" = run ] && command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
# NCCL's header: the toolkit's, else the one of the nvidia-nccl wheel beside python3's torch.
extra_flags=""
if [ "$mode" = run ] && ! [ -e /usr/local/cuda/include/nccl.h ] && ! [ -e /usr/include/nccl.h ] && [ -n "$torch_prefix" ]; then
  site=$(cd "$torch_prefix/../../.." 2>/dev/null && pwd)
  nccl_h=$(find "$site/nvidia" -name nccl.h -path '*include*' 2>/dev/null | head -n 1)
  [ -n "$nccl_h" ] && extra_flags="-isystem $(dirname "$nccl_h")"
  note "nccl.h: ${nccl_h:-not found}"
fi
[ -d "$build_dir" ] && [ -f "$build_dir/CMakeCache.txt" ] && ! grep -q "CMAKE_GENERATOR:INTERNAL=Ninja" "$build_dir/CMakeCache.txt" &&
  [ "${#generator[@]}" -gt 0 ] && rm -rf "$build_dir"
configure=(cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DZT_CUDA=ON -DZT_BUILD_TESTS=ON
  -DZT_BUILD_BENCH=OFF -DCMAKE_CUDA_ARCHITECTURES=90 -DTORCH_CUDA_ARCH_LIST=9.0 "-DCMAKE_PREFIX_PATH=$prefix_path"
  "${launcher[@]}")
[ -n "$extra_flags" ] && configure+=("-DCMAKE_CXX_FLAGS=$extra_flags" "-DCMAKE_CUDA_FLAGS=$extra_flags")
built=0
if phase "configure (CUDA, sm_90)" 90 "$build_log" "${configure[@]}"; then
  targets=(zerotrain_cli)
  test_bins=()
  # Every tests/device_*_test.cpp: the tests that run on ZT_TEST_DEVICE (the device kernels against
  # the CPU's, the engine on the GPU against the CPU run); the rest of the suite is CPU-only.
  device_tests=()
  for f in tests/device_*_test.cpp; do [ -f "$f" ] && device_tests+=("$(basename "$f" .cpp)"); done
  for t in device_kernels_test "${device_tests[@]}"; do
    [[ " ${targets[*]} " == *" $t "* ]] && continue
    if [ -f "tests/$t.cpp" ]; then targets+=("$t"); test_bins+=("$t"); else note "tests/$t.cpp does not exist: $t is not built"; fi
  done
  jobs=$(nproc 2>/dev/null || echo 16)
  phase "build ${targets[*]}" 330 "$build_log" cmake --build "$build_dir" -j"$jobs" --target "${targets[@]}" && built=1
fi
[ "$mode" = dry ] && built=1
cli=$build_dir/bin/zerotrain

# --- tests on the GPU ---------------------------------------------------------------------------
if ((built)); then
  for t in "${test_bins[@]}"; do
    phase "test $t" 150 "$tests_log" env ZT_TEST=1 ZT_TEST_DEVICE=cuda "$build_dir/tests/$t" "--gtest_filter=$test_filter"
  done
else
  record "tests" SKIPPED "the build did not finish"
fi

# --- benchmark (a): GPT-2 1.5B, bf16, stage 0, one GPU, flops profiler ---------------------------
if ((built)); then
  phase "bench gpt2-1.5b stage 0" 100 "$bench_log" "$cli" train configs/gpu_gpt2_1.5b_stage0.json --device cuda \
    --summary "$summary_a"

  # --- benchmark (c): BERT-large pre-training (LAMB, sequence 128, bf16, stage 0) ----------------
  # TFLOPS from its last steps' tokens/s and BERT's analytic FLOPs (the report below); the per-step
  # lines go to bench.log, so no ninth file.
  [ "$mode" = run ] && echo "=== bert-large benchmark ===" >>"$bench_log"
  phase "bench bert-large" 60 "$bench_log" "$cli" train configs/gpu_bert_large.json --device cuda
  [ "$mode" = run ] && echo "=== bert-large benchmark end ===" >>"$bench_log"

  # --- benchmark (b): ZeRO-Offload, the largest preset that fits 141 GB + 128 GB ------------------
  preset=${ZT_GPU_OFFLOAD_PRESET:-}
  if [ -z "$preset" ]; then
    for p in "${offload_presets[@]}"; do
      estimate=("$cli" estimate configs/gpu_offload.json --preset "$p" --device cuda --device-memory 141GB
        --host-memory 128GB --offload-optimizer cpu --json)
      if [ "$mode" = dry ]; then
        echo "+ [estimate $p, at most 20s] $(quote "${estimate[@]}")  # the largest that fits is trained"
        continue
      fi
      fits=$(timeout 20 "${estimate[@]}" 2>>"$bench_log" | python3 -c 'import json,sys; print(json.load(sys.stdin)["fits"])' 2>>"$bench_log")
      echo "== estimate $p: fits=${fits:-?}" >>"$bench_log"
      if [ "$fits" = True ]; then preset=$p; break; fi
    done
    [ "$mode" = dry ] && preset='<the largest that fits>'
  fi
  if [ -z "$preset" ]; then
    record "bench offload" FAIL "zerotrain estimate found no preset of ${offload_presets[*]} that fits"
  else
    [ "$mode" = run ] && echo "=== offload benchmark: $preset ===" >>"$bench_log"
    phase "bench offload $preset" 200 "$bench_log" "$cli" train configs/gpu_offload.json --device cuda \
      --set "model.preset=$preset" --summary "$summary_b"
  fi
else
  record "benchmarks" SKIPPED "the build did not finish"
fi

# --- the report ---------------------------------------------------------------------------------
report_py=$(cat <<'PY'
import json, os, re, sys
out, peak_tflops, bench_log = sys.argv[1], float(sys.argv[2]), sys.argv[3]
def read(path):
    return open(path).read() if os.path.exists(path) else ''
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception:
        return None
def gib(b):
    return '%.1f GiB' % (b / 2**30) if b else '-'
text = read(bench_log)
env = read(os.path.join(out, 'env.txt'))
gpu = re.search(r'^== GPU \(nvidia-smi --query-gpu\)\n[^\n]*\n([^\n]*)', env, re.M)
offload = re.search(r'=== offload benchmark: (\S+) ===', text)
before, _, after = text.partition('=== offload benchmark')
runs = [('summary-gpt2-1.5b.json', 'gpt2-1.5b: bf16, stage 0, all on the GPU', before),
        ('summary-offload.json', '%s: bf16, stage 2, optimizer on the CPU (pinned, delayed update)'
         % (offload.group(1) if offload else 'offload'), after)]
rows = []
for name, label, section in runs:
    s = load(name)
    if s is None:
        rows.append('| %s | no summary (see bench.log) | | | | | | |' % label)
        continue
    fp = s.get('flops_profiler', {})
    achieved = fp.get('achieved_flops_per_second_per_rank', 0) / 1e12
    measured = fp.get('peak_flops_per_rank', 0) / 1e12
    dev = s.get('device', {})
    params = s.get('parameters', 0)
    rss = s['ranks'][0]['peak_rss_bytes'] if s.get('ranks') else 0
    share = '-'
    times = re.findall(r'ms/step fwd (\d+) bwd (\d+) step (\d+)', section)
    if times:
        f, b, st = map(float, times[-1])
        share = '%.0f%% (fwd %.0f, bwd %.0f, step %.0f ms)' % (100 * st / max(1.0, f + b + st), f, b, st)
    rows.append('| %s | %.2f B | %.3f s | %.1f | %.1f%% (measured matmul peak %.0f) | %s | %s / %s | %s, %.1f B/parameter |' % (
        label, params / 1e9, fp.get('step_seconds', 0), achieved, 100 * achieved / peak_tflops, measured, share,
        gib(dev.get('peak_allocated_bytes', 0)), gib(dev.get('peak_reserved_bytes', 0)), gib(rss), rss / max(1, params)))
# BERT-large: model FLOPs per token of one training step = 3 x forward (backward 2 x forward), the
# forward per token: per layer 2(4H^2 + 2HI) for the projections and 4TH for the attention scores
# and weighted sum; the MLM head 2(H^2 + HV) on the masked share only (max_predictions of T).
bert = re.search(r'=== bert-large benchmark ===\n(.*?)=== bert-large benchmark end', text, re.S)
L, H, I, V, T, masked = 24, 1024, 4096, 30522, 128, 20
per_token = 3 * (L * (2 * (4 * H * H + 2 * H * I) + 4 * T * H) + masked / T * 2 * (H * H + H * V))
rates = [float(r) for r in re.findall(r'\| (\d+(?:\.\d+)?) tok/s', bert.group(1))] if bert else []
if len(rates) >= 4:
    rate = sorted(rates[-4:])[len(rates[-4:]) // 2]  # median of the last four steps
    tflops = rate * per_token / 1e12
    rows.append('| bert-large: bf16, LAMB, stage 0, micro-batch 64 x 128 | 0.34 B | %.0f tokens/s | %.1f | %.1f%% '
                '(analytic FLOPs x tokens/s; the seeds: 64 TFLOPS, 51%% of a V100) | | | |'
                % (rate, tflops, 100 * tflops / peak_tflops))
else:
    rows.append('| bert-large | no step lines (see bench.log) | | | | | | |')
lines = ['# GPU benchmarks (scripts/gpu-check.sh)', '',
         'GPU: %s. MFU against %.0f TFLOPS (dense bf16, datasheet); the model FLOPs of the profiled step '
         '(flops_profiler) over its time.' % (gpu.group(1).strip() if gpu else 'see env.txt', peak_tflops), '',
         '| run | parameters | profiled step | TFLOPS | % of peak | step() share of the step (wall_clock_breakdown) '
         '| GPU peak allocated / reserved | host peak RSS, per parameter |',
         '|---|---|---|---|---|---|---|---|'] + rows
open(os.path.join(out, 'gpu-bench.md'), 'w').write('\n'.join(lines) + '\n')
print('\n'.join(lines))
PY
)
if [ "$mode" = dry ]; then
  echo "+ python3 - $out $peak_tflops $bench_log  # writes $report: TFLOPS, % of ${peak_tflops} TFLOPS, CPU step share, bytes per parameter"
else
  deadline=$((deadline + reserve))  # the reserve is the report's
  shown="python3 -c '<the report script>' $out $peak_tflops $bench_log"
  phase "report gpu-bench.md" 10 "$bench_log" python3 -c "$report_py" "$out" "$peak_tflops" "$bench_log"
fi

# --- verdicts -----------------------------------------------------------------------------------
if [ "$mode" = dry ]; then
  echo "# then the verdict of each phase into $verdict_file; exit 1 when one failed"
  exit 0
fi
{
  echo "gpu-check: $(($(date +%s) - start))s of ${budget}s; results in $out"
  printf '%s\n' "${verdicts[@]}"
  if ((failed)); then echo "gpu-check: FAILED or incomplete (see the logs named above)"; else echo "gpu-check: all passed"; fi
} | tee "$verdict_file"
[ -f "$report" ] && cat "$report"
exit $failed
