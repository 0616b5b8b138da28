#!/usr/bin/env bash
# zerotrain's Python package against the newest torch it supports (cmake/torch-python-range.txt):
# installs that torch wheel beside the pinned one (never into the system's Python), builds the
# library and the extension against it in build-torch-<version>/ (the whole library: about 25
# minutes on 2 cores, which is why the test command does not run this), and runs the Python tests
# with it. The command line stays on the pinned torch: the tests that start ranks use
# build/bin/zerotrain, so scripts/test.sh (or its build) must have run first.
#   scripts/python_newest_torch.sh [VERSION]     (default 2.15.0, the newest on PyPI when written)
# Prints the pytest summary; the exit status is pytest's (2 when the set-up fails).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=${1:-2.15.0}
deps=${ZT_DEPS_DIR:-$HOME/.cache/zerotrain}
dir="$deps/torch-$version-python"  # its site/ holds the wheels
build="build-torch-$version"
log() { echo "[python-newest-torch] $*" >&2; }
[ -x build/bin/zerotrain ] || { log "build/bin/zerotrain is missing: run scripts/test.sh (or its build) first"; exit 2; }
hf_path=$(scripts/python_deps.sh | tail -n 1) || { log "transformers could not be installed"; exit 2; }
hf_site=${hf_path%%:*}

# The torch wheel and the CUDA runtime libraries libtorch loads even on a machine without a GPU,
# at the versions torch's own metadata names (2.15.0: cuda-toolkit 13.2.2, cuSPARSELt 0.8.1, NVSHMEM 3.7.2, NCCL 2.30.7),
# and torch's pure-Python dependencies, as scripts/bootstrap.sh puts them beside the pinned torch (the
# tests import the package with Debian's python3 and that folder alone).
wheels=("torch==$version" "nvidia-cuda-runtime==13.2.86" "nvidia-cuda-cupti==13.2.86" "nvidia-cufile==1.17.1.22"
  "nvidia-cusparselt-cu13==0.8.1" "nvidia-nvshmem-cu13==3.7.2" "nvidia-nccl-cu13==2.30.7"
  "typing-extensions==4.16.0" "filelock==4.3.1" "sympy==1.14.0" "mpmath==1.3.0" "networkx==3.5" "jinja2==3.1.6"
  "markupsafe==3.0.2" "fsspec==2026.9.0")
source scripts/pinned_wheels.sh
pinned_wheels_install "$dir" python-newest-torch "${wheels[@]}" || { log "the torch wheel could not be installed"; exit 2; }
dir="$dir/site"
PYTHONPATH="$dir:$hf_site" python3 -c "import torch; print(f'[python-newest-torch] torch {torch.__version__} imports')" >&2

log "building the library and the Python package against torch $version in $build/"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$dir/torch/share/cmake" \
  -DZT_TORCH_ANY_SUPPORTED=ON -DZT_BUILD_TESTS=OFF -DZT_BUILD_BENCH=OFF \
  -DPython3_EXECUTABLE="$(python3 -c 'import sys; print(sys.executable)')" >"$build.configure.log" 2>&1 ||
  { log "configure failed (see $build.configure.log)"; tail -5 "$build.configure.log" >&2; exit 2; }
cmake --build "$build" -j"$(nproc)" --target zerotrain_python zerotrain_python_modules >"$build.build.log" 2>&1 ||
  { log "build failed (see $build.build.log)"; grep -m5 -E "error" "$build.build.log" >&2; exit 2; }

log "Python tests against torch $version"
ZT_BIN=$PWD/build/bin/zerotrain PYTHONPATH="$PWD/$build/python:$hf_site:$dir:$deps/python-tools" \
  python3 -m pytest -q -rs -p no:cacheprovider tests/python
