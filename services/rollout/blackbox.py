"""Black-box agents as environments: the user's `async def run(task, client) -> str | float`.

`rollout.agent: "module:function"` replaces the built-in turn loop. For each episode the
runner resets the configured environment (the task), hands the agent an `openai.AsyncOpenAI`
client pointed at one inference replica's OpenAI endpoint with the episode's id in the
`X-Arlo-Episode` header, and lets the agent call the model and its tools however it likes.
Afterwards it fetches what that replica recorded (Inference.GetEpisode) and assembles the
trajectory from the exact token ids: nothing is re-tokenized.

Assembly (`assemble`): calls are taken in order. A call whose prompt extends the sequence so
far (the agent sent the model's replies back verbatim, so the endpoint continued from their
tokens) adds only its new prompt tokens as context (loss mask 0) and its sampled tokens as
model tokens (mask 1, with their logprobs and versions). A call whose prompt does not extend
it (the agent rewrote or trimmed its history, or ran an unrelated side call) starts a new
*segment*: a sequence the trainer could not score as one context. The trajectory is the
last segment (the one that produced the answer); earlier ones are dropped (counted in the
runner's `segments_dropped`), and `num_turns` counts the last segment's calls only.

Scoring: a float return is the reward as is. A str is the answer: it is sent to the
environment as the final action (so its answer extraction and reference apply) and scored
with the entry's reward function, as the built-in loop does.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from arlo.proto.v1 import common_pb2
from services.rollout.agent import (
    EnvClient,
    EpisodeSpec,
    Scorer,
    Turn,
    _Builder,
    _trajectory,
    parse_metadata,
    parse_tools,
)
from services.rollout.types import ScoreResult

log = logging.getLogger(__name__)
EPISODE_HEADER = "X-Arlo-Episode"


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentTask:
    """What the agent is given: the environment's first observation as OpenAI messages."""

    id: str
    messages: list[dict[str, str]]
    tools: list[dict[str, Any]]
    """The environment's tools in the OpenAI format (pass them as `tools=`); [] when none."""
    metadata: dict[str, Any]
    env_name: str
    seed: int
    episode_id: str


