#!/usr/bin/env python3
"""Source files and functions stay small enough to read.

C++: every file under src/ (.h, .hpp, .cpp, .cc, .cu, .cuh) has at most MAX_FILE_LINES lines, and
every function at most MAX_FUNCTION_LINES lines (from the first line of its signature to its
closing brace) unless a comment beside it gives the reason: a line comment starting "long:" on
the signature's first line or in the comment block directly above it, as in
    // long: one sequence of collectives that every rank runs in the same order
Functions are found by a brace-matching heuristic: comments, string and character literals are
blanked; a '{' outside any function whose statement text ends in a parameter list (with
qualifiers, a trailing return type or a constructor's initializer list after it) opens a
function, unless the statement starts with a control keyword. Lambdas and local classes count
toward the function around them.

Python: every .py file under python/ (the zerotrain package, the pip build backend, the
DeepSpeed companion package; build outputs, in folders named build* or __pycache__ or *.egg-info,
are left out) has at most MAX_FILE_LINES lines, and every function at most MAX_FUNCTION_LINES
lines, measured with the ast module from its `def` line to its last line (decorators not
counted). Only the outermost function of a nesting is measured: nested functions, classes and
lambdas count toward the function around them; a method is outermost within its class (named
Class.method). The reason is a comment starting "long:" on the `def` line or in the comment
block directly above it (decorators between are fine), as in
    # long: one table of the exposed names, a row per name
A file that ast cannot parse is a problem.

FILE_ALLOWED lists the files that may stay longer (their functions are not checked either), and
FUNCTION_ALLOWED the functions outside the engine that are longer today, as (file, name), each
with the reason; an entry that no longer applies fails, so that the lists only shrink.
Prints one line per problem and exits 1 when there is any; otherwise one summary line.
`--self-test` runs the checks on small trees made in a temporary folder (outside the repository)
and exits 1 unless each case gives the verdict expected of it.
"""
import ast
import io
import pathlib
import re
import sys
import tempfile
import tokenize

root = pathlib.Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"}
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80

# Files over the limits today, with the reason each stays.
FILE_ALLOWED = {
}

# Functions over the limit outside the engine today, as (file, name), a Python method's name being
# Class.method: each with the reason it stays.
FUNCTION_ALLOWED = {
    ("src/python/bindings.cpp", "PYBIND11_MODULE"):
        "the Python module's definitions, one per exposed name: a table more than a sequence",
}

CONTROL = re.compile(r"^(if|for|while|switch|catch|do|else|try|return)\b")
# The end of a function's head: a parameter list, then qualifiers and an optional trailing return.
SIGNATURE_END = re.compile(
    r"\)\s*(?:const\b|override\b|final\b|noexcept\b(?:\s*\([^()]*\))?|mutable\b|&&?|\s)*"
    r"(?:->\s*[\w:<>,\s*&]+)?$")
INITIALIZER_LIST = re.compile(r"\)\s*(?:noexcept\s*)?:\s*[\w:]+\s*[({].*[)}]$", re.S)
# A brace initializer of a member in a constructor's initializer list: part of the head.
MEMBER_BRACE_INIT = re.compile(r"\)\s*(?:noexcept\s*)?:\s*(?:[\w:]+\s*(?:\([^()]*\)|\{[^{}]*\})\s*,\s*)*[\w:]+\s*$", re.S)
NAME = re.compile(r"((?:[\w]+::)*~?[\w]+|operator\s*\S+?)\s*\(")


