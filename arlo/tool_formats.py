"""The text grammars of the tool-call formats whose calls are not one JSON object each: Qwen3-Coder's
XML-style calls, Mistral's `[TOOL_CALLS]`, Gemma's `call:name{...}`. Pure.

Each reader takes a model turn and returns `Found`: the turn's text without the call markup, and
for each call written, `(name, arguments)` or `(name, error)`: a call that cannot be read becomes
an error string that says what was wrong and how a correct call looks, never an exception.
Checking a call against its tool's schema is `tool_calls.py`'s, the same for every format.

The layouts, as each family's chat template renders an assistant's `tool_calls`:
- Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`;
  a value is written as text (JSON for objects and arrays, Python's str() for the rest), so its
  type is read from the tool's schema.
- Mistral: v0.3/Nemo `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]`, and the
  later tokenizers' `[TOOL_CALLS]NAME[ARGS]{...}` (optionally `[CALL_ID]ID` before `[ARGS]`), one
  marker per call.
- Gemma: `call:NAME{key:value,...}` between Gemma 4's `<|tool_call>`/`<tool_call|>` (strings
  inside `<|"|>`) or FunctionGemma's `<start_function_call>`/`<end_function_call>` (strings inside
  `<escape>`); keys are bare, other values JSON-like (numbers, true/false/null, {...}, [...]).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from arlo.jsonfields import MAX_DEPTH, loads_bounded

MARKUP_TOKENS = frozenset({"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|tool_call>", "<tool_call|>", '<|"|>',
                           "<start_function_call>", "<end_function_call>", "<escape>", "<tool_call>", "</tool_call>"})
"""The formats' markers: a tokenizer that makes one of them a special token still decodes it."""
Raw = tuple[str, "dict[str, Any] | str"]
"""One call as written: (tool name or "", its arguments, or an error string)."""


@dataclass(frozen=True, slots=True)
class Found:
    text: str
    calls: list[Raw]
    total: int
    """Calls written, including those past the cap that were not read."""


# ----- Qwen3-Coder -----

QWEN3_CODER_EXAMPLE = "<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>"
_QC_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)|(<function=.*?)(?:</function>|$)", re.DOTALL)
_QC_START = re.compile(r"<tool_call>\s*<function=")
_QC_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)
_QC_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)(</parameter>|(?=<parameter=)|$)", re.DOTALL)


def is_qwen3_coder(text: str) -> bool:
    """Whether the turn is in this format rather than Hermes' (whose `<tool_call>` holds JSON)."""
    return _QC_START.search(text) is not None or ("<tool_call>" not in text and "<function=" in text)


def has_qwen3_coder_call(text: str) -> bool:
    """Whether the turn holds a call to read as Qwen3-Coder's when that format is chosen."""
    return "<tool_call>" in text or "<function=" in text


def read_qwen3_coder(text: str, by_name: Mapping[str, Any], max_calls: int) -> Found:
    blocks = list(_QC_BLOCK.finditer(text))
    rest = _QC_BLOCK.sub(" ", text).replace("</tool_call>", " ")
    calls = [_qwen3_coder_call(m.group(1) if m.group(1) is not None else m.group(2), i, by_name) for i, m in enumerate(blocks[:max_calls])]
    return Found(text=rest.strip(), calls=calls, total=len(blocks))


def _qwen3_coder_call(block: str, index: int, by_name: Mapping[str, Any]) -> Raw:
    where = f"tool call {index + 1}"
    fn = _QC_FUNCTION.search(block)
    name = fn.group(1).strip() if fn else ""
    if not fn or not name:
        return "", f"{where} has no <function=NAME>; write {QWEN3_CODER_EXAMPLE}"
    properties = _properties(by_name.get(name))
    arguments: dict[str, Any] = {}
    for p in _QC_PARAM.finditer(fn.group(2)):
        key = p.group(1).strip()
        if not p.group(3):  # cut off (the turn ended inside it) or not closed before the next one
            return name, f"{name}: parameter {key!r} is not closed with </parameter>; write {QWEN3_CODER_EXAMPLE}"
        if key in arguments:
            return name, f"{name}: parameter {key!r} is given twice"
        arguments[key] = _typed(_strip_one_newline(p.group(2)), properties.get(key, {}))
    return name, arguments


def _properties(tool: Any) -> Mapping[str, Any]:
    if not isinstance(tool, Mapping):
        return {}
    props = tool.get("function", {}).get("parameters", {}).get("properties", {})
    return props if isinstance(props, Mapping) else {}


