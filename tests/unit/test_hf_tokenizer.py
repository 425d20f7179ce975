"""HFTokenizer on small tokenizer.json files built here: encode/decode, special tokens, chat
templates (jinja2 and the native Llama 3 / ChatML renderers), turn-by-turn encoding, and,
with the `hf` extra, agreement with transformers' apply_chat_template."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from arlo.model import get_tokenizer
from arlo.model.hf_tokenizer import HFTokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
HAS_JINJA = importlib.util.find_spec("jinja2") is not None
ENGINES = ["native", pytest.param("jinja2", marks=pytest.mark.skipif(not HAS_JINJA, reason="needs jinja2"))]

# Trimmed from the Qwen2.5 template (tool-call rendering of assistant turns left out).
QWEN25 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Trimmed from the Llama 3.1 template (tool definitions left out).
LLAMA31 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool') %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA30 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
           "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
           "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
           "{{ content }}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
FAMILIES = {
    "qwen25": (QWEN25, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, [151645, 2]),
    "llama31": (LLAMA31, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, [4, 7]),
    "llama30": (LLAMA30, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, [7]),
}
CONVERSATION = [("system", "be brief"), ("user", "2+2?"), ("assistant", "4"), ("tool", "ok"), ("tool", "done"),
                ("user", "and 3+3?")]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["be brief and answer the question", "system user assistant tool", "héllo wörld 数学 🙂"] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def _model_dir(root: Path, tokenizer_json: Path, family: str, *, jinja_file: bool = False) -> Path:
    template, special, gen_eos = FAMILIES[family]
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **special}
    if jinja_file:
        (root / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    return root


@pytest.fixture(params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


def test_encode_decode_and_specials(tmp_path: Path, tokenizer_json: Path) -> None:
    tok = HFTokenizer.from_dir(_model_dir(tmp_path, tokenizer_json, "qwen25"))
    for text in ["", "be brief", "héllo wörld 数学 🙂\n\ttab"]:
        assert tok.decode(tok.encode(text)) == text
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and tok.decode([*tok.encode("hi"), *im_end, 10**6]) == "hi"
    assert tok.vocab_size == 300 and tok.bos_id is None
    assert (tok.eos_id, tok.pad_id) == (im_end[0], tok.encode("<|endoftext|>")[0])
    assert tok.stop_token_ids[0] == tok.eos_id and 2 in tok.stop_token_ids  # + generation_config's ids


@pytest.mark.parametrize("engine", ENGINES)
def test_template_layouts(tmp_path: Path, tokenizer_json: Path, engine: str) -> None:
    qwen = HFTokenizer.from_dir(_model_dir(tmp_path / "q", tokenizer_json, "qwen25"), template_engine=engine)
    assert qwen.render_messages([("user", "hi")], add_generation_prompt=True, add_bos=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    llama = HFTokenizer.from_dir(_model_dir(tmp_path / "l", tokenizer_json, "llama31", jinja_file=True),
                                 template_engine=engine)
    assert llama.render_messages([("user", " hi ")], add_generation_prompt=True, add_bos=True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # The end of a model turn is the template's, not tokenizer_config's eos (Llama 3.0 case).
    llama30 = HFTokenizer.from_dir(_model_dir(tmp_path / "l0", tokenizer_json, "llama30"), template_engine=engine)
    assert llama30.eos_id == llama30.encode("<|eot_id|>")[0]
    assert llama30.stop_token_ids[:2] == [llama30.eos_id, llama30.encode("<|end_of_text|>")[0]]


@pytest.mark.parametrize("engine", ENGINES)
def test_turn_by_turn_equals_whole_conversation(tmp_path: Path, tokenizer_json: Path, family: str,
                                                engine: str) -> None:
    tok = HFTokenizer.from_dir(_model_dir(tmp_path, tokenizer_json, family), template_engine=engine)
    ids = tok.encode_messages(CONVERSATION[:2], add_generation_prompt=True, add_bos=True)
    ids += tok.encode("4") + [tok.eos_id]  # what the model generates, its stop token included
    ids += tok.encode_messages(CONVERSATION[3:], add_generation_prompt=True, add_bos=False)
    assert ids == tok.encode_messages(CONVERSATION, add_generation_prompt=True, add_bos=True)


@pytest.mark.skipif(not HAS_JINJA, reason="needs jinja2 to compare the native renderers against")
def test_native_renderers_match_jinja2(tmp_path: Path, tokenizer_json: Path, family: str) -> None:
    path = _model_dir(tmp_path, tokenizer_json, family)
    native, jinja = (HFTokenizer.from_dir(path, template_engine=e) for e in ("native", "jinja2"))
    for gp in (True, False):
        for messages in (CONVERSATION, CONVERSATION[1:], CONVERSATION[1:3]):
            assert native.render_messages(messages, add_generation_prompt=gp, add_bos=True) == \
                jinja.render_messages(messages, add_generation_prompt=gp, add_bos=True)


def test_matches_transformers_apply_chat_template(tmp_path: Path, tokenizer_json: Path, family: str) -> None:
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    path = _model_dir(tmp_path, tokenizer_json, family)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    ours = HFTokenizer.from_dir(path)
    chat = [{"role": r, "content": c} for r, c in CONVERSATION]
    expected = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.encode_messages(CONVERSATION, add_generation_prompt=True, add_bos=True) == list(expected)
    # And from the files transformers itself writes (chat_template.jinja, AddedToken dicts).
    ref.save_pretrained(tmp_path / "saved")
    again = HFTokenizer.from_dir(tmp_path / "saved")
    assert again.encode_messages(CONVERSATION, add_generation_prompt=True, add_bos=True) == list(expected)
    assert again.decode(list(expected)) == ref.decode(list(expected), skip_special_tokens=True)


def test_get_tokenizer_and_errors(tmp_path: Path, tokenizer_json: Path) -> None:
    path = _model_dir(tmp_path / "m", tokenizer_json, "qwen25")
    assert isinstance(get_tokenizer(str(path)), HFTokenizer)
    assert get_tokenizer("byte").name == "byte"
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        get_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="Hugging Face model directory"):
        get_tokenizer(str(tmp_path / "nope"))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = HFTokenizer.from_dir(bare)
    assert tok.decode(tok.encode("be brief")) == "be brief"
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_messages([("user", "hi")], add_generation_prompt=True, add_bos=True)
    (bare / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    with pytest.raises(ValueError, match="end-of-sequence"):
        HFTokenizer.from_dir(bare, template_engine="native")
