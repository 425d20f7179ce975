"""Loading a user's "package.module:attr" target (reward plugins, environment plugins): one rule,
one wording. A failing import or a missing attribute is a ConfigError naming `where` (the config
field and the plugin), never a traceback from inside a service's start-up."""

from __future__ import annotations

import importlib
from typing import Any

from arlo.config import ConfigError


def load_target(target: str, where: str) -> Any:
    """The object `target` ("package.module:attr.sub") names."""
    module, _, attrs = target.partition(":")
    if not module or not attrs:
        raise ConfigError(f"{where}: target {target!r} must look like 'package.module:attribute'")
    try:
        obj = importlib.import_module(module)
    except (Exception, SystemExit) as e:  # the plugin's own import-time failure, reported in one line
        raise ConfigError(f"{where}: cannot import module {module!r}: {type(e).__name__}: {e}") from None
    for attr in attrs.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ConfigError(f"{where}: {type(obj).__name__} {getattr(obj, '__name__', obj)!r} has no "
                              f"attribute {attr!r}") from None
    return obj
