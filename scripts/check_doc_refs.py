#!/usr/bin/env python3
"""Every file path, test name and section the documentation cites exists.

Reads README.md, CHANGELOG.md and docs/*.md. A path is a backticked span, or a docs/*.md
mention anywhere, that starts with one of the repository's top-level folders (src/, include/,
tests/, docs/, bench/, scripts/, configs/, examples/, fuzz/, cmake/); a test name is a
backticked Suite.Name (gtest's, optionally with a parameterised prefix Prefix/ and suffix /Value).
Paths with placeholders (<...>, {...}, *, $) and names with wildcards or an ellipsis are skipped.

A section reference, docs/<name>.md (or README) followed by a quoted name, as in
`docs/zero.md "Stage 3"`, is checked in those documents and in the source, test, benchmark and
build files too (where a cited docs/*.md must also exist): the name, ignoring case, backticks and
line breaks, must be part of a heading, a bold phrase or a table row's first cell of the named
file, or begin one of its list items.
Prints one line per missing reference and exits 1 when there is any.
"""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
folders = ("src/", "include/", "tests/", "docs/", "bench/", "scripts/", "configs/", "examples/", "fuzz/", "cmake/")
docs = [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").glob("*.md"))]

test_sources = "\n".join(p.read_text(errors="replace") for p in sorted((root / "tests").glob("*.cpp")))
declared = set(re.findall(r"\bTEST(?:_F|_P)?\(\s*(\w+)\s*,\s*(\w+)\s*\)", test_sources))
# INSTANTIATE_TEST_SUITE_P(Prefix, Suite, ...) and add_test(NAME Suite.Name) in CMake.
declared |= set(re.findall(r"add_test\(NAME\s+(\w+)\.(\w+)", (root / "tests" / "CMakeLists.txt").read_text()))

missing = []
for doc in docs:
    if not doc.exists():
        continue
    text = doc.read_text(errors="replace")
    rel = doc.relative_to(root)
    spans = re.findall(r"`([^`\n]+)`", text)
    mentions = set(re.findall(r"(?<![\w/.-])(docs/[\w.-]+\.md)\b", text))
    for span in spans:
        for token in span.split():
            token = token.strip("()[],;:'\"")
            token = re.sub(r":\d+$", "", token)  # file:line
            if token.startswith(folders):
                mentions.add(token)
    for path in sorted(mentions):
        if any(ch in path for ch in "<>{}*$…") or path.endswith("/..."):
            continue
        if not (root / path.rstrip("/")).exists():
            missing.append(f"{rel}: cites {path}, which does not exist")
    for span in spans:
        m = re.fullmatch(r"(?:\w+/)?([A-Z]\w*)\.([A-Z]\w*)(?:/\w+)?", span.strip())
        if not m or "…" in span:
            continue
        suite, name = m.group(1), m.group(2)
        if (suite, name) not in declared:
            missing.append(f"{rel}: cites the test {suite}.{name}, which no tests/*.cpp declares")


def normalise(text):
    return re.sub(r"\s+", " ", text.replace("`", "").replace("*", "")).strip().lower()


anchor_cache = {}


def anchors(path):
    """(texts a quoted name may be part of, texts it may begin) of one markdown file."""
    if path not in anchor_cache:
        within, starts = [], []
        for line in path.read_text(errors="replace").splitlines():
            heading = re.match(r"#{1,6}\s+(.*)", line)
            if heading:
                within.append(normalise(heading.group(1)))
            within += [normalise(bold) for bold in re.findall(r"\*\*(.+?)\*\*", line)]
            cell = re.match(r"\|([^|]+)\|", line)
            if cell:
                within.append(normalise(cell.group(1)))
            item = re.match(r"\s*(?:[-*]|\d+\.)\s+(.*)", line)
            if item:
                starts.append(normalise(item.group(1)))
        anchor_cache[path] = (within, starts)
    return anchor_cache[path]


# A line break inside a reference may carry a comment leader (// or #) on the next line.
BREAK = r"\n[ \t]*(?://+|#+)?[ \t]*"
section_ref = re.compile(r'(?<![\w/."-])(docs/[\w.-]+\.md|README(?:\.md)?),?(?:[ \t]+|[ \t]*' + BREAK + r')'
                         r'"([^"\n]{1,100}(?:' + BREAK + r'[^"\n]{1,100})?)"')
sources = [p for folder in ("src", "include", "tests", "bench", "scripts", "examples", "fuzz", "cmake")
           for p in sorted((root / folder).rglob("*"))
           if p.is_file() and p.suffix in {".h", ".cpp", ".cu", ".py", ".sh", ".cmake", ".txt"}]
sources += sorted(root.rglob("CMakeLists.txt"))
for source in sorted(set(sources)):
    text = source.read_text(errors="replace")
    rel = source.relative_to(root)
    for path in sorted(set(re.findall(r"(?<![\w/.-])(docs/[\w.-]+\.md)\b", text))):
        if not (root / path).exists():
            missing.append(f"{rel}: cites {path}, which does not exist")
sections = 0
for document in [*docs, *sorted(set(sources))]:
    if not document.exists():
        continue
    text = document.read_text(errors="replace")
    rel = document.relative_to(root)
    for m in section_ref.finditer(text):
        sections += 1
        target = root / ("README.md" if m.group(1).startswith("README") else m.group(1))
        if not target.exists():
            continue  # reported above
        name = normalise(re.sub(BREAK, " ", m.group(2)))
        within, starts = anchors(target)
        if not any(name in a for a in within) and not any(s.startswith(name) for s in starts):
            line = text.count("\n", 0, m.start()) + 1
            missing.append(f'{rel}:{line}: cites {m.group(1)} "{m.group(2)}", which has no such section')

for line in missing:
    print(line)
if missing:
    print(f"check_doc_refs: {len(missing)} reference(s) to nothing", file=sys.stderr)
    sys.exit(1)
print(f"check_doc_refs: every path and test name cited in {len(docs)} documents exists, and each of "
      f"{sections} section references names a section")
