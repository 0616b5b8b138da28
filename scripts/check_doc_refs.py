#!/usr/bin/env python3
"""Every file path, test name, command-line flag and section the documentation cites exists.

Reads README.md, CHANGELOG.md, docs/*.md and each source folder's src/*/README.md (the
documents) and checks:

- Paths: every word, in backticks or in prose, that starts with one of the repository's
  top-level folders (src/, include/, tests/, docs/, bench/, scripts/, configs/, examples/,
  fuzz/, cmake/, python/) must exist; `a.{h,cpp}` is expanded to each file. Relative links,
  [text](target), must exist beside the document. Paths with placeholders (<...>, *, $, an
  ellipsis) are skipped.
- GoogleTest and ctest names: a Suite.Name in backticks (optionally Prefix/Suite.Name/Value, as
  ctest lists parameterised tests), even when the line breaks inside it, and a Suite.Name in prose
  whose suite tests/ declares, must be a TEST/TEST_F/TEST_P of tests/ or an add_test(NAME ...) of
  a CMakeLists.txt. `Suite.*` needs the suite; `Suite.Start…End` or `Suite.Start*` needs a test
  that matches.
- pytest names: `test_name`, `file.py::test_name` and `file.py::test_name[param]` must be a
  `def test_...` of a tests/**/*.py (in that file, when one is named); a bare `test_x` may also
  be the module tests/python/test_x.py.
- Command-line flags: every --flag that docs/cli.md shows must be declared in src/cli/ (main.cpp
  and one source per subcommand)
  (or be one of the few flags of other programs it quotes, listed below).
- Sections: docs/<name>.md (or README) followed by a quoted name, as in `docs/zero.md "Stage 3"`,
  in the documents and in the source, test, benchmark and build files (where a cited docs/*.md
  must also exist): the name, ignoring case, backticks and line breaks, must be part of a heading,
  a bold phrase or a table row's first cell of the named file, or begin one of its list items.

Prints one line per missing reference, naming the file and line, and exits 1 when there is any.
"""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("src", "include", "tests", "docs", "bench", "scripts", "configs", "examples", "fuzz", "cmake", "python")
docs = [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").glob("*.md")),
        *sorted((root / "src").glob("*/README.md"))]
docs = [d for d in docs if d.exists()]
missing = []


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


def report(doc, text, offset, message):
    missing.append(f"{doc.relative_to(root)}:{line_of(text, offset)}: {message}")


def skipped(path):
    return any(ch in path for ch in "<>*$…") or "..." in path


def expand_braces(path):
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand_braces(path[:m.start()] + alt + path[m.end():])]


# ---- what exists -------------------------------------------------------------------------------
test_cpp = sorted((root / "tests").rglob("*.cpp"))
gtests = set()
for source in test_cpp:
    gtests |= set(re.findall(r"\bTEST(?:_F|_P)?\(\s*(\w+)\s*,\s*(\w+)\s*\)", source.read_text(errors="replace")))
for cmake in sorted(root.rglob("CMakeLists.txt")):
    if "build" in cmake.relative_to(root).parts[:1]:
        continue
    gtests |= set(re.findall(r"add_test\(\s*NAME\s+(\w+)\.(\w+)", cmake.read_text(errors="replace")))
suites = {suite for suite, _ in gtests}

pytests = {}  # test function name -> files (relative) that define it
for source in sorted((root / "tests").rglob("*.py")):
    for name in re.findall(r"^\s*def (test_\w+)\s*\(", source.read_text(errors="replace"), re.M):
        pytests.setdefault(name, set()).add(str(source.relative_to(root)))

cli_source = "\n".join(p.read_text(errors="replace") for p in sorted((root / "src" / "cli").glob("*.cpp")))
cli_flags = set(re.findall(r'"(--[a-z][\w-]*)', cli_source)) | set(re.findall(r",(--[a-z][\w-]*)", cli_source))
cli_flags |= {"--help", "--version"}  # CLI11's own
# Flags of other programs that docs/cli.md quotes beside zerotrain's.
OTHER_PROGRAMS = {"--no-python", "--nproc_per_node", "--nnodes", "--node_rank", "--rdzv-backend", "--rdzv-endpoint"}


# ---- paths -------------------------------------------------------------------------------------
path_word = re.compile(r"(?<![\w/.~$@:-])((?:" + "|".join(FOLDERS) + r")/[\w./+{},-]*)")
for doc in docs:
    text = doc.read_text(errors="replace")
    for m in path_word.finditer(text):
        raw = re.sub(r":\d+(?:-\d+)?$", "", m.group(1).rstrip(".,;:)'\""))  # file:line
        if skipped(raw) or raw.endswith("/..."):
            continue
        for path in expand_braces(raw):
            path = path.rstrip(".,;:")
            if path and not (root / path.rstrip("/")).exists():
                report(doc, text, m.start(), f"cites {path}, which does not exist")
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"[a-z]+:", target) or skipped(target) or target.startswith(tuple(f + "/" for f in FOLDERS)):
            continue
        if not (doc.parent / target).exists():
            report(doc, text, m.start(), f"links {target}, which does not exist beside {doc.name}")


