"""JAX's persistent compilation cache, on by default: a restarted service starts in seconds.

Inference and the trainer compile a few dozen programs before their first useful step (tens of
seconds on a small CPU host). With the cache, the second start of the same shapes reads them
back from disk. The directory is `$ARLO_COMPILE_CACHE_DIR` (the local launcher points it under
`$ARLO_HOME`, Kubernetes at a volume), else `$ARLO_HOME/jax-cache`; "off" disables it. JAX's
own thresholds (cache only programs that took >= 1 s to compile) are lowered to zero: at these
model sizes most programs compile in well under a second, and together they are the start-up.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from arlo.private_files import arlo_home

log = logging.getLogger(__name__)

ENV = "ARLO_COMPILE_CACHE_DIR"


def cache_dir() -> Path | None:
    """Where compiled programs are kept; None when the cache is off."""
    configured = os.environ.get(ENV, "").strip()
    if configured.lower() == "off":
        return None
    if configured:
        return Path(configured)
    return arlo_home() / "jax-cache"


def enable_compile_cache() -> Path | None:
    """Points JAX at the cache directory (made if missing); call before the first compile.
    A directory that cannot be made leaves the cache off, with a warning: never fatal."""
    path = cache_dir()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache off: cannot create %s (%s)", path, e)
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