AgentFn = Callable[[AgentTask, Any], Awaitable["str | float"]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Call:
    """One recorded call (the rollout's view of inference's RecordedCall)."""

    prompt: tuple[int, ...]
    choices: tuple[Turn, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Assembled:
    builder: _Builder
    prompt_length: int
    turns: int
    segments: int


class Recordings(Protocol):
    """The inference side of a black-box episode (gRPC in production: `recorded.py`)."""

    async def endpoint(self, episode_id: str) -> str:
        """Base URL of the OpenAI endpoint on the replica that serves `episode_id`."""
        ...

    async def take(self, episode_id: str) -> list[Call]: ...


def load_agent(spec: str) -> AgentFn:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"rollout.agent: cannot import {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.agent: {spec!r} must name an `async def run(task, client)` "
                         f"(found {type(fn).__name__ if fn is not None else 'nothing'})")
    return fn


def assemble(calls: Sequence[Call]) -> Assembled | None:
    """The trajectory's arrays from the recorded calls (see the module docstring); None when
    the agent never called the model."""
    b, prompt_length, turns, segments = _Builder(), 0, 0, 0
    for k, call in enumerate(calls):
        choice = _continued_choice(call, calls[k + 1] if k + 1 < len(calls) else None)
        if b.tokens and list(call.prompt[:len(b.tokens)]) == b.tokens:
            b.add_context(call.prompt[len(b.tokens):])
        else:
            b, prompt_length, turns, segments = _Builder(), len(call.prompt), 0, segments + 1
            b.add_context(call.prompt)
        b.add_model(choice)
        turns += 1
    return Assembled(builder=b, prompt_length=prompt_length, turns=turns, segments=segments) if calls else None


def _continued_choice(call: Call, following: Call | None) -> Turn:
    """With n > 1, the choice the next call built on (else the first)."""
    if following is not None and len(call.choices) > 1:
        for choice in call.choices:
            seq = [*call.prompt, *choice.token_ids]
            if list(following.prompt[:len(seq)]) == seq:
                return choice
    return call.choices[0]


@dataclass(kw_only=True)
class BlackBoxRunner:
    """Runs episodes with a black-box agent; called like `agent.run_episode`."""

    agent: AgentFn
    recordings: Recordings
    token: str | None
    timeout_s: float = 120.0
    client_timeout_s: float = 60.0
    stats: dict[str, int] = field(default_factory=lambda: {"segments_dropped": 0, "agent_errors": 0})

    async def __call__(self, spec: EpisodeSpec, tok: object, gen: object, env: EnvClient,
                       scorer: Scorer) -> common_pb2.Trajectory:
        import openai  # the agent's own client library; only black-box runs need it

        started = time.monotonic()
        episode_id = uuid.uuid4().hex
        reset = await env.reset(spec.env_name, spec.env_config_json, spec.seed)
        timings = common_pb2.Timings()
        task = AgentTask(id=reset.task_id, env_name=spec.env_name, seed=spec.seed, episode_id=episode_id,
                         messages=[_message(m) for m in reset.observation],
                         tools=parse_tools(reset.tools_json) or [], metadata=parse_metadata(reset.metadata_json))
        finish, result, failure = "done", None, ""
        client = openai.AsyncOpenAI(base_url=await self.recordings.endpoint(episode_id), api_key=self.token or "none",
                                    default_headers={EPISODE_HEADER: episode_id}, max_retries=2,
                                    timeout=self.client_timeout_s)
        try:
            result = await asyncio.wait_for(self.agent(task, client), spec.max_wall_s or self.timeout_s)
        except TimeoutError:
            finish = "max_wall_time"
        except Exception as e:  # the user's code failed: this episode is an error, the run goes on
            self.stats["agent_errors"] += 1
            finish, failure = "error", f"agent raised {type(e).__name__}: {e}"
        finally:
            await client.close()
        timings.generate_s = time.monotonic() - started
        calls = await self.recordings.take(episode_id)
        score, answer = None, ""
        try:
            if finish == "done" and isinstance(result, int | float) and not isinstance(result, bool):
                score = ScoreResult(status="ok", reward=float(result))
            elif finish == "done" and isinstance(result, str):
                t0 = time.monotonic()
                answer, score = await self._score(spec, env, scorer, reset.session_id, result, reset.metadata_json)
                timings.reward_s = time.monotonic() - t0
            elif finish == "done":
                finish, failure = "error", f"the agent returned {type(result).__name__}; expected str or float"
        finally:
            await env.close(reset.session_id)
        timings.total_s = time.monotonic() - started
        return self._trajectory(spec, episode_id, reset.task_id, calls, finish, failure, score, timings)

    async def _score(self, spec: EpisodeSpec, env: EnvClient, scorer: Scorer, session_id: str, result: str,
                     metadata_json: str) -> tuple[str, ScoreResult]:
        step = await env.step(session_id, result)
        answer, reference = (step.answer, step.reference) if step.done else (result, "")
        return answer, await scorer.score(spec.reward_fn, answer, reference, metadata_json)

    def _trajectory(self, spec: EpisodeSpec, episode_id: str, task_id: str, calls: list[Call], finish: str,
                    failure: str, score: ScoreResult | None, timings: common_pb2.Timings) -> common_pb2.Trajectory:
        built = assemble(calls)
        if built is None:
            failure = failure or "the agent made no model call through the endpoint"
            built = Assembled(builder=_Builder(), prompt_length=0, turns=0, segments=0)
        self.stats["segments_dropped"] += max(built.segments - 1, 0)
        traj = _trajectory(spec, episode_id, task_id, built.builder, built.prompt_length, finish, built.turns,
                           score, timings)
        if failure:
            traj.status, traj.error, traj.finish_reason = common_pb2.TRAJECTORY_STATUS_ERROR, failure[:1000], "error"
        return traj


def _message(m: Any) -> dict[str, str]:
    out = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    return out
