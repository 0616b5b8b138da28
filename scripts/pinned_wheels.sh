# Sourced by scripts/python_deps.sh and bench/deepspeed_env.sh: installs a pinned set of wheels
# into a directory of their own beside the torch wheel, never into the system's Python.
#   pinned_wheels_install DIR LABEL WHEEL...
# installs WHEEL... (each name==version) with --no-deps (pip never pulls a second torch or the
# CUDA wheels) into DIR/site. DIR/site/.complete records the wheel set, so a changed pin
# reinstalls instead of being skipped; an interrupted install leaves only DIR/site.partial, which
# the next run discards. Messages go to stderr prefixed with [LABEL]; the status is non-zero, with
# the reason, when pip fails (no access to the package index, ...).
# Environment passed through to pip's build: whatever the caller exports (DeepSpeed reads
# DS_BUILD_OPS and DS_ACCELERATOR at install time).
pinned_wheels_install() {
  local dir=$1 label=$2
  shift 2
  if [ "$(cat "$dir/site/.complete" 2>/dev/null)" = "$*" ]; then
    echo "[$label] $1: already in $dir/site" >&2
    return 0
  fi
  echo "[$label] installing $1 and its pinned dependencies into $dir/site" >&2
  rm -rf "$dir/site.partial"
  mkdir -p "$dir"
  if ! PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet \
    --disable-pip-version-check --no-deps --no-compile --target "$dir/site.partial" "$@" >&2; then
    echo "[$label] pip could not install the pinned wheels (no access to the package index?)" >&2
    rm -rf "$dir/site.partial"
    return 1
  fi
  rm -rf "$dir/site"
  mv "$dir/site.partial" "$dir/site"
  echo "$*" >"$dir/site/.complete"
}
