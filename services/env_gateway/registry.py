"""Environments by name: how to make one, its typed config, its tools, and what ListEnvironments
says about it. Factories get an `EnvContext`: the gateway config plus shared objects."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from arlo.config import EnvGatewayConfig
from services.env_gateway.envs import arith, calculator, guess_number, python_exec, retrieval
from services.env_gateway.envs.base import Environment, EnvUnavailableError
from services.env_gateway.envs.python_exec import CodeRunner
from services.env_gateway.tool_schema import tools_json


class EnvContext:
    """What environment factories receive: the gateway's config and objects shared by sessions.

    Shared objects are built on first use, so a gateway whose clients never pick the python
    environment never probes for a sandbox.
    """

    def __init__(self, config: EnvGatewayConfig | None = None, *, sandbox: CodeRunner | None = None) -> None:
        self.config = config if config is not None else EnvGatewayConfig()
        self._sandbox = sandbox

    @property
    def sandbox(self) -> CodeRunner:
        if self._sandbox is None:
            from arlo.sandbox import Sandbox, SandboxError  # imported late: only the python env needs it

            try:
                self._sandbox = Sandbox(self.config.sandbox)
            except SandboxError as e:
                raise EnvUnavailableError(f"no code sandbox on this gateway: {e}") from e
        return self._sandbox


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvSpec:
    name: str
    description: str
    factory: Callable[[EnvContext], Environment]
    """A fresh instance per session."""
    config_type: type[Any]
    """The typed config (a frozen dataclass) that Reset's config_json is read into."""
    tools: Sequence[Mapping[str, Any]] = ()
    """Tool schemas in the OpenAI function format."""
    max_turns: int = 1
    """Upper bound on turns any config of this environment allows."""
    blocking: bool = False
    """reset/step may block (run code, do I/O): the gateway calls them in a worker thread.
    Cheap environments stay inline, where a StepBatch of them costs about one Step."""
    tools_json: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools_json", tools_json(self.tools))


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
    corpus = retrieval.load_corpus(context.config.retrieval_docs_dir)  # at start: a bad dir fails fast
    return [
        EnvSpec(name=arith.NAME, description=arith.DESCRIPTION, factory=lambda ctx: arith.ArithEnv(),
                config_type=arith.ArithConfig, max_turns=arith.MAX_TURNS),
        EnvSpec(name=calculator.NAME, description=calculator.DESCRIPTION,
                factory=lambda ctx: calculator.CalculatorEnv(), config_type=calculator.CalculatorConfig,
                tools=calculator.TOOLS, max_turns=calculator.MAX_TURNS),
        EnvSpec(name=guess_number.NAME, description=guess_number.DESCRIPTION,
                factory=lambda ctx: guess_number.GuessNumberEnv(), config_type=guess_number.GuessNumberConfig,
                tools=guess_number.TOOLS, max_turns=guess_number.MAX_TURNS),
        EnvSpec(name=python_exec.NAME, description=python_exec.DESCRIPTION,
                factory=lambda ctx: python_exec.PythonEnv(ctx.sandbox), config_type=python_exec.PythonConfig,
                tools=python_exec.TOOLS, max_turns=python_exec.MAX_TURNS, blocking=True),
        EnvSpec(name=retrieval.NAME, description=retrieval.DESCRIPTION,
                factory=lambda ctx: retrieval.RetrievalEnv(corpus), config_type=retrieval.RetrievalConfig,
                tools=retrieval.TOOLS, max_turns=retrieval.MAX_TURNS),
    ]


def default_registry(context: EnvContext | None = None) -> EnvRegistry:
    """The built-in environments; `context` defaults to the default gateway config."""
    context = context if context is not None else EnvContext()
    return EnvRegistry(builtin_specs(context), context=context)
