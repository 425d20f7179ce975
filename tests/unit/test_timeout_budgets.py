"""No test's pytest-timeout undercuts a timeout the test itself waits for.

pytest-timeout (pyproject: `timeout`) kills a test from outside; when that fires first, a test
that bounded its own subprocess with a longer inner timeout is cut mid-run, under load, with
none of its own cleanup (the demo e2e test waited 1500 s under a 300 s limit). Every literal
`timeout=N` in a test function (or a helper in the same file that the test calls) must fit
inside the test's limit: its `@pytest.mark.timeout(...)` or the global one.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GLOBAL = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]


def _timeout_literals(fn: ast.AST) -> list[int]:
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in ("timeout", "timeout_s") and isinstance(kw.value, ast.Constant) \
                        and isinstance(kw.value.value, int | float) and not isinstance(kw.value.value, bool):
                    found.append(kw.value.value)
    return found


def _mark_timeout(fn: ast.FunctionDef | ast.AsyncFunctionDef, module_mark: float | None) -> float:
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and ast.unparse(deco.func) == "pytest.mark.timeout" and deco.args:
            return float(ast.literal_eval(deco.args[0]))
    return module_mark if module_mark is not None else GLOBAL


def _module_mark(tree: ast.Module) -> float | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            for call in ast.walk(node.value):
                if isinstance(call, ast.Call) and ast.unparse(call.func) == "pytest.mark.timeout" and call.args:
                    return float(ast.literal_eval(call.args[0]))
    return None


def test_no_test_waits_longer_than_its_pytest_timeout() -> None:
    problems = []
    for file in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(file.read_text())
        module_mark = _module_mark(tree)
        functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        for name, fn in functions.items():
            if not name.startswith("test_"):
                continue
            called = {ast.unparse(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)}
            waits = _timeout_literals(fn) + [t for helper in called & functions.keys()
                                             for t in _timeout_literals(functions[helper])]
            limit = _mark_timeout(fn, module_mark)
            if waits and max(waits) >= limit:
                problems.append(f"{file.relative_to(ROOT)}::{name}: waits up to {max(waits)} s under a "
                                f"{limit:g} s pytest timeout")
    assert not problems, "\n".join(problems)
