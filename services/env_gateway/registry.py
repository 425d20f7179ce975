"""Environments by name: how to make one, its typed config, its tools, and what ListEnvironments
says about it. Factories get an `EnvContext`: the gateway config plus shared objects."""

from __future__ import annotations

from collections.abc import Iterable

from arlo.private_files import arlo_home
from services.env_gateway.envs import (
    arith,
    calculator,
    dataset,
    guess_number,
    long_doc,
    python_exec,
    retrieval,
)
from services.env_gateway.envs.base import Environment
from services.env_gateway.envs.dataset_source import DatasetRoots, DatasetStore
from services.env_gateway.spec import EnvContext, EnvSpec

__all__ = ["EnvContext", "EnvRegistry", "EnvSpec", "builtin_specs", "default_registry"]


class EnvRegistry:
    def __init__(self, specs: Iterable[EnvSpec] = (), *, context: EnvContext | None = None) -> None:
        self.context = context if context is not None else EnvContext()
        self._specs: dict[str, EnvSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: EnvSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"environment {spec.name!r} is already registered")
        self._specs[spec.name] = spec

    def get(self, name: str) -> EnvSpec | None:
        return self._specs.get(name)

    def create(self, spec: EnvSpec) -> Environment:
        return spec.factory(self.context)

    def specs(self) -> list[EnvSpec]:
        return sorted(self._specs.values(), key=lambda s: s.name)

    def names(self) -> list[str]:
        return sorted(self._specs)


def builtin_specs(context: EnvContext) -> list[EnvSpec]:
    try:
        corpus = retrieval.load_corpus(context.config.retrieval_docs_dir)  # at start: a bad dir fails fast
    except ValueError as e:
        raise ValueError(f"env_gateway.retrieval_docs_dir: {e}") from e
    # One copy of each dataset for all sessions; relative roots are from the working directory now.
    # arlo's state directory (token, config, JSON-line logs) sits in the default root "." of `arlo up`.
    store = DatasetStore(DatasetRoots(context.config.dataset_roots, private=(arlo_home(),)))
    return [
        EnvSpec(name=dataset.NAME, description=dataset.DESCRIPTION, factory=lambda ctx: dataset.DatasetEnv(store, tool_format=ctx.tool_format),
                config_type=dataset.DatasetConfig, tools=dataset.TOOLS, max_turns=dataset.MAX_TURNS,
                blocking=True),  # the first Reset of a dataset reads it from disk
        EnvSpec(name=arith.NAME, description=arith.DESCRIPTION, factory=lambda ctx: arith.ArithEnv(tool_format=ctx.tool_format),
                config_type=arith.ArithConfig, max_turns=arith.MAX_TURNS),
        EnvSpec(name=calculator.NAME, description=calculator.DESCRIPTION,
                factory=lambda ctx: calculator.CalculatorEnv(tool_format=ctx.tool_format), config_type=calculator.CalculatorConfig,
                tools=calculator.TOOLS, max_turns=calculator.MAX_TURNS),
        EnvSpec(name=guess_number.NAME, description=guess_number.DESCRIPTION,
                factory=lambda ctx: guess_number.GuessNumberEnv(tool_format=ctx.tool_format), config_type=guess_number.GuessNumberConfig,
                tools=guess_number.TOOLS, max_turns=guess_number.MAX_TURNS),
        EnvSpec(name=long_doc.NAME, description=long_doc.DESCRIPTION, factory=lambda ctx: long_doc.LongDocEnv(),
                config_type=long_doc.LongDocConfig, max_turns=long_doc.MAX_PARTS),
        EnvSpec(name=python_exec.NAME, description=python_exec.DESCRIPTION,
                factory=lambda ctx: python_exec.PythonEnv(ctx.sandbox, tool_format=ctx.tool_format), config_type=python_exec.PythonConfig,
                tools=python_exec.TOOLS, max_turns=python_exec.MAX_TURNS, blocking=True),
        EnvSpec(name=retrieval.NAME, description=retrieval.DESCRIPTION,
                factory=lambda ctx: retrieval.RetrievalEnv(corpus, tool_format=ctx.tool_format), config_type=retrieval.RetrievalConfig,
                tools=retrieval.TOOLS, max_turns=retrieval.MAX_TURNS),
    ]


def default_registry(context: EnvContext | None = None) -> EnvRegistry:
    """The built-in environments; `context` defaults to the default gateway config."""
    context = context if context is not None else EnvContext()
    return EnvRegistry(builtin_specs(context), context=context)
