"""Chat templates of the tool-call families beyond Hermes and Llama 3.1, and tokenizer directories
that carry them (no hub here: each template is written from its published template's structure,
rendering an assistant's `tool_calls`, the tool listing and tool results as the original does).

- QWEN3_CODER: Qwen/Qwen3-Coder-30B-A3B-Instruct's chat_template.jinja (the copy vLLM ships as
  examples/tool_chat_template_qwen3coder.jinja): ChatML, tools as <function><name>... blocks in
  the system turn, calls as <tool_call><function=NAME><parameter=KEY>, results in <tool_response>.
- MISTRAL: mistralai/Mistral-7B-Instruct-v0.3's template (Nemo's differs only in spacing):
  [AVAILABLE_TOOLS] before the last user turn, [TOOL_CALLS] [{...JSON, "id"}]</s>, results as
  [TOOL_RESULTS] {"content": ..., "call_id": ...}[/TOOL_RESULTS]; ids are 9 alphanumerics.
- GEMMA4: google/gemma-4's template (vLLM's examples/tool_chat_template_gemma4.jinja), its tool
  parts: declarations in the system turn, calls as <|tool_call>call:NAME{k:<|"|>v<|"|>}<tool_call|>,
  results as <|tool_response>response:NAME{...}<tool_response|> in the same model turn; the
  declaration's parameter rendering is shortened to the JSON schema's fields a test needs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from tests.support.hf_checkpoints import train_tokenizer

QWEN3_CODER = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined or tools is none %}
    {%- set tools = [] %}
{%- endif %}
{%- if system_message is defined %}
    {{- "<|im_start|>system\n" + system_message }}
{%- elif tools | length > 0 %}
    {{- "<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a computer to solve tasks." }}
{%- endif %}
{%- if tools | length > 0 %}
    {{- "\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif %}
        {{- "\n<function>\n<name>" ~ tool.name ~ "</name>" }}
        {%- if tool.description is defined %}{{- "\n<description>" ~ (tool.description | trim) ~ "</description>" }}{%- endif %}
        {{- "\n<parameters>" }}
        {%- for param_name, param_fields in (tool.parameters.properties | default({})) | items %}
            {{- "\n<parameter>\n<name>" ~ param_name ~ "</name>" }}
            {%- if param_fields.type is defined %}{{- "\n<type>" ~ (param_fields.type | string) ~ "</type>" }}{%- endif %}
            {%- if param_fields.description is defined %}{{- "\n<description>" ~ (param_fields.description | trim) ~ "</description>" }}{%- endif %}
            {{- "\n</parameter>" }}
        {%- endfor %}
        {%- if tool.parameters.required is defined %}{{- "\n<required>" ~ (tool.parameters.required | tojson) ~ "</required>" }}{%- endif %}
        {{- "\n</parameters>\n</function>" }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>" }}
{%- endif %}
{%- if system_message is defined or tools | length > 0 %}
    {{- "<|im_end|>\n" }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- "<|im_start|>" + message.role }}
        {%- if message.content is defined and message.content is string and message.content | trim | length > 0 %}
            {{- "\n" + message.content | trim + "\n" }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- "\n<tool_call>\n<function=" + tool_call.name + ">\n" }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments | items %}
                    {{- "<parameter=" + args_name + ">\n" }}
                    {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- "\n</parameter>\n" }}
                {%- endfor %}
            {%- endif %}
            {{- "</function>\n</tool_call>" }}
        {%- endfor %}
        {{- "<|im_end|>\n" }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- "<|im_start|>user\n" }}
        {%- endif %}
        {{- "<tool_response>\n" + message.content + "\n</tool_response>\n" }}
        {%- if loop.last or loop.nextitem.role != "tool" %}
            {{- "<|im_end|>\n" }}
        {%- endif %}
    {%- else %}
        {{- "<|im_start|>" + message.role + "\n" + message.content + "<|im_end|>\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\n" }}
{%- endif %}
"""

