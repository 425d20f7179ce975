"""The package layout's import rules (docs/architecture.md, "Code layout"): the shared library
and the services never import the operator application, which reaches the services only as
subprocesses and over gRPC; a service never imports another service's package (a rule two
services apply lives in the library, `arlo/`), and the library imports no service."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def modules(folder: str) -> list[Path]:
    return [p for p in (ROOT / folder).rglob("*.py") if "proto" not in p.relative_to(ROOT).parts]


def offenders(files: list[Path], prefix: str) -> list[str]:
    return sorted(f"{p.relative_to(ROOT)}: {m}" for p in files for m in imported(p)
                  if m == prefix or m.startswith(prefix + "."))


def test_library_and_services_do_not_import_the_application() -> None:
    library = [p for p in modules("arlo") if "app" not in p.relative_to(ROOT / "arlo").parts[:1]]
    assert library and offenders(library + modules("services"), "arlo.app") == []


def test_the_application_does_not_import_the_services() -> None:
    app = modules("arlo/app")
    assert app and offenders(app, "services") == []


def test_a_service_does_not_import_another_service() -> None:
    services = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file())
    assert len(services) >= 5
    found = [hit for name in services for other in services if other != name
             for hit in offenders(modules(f"services/{name}"), f"services.{other}")]
    assert found == []


def test_the_library_does_not_import_the_services() -> None:
    library = modules("arlo")
    assert library and offenders(library, "services") == []


def test_no_two_test_files_share_a_name() -> None:
    """pytest imports test modules by their file name (the test folders are not packages): a second
    tests/*/test_x.py stops the whole run at collection ("import file mismatch")."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
