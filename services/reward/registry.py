"""Reward functions by name, built from config: built-ins, code tests in the sandbox, plugins."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from arlo.config import ConfigError, RewardConfig
from arlo.sandbox import Sandbox, SandboxError
from services.reward.plugins import load_plugin
from services.reward.verifiers.base import RewardFn, RewardSpec
from services.reward.verifiers.code import make_code_verifier
from services.reward.verifiers.composite import MetadataComposite, Part, WeightedComposite
from services.reward.verifiers.exact import exact_match
from services.reward.verifiers.format import format_regex, format_think
from services.reward.verifiers.math import math_equiv

__all__ = ["RewardRegistry", "RewardSpec", "build_registry", "builtin_specs", "default_registry"]

log = logging.getLogger(__name__)


class RewardRegistry:
    def __init__(self, specs: Iterable[RewardSpec] = ()) -> None:
        self._specs: dict[str, RewardSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: RewardSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"reward function {spec.name!r} is already registered")
        self._specs[spec.name] = spec

    def get(self, name: str) -> RewardSpec | None:
        return self._specs.get(name)

    def fn(self, name: str) -> RewardFn | None:
        spec = self._specs.get(name)
        return spec.fn if spec is not None else None

    def specs(self) -> list[RewardSpec]:
        return sorted(self._specs.values(), key=lambda s: s.name)

    def names(self) -> list[str]:
        return sorted(self._specs)


def builtin_specs() -> list[RewardSpec]:
    """The verifiers that need nothing but the process: exact, math, format, and a fixed composite."""
    math_think = WeightedComposite(parts=(Part(name="math_equiv", fn=math_equiv, weight=0.9),
                                          Part(name="format_think", fn=format_think, weight=0.1)))
    return [
        RewardSpec(name="exact_match", fn=exact_match,
                   description="1.0 when response equals reference after stripping and collapsing whitespace, "
                               "else 0.0; component 'exact_match'."),
        RewardSpec(name="math_equiv", fn=math_equiv,
                   description="1.0 when the response's final answer (last \\boxed{}, <answer>, 'answer:', or last "
                               "number) equals the reference numerically or symbolically; metadata rel_tol, "
                               "abs_tol, extract; components 'parsed', 'math_equiv'. Unparsable reference: ERROR."),
        RewardSpec(name="format_think", fn=format_think,
                   description="Mean of 'think' (one leading non-empty <think>...</think>) and 'answer' (exactly "
                               "one final answer after it); metadata answer_style any|tag|boxed."),
        RewardSpec(name="format_regex", fn=format_regex,
                   description="Mean of named regex checks from metadata patterns {name: regex | {regex, flags, "
                               "min, max}}; one component per name."),
        RewardSpec(name="math_think", fn=math_think,
                   description="0.9 * math_equiv + 0.1 * format_think; components prefixed 'math_equiv.' and "
                               "'format_think.'."),
    ]


def default_registry() -> RewardRegistry:
    """Just `exact_match`: the smallest real registry, for tests of the RPC plumbing. The service
    uses `build_registry`; `RewardRegistry(builtin_specs())` has every in-process verifier."""
    return RewardRegistry([spec for spec in builtin_specs() if spec.name == "exact_match"])


def _code_spec(cfg: RewardConfig) -> RewardSpec:
    try:
        sandbox = Sandbox(cfg.sandbox)
    except SandboxError as e:
        raise ConfigError(f"reward.sandbox: {e}") from None
    if cfg.sandbox.wall_timeout_s >= cfg.timeout_s:
        # The item turns TIMEOUT at timeout_s while the sandboxed program may run on to its own
        # wall limit, holding a runner thread: legal, but code tasks near the limit are lost.
        log.warning("reward.sandbox.wall_timeout_s (%gs) >= reward.timeout_s (%gs): slow code_tests items "
                    "will be TIMEOUT before the sandbox stops them", cfg.sandbox.wall_timeout_s, cfg.timeout_s)
    return RewardSpec(name="code_tests", fn=make_code_verifier(sandbox),
                      description="Fraction of tests passed by the response's code (its last ```python block), "
                                  "run in the sandbox (isolation " + sandbox.isolation + "); tests from metadata "
                                  "tests (string or list) else the reference; components tests_passed, compiled.")


def build_registry(cfg: RewardConfig) -> RewardRegistry:
    """Built-ins, `code_tests`, `composite` and the configured plugins; ConfigError when one is broken."""
    # Plugins first: a typo in a target should fail in milliseconds, before the sandbox probe.
    plugins = [(f"reward.plugins[{i}]", load_plugin(p, f"reward.plugins[{i}]")) for i, p in enumerate(cfg.plugins)]
    registry = RewardRegistry(builtin_specs())
    registry.register(_code_spec(cfg))
    registry.register(RewardSpec(
        name="composite", fn=MetadataComposite(lookup=registry.fn),
        description="Weighted sum of other reward functions named in metadata components: [{fn, weight, "
                    "metadata?, name?}]; components prefixed '<name>.'."))
    for where, spec in plugins:
        if registry.get(spec.name) is not None:
            raise ConfigError(f"{where}: name {spec.name!r} is already taken; built-in and plugin names must "
                              f"be unique (taken: {registry.names()})")
        registry.register(spec)
    return registry