MISTRAL = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {{- '{"type": "function", "function": ' + (tool.function | tojson) + '}' }}
                {%- if not loop.last %}{{- ", " }}{%- endif %}
            {%- endfor %}
            {{- "][/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function | tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id | length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"] | trim + eos_token }}
    {%- elif message["role"] == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id | length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

GEMMA4 = r"""{%- macro format_argument(argument, escape_keys=True) -%}
    {%- if argument is string -%}
        {{- '<|"|>' + argument + '<|"|>' -}}
    {%- elif argument is boolean -%}
        {{- 'true' if argument else 'false' -}}
    {%- elif argument is mapping -%}
        {{- '{' -}}
        {%- for key, value in argument | dictsort -%}
            {%- if escape_keys -%}{{- '<|"|>' + key + '<|"|>' -}}{%- else -%}{{- key -}}{%- endif -%}
            :{{- format_argument(value, escape_keys=escape_keys) -}}
            {%- if not loop.last %},{% endif -%}
        {%- endfor -%}
        {{- '}' -}}
    {%- elif argument is sequence -%}
        {{- '[' -}}
        {%- for item in argument -%}
            {{- format_argument(item, escape_keys=escape_keys) -}}
            {%- if not loop.last %},{% endif -%}
        {%- endfor -%}
        {{- ']' -}}
    {%- else -%}
        {{- argument -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro format_tool_response_block(tool_name, response) -%}
    {{- '<|tool_response>response:' + tool_name + '{value:' + format_argument(response, escape_keys=False) + '}<tool_response|>' -}}
{%- endmacro -%}
{%- set ns = namespace(prev_message_type=None) -%}
{%- set loop_messages = messages -%}
{{- bos_token -}}
{%- if tools or messages[0]['role'] in ['system', 'developer'] -%}
    {{- '<|turn>system\n' -}}
    {%- if messages[0]['role'] in ['system', 'developer'] -%}
        {{- messages[0]['content'] | trim -}}
        {%- set loop_messages = messages[1:] -%}
    {%- endif -%}
    {%- if tools -%}
        {%- for tool in tools -%}
            {{- '<|tool>declaration:' + tool['function']['name'] + '{description:<|"|>' + tool['function']['description'] + '<|"|>' -}}
            {{- ',parameters:' + format_argument(tool['function']['parameters'], escape_keys=False) + '}<tool|>' -}}
        {%- endfor -%}
        {%- set ns.prev_message_type = 'tool' -%}
    {%- endif -%}
    {{- '<turn|>\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message['role'] != 'tool' -%}
        {%- set ns.prev_message_type = None -%}
        {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
        {{- '<|turn>' + role + '\n' -}}
        {%- if message['tool_calls'] -%}
            {%- for tool_call in message['tool_calls'] -%}
                {%- set function = tool_call['function'] -%}
                {{- '<|tool_call>call:' + function['name'] + '{' -}}
                {%- if function['arguments'] is mapping -%}
                    {%- for key, value in function['arguments'] | dictsort -%}
                        {{- key -}}:{{- format_argument(value, escape_keys=False) -}}
                        {%- if not loop.last %},{% endif -%}
                    {%- endfor -%}
                {%- elif function['arguments'] is string -%}
                    {{- function['arguments'] -}}
                {%- endif -%}
                {{- '}<tool_call|>' -}}
            {%- endfor -%}
            {%- set ns.prev_message_type = 'tool_call' -%}
        {%- endif -%}
        {%- set ns_tr = namespace(flag=false, stopped=false) -%}
        {%- if message.get('tool_calls') -%}
            {%- for k in range(loop.index0 + 1, loop_messages | length) -%}
                {%- if ns_tr.stopped or loop_messages[k]['role'] != 'tool' -%}
                    {%- set ns_tr.stopped = true -%}
                {%- else -%}
                    {%- set follow = loop_messages[k] -%}
                    {%- set ns_name = namespace(name=follow.get('name') | default('unknown', true)) -%}
                    {%- for tc in message['tool_calls'] -%}
                        {%- if tc.get('id') == follow.get('tool_call_id') -%}{%- set ns_name.name = tc['function']['name'] -%}{%- endif -%}
                    {%- endfor -%}
                    {{- format_tool_response_block(ns_name.name, follow.get('content')) -}}
                    {%- set ns_tr.flag = true -%}
                    {%- set ns.prev_message_type = 'tool_response' -%}
                {%- endif -%}
            {%- endfor -%}
        {%- endif -%}
        {%- set content = (message['content'] or '') | trim -%}
        {{- content -}}
        {%- if ns.prev_message_type == 'tool_call' and not ns_tr.flag -%}
            {{- '<|tool_response>' -}}
        {%- elif not (ns_tr.flag and not content) -%}
            {{- '<turn|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.prev_message_type != 'tool_response' and ns.prev_message_type != 'tool_call' -%}
    {{- '<|turn>model\n<|channel>thought\n<channel|>' -}}
{%- endif -%}
"""

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_coder": dict(template=QWEN3_CODER, tokenizer_class="Qwen2Tokenizer", bos=None, eos="<|im_end|>",
                        pad="<|endoftext|>", specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                        added=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]),
    # Mistral's control tokens are special: decoding must keep [TOOL_CALLS] for the call to be read.
    "mistral": dict(template=MISTRAL, tokenizer_class="PreTrainedTokenizerFast", bos="<s>", eos="</s>", pad="</s>",
                    specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                              "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], added=[]),
    # So are Gemma 4's tool tokens, its string quote <|"|> among them.
    "gemma": dict(template=GEMMA4, tokenizer_class="PreTrainedTokenizerFast", bos="<bos>", eos="<turn|>", pad="<pad>",
                  specials=["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>",
                            "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>",
                            "<channel|>"], added=[]),
}


def write_tool_tokenizer(path: Path, family: str, *, extra: Sequence[str] = ()) -> Tokenizer:
    """A tokenizer directory for `family` (FAMILIES): tokenizer.json trained here (with `extra`
    added as ordinary tokens), and tokenizer_config.json with the family's chat template and
    special tokens."""
    spec = FAMILIES[family]
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec["specials"], [])
    added = [*spec["added"], *extra]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in [*spec["specials"], *added]}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": spec["tokenizer_class"], "chat_template": spec["template"],
        "eos_token": spec["eos"], "pad_token": spec["pad"], "bos_token": spec["bos"],
        "model_max_length": 4096, "clean_up_tokenization_spaces": False, "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": t in spec["specials"], "normalized": False, "lstrip": False,
                     "rstrip": False, "single_word": False} for t, i in ids.items()},
    }, indent=2))
    return tok
