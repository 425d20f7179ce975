"""SFT data: built-in demonstrations found through package resources, tokenized into batches
whose loss mask covers exactly the assistant's text and its end token."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from arlo.model import get_tokenizer
from services.trainer.sft import BUILTIN, demonstration_batches, load_demonstrations, tokenize_demonstration

TOK = get_tokenizer("byte")


@pytest.mark.parametrize("source", sorted(BUILTIN))
def test_builtin_data_loads_from_the_package(source: str) -> None:
    demos = load_demonstrations(source)
    assert len(demos) >= 8 and all(any(m["role"] == "assistant" for m in d.messages) for d in demos)


def test_the_mask_is_the_assistant_text_and_its_end_token() -> None:
    demo = [("user", "2+3?"), ("assistant", "5"), ("user", "and 4+4?"), ("assistant", "8")]
    ex = tokenize_demonstration(demo, TOK)
    assert len(ex.token_ids) == len(ex.loss_mask)
    targets = [t for t, m in zip(ex.token_ids, ex.loss_mask, strict=True) if m]
    assert targets == [*TOK.encode("5"), TOK.eos_id, *TOK.encode("8"), TOK.eos_id]
    # Context: everything but the targets is the chat template the rollout encodes.
    assert ex.token_ids[:len(TOK.encode_messages(demo[:1], add_generation_prompt=False, add_bos=True))] == \
        TOK.encode_messages(demo[:1], add_generation_prompt=False, add_bos=True)


def test_batches_are_padded_to_a_bucket_and_cut_at_the_context() -> None:
    demos = load_demonstrations("builtin:arith")
    batch = next(demonstration_batches(demos, TOK, 4, max_seq_len=512))
    assert batch.tokens_bt.shape[0] == 4 and batch.tokens_bt.shape == batch.mask_bt.shape
    length = batch.tokens_bt.shape[1]
    assert length & (length - 1) == 0  # a power of two: few compiled steps
    assert batch.tokens_bt.dtype == np.int32 and batch.mask_bt.dtype == np.float32
    assert batch.num_tokens == int(batch.mask_bt.sum()) > 0
    cut = next(demonstration_batches(demos, TOK, 4, max_seq_len=8, too_long="truncate_left"))
    assert cut.tokens_bt.shape == (4, 8) and cut.num_tokens > 0  # their ends: the assistant's answers
    # Endless and reshuffled: more batches than demonstrations.
    assert len(list(itertools.islice(demonstration_batches(demos, TOK, 4, max_seq_len=512), len(demos)))) == len(demos)


def test_missing_data_names_the_source() -> None:
    with pytest.raises(ValueError, match="SFT data not found: 'nope.jsonl'"):
        load_demonstrations("nope.jsonl")


def _tool_demo() -> dict:
    from services.env_gateway.envs.calculator import TOOLS

    def call(expression: str) -> dict:
        return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}

    return {"tools": [dict(t) for t in TOOLS], "messages": [
        {"role": "system", "content": "Use the calculator for arithmetic."},
        {"role": "user", "content": "What is 12*7 + 3*5?"},
        {"role": "assistant", "content": "", "tool_calls": [call("12*7")]},
        {"role": "tool", "name": "calculator", "content": "84"},
        {"role": "assistant", "content": "", "tool_calls": [call("3*5")]},
        {"role": "tool", "name": "calculator", "content": "15"},
        {"role": "assistant", "content": "The answer is 99."},
        {"role": "user", "content": "And 84 alone?"},
        {"role": "assistant", "content": "84"},
    ]}


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_hf_template_demonstrations_mask_exactly_the_assistant_tokens(tmp_path, family: str) -> None:
    """Against transformers: the tokens are apply_chat_template(whole conversation, tools=), and
    the mask is each assistant turn's span, the tokens between the rendering of the conversation
    up to it (with the generation prompt) and the rendering including it, up to its end token."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    import json

    from arlo.config import SFTConfig
    from arlo.model.hf_tokenizer import HFTokenizer
    from services.trainer.warmstart import WarmStart
    from tests.support.hf_checkpoints import write_tokenizer

    write_tokenizer(tmp_path / "tok", family)
    line = _tool_demo()
    data = tmp_path / "demos.jsonl"
    data.write_text(json.dumps(line) + "\n\n" + json.dumps({"messages": line["messages"][1:4] + [
        {"role": "assistant", "content": "84"}]}) + "\n")
    (demo, plain) = load_demonstrations(str(data))
    assert demo.tools is not None and plain.tools is None
    tok = HFTokenizer.from_dir(tmp_path / "tok")
    ex = tokenize_demonstration(demo, tok)

    ref = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")

    def render(messages: list, gp: bool = False) -> list[int]:
        return list(ref.apply_chat_template(messages, tools=line["tools"], add_generation_prompt=gp,
                                            tokenize=True, return_dict=False))

    chat = line["messages"]
    assert ex.token_ids == render(chat)
    expected = [0] * len(ex.token_ids)
    for k, m in enumerate(chat):
        if m["role"] != "assistant":
            continue
        before, upto = render(chat[:k], gp=True), render(chat[:k + 1])
        assert upto[:len(before)] == before  # the template is prefix-stable here
        span = upto[len(before):]
        span = span[:len(span) - span[::-1].index(tok.eos_id)]  # through the end-of-turn token
        expected[len(before):len(before) + len(span)] = [1] * len(span)
    assert ex.loss_mask == expected
    targets = tok.decode([t for t, m in zip(ex.token_ids, ex.loss_mask, strict=True) if m])
    assert '"expression": "12*7"' in targets and "The answer is 99." in targets and "calculator" in targets
    assert "system" not in targets and "user" not in targets and "assistant" not in targets  # no role headers
    # The trainer's warm start takes the model's tokenizer (it refused every one but "byte" before).
    batch = WarmStart(SFTConfig(data=str(data), steps=1, batch_size=2), tok, max_seq_len=2048).next_batch()
    assert batch.tokens_bt.shape[0] == 2  # and every assistant token of both is a target:
    assert batch.num_tokens == sum(ex.loss_mask) + sum(tokenize_demonstration(plain, tok).loss_mask)


