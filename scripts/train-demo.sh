#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains a small GPT on 2 local ranks on the
# embedded corpus (no download). Extra arguments go to `zerotrain train`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
torch_prefix=$(scripts/bootstrap.sh | tail -n 1)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$torch_prefix" >/dev/null
cmake --build build -j"${ZT_JOBS:-$(nproc)}" --target zerotrain_cli
exec build/bin/zerotrain train configs/demo.json --nproc 2 --summary runs/demo/summary.json "$@"
