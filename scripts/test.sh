#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what is missing, builds (CPU), checks that
# the CUDA configuration compiles and links when nvcc is present, then runs every test with ctest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
torch_prefix=$(scripts/bootstrap.sh | tail -n 1)
jobs=${ZT_JOBS:-$(nproc)}

echo "== build (CPU) =="
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$torch_prefix" >/dev/null
cmake --build build -j"$jobs"

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "== build (CUDA, -DZT_CUDA=ON: compile and link only; no GPU is used) =="
  export PATH="$PATH:/usr/local/cuda/bin"
  cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DZT_CUDA=ON -DZT_BUILD_TESTS=OFF -DZT_BUILD_BENCH=OFF \
    "-DCMAKE_PREFIX_PATH=$torch_prefix" >/dev/null
  cmake --build build-cuda -j"$jobs"
else
  echo "== build (CUDA): skipped, nvcc not found =="
fi

echo "== tests =="
ctest --test-dir build --output-on-failure -j"$jobs" "$@"
