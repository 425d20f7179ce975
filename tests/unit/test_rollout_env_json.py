"""A remote environment's Reset whose tools_json or metadata_json nests 100,000 deep is that
episode's INVALID_ARGUMENT from the env gateway, not a RecursionError in the rollout (issue 33
item 15), in the token-in-token-out loop (run_episode) and the black-box one (blackbox)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.rollout.agent import EpisodeSpec, Turn, parse_metadata, parse_tools, run_episode
from services.rollout.types import BackendError, ResetResult
from tests.support.inprocess import TOK, CoreScorer, GatewayEnv

DEEP = "[" * 100_000 + "]" * 100_000
pytestmark = pytest.mark.timeout(60)


class DeepTools(GatewayEnv):
    async def reset(self, env_name: str, config_json: str, seed: int) -> ResetResult:
        return dataclasses.replace(await super().reset(env_name, config_json, seed), tools_json=DEEP)


class NeverAsked:
    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        raise AssertionError("the episode must end before generating")


def test_deep_tools_json_from_the_environment_is_invalid_argument_not_recursion() -> None:
    env = DeepTools()
    spec = EpisodeSpec(env_name="arith", env_config_json="", reward_fn="exact_match", seed=7, max_turns=1,
                       max_tokens_per_turn=4, max_episode_tokens=128, run_id="r", group_id="g", group_size=1)
    with pytest.raises(BackendError) as refused:
        asyncio.run(run_episode(spec, TOK, NeverAsked(), env, CoreScorer()))
    assert refused.value.service == "env_gateway" and refused.value.code == "INVALID_ARGUMENT"
    assert "nesting deeper than" in refused.value.message
    assert env.closed  # its session is closed all the same


@pytest.mark.parametrize(("parse", "text"), [
    (parse_tools, DEEP), (parse_metadata, '{"a": ' + DEEP + "}"), (parse_metadata, "[1]"), (parse_metadata, "{x"),
])
def test_the_black_box_loops_parsers_refuse_bad_environment_json_as_invalid_argument(parse, text: str) -> None:
    with pytest.raises(BackendError) as refused:
        parse(text)
    assert refused.value.code == "INVALID_ARGUMENT"


def test_good_environment_json_still_parses() -> None:
    assert parse_tools("") is None and parse_tools("[]") is None
    assert parse_tools('[{"type": "function"}]') == [{"type": "function"}]
    assert parse_metadata("") == {} and parse_metadata('{"a": [1]}') == {"a": [1]}
