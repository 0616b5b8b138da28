#!/usr/bin/env bash
# Installs the built project into a temporary prefix, builds tests/consumer against it with
# find_package(zerotrain), and runs it. Args: SOURCE_DIR BUILD_DIR TORCH_PREFIX_PATH
set -euo pipefail
src=$1 build=$2 torch_prefix=$3
work="$build/consumer-check"
rm -rf "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/tests/consumer" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_PREFIX_PATH=$work/prefix;$torch_prefix" >/dev/null
cmake --build "$work/build" -j2 >/dev/null
"$work/build/consumer"
