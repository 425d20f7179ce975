"""Every int and float setting declares its valid range (`ranged`), and the loader refuses a value
outside it with an error naming the field and the range: values that loaded and broke the run
later (a 0 s socket timeout, a 0 s RPC deadline, read_block_ms -1) are refused at load."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest

from arlo.config import (
    ConfigError,
    McpServerConfig,
    RemoteEnvConfig,
    RolloutEnvConfig,
    RunConfig,
    load_config,
)
from arlo.config.base import MAX_INT, Range, range_of

ROOT = Path(__file__).resolve().parents[2]

# A valid entry of each list-of-sections field, so that one field of it can be set out of range.
ENTRY = {RemoteEnvConfig: {"address": "h:1"}, McpServerConfig: {"name": "m", "url": "http://h/mcp"},
         RolloutEnvConfig: {"name": "arith"}}


@dataclasses.dataclass(frozen=True)
class Numeric:
    steps: tuple[tuple[str, type | None], ...]  # (field name, the section class when it is a list of them)
    field: dataclasses.Field
    is_int: bool
    is_tuple: bool

    @property
    def path(self) -> str:
        return ".".join(name + ("[0]" if entry else "") for name, entry in self.steps)

    def overrides(self, value: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        node = out
        for name, entry in self.steps[:-1]:
            if entry is None:
                node = node.setdefault(name, {})
            else:
                item = dict(ENTRY[entry])
                node[name] = [item]
                node = item
        node[self.steps[-1][0]] = [value] if self.is_tuple else value
        return out


def _scalar(tp: Any) -> type | None:
    """int or float when `tp` is one (bare, optional, or a tuple's item), else None."""
    if get_origin(tp) in (Union, UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        tp = options[0] if len(options) == 1 else None
    if get_origin(tp) is tuple:
        tp = get_args(tp)[0]
    return tp if tp in (int, float) else None


def numeric_fields(cls: type = RunConfig, steps: tuple[tuple[str, type | None], ...] = ()) -> list[Numeric]:
    """Every int and float setting under `cls`: nested sections and lists of sections included."""
    out = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        item = get_args(tp)[0] if get_origin(tp) is tuple else None
        if dataclasses.is_dataclass(tp):
            out += numeric_fields(tp, (*steps, (f.name, None)))
        elif isinstance(item, type) and dataclasses.is_dataclass(item):
            out += numeric_fields(item, (*steps, (f.name, item)))
        elif (scalar := _scalar(tp)) is not None:
            out.append(Numeric((*steps, (f.name, None)), f, scalar is int, get_origin(tp) is tuple))
    return out


FIELDS = numeric_fields()


def outside(bounds: Range, is_int: bool) -> list[float]:
    """Values just past each end of `bounds` (and not one of its special values)."""
    step = 1 if is_int else 1e-3
    values = []
    for end, is_open, sign in ((bounds.lo, bounds.lo_open, -1), (bounds.hi, bounds.hi_open, 1)):
        if end is None:
            continue
        value = end if is_open else end + sign * max(step, abs(end) * 1e-3 if not is_int else step)
        while value in bounds:  # a special value just past the end (-1 below ports starting at 0)
            value += sign * step
        values.append(int(value) if is_int else float(value))
    return values


def test_every_numeric_setting_declares_a_range() -> None:
    """A new int or float field without `ranged(...)` fails here: declare what it may be."""
    missing = [n.path for n in FIELDS if range_of(n.field) is None]
    assert missing == [], f"numeric settings without a declared range: {missing}"
    paths = {n.path for n in FIELDS}
    assert len(FIELDS) > 120, len(FIELDS)
    for path in ("redis.socket_timeout_s", "rollout.rpc_timeout_s", "trainer.read_block_ms", "env_gateway.sandbox.uid",
                 "env_gateway.remotes[0].timeout_s", "env_gateway.mcp_servers[0].max_turns", "rollout.envs[0].weight",
                 "rollout.tasks.eval_fraction", "rollout.sampling.stop_token_ids", "trainer.mesh.axis_sizes",
                 "rollout.sampling.seed", "reward.server.grace_s"):
        assert path in paths, path


def test_every_declared_range_has_a_limit_and_holds_its_default() -> None:
    for n in FIELDS:
        bounds = range_of(n.field)
        assert bounds is not None and (bounds.lo is not None or bounds.hi is not None), n.path
        assert outside(bounds, n.is_int), f"{n.path}: no value lies outside {bounds.describe()}"
    assert load_config() == RunConfig()  # every default (each service's own server section too) is in range


@pytest.mark.parametrize("numeric", FIELDS, ids=[n.path for n in FIELDS])
def test_a_value_outside_the_declared_range_is_refused(numeric: Numeric) -> None:
    bounds = range_of(numeric.field)
    assert bounds is not None
    for value in outside(bounds, numeric.is_int):
        if numeric.is_int and abs(value) > MAX_INT:
            continue  # the int64 limit refuses it first (test_config.py)
        pattern = rf"^{re.escape(numeric.path)}(\[0\])?: must be {re.escape(bounds.describe())}, got "
        with pytest.raises(ConfigError, match=pattern):
            load_config(overrides=numeric.overrides(value))


@pytest.mark.parametrize("numeric", [n for n in FIELDS if range_of(n.field).special and not n.is_tuple],  # type: ignore[union-attr]
                         ids=lambda n: n.path)
def test_special_values_keep_their_meaning(numeric: Numeric) -> None:
    """0 = off, -1 = disabled: the values a field documents outside its span still load."""
    bounds = range_of(numeric.field)
    assert bounds is not None
    for value, _meaning in bounds.special:
        load_config(overrides=numeric.overrides(value))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"redis": {"socket_timeout_s": 0}}, "redis.socket_timeout_s: must be in (0, 604800], got 0.0"),
    ({"redis": {"socket_timeout_s": -1.0}}, "redis.socket_timeout_s: must be in (0, 604800], got -1.0"),
    ({"redis": {"reconnect_max_s": -1}}, "redis.reconnect_max_s: must be in [0.01, 300], got -1.0"),
    ({"rollout": {"rpc_timeout_s": 0}}, "rollout.rpc_timeout_s: must be in (0, 604800], got 0.0"),
    ({"rollout": {"episode_timeout_s": -5}}, "rollout.episode_timeout_s: must be in (0, 604800]"),
    ({"rollout": {"max_episode_tokens": -1}}, "rollout.max_episode_tokens: must be >= 1, got -1"),
    ({"trainer": {"read_block_ms": -1}}, "trainer.read_block_ms: must be in [10, 604800000], got -1"),
    ({"trainer": {"read_block_ms": 0}}, "trainer.read_block_ms: must be in [10, 604800000], got 0"),
    ({"trainer": {"max_grad_norm": -1}}, "trainer.max_grad_norm: must be > 0, got -1.0"),
    ({"trainer": {"algorithm": {"norm_constant": -1}}}, "trainer.algorithm.norm_constant: must be >= 0"),
    ({"trainer": {"algorithm": {"overlong_buffer_tokens": -1}}}, "trainer.algorithm.overlong_buffer_tokens: must be >= 0"),
    ({"trainer": {"algorithm": {"dual_clip": 0.5}}}, "trainer.algorithm.dual_clip: must be 0 (off) or > 1, got 0.5"),
    ({"env_gateway": {"max_sessions": -1}}, "env_gateway.max_sessions: must be >= 1, got -1"),
    ({"env_gateway": {"sandbox": {"uid": -1}}}, "env_gateway.sandbox.uid: must be in [1, 4294967294], got -1"),
    ({"reward": {"sandbox": {"uid": 0}}}, "reward.sandbox.uid: must be in [1, 4294967294], got 0"),
    ({"inference": {"server": {"metrics_port": -2}}}, "inference.server.metrics_port: must be -1 (off) or in [0, 65535]"),
    ({"trainer": {"mesh": {"axis_sizes": [-1, 0, 1]}}}, "trainer.mesh.axis_sizes[1]: must be -1 (the rest) or >= 1, got 0"),
    ({"rollout": {"sampling": {"stop_token_ids": [3, -1]}}}, "rollout.sampling.stop_token_ids[1]: must be >= 0, got -1"),
    ({"model": {"seed": 2**32}}, "model.seed: must be in [0, 4294967295], got 4294967296"),
])
def test_reported_values_are_refused_at_load(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("section", ["inference", "trainer", "env_gateway", "reward", "rollout"])
def test_every_server_grace_is_checked(section: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{section}\.server\.grace_s: must be in \[0, 604800\], got -1.0"):
        load_config(overrides={section: {"server": {"grace_s": -1}}})
    assert getattr(load_config(overrides={section: {"server": {"grace_s": 0}}}), section).server.grace_s == 0.0


def test_the_trainer_read_stays_below_the_redis_socket_timeout() -> None:
    """The stream refuses (mid-run, in the trainer's intake) a block that the socket timeout
    could cut short; the loader now refuses that pair up front, with the same rule."""
    assert load_config(overrides={"trainer": {"read_block_ms": 9000}}).trainer.read_block_ms == 9000
    with pytest.raises(ConfigError, match=r"^trainer.read_block_ms: must stay below redis.socket_timeout_s \(10 s\)"
                                          r".*at most 9000 here, got 9001"):
        load_config(overrides={"trainer": {"read_block_ms": 9001}})
    with pytest.raises(ConfigError, match=r"at most 500 here, got 1000"):
        load_config(overrides={"redis": {"socket_timeout_s": 1}})
    load_config(overrides={"redis": {"socket_timeout_s": 1}, "trainer": {"read_block_ms": 500}})


GENERATED_MODEL = ROOT / "examples" / "own_format" / "demo.yaml"
"""Its model.path is written by the example's make_checkpoint.py (git ignores it): loaded over one
written here (test_the_own_format_example_config_loads)."""


def test_the_shipped_configs_load() -> None:
    """The built-in, example and deploy run configs stay within the declared ranges."""
    paths = [ROOT / "arlo" / "data" / "demo.yaml", *sorted((ROOT / "examples").rglob("*.yaml")),
             *sorted((ROOT / "deploy").rglob("run.yaml"))]
    assert len(paths) >= 8 and GENERATED_MODEL in paths
    for path in paths:
        if path != GENERATED_MODEL:
            load_config(path)


@pytest.mark.timeout(300)
def test_the_own_format_example_config_loads(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    model = tmp_path / "model"
    made = subprocess.run([sys.executable, str(GENERATED_MODEL.parent / "make_checkpoint.py"), "--out", str(model),
                           "--demos", "50"], capture_output=True, text=True, timeout=240)
    assert made.returncode == 0, made.stderr[-3000:]
    load_config(GENERATED_MODEL, {"model": {"path": str(model)}, "trainer": {"sft": {"data": str(model / "sft.jsonl")}}})
