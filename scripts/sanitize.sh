#!/usr/bin/env bash
# ASan + UBSan build of zerotrain's own code (LibTorch is prebuilt, not instrumented) and its
# fast tests, in build-asan. Any sanitizer report fails the run: ASan stops at the first error,
# UBSan is compiled with -fno-sanitize-recover, and LeakSanitizer fails on any leak that
# scripts/sanitize.supp does not name (only LibTorch-internal allocations are suppressed there).
#   scripts/sanitize.sh                  # configure, build, run the default test list
#   ZT_SANITIZE_TESTS="config_test zero_test" scripts/sanitize.sh
#   scripts/sanitize.sh --gtest_filter='Config*'   # extra arguments go to every test binary
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
torch_prefix=${ZT_TORCH_PREFIX:-$(scripts/bootstrap.sh | tail -n 1)}
jobs=${ZT_JOBS:-$(nproc)}
build=${ZT_SANITIZE_BUILD_DIR:-build-asan}
tests=${ZT_SANITIZE_TESTS:-"layout_test config_test lr_schedule_test loss_scaler_test safetensors_test \
checkpoint_test optim_kernels_test engine_test zero_test"}
launcher=()
command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

start=$(date +%s)
echo "== sanitizer build (address,undefined) in $build =="
# -O1: instrumented -O3 builds of the LibTorch-heavy sources take several times longer to compile
# for no extra findings; NDEBUG as in the normal build, so the same code is checked.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" \
  -DZT_SANITIZE=address,undefined -DZT_BUILD_BENCH=OFF \
  "-DCMAKE_PREFIX_PATH=$torch_prefix" "${launcher[@]}" >/dev/null
# shellcheck disable=SC2086
cmake --build "$build" -j"$jobs" --target zerotrain zerotrain_cli $tests
built=$(date +%s)

export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=0:check_initialization_order=1:exitcode=99"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=98"
export LSAN_OPTIONS="suppressions=$root/scripts/sanitize.supp:print_suppressions=0"
export ZT_TEST=1

failed=()
for t in $tests; do
  echo "== $t =="
  t0=$(date +%s)
  if "$build/tests/$t" --gtest_brief=1 "$@"; then
    echo "-- $t passed in $(( $(date +%s) - t0 )) s"
  else
    echo "-- $t FAILED (exit $?) after $(( $(date +%s) - t0 )) s"
    failed+=("$t")
  fi
done
echo "== sanitizer run: build $((built - start)) s, tests $(( $(date +%s) - built )) s =="
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "all sanitizer tests passed"
