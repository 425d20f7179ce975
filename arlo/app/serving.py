"""Whether a run's services serve before a command drives them (`arlo train`).

`arlo train` started while `arlo up` restarted a killed trainer exited at once ("not serving")
where every call of the run itself would have ridden the restart out within `--outage-s`
(issue 33, item 17). Services of which some serve are a run, part of it restarting or still
starting: they are waited for, up to the outage the run allows. None serving is no run at all:
said at once, with how to start one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from arlo.app.supervisor import is_serving
from arlo.config import RunConfig


class NotRunning(RuntimeError):
    """A service the command needs does not answer health checks."""


def _down(cfg: RunConfig, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not is_serving(getattr(cfg, n).server.address)]


def require_serving(cfg: RunConfig, names: tuple[str, ...], *, outage_s: float = 0.0, poll_s: float = 1.0,
                    on_wait: Callable[[list[str]], None] | None = None) -> None:
    """Returns once every service of `names` serves. Raises NotRunning at once when none does,
    else after `outage_s` of some still down (`on_wait(down)` is told once, when the wait begins)."""
    down = _down(cfg, names)
    if not down:
        return
    where = ", ".join(f"{n} ({getattr(cfg, n).server.address})" for n in down)
    if len(down) == len(names):
        raise NotRunning(f"not serving: {where}. Start the services with `arlo up` "
                         f"(or point -c at the config they run with).")
    if on_wait is not None:
        on_wait(down)
    deadline = time.monotonic() + outage_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if not (down := _down(cfg, names)):
            return
    where = ", ".join(f"{n} ({getattr(cfg, n).server.address})" for n in down)
    raise NotRunning(f"not serving after {outage_s:.0f}s (--outage-s) while the rest of the run serves: {where}. "
                     f"See its log under $ARLO_HOME/logs, or the terminal of `arlo up`.")
