"""The episode loop, token-in/token-out: generate -> env step -> ... -> score.

The trajectory is the exact tokens the engine produced plus the exact tokens of each
observation, concatenated; the conversation is never re-tokenized (re-tokenization drift
breaks PPO in peers). The first prompt is the model's chat template applied to the reset
observation with the environment's tools (`tools=`, from ResetResult.tools_json); each
observation after a model turn is the template's continuation for it (tool results are
`role: tool` messages with their `name`), so the tokens equal what the template gives for the
whole conversation (tests/unit/test_chat_prefix.py checks this against transformers). The loop
depends on three small Protocols over the rollout's own
records (`types.py`), so it runs against the in-process adapters (tests/support/inprocess.py) in tests and
the gRPC clients (`clients.py`) in production alike. The Trajectory it returns is a protobuf:
it is the trajectory stream's contract, written to Redis as is.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from arlo.jsonfields import loads_bounded, parse_json_object
from arlo.model.tokenizer import Tokenizer
from arlo.proto.v1 import common_pb2
from services.rollout.types import BackendError, EpisodeDoesNotFit, ResetResult, ScoreResult, StepResult


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finished_by_stop: bool
    queue_s: float = 0.0
    """The generator's own account of the call, when it gives one: time queued before a slot
    took it, and time from then to its last token (the rest of the call is transport)."""
    engine_s: float = 0.0
    routed_experts: bytes = b""
    """Routing replay: each token's recorded experts (Completion.routed_experts' encoding); empty
    when the generator was not asked for them."""
    kept_token_ids: bytes = b""
    """Filter replay: each token's kept set (Completion.kept_token_ids' encoding); empty when the
    generator was not asked for them."""


class Generator(Protocol):
    async def generate(self, prompt: Sequence[int], *, max_tokens: int, session_id: str = "",
                       seed: int | None = None) -> Turn:
        """`session_id` lets the engine keep the episode's KV prefix between turns; `seed` fixes
        the turn's random stream (None: the generator's own choice)."""
        ...


class EnvClient(Protocol):
    """Failures raise `types.BackendError` (`RetryableError` when a retry may succeed)."""

    async def reset(self, env_name: str, config_json: str, seed: int) -> ResetResult: ...
    async def step(self, session_id: str, action: str) -> StepResult: ...
    async def close(self, session_id: str) -> None:
        """Best effort: never raises for a session the backend already forgot."""
        ...


class Scorer(Protocol):
    async def score(self, reward_fn: str, response: str, reference: str,
                    metadata_json: str = "") -> ScoreResult: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class EpisodeSpec:
    env_name: str
    env_config_json: str
    reward_fn: str
    seed: int
    max_turns: int
    max_tokens_per_turn: int
    max_episode_tokens: int
    run_id: str
    group_id: str
    group_size: int
    max_wall_s: float = 0.0
    """> 0: no new turn starts after this long; the episode ends with finish_reason "max_wall_time"."""
    sampling_seed: int | None = None
    """Set: turn k samples with seed derive_seed(sampling_seed, k), so the episode is reproducible."""
    max_prompt_tokens: int = 0
    """The longest prompt inference takes (inference.max_prompt_tokens; 0: not checked here). A
    first prompt past it is refused; a later turn's is where the episode's budget ends."""


def check_first_prompt(spec: EpisodeSpec, prompt_length: int) -> None:
    """Refuses an episode whose first prompt leaves no room to generate: every such episode would
    be a trajectory without one model token, dropped by the trainer, and the run would wait for
    steps that never come. The message names the limits to raise and by how much."""
    need = prompt_length + spec.max_tokens_per_turn
    what = (f"the first prompt is {prompt_length} tokens (the reset messages and tool schemas under the "
            f"chat template; env {spec.env_name!r})")
    if prompt_length >= spec.max_episode_tokens:
        raise EpisodeDoesNotFit(f"{what}, and rollout.max_episode_tokens is {spec.max_episode_tokens}: it counts "
                                f"the prompt, so no token is left to generate. Set rollout.max_episode_tokens to "
                                f"at least {need} (prompt + rollout.sampling.max_tokens {spec.max_tokens_per_turn}), "
                                f"with inference.max_prompt_tokens and model.max_seq_len to match")
    if spec.max_prompt_tokens and prompt_length > spec.max_prompt_tokens:
        raise EpisodeDoesNotFit(f"{what}, over inference.max_prompt_tokens {spec.max_prompt_tokens}: set it to at "
                                f"least {prompt_length} (rollout.max_episode_tokens - 1 covers every later turn too)")


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from `parts` (stable across processes and Python versions, unlike hash())."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def parse_tools(tools_json: str) -> list[dict[str, Any]] | None:
    """The environment's tool schemas for the chat template; None when it has none."""
    if not tools_json.strip():
        return None
    try:
        tools = loads_bounded(tools_json)  # a remote environment's: 100k deep is its error, not a RecursionError
    except json.JSONDecodeError as e:
        raise BackendError("env_gateway", "INVALID_ARGUMENT", f"tools_json is not JSON: {e}") from e
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BackendError("env_gateway", "INVALID_ARGUMENT", "tools_json must be a JSON list of function schemas")
    return tools or None


