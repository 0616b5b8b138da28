#!/usr/bin/env python3
"""Every project #include follows the layers of src/layers.txt, and every file's layer is its folder.

src/layers.txt lists the layers in order, each with its folders (src/<part> and, where the layer
has public headers, include/zerotrain/<part>; include/zerotrain itself holds the common layer's
headers). A file may include the headers of its own layer and of earlier layers, never those of a
later layer. Project includes are the `#include "..."` lines of src/** and include/zerotrain/**,
in the forms "zerotrain/x.h" (include/zerotrain/x.h) and "<part>/x.h" (src/<part>/x.h).

Prints one line per upward include ("file:line: <layer> includes <header> of layer <layer>, a later
layer") and per source file in a folder the table does not name, and exits 1 when there is any;
otherwise one summary line. Exits 2 when src/layers.txt cannot be read. There is no list of
exceptions: an include that runs upward is moved, or the header is.
"""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"}
TABLE = root / "src" / "layers.txt"


def read_table():
    """{folder relative to the root: (rank, layer name)}."""
    folders = {}
    try:
        lines = TABLE.read_text().splitlines()
    except OSError as e:
        sys.exit(f"check_layers: cannot read {TABLE.relative_to(root)}: {e.strerror}")
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) < 2:
            print(f"check_layers: {TABLE.relative_to(root)}:{number}: expected a layer and its folders, found '{line}'",
                  file=sys.stderr)
            sys.exit(2)
        rank = len({layer for _, layer in folders.values()})
        for folder in words[1:]:
            if not (root / folder).is_dir():
                print(f"check_layers: {TABLE.relative_to(root)}:{number}: the folder {folder} does not exist",
                      file=sys.stderr)
                sys.exit(2)
            folders[folder] = (rank, words[0])
    return folders


folders = read_table()
problems = []


def layer_of(path):
    folder = path.parent.relative_to(root).as_posix()
    found = folders.get(folder)
    if found is None:
        problems.append(f"{path.relative_to(root)}: its folder {folder} is no layer's ({TABLE.relative_to(root)})")
    return found


def resolve(target):
    return root / "include" / target if target.startswith("zerotrain/") else root / "src" / target


files = sorted(p for d in (root / "src", root / "include" / "zerotrain") for p in d.rglob("*")
               if p.is_file() and p.suffix in SOURCE_SUFFIXES)
include_re = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
count = 0
for path in files:
    rel = path.relative_to(root).as_posix()
    layer = layer_of(path)
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        m = include_re.match(line)
        if not m:
            continue
        target = m.group(1)
        target_path = resolve(target)
        if not target_path.is_file():
            problems.append(f"{rel}:{number}: includes \"{target}\", but {target_path.relative_to(root)} does not exist")
            continue
        count += 1
        target_layer = layer_of(target_path)
        if layer and target_layer and target_layer[0] > layer[0]:
            problems.append(f"{rel}:{number}: {layer[1]} includes {target} of layer {target_layer[1]}, a later layer")

if problems:
    print("\n".join(sorted(set(problems))))
    print(f"check_layers: {len(set(problems))} problem(s); a file includes only the headers of its own layer and "
          f"of the layers before it in {TABLE.relative_to(root)}")
    sys.exit(1)
layers = len({layer for _, layer in folders.values()})
print(f"check_layers: {len(files)} files in {len(folders)} folders of {layers} layers, {count} project includes, "
      "none to a later layer")
