#!/usr/bin/env bash
# `pip wheel .` and `pip install` of that wheel as a Python user runs them, with pip's build
# isolation, into a fresh virtual environment that has torch; then the Python tests run against the
# installed package (not build/python). It builds the whole library through scikit-build-core
# (about 15 minutes on 2 cores the first time; build/pip-<tag>/ is kept for the next run), which is
# why the test command does not run it.
#   scripts/python_pip_install.sh
# The environment's torch is the bootstrap's torch wheel (cmake/torch-version.txt), made visible to
# the virtual environment by a .pth file: a torch installed from PyPI brings several GB of CUDA
# wheels. For the same reason pip installs with --no-deps here (torch's own CUDA dependencies are
# not in that folder); the build requirements (scikit-build-core, and CMake or Ninja when missing)
# come from PyPI into pip's isolated build environment as usual.
# Prints the pytest summary; the exit status is pytest's (2 when the set-up or the build fails).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
deps=${ZT_DEPS_DIR:-$HOME/.cache/zerotrain}
work="$deps/pip-install-check"
log() { echo "[python-pip-install] $*" >&2; }
[ -x build/bin/zerotrain ] || { log "build/bin/zerotrain is missing: run scripts/test.sh (or its build) first"; exit 2; }
torch_prefix=$(scripts/bootstrap.sh 2>/dev/null | tail -n 1)
torch_site=$(dirname "$(dirname "$(dirname "$torch_prefix")")")
hf_path=$(scripts/python_deps.sh | tail -n 1) || { log "transformers could not be installed"; exit 2; }
hf_site=${hf_path%%:*}

rm -rf "$work/venv" "$work/wheels"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$torch_site" >"$site/zerotrain-check-torch.pth"
log "virtual environment $work/venv with torch $("$py" -c 'import torch; print(torch.__version__)')"

log "pip wheel . (build isolation on; the log: $work/pip-wheel.log)"
if ! "$py" -m pip wheel --no-deps --wheel-dir "$work/wheels" . >"$work/pip-wheel.log" 2>&1; then
  log "pip wheel failed:"; tail -20 "$work/pip-wheel.log" >&2; exit 2
fi
wheel=$(ls "$work/wheels"/zerotrain-*.whl)
log "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"
"$py" -m pip install --no-deps "$wheel" >"$work/pip-install.log" 2>&1 ||
  { log "pip install failed:"; tail -20 "$work/pip-install.log" >&2; exit 2; }
(cd /tmp && "$py" -c 'import zerotrain, zerotrain._build_info as b
print(f"[python-pip-install] import zerotrain: {zerotrain.__file__}, built against torch {b.TORCH_VERSION}")') >&2

log "Python tests against the installed package"
ZT_BIN=$PWD/build/bin/zerotrain PYTHONPATH="$hf_site:$deps/python-tools" \
  "$py" -m pytest -q -rs -p no:cacheprovider tests/python
