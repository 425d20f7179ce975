"""Byte-level tokenizer with a minimal chat template.

Token ids 0..255 are the UTF-8 bytes; specials follow. The chat template is
`[BOS] (ROLE content EOS)* [ASSISTANT]`: every message ends in EOS and the generation
prompt is a bare ASSISTANT token, so a model turn is exactly `content EOS`. That makes the
template prefix-stable: encoding a conversation turn by turn (first call with add_bos,
later ones without, model tokens appended verbatim in between) gives the same ids as
encoding it whole, which token-in/token-out rollouts rely on.
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

    def encode_messages(self, messages: Sequence[Any], *, add_generation_prompt: bool,
                        add_bos: bool) -> list[int]: ...


class ByteTokenizer:
    name = "byte"
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

    def encode_messages(
        self, messages: Sequence[Any], *, add_generation_prompt: bool, add_bos: bool
    ) -> list[int]:
        """Messages are (role, content) pairs or objects with .role and .content (e.g. the
        proto `Message`)."""
        ids = [BOS] if add_bos else []
        for i, message in enumerate(messages):
            role, content = _role_and_content(message)
            role_id = self.role_ids.get(role)
            if role_id is None:
                raise ValueError(f"messages[{i}].role: unknown role {role!r}; known: {sorted(self.role_ids)}")
            ids.append(role_id)
            ids.extend(self.encode(content))
            ids.append(EOS)
        if add_generation_prompt:
            ids.append(ASSISTANT)
        return ids


def _role_and_content(message: Any) -> tuple[str, str]:
    if isinstance(message, tuple | list):
        role, content = message
        return role, content
    return message.role, message.content


def get_tokenizer(name: str) -> Tokenizer:
    """"byte", or the path of a Hugging Face model/tokenizer directory (an HFTokenizer)."""
    if name == ByteTokenizer.name:
        return ByteTokenizer()
    if Path(name).is_dir():
        from arlo.model.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_dir(name)
    raise ValueError(f"unknown tokenizer {name!r}; known: ['byte'] or a Hugging Face model directory")
