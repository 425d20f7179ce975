"""The rollout's tokens are the model's own chat format, token for token (issue 14, item 5).

A real episode of the `calculator` environment (through the gateway core) runs in the real
agent loop with a Hugging Face tokenizer carrying the Qwen2.5 or Llama 3.1 chat template as
shipped. The "model" is scripted: each turn it emits the tokens of a text written in the
family's tool-call format (Hermes `<tool_call>` for Qwen, Llama 3.1's bare JSON), then its
end-of-turn token, as a sampler would. The trajectory (first prompt rendered with the
environment's tools, the model's tokens, each observation's continuation) must equal
transformers' `apply_chat_template(whole conversation, tools=tools)`, with the assistant
turns given either as their text or as structured `tool_calls` (which the template renders to
that same text), and the loss mask must cover exactly the model's tokens.

What the templates themselves do, and the test pins: Llama 3.1 renders a tool result's
string content JSON-quoted (`"84"`; `is iterable` holds for strings), and transformers does
the same, so the prefix property holds with the quotes; Llama 3.1 takes one tool call per
assistant turn, so its episode calls one tool a turn where Qwen's second turn calls two.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from arlo.model.hf_tokenizer import HFTokenizer
from services.env_gateway.envs.calculator import CalculatorConfig, make_task
from services.rollout.agent import EpisodeSpec, Turn, run_episode
from services.rollout.types import Message, ResetResult, StepResult
from tests.support.hf_checkpoints import write_tokenizer
from tests.support.inprocess import CoreScorer, GatewayEnv

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

SYSTEM = "You are a careful assistant. Call tools for arithmetic."
CONFIG = {"num_terms": 3, "min_digits": 2, "max_digits": 2, "max_turns": 6}
SEED = 11


def _terms() -> tuple[list[str], int]:
    text, total = make_task(SEED, CalculatorConfig(**CONFIG))
    # "a * b + c * d - e * f" -> the three products, as the model would send them to the tool.
    parts = text.replace("- ", "+ -").split(" + ")
    return [p.removeprefix("-").strip() for p in parts], total


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _turns(family: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """(text the model emits, the same turn as structured tool_calls) for each turn."""
    products, total = _terms()
    calls = [[_call("calculator", {"expression": p})] for p in products]
    if family == "qwen2":
        # Hermes: each call on its own lines in <tool_call> tags, as the template writes them; two
        # calls in the second turn (their results share one user turn in Qwen2.5's rendering).
        calls = [calls[0], calls[1] + calls[2]]

        def text(turn: list[dict[str, Any]]) -> str:
            return "\n".join(f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": '
                             f'{json.dumps(c["function"]["arguments"])}}}\n</tool_call>' for c in turn)
    else:
        def text(turn: list[dict[str, Any]]) -> str:
            (c,) = turn
            return f'{{"name": "{c["function"]["name"]}", "parameters": {json.dumps(c["function"]["arguments"])}}}'
    return [*((text(t), t) for t in calls), (f"The answer is {total}.", [])]


class ScriptedModel:
    """A Generator that emits fixed texts, tokenized, each closed by the end-of-turn token."""

    def __init__(self, tok: HFTokenizer, texts: list[str]) -> None:
        self.tok, self.texts, self.emitted = tok, list(texts), []

    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        ids = self.tok.encode(self.texts.pop(0)) + [self.tok.eos_id]
        self.emitted.append(ids)
        return Turn(token_ids=ids, logprobs=[0.0] * len(ids), policy_versions=[0] * len(ids), finished_by_stop=True)


class WithSystem(GatewayEnv):
    """The real calculator environment, with a system message first (as a deployment may add)
    and every observation recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.observations: list[tuple[Message, ...]] = []
        self.tools_json = ""

    async def reset(self, env_name: str, config_json: str, seed: int) -> ResetResult:
        r = await super().reset(env_name, config_json, seed)
        r = replace(r, observation=(Message(role="system", content=SYSTEM), *r.observation))
        self.observations.append(r.observation)
        self.tools_json = r.tools_json
        return r

    async def step(self, session_id: str, action: str) -> StepResult:
        r = await super().step(session_id, action)
        self.observations.append(r.observation)
        return r


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp(request.param)
    write_tokenizer(path, request.param)
    return request.param, path


