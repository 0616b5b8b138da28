#!/usr/bin/env bash
# The test suite that runs on every change (CI runs it through .ci/run), from a fresh machine:
# installs what is missing, builds (CPU), checks that the CUDA configuration compiles and links
# when nvcc is present, runs every test with ctest, and fuzzes the configuration and checkpoint
# readers for a bounded time. The ASan + UBSan build and longer fuzzing are in
# scripts/nightly.sh: with them a change would take over 40 minutes on a 2-core machine
# (docs/benchmarks.md "Test suite").
#   ZT_SKIP_FUZZ=1 leaves fuzzing out (for a quick local run); ZT_FUZZ_SECONDS sets its length.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh

stamp "build (CPU)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$torch_prefix" >/dev/null
cmake --build build -j"$jobs"

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  stamp "build (CUDA, -DZT_CUDA=ON: compile and link only; no GPU is used)"
  export PATH="$PATH:/usr/local/cuda/bin"
  cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DZT_CUDA=ON -DZT_BUILD_TESTS=OFF -DZT_BUILD_BENCH=OFF \
    "-DCMAKE_PREFIX_PATH=$torch_prefix" >/dev/null
  cmake --build build-cuda -j"$jobs"
else
  stamp "build (CUDA): skipped, nvcc not found"
fi

stamp "tests"
ctest --test-dir build --output-on-failure -j"$jobs" "$@"

if [ "${ZT_SKIP_FUZZ:-0}" != 1 ]; then
  stamp "fuzzing (libFuzzer + ASan/UBSan, ${ZT_FUZZ_SECONDS:-60} s per target)"
  scripts/fuzz.sh
fi
stamp "done"
