"""Byte-level tokenizer with a minimal chat template.

Token ids 0..255 are the UTF-8 bytes; specials follow. The chat template is
`[BOS] (ROLE content EOS)* [ASSISTANT]`: every message ends in EOS and the generation
prompt is a bare ASSISTANT token, so a model turn is exactly `content EOS`. That makes the
template prefix-stable: encoding a conversation turn by turn (first call with add_bos,
later ones without, model tokens appended verbatim in between) gives the same ids as
encoding it whole, which token-in/token-out rollouts rely on.

Tools (`encode_messages(..., tools=)`) are ignored by the byte template: its presets are the
demo's tiny models, whose context is a few hundred bytes, and they learn an environment's
action syntax from demonstrations rather than from a schema listing. Structured tool calls
(an assistant message's `tool_calls`) have no byte rendering either and are refused: write the
call as the assistant's content. Hugging Face tokenizers (hf_tokenizer.py) render both with
the model's own template.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, TOOL = range(256, 263)


class Tokenizer(Protocol):
    """What services need of a tokenizer: ByteTokenizer and hf_tokenizer.HFTokenizer."""

    name: str
    eos_id: int
    pad_id: int
    vocab_size: int

    @property
    def stop_token_ids(self) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_messages(self, messages: Sequence[Any], *, add_generation_prompt: bool, add_bos: bool,
                        tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Messages are (role, content) pairs, dicts (every field kept: name, tool_calls, ...)
        or objects with .role, .content and optionally .name; `tools` are OpenAI function
        schemas for the template to list."""
        ...

    def assistant_ids(self, message: Any, *, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """An assistant turn's tokens as the model writes them: what follows the generation prompt
        (its text, or its structured tool_calls in the template's format), without the end token."""
        ...


class ByteTokenizer:
    name = "byte"
    renders_tools = False
    """encode_messages ignores tools= (see its docstring)."""
    pad_id = PAD
    bos_id = BOS
    eos_id = EOS
    vocab_size = 263
    role_ids: Mapping[str, int] = MappingProxyType(
        {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL})

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end a model turn."""
        return [EOS]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; special and out-of-range ids are skipped, bad UTF-8 replaced."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def assistant_ids(self, message: Any, *, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        m = message_dict(message)
        if m.get("tool_calls"):
            raise ValueError("tool_calls: the byte tokenizer has no tool-call format; write the call as content")
        return self.encode(m.get("content") or "")

    def encode_messages(self, messages: Sequence[Any], *, add_generation_prompt: bool, add_bos: bool,
                        tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Messages as in the Protocol; `tools` are ignored (see the module docstring)."""
        del tools
        ids = [BOS] if add_bos else []
        for i, message in enumerate(messages):
            m = message_dict(message)
            if m.get("tool_calls"):
                raise ValueError(f"messages[{i}].tool_calls: the byte tokenizer has no tool-call format; "
                                 f"write the call as the message's content")
            role, content = m.get("role"), m.get("content") or ""
            role_id = self.role_ids.get(role)
            if role_id is None:
                raise ValueError(f"messages[{i}].role: unknown role {role!r}; known: {sorted(self.role_ids)}")
            ids.append(role_id)
            ids.extend(self.encode(content))
            ids.append(EOS)
        if add_generation_prompt:
            ids.append(ASSISTANT)
        return ids


def message_dict(message: Any) -> dict[str, Any]:
    """A chat message as the dict templates read: (role, content) pairs, dicts (copied, every
    field kept) and objects with .role/.content/.name (the proto and rollout `Message`s; an
    empty name is left out, as a template tests whether `name` is defined)."""
    if isinstance(message, Mapping):
        return dict(message)
    if isinstance(message, tuple | list):
        role, content = message
        return {"role": role, "content": content}
    out = {"role": message.role, "content": message.content}
    name = getattr(message, "name", "")
    if name:
        out["name"] = name
    return out


def tokenizer_name(*, path: str, tokenizer: str) -> str:
    """The tokenizer a model section names: `tokenizer`, else the checkpoint directory's own
    (`path`), else "byte" (model.tokenizer and model.path of the run config)."""
    if path:
        return path if tokenizer in ("", ByteTokenizer.name) else tokenizer
    return tokenizer or ByteTokenizer.name


def get_tokenizer(name: str) -> Tokenizer:
    """"byte", or the path of a Hugging Face model/tokenizer directory (an HFTokenizer)."""
    if name == ByteTokenizer.name:
        return ByteTokenizer()
    if Path(name).is_dir():
        from arlo.model.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_dir(name)
    raise ValueError(f"unknown tokenizer {name!r}; known: ['byte'] or a Hugging Face model directory")
