"""Token shapes of bench/grpo_tiny.py's arith workloads, as arlo's rollout renders them.

The task is "a*b=" with operands up to 30 and no tool; with `max_turns` > 1 a wrong answer is
answered "no" (a reply that is not a number: "answer with a number") and the agent answers
again. The rollout (services/rollout/agent.py) renders the reset observation with the chat
template (BOS, generation prompt), appends each model turn verbatim, closes a turn cut by the
token budget with the end-of-turn token (context, not trained), then the template's
continuation for the env's reply. So turn k's prompt is at most

    first prompt + (k - 1) x (tokens per turn + 1 + longest reply)

and an episode at most the last turn's prompt + tokens per turn: the inference service's
`max_prompt_tokens` and the rollout's `max_episode_tokens` must cover these, or requests are
refused (prompt too long) or turns cut short (episode budget). No JAX here: the service side
of the bench imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from arlo.model.tokenizer import Tokenizer
from services.env_gateway.envs.arith import NOT_A_NUMBER, WRONG

OP = "*"
MAX_OPERAND = 30


def env_config(turns: int) -> dict[str, Any]:
    """The arith env's config for a workload of `turns` model turns per episode."""
    return {"op": OP, "max_operand": MAX_OPERAND, "tool": False, "max_turns": turns}


def env_config_json(turns: int) -> str:
    return json.dumps(env_config(turns))


def first_prompt_tokens(tok: Tokenizer, config: Mapping[str, Any]) -> int:
    """The longest rendered reset observation: both operands at their most digits."""
    widest = str(config["max_operand"])
    question = f"{widest}{config['op']}{widest}="
    return len(tok.encode_messages([("user", question)], add_generation_prompt=True, add_bos=True))


def reply_tokens(tok: Tokenizer) -> int:
    """The longest rendered env reply after a wrong turn (a random policy's is "answer with a number")."""
    return max(len(tok.encode_messages([("user", text)], add_generation_prompt=True, add_bos=False))
               for text in (WRONG, NOT_A_NUMBER))


def turn_prompt_tokens(tok: Tokenizer, config: Mapping[str, Any], tokens: int, turn: int) -> int:
    """The longest prompt of model turn `turn` (1-based) at `tokens` new tokens per turn."""
    # + 1: the end-of-turn token the rollout closes a budget-cut turn with.
    return first_prompt_tokens(tok, config) + (turn - 1) * (tokens + 1 + reply_tokens(tok))


def episode_tokens(tok: Tokenizer, config: Mapping[str, Any], tokens: int) -> int:
    """The longest episode up to its last model token: the trained length the budget must allow."""
    return turn_prompt_tokens(tok, config, tokens, config["max_turns"]) + tokens
