"""Writes docs/configuration.md from the arlo/config/ package, so the reference cannot drift from the code.

Field descriptions are the string literals that follow each field in the dataclass body (read
with `ast` from every module of the package); defaults come from the dataclasses themselves.
Every field must have one: the script fails, naming them, when a field has none, and `--check`
fails when the committed file is stale (tests run both).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from arlo import config as config_module  # noqa: E402
from arlo.config.base import range_of  # noqa: E402

OUT = ROOT / "docs" / "configuration.md"
GUIDE = ROOT / "docs" / "configuration_guide.md"
PACKAGE = Path(config_module.__file__).parent


def field_docs() -> dict[str, dict[str, str]]:
    """{class name: {field name: docstring}} from the source of every module of the package
    (class names are unique across them: arlo.config re-exports them all)."""
    docs: dict[str, dict[str, str]] = {}
    for node in (node for module in sorted(PACKAGE.glob("*.py")) for node in ast.parse(module.read_text()).body):
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    fields[stmt.target.id] = " ".join(nxt.value.value.split())
        docs[node.name] = fields
    return docs


def class_docs(docs: dict[str, dict[str, str]], cls: type) -> dict[str, str]:
    """`cls`'s field docstrings, with those of the config classes it extends (TasksConfig's
    DatasetConfig fields are declared, and documented, once)."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        out.update(docs.get(base.__name__, {}))
    return out


def undocumented() -> list[str]:
    """"Class.field" for every dataclass field of arlo/config/ without a docstring."""
    docs = field_docs()
    return [f"{cls.__name__}.{f.name}" for cls in config_classes() for f in dataclasses.fields(cls)
            if f.name not in class_docs(docs, cls)]


def config_classes() -> list[type]:
    """The config dataclasses arlo.config exports (each declared in one of its modules)."""
    return [obj for obj in vars(config_module).values()
            if isinstance(obj, type) and dataclasses.is_dataclass(obj)
            and obj.__module__.startswith(config_module.__name__ + ".")]


def default_of(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return None if dataclasses.is_dataclass(value) else value
    return "(required)"


def render() -> str:
    docs = field_docs()
    lines = ["# Configuration reference", "",
             "Generated from `arlo/config/` by `scripts/gen_config_docs.py`; do not edit by hand (the guide",
             "below comes from `docs/configuration_guide.md`).",
             "A run is one YAML file; every section and field below is optional unless marked required.", "",
             *GUIDE.read_text().rstrip().splitlines(), ""]

    def section(cls: type, path: str, instance: object | None) -> None:
        hints = typing.get_type_hints(cls)
        lines.extend([f"## `{path or '(top level)'}` ({cls.__name__})", ""])
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            lines.extend([" ".join(cls.__doc__.split()), ""])
        lines.extend(["| field | type | default | range | meaning |", "| --- | --- | --- | --- | --- |"])
        nested = []
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            is_list = typing.get_origin(tp) in (tuple, list)
            inner = typing.get_args(tp)[0] if is_list else tp
            # Defaults come from the enclosing default instance: each service's `server`
            # section has its own port, which the ServerConfig class default does not show.
            value = getattr(instance, f.name) if instance is not None else default_of(f)
            if dataclasses.is_dataclass(inner):
                sub = f"{path}.{f.name}" if path else f.name
                nested.append((inner, sub + ("[]" if is_list else ""), None if is_list else value))
                shown = "`[]`" if is_list else "see below"
            else:
                shown = f"`{value!r}`"
            bounds = range_of(f)  # checked at load (arlo/config/base.py `ranged`)
            allowed = bounds.describe() if bounds is not None else ""
            lines.append(f"| `{f.name}` | {config_module.type_name(tp)} | {shown} | {allowed} | "
                         f"{class_docs(docs, cls).get(f.name, '')} |")
        lines.append("")
        for inner, sub, value in nested:
            section(inner, sub, value)

    section(config_module.RunConfig, "", config_module.RunConfig())
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    missing = undocumented()
    if missing:
        print(f"fields without a docstring in arlo/config/: {', '.join(missing)}", file=sys.stderr)
        return 1
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print("docs/configuration.md is stale; run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
