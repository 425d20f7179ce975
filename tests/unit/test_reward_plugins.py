"""Plugins from config (`module:function`): good, missing, broken, not callable, wrong shape; the registry."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from arlo.config import ConfigError, RewardConfig, RewardPluginConfig, SandboxConfig
from services.reward.plugins import load_plugin
from services.reward.registry import build_registry
from services.reward.verifiers.base import Verdict

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples.reward_plugin.my_verifier"


@pytest.fixture(autouse=True)
def importable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "plugin_import_fails.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "plugin_syntax_error.py").write_text("def f(:\n")
    (tmp_path / "plugin_exits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "plugin_nested.py").write_text(
        "from services.reward.verifiers.base import Verdict\n"
        "class Scorers:\n"
        "    @staticmethod\n"
        "    def length(response, reference, metadata):\n"
        "        return Verdict(reward=float(len(response)))\n")
    yield
    for name in [m for m in sys.modules if m.startswith("plugin_")]:
        del sys.modules[name]


def plugin(target: str, name: str = "mine", description: str = "") -> RewardPluginConfig:
    return RewardPluginConfig(name=name, target=target, description=description)


def test_good_plugin() -> None:
    spec = load_plugin(plugin(f"{EXAMPLE}:keyword_recall"), "reward.plugins[0]")
    assert spec.name == "mine"
    assert spec.description.startswith("Fraction of the reference's comma-separated keywords")
    verdict = spec.fn("Chlorophyll absorbs light.", "chlorophyll, light, water", {})
    assert verdict == Verdict(reward=pytest.approx(2 / 3), components={"recall": pytest.approx(2 / 3),
                                                                         "num_keywords": 3.0})
    assert load_plugin(plugin(f"{EXAMPLE}:keyword_recall", description="mine!"), "p").description == "mine!"


def test_dotted_attribute_target() -> None:
    spec = load_plugin(plugin("plugin_nested:Scorers.length"), "p")
    assert spec.fn("abc", "", {}).reward == 3.0


@pytest.mark.parametrize(("target", "why"), [
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
    ("plugin_import_fails:fn", "cannot import module 'plugin_import_fails': RuntimeError: no GPU here"),
    ("plugin_syntax_error:fn", "cannot import module 'plugin_syntax_error': SyntaxError"),
    ("plugin_exits:fn", "cannot import module 'plugin_exits': SystemExit"),
    (f"{EXAMPLE}:nope", "has no attribute 'nope'"),
    ("plugin_nested:Scorers.nope", "has no attribute 'nope'"),
    (f"{EXAMPLE}:MAX_KEYWORDS", "'MAX_KEYWORDS' is a int, not callable"),
    ("json:dumps", "must accept (response, reference, metadata)"),
    ("json", "must look like 'package.module:function'"),
])
def test_broken_plugins_name_the_plugin_and_target(target: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_plugin(plugin(target), "reward.plugins[2]")
    message = str(e.value)
    assert message.startswith(f"reward.plugins[2] 'mine' (target {target!r}): "), message
    assert why in message, message


def test_build_registry_has_builtins_code_composite_and_plugins() -> None:
    cfg = RewardConfig(sandbox=SandboxConfig(isolation="none"),
                       plugins=(plugin(f"{EXAMPLE}:keyword_recall", name="keyword_recall"),))
    registry = build_registry(cfg)
    assert registry.names() == ["code_tests", "composite", "exact_match", "format_regex", "format_think",
                                "keyword_recall", "math_equiv", "math_think"]
    assert all(spec.description for spec in registry.specs())
    composite = registry.fn("composite")
    verdict = composite("Light! \\boxed{2}", "light", {"components": [
        {"fn": "keyword_recall", "weight": 0.5}, {"fn": "exact_match", "weight": 0.5}]})
    assert verdict.reward == 0.5 and verdict.components["keyword_recall.recall"] == 1.0


def test_build_registry_refuses_broken_or_clashing_plugins() -> None:
    with pytest.raises(ConfigError, match=r"reward.plugins\[1\] 'bad' \(target 'no_such_module_xyz:f'\)"):
        build_registry(RewardConfig(sandbox=SandboxConfig(isolation="none"), plugins=(
            plugin(f"{EXAMPLE}:keyword_recall"), plugin("no_such_module_xyz:f", name="bad"))))
    with pytest.raises(ConfigError, match=r"reward.plugins\[0\]: name 'math_equiv' is already taken"):
        build_registry(RewardConfig(sandbox=SandboxConfig(isolation="none"), plugins=(
            plugin(f"{EXAMPLE}:keyword_recall", name="math_equiv"),)))
