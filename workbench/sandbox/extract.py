"""From a model's completion to the program that is tested: the code it wrote, after the problem's own prompt.

The rule (`solution_program`):

1. Code: the first fenced block (```python, ```py, ```python3 or a bare ```; an unclosed last fence runs to the
   end), dedented, that defines the entry point at column 0 (`def name(`), else the first one. Without fences,
   bare code: from the line `def name(` (with the import and decorator lines right above it) to the last
   column-0 line at which the code still parses (so trailing prose is dropped; of the last MAX_PARSES such
   lines, else the first), or else the whole completion.
2. When that code defines the entry point, the program is the prompt followed by the code: the prompt's imports
   and helpers (HumanEval/10, /38 need theirs) stay, and the code's `def` replaces the prompt's stub.
3. Otherwise the code is taken as the function's body, continuing the prompt (HumanEval's original format),
   cut at the Codex paper's stop sequences ('\\nclass', '\\ndef', '\\n#', '\\nif', '\\nprint'): what follows
   the function at column 0 is the model going on, not the answer. A fenced body written at column 0 is
   indented to the function's level first.
"""

from __future__ import annotations

import ast
import re
import textwrap

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
"""Where HumanEval's evaluation (Chen et al. 2021) cuts a completion that continues the prompt."""
# Possessive quantifiers: a fence followed by thousands of spaces must not make the match quadratic.
_FENCE = re.compile(r"^[ \t]*+```[ \t]*+(\w*+)[^\n]*+\n(.*?)(?:^[ \t]*+```|\Z)", re.MULTILINE | re.DOTALL)
_PYTHON_TAGS = ("", "python", "py", "python3")
MAX_PARSES = 32
"""Bare code: the most end points tried (from the last), so pages of prose after it cost bounded time."""
_HEADER = re.compile(r"(?:from|import)\s|@")


def _defines(code: str, entry_point: str) -> re.Match | None:
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE)


def extract_code(completion: str, entry_point: str) -> tuple[str, bool]:
    """(the code in `completion`, whether it came from a fenced block)."""
    blocks = [textwrap.dedent(m.group(2)) for m in _FENCE.finditer(completion) if m.group(1).lower() in _PYTHON_TAGS]
    if blocks:
        return next((b for b in blocks if _defines(b, entry_point)), blocks[0]), True
    found = _defines(completion, entry_point)
    if found is None:
        return completion, False
    lines = completion[found.start():].split("\n")
    before = completion[:found.start()].split("\n")[:-1]
    while before and _HEADER.match(before[-1]):  # the imports and decorators right above the def
        lines.insert(0, before.pop())
    cuts = [i for i, line in enumerate(lines) if i and line[:1].strip()] + [len(lines)]
    for cut in cuts[:-MAX_PARSES - 1:-1]:
        code = "\n".join(lines[:cut])
        if _parses(code):
            return code, False
    return "\n".join(lines[:cuts[0]]), False


def solution_program(completion: str, prompt: str, entry_point: str) -> str:
    """The whole program to test for `completion` to the problem with code prompt `prompt` (rule above)."""
    code, fenced = extract_code(completion, entry_point)
    if _defines(code, entry_point):
        return f"{prompt}\n\n{code}\n"
    if fenced and code.strip() and not code.lstrip("\n")[:1].isspace():
        code = textwrap.indent(code, "    ")
    cut = min((i for i in (code.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(code))
    return prompt + code[:cut].rstrip() + "\n"


def _parses(code: str) -> bool:
    try:
        ast.parse(code)  # parse only: nothing of the completion runs in this process
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # the last two: absurd nesting
        return False
    return True
