#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang + ASan + UBSan) in build-fuzz and runs each for a
# bounded time from its seed corpus (fuzz/corpus/<target>). Fails on any crash, leak, timeout,
# uncaught exception or out-of-memory, and prints where the reproducer was written.
#   scripts/fuzz.sh                          # every target, 60 s each
#   ZT_FUZZ_SECONDS=600 scripts/fuzz.sh config_fuzz
#   build-fuzz/fuzz/config_fuzz REPRODUCER   # replay one input
# New inputs the fuzzer finds go to build-fuzz/fuzz-work/<target> (not the repository); add an
# input to fuzz/corpus/<target> when it covers something the seeds do not, and every reproducer
# of a fixed defect together with a regression test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
seconds=${ZT_FUZZ_SECONDS:-60}
jobs=${ZT_JOBS:-$(nproc)}
build=${ZT_FUZZ_BUILD_DIR:-build-fuzz}
targets=("$@")
((${#targets[@]})) || targets=(config_fuzz safetensors_fuzz manifest_fuzz tokenizer_fuzz)
torch_prefix=${ZT_TORCH_PREFIX:-$(scripts/bootstrap.sh | tail -n 1)}
cxx=${ZT_FUZZ_CXX:-$(command -v clang++ || true)}
[ -n "$cxx" ] || { echo "fuzz.sh: clang++ not found (scripts/bootstrap.sh installs clang)" >&2; exit 1; }
launcher=()
command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

start=$(date +%s)
echo "== fuzz build ($cxx, address,undefined + libFuzzer) in $build =="
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_COMPILER=$cxx" -DZT_FUZZ=ON \
  -DZT_BUILD_TESTS=OFF -DZT_BUILD_BENCH=OFF "-DCMAKE_PREFIX_PATH=$torch_prefix" "${launcher[@]}" >/dev/null
cmake --build "$build" -j"$jobs" --target "${targets[@]}"
built=$(date +%s)

# Leaks are findings; UBSan is fatal by its compile flags; ASan stops at the first error.
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
failed=()
for t in "${targets[@]}"; do
  work="$root/$build/fuzz-work/$t"
  artifacts="$root/$build/fuzz-artifacts/$t/"
  mkdir -p "$work" "$artifacts"
  echo "== $t: ${seconds} s from fuzz/corpus/$t =="
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb: an input needing 2 GiB is a finding.
  if "$build/fuzz/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$artifacts" "$work" "fuzz/corpus/$t" > "$build/fuzz-work/$t.log" 2>&1; then
    grep -E "^stat::(number_of_executed_units|peak_rss_mb)" "$build/fuzz-work/$t.log" || true
    echo "-- $t: no findings"
  else
    tail -n 40 "$build/fuzz-work/$t.log"
    echo "-- $t: FINDING; reproducer(s):" >&2
    ls -1 "$artifacts" >&2 || true
    echo "   replay: $build/fuzz/$t $artifacts<file>   (full log: $build/fuzz-work/$t.log)" >&2
    failed+=("$t")
  fi
done
echo "== fuzz run: build $((built - start)) s, fuzzing $(( $(date +%s) - built )) s =="
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "no findings"
