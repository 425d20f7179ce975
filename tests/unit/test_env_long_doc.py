"""`long_doc`: a long, many-turn episode (issue 36's 16k-token, 8-turn e2e run): one document part per
turn, a question after the last, a verifiable answer."""

from __future__ import annotations

import pytest

from services.env_gateway.envs.base import EpisodeOverError
from services.env_gateway.envs.long_doc import LongDocConfig, LongDocEnv, document
from services.env_gateway.registry import default_registry


def play(env: LongDocEnv, seed: int, config: dict, answer: str | None = None) -> tuple[list[str], object]:
    observations = [env.reset(seed, config).observation[0].content]
    while True:
        step = env.step("next" if answer is None or "Question" not in observations[-1] else answer)
        if step.done:
            return observations, step
        observations.append(step.observation[0].content)


def test_an_episode_is_parts_turns_of_part_chars_each_then_the_question_is_scored() -> None:
    env = LongDocEnv()
    observations, last = play(env, 7, {})
    assert len(observations) == 8  # 8 observations, so 8 model turns (the 8th answers)
    assert all(1900 <= len(o) <= 2200 for o in observations), [len(o) for o in observations]
    assert sum(map(len, observations)) >= 16_000
    assert "Question: what is the value of record" in observations[-1]
    assert not any("Question" in o for o in observations[:-1])
    assert last.reward == 0.0 and last.reference.isdigit()
    # The record's value is in the document, and answering it scores 1.
    _, right = play(LongDocEnv(), 7, {}, answer=f"It is {last.reference}.")
    assert right.reward == 1.0 and right.answer == last.reference
    with pytest.raises(EpisodeOverError):
        env.step("again")


def test_deterministic_in_seed_and_config_and_config_errors_name_the_key() -> None:
    assert document(3, LongDocConfig()) == document(3, LongDocConfig())
    assert document(3, LongDocConfig()) != document(4, LongDocConfig())
    observations, _ = play(LongDocEnv(), 1, {"parts": 2, "part_chars": 300})
    assert len(observations) == 2 and all(len(o) < 520 for o in observations)  # the intro, the question
    with pytest.raises(ValueError, match="long_doc config: parts must be in"):
        LongDocEnv().reset(0, {"parts": 0})
    with pytest.raises(ValueError, match="unknown key"):
        LongDocEnv().reset(0, {"turns": 8})


def test_registered_as_a_builtin() -> None:
    spec = default_registry().get("long_doc")
    assert spec is not None and spec.max_turns >= 8 and spec.config_type is LongDocConfig
