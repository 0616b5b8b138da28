#!/usr/bin/env bash
# DeepSpeed, pinned, for the peer benchmarks (bench/offload_vs_deepspeed.sh): installed beside the
# torch wheel that scripts/bootstrap.sh unpacks, never into the system's Python.
#   - $ZT_DEPS_DIR/deepspeed-<version>/site: DeepSpeed and its pure-Python dependencies (pinned,
#     --no-deps, so pip never pulls a second torch or the CUDA wheels); torch itself comes from
#     $ZT_DEPS_DIR/torch-<version> through PYTHONPATH.
#   - $ZT_DEPS_DIR/deepspeed-<version>/torch-extensions: DeepSpeed's JIT-built CPU ops (cpu_adam,
#     fused_adam, async_io, pin_memory), built once with ninja and g++ and reused (a new CPU kind
#     changes their -march flags, and so their build hash: they are rebuilt, not misused).
#   - libaio-dev from Debian when missing (DeepSpeed's async_io op links -laio).
# Sourced: defines ds_install and ds_env (exports PYTHONPATH, PATH, DS_ACCELERATOR, ...).
#   ds_install [OP...] builds only the named CPU ops (cpu_adam fused_adam async_io; default all
#   three): the oracle (tests/oracle/run.sh) steps in memory and needs fused_adam alone.
# Run: installs (idempotent), prints what it did, and prints the environment lines on stdout.
_ds_here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$_ds_here/scripts/pinned_wheels.sh"
ds_version=0.19.8
_ds_torch_version=$(tr -d '[:space:]' < "$_ds_here/cmake/torch-version.txt")
_ds_deps=${ZT_DEPS_DIR:-$HOME/.cache/zerotrain}
ds_torch_dir="$_ds_deps/torch-$_ds_torch_version"
ds_dir="$_ds_deps/deepspeed-$ds_version"
# DeepSpeed's requirements (requirements/requirements.txt of 0.19.8: einops hjson msgpack ninja
# numpy packaging psutil py-cpuinfo pydantic>=2 tqdm, torch) and torch's pure-Python ones
# (filelock typing-extensions sympy networkx jinja2 fsspec setuptools<82), each pinned.
ds_wheels=("deepspeed==$ds_version" "einops==0.8.1" "hjson==3.1.0" "msgpack==1.1.1" "ninja==1.11.1.4"
  "numpy==2.2.6" "packaging==24.2" "psutil==7.0.0" "py-cpuinfo==9.0.0" "pydantic==2.11.7"
  "pydantic-core==2.33.2" "annotated-types==0.7.0" "typing-inspection==0.4.1" "typing-extensions==4.14.1"
  "tqdm==4.67.1" "filelock==3.18.0" "fsspec==2025.5.1" "sympy==1.14.0" "mpmath==1.3.0" "networkx==3.5"
  "jinja2==3.1.6" "markupsafe==3.0.2" "setuptools==80.9.0")

_ds_log() { echo "[deepspeed-env] $*" >&2; }

ds_env() {
  export PYTHONPATH="$ds_dir/site:$ds_torch_dir${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$ds_dir/site/bin:$PATH"
  export DS_ACCELERATOR=cpu
  export TORCH_EXTENSIONS_DIR="$ds_dir/torch-extensions"
  # No GPU here: keep DeepSpeed's op builders from looking for CUDA.
  export CUDA_VISIBLE_DEVICES=""
  export PYTHONNOUSERSITE=1
}

ds_install() {
  if [ ! -d "$ds_torch_dir/torch" ]; then
    _ds_log "torch wheel not found at $ds_torch_dir: run scripts/bootstrap.sh first"
    return 1
  fi
  if ! dpkg-query -W -f='${Status}' libaio-dev 2>/dev/null | grep -q "install ok installed"; then
    _ds_log "installing Debian package libaio-dev (DeepSpeed's async_io op links -laio)"
    local sudo_cmd=(); [ "$(id -u)" = 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends libaio-dev >&2
  else
    _ds_log "libaio-dev: already installed"
  fi
  # DS_BUILD_OPS=0: no op is compiled at install time; the ones used are JIT-built below.
  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pinned_wheels_install "$ds_dir" deepspeed-env "${ds_wheels[@]}" || return 1
  ds_env
  # JIT-build the CPU ops the runs load (each about two minutes on 2 cores the first
  # time); later loads find them in $TORCH_EXTENSIONS_DIR and only check them.
  local t0=$SECONDS ops=("$@")
  ((${#ops[@]})) || ops=(cpu_adam fused_adam async_io)
  _ds_log "building or checking DeepSpeed's CPU ops (${ops[*]}) in $TORCH_EXTENSIONS_DIR"
  python3 - "${ops[@]}" >&2 <<'PY'
import sys, warnings
warnings.filterwarnings("ignore")
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder, FusedAdamBuilder
print(f"accelerator: {get_accelerator().device_name()}, communication backend: {get_accelerator().communication_backend_name()}")
# cpu_adam steps offloaded optimizers, fused_adam the in-memory ones; async_io does the NVMe swapping.
builders = {"cpu_adam": CPUAdamBuilder, "fused_adam": FusedAdamBuilder, "async_io": AsyncIOBuilder}
for name in sys.argv[1:]:
    if name not in builders:
        raise SystemExit(f"unknown DeepSpeed op {name!r}: expected one of {', '.join(builders)}")
    b = builders[name]()
    if not b.is_compatible(verbose=True):
        raise SystemExit(f"DeepSpeed op {b.NAME} is not buildable here")
    b.load(verbose=False)
    print(f"op {b.NAME}: loaded")
PY
  _ds_log "ops ready ($((SECONDS - t0)) s)"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  ds_install
  echo "export PYTHONPATH=$PYTHONPATH"
  echo "export PATH=$ds_dir/site/bin:\$PATH DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR CUDA_VISIBLE_DEVICES="
fi
