"""The bounds a remote environment's replies must keep: the gateway checks every reply before it
passes it on, because a remote backend is another party's code and whatever it answers goes
into prompts (observations, tools), the reward service (answer, reference, metadata) and the
trainer (rewards).

Found by a red team (issue 33, item 16): a 60 MB observation, 200,000 messages, a non-JSON or
deeply nested tools_json, NaN and inf rewards and an 8 MiB answer all passed through. A reply
outside the bounds is refused as the backend's failure (UNAVAILABLE, like any other failure of
what an environment depends on: not the agent's doing), naming the field and its bound.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from arlo.groups import MAX_ABS_REWARD
from arlo.jsonfields import loads_bounded, parse_json_object
from arlo.proto.v1 import common_pb2, env_pb2
from arlo.rpc import utf8_too_long

MAX_CONTENT_BYTES = 64 << 10
"""One message's content (common.proto: "UTF-8 text, at most 64 KiB")."""
MAX_OBSERVATION_MESSAGES = 64
"""Messages in one observation (a turn's tool results: local environments answer a handful)."""
MAX_OBSERVATION_BYTES = 1 << 20
"""All of one observation's contents together."""
MAX_NAME_BYTES = 128
"""A message's tool name, an environment's name."""
ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_TOOLS_JSON_BYTES = 64 << 10
MAX_TASK_ID_BYTES = 1024
MAX_METADATA_BYTES = 64 << 10
"""metadata_json, passed on as the reward service's metadata_json (reward.proto: 64 KiB)."""
MAX_TEXT_BYTES = 1 << 20
"""answer and reference, passed on as the reward service's response and reference (1 MiB)."""
MAX_INFO_BYTES = 64 << 10


def observation_problem(observation: Sequence[common_pb2.Message]) -> str | None:
    if len(observation) > MAX_OBSERVATION_MESSAGES:
        return f"observation has {len(observation)} messages (at most {MAX_OBSERVATION_MESSAGES})"
    total = 0
    for i, m in enumerate(observation):
        content = m.content
        total += len(content)
        if m.role not in ROLES:
            return f"observation[{i}].role is {m.role[:32]!r}; one of {sorted(ROLES)}"
        problem = (utf8_too_long(f"observation[{i}].content", content, MAX_CONTENT_BYTES)
                   or utf8_too_long(f"observation[{i}].name", m.name, MAX_NAME_BYTES))
        if problem:
            return problem
    if total * 4 > MAX_OBSERVATION_BYTES:  # characters: 1 to 4 bytes each
        size = sum(len(m.content.encode()) for m in observation)
        if size > MAX_OBSERVATION_BYTES:
            return f"observation's contents are {size} bytes in all (at most {MAX_OBSERVATION_BYTES})"
    return None


def tools_problem(tools_json: str, field: str = "tools_json") -> str | None:
    """A JSON list of tool schemas, "" for none."""
    problem = utf8_too_long(field, tools_json, MAX_TOOLS_JSON_BYTES)
    if problem or not tools_json:
        return problem
    try:
        tools = loads_bounded(tools_json)
    except json.JSONDecodeError as e:
        return f"{field} is not valid JSON: {e}"
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        return f"{field} must be a JSON list of tool schemas (objects), got {type(tools).__name__}"
    return None


def _json_object_problem(text: str, field: str, limit: int) -> str | None:
    problem = utf8_too_long(field, text, limit)
    if problem:
        return problem
    try:
        parse_json_object(text, field)
    except ValueError as e:
        return str(e)
    return None


def reset_problem(reply: env_pb2.ResetResponse) -> str | None:
    """Why a remote Reset reply is refused (the session id's bound is the caller's), or None."""
    return (observation_problem(reply.observation) or tools_problem(reply.tools_json)
            or utf8_too_long("task_id", reply.task_id, MAX_TASK_ID_BYTES)
            or _json_object_problem(reply.metadata_json, "metadata_json", MAX_METADATA_BYTES))


def step_problem(reply: env_pb2.StepResponse) -> str | None:
    """Why a remote Step reply (or a StepBatch result's response) is refused, or None."""
    reward = reply.reward
    if not math.isfinite(reward) or abs(reward) > MAX_ABS_REWARD:
        return f"reward is {reward!r}; it must be finite, within +-{MAX_ABS_REWARD:g}"
    return (observation_problem(reply.observation)
            or utf8_too_long("answer", reply.answer, MAX_TEXT_BYTES)
            or utf8_too_long("reference", reply.reference, MAX_TEXT_BYTES)
            or _json_object_problem(reply.info_json, "info_json", MAX_INFO_BYTES))


def info_problem(info: env_pb2.EnvironmentInfo) -> str | None:
    """Why a remote ListEnvironments entry is left out, or None."""
    return (utf8_too_long("name", info.name, MAX_NAME_BYTES) or (None if info.name else "name is empty")
            or tools_problem(info.tools_json)
            or utf8_too_long("description", info.description, MAX_CONTENT_BYTES))
