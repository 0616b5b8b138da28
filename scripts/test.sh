#!/usr/bin/env bash
# The test suite that runs on every change (CI runs it through .ci/run), from a fresh machine:
# installs what is missing, checks that every path and test name the docs cite exists, that
# every #include follows the layers of src/layers.txt and that files and functions stay
# within their sizes, builds
# (CPU), checks that the CUDA configuration compiles and links
# when nvcc is present, runs every test with ctest, and fuzzes the configuration and checkpoint
# readers for a bounded time. The ASan + UBSan build and longer fuzzing are in
# scripts/nightly.sh: with them a change would take over 40 minutes on 2 cores
# (docs/benchmarks.md "Test suite").
#   ZT_SKIP_FUZZ=1 leaves fuzzing out (for a quick local run); ZT_FUZZ_SECONDS sets its length.
#   ZT_SKIP_ORACLE=1 leaves out the DeepSpeed oracle (tests/oracle/run.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh

stamp "documentation references (scripts/check_doc_refs.py)"
python3 scripts/check_doc_refs.py

stamp "include layers (scripts/check_layers.py)"
python3 scripts/check_layers.py

stamp "model-type branches outside the model interface (scripts/check_model_branches.py)"
python3 scripts/check_model_branches.py

stamp "file and function sizes (scripts/check_sizes.py)"
python3 scripts/check_sizes.py --self-test
python3 scripts/check_sizes.py

stamp "build (CPU)"
# The Python package's extension is built for the python3 that runs its tests below.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$torch_prefix" \
  "-DPython3_EXECUTABLE=$(python3 -c 'import sys; print(sys.executable)')" >/dev/null
cmake --build build -j"$jobs"

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  # The CUDA configuration compiles and links (no GPU is used): the library, the CLI and the GPU
  # tests, built and staged in .gpu-bin/ exactly as they travel to a GPU machine (docs/gpu.md).
  stamp "build (CUDA, -DZT_CUDA=ON, sm_90: scripts/gpu-check.sh --prepare; compile and link only)"
  scripts/gpu-check.sh --prepare
else
  stamp "build (CUDA): skipped, nvcc not found"
fi

# The GPU checks (docs/gpu.md) run on a machine with a GPU; here their dry runs for an H100 80 GB
# and an H200 141 GB must list every phase with that GPU's figures (the estimates' picks from the
# CLI built above), and what would travel there must fit.
stamp "GPU checks: dry runs for an H100 and an H200 (tests/gpu_check_dry_run.sh)"
tests/gpu_check_dry_run.sh

stamp "python test dependencies (transformers, scripts/python_deps.sh)"
hf_note=""
if ! hf_pythonpath=$(scripts/python_deps.sh | tail -n 1); then
  hf_pythonpath=""
  hf_note="transformers could not be installed (see the lines above): the tests that compare with it (hf_test, tests/python/test_transformers.py) skip"
  echo "NOTE: $hf_note"
fi

stamp "tests"
ctest --test-dir build --output-on-failure -j"$jobs" "$@"
# The Python package (python/, built beside the library) with pytest: DeepSpeed's API over the
# engine in one process; its two-rank runs against DeepSpeed are in the oracle below.
stamp "Python package tests (pytest tests/python)"
if ! ls build/python/zerotrain/_C*.so >/dev/null 2>&1; then
  echo "the Python package's extension was not built (build/python/zerotrain/_C*.so): are Python's headers installed?" >&2
  exit 1
fi
ZT_BIN=$PWD/build/bin/zerotrain PYTHONPATH="$PWD/build/python${hf_pythonpath:+:$hf_pythonpath}:$(dirname "$(dirname "$(dirname "$torch_prefix")")"):${ZT_DEPS_DIR:-$HOME/.cache/zerotrain}/python-tools" \
  python3 -m pytest -q -rs -p no:cacheprovider tests/python
# A test that skips passes in ctest's count: list each with its reason (gtest's "Skipped" lines).
skips=$(grep -h -A1 ": Skipped$" build/Testing/Temporary/LastTest.log 2>/dev/null | grep -v -e ": Skipped$" -e "^--$" | sort -u || true)
if [ -n "$skips" ] || [ -n "$hf_note" ]; then
  echo "== tests that skipped (they did not run) =="
  [ -z "$hf_note" ] || echo "$hf_note"
  [ -z "$skips" ] || echo "$skips"
fi

# DeepSpeed as the numerical oracle (docs/deepspeed_oracle.md): the same training in zerotrain and
# DeepSpeed 0.19.8, compared; a few minutes. It says so in one line when DeepSpeed cannot be installed.
if [ "${ZT_SKIP_ORACLE:-0}" = 1 ]; then
  stamp "DeepSpeed oracle: skipped (ZT_SKIP_ORACLE=1)"
else
  stamp "DeepSpeed oracle (tests/oracle/run.sh)"
  tests/oracle/run.sh
fi

if [ "${ZT_SKIP_FUZZ:-0}" != 1 ]; then
  stamp "fuzzing (libFuzzer + ASan/UBSan, ${ZT_FUZZ_SECONDS:-60} s per target)"
  scripts/fuzz.sh
fi
stamp "done"
