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


def _timeout_literals(fn: ast.AST, names: dict[str, object]) -> list[float]:
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg not in ("timeout", "timeout_s"):
                    continue
                try:
                    value = _evaluate(kw.value, names)
                except Exception:
                    continue  # depends on the test's own variables: not a fixed wait
                if isinstance(value, int | float) and not isinstance(value, bool):
                    found.append(value)
    return found


def _constants(tree: ast.Module) -> dict[str, object]:
    """Module-level `NAME = <literal>` assignments, so marks like timeout(LIMIT + 120) evaluate."""
    found: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = _evaluate(node.value, found)
            except Exception:
                continue
    return found


def _evaluate(node: ast.expr, names: dict[str, object]) -> float:
    return eval(compile(ast.Expression(node), "<mark>", "eval"), {"__builtins__": {}}, dict(names))


def _mark_timeout(fn: ast.FunctionDef | ast.AsyncFunctionDef, module_mark: float | None,
                  names: dict[str, object]) -> float:
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and ast.unparse(deco.func) == "pytest.mark.timeout" and deco.args:
            return float(_evaluate(deco.args[0], names))
    return module_mark if module_mark is not None else GLOBAL


def _module_mark(tree: ast.Module) -> float | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            for call in ast.walk(node.value):
                if isinstance(call, ast.Call) and ast.unparse(call.func) == "pytest.mark.timeout" and call.args:
                    return float(_evaluate(call.args[0], _constants(tree)))
    return None


def test_no_test_waits_longer_than_its_pytest_timeout() -> None:
    problems = []
    for file in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(file.read_text())
        module_mark = _module_mark(tree)
        names = _constants(tree)
        functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        for name, fn in functions.items():
            if not name.startswith("test_"):
                continue
            called = {ast.unparse(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)}
            waits = _timeout_literals(fn, names) + [t for helper in called & functions.keys()
                                                    for t in _timeout_literals(functions[helper], names)]
            limit = _mark_timeout(fn, module_mark, names)
            if waits and max(waits) >= limit:
                problems.append(f"{file.relative_to(ROOT)}::{name}: waits up to {max(waits)} s under a "
                                f"{limit:g} s pytest timeout")
    assert not problems, "\n".join(problems)
