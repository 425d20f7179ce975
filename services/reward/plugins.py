"""User verifiers from config: `reward.plugins: [{name, target: "package.module:function"}]`.

Loaded once at start. Anything wrong (module missing or failing to import, attribute missing,
not callable, not taking `(response, reference, metadata)`) is a ConfigError naming the plugin
and its target, so the service exits with status 2 and one line instead of starting without it
and scoring its items as unknown.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from arlo.config import ConfigError, RewardPluginConfig
from arlo.plugins import load_target
from services.reward.verifiers.base import RewardFn, RewardSpec


def _check_signature(fn: Callable[..., Any], where: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; the call itself will tell
        return
    try:
        signature.bind("response", "reference", {})
    except TypeError as e:
        raise ConfigError(f"{where}: must accept (response, reference, metadata); its signature is "
                          f"{signature} ({e})") from None


def load_plugin(plugin: RewardPluginConfig, where: str) -> RewardSpec:
    """The plugin's RewardSpec; ConfigError (naming `where`, the plugin and its target) if unusable."""
    where = f"{where} {plugin.name!r} (target {plugin.target!r})"
    module_name, _, attrs = plugin.target.partition(":")
    if not module_name or not attrs:
        raise ConfigError(f"{where}: target must look like 'package.module:function'")
    fn = load_target(plugin.target, where)
    if not callable(fn):
        raise ConfigError(f"{where}: {attrs!r} is a {type(fn).__name__}, not callable")
    _check_signature(fn, where)
    doc = (inspect.getdoc(fn) or "").strip().split("\n\n")[0].replace("\n", " ")
    description = plugin.description or doc or f"plugin {plugin.target}"
    reward_fn: RewardFn = fn
    return RewardSpec(name=plugin.name, fn=reward_fn, description=description)
