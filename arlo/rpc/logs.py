"""Structured logs: one JSON object per line on stderr, tagged with the service and request id.

The request id lives in a ContextVar: the server's request-id interceptor sets it for each
RPC (from the caller's `x-request-id`, else a fresh one), client channels forward it, and
every log line written while handling that RPC carries it, across services.
"""

from __future__ import annotations

import json
import logging
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128

_request_id: ContextVar[str | None] = ContextVar("arlo_request_id", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged too.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def current_request_id() -> str | None:
    """The request id of the RPC being handled (or set by `use_request_id`), else None."""
    return _request_id.get()


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def valid_request_id(value: str) -> bool:
    # Ids come from callers and end up in every log line: keep them short and printable.
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and value.isascii() and value.isprintable()


@contextmanager
def use_request_id(request_id: str | None = None) -> Iterator[str]:
    """Sets the request id for the enclosed code (e.g. one episode of a rollout worker)."""
    rid = request_id or new_request_id()
    token = _request_id.set(rid)
    try:
        yield rid
    finally:
        _request_id.reset(token)


def set_request_id(request_id: str) -> None:
    """Sets the id in the current context; the server interceptor uses it once per RPC context."""
    _request_id.set(request_id)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": current_request_id(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        return json.dumps(entry, default=str)


class _ArloHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler we install, so a second setup_logging replaces it and leaves others be."""


def setup_logging(service: str, level: str = "INFO") -> None:
    """Sends every log record (ours, grpc's, libraries') to stderr as JSON lines."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    root = logging.getLogger()
    # The service process owns logging: drop handlers that imports installed (a library's
    # basicConfig-style stderr handler printed every record twice, once not as JSON).
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = _ArloHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root.addHandler(handler)
    root.setLevel(numeric)
