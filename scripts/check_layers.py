#!/usr/bin/env python3
"""Every project #include follows the layers of docs/architecture.md.

The layers are the rows of the table in docs/architecture.md, in its order: a layer may include
its own headers and those of the layers above it (earlier rows), never those of a layer below it.
A file's layer:
- src/<part>/...: the row whose "source" column names src/<part>/ (or a file in it);
  src/common/ is a utility layer every layer may include, and it includes only the errors layer;
- include/zerotrain/<name>.h: the row whose "header" column lists it as a public header (before
  the word "internal"), or the entry in EXTRA_HEADERS / HEADER_OWNER below.
Project includes are the `#include "..."` lines of src/** and include/zerotrain/**, in the forms
"zerotrain/x.h" (include/zerotrain/x.h) and "<part>/x.h" (src/<part>/x.h).

Prints one line per include of a lower layer's header ("file:line: <layer> includes <header> of
layer <layer> (below it)") that ALLOWED does not list, one per ALLOWED entry that no longer
matches any include, and exits 1 when there is any; otherwise one summary line. Exits 2 when the
table cannot be read or a file has no layer (the table, or the mappings below, need a row).
"""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"}
COMMON = "common"

# Public headers that the table's header column does not list: their layer, and why.
EXTRA_HEADERS = {
    "comms_logger.h": "comm",  # the comm row's "owns" column names it; implemented in src/comm/
    "version.h": COMMON,       # the library's version string; implemented in src/common/
}
# Public headers that the header column lists in more than one row: the layer that owns them.
HEADER_OWNER = {
    # Declares Engine (and WeightReader); the checkpoint row lists it for save_checkpoint and
    # load_checkpoint, which are Engine's members.
    "engine.h": "zero (engine)",
}

# Upward includes that exist today, as (including file, included header as written): each with
# the reason it runs upward. Any other upward include fails the check; an entry that no longer
# matches fails too, so that the list only shrinks.
ALLOWED = {
}


def fail_setup(message):
    print(f"check_layers: {message}", file=sys.stderr)
    sys.exit(2)


def read_table():
    """[(layer, public header names, src parts)] in the table's order."""
    text = (root / "docs" / "architecture.md").read_text()
    rows, in_table = [], False
    for line in text.splitlines():
        if re.match(r"\|\s*layer\s*\|\s*header\s*\|\s*source\s*\|", line):
            in_table = True
            continue
        if not in_table:
            continue
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or set(cells[0]) <= set("-: "):
            continue
        layer, header_cell, source_cell = cells[0], cells[1], cells[2]
        public_part = header_cell.split("internal")[0]
        headers = [h for h in re.findall(r"`([^`]+)`", public_part) if h.endswith(".h") and not h.startswith("src/")]
        parts = re.findall(r"`src/(\w+)/[^`]*`", source_cell)
        rows.append((layer, headers, parts))
    if len(rows) < 10:
        fail_setup(f"read {len(rows)} rows from the layer table of docs/architecture.md; expected its 14")
    return rows


rows = read_table()
rank = {COMMON: 0}
part_layer = {COMMON: COMMON}
header_layer = dict(EXTRA_HEADERS)
listed = {}
for i, (layer, headers, parts) in enumerate(rows):
    rank[layer] = i
    for part in parts:
        part_layer[part] = layer
    for header in headers:
        listed.setdefault(header, []).append(layer)
for header, layers in listed.items():
    if header in HEADER_OWNER:
        if HEADER_OWNER[header] not in layers:
            fail_setup(f"HEADER_OWNER gives {header} to {HEADER_OWNER[header]}, which the table does not list it under")
        header_layer[header] = HEADER_OWNER[header]
    elif len(layers) > 1:
        fail_setup(f"the table lists {header} under {', '.join(layers)}: say which owns it in HEADER_OWNER")
    else:
        header_layer[header] = layers[0]
for layer in list(EXTRA_HEADERS.values()) + list(HEADER_OWNER.values()):
    if layer not in rank:
        fail_setup(f"the mappings name the layer '{layer}', which is no row of the table")

public_dir = root / "include" / "zerotrain"
files = sorted(p for d in (root / "src", public_dir) for p in d.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES)


def layer_of(path):
    rel = path.relative_to(root)
    if rel.parts[0] == "src":
        layer = part_layer.get(rel.parts[1])
        if layer is None:
            fail_setup(f"{rel}: no row of the layer table names src/{rel.parts[1]}/ in its source column")
        return layer
    name = path.relative_to(public_dir).as_posix()
    layer = header_layer.get(name)
    if layer is None:
        fail_setup(f"{rel}: no row of the layer table lists {name} as a public header (nor EXTRA_HEADERS)")
    return layer


def resolve(target):
    if target.startswith("zerotrain/"):
        return root / "include" / target
    return root / "src" / target


include_re = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
problems, used_allowed, count = [], set(), 0
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
        if rank[target_layer] <= rank[layer]:
            continue
        if (rel, target) in ALLOWED:
            used_allowed.add((rel, target))
            continue
        problems.append(f"{rel}:{number}: {layer} includes {target} of layer {target_layer} (below it)")

for rel, target in sorted(set(ALLOWED) - used_allowed):
    problems.append(f"scripts/check_layers.py: the exception ({rel}, {target}) no longer occurs: remove it from ALLOWED")

if problems:
    print("\n".join(problems))
    print(f"check_layers: {len(problems)} problem(s); a layer uses only its own headers and those of the "
          "layers above it in the table of docs/architecture.md")
    sys.exit(1)
print(f"check_layers: {len(files)} files, {count} project includes, all follow the layers "
      f"({len(used_allowed)} known exceptions)")
