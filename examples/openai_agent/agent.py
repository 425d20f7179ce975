"""A black-box agent: plain OpenAI SDK code, trained by arlo as it is.

`rollout.agent: examples.openai_agent.agent:run` (see rollout.yaml beside this file). arlo
calls `run(task, client)` once per episode with the environment's first observation and
tools, and a real `openai.AsyncOpenAI` client pointed at the policy; whatever the agent does
with it is recorded token by token and becomes the trajectory. The returned string is the
answer the environment and reward function judge.

Two turns: the model may call the calculator (the agent's own tool, run here), then it
answers with the tool's result in view. The agent sends each reply back exactly as it got
it (`message.model_dump()`), which is what lets arlo continue the episode from the model's
own tokens instead of re-rendering them.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

MODEL = "policy"  # any name: the endpoint serves one model
# The agent's own tool, run here: the environment only asks the question and judges the answer.
# Terse, because the demo's byte-level model has a 256-token context for the whole episode.
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The agent's own tool: + - * on integers, nothing else."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression {expression!r}")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError) as e:
        return f"error: {e}"


def run_tool(name: str, arguments: str) -> str:
    try:
        args: dict[str, Any] = json.loads(arguments or "{}")
    except json.JSONDecodeError as e:
        return f"error: arguments are not JSON ({e})"
    if name == "calculator":
        return calculate(str(args.get("expression", "")))
    if name == "answer":
        return str(args.get("value", ""))
    return f"error: unknown tool {name!r}"


async def run(task, client) -> str:
    messages: list[dict[str, Any]] = list(task.messages)
    first = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                 max_tokens=12, logprobs=True)
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    if reply.tool_calls:
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    else:  # an untrained policy rarely calls a tool: the agent tells it what it did instead
        messages.append({"role": "user", "content": "Answer with a number."})
    second = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                  max_tokens=12, logprobs=True)
    return second.choices[0].message.content or ""
