#!/usr/bin/env python3
"""Source files and functions stay small enough to read.

Every file under src/ (.h, .hpp, .cpp, .cc, .cu, .cuh) has at most MAX_FILE_LINES lines, and
every function at most MAX_FUNCTION_LINES lines (from the first line of its signature to its
closing brace) unless a comment beside it gives the reason: a line comment starting "long:" on
the signature's first line or in the comment block directly above it, as in
    // long: one sequence of collectives that every rank runs in the same order
Functions are found by a brace-matching heuristic: comments, string and character literals are
blanked; a '{' outside any function whose statement text ends in a parameter list (with
qualifiers, a trailing return type or a constructor's initializer list after it) opens a
function, unless the statement starts with a control keyword. Lambdas and local classes count
toward the function around them.

FILE_ALLOWED lists the files that may stay longer (their functions are not checked either), and
FUNCTION_ALLOWED the functions outside the engine that are longer today, each with the reason; an
entry that no longer applies fails, so that the lists only shrink.
Prints one line per problem and exits 1 when there is any; otherwise one summary line.
"""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"}
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80

# Files over the limits today, with the reason each stays.
FILE_ALLOWED = {
}

# Functions over the limit outside the engine today, as (file, name): each with the reason it stays.
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
    """Whether the function starting at line `first` has a "long:" comment beside it."""
    marker = re.compile(r"//\s*long:\s*\S")
    if marker.search(lines[first - 1]):
        return True
    k = first - 2
    while k >= 0 and (lines[k].strip().startswith("//") or lines[k].strip().startswith("template")):
        if marker.search(lines[k]):
            return True
        k -= 1
    return False


def main():
    files = sorted(p for p in (root / "src").rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES)
    problems, allowed_used, long_with_reason, function_count = [], set(), 0, 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        text = path.read_text(errors="replace")
        lines = text.split("\n")
        count = len(text.splitlines())
        found = functions(text)
        function_count += len(found)
        long_ones = [(name, a, b) for name, a, b in found if b - a + 1 > MAX_FUNCTION_LINES]
        if rel in FILE_ALLOWED:
            allowed_used.add(rel)
            if count <= MAX_FILE_LINES and not any(not has_reason(lines, a) for _, a, _ in long_ones):
                problems.append(f"scripts/check_sizes.py: {rel} is within the limits now: remove it from FILE_ALLOWED")
            continue
        if count > MAX_FILE_LINES:
            problems.append(f"{rel}: {count} lines, over {MAX_FILE_LINES}: split it by responsibility")
        for name, a, b in long_ones:
            if has_reason(lines, a):
                long_with_reason += 1
            elif (rel, name) in FUNCTION_ALLOWED:
                allowed_used.add((rel, name))
            else:
                problems.append(f"{rel}:{a}: {name} has {b - a + 1} lines, over {MAX_FUNCTION_LINES}, and no "
                                "'// long: <reason>' comment beside it")
    for rel in sorted(set(FILE_ALLOWED) - allowed_used):
        problems.append(f"scripts/check_sizes.py: {rel} in FILE_ALLOWED does not exist: remove it")
    for rel, name in sorted(set(FUNCTION_ALLOWED) - allowed_used):
        problems.append(f"scripts/check_sizes.py: {name} of {rel} in FUNCTION_ALLOWED is no longer over "
                        f"{MAX_FUNCTION_LINES} lines (or gone): remove it")
    if problems:
        print("\n".join(problems))
        print(f"check_sizes: {len(problems)} problem(s); files under src/ have at most {MAX_FILE_LINES} lines and "
              f"functions at most {MAX_FUNCTION_LINES} unless a comment says why")
        sys.exit(1)
    allowed_files = sorted(a for a in allowed_used if isinstance(a, str))
    print(f"check_sizes: {len(files)} files, {function_count} functions within the limits "
          f"({long_with_reason} longer with a reason beside them, {len(allowed_used) - len(allowed_files)} "
          f"known in FUNCTION_ALLOWED; files allowed longer: {', '.join(allowed_files)})")


if __name__ == "__main__":
    main()
