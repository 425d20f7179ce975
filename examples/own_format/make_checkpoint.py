"""Writes the checkpoint that examples/own_format/demo.yaml learns in, and its SFT demonstrations.

A Qwen2-architecture model written by `transformers` (Qwen2Config, safetensors, random init, about
0.4M parameters by default), a byte-level BPE tokenizer trained here by `tokenizers` on the
calculator task's conversations as the Qwen2.5 chat template renders them (tool schema in the
system prompt, Hermes `<tool_call>` JSON, `<tool_response>` results), and that template in
tokenizer_config.json. Beside it, `sft.jsonl`: worked episodes of the demo's task (the arith
environment's own imperfect demonstrator, services/env_gateway/envs/arith.py) in the OpenAI
message format: `tools` (the environment's calc schema), an assistant `tool_calls` entry, the
`role: tool` result, the answer. The trainer renders them with the checkpoint's template, so SFT
sees exactly the text RL's episodes are made of.

    python examples/own_format/make_checkpoint.py              # -> examples/own_format/model
    arlo demo -c examples/own_format/demo.yaml --json own.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout: the arith task's demonstrator and schema

from arlo.model.chat_template import ChatTemplate  # noqa: E402
from arlo.model.family_templates import QWEN25  # noqa: E402
from arlo.model.tiny_checkpoints import write_checkpoint  # noqa: E402
from services.env_gateway.envs.arith import TOOL_PREFIX, TOOLS, ArithConfig, demonstration, draw_task  # noqa: E402
from services.env_gateway.tool_schema import tools_json  # noqa: E402

# The demo's task (demo.yaml's rollout.env_config_json): a*b= with operands up to 30, a calculator.
ENV_CONFIG = {"op": "*", "max_operand": 30, "tool": True, "max_turns": 2}
TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": ""}


def episode(messages: list[tuple[str, str]], tools: list[dict]) -> dict:
    """An arith demonstration ((role, text) pairs; a tool call written `calc a*b`) in the OpenAI
    message format: the call as a structured tool_calls entry, its result a named tool message."""
    out = []
    for role, text in messages:
        if role == "assistant" and text.startswith(TOOL_PREFIX + " "):
            call = {"type": "function", "function": {"name": TOOL_PREFIX,
                                                     "arguments": {"expression": text[len(TOOL_PREFIX) + 1:]}}}
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif role == "tool":
            out.append({"role": "tool", "name": TOOL_PREFIX, "content": text})
        else:
            out.append({"role": role, "content": text})
    return {"tools": tools, "messages": out}


def demonstrations(count: int, tool_prob: float, seed: int) -> list[dict]:
    tools = json.loads(tools_json(TOOLS))
    rng = random.Random(seed)
    config = {**ENV_CONFIG, "split": "train"}
    return [episode(demonstration(rng.randrange(2**31), config, tool_prob=tool_prob, rng=rng), tools)
            for _ in range(count)]


def corpus(demos: list[dict]) -> list[str]:
    """The tokenizer's training text: demonstrations rendered by the Qwen2.5 template, both
    branches (tool call or answer) of every one, and the held-out split's questions too (their
    digits are single tokens under Qwen's split anyway, so nothing about them is learned here)."""
    template = ChatTemplate(QWEN25)
    texts = [template.render(d["messages"], add_generation_prompt=False, tokens=TOKENS, tools=d["tools"])
             for d in demos]
    eval_cfg = ArithConfig(**{**ENV_CONFIG, "split": "eval"})
    texts += [f"{a}*{b}={a * b}" for a, b in (draw_task(s, eval_cfg) for s in range(200))]
    return texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "model")
    parser.add_argument("--hidden", type=int, default=96)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--intermediate", type=int, default=256)
    # Qwen2.5's 1e6 leaves a 24-wide head few rotations that tell nearby positions apart, and the
    # tool call must copy the operands from the question ~20 tokens back (README.md).
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size (at most)")
    parser.add_argument("--demos", type=int, default=2000, help="SFT demonstrations to write")
    parser.add_argument("--tool-prob", type=float, default=0.85,
                        help="share of demonstrations that call the calculator (the rest answer an estimate)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    demos = demonstrations(args.demos, args.tool_prob, args.seed)
    write_checkpoint(args.out, "qwen2", layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                     heads=4, kv_heads=2, max_positions=512, init_range=0.02, vocab_size=args.vocab,
                     corpus=corpus(demos), seed=args.seed, config={"rope_theta": args.rope_theta})
    (args.out / "sft.jsonl").write_text("".join(json.dumps(d) + "\n" for d in demos))
    config = json.loads((args.out / "config.json").read_text())
    params = parameters(args.out)
    print(f"wrote {args.out}: Qwen2 {config['num_hidden_layers']} layers x {config['hidden_size']}, "
          f"vocab {config['vocab_size']}, {params / 1e6:.2f}M parameters; {len(demos)} demonstrations in sft.jsonl")
    return 0


def parameters(path: Path) -> int:
    """The checkpoint's parameter count, read from its safetensors header."""
    import math

    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "np") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


if __name__ == "__main__":
    sys.exit(main())
