# Sourced by the suite scripts (test.sh, nightly.sh): installs what is missing (bootstrap), then
# sets torch_prefix and jobs, exports them for fuzz.sh and sanitize.sh, and defines stamp.
torch_prefix=$(scripts/bootstrap.sh | tail -n 1)
jobs=${ZT_JOBS:-$(nproc)}
export ZT_TORCH_PREFIX="$torch_prefix" ZT_JOBS="$jobs"
stamp() { echo "== [$(date +%H:%M:%S)] $* =="; }
