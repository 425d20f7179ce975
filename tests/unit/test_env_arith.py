"""The built-in `arith` environment, its config checks, and the gateway core around it."""

from __future__ import annotations

import pytest

from services.env_gateway.envs.arith import ArithEnv, parse_answer
from services.env_gateway.envs.base import EpisodeOverError, Message
from services.env_gateway.gateway import Gateway, InvalidConfigError, UnknownEnvError
from services.env_gateway.registry import default_registry
from services.env_gateway.sessions import SessionLimitError, SessionNotFoundError, SessionStore


def operands(prompt: str, op: str = "+") -> tuple[int, int]:
    a, b = prompt.removesuffix("=").split(op)
    return int(a), int(b)


def started(seed: int = 0, **config: object) -> tuple[ArithEnv, int]:
    env = ArithEnv()
    result = env.reset(seed, config)
    a, b = operands(result.observation[0].content, str(config.get("op", "+")))
    return env, {"+": a + b, "-": a - b, "*": a * b}[str(config.get("op", "+"))]


def test_reset_is_short_and_deterministic_per_seed() -> None:
    first = ArithEnv().reset(7, {})
    again = ArithEnv().reset(7, {})
    assert first == again
    (message,) = first.observation
    assert message.role == "user"
    a, b = operands(message.content)
    assert message.content == f"{a}+{b}=" and 0 <= a <= 9 and 0 <= b <= 9
    assert first.task_id == f"arith-{a}+{b}"
    tasks = {ArithEnv().reset(seed, {}).task_id for seed in range(50)}
    assert len(tasks) > 10  # seeds pick different tasks


def test_max_operand_bounds_the_operands() -> None:
    for seed in range(30):
        a, b = operands(ArithEnv().reset(seed, {"max_operand": 2}).observation[0].content)
        assert 0 <= a <= 2 and 0 <= b <= 2
    assert ArithEnv().reset(3, {"max_operand": 0}).observation[0].content == "0+0="


def test_correct_answer_ends_with_reward_one() -> None:
    env, result = started(seed=1)
    step = env.step(f"  {result} because I said so")
    assert step.done and step.reward == 1.0
    assert step.answer == str(result) and step.reference == str(result)
    assert step.info == {"turns": 1, "correct": True}
    assert step.observation == []


def test_wrong_answers_continue_until_the_turn_limit() -> None:
    env, result = started(seed=2, max_turns=3)
    for turn in (1, 2):
        step = env.step(str(result + 1))
        assert not step.done and step.reward == 0.0
        assert step.observation == [Message(role="user", content="no")]
        assert step.info["turns"] == turn
    last = env.step(str(result + 5))
    assert last.done and last.reward == 0.0
    assert last.answer == str(result + 5) and last.reference == str(result)
    assert last.info == {"turns": 3, "correct": False}
    with pytest.raises(EpisodeOverError):
        env.step(str(result))


def test_right_on_a_later_turn() -> None:
    env, result = started(seed=3, max_turns=3)
    assert not env.step("1000").done
    step = env.step(str(result))
    assert step.done and step.reward == 1.0 and step.info["turns"] == 2


def test_unparseable_action_asks_for_a_number_and_counts_as_a_turn() -> None:
    env, _ = started(seed=4, max_turns=2)
    step = env.step("  hmm, seven?")
    assert not step.done
    assert step.observation == [Message(role="user", content="answer with a number")]
    last = env.step("no idea ")
    assert last.done and last.reward == 0.0 and last.answer == "no idea"


def test_other_ops_and_negative_answers() -> None:
    env, result = started(seed=5, op="-", max_operand=9)
    assert env.step(str(result)).reward == 1.0
    env, result = started(seed=6, op="*")
    assert env.step(str(result)).reward == 1.0


@pytest.mark.parametrize(("action", "parsed"), [
    ("7", "7"), (" 7\n", "7"), ("007", "7"), ("-3x", "-3"), ("-0", "0"), ("+3", None), ("x7", None),
    ("", None), ("-", None), ("9" * 10_000, "9" * 10_000),
])
def test_parse_answer(action: str, parsed: str | None) -> None:
    assert parse_answer(action) == parsed


@pytest.mark.parametrize(("config", "names"), [
    ({"bogus": 1}, "bogus"),
    ({"max_operand": "9"}, "max_operand"),
    ({"max_operand": True}, "max_operand"),
    ({"max_operand": 9.0}, "max_operand"),
    ({"max_operand": -1}, "max_operand"),
    ({"max_turns": 0}, "max_turns"),
    ({"max_turns": 17}, "max_turns"),
    ({"op": "/"}, "op"),
    ({"op": 1}, "op"),
])
def test_bad_config_names_the_key(config: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        ArithEnv().reset(0, config)


def gateway(max_sessions: int = 10, idle_timeout_s: float = 60.0) -> tuple[Gateway, list[float]]:
    now = [0.0]
    store = SessionStore(idle_timeout_s=idle_timeout_s, max_sessions=max_sessions, clock=lambda: now[0])
    return Gateway(default_registry(), store), now


def test_gateway_reset_step_close() -> None:
    gw, _ = gateway()
    started_ = gw.reset("arith", '{"max_operand": 3}', 11)
    assert started_.result.task_id.startswith("arith-")
    assert not gw.step(started_.session_id, "x").done
    assert gw.close(started_.session_id)
    assert not gw.close(started_.session_id)  # closing twice is fine
    with pytest.raises(SessionNotFoundError):
        gw.step(started_.session_id, "1")


@pytest.mark.parametrize("config_json", ["{", "[1]", '"x"', '{"nope": 1}'])
def test_gateway_rejects_bad_config_json(config_json: str) -> None:
    gw, _ = gateway()
    with pytest.raises(InvalidConfigError):
        gw.reset("arith", config_json, 0)
    assert len(gw.sessions) == 0


def test_gateway_unknown_env() -> None:
    gw, _ = gateway()
    with pytest.raises(UnknownEnvError, match="known: \\['arith', 'calculator'"):
        gw.reset("chess", "", 0)


def test_sessions_expire_when_idle_and_are_bounded() -> None:
    gw, now = gateway(max_sessions=2, idle_timeout_s=10.0)
    first = gw.reset("arith", "", 1).session_id
    now[0] = 5.0
    second = gw.reset("arith", "", 2).session_id
    with pytest.raises(SessionLimitError):
        gw.reset("arith", "", 3)
    now[0] = 9.0
    gw.step(first, "x")  # using a session keeps it alive
    now[0] = 16.0  # second idle for 11 s, first for 7 s
    with pytest.raises(SessionNotFoundError, match="expired"):
        gw.step(second, "1")
    gw.reset("arith", "", 4)  # room again
    now[0] = 100.0
    assert gw.sessions.expire() == 2
    assert len(gw.sessions) == 0