def parse_metadata(metadata_json: str) -> dict[str, Any]:
    """The environment's task metadata (a JSON object, "" for none), bounded like tools_json."""
    try:
        return parse_json_object(metadata_json, "metadata_json")
    except ValueError as e:
        raise BackendError("env_gateway", "INVALID_ARGUMENT", str(e)) from e


@dataclass(kw_only=True)
class _Builder:
    """Accumulates the token-aligned arrays of a trajectory."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_rewards: list[common_pb2.TurnReward] = field(default_factory=list)
    """The environment's reward per model turn, located at the end of the turn's model tokens."""
    tool_call_errors: int = 0
    routed: list[bytes] = field(default_factory=list)
    """Each model turn's Turn.routed_experts: together, the loss-mask-1 tokens' records in order."""
    kept: list[tuple[int, bytes]] = field(default_factory=list)
    """Each model turn's (tokens, Turn.kept_token_ids)."""

    def add_context(self, ids: Sequence[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_model(self, turn: Turn) -> None:
        self.tokens += turn.token_ids
        self.logprobs += turn.logprobs
        self.mask += [1] * len(turn.token_ids)
        self.versions += turn.policy_versions
        self.routed.append(turn.routed_experts)
        self.kept.append((len(turn.token_ids), turn.kept_token_ids))

    def kept_token_ids(self) -> bytes:
        """The model tokens' kept sets in order, or nothing unless every model turn has them at
        one width (a turn from a generator that recorded none: the trainer applies its own filter
        to the whole trajectory rather than refuse it)."""
        sizes = {len(k) // n for n, k in self.kept if n}
        if len(sizes) != 1 or 0 in sizes or any(len(k) != n * next(iter(sizes)) for n, k in self.kept):
            return b""
        return b"".join(k for _, k in self.kept)


async def run_episode(spec: EpisodeSpec, tok: Tokenizer, gen: Generator, env: EnvClient,
                      scorer: Scorer) -> common_pb2.Trajectory:
    """Runs one episode to a Trajectory; backend errors propagate (the worker decides retry or mask)."""
    started = time.monotonic()
    episode_id = uuid.uuid4().hex  # the trajectory id, and the engine session that keeps its KV prefix
    timings = common_pb2.Timings(started_at=time.time())
    reset = await env.reset(spec.env_name, spec.env_config_json, spec.seed)
    timings.reset_s = time.monotonic() - started
    finish, answer, reference, turns = "max_turns", "", "", 0
    b = _Builder()
    try:
        tools = parse_tools(reset.tools_json)
        b.add_context(tok.encode_messages(reset.observation, add_generation_prompt=True, add_bos=True, tools=tools))
        prompt_length = len(b.tokens)
        check_first_prompt(spec, prompt_length)
        for _ in range(spec.max_turns):
            budget = min(spec.max_tokens_per_turn, spec.max_episode_tokens - len(b.tokens))
            if budget <= 0 or (spec.max_prompt_tokens and len(b.tokens) > spec.max_prompt_tokens):
                # The episode's budget is spent: its tokens, or the longest prompt inference takes.
                finish = "max_tokens"
                break
            if spec.max_wall_s and time.monotonic() - started > spec.max_wall_s:
                finish = "max_wall_time"
                break
            turns += 1
            t0 = time.monotonic()
            seed = None if spec.sampling_seed is None else derive_seed(spec.sampling_seed, turns)
            turn = await gen.generate(b.tokens, max_tokens=budget, session_id=episode_id, seed=seed)
            timings.generate_s += time.monotonic() - t0
            timings.generate_queue_s += turn.queue_s
            timings.generate_engine_s += turn.engine_s
            b.add_model(turn)
            turn_end = len(b.tokens)
            if not turn.token_ids or turn.token_ids[-1] not in tok.stop_token_ids:
                # Cut by the budget, a stop string or an extra stop id: close the turn the way the
                # template would, but as context (the model did not say it), so the next observation
                # continues the conversation the template expects.
                b.add_context([tok.eos_id])
            t0 = time.monotonic()
            step = await env.step(reset.session_id, tok.decode(turn.token_ids))
            timings.env_s += time.monotonic() - t0
            b.turn_rewards.append(common_pb2.TurnReward(token_end=turn_end, reward=step.reward))
            b.tool_call_errors += sum(m.role == "tool" and m.content.startswith("error:") for m in step.observation)
            if step.done:
                finish, answer, reference = "done", step.answer, step.reference
                break
            b.add_context(tok.encode_messages(step.observation, add_generation_prompt=True, add_bos=False,
                                              tools=tools))
    finally:
        t0 = time.monotonic()
        await env.close(reset.session_id)
        timings.env_s += time.monotonic() - t0
    t0 = time.monotonic()
    score = await scorer.score(spec.reward_fn, answer, reference, reset.metadata_json) if finish == "done" else None
    timings.reward_s = time.monotonic() - t0
    timings.total_s = time.monotonic() - started
    return _trajectory(spec, episode_id, reset.task_id, b, prompt_length, finish, turns, score, timings)


def _trajectory(spec: EpisodeSpec, episode_id: str, task_id: str, b: _Builder, prompt_length: int, finish: str, turns: int,
                score: ScoreResult | None, timings: common_pb2.Timings) -> common_pb2.Trajectory:
    traj = common_pb2.Trajectory(
        id=episode_id, run_id=spec.run_id, task_id=task_id, group_id=spec.group_id,
        group_size=spec.group_size, token_ids=b.tokens, logprobs=b.logprobs, loss_mask=b.mask,
        policy_versions=b.versions, prompt_length=prompt_length, finish_reason=finish,
        num_turns=turns, timings=timings, created_at=time.time(), turn_rewards=b.turn_rewards,
        tool_call_errors=b.tool_call_errors, routed_experts=b"".join(b.routed), kept_token_ids=b.kept_token_ids(),
    )
    if score is None:
        # A limit ended the episode before an answer: trainable, with reward 0 for no answer.
        traj.status = common_pb2.TRAJECTORY_STATUS_TRUNCATED
    elif score.status != "ok":
        traj.status = common_pb2.TRAJECTORY_STATUS_ERROR
        traj.error = f"reward {score.status}: {score.error}"
    else:
        traj.status = common_pb2.TRAJECTORY_STATUS_OK
        traj.reward = score.reward
        traj.reward_components.update(score.components)
    return traj
