"""Rendering a Hugging Face chat template to text.

With jinja2 installed (it comes with the `hf` extra, through torch), the template is
rendered exactly as transformers' `apply_chat_template` does: a sandboxed environment with
the same options, filters and globals. jinja2 is not a core dependency, so without it two
families are rendered natively, recognised by their special tokens:
- ChatML (Qwen2/2.5/3): `<|im_start|>{role}\\n{content}<|im_end|>\\n`, with the template's
  default system prompt when it has one (Qwen2/2.5) and tool results wrapped in
  `<tool_response>` inside one user turn when the template does that (Qwen2.5/3).
- Llama 3: `{bos}<|start_header_id|>{role}<|end_header_id|>\\n\\n{content|trim}<|eot_id|>`, and
  for Llama 3.1+ templates their dated system turn and `ipython` role for tool results.
Not rendered natively: tool definitions (`tools=`) and structured tool calls (an assistant
message's `tool_calls`), Qwen3's thinking tags (`enable_thinking`, stripping of past
reasoning): asking the native engine for them, or for any other template, is an error on use
that says to install jinja2.

Messages are dicts and keep every field the caller gives (role, content, name, tool_calls,
tool_call_id, ...): a template reads what it knows. `tools` is a list of OpenAI function
schemas (`{"type": "function", "function": {"name", "description", "parameters"}}`), passed to
the template as its `tools` variable exactly as transformers' `apply_chat_template(tools=)` does.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

ENGINES = ("auto", "jinja2", "native")
Messages = Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]] | None
Renderer = Callable[[Messages, bool, Mapping[str, str], Tools], str]


def jinja2_available() -> bool:
    return importlib.util.find_spec("jinja2") is not None


class ChatTemplate:
    """A compiled template: `render(messages, add_generation_prompt=..., tokens=..., tools=...)`."""

    def __init__(self, source: str, *, engine: str = "auto"):
        if engine not in ENGINES:
            raise ValueError(f"chat template engine: expected one of {ENGINES}, got {engine!r}")
        if engine == "auto":
            engine = "jinja2" if jinja2_available() else "native"
        self.source = source
        self.engine = engine
        self._render = _compile_jinja(source) if engine == "jinja2" else _native(source)

    def render(self, messages: Messages, *, add_generation_prompt: bool, tokens: Mapping[str, str],
               tools: Tools = None) -> str:
        """`tokens` are the special-token strings templates read (bos_token, eos_token, ...);
        `tools` the OpenAI function schemas the template lists (None or empty: no tools)."""
        return self._render(messages, add_generation_prompt, tokens, list(tools) if tools else None)


def _compile_jinja(source: str) -> Renderer:
    if not jinja2_available():
        raise ValueError("chat template: the jinja2 engine needs jinja2 (pip install jinja2)")
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # `{% generation %}` marks assistant spans for HF's assistant masks; render its body as is.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template: does not compile ({e})") from e

    def render(messages: Messages, add_generation_prompt: bool, tokens: Mapping[str, str], tools: Tools) -> str:
        # As transformers: tools=None when there are none (templates test `tools is not none`).
        return template.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                               tools=[dict(t) for t in tools] if tools else None, documents=None, **tokens)

    return render


def _native(source: str) -> Renderer:
    if "<|im_start|>" in source:
        inner = _chatml(_default_system(source), wrap_tool="<tool_response>" in source)
    elif "<|start_header_id|>" in source:
        inner = _llama3(_date_string(source) if "Cutting Knowledge Date" in source else None)
    else:
        return _unsupported

    def render(messages: Messages, add_generation_prompt: bool, tokens: Mapping[str, str], tools: Tools) -> str:
        if tools or any(m.get("tool_calls") for m in messages):
            raise ValueError("chat template: tool definitions and structured tool calls need the jinja2 engine "
                             "(pip install jinja2); the native renderer writes only role and content")
        return inner(messages, add_generation_prompt, tokens)

    return render


def _unsupported(messages: Messages, add_generation_prompt: bool, tokens: Mapping[str, str], tools: Tools) -> str:
    # Raised on use, not on load: a tokenizer with such a template still encodes and decodes.
    raise ValueError("chat template: rendering this template needs jinja2 (pip install jinja2); without it "
                     "only Llama 3 and ChatML (Qwen) templates are rendered natively")


def _default_system(source: str) -> str | None:
    # Qwen2/2.5 write their default system turn as one string literal in the template.
    match = re.search(r"<\|im_start\|>system\\n([^'\"{}]*?)<\|im_end\|>", source)
    return match.group(1).replace("\\n", "\n") if match else None


def _date_string(source: str) -> Callable[[], str]:
    # Llama 3.2+ date the system turn today (strftime_now); 3.1 uses a fixed default.
    if "strftime_now" in source:
        return lambda: datetime.now().strftime("%d %b %Y")
    match = re.search(r"set date_string = \"([^\"]+)\"", source)
    fixed = match.group(1) if match else "26 Jul 2024"
    return lambda: fixed


def _chatml(default_system: str | None, *, wrap_tool: bool) -> Callable[[Messages, bool, Mapping[str, str]], str]:
    def render(messages: Messages, add_generation_prompt: bool, tokens: Mapping[str, str]) -> str:
        del tokens  # ChatML has no BOS
        parts = []
        if default_system is not None and (not messages or messages[0]["role"] != "system"):
            parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
        for i, m in enumerate(messages):
            if not (wrap_tool and m["role"] == "tool"):
                parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
                continue
            # Qwen2.5/3: consecutive tool results share one user turn.
            if i == 0 or messages[i - 1]["role"] != "tool":
                parts.append("<|im_start|>user")
            parts.append(f"\n<tool_response>\n{m['content']}\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                parts.append("<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    return render


def _llama3(date_string: Callable[[], str] | None) -> Callable[[Messages, bool, Mapping[str, str]], str]:
    """Llama 3.0, or with `date_string` the Llama 3.1+ layout: a dated system turn always
    first, tool results under the ipython role."""

    def render(messages: Messages, add_generation_prompt: bool, tokens: Mapping[str, str]) -> str:
        parts = [tokens.get("bos_token", "")]
        if date_string is not None:
            system = ""
            if messages and messages[0]["role"] == "system":
                system, messages = messages[0]["content"].strip(), messages[1:]
            parts.append(f"<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                         f"Today Date: {date_string()}\n\n{system}<|eot_id|>")
        for m in messages:
            if date_string is not None and m["role"] in ("tool", "ipython"):
                parts.append(f"<|start_header_id|>ipython<|end_header_id|>\n\n{m['content']}<|eot_id|>")
            else:
                parts.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>")
        if add_generation_prompt:
            parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
        return "".join(parts)

    return render