def _strip_one_newline(value: str) -> str:
    # The template writes "\n" + value + "\n": only those two go, the value's own blank lines stay.
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: Mapping[str, Any]) -> Any:
    """A parameter's text as its schema's type; text that does not read as that type stays text,
    so the schema check names the parameter and what it got."""
    kinds = schema.get("type", "string")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if "string" in kinds or not kinds:
        return value
    word = value.strip()
    if "boolean" in kinds and word.lower() in ("true", "false"):  # the template writes Python's True/False
        return word.lower() == "true"
    if "null" in kinds and word in ("null", "None"):
        return None
    try:
        return loads_bounded(word)
    except json.JSONDecodeError:
        return value


# ----- Mistral -----

MISTRAL_EXAMPLE = '[TOOL_CALLS] [{"name": "NAME", "arguments": {...}}]'
TOOL_CALLS = "[TOOL_CALLS]"
_ARGS, _CALL_ID = "[ARGS]", "[CALL_ID]"
_MISTRAL_END = ("</s>",)


def is_mistral(text: str) -> bool:
    return TOOL_CALLS in text


def read_mistral(text: str, max_calls: int) -> Found:
    head, _, body = text.partition(TOOL_CALLS)
    for end in _MISTRAL_END:
        body = body.strip().removesuffix(end)
    body = body.strip()
    if body[:1] in ("[", "{"):  # v0.3 / Nemo: one JSON list after the marker
        return _mistral_json(head, body, max_calls)
    parts = body.split(TOOL_CALLS)  # later tokenizers: NAME[ARGS]{...} per marker
    calls = [_mistral_named(p, i) for i, p in enumerate(parts[:max_calls])]
    return Found(text=head.strip(), calls=calls, total=len(parts))


def _mistral_json(head: str, body: str, max_calls: int) -> Found:
    try:
        value = loads_bounded(body)
    except json.JSONDecodeError as e:
        return Found(text=head.strip(), total=1, calls=[(_name_in(body), (
            f"the tool calls after [TOOL_CALLS] are not valid JSON ({e.msg} at char {e.pos}); write {MISTRAL_EXAMPLE}"))])
    items = value if isinstance(value, list) else [value]
    calls: list[Raw] = []
    for i, item in enumerate(items[:max_calls]):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            calls.append(("", f"tool call {i + 1} must be an object with \"name\" and \"arguments\"; "
                              f"write {MISTRAL_EXAMPLE}"))
        else:
            calls.append(_args_as_object((item["name"], item.get("arguments", item.get("parameters", {})))))
    return Found(text=head.strip(), calls=calls, total=len(items))


def _mistral_named(part: str, index: int) -> Raw:
    name, sep, args = part.partition(_ARGS)
    name = name.partition(_CALL_ID)[0].strip()
    if not sep or not name:
        return name, f"tool call {index + 1} is not NAME[ARGS]{{...}} after [TOOL_CALLS]; write {MISTRAL_EXAMPLE}"
    args = args.strip()
    for end in _MISTRAL_END:
        args = args.removesuffix(end).strip()
    try:
        value = loads_bounded(args) if args else {}
    except json.JSONDecodeError as e:
        return name, f"{name}: the arguments after [ARGS] are not valid JSON ({e.msg} at char {e.pos})"
    return _args_as_object((name, value))