def _episode(family: str, path: Path):
    tok = HFTokenizer.from_dir(path)
    turns = _turns(family)
    model, env = ScriptedModel(tok, [t for t, _ in turns]), WithSystem()
    spec = EpisodeSpec(env_name="calculator", env_config_json=json.dumps(CONFIG), reward_fn="exact_match",
                       seed=SEED, max_turns=6, max_tokens_per_turn=256, max_episode_tokens=8192, run_id="r",
                       group_id="g", group_size=1)
    traj = asyncio.run(run_episode(spec, tok, model, env, CoreScorer()))
    return tok, turns, model, env, traj


def _conversation(env: WithSystem, turns: list[tuple[str, list[dict[str, Any]]]], *,
                  structured: bool) -> list[dict[str, Any]]:
    """The whole episode as chat messages: observations as the env sent them (tool results with
    their name), assistant turns as text or as structured tool calls."""
    chat: list[dict[str, Any]] = []
    assert env.observations[-1] == ()  # the final answer ended the episode
    for observation, (text, calls) in zip(env.observations[:-1], turns, strict=True):
        chat += [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})} for m in observation]
        if structured and calls:
            chat.append({"role": "assistant", "content": "", "tool_calls": calls})
        else:
            chat.append({"role": "assistant", "content": text})
    return chat


@pytest.mark.parametrize("structured", [False, True], ids=["text", "tool_calls"])
def test_trajectory_equals_transformers_rendering(family_dir: tuple[str, Path], structured: bool) -> None:
    family, path = family_dir
    tok, turns, model, env, traj = _episode(family, path)
    assert traj.finish_reason == "done" and traj.reward == 1.0  # both formats parsed by the env, answer right
    tools = json.loads(env.tools_json)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    expected = list(ref.apply_chat_template(_conversation(env, turns, structured=structured), tools=tools,
                                            tokenize=True, return_dict=False))
    got = list(traj.token_ids)
    assert got == expected[:len(got)], _first_difference(ref, got, expected)
    # After the final end-of-turn token the full rendering has only the template's separator.
    assert ref.decode(expected[len(got):]).strip() == ""
    # The loss mask is exactly the model's tokens, in order.
    assert [t for t, m in zip(got, traj.loss_mask, strict=True) if m] == [i for ids in model.emitted for i in ids]
    # The first prompt is the template's own, tools listed.
    prompt = ref.apply_chat_template(_conversation(env, turns, structured=structured)[:2], tools=tools,
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    assert got[:traj.prompt_length] == list(prompt)
    assert '"name": "calculator"' in ref.decode(got[:traj.prompt_length])


def test_tool_results_are_role_tool_with_name(family_dir: tuple[str, Path]) -> None:
    family, path = family_dir
    _, _, _, env, traj = _episode(family, path)
    products, _ = _terms()
    results = [m for obs in env.observations[1:] for m in obs]
    assert env.observations[0][1].role == "user" and traj.num_turns == len(_turns(family))
    assert [(m.role, m.name) for m in results] == [("tool", "calculator")] * len(products)
    assert [m.content for m in results] == [str(int(a) * int(b)) for a, _, b in map(str.split, products)]
    text = HFTokenizer.from_dir(path).decode(list(traj.token_ids))
    if family == "qwen2":
        assert f"<tool_response>\n{results[0].content}\n</tool_response>" in text
    else:  # Llama 3.1 quotes a string tool result (its template tojson's any iterable content)
        assert f'ipython\n\n"{results[0].content}"' in text


def _first_difference(ref: Any, got: list[int], expected: list[int]) -> str:
    i = next((k for k, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected)))
    return (f"first difference at token {i}:\n ours: {ref.decode(got[max(0, i - 8):i + 8])!r}\n"
            f"  ref: {ref.decode(expected[max(0, i - 8):i + 8])!r}")
