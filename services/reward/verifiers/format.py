"""Format verifiers: does the response have the required shape? One component per check.

`format_think` checks the reasoning layout `<think>...</think>` then exactly one final answer;
`format_regex` checks task-supplied patterns. Both score the mean of their checks, so a
composite can weight format against correctness (see composite.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from services.reward.verifiers.base import Verdict
from services.reward.verifiers.extract import answer_blocks

MAX_PATTERNS = 32
MAX_PATTERN_CHARS = 1024
ANSWER_STYLES = ("any", "tag", "boxed")

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_BOXED = re.compile(r"\\boxed\s*\{")
_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


def think_block_ok(response: str) -> bool:
    """Exactly one <think>...</think>, first in the response, with something inside."""
    if response.count(_THINK_OPEN) != 1 or response.count(_THINK_CLOSE) != 1:
        return False
    body = response.lstrip()
    if not body.startswith(_THINK_OPEN):
        return False
    inner, _, _ = body[len(_THINK_OPEN):].partition(_THINK_CLOSE)
    return bool(inner.strip())


def final_answers(text: str, style: str) -> int:
    """How many final answers `text` gives: <answer> blocks and/or \\boxed{} per `style`.

    In "any" style a \\boxed{} inside an <answer> block is part of that one answer.
    """
    blocks, unclosed = answer_blocks(text)
    if style == "tag":
        return len(blocks) + unclosed
    boxed = len(_BOXED.findall(text))
    if style == "boxed":
        return boxed
    inside_tags = sum(len(_BOXED.findall(block)) for block in blocks)
    return len(blocks) + unclosed + boxed - inside_tags


def _answer_style(metadata: Mapping[str, Any]) -> str:
    style = metadata.get("answer_style", "any")
    if style not in ANSWER_STYLES:
        raise ValueError(f"metadata answer_style must be one of {ANSWER_STYLES}, got {style!r}")
    return str(style)


def format_think(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
    """Components: `think` (one non-empty think block opening the response) and `answer` (exactly
    one final answer after it, or in the whole response when the think block is missing or
    malformed; metadata `answer_style`: "any" (default), "tag" (<answer>) or "boxed")."""
    style = _answer_style(metadata)
    think = think_block_ok(response)
    # Drafts inside the think block do not count: the answer section is what follows it.
    after = response.partition(_THINK_CLOSE)[2] if think else response
    answer = final_answers(after, style) == 1
    components = {"think": float(think), "answer": float(answer)}
    return Verdict(reward=sum(components.values()) / len(components), components=components)


def _compile(name: str, spec: Any) -> tuple[re.Pattern[str], int, int | None]:
    """(pattern, min matches, max matches) from a string or {"regex", "flags", "min", "max"}."""
    if isinstance(spec, str):
        spec = {"regex": spec}
    if not isinstance(spec, Mapping) or not isinstance(spec.get("regex"), str):
        raise ValueError(f"pattern {name!r} must be a regex string or an object with a 'regex' string")
    unknown = set(spec) - {"regex", "flags", "min", "max"}
    if unknown:
        raise ValueError(f"pattern {name!r} has unknown keys {sorted(unknown)}")
    regex, flags = spec["regex"], spec.get("flags", "")
    if len(regex) > MAX_PATTERN_CHARS:
        raise ValueError(f"pattern {name!r} is longer than {MAX_PATTERN_CHARS} characters")
    if not isinstance(flags, str) or set(flags) - set(_FLAGS):
        raise ValueError(f"pattern {name!r} flags must be letters from {''.join(_FLAGS)}, got {flags!r}")
    lo, hi = spec.get("min", 1), spec.get("max")
    if isinstance(lo, bool) or not isinstance(lo, int) or (hi is not None and (
            isinstance(hi, bool) or not isinstance(hi, int) or hi < lo)) or lo < 0:
        raise ValueError(f"pattern {name!r} needs 0 <= min <= max (integers), got min={lo!r} max={hi!r}")
    try:
        pattern = re.compile(regex, sum((_FLAGS[f] for f in flags), re.NOFLAG))
    except re.error as e:
        raise ValueError(f"pattern {name!r} is not a valid regex: {e}") from None
    return pattern, lo, hi


def format_regex(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
    """Metadata `patterns`: {name: regex or {"regex", "flags", "min", "max"}}. A plain regex must
    match somewhere; with min/max the number of non-overlapping matches must lie in [min, max].
    `fullmatch: true` makes plain regexes match the whole (stripped) response. Component per name."""
    patterns = metadata.get("patterns")
    if not isinstance(patterns, Mapping) or not 1 <= len(patterns) <= MAX_PATTERNS:
        raise ValueError(f"metadata patterns must be an object of 1 to {MAX_PATTERNS} named regexes")
    fullmatch = metadata.get("fullmatch", False)
    if not isinstance(fullmatch, bool):
        raise ValueError(f"metadata fullmatch must be true or false, got {fullmatch!r}")
    components = {}
    for name, spec in patterns.items():
        pattern, lo, hi = _compile(name, spec)
        if isinstance(spec, str) and fullmatch:
            ok = pattern.fullmatch(response.strip()) is not None
        elif isinstance(spec, str):
            ok = pattern.search(response) is not None
        else:
            count = sum(1 for _ in pattern.finditer(response))
            ok = count >= lo and (hi is None or count <= hi)
        components[str(name)] = float(ok)
    return Verdict(reward=sum(components.values()) / len(components), components=components)
