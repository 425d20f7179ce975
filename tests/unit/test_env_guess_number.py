"""`guess_number`: higher/lower hints, a delayed reward, and a policy that needs several turns."""

from __future__ import annotations

import re

import pytest

from services.env_gateway.envs.base import EpisodeOverError, Message
from services.env_gateway.envs.guess_number import HIGHER, LOWER, GuessNumberEnv


def binary_search(env: GuessNumberEnv, low: int, high: int) -> tuple[list[float], int]:
    """Plays the optimal policy; returns every step's reward and the turns used."""
    rewards = []
    while True:
        guess = (low + high) // 2
        step = env.step(f"I guess {guess}")
        rewards.append(step.reward)
        if step.done:
            assert step.answer == str(guess) and step.reward == 1.0, step
            return rewards, step.info["turns"]
        hint = step.observation[0].content
        low, high = (guess + 1, high) if hint == HIGHER else (low, guess - 1)


def test_binary_search_always_wins_with_delayed_reward() -> None:
    turns_used = []
    for seed in range(200):
        env = GuessNumberEnv()
        env.reset(seed, {})
        rewards, turns = binary_search(env, 1, 100)
        assert rewards[:-1] == [0.0] * (len(rewards) - 1)  # nothing before the end
        turns_used.append(turns)
    assert max(turns_used) <= 7 and sum(turns_used) / len(turns_used) > 4  # several turns needed


def test_hints_point_at_the_secret_and_running_out_scores_zero() -> None:
    env = GuessNumberEnv()
    env.reset(3, {"low": 1, "high": 1000, "max_turns": 2})
    first = env.step("500")
    assert first.observation[0] == Message(role="user", content=first.observation[0].content)
    assert first.observation[0].content in (HIGHER, LOWER)
    last = env.step("500")
    assert last.done and last.reward == 0.0 and last.answer == "500" and last.reference.isdigit()
    assert last.info == {"turns": 2, "correct": False}
    with pytest.raises(EpisodeOverError):
        env.step("1")


def test_tool_call_guesses_get_tool_replies() -> None:
    env = GuessNumberEnv()
    env.reset(4, {})
    step = env.step('<tool_call>{"name": "guess", "arguments": {"number": 101}}</tool_call>')
    assert step.observation == [Message(role="tool", name="guess",
                                        content="101 is out of range: the number is between 1 and 100.")]
    bad = env.step('<tool_call>{"name": "guess", "arguments": {"n": 5}}</tool_call>')
    assert bad.observation[0].role == "tool" and "missing required argument(s) ['number']" in bad.observation[0].content
    words = env.step("no idea")
    assert words.observation[0].content == "Reply with one integer between 1 and 100."
    assert words.info["turns"] == 3 and not words.done


def test_huge_numbers_do_not_break_parsing() -> None:
    env = GuessNumberEnv()
    env.reset(5, {})
    assert "Reply with one integer" in env.step("9" * 60_000).observation[0].content


def test_same_seed_same_secret() -> None:
    tasks = {GuessNumberEnv().reset(9, {"high": 50}).task_id for _ in range(3)}
    assert len(tasks) == 1 and re.fullmatch(r"guess_number-1-50-\d+", tasks.pop())


@pytest.mark.parametrize(("config", "fragment"), [
    ({"low": 5, "high": 5}, "high must be in [6, "), ({"max_turns": 0}, "max_turns"),
    ({"high": 10**10}, "high"), ({"low": 1.5}, "low must be int"),
])
def test_bad_config_names_the_key(config: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        GuessNumberEnv().reset(0, config)


def test_held_out_split_never_draws_a_training_number() -> None:
    from services.env_gateway.envs.guess_number import GuessNumberEnv

    env = GuessNumberEnv()
    secrets = {split: {int(env.reset(s, {"split": split}).task_id.rsplit("-", 1)[1]) for s in range(400)}
               for split in ("train", "eval")}
    assert secrets["eval"] == set(range(8, 101, 8))  # all 12 held-out numbers come up, nothing else
    assert secrets["train"].isdisjoint(secrets["eval"]) and len(secrets["train"]) > 60
    with pytest.raises(ValueError, match=r"split needs high - low \+ 1 >= 8"):
        env.reset(0, {"low": 1, "high": 5, "split": "eval"})
