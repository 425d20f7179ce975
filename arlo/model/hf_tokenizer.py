"""A Hugging Face tokenizer directory behind ByteTokenizer's interface.

Reads `tokenizer.json` (the `tokenizers` library), special tokens from
`tokenizer_config.json`, the chat template from `chat_template.jinja` or
`tokenizer_config.json`, and extra end-of-sequence ids from `generation_config.json` /
`config.json`. Nothing is fetched: a missing tokenizer.json is an error naming it.

Turn by turn encoding (the rollout agent's token-in/token-out loop) works as with
ByteTokenizer: `encode_messages(first, add_bos=True)`, then the model's tokens up to and
including its end-of-turn token (`eos_id`), then `encode_messages(next, add_bos=False)`
for the next messages. A continuation is the text a full rendering puts after an
assistant turn's end-of-turn token (for ChatML, the newline after `<|im_end|>`), so the
concatenation matches what the template gives for the whole conversation wherever the
template renders past turns verbatim.

`tools` (OpenAI function schemas) go to the template on both calls: the first renders the
tool listing where the template puts it (Qwen2.5's system turn, Llama 3.1's first user
turn); a continuation is cut after the probe's answer, so the listing never repeats but any
template logic that depends on tools being defined still sees them. Messages keep every field
(name, tool_calls, tool_call_id): a tool result is `{"role": "tool", "name": ..., "content": ...}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from arlo.model.chat_template import ChatTemplate
from arlo.model.tokenizer import message_dict
from arlo.tool_formats import MARKUP_TOKENS

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# An assistant turn rendered once to find what follows its content (the end-of-turn token).
_PROBE = [{"role": "user", "content": "arlo-probe-question"},
          {"role": "assistant", "content": "arlo-probe-answer"}]
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class HFTokenizer:
    """encode / decode / encode_messages, eos_id, pad_id, bos_id, vocab_size, stop_token_ids."""

    renders_tools = True
    """Tool schemas given to encode_messages reach the model (through its chat template)."""

    def __init__(self, tokenizer: Tokenizer, *, name: str, special_tokens: Mapping[str, str],
                 chat_template: str | None, extra_eos_ids: Sequence[int] = (), template_engine: str = "auto"):
        self.name = name
        self._tok = tokenizer
        self.special_tokens = dict(special_tokens)
        self.template = ChatTemplate(chat_template, engine=template_engine) if chat_template else None
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        specials = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        # Tool-call markup is a special token in some families (Mistral's [TOOL_CALLS], Gemma's
        # <|tool_call>, <|"|>): decode keeps it, or the call could not be read back from the text.
        self._dropped = frozenset(i for i, text in specials.items() if text not in MARKUP_TOKENS)
        self._keeps_markup = len(self._dropped) < len(specials)
        self._result_probe: bool | None = None
        self.bos_id = self._id_of("bos_token")
        config_eos = self._id_of("eos_token")
        # A chat model's turn ends with the template's end-of-turn token (Llama 3's <|eot_id|>,
        # ChatML's <|im_end|>), which base checkpoints' eos_token often is not.
        self._turn_end = self._find_turn_end()
        fallback = config_eos if config_eos is not None else next(iter(extra_eos_ids), None)
        eos = self._turn_end[0] if self._turn_end else fallback
        if eos is None:
            raise ValueError(f"{name}: no end-of-sequence token (set eos_token in {CONFIG_FILE})")
        self.eos_id: int = eos
        pad = self._id_of("pad_token")
        self.pad_id: int = eos if pad is None else pad
        candidates = [self.eos_id, config_eos, *extra_eos_ids]
        self._stop_ids = list(dict.fromkeys(i for i in candidates if i is not None))

    @classmethod
    def from_dir(cls, path: str | Path, *, template_engine: str = "auto") -> HFTokenizer:
        root = Path(path)
        file = root / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file}: missing; an HF tokenizer directory needs {TOKENIZER_FILE} "
                                    f"(slow sentencepiece/tiktoken-only tokenizers are not read)")
        config = _read_json(root / CONFIG_FILE)
        template_file = root / TEMPLATE_FILE
        template = template_file.read_text() if template_file.is_file() else _template_from(config)
        special = {k: v for k in _SPECIAL_KEYS if (v := _token_text(config.get(k))) is not None}
        extra_eos = _eos_ids(_read_json(root / "generation_config.json")) + _eos_ids(_read_json(root / "config.json"))
        return cls(Tokenizer.from_file(str(file)), name=str(root), special_tokens=special, chat_template=template,
                   extra_eos_ids=extra_eos, template_engine=template_engine)

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end a model turn: eos_id first, then the checkpoint's other eos ids."""
        return list(self._stop_ids)

    def encode(self, text: str) -> list[int]:
        """Text to ids, no BOS/EOS added (special-token strings in the text become their ids)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids to text; out-of-range ids and special ids other than tool-call markup are skipped."""
        if not self._keeps_markup:
            return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=True)
        kept = [i for i in ids if 0 <= i < self.vocab_size and i not in self._dropped]
        return self._tok.decode(kept, skip_special_tokens=False)

    def encode_messages(self, messages: Sequence[Any], *, add_generation_prompt: bool, add_bos: bool,
                        tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """add_bos=True: a conversation from its start (the template decides on BOS and any
        default system prompt). add_bos=False: messages continuing a conversation whose last
        model turn ended with eos_id (see the module docstring)."""
        return self.encode(self.render_messages(messages, add_generation_prompt=add_generation_prompt,
                                                add_bos=add_bos, tools=tools))

    def render_messages(self, messages: Sequence[Any], *, add_generation_prompt: bool, add_bos: bool,
                        tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The text `encode_messages` encodes."""
        chat = _with_call_ids([message_dict(m) for m in messages])
        if add_bos:
            return self._render(chat, add_generation_prompt, tools)
        turn_end = self._turn_end
        if turn_end is None:
            raise ValueError(f"{self.name}: the chat template puts no special token after an assistant turn, "
                             f"so a conversation cannot be encoded turn by turn")
        full = self._render([*_PROBE, *chat], add_generation_prompt, tools)
        answer = full.find(_PROBE[1]["content"])
        after = answer + len(_PROBE[1]["content"])
        if answer < 0 or not full.startswith(turn_end[1], after):
            raise ValueError(f"{self.name}: the chat template does not render an earlier assistant turn verbatim; "
                             f"turn-by-turn encoding needs that")
        if any(m["role"] == "tool" for m in chat) and self._drops_results():
            raise ValueError(f"{self.name}: the chat template drops a tool result that follows an assistant turn "
                             f"given as tokens (it renders results only inside the calling turn); such a "
                             f"conversation cannot be encoded turn by turn")
        return full[after + len(turn_end[1]):]

    def _drops_results(self) -> bool:
        """Whether the template writes nothing for a tool result after a plain assistant turn:
        Gemma 4's writes a result only inside the turn that made the call, so after a turn given
        as tokens it would drop it; an error is better than a prompt without it. Probed once."""
        if self._result_probe is None:
            result = {"role": "tool", "name": "arlo_probe", "tool_call_id": "call00000", "content": "arlo-probe-result"}
            try:
                self._result_probe = "arlo-probe-result" not in self._render([*_PROBE, result], False)
            except ValueError:
                self._result_probe = False  # a template that refuses the probe says so itself on real input
        return self._result_probe

    def assistant_ids(self, message: Any, *, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The template's rendering of an assistant turn between its generation prompt and its
        end-of-turn token (structured tool_calls become the family's call text), encoded."""
        return self.encode(self.render_assistant(message, tools=tools))

    def render_assistant(self, message: Any, *, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The text `assistant_ids` encodes."""
        turn = message_dict(message)
        if turn.get("role") != "assistant":
            raise ValueError(f"render_assistant: expected an assistant message, got role {turn.get('role')!r}")
        if self._turn_end is None:
            raise ValueError(f"{self.name}: the chat template puts no special token after an assistant turn")
        head = self._render(_PROBE[:1], True, tools)
        full = self._render([*_PROBE[:1], turn], False, tools)
        end = full.rfind(self._turn_end[1])
        if not full.startswith(head) or end < len(head):
            raise ValueError(f"{self.name}: the chat template does not render an assistant turn after its "
                             f"generation prompt; its tokens cannot be told apart")
        return full[len(head):end]

    def _render(self, chat: list[dict[str, Any]], add_generation_prompt: bool,
                tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        if self.template is None:
            raise ValueError(f"{self.name}: no chat template ({TEMPLATE_FILE} or chat_template in {CONFIG_FILE})")
        return self.template.render(chat, add_generation_prompt=add_generation_prompt, tokens=self.special_tokens,
                                    tools=tools)

    def _find_turn_end(self) -> tuple[int, str] | None:
        """(id, text) of the special token the template puts right after an assistant turn."""
        if self.template is None:
            return None
        try:
            text = self._render(_PROBE, False)
        except ValueError:
            return None  # e.g. no jinja2 for an unknown template: encode/decode still work
        after = text.find(_PROBE[1]["content"]) + len(_PROBE[1]["content"])
        specials = [t for t in self._tok.get_added_tokens_decoder().values() if t.special]
        found = [t.content for t in specials if text.startswith(t.content, after)]
        if not found:
            return None
        content = max(found, key=len)
        return self._tok.token_to_id(content), content

    def _id_of(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        return None if text is None else self._tok.token_to_id(text)


def _with_call_ids(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A tool result without a `tool_call_id` (the rollout's observations carry none) gets a
    placeholder, numbered in order: Mistral's templates refuse a result without a 9-character id,
    the others ignore it."""
    n = 0
    for m in chat:
        if m.get("role") == "tool" and not m.get("tool_call_id"):
            m["tool_call_id"] = f"call{n:05d}"
            n += 1
    return chat


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _template_from(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialised AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _eos_ids(config: Mapping[str, Any]) -> list[int]:
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in ids if isinstance(i, int)]
