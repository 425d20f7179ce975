"""format_think and format_regex: one component per check, reward = mean of checks."""

from __future__ import annotations

import pytest

from services.reward.verifiers.base import Verdict
from services.reward.verifiers.format import final_answers, format_regex, format_think, think_block_ok


def checks(think: float, answer: float) -> Verdict:
    return Verdict(reward=(think + answer) / 2, components={"think": think, "answer": answer})


@pytest.mark.parametrize(("response", "style", "think", "answer"), [
    ("<think>2+2=4</think><answer>4</answer>", "any", 1, 1),
    ("  <think>2+2=4</think>\nSo \\boxed{4}.", "any", 1, 1),
    ("<think>draft \\boxed{3}</think><answer>\\boxed{4}</answer>", "any", 1, 1),  # drafts in think don't count
    ("<think>a</think><answer>4</answer>", "boxed", 1, 0),
    ("<think>a</think>\\boxed{4}", "tag", 1, 0),
    ("<think>a</think><answer>4</answer><answer>5</answer>", "any", 1, 0),
    ("<think>a</think><answer>4</answer> and \\boxed{5}", "any", 1, 0),
    ("<think>a</think><answer>4", "any", 1, 1),  # an unclosed tag still counts as the one answer
    ("<think>a</think>no answer", "any", 1, 0),
    ("<think> </think><answer>4</answer>", "any", 0, 1),
    ("<answer>4</answer>", "any", 0, 1),
    ("preamble <think>a</think><answer>4</answer>", "any", 0, 1),
    ("<think>a</think><think>b</think><answer>4</answer>", "any", 0, 1),
    ("<think>a<answer>4</answer>", "any", 0, 1),
    ("", "any", 0, 0),
])
def test_format_think(response: str, style: str, think: float, answer: float) -> None:
    assert format_think(response, "ignored", {"answer_style": style}) == checks(think, answer)


def test_format_think_defaults_and_bad_metadata() -> None:
    assert format_think("<think>a</think>\\boxed{1}", "", {}) == checks(1, 1)
    with pytest.raises(ValueError, match="answer_style"):
        format_think("", "", {"answer_style": "xml"})


def test_helpers() -> None:
    assert think_block_ok("<think>x</think>") and not think_block_ok("</think><think>x")
    assert final_answers("<answer>\\boxed{1}</answer>", "any") == 1
    assert final_answers("<answer>\\boxed{1}</answer>", "boxed") == 1
    assert final_answers("\\boxed{1} \\boxed{2}", "any") == 2


def test_format_regex_named_checks() -> None:
    metadata = {"patterns": {
        "has_answer": r"Answer: \d+",
        "one_number": {"regex": r"\d+", "min": 1, "max": 1},
        "shouting": {"regex": "ANSWER", "flags": "i", "min": 1},
        "no_apology": {"regex": "sorry", "flags": "i", "max": 0, "min": 0},
    }}
    verdict = format_regex("Answer: 42", "", metadata)
    assert verdict == Verdict(reward=1.0, components={"has_answer": 1.0, "one_number": 1.0, "shouting": 1.0,
                                                      "no_apology": 1.0})
    verdict = format_regex("Sorry. Answer: 4 or 2", "", metadata)
    assert verdict.components == {"has_answer": 1.0, "one_number": 0.0, "shouting": 1.0, "no_apology": 0.0}
    assert verdict.reward == 0.5


def test_format_regex_fullmatch() -> None:
    metadata = {"patterns": {"just_a_number": r"-?\d+"}, "fullmatch": True}
    assert format_regex(" 42\n", "", metadata).reward == 1.0
    assert format_regex("it is 42", "", metadata).reward == 0.0
    assert format_regex("it is 42", "", {**metadata, "fullmatch": False}).reward == 1.0


@pytest.mark.parametrize(("metadata", "why"), [
    ({}, "patterns"), ({"patterns": {}}, "patterns"), ({"patterns": ["a"]}, "patterns"),
    ({"patterns": {f"p{i}": "a" for i in range(33)}}, "patterns"),
    ({"patterns": {"p": "("}}, "not a valid regex"), ({"patterns": {"p": "a" * 1025}}, "longer"),
    ({"patterns": {"p": {"regex": "a", "flags": "q"}}}, "flags"),
    ({"patterns": {"p": {"regex": "a", "min": 2, "max": 1}}}, "min <= max"),
    ({"patterns": {"p": {"regex": "a", "min": -1}}}, "min <= max"),
    ({"patterns": {"p": {"regex": "a", "count": 1}}}, "unknown keys"),
    ({"patterns": {"p": {"re": "a"}}}, "'regex' string"), ({"patterns": {"p": 3}}, "'regex' string"),
    ({"patterns": {"p": "a"}, "fullmatch": "yes"}, "fullmatch"),
])
def test_format_regex_bad_metadata_raises(metadata: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        format_regex("a", "", metadata)