def _args_as_object(call: tuple[str, Any]) -> Raw:
    name, args = call
    if isinstance(args, str):  # OpenAI's wire format sends arguments as a JSON string; models copy it
        try:
            args = loads_bounded(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return name, f"{name}: arguments is a string but not valid JSON ({e.msg})"
    return (name, args) if isinstance(args, dict) else (name, f"{name}: arguments must be a JSON object")


def _name_in(body: str) -> str:
    match = re.search(r'"name"\s*:\s*"([^"]{1,64})"', body)
    return match.group(1) if match else ""


# ----- Gemma -----

GEMMA_EXAMPLE = '<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>'
_GEMMA_MARKS = (("<|tool_call>", "<tool_call|>", '<|"|>'),  # Gemma 4
                ("<start_function_call>", "<end_function_call>", "<escape>"))  # FunctionGemma


_WORD = re.compile(r"[^,}\]\s]+")
_KEY = re.compile(r"[A-Za-z_][\w.\-]*")


def is_gemma(text: str) -> bool:
    return any(start in text for start, _, _ in _GEMMA_MARKS)


def read_gemma(text: str, max_calls: int) -> Found:
    start, end, quote = next(m for m in _GEMMA_MARKS if m[0] in text)
    pieces = text.split(start)
    rest, calls = [pieces[0]], []
    for i, piece in enumerate(pieces[1:]):
        body, closed, after = piece.partition(end)
        rest.append(after if closed else "")
        if i < max_calls:
            calls.append(_gemma_call(body.strip(), i, quote))
    return Found(text=" ".join(rest).strip(), calls=calls, total=len(pieces) - 1)


def _gemma_call(body: str, index: int, quote: str) -> Raw:
    where = f"tool call {index + 1}"
    match = re.match(r"call:([^{\s]+)\s*\{", body)
    if not match:
        return "", f"{where} is not call:NAME{{...}}; write {GEMMA_EXAMPLE}"
    name = match.group(1)
    reader = _GemmaValues(body, quote)
    try:
        arguments, at = reader.object(match.end() - 1, 0)
        if body[at:].strip():
            raise _Unreadable(at, "text after the closing }")
    except _Unreadable as e:
        return name, f"{name}: the arguments cannot be read at char {e.at} ({e.why}); write {GEMMA_EXAMPLE}"
    return name, arguments


class _Unreadable(Exception):
    def __init__(self, at: int, why: str):
        super().__init__(why)
        self.at, self.why = at, why


class _GemmaValues:
    """Gemma's argument values: JSON's shapes, with strings between `quote` tokens and object
    keys bare or quoted. Recursive descent, nesting bounded as for JSON."""

    def __init__(self, text: str, quote: str):
        self.text, self.quote = text, quote

    def value(self, at: int, depth: int) -> tuple[Any, int]:
        at = self._skip(at)
        if self.text.startswith(self.quote, at):
            close = self.text.find(self.quote, at + len(self.quote))
            if close < 0:
                raise _Unreadable(at, f"a string opened with {self.quote} is not closed")
            return self.text[at + len(self.quote):close], close + len(self.quote)
        if self.text.startswith("{", at):
            return self.object(at, depth + 1)
        if self.text.startswith("[", at):
            return self._array(at, depth + 1)
        match = _WORD.match(self.text, at)
        if not match:
            raise _Unreadable(at, "a value is missing")
        word = match.group(0)
        try:
            value = json.loads(word) if word not in ("True", "False", "None") else {"True": True, "False": False}.get(word)
        except json.JSONDecodeError:
            raise _Unreadable(at, f"{word!r} is not a number, true, false, null or a {self.quote}string{self.quote}") from None
        return value, match.end()

    def object(self, at: int, depth: int) -> tuple[dict[str, Any], int]:
        """An object at `at` (its "{"); keys bare or quoted, as templates differ in which they write."""
        self._deep(at, depth)
        out: dict[str, Any] = {}
        at = self._skip(at + 1)
        while not self.text.startswith("}", at):
            if at >= len(self.text):
                raise _Unreadable(at, "the object is not closed with }")
            key, at = self._key(at)
            at = self._skip(at)
            if not self.text.startswith(":", at):
                raise _Unreadable(at, f"expected : after key {key!r}")
            out[key], at = self.value(at + 1, depth)
            at = self._after_item(at, "}")
        return out, at + 1

    def _array(self, at: int, depth: int) -> tuple[list[Any], int]:
        self._deep(at, depth)
        out: list[Any] = []
        at = self._skip(at + 1)
        while not self.text.startswith("]", at):
            if at >= len(self.text):
                raise _Unreadable(at, "the list is not closed with ]")
            item, at = self.value(at, depth)
            out.append(item)
            at = self._after_item(at, "]")
        return out, at + 1

    def _key(self, at: int) -> tuple[str, int]:
        if self.text.startswith(self.quote, at):
            return self.value(at, 0)
        match = _KEY.match(self.text, at)
        if not match:
            raise _Unreadable(at, "expected a key")
        return match.group(0), match.end()

    def _after_item(self, at: int, close: str) -> int:
        at = self._skip(at)
        if self.text.startswith(",", at):
            return self._skip(at + 1)
        if not self.text.startswith(close, at):
            raise _Unreadable(at, f"expected , or {close}")
        return at

    def _skip(self, at: int) -> int:
        while at < len(self.text) and self.text[at].isspace():
            at += 1
        return at

    @staticmethod
    def _deep(at: int, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _Unreadable(at, f"nesting deeper than {MAX_DEPTH} levels")
