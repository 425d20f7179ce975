"""Environments from the user's package: `env_gateway.plugins: [{name, target: "pkg.module:attr"}]`.

The target is an `EnvSpec`, an environment class (one instance per session; it declares
`config_type`, and optionally `tools`, `max_turns` and `blocking`, as class attributes), or a
factory `f(ctx) -> EnvSpec` given the gateway's `EnvContext`. Loaded once at gateway start; anything wrong (module missing or
failing to import, attribute missing, not an environment, a config type that is not a frozen
dataclass with `validate`) is a ConfigError naming the plugin and its target, so the gateway
exits with one line instead of starting without it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from arlo.config import ConfigError, EnvPluginConfig
from arlo.plugins import load_target
from services.env_gateway.spec import EnvContext, EnvSpec


def _is_environment_class(obj: Any) -> bool:
    return inspect.isclass(obj) and callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None))


def _from_class(cls: type[Any], plugin: EnvPluginConfig, where: str) -> EnvSpec:
    config_type = getattr(cls, "config_type", None)
    if config_type is None:
        raise ConfigError(f"{where}: class {cls.__name__} needs a `config_type` attribute (its config dataclass)")
    tools = getattr(cls, "tools", ())
    max_turns = getattr(cls, "max_turns", 1)
    description = plugin.description or (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
    try:
        return EnvSpec(name=plugin.name, description=description or f"plugin {plugin.target}",
                       factory=lambda ctx: cls(), config_type=config_type, tools=tools, max_turns=max_turns,
                       blocking=bool(getattr(cls, "blocking", False)))
    except (TypeError, ValueError) as e:  # bad tool schemas
        raise ConfigError(f"{where}: {type(e).__name__}: {e}") from None


def _check_spec(spec: Any, plugin: EnvPluginConfig, where: str) -> EnvSpec:
    if not isinstance(spec, EnvSpec):
        raise ConfigError(f"{where}: expected an EnvSpec, an environment class (with reset and step) or a "
                          f"factory returning an EnvSpec; got a {type(spec).__name__}")
    ct = spec.config_type
    if not (dataclasses.is_dataclass(ct) and inspect.isclass(ct) and callable(getattr(ct, "validate", None))):
        raise ConfigError(f"{where}: config_type {getattr(ct, '__name__', ct)!r} must be a dataclass with a "
                          "validate() method (see services/env_gateway/envs/base.py EnvConfig)")
    if not callable(spec.factory):
        raise ConfigError(f"{where}: the spec's factory is not callable")
    if spec.max_turns < 1:
        raise ConfigError(f"{where}: max_turns must be >= 1, got {spec.max_turns}")
    changes: dict[str, Any] = {}
    if spec.name != plugin.name:
        changes["name"] = plugin.name  # the config names it: one name, the one clients use
    if plugin.description:
        changes["description"] = plugin.description
    return dataclasses.replace(spec, **changes) if changes else spec


def load_env_plugin(plugin: EnvPluginConfig, context: EnvContext, where: str) -> EnvSpec:
    """The plugin's EnvSpec; ConfigError (naming `where`, the plugin and its target) if unusable."""
    where = f"{where} {plugin.name!r} (target {plugin.target!r})"
    module_name, _, attrs = plugin.target.partition(":")
    if not module_name or not attrs:
        raise ConfigError(f"{where}: target must look like 'package.module:attr'")
    obj = load_target(plugin.target, where)
    if isinstance(obj, EnvSpec):
        return _check_spec(obj, plugin, where)
    if _is_environment_class(obj):
        return _check_spec(_from_class(obj, plugin, where), plugin, where)
    if callable(obj):
        try:
            made = obj(context)
        except Exception as e:
            raise ConfigError(f"{where}: the factory failed: {type(e).__name__}: {e}") from None
        return _check_spec(made, plugin, where)
    raise ConfigError(f"{where}: {attrs!r} is a {type(obj).__name__}, not an EnvSpec, environment class or factory")
