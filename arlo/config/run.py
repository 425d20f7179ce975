"""`RunConfig`, the whole run, and the loader: YAML in, typed and validated config out (and back)."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

import yaml

from arlo.config.base import (
    MAX_INT,
    AuthConfig,
    ConfigError,
    LocalConfig,
    RedisConfig,
    T,
    TracingConfig,
    _check,
    _frozen,
    check_run_id,
    longest_block_ms,
)
from arlo.config.env import EnvGatewayConfig, RewardConfig
from arlo.config.inference import InferenceConfig
from arlo.config.model import ModelSpec
from arlo.config.rollout import RolloutConfig
from arlo.config.trainer import TrainerConfig
from arlo.jsonfields import MAX_DEPTH
from arlo.private_files import write_private
from arlo.regular_files import read_regular_text


@_frozen
class RunConfig:
    run_id: str = "default"
    """Namespace of every Redis key (`arlo:{run_id}:...`)."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The policy model, shared by trainer and inference."""
    redis: RedisConfig = field(default_factory=RedisConfig)
    """The Redis that holds the trajectory stream, weight pointer and heartbeats."""
    auth: AuthConfig = field(default_factory=AuthConfig)
    """Bearer-token auth of every RPC but health."""
    tracing: TracingConfig = field(default_factory=TracingConfig)
    """OpenTelemetry traces of every service: where spans go, how many traces are kept."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """The inference service: request limits, batching, KV cache."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The trainer service: optimizer, RL objective, checkpoints."""
    env_gateway: EnvGatewayConfig = field(default_factory=EnvGatewayConfig)
    """The environment gateway: sessions, sandbox, remote environments."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward service: verifier deadline, plugins, sandbox."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout workers: the task, group sampling, episode limits."""
    local: LocalConfig = field(default_factory=LocalConfig)
    """Local runs only (`arlo up`, `demo`, and the workers `arlo train` adds): how the services share this host's CPUs and accelerator."""

    def model_source(self) -> Any:
        """The arlo.model.source ModelSource of the policy: `model`, with `trainer.lora`'s adapters."""
        return self.model.source(lora=self.trainer.lora)

    def validate(self, path: str = "") -> None:
        check_run_id(self.run_id)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if hasattr(value, "validate"):
                value.validate(f.name)
        # The stream refuses such a read at every call (arlo/coord/stream.py): mid-run, not here.
        timeout = self.redis.socket_timeout_s
        most_ms = longest_block_ms(timeout)
        _check("trainer.read_block_ms", self.trainer.read_block_ms <= most_ms,
               f"must stay below redis.socket_timeout_s ({timeout:g} s) by min(1 s, half of it): at most "
               f"{most_ms} here, got {self.trainer.read_block_ms}")
        self._check_episode_fits()
        self._check_kv_budget()
        self._check_step_fits_backlog()
        self._check_lora_fits()
        self._check_routing_replay()
        self._check_attention_kernel()
        runs = self.inference.runs
        _check("inference.runs", not runs or self.trainer.lora.rank > 0,
               "several runs share one inference service through LoRA adapter slots over one base: "
               "set trainer.lora.rank (every run the same shape)")
        _check("inference.runs", self.run_id not in runs, f"lists this config's own run_id {self.run_id!r}")

    def _check_routing_replay(self) -> None:
        """Routing replay records routed experts: a model without any has nothing to replay."""
        if not self.trainer.algorithm.routing_replay:
            return
        from arlo.model.config import ModelConfig
        from arlo.routing_replay import routing_shape

        m = ModelConfig.from_hf_dir(self.model.path) if self.model.path else ModelConfig.named(self.model.name)
        what = f"model.path {self.model.path!r}" if self.model.path else f"model.name {self.model.name!r}"
        _check("trainer.algorithm.routing_replay", routing_shape(m) is not None,
               f"{what} has no routed experts (a Qwen3-MoE checkpoint has); set it to false")

    def _check_attention_kernel(self) -> None:
        """The paged-attention kernels have no sliding window: refused at load, not at the engine's start."""
        if self.inference.attention_kernel != "pallas":
            return
        from arlo.model.config import ModelConfig

        m = ModelConfig.from_hf_dir(self.model.path) if self.model.path else ModelConfig.named(self.model.name)
        what = f"model.path {self.model.path!r}" if self.model.path else f"model.name {self.model.name!r}"
        _check("inference.attention_kernel", not any(m.is_sliding(i) for i in range(m.num_layers)),
               f"'pallas' has no sliding window, and {what} has sliding-window layers (Gemma 2/3); use 'xla'")

    def _check_lora_fits(self) -> None:
        """A rank at or above a targeted projection's narrower side is no low-rank update: full
        fine-tuning's cost with none of its simplicity, almost always a typo (rank 512 for 16)."""
        lora = self.trainer.lora
        if not lora.rank:
            return
        from arlo.model.config import ModelConfig

        m = ModelConfig.from_hf_dir(self.model.path) if self.model.path else ModelConfig.named(self.model.name)
        mlp = [t for t in lora.targets if t in ("gate_proj", "up_proj", "down_proj")]
        _check("trainer.lora.targets", m.moe is None or not mlp,
               f"{mlp}: the model's MLPs are routed experts (Qwen3-MoE), which carry no LoRA adapters; "
               "target the attention projections (q_proj, k_proj, v_proj, o_proj)")
        widths = {"q_proj": (m.dim, m.num_heads * m.head_dim), "k_proj": (m.dim, m.num_kv_heads * m.head_dim),
                  "v_proj": (m.dim, m.num_kv_heads * m.head_dim), "o_proj": (m.num_heads * m.head_dim, m.dim),
                  "gate_proj": (m.dim, m.mlp_dim), "up_proj": (m.dim, m.mlp_dim), "down_proj": (m.mlp_dim, m.dim)}
        if lora.quantize == "nf4":  # two 4-bit codes per byte along each weight's last axis
            odd = [name for name, size in (("model dim", m.dim), ("head_dim", m.head_dim), ("mlp_dim", m.mlp_dim))
                   if size % 2]
            _check("trainer.lora.quantize", not odd, f"nf4 packs pairs along each weight's last axis; this "
                   f"model's {', '.join(odd)} is odd: use int8")
        for target in lora.targets:
            narrow = min(widths[target])
            _check("trainer.lora.rank", lora.rank < narrow,
                   f"{lora.rank} is not below {target}'s narrower side ({narrow}: {widths[target][0]} -> "
                   f"{widths[target][1]}), so the adapter is no low-rank update; lower it or drop {target} "
                   "from trainer.lora.targets")

    def _check_kv_budget(self) -> None:
        """The inference engine's KV pages must hold one request of inference.max_n samples at the
        engine's full sequence length, or it could never be admitted; the engine refuses such a
        budget at start, this says so when the config loads (a 32k-token run's first check)."""
        if not self.inference.kv_cache_mib:
            return
        from arlo.model.config import ModelConfig
        from arlo.model.kv_budget import kv_layout

        base = ModelConfig.from_hf_dir(self.model.path) if self.model.path else ModelConfig.named(self.model.name)
        length = min(self._model_max_seq_len(), self.inference.max_seq_len or base.max_seq_len)
        try:
            kv_layout(self.inference, dataclasses.replace(base, max_seq_len=length, dtype=self.model.dtype))
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_step_fits_backlog(self) -> None:
        """Liveness: the trainer holds trained entries until a checkpoint covers them, and takes a
        checkpoint early once they would pass half of redis.max_backlog (services/trainer/core/
        holds.py). A step's entries must fit twice in the other half, beside the groups still
        being assembled, or producers stop writing while the trainer waits for a batch: the run
        stalls with every service green (issue 33, item 8)."""
        step = self.trainer.groups_per_step * self.rollout.group_size
        backlog = self.redis.max_backlog
        _check("redis.max_backlog", step * 4 <= backlog,
               f"{backlog} cannot hold the trainer's held entries beside the next batch: one step takes "
               f"trainer.groups_per_step x rollout.group_size = {step} entries, so redis.max_backlog must "
               f"be at least {step * 4}; raise it, or lower trainer.groups_per_step or rollout.group_size")

    def _check_episode_fits(self) -> None:
        """An episode of rollout.max_episode_tokens (its prompt included: the trainer's longest batch
        row) must fit every context set here; past one, its later turns are refused mid-run. The
        first prompt's length is known only at the first episode (the rollout refuses it there)."""
        episode = self.rollout.max_episode_tokens
        for where, limit in (("model.max_seq_len", self.model.max_seq_len),
                             ("inference.max_seq_len", self.inference.max_seq_len)):
            _check(where, not limit or limit >= episode,
                   f"{limit} cannot hold an episode of rollout.max_episode_tokens ({episode}, its prompt "
                   f"included): raise it, or lower rollout.max_episode_tokens")
        # Unset (0), model.max_seq_len is the model's own length: a preset's table (the `small`
        # preset's 1,024; set model.max_seq_len to raise it), a checkpoint's positions (never raised).
        length = self._model_max_seq_len()
        if self.model.path:
            _check("model.path", length >= episode,
                   f"{self.model.path}: its max_position_embeddings ({length}) cannot hold an episode of "
                   f"rollout.max_episode_tokens ({episode}); a checkpoint's context is not raised past "
                   f"it: lower rollout.max_episode_tokens, or use a checkpoint with more positions")
        else:
            _check("model.max_seq_len", length >= episode,
                   f"unset, the preset {self.model.name!r} holds {length} positions, not an episode of "
                   f"rollout.max_episode_tokens ({episode}); set model.max_seq_len to at least {episode} "
                   f"(a preset's RoPE positions extend), or lower rollout.max_episode_tokens")

    def _model_max_seq_len(self) -> int:
        """The model's sequence length as every service resolves it (arlo.model.source)."""
        from arlo.model.config import ModelConfig, sequence_length

        own = (ModelConfig.from_hf_dir(self.model.path) if self.model.path
               else ModelConfig.named(self.model.name)).max_seq_len
        return sequence_length(own, self.model.max_seq_len, checkpoint=bool(self.model.path))


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Builds dataclass `cls` from plain data, checking keys and types; errors name the field."""
    where = path or "<root>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{path}.{name}" if path else name)
    return cls(**kwargs)


_FLOAT_TEXT = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
"""A decimal or scientific float literal, as a string: PyYAML (YAML 1.1) reads `1e-3` (no dot) as one."""


def _coerce(tp: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        # `type(value) is type(a)`: YAML's `true` must not pass as 1, nor 1 as 1.0.
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(f"{path}: must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path}: must be set (null is not allowed)")
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _coerce(options[0], value, path)
        for option in options:  # the first alternative that takes the value
            try:
                return _coerce(option, value, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: expected {' or '.join(type_name(o) for o in options)}, got {value!r}")
    if tp is float and isinstance(value, str) and _FLOAT_TEXT.fullmatch(value):
        number = float(value)  # '1e-3', '5E+2'
        if not math.isfinite(number):  # '1e999'
            raise ConfigError(f"{path}: must be a finite number, got {value!r}")
        value = number
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # past ~1.8e308: no float holds it
            raise ConfigError(f"{path}: must be a finite number, got an integer of {len(str(value))} digits") from None
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
        if tp is int and abs(value) > MAX_INT:  # no setting counts past int64 (protobuf, numpy, JAX)
            raise ConfigError(f"{path}: must be within +-{MAX_INT}, got {value}")
        # No setting means anything by NaN or infinity, and each slips past range checks written
        # as comparisons (NaN fails them all; an infinite poll interval passed `> 0` and never woke).
        if tp is float and not math.isfinite(value):
            raise ConfigError(f"{path}: must be a finite number, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        key_type, value_type = typing.get_args(tp)
        return {_coerce(key_type, k, f"{path} key"): _coerce(value_type, v, f"{path}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1]
        return tuple(_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    return value


def type_name(tp: Any) -> str:
    """A field type as the docs and errors show it: `int`, `list of str`, `one of "a", "b"`, `float or null`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        return f"map of {type_name(key_type)} to {type_name(value_type)}"
    return getattr(tp, "__name__", str(tp))


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain data (lists, not tuples) that YAML can write and `from_dict` reads back."""
    return _plain(dataclasses.asdict(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Loads a YAML run config (the built-in one when `path` is None) and validates it."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = read_yaml(read_regular_text(p)) or {}  # a pipe or a device: refused, not read
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from e
        except (ConfigError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: {e}") from None
        except ValueError as e:  # not a regular file (ConfigError, a ValueError, is caught above)
            raise ConfigError(str(e)) from None
    if overrides:
        data = _merge(data, overrides)
    cfg = from_dict(RunConfig, data)
    cfg.validate()
    return cfg


def read_yaml(text: str) -> Any:
    """`yaml.safe_load`, but a key given twice in one mapping, at any depth, is a ConfigError
    naming it and both lines: PyYAML keeps the last silently (a second `trainer:` section
    dropped the whole first one). A `<<` merge key's entries may still be overridden. Nesting
    past MAX_DEPTH is a ConfigError too, found before composing (which recurses per level)."""
    _check_depth(text)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, "", set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_depth(text: str) -> None:
    """ConfigError where `text` nests past MAX_DEPTH: PyYAML's parser walks events without
    recursing, its composer and constructor recurse per level (RecursionError 100k deep)."""
    loader = yaml.SafeLoader(text)
    try:
        depth = 0
        while (event := loader.get_event()) is not None:
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                _check(f"line {event.start_mark.line + 1}", depth <= MAX_DEPTH, f"nested deeper than {MAX_DEPTH} levels")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: yaml.Node, path: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias: checked where its anchor is
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else f"<{key.tag}>"
            where = f"{path}.{name}" if path else name
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line, first = key.start_mark.line + 1, lines.get((key.tag, key.value))
                _check(where, first is None, f"duplicate key at line {line} (first at line {first}); "
                       "YAML would silently keep only the last")
                lines[(key.tag, key.value)] = line
            _refuse_duplicate_keys(value, where, seen)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    """Written 0600 (atomically): redis.url may carry a password."""
    write_private(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def replace_config(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """A copy of `cfg` with nested `overrides` applied, validated like a loaded config."""
    new = from_dict(RunConfig, _merge(to_dict(cfg), overrides))
    new.validate()
    return new