def blank(text):
    """The text with comments and literals replaced by spaces (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 1'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(" " * (j - i))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(text):
    """[(name, first line, last line)] of the functions in `text` (1-based lines)."""
    code = blank(text)
    found = []
    stack = []          # per open brace: True when it opens a function body
    inside = 0          # open function bodies
    statement_start = 0
    for i, c in enumerate(code):
        if c == ";":
            statement_start = i + 1
        elif c == "{":
            is_function = False
            if inside == 0 and MEMBER_BRACE_INIT.search(" ".join(code[statement_start:i].split())):
                stack.append("init")
                continue
            if inside == 0:
                head = code[statement_start:i]
                # Drop preprocessor lines, access specifiers and attributes from the head.
                head = "\n".join(l for l in head.split("\n") if not l.lstrip().startswith("#"))
                head = re.sub(r"\b(public|private|protected)\s*:(?!:)", " ", head)
                stripped = " ".join(head.split())
                if stripped and not CONTROL.match(stripped) and "(" in stripped and (
                        SIGNATURE_END.search(stripped) or INITIALIZER_LIST.search(stripped)):
                    m = NAME.search(stripped)
                    name = m.group(1) if m else "?"
                    # The head starts at its first non-blank character.
                    offset = statement_start + len(code[statement_start:i]) - len(code[statement_start:i].lstrip())
                    first = code.count("\n", 0, offset) + 1
                    found.append([name, first, None])
                    is_function = True
                    inside += 1
            stack.append(is_function)
            statement_start = i + 1
        elif c == "}":
            if stack and stack[-1] == "init":
                stack.pop()
                continue
            if stack:
                if stack.pop():
                    inside -= 1
                    for f in reversed(found):
                        if f[2] is None:
                            f[2] = code.count("\n", 0, i) + 1
                            break
            statement_start = i + 1
    return [tuple(f) for f in found if f[2] is not None]


def has_reason(lines, first):
    """Whether the C++ function starting at line `first` has a "long:" comment beside it."""
    marker = re.compile(r"//\s*long:\s*\S")
    if marker.search(lines[first - 1]):
        return True
    k = first - 2
    while k >= 0 and (lines[k].strip().startswith("//") or lines[k].strip().startswith("template")):
        if marker.search(lines[k]):
            return True
        k -= 1
    return False


def cpp_functions(text):
    """[(name, first line, last line, whether a reason is beside it)] of the C++ functions in `text`."""
    lines = text.split("\n")
    return [(name, a, b, has_reason(lines, a)) for name, a, b in functions(text)]


PYTHON_REASON = re.compile(r"#\s*long:\s*\S")


def python_functions(text):
    """[(name, first line, last line, whether a reason is beside it)] of the outermost Python
    functions in `text`: module-level functions and methods (Class.name, Outer.Inner.name), each
    from its `def` line to its last; what is nested in a function counts toward it. Raises
    SyntaxError (or tokenize.TokenError) when `text` is not Python."""
    tree = ast.parse(text)
    lines = text.split("\n")
    comments = {}  # line -> the comment on it
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                head = min([d.lineno for d in child.decorator_list] + [child.lineno])
                found.append((prefix + child.name, child.lineno, child.end_lineno,
                              python_has_reason(lines, comments, head, child.lineno)))
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def python_has_reason(lines, comments, head, first):
    """Whether a "long:" comment is on the `def` line `first`, among its decorators (from line
    `head`) or in the comment block directly above them."""
    if any(PYTHON_REASON.search(comments.get(k, "")) for k in range(head, first + 1)):
        return True
    k = head - 1
    while k >= 1 and k in comments and lines[k - 1].lstrip().startswith("#"):
        if PYTHON_REASON.search(comments[k]):
            return True
        k -= 1
    return False


def cpp_sources(base):
    folder = base / "src"
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES) if folder.is_dir() else []


def python_sources(base):
    """The .py files under python/, build outputs (build*/, __pycache__/, *.egg-info/) left out."""
    folder = base / "python"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.rglob("*.py") if p.is_file() and not any(
        part.startswith("build") or part == "__pycache__" or part.endswith(".egg-info")
        for part in p.relative_to(folder).parts[:-1]))


# (language, its files under a root, their functions, the comment that gives a reason)
LANGUAGES = (("C++", cpp_sources, cpp_functions, "// long: <reason>"),
             ("Python", python_sources, python_functions, "# long: <reason>"))


def check(base, file_allowed, function_allowed):
    """(the problems, the summary line) for the tree at `base`."""
    problems, allowed_used, long_with_reason, counts = [], set(), 0, []
    for language, sources, measure, comment in LANGUAGES:
        files, function_count = sources(base), 0
        for path in files:
            rel = path.relative_to(base).as_posix()
            text = path.read_text(errors="replace")
            count = len(text.splitlines())
            try:
                found = measure(text)
            except (SyntaxError, tokenize.TokenError) as e:
                problems.append(f"{rel}: ast cannot parse it ({e}), so its functions cannot be measured")
                found = []
            function_count += len(found)
            long_ones = [f for f in found if f[2] - f[1] + 1 > MAX_FUNCTION_LINES]
            if rel in file_allowed:
                allowed_used.add(rel)
                if count <= MAX_FILE_LINES and all(reason for _, _, _, reason in long_ones):
                    problems.append(f"scripts/check_sizes.py: {rel} is within the limits now: remove it from FILE_ALLOWED")
                continue
            if count > MAX_FILE_LINES:
                problems.append(f"{rel}: {count} lines, over {MAX_FILE_LINES}: split it by responsibility")
            for name, a, b, reason in long_ones:
                if reason:
                    long_with_reason += 1
                elif (rel, name) in function_allowed:
                    allowed_used.add((rel, name))
                else:
                    problems.append(f"{rel}:{a}: {name} has {b - a + 1} lines, over {MAX_FUNCTION_LINES}, and no "
                                    f"'{comment}' comment beside it")
        counts.append(f"{len(files)} {language} files with {function_count} functions")
    for rel in sorted(set(file_allowed) - allowed_used):
        problems.append(f"scripts/check_sizes.py: {rel} in FILE_ALLOWED does not exist: remove it")
    for rel, name in sorted(set(function_allowed) - allowed_used):
        problems.append(f"scripts/check_sizes.py: {name} of {rel} in FUNCTION_ALLOWED is no longer over "
                        f"{MAX_FUNCTION_LINES} lines (or gone): remove it")
    if problems:
        return problems, (f"check_sizes: {len(problems)} problem(s); files under src/ and python/ have at most "
                          f"{MAX_FILE_LINES} lines and functions at most {MAX_FUNCTION_LINES} unless a comment says why")
    allowed_files = sorted(a for a in allowed_used if isinstance(a, str))
    return problems, (f"check_sizes: {' and '.join(counts)} within the limits ({long_with_reason} longer with a "
                      f"reason beside them, {len(allowed_used) - len(allowed_files)} known in FUNCTION_ALLOWED; "
                      f"files allowed longer: {', '.join(allowed_files) or 'none'})")


def self_test():
    """Runs check() on small trees in a temporary folder; returns the exit status."""
    def body(n, indent="    "):  # n lines of statements
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    long_f = "def f():\n" + body(80)  # 81 lines
    nested = "def f():\n    def g():\n" + body(40, " " * 8) + "    def h():\n" + body(40, " " * 8) + "    return g, h\n"
    cases = [  # (what, {path: text}, FUNCTION_ALLOWED, the problems expected, by a part of each)
        ("a Python function of 81 lines", {"python/pkg/m.py": long_f}, {}, ["python/pkg/m.py:1: f has 81 lines"]),
        ("a Python function of 80 lines", {"python/pkg/m.py": "def f():\n" + body(79)}, {}, []),
        ("an async method, named with its class", {"python/pkg/m.py": "class C:\n    async def m(self):\n" + body(80, " " * 8)},
         {}, ["python/pkg/m.py:2: C.m has 81 lines"]),
        ("nested functions count toward the outermost only", {"python/pkg/m.py": nested}, {}, ["m.py:1: f has 84 lines"]),
        ("a reason above the decorators", {"python/pkg/m.py": "# why:\n# long: a table\n@d\n@e(\n    1)\n" + long_f}, {}, []),
        ("a reason among the decorators", {"python/pkg/m.py": "@d\n# long: a table\n" + long_f}, {}, []),
        ("a reason on the def line", {"python/pkg/m.py": long_f.replace(":\n", ":  # long: a table\n", 1)}, {}, []),
        ("'long:' without a reason", {"python/pkg/m.py": "# long:\n" + long_f}, {}, ["m.py:2: f has 81 lines"]),
        ("a blank line between the reason and the def", {"python/pkg/m.py": "# long: a table\n\n" + long_f}, {},
         ["m.py:3: f has 81 lines"]),
        ("'# long:' inside a string is no comment", {"python/pkg/m.py": "X = '''\n# long: a table\n'''\n" + long_f}, {},
         ["m.py:4: f has 81 lines"]),
        ("a Python file of 701 lines", {"python/pkg/big.py": "x = 1\n" * 701}, {}, ["python/pkg/big.py: 701 lines"]),
        ("build outputs are left out", {"python/companion/build/lib/m.py": long_f, "python/pkg/__pycache__/m.py": long_f},
         {}, []),
        ("a file ast cannot parse", {"python/pkg/bad.py": "def f(:\n"}, {}, ["python/pkg/bad.py: ast cannot parse"]),
        ("a Python function in FUNCTION_ALLOWED", {"python/pkg/m.py": long_f}, {("python/pkg/m.py", "f"): "why"}, []),
        ("a FUNCTION_ALLOWED entry that no longer applies", {"python/pkg/m.py": "def f():\n    pass\n"},
         {("python/pkg/m.py", "f"): "why"}, ["f of python/pkg/m.py in FUNCTION_ALLOWED is no longer over"]),
        ("a C++ function of 81 lines", {"src/a.cpp": "void f() {\n" + "  g();\n" * 79 + "}\n"}, {},
         ["src/a.cpp:1: f has 81 lines"]),
    ]
    failed = 0
    for what, tree, function_allowed, expected in cases:
        with tempfile.TemporaryDirectory(prefix="check_sizes-") as folder:
            for rel, text in tree.items():
                (pathlib.Path(folder) / rel).parent.mkdir(parents=True, exist_ok=True)
                (pathlib.Path(folder) / rel).write_text(text)
            problems, _ = check(pathlib.Path(folder), {}, function_allowed)
        if len(problems) != len(expected) or not all(any(e in p for p in problems) for e in expected):
            failed += 1
            print(f"check_sizes --self-test: {what}: expected {expected or 'no problem'}, found {problems or 'none'}")
    print(f"check_sizes --self-test: {len(cases) - failed} of {len(cases)} cases give the expected verdict")
    return 1 if failed else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    if sys.argv[1:]:
        sys.exit(f"usage: {sys.argv[0]} [--self-test]")
    problems, summary = check(root, FILE_ALLOWED, FUNCTION_ALLOWED)
    print("\n".join(problems + [summary]))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
