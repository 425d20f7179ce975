"""Learning in a real chat format (issue 32's last bar): examples/own_format, as a user runs it.

`examples/own_format/make_checkpoint.py` writes a Qwen2-architecture checkpoint with transformers
(random init, 0.36M parameters, a BPE tokenizer trained by `tokenizers`, the Qwen2.5 tool template)
and SFT demonstrations in its own format (the calc schema in the prompt, Hermes tool calls,
`role: tool` results); `arlo demo -c examples/own_format/demo.yaml` warm-starts on them and runs RL
on the calculator task through every service as subprocesses on a real Redis. The bar: held-out
sampled reward >= 0.8 at the end, in <= 10 minutes on 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_cli import arlo

pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")
pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_format"
FULL = os.environ.get("ARLO_OWN_FORMAT_FULL") == "1"
"""The whole learning run (400 SFT + 80 RL steps, 5 evaluations: ~8.5 minutes at load ~2): on request,
as CI's 90 minutes are spent elsewhere. CI runs the same pipeline short (a few SFT and RL steps, no
evaluation): the format end to end."""
RL_STEPS = 80 if FULL else 2  # the demo's RL budget (arlo demo's default --steps)
SFT_STEPS_SHORT = 8
BAR = 0.8
WALL_BAR_S = 600
DEMO_TIMEOUT_S = 1500
IDLE_LOAD = 2.5
"""Below this 1-minute load average (2 cores) the 10-minute wall bar is asserted too."""


def parameters(model: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "np") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


@pytest.mark.slow  # short: ~4 min; ARLO_OWN_FORMAT_FULL=1: the learning run (README)
@pytest.mark.timeout(DEMO_TIMEOUT_S + 300)  # above the checkpoint's and the demo's own limits
def test_own_format_demo_learns_the_tool_in_qwen25_format(tmp_path: Path, redis_url: str, run_id: str) -> None:
    model = tmp_path / "model"
    made = subprocess.run([sys.executable, str(EXAMPLE / "make_checkpoint.py"), "--out", str(model)],
                          capture_output=True, text=True, timeout=240)
    assert made.returncode == 0, made.stderr[-4000:]
    hf_config = json.loads((model / "config.json").read_text())
    assert hf_config["architectures"] == ["Qwen2ForCausalLM"] and hf_config["model_type"] == "qwen2"
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    assert "<tool_call>" in tokenizer_config["chat_template"] and "<tool_response>" in tokenizer_config["chat_template"]
    assert parameters(model) <= 10_000_000
    first = json.loads((model / "sft.jsonl").read_text().splitlines()[1])
    assert first["tools"][0]["function"]["name"] == "calc"
    assert {m["role"] for m in first["messages"]} >= {"user", "assistant", "tool"}

    data = yaml.safe_load((EXAMPLE / "demo.yaml").read_text())
    data.update(run_id=run_id, redis={"url": redis_url})
    data["model"]["path"] = str(model)
    data["trainer"]["sft"]["data"] = str(model / "sft.jsonl")
    if not FULL:
        data["trainer"]["sft"]["steps"] = SFT_STEPS_SHORT
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "demo.json"
    evals = [] if FULL else ["--no-eval"]
    result = arlo("demo", "-c", str(config), "--steps", str(RL_STEPS), "--json", str(out), *evals,
                  home=tmp_path / "home", timeout=DEMO_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    if not FULL:  # the format end to end: SFT on its own-format demonstrations, RL steps through every service
        assert report["sft_steps"] == SFT_STEPS_SHORT and report["steps"] >= SFT_STEPS_SHORT + RL_STEPS, report
        assert len(report["rewards"]) >= RL_STEPS, report
        return
    curve = {tag: (round(e["sampled_reward"], 3), round(e["greedy_reward"], 3)) for tag, e in report["evals"].items()
             if "sampled_reward" in e}
    print({k: report[k] for k in ("reward_start", "reward_after_sft", "reward_end", "wall_s")}, curve)
    assert report["sft_steps"] == data["trainer"]["sft"]["steps"] and report["steps"] == report["sft_steps"] + RL_STEPS
    assert report["evals"]["end"]["served_version"] == report["pointer_version"] >= RL_STEPS + 1
    assert report["reward_start"] <= 0.05, curve  # from random init: nothing right at the start

    # The bar: SFT in the model's own format, then RL, to held-out sampled reward >= 0.8 within
    # 10 minutes on 2 cores. The wall time is held to it only on an idle machine: under others'
    # load the same steps take longer, and the learning (counted in steps) is what is tested.
    assert report["reward_end"] >= BAR, f"held-out sampled reward {report['reward_end']:.3f} (>= {BAR}): {curve}"
    load = os.getloadavg()[0]
    if load < IDLE_LOAD:
        assert report["wall_s"] <= WALL_BAR_S, (report["wall_s"], load)
