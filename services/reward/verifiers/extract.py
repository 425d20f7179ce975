"""Finding the final answer in a model's response.

The rule, in order: the last `\\boxed{...}`; else the last `<answer>...</answer>`; else the
text after the last "answer is" / "answer:"; else the whole response when it parses as an
answer (a bare `x^2+1`); else the last number in the response. The first
rule that finds something decides (a boxed answer that does not parse is wrong, we do not go
looking for another number); inside a tag or an "answer:" phrase the last number is tried
when the whole text does not parse ("<answer>It is 12.</answer>").
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_OPEN, _CLOSE = "<answer>", "</answer>"
_PHRASE = re.compile(r"answer\s*(?:is\s*:?|:)[ \t]*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?")
_TRAILING = " \t\n.;,$"
MAX_WHOLE_CHARS = 1000


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def answer_blocks(text: str) -> tuple[list[str], int]:
    """The contents of the <answer>...</answer> blocks, and how many <answer> tags are left unclosed.

    A scan, not the regex `<answer>(.*?)</answer>`: that one is quadratic in the number of
    unclosed tags, and a degenerate generation repeating "<answer>" is exactly that input.
    """
    blocks, pos = [], 0
    while (start := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            return blocks, text.count(_OPEN, start)
        blocks.append(text[start + len(_OPEN):end])
        pos = end + len(_CLOSE)
    return blocks, 0


def last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def answer_candidates(response: str) -> list[str]:
    """What the response answers, most specific first; [] when it answers nothing."""
    boxed = last_boxed(response)
    if boxed is not None:
        return [boxed]
    tags, _ = answer_blocks(response)
    phrases = _PHRASE.findall(response)
    text = tags[-1] if tags else (phrases[-1] if phrases else None)
    if text is not None:
        text = text.strip().rstrip(_TRAILING).strip()
        number = last_number(text)
        return [text] + ([number] if number is not None and number != text else [])
    number = last_number(response)
    # A bare answer ("x^2+1", "\\frac{1}{2}") is its own answer; prose falls back to its last number.
    whole = [response.strip()] if len(response) <= MAX_WHOLE_CHARS else []
    return whole + ([number] if number is not None else [])
