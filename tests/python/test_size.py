"""Size budgets of the production sources (C and Python): no file over
FILE_LINES lines, no function over FUNCTION_LINES.  What is over today is
named in ALLOWED with its size and the reason; the test fails when an entry
is no longer needed, so the list only shrinks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILE_LINES = 600
FUNCTION_LINES = 60
SOURCES = ["proto/*.[ch]", "daemon/*/*.[ch]", "daemon/worker/*.py", "daemon/worker/*/*.py",
           "client/*.[ch]", "client/python/*.py", "client/python/torchloop/*.py",
           "client/python/torchloop/*.[ch]"]

# "path" or "path:function" -> why it is over its budget (each entry is checked)
ALLOWED: dict[str, str] = {}

C_FUNCTION = re.compile(r"^[A-Za-z_][^;{}()]*\b([A-Za-z_]\w*)\s*\(")


def sources() -> list[Path]:
    return sorted({p for pattern in SOURCES for p in ROOT.glob(pattern)})


def c_functions(text: str) -> list[tuple[str, int]]:
    """(name, lines) of each function definition: a header line at column 0,
    a body between a "{" and a "}" at column 0 (the tree's .clang-format)."""
    out, name, start = [], "", -1
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = C_FUNCTION.match(line)
        if m and start < 0 and not line.startswith("#"):
            name = m.group(1)
        elif line == "{" and name:
            start = i
        elif line == "}" and start >= 0:
            out.append((name, i - start + 1))
            name, start = "", -1
    return out


def py_functions(text: str) -> list[tuple[str, int]]:
    tree = ast.parse(text)
    return [(node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def over_budget() -> dict[str, int]:
    over: dict[str, int] = {}
    for path in sources():
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        n = text.count("\n")
        if n > FILE_LINES:
            over[rel] = n
        funcs = py_functions(text) if path.suffix == ".py" else c_functions(text)
        for name, lines in funcs:
            if lines > FUNCTION_LINES:
                over[f"{rel}:{name}"] = lines
    return over


def test_the_function_finder_sees_c_and_python_functions() -> None:
    c = "static int f(int a,\n               int b)\n{\n\treturn a;\n}\n\nvoid g(void)\n{\n}\n"
    assert c_functions(c) == [("f", 3), ("g", 2)]
    assert py_functions("def f():\n    return 1\n\n\nclass A:\n    def g(self):\n"
                        "        pass\n") == [("f", 2), ("g", 2)]
    assert len(sources()) > 60


def test_no_production_source_is_over_its_budget() -> None:
    over = over_budget()
    new = {k: v for k, v in over.items() if k not in ALLOWED}
    assert not new, (f"over {FILE_LINES} lines a file or {FUNCTION_LINES} a function "
                     f"(split it, or name it in ALLOWED with the reason): {new}")
    stale = sorted(set(ALLOWED) - set(over))
    assert not stale, f"no longer over budget: take them out of ALLOWED: {stale}"
