#!/usr/bin/env python3
"""No code outside the model interface asks which model it holds.

The models that model.type names implement one interface, zerotrain/models/model_kind.h: the
registry src/models/model_kinds.cpp and one src/models/<name>_kind.cpp per model. Anywhere else in
src/ and include/, a test of the model's type is a branch that the next model would have to add
to. This check finds, outside comments:
  - comparisons of model.type or of a variable named type with "gpt", "bert" or "llama";
  - the trainer's old flags is_gpt, is_bert, is_llama;
  - ModelFigures::Family::Gpt / Family::Llama (the estimate's per-model formulas).
(Checks of a Hugging Face file's own model_type field are validation of an input, not branches.)

KNOWN lists the files that still branch, with how many lines and why: a file not listed fails, and
so does a listed count that no longer matches (lower it when a branch goes), so the list only
shrinks. Prints one line per problem and exits 1, or one summary line.
"""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
INTERFACE = re.compile(r"^src/models/(model_kinds|\w+_kind)\.(cpp|h)$")
BRANCH = re.compile(r'\bmodel\.type\s*[!=]=|\btype\s*[!=]=\s*"(gpt|bert|llama)"|\bis_(gpt|bert|llama)\b|'
                    r'Family::(Gpt|Llama)\b')

# Files that still branch on the model's type: (lines, why they are not behind the interface yet).
KNOWN = {
    "src/checkpoint/hf.cpp": (1, "the model types a checkpoint's saved configuration may name"),
    "src/cli/export_command.cpp": (5, "the Hugging Face writer per model type"),
    "src/cli/generate_command.cpp": (2, "generation builds the GPT or the Llama from a checkpoint"),
    "src/cli/estimate_command.cpp": (2, "the estimate's model line and the step-time model's refusal for the Llama"),
    "src/python/bindings.cpp": (1, "zerotrain.models.GPT builds the GPT and refuses a configuration of another model.type"),
    "src/memory/estimate.cpp": (1, "the Llama's activation formula"),
    "src/memory/llama_estimate.cpp": (1, "the Llama's figures name their formula"),
    "include/zerotrain/memory/estimate.h": (1, "ModelFigures::Family, the estimate's formula per decoder"),
}

found = {}
for path in sorted(p for d in ("src", "include") for p in (root / d).rglob("*") if p.suffix in {".h", ".cpp", ".cu"}):
    rel = path.relative_to(root).as_posix()
    if INTERFACE.match(rel):
        continue
    for line in path.read_text(errors="replace").splitlines():
        code = line.split("//", 1)[0]
        if BRANCH.search(code):
            found[rel] = found.get(rel, 0) + 1

problems = []
for rel, count in sorted(found.items()):
    if rel not in KNOWN:
        problems.append(f"{rel}: {count} line(s) test the model's type; ask the model interface "
                        "(zerotrain/models/model_kind.h) instead")
    elif KNOWN[rel][0] != count:
        problems.append(f"{rel}: {count} line(s) test the model's type, KNOWN says {KNOWN[rel][0]}: "
                        "update scripts/check_model_branches.py (the list only shrinks)")
for rel in sorted(set(KNOWN) - set(found)):
    problems.append(f"{rel}: no longer tests the model's type; remove it from KNOWN in scripts/check_model_branches.py")
if problems:
    print("\n".join(problems))
    sys.exit(1)
print(f"check_model_branches: no model-type branch outside the model interface but the {sum(c for c, _ in KNOWN.values())} "
      f"known lines in {len(KNOWN)} files")
