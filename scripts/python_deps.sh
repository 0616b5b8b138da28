#!/usr/bin/env bash
# Hugging Face transformers, Accelerate and TRL, pinned, for the tests that check our Hugging Face
# exports and model.init_from against the real library (tests/hf_test.cpp) and run the Trainer,
# Accelerate and TRL on zerotrain (tests/oracle/hf_clients.py): installed beside the torch wheel
# that scripts/bootstrap.sh unpacks, never into the system's Python.
#   - $ZT_DEPS_DIR/hf-<version>/site: transformers and its pure-Python dependencies, every wheel
#     pinned and installed with --no-deps (pip never pulls a second torch); torch itself comes from
#     $ZT_DEPS_DIR/torch-<version> through PYTHONPATH. The set is what pip resolves for
#     transformers==<version> on Python 3.11, frozen here.
# Run: installs (idempotent), checks that `from transformers import GPT2LMHeadModel` works with
# that torch, and prints the PYTHONPATH to use as its last line. Exit status non-zero (with the
# reason on stderr) when it cannot install, e.g. without access to the package index: the tests
# that need it then skip, saying so.
# Sourced: defines hf_install and hf_pythonpath.
_hf_here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$_hf_here/scripts/pinned_wheels.sh"
hf_version=$(tr -d '[:space:]' < "$_hf_here/cmake/transformers-version.txt")
_hf_torch_version=$(tr -d '[:space:]' < "$_hf_here/cmake/torch-version.txt")
_hf_deps=${ZT_DEPS_DIR:-$HOME/.cache/zerotrain}
hf_torch_dir="$_hf_deps/torch-$_hf_torch_version"
hf_dir="$_hf_deps/hf-$hf_version"
hf_wheels=("transformers==$hf_version" "huggingface-hub==2.4.0" "tokenizers==0.23.3" "safetensors==0.8.0"
  "numpy==2.4.6" "packaging==26.4" "pyyaml==6.0.4" "regex==2026.11.19" "tqdm==4.70.1" "typer==0.29.2"
  "annotated-doc==0.0.7" "click==8.5.1" "filelock==4.3.1" "fsspec==2026.9.0" "hf-xet==1.8.0"
  "httpx2==2.16.2" "httpcore2==2.16.2" "pydantic==2.14.4" "pydantic-core==2.50.5" "rich==15.0.0"
  "shellingham==1.5.4" "typing-extensions==4.16.0" "annotated-types==0.8.0" "anyio==4.16.0" "idna==3.20"
  "markdown-it-py==4.3.0" "pygments==2.21.0" "truststore==0.10.5" "typing-inspection==0.4.5" "h11==0.16.0"
  "mdurl==0.1.2"
  # Accelerate and TRL, and what they need beyond the above (TRL's datasets: pyarrow, pandas, ...).
  "accelerate==1.16.0" "trl==1.16.0" "datasets==5.2.0" "psutil==7.2.2" "dill==0.4.1" "multiprocess==0.70.19"
  "pandas==3.1.1" "pyarrow==26.0.1" "python-dateutil==4.0.0" "tzdata==2026.6" "xxhash==4.1.0"
  # torch's own pure-Python dependencies (the bootstrap installs torch alone).
  "sympy==1.14.0" "mpmath==1.3.0" "networkx==3.5" "jinja2==3.1.6" "markupsafe==3.0.2")

_hf_log() { echo "[python-deps] $*" >&2; }

hf_pythonpath() { echo "$hf_dir/site:$hf_torch_dir"; }

hf_install() {
  if [ ! -d "$hf_torch_dir/torch" ]; then
    _hf_log "torch wheel not found at $hf_torch_dir: run scripts/bootstrap.sh first"
    return 1
  fi
  pinned_wheels_install "$hf_dir" python-deps "${hf_wheels[@]}" || return 1
  if ! PYTHONPATH="$(hf_pythonpath)" PYTHONNOUSERSITE=1 HF_HUB_OFFLINE=1 python3 -c \
    'import transformers, torch, accelerate, trl; from transformers import GPT2LMHeadModel; print(f"transformers {transformers.__version__}, accelerate {accelerate.__version__}, trl {trl.__version__} on torch {torch.__version__}")' >&2; then
    _hf_log "transformers $hf_version does not import with the torch at $hf_torch_dir"
    return 1
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  hf_install
  hf_pythonpath
fi
