"""Typed run configuration: frozen dataclasses, loaded from YAML, validated at load.

A run is one YAML file whose sections map onto `RunConfig`'s fields; every field has a
default, so `{}` is a valid (the built-in) config. Unknown keys and wrong types are errors
that name the field's full path, e.g. `trainer.learning_rate: expected float, got 'abc'`, and
so is a key given twice in the YAML. Every int and float field declares its valid range with
the field (`ranged(default, gt=0, ...)`, arlo/config/base.py), which its section's validate
checks at load (`check_ranges`): `rollout.rpc_timeout_s: must be in (0, 604800], got 0.0`.

One module per subject (base: errors, the run-id rule and the shared sections; model;
inference; trainer; env: env_gateway and reward; rollout; run: RunConfig and the loader);
import from `arlo.config`, which re-exports every name.
"""

from __future__ import annotations

from arlo.choices import Advantage, Aggregation, Dtype, Isolation, KlKind, RatioLevel, Reference, Remat
from arlo.config.base import (
    AuthConfig,
    ConfigError,
    LocalConfig,
    MeshConfig,
    RedisConfig,
    ServerConfig,
    TlsConfig,
    TracingConfig,
    check_run_id,
)
from arlo.config.env import (
    EnvGatewayConfig,
    EnvPluginConfig,
    McpServerConfig,
    RemoteEnvConfig,
    RewardConfig,
    RewardPluginConfig,
    SandboxConfig,
)
from arlo.config.inference import InferenceConfig
from arlo.config.model import ModelSpec
from arlo.config.rollout import (
    DATASET_ANSWER_FORMATS,
    DATASET_FORMATS,
    DATASET_MAX_TURNS,
    DATASET_SPLITS,
    TASK_SEEDS,
    DatasetConfig,
    EvalConfig,
    RolloutConfig,
    RolloutEnvConfig,
    SamplingConfig,
    TasksConfig,
)
from arlo.config.run import RunConfig, dump_config, from_dict, load_config, replace_config, to_dict, type_name
from arlo.config.trainer import AlgorithmConfig, SFTConfig, TrainerConfig

__all__ = [
    # the Literal choices the fields are typed with (arlo.choices), importable from here too
    "Advantage", "Aggregation", "Dtype", "Isolation", "KlKind", "RatioLevel", "Reference", "Remat",
    # base
    "AuthConfig", "ConfigError", "LocalConfig", "MeshConfig", "RedisConfig", "ServerConfig", "TlsConfig", "TracingConfig",
    "check_run_id",
    # model, inference, trainer
    "ModelSpec", "InferenceConfig", "AlgorithmConfig", "SFTConfig", "TrainerConfig",
    # env gateway and reward
    "EnvGatewayConfig", "EnvPluginConfig", "McpServerConfig", "RemoteEnvConfig", "RewardConfig",
    "RewardPluginConfig", "SandboxConfig",
    # rollout
    "DATASET_ANSWER_FORMATS", "DATASET_FORMATS", "DATASET_MAX_TURNS", "DATASET_SPLITS", "TASK_SEEDS",
    "DatasetConfig", "EvalConfig", "RolloutConfig", "RolloutEnvConfig", "SamplingConfig", "TasksConfig",
    # the run and its loader
    "RunConfig", "dump_config", "from_dict", "load_config", "replace_config", "to_dict", "type_name",
]
