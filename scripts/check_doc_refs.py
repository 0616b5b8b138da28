#!/usr/bin/env python3
"""Every file path and test name the documentation cites exists.

Reads README.md, CHANGELOG.md and docs/*.md. A path is a backticked span, or a docs/*.md
mention anywhere, that starts with one of the repository's top-level folders (src/, include/,
tests/, docs/, bench/, scripts/, configs/, examples/, fuzz/, cmake/); a test name is a
backticked Suite.Name (gtest's, optionally with a parameterised prefix Prefix/ and suffix /Value).
Paths with placeholders (<...>, {...}, *, $) and names with wildcards or an ellipsis are skipped.
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

for line in missing:
    print(line)
if missing:
    print(f"check_doc_refs: {len(missing)} reference(s) to nothing", file=sys.stderr)
    sys.exit(1)
print(f"check_doc_refs: every path and test name cited in {len(docs)} documents exists")
