#!/usr/bin/env bash
# Builds an HTML reference of the public API (the headers in include/zerotrain/) with Doxygen,
# into build/api/html; installs Debian's doxygen when it is missing. The Doxyfile is written
# into build/api/ on every run (generated, not kept in the repository). Each header states its
# contract in its leading comment: every file's page links to its source, where it is read.
# Prints the path of index.html on its last line.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out="$root/build/api"

if ! command -v doxygen >/dev/null 2>&1; then
  echo "[api_docs] installing Debian package: doxygen" >&2
  sudo_cmd=(); [ "$(id -u)" = 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends doxygen >&2
fi

version=$(sed -n 's/^project(zerotrain VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
mkdir -p "$out"
rm -rf "$out/html"
cat > "$out/Doxyfile" <<EOF
PROJECT_NAME           = zerotrain
PROJECT_NUMBER         = "$version"
PROJECT_BRIEF          = "ZeRO stages on LibTorch: the public API"
INPUT                  = "$root/include/zerotrain"
RECURSIVE              = YES
FILE_PATTERNS          = *.h
FULL_PATH_NAMES        = YES
STRIP_FROM_PATH        = "$root/include"
STRIP_FROM_INC_PATH    = "$root/include"
OUTPUT_DIRECTORY       = "$out"
EXTRACT_ALL            = YES
EXTRACT_STATIC         = YES
SOURCE_BROWSER         = YES
GENERATE_HTML          = YES
HTML_OUTPUT            = html
GENERATE_LATEX         = NO
HAVE_DOT               = NO
QUIET                  = YES
WARN_IF_UNDOCUMENTED   = NO
EOF

(cd "$out" && doxygen Doxyfile)
echo "$out/html/index.html"
