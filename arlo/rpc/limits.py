"""Size checks for client-controlled request fields (the proto comments' "at most N bytes")."""

from __future__ import annotations


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def utf8_too_long(field: str, text: str, limit: int) -> str | None:
    """A message for INVALID_ARGUMENT when `text` is over `limit` UTF-8 bytes, else None."""
    # Cheap paths first: a char is 1 to 4 bytes, so most strings need no encoding.
    if len(text) * 4 <= limit:
        return None
    size = len(text) if len(text) > limit else utf8_len(text)
    if size <= limit:
        return None
    return f"{field} is {size} bytes; the limit is {limit} bytes"
