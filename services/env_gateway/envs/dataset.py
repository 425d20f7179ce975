"""`dataset`: tasks read from a file (JSONL, Parquet, a `datasets.save_to_disk` directory).

Each row is a task: a prompt (or a list of chat messages), a reference answer, and metadata the
reward function may need (tests, a difficulty...). Single-turn by default (the model's reply is
the answer); with `tool: true` the agent also has the calculator tool and answers in plain text
when done. The reward service scores the answer against the reference with the run's reward
function; Reset hands the metadata to the rollout, which passes it on to the reward service.

Seed -> task: position `seed % n` of epoch `seed // n`, each epoch a permutation seeded by
(`shuffle_seed`, epoch); the rollout's durable cursor counts seeds 0, 1, 2, ... so every task
comes once per epoch. See docs/datasets.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from arlo.config import DATASET_MAX_TURNS, DatasetConfig
from services.env_gateway.envs.answers import last_integer, normalize_text
from services.env_gateway.envs.base import (
    EpisodeOverError,
    Message,
    ResetResult,
    StepResult,
    describe_config,
    parse_config,
)
from services.env_gateway.envs.calculator import TOOLS as CALCULATOR_TOOLS
from services.env_gateway.envs.dataset_source import DatasetStore, Rows
from services.env_gateway.envs.safe_eval import EvalError, evaluate, format_number
from services.env_gateway.tool_calls import BadToolCall, error_message, parse_tool_calls
from services.env_gateway.tool_schema import tools_json

NAME = "dataset"
MAX_TURNS = DATASET_MAX_TURNS
MAX_METADATA_BYTES = 64 << 10  # ScoreRequest.metadata_json's bound
ROLES = ("system", "user", "assistant", "tool")
TOOLS = CALCULATOR_TOOLS[:1]
NO_ANSWER = "Give your final answer, or call the calculator tool."


DESCRIPTION = ("Tasks from a dataset file (JSONL, Parquet or a datasets save_to_disk directory) with a field "
               "mapping; single-turn, or multi-turn with a calculator tool; scored by the run's reward "
               f"function. Config: {describe_config(DatasetConfig)}.")


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    id: str
    observation: list[Message]
    reference: str
    metadata: dict[str, Any]


def pick_task(store: DatasetStore, cfg: DatasetConfig, seed: int) -> Task:
    """The task for `seed`: row order[seed % n] of epoch seed // n in the configured split."""
    key, rows = store.rows(cfg.path, cfg.format, cfg.hf_split)
    _check_columns(cfg, rows)

    def task_id(i: int) -> str:
        return str(rows.row(i)[cfg.id_field]) if cfg.id_field else str(i)

    indices = store.split(key, rows, task_id, cfg.split, cfg.eval_fraction, cfg.split_seed)
    if not indices:
        raise ValueError(f"split {cfg.split!r} of {cfg.path!r} holds no tasks ({len(rows)} rows, "
                         f"eval_fraction {cfg.eval_fraction})")
    n = len(indices)
    epoch, position = divmod(seed, n)
    skey = (key, cfg.split, cfg.eval_fraction, cfg.split_seed)
    index = indices[store.order(skey, n, epoch, cfg.shuffle_seed)[position]]
    return _task(cfg, rows.row(index), task_id(index), index)


def _check_columns(cfg: DatasetConfig, rows: Rows) -> None:
    wanted = {"messages_field": cfg.messages_field} if cfg.messages_field else {"prompt_field": cfg.prompt_field}
    wanted |= {"answer_field": cfg.answer_field, "id_field": cfg.id_field}
    wanted |= {f"metadata_fields ({c})": c for c in cfg.metadata_columns}
    for key, column in wanted.items():
        if column and column not in rows.columns:
            raise ValueError(f"{key}: column {column!r} is not in {cfg.path!r}; its columns are {list(rows.columns)}")


def _task(cfg: DatasetConfig, row: dict[str, Any], task_id: str, index: int) -> Task:
    where = f"{cfg.path!r} row {index}"
    if cfg.messages_field:
        observation = _messages(row.get(cfg.messages_field), f"{where}: {cfg.messages_field}")
    else:
        prompt = row.get(cfg.prompt_field)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: {cfg.prompt_field} must be a non-empty string, got {prompt!r:.80}")
        observation = ([Message(role="system", content=cfg.system_prompt)] if cfg.system_prompt else []) + \
            [Message(role="user", content=prompt)]
    answer = row.get(cfg.answer_field)
    if answer is None:
        raise ValueError(f"{where}: {cfg.answer_field} is missing")
    reference = answer if isinstance(answer, str) else json.dumps(answer)
    metadata = {c: row.get(c) for c in cfg.metadata_columns}
    if len(json.dumps(metadata, default=str)) > MAX_METADATA_BYTES:
        raise ValueError(f"{where}: metadata {list(metadata)} is larger than {MAX_METADATA_BYTES} bytes as JSON")
    return Task(id=task_id, observation=observation, reference=reference, metadata=metadata)


def _messages(value: Any, where: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of {{role, content}}, got {value!r:.80}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}[{i}] must be {{role: one of {list(ROLES)}, content: str}}, got {m!r:.80}")
        out.append(Message(role=m["role"], content=m["content"], name=str(m.get("name") or "")))
    return out


class DatasetEnv:
    def __init__(self, store: DatasetStore, *, tool_format: str = "auto") -> None:
        self._store = store
        self._tool_format = tool_format
        self._cfg = DatasetConfig(path="-")
        self._reference = ""
        self._turns = 0
        self._done = True

    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        self._cfg = cfg = parse_config(DatasetConfig, config, NAME)
        task = pick_task(self._store, cfg, seed)
        self._reference = normalize_text(task.reference) if cfg.answer_format == "normalized" else task.reference
        self._turns, self._done = 0, False
        return ResetResult(observation=task.observation, task_id=f"{NAME}-{task.id}",
                           tools_json=tools_json(TOOLS) if cfg.tool else "[]", metadata=task.metadata)

    def step(self, action: str) -> StepResult:
        if self._done:
            raise EpisodeOverError("the episode is over; call Reset to start another")
        self._turns += 1
        if not self._cfg.tool:
            return self._finish(action)
        parsed = parse_tool_calls(action, TOOLS, format=self._tool_format)
        if not parsed.calls:
            if parsed.text.strip():
                return self._finish(parsed.text)
            replies = [Message(role="user", content=NO_ANSWER)]
        else:
            replies = [error_message(c) if isinstance(c, BadToolCall) else _calculate(c.arguments["expression"])
                       for c in parsed.calls]
        if self._turns >= self._cfg.max_turns:
            return self._finish("", out_of_turns=True)
        return StepResult(observation=replies, done=False, info={"turns": self._turns})

    def _finish(self, text: str, *, out_of_turns: bool = False) -> StepResult:
        self._done = True
        answer = _answer(text, self._cfg.answer_format)
        # The run's reward function scores it; this is only the environment's own exact-match view.
        correct = bool(answer) and answer == self._reference
        return StepResult(observation=[], done=True, reward=1.0 if correct else 0.0, answer=answer,
                          reference=self._reference,
                          info={"turns": self._turns, "correct": correct, "out_of_turns": out_of_turns})


def _answer(text: str, answer_format: str) -> str:
    if answer_format == "last_integer":
        return last_integer(text) or ""
    if answer_format == "normalized":
        return normalize_text(text)
    return text.strip()


def _calculate(expression: str) -> Message:
    try:
        content = format_number(evaluate(expression))
    except EvalError as e:
        content = f"error: {e}"
    return Message(role="tool", name="calculator", content=content)