# ---- test names --------------------------------------------------------------------------------
def gtest_matches(suite, name):
    if name == "*":
        return suite in suites
    if "…" in name or "*" in name:
        pattern = re.escape(name).replace("…", ".*").replace(r"\*", ".*")
        return any(s == suite and re.fullmatch(pattern, n) for s, n in gtests)
    return (suite, name) in gtests


GTEST = r"(?:\w+/)?([A-Z]\w*)\.([A-Z][\w…*]*|\*)(?:/\w+)?"
cited_tests = 0
for doc in docs:
    text = doc.read_text(errors="replace")
    seen = set()
    # Backticked spans outside fenced code blocks (blanked, keeping the line numbers), a line
    # break inside one joined (`Suite.Long\n  Name`).
    prose = re.sub(r"^[ \t]*```.*?^[ \t]*```", lambda f: "\n" * f.group(0).count("\n"), text, flags=re.M | re.S)
    for m in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", prose):
        span = m.group(1)
        joined = re.sub(r"\s*\n\s*", "", span.strip())
        t = re.fullmatch(GTEST, joined)
        if t:
            cited_tests += 1
            seen.add(m.start())
            if not gtest_matches(t.group(1), t.group(2)):
                report(doc, text, m.start(), f"cites the test {joined}, which no tests/ file or add_test declares")
            continue
        p = re.fullmatch(r"(?:([\w/.-]+\.py)::)?(test_\w+)(?:\[[^\]]*\])?", joined)
        if p:
            cited_tests += 1
            file, name = p.group(1), p.group(2)
            if file and file not in pytests.get(name, set()):
                report(doc, text, m.start(), f"cites the pytest test {file}::{name}, which that file does not define")
            elif not file and name not in pytests and not (root / "tests" / "python" / f"{name}.py").exists():
                report(doc, text, m.start(), f"cites the pytest test {name}, which no tests/**/*.py defines")
    # Prose: Suite.Name of a suite that exists (a renamed or mistyped test of a known suite).
    for m in re.finditer(r"(?<![\w/.`])([A-Z]\w*)\.([A-Z]\w*)\b(?![\w`(])", text):
        if m.group(1) not in suites:
            continue
        cited_tests += 1
        if not gtest_matches(m.group(1), m.group(2)):
            report(doc, text, m.start(), f"cites the test {m.group(0)}, which no tests/ file or add_test declares")
    # path::test_name in prose.
    for m in re.finditer(r"(?<![\w/.-])((?:tests/)[\w/.-]+\.py)::(test_\w+)", text):
        cited_tests += 1
        if m.group(1) not in pytests.get(m.group(2), set()):
            report(doc, text, m.start(), f"cites the pytest test {m.group(1)}::{m.group(2)}, which that file does not define")


# ---- command-line flags of docs/cli.md ---------------------------------------------------------
cli_doc = root / "docs" / "cli.md"
if cli_doc.exists() and cli_source:
    text = cli_doc.read_text(errors="replace")
    for m in re.finditer(r"(?<![\w-])(--[a-z][\w-]*)", text):
        flag = m.group(1)
        if flag not in cli_flags and flag not in OTHER_PROGRAMS:
            report(cli_doc, text, m.start(), f"shows the flag {flag}, which src/cli/ does not declare")


# ---- sections ----------------------------------------------------------------------------------
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
sources = [p for folder in ("src", "include", "tests", "bench", "scripts", "examples", "fuzz", "cmake", "python")
           for p in sorted((root / folder).rglob("*"))
           if p.is_file() and p.suffix in {".h", ".cpp", ".cu", ".py", ".sh", ".cmake", ".txt"}]
sources += [p for p in sorted(root.rglob("CMakeLists.txt")) if p.relative_to(root).parts[0] not in {"build"}
            and not p.relative_to(root).parts[0].startswith(("build", "."))]
sources = sorted(set(sources))
for source in sources:
    text = source.read_text(errors="replace")
    for m in re.finditer(r"(?<![\w/.-])(docs/[\w.-]+\.md)\b", text):
        if not (root / m.group(1)).exists():
            report(source, text, m.start(), f"cites {m.group(1)}, which does not exist")
sections = 0
for document in [*docs, *sources]:
    text = document.read_text(errors="replace")
    for m in section_ref.finditer(text):
        sections += 1
        target = root / ("README.md" if m.group(1).startswith("README") else m.group(1))
        if not target.exists():
            continue  # reported above
        name = normalise(re.sub(BREAK, " ", m.group(2)))
        within, starts = anchors(target)
        if not any(name in a for a in within) and not any(s.startswith(name) for s in starts):
            report(document, text, m.start(), f'cites {m.group(1)} "{m.group(2)}", which has no such section')

missing = sorted(set(missing), key=lambda line: (line.split(":")[0], int(line.split(":")[1])))
for line in missing:
    print(line)
if missing:
    print(f"check_doc_refs: {len(missing)} reference(s) to nothing", file=sys.stderr)
    sys.exit(1)
print(f"check_doc_refs: in {len(docs)} documents every cited path and each of {cited_tests} test names exists "
      f"({len(gtests)} GoogleTest/ctest and {len(pytests)} pytest tests declared), and each of {sections} "
      f"section references names a section")
