"""`long_doc`: a long, many-turn episode: a document read part by part, a question at the end.

Reset shows part 1 of a generated ledger of `parts` parts (each about `part_chars` characters:
with the byte tokenizer about as many tokens); each agent turn is answered with the next part,
the last one followed by the question "what is the value of record R?". The agent's turn after
it is the answer (its last integer), scored against the record's value, so an episode is
`parts` model turns over about `parts x part_chars` observation tokens: the long multi-turn
shape of agentic workloads (tool outputs of thousands of tokens, a sparse reward at the end).
It exists for long-context runs and their end-to-end test (tests/e2e/test_long_episode.py);
the reward is verifiable, not meant to be easy to learn. Deterministic in (seed, config).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.env_gateway.envs.answers import last_integer
from services.env_gateway.envs.base import (
    EpisodeOverError,
    Message,
    ResetResult,
    StepResult,
    check_range,
    describe_config,
    parse_config,
)

NAME = "long_doc"
MAX_PARTS = 64
MAX_PART_CHARS = 65_536
_WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
          "kestrel", "lagoon", "meadow", "nimbus", "obsidian", "prairie", "quartz", "river", "summit", "tundra")


@dataclass(frozen=True, kw_only=True, slots=True)
class LongDocConfig:
    parts: int = 8
    """Parts of the document, one per observation: the episode's model turns."""
    part_chars: int = 2000
    """Characters per part (each part is whole records, so slightly fewer)."""

    def validate(self) -> None:
        check_range("parts", self.parts, 1, MAX_PARTS)
        check_range("part_chars", self.part_chars, 64, MAX_PART_CHARS)


DESCRIPTION = ("Read a long generated ledger part by part (one part per turn), then answer which value a "
               f"record holds; reward 1 for the right integer. Config: {describe_config(LongDocConfig)}.")


def record(rng: random.Random, number: int) -> tuple[str, int]:
    value = rng.randint(0, 9999)
    words = " ".join(rng.choice(_WORDS) for _ in range(3))
    return f"Record {number}: {words}; value {value}.", value


def document(seed: int, cfg: LongDocConfig) -> tuple[list[str], dict[int, int]]:
    """The parts' texts and every record's value."""
    rng = random.Random(seed)
    parts, values, number = [], {}, 1
    for _ in range(cfg.parts):
        lines: list[str] = []
        size = 0
        while True:
            line, value = record(rng, number)
            if lines and size + len(line) + 1 > cfg.part_chars:
                break
            lines.append(line)
            values[number] = value
            size += len(line) + 1
            number += 1
        parts.append("\n".join(lines))
    return parts, values


class LongDocEnv:
    def __init__(self) -> None:
        self._parts: list[str] = []
        self._shown = 0
        self._asked = 0
        self._value = 0
        self._done = True

    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        cfg = parse_config(LongDocConfig, config, NAME)
        self._parts, values = document(seed, cfg)
        self._asked = random.Random(seed + 1).randint(1, len(values))
        self._value = values[self._asked]
        self._shown, self._done = 1, False
        intro = (f"Read this ledger; it comes in {cfg.parts} parts, one per turn (reply 'next' for the next "
                 f"one). After the last part I ask about one record: answer with its value.\n\n")
        return ResetResult(observation=[Message(role="user", content=intro + self._part(0))],
                           task_id=f"{NAME}-{cfg.parts}-{cfg.part_chars}-{seed}")

    def _part(self, i: int) -> str:
        return f"Part {i + 1} of {len(self._parts)}:\n{self._parts[i]}"

    def step(self, action: str) -> StepResult:
        if self._done:
            raise EpisodeOverError(f"{NAME}: the episode is over")
        if self._shown < len(self._parts):
            text = self._part(self._shown)
            self._shown += 1
            if self._shown == len(self._parts):
                text += f"\n\nQuestion: what is the value of record {self._asked}? Answer with the number."
            return StepResult(observation=[Message(role="user", content=text)], done=False)
        self._done = True
        answer = last_integer(action) or ""
        correct = answer == str(self._value)
        return StepResult(observation=[], done=True, reward=1.0 if correct else 0.0, answer=answer,
                          reference=str(self._value), info={"turns": self._shown, "correct": correct})