def test_bad_demonstration_lines_name_the_line(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1:.*messages\[1\].content"):
        load_demonstrations(str(bad))
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}], "tools": {}}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1:.*no assistant message"):
        load_demonstrations(str(bad))
    with pytest.raises(ValueError, match="tool_calls: the byte tokenizer has no tool-call format"):
        tokenize_demonstration(_tool_demo()["messages"], TOK)


def test_a_deep_line_or_a_pipe_for_sft_data_is_refused_naming_it(tmp_path) -> None:
    """Issue 33: a line nested 100k deep was a RecursionError; a named pipe would block the start."""
    import os

    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"messages": ' + "[" * 100_000 + "\n")
    with pytest.raises(ValueError, match="deep.jsonl:1:.*nesting deeper than"):
        load_demonstrations(str(deep))
    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(ValueError, match="pipe.jsonl' is a named pipe"):
        load_demonstrations(str(tmp_path / "pipe.jsonl"))


def _qwen_tool_demos(tmp_path, long: int, short: int = 0):
    """`long` tool demonstrations in the Qwen2.5 template (713 tokens: the tool schema in the system
    prompt, the first assistant token at 573) and `short` plain ones of ~40 tokens."""
    import json

    from arlo.model.hf_tokenizer import HFTokenizer
    from tests.support.hf_checkpoints import write_tokenizer

    write_tokenizer(tmp_path / "tok", "qwen2")
    plain = {"messages": [{"role": "user", "content": "What is 12*7?"}, {"role": "assistant", "content": "84"}]}
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in [_tool_demo()] * long + [plain] * short))
    return str(data), HFTokenizer.from_dir(tmp_path / "tok")


def test_over_long_demonstrations_are_refused_not_trained_on_nothing(tmp_path) -> None:
    """Issue 32, item 5: cut from the right at model.max_seq_len, tool demonstrations kept their
    prompt and lost every assistant turn: SFT steps on 0 loss tokens, no warning."""
    from arlo.config import ConfigError, SFTConfig
    from services.trainer.warmstart import WarmStart

    data, tok = _qwen_tool_demos(tmp_path, long=4)
    with pytest.raises(ConfigError, match=r"trainer.sft.batch_size.*model.max_seq_len = 256"):
        WarmStart(SFTConfig(data=data, steps=1, batch_size=2), tok, max_seq_len=256)  # "drop" leaves none
    with pytest.raises(ConfigError, match=r"4 of 4 demonstrations are longer than model.max_seq_len = 256 "
                                          r"tokens \(the longest 713\).*trainer.sft.too_long"):
        WarmStart(SFTConfig(data=data, steps=1, batch_size=2, too_long="error"), tok, max_seq_len=256)


def test_over_long_demonstrations_truncated_from_the_left_keep_their_last_turns(tmp_path, caplog) -> None:
    from arlo.config import SFTConfig
    from services.trainer.warmstart import WarmStart

    data, tok = _qwen_tool_demos(tmp_path, long=2)
    warm = WarmStart(SFTConfig(data=data, steps=1, batch_size=2, too_long="truncate_left"), tok, max_seq_len=256)
    assert (warm.fitted.too_long, warm.fitted.dropped, warm.fitted.longest) == (2, 0, 713)
    assert "2 of 2 demonstrations are longer than model.max_seq_len = 256" in caplog.text
    assert "2 truncated from the left" in caplog.text
    batch = warm.next_batch()
    assert batch.tokens_bt.shape == (2, 256) and batch.num_tokens == 2 * 66  # every assistant token is kept
    targets = tok.decode([int(t) for t, m in zip(batch.tokens_bt[0], batch.mask_bt[0], strict=True) if m])
    assert "The answer is 99." in targets and '"expression": "12*7"' in targets


def test_over_long_demonstrations_dropped_are_counted_and_the_rest_train(tmp_path, caplog) -> None:
    from arlo.config import SFTConfig
    from services.trainer.warmstart import WarmStart

    data, tok = _qwen_tool_demos(tmp_path, long=3, short=2)
    warm = WarmStart(SFTConfig(data=data, steps=1, batch_size=2), tok, max_seq_len=256)
    assert (warm.fitted.too_long, warm.fitted.dropped, len(warm.fitted.examples)) == (3, 3, 2)
    assert "3 of 5 demonstrations are longer than model.max_seq_len = 256" in caplog.text and "left out" in caplog.text
    assert all(warm.next_batch().num_tokens > 0 for _ in range(4))


def test_an_sft_batch_with_no_loss_token_is_an_error() -> None:
    from arlo.config import ConfigError
    from services.trainer.sft import Example, sft_batch

    prompt_first = Example(token_ids=list(range(40)), loss_mask=[0] * 30 + [1] * 10)
    assert sft_batch([prompt_first], 32, 0).num_tokens == 2
    with pytest.raises(ConfigError, match=r"0 loss tokens.*raise model.max_seq_len"):
        sft_batch([prompt_first], 16, 0)
