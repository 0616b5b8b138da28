#!/usr/bin/env bash
# Installs everything zerotrain needs to build, test and run; safe to run again (idempotent).
#   - Debian packages: compiler, CMake, header-only and small libraries (see README "Dependencies").
#   - LibTorch from the PyPI `torch` wheel, version pinned in cmake/torch-version.txt, unpacked
#     with --no-deps into $ZT_DEPS_DIR (default ~/.cache/zerotrain), plus the NVIDIA runtime
#     wheels its libraries find through their $ORIGIN/../../nvidia/*/lib RPATH and that a CUDA
#     toolkit does not provide: cudart and cupti (libtorch_cpu.so needs them even on a CPU-only
#     machine) and cuSPARSELt, NVSHMEM, cuFile (libtorch_cuda.so, for the -DZT_CUDA=ON build).
#     Pins are the ones torch's own metadata gives. torch's pure-Python dependencies (typing-extensions,
#     sympy, ...) go into the same directory, so that it imports with a python3 that lacks them.
#   - Python's safetensors package and pytest (pinned below) into $ZT_DEPS_DIR/python-tools, for
#     the tests (pytest runs the Python package's tests, tests/python/).
# Prints the torch CMake prefix path on its last line of stdout.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
torch_version=$(tr -d '[:space:]' < "$here/cmake/torch-version.txt")
deps_dir=${ZT_DEPS_DIR:-$HOME/.cache/zerotrain}
torch_dir="$deps_dir/torch-$torch_version"

log() { echo "[bootstrap] $*" >&2; }

apt_packages=(g++ cmake make git python3 python3-pip pkg-config
  libgloo-dev nlohmann-json3-dev libcli11-dev zlib1g-dev liburing-dev
  libpcre2-dev  # the regular expressions of Hugging Face tokenizers (src/data/hf_regex.cpp)
  libgtest-dev libgmock-dev
  clang libclang-rt-14-dev)  # clang + its sanitizer/libFuzzer runtimes: scripts/fuzz.sh
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# python3/pip may come from elsewhere (pyenv); only ask apt for them when absent.
command -v python3 >/dev/null && missing=("${missing[@]/python3}")
python3 -m pip --version >/dev/null 2>&1 && missing=("${missing[@]/python3-pip}")
# The Python package's extension needs Python's headers (Debian's python3-dev for Debian's python3).
if command -v python3 >/dev/null && ! python3 -c 'import os, sysconfig, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
  missing+=(python3-dev)
fi
read -ra missing <<< "${missing[*]}"
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=(); [ "$(id -u)" = 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

wheels=("torch==$torch_version" "nvidia-cuda-runtime==13.0.96.*" "nvidia-cuda-cupti==13.0.85.*"
  "nvidia-cusparselt-cu13==0.8.0" "nvidia-nvshmem-cu13==3.4.5" "nvidia-cufile==1.15.1.6.*")
# Installs wheels (no dependencies) into a directory of their own, atomically. The marker records
# the wheel set, so a changed pin or set reinstalls instead of being skipped.
install_wheels() {
  local dir=$1 what=$2
  shift 2
  [ "$(cat "$dir/.complete" 2>/dev/null)" = "$*" ] && return 0
  log "installing $what into $dir"
  rm -rf "$dir.partial"
  mkdir -p "$deps_dir"
  PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
    --no-deps --no-compile --target "$dir.partial" "$@" >&2
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
  echo "$*" > "$dir/.complete"
}
install_wheels "$torch_dir" "torch==$torch_version (LibTorch) and its runtime wheels" "${wheels[@]}"
# torch's pure-Python dependencies (its Requires-Dist without the CUDA and triton wheels), pinned,
# installed into the same directory: PYTHONPATH=<that directory> then imports torch with any
# python3 3.11, Debian's /usr/bin/python3 included, which has none of them (docs/python.md).
torch_python_deps=("typing-extensions==4.16.0" "filelock==4.3.1" "sympy==1.14.0" "mpmath==1.3.0" "networkx==3.5"
  "jinja2==3.1.6" "markupsafe==3.0.2" "fsspec==2026.9.0")
if [ "$(cat "$torch_dir/.complete-python-deps" 2>/dev/null)" != "${torch_python_deps[*]}" ]; then
  log "installing torch's Python dependencies into $torch_dir"
  rm -rf "$torch_dir.python-deps"
  PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
    --no-deps --no-compile --target "$torch_dir.python-deps" "${torch_python_deps[@]}" >&2
  cp -a "$torch_dir.python-deps/." "$torch_dir/"
  rm -rf "$torch_dir.python-deps"
  echo "${torch_python_deps[*]}" > "$torch_dir/.complete-python-deps"
fi
# Python's own safetensors reader, with which the tests check that our files open in other tools
# (it imports torch from the wheel above through PYTHONPATH; see tests/CMakeLists.txt).
install_wheels "$deps_dir/python-tools" "Python's safetensors reader and pytest (tests)" "safetensors==0.7.0" "packaging==24.2" \
  "pytest==8.3.4" "iniconfig==2.0.0" "pluggy==1.5.0"
echo "$torch_dir/torch/share/cmake"
