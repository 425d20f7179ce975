"""Bring your own model, end to end: a tiny checkpoint written by `transformers` (its real config
class, safetensors, a BPE tokenizer trained by `tokenizers`, the family's real chat template) as
`model.path`; `arlo demo` runs SFT on tool-call demonstrations, then RL steps of the tool-using
arith environment (its calculator schema in the prompt, Hermes tool calls parsed by the gateway)
through every service as subprocesses on a real Redis, and exports the policy; transformers loads the export with logits equal to arlo's within 1e-4.
Gemma 3 (sliding-window and full layers, QK-norm, its template without tools) goes the same way
on plain arithmetic. Config errors for a bad model section come at load, naming the field and the file."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from arlo.config import ConfigError, load_config
from tests.e2e.test_cli import arlo
from tests.support.hf_checkpoints import write_checkpoint

_SKIP = "needs the hf extra: pip install -e '.[hf]'"
torch = pytest.importorskip("torch", reason=_SKIP)
transformers = pytest.importorskip("transformers", reason=_SKIP)

DEMO_TIMEOUT_S = 420


CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
                                          "parameters": {"type": "object", "required": ["expression"],
                                                         "properties": {"expression": {"type": "string"}}}}}


def tool_demonstrations(path: Path) -> Path:
    """SFT lines in the OpenAI message format: an assistant tool call, the tool's named result, the answer."""
    lines = []
    for a, b in ((2, 3), (4, 5), (1, 7), (6, 2)):
        call = {"type": "function", "function": {"name": "calc", "arguments": {"expression": f"{a}+{b}"}}}
        lines.append({"tools": [CALC], "messages": [
            {"role": "user", "content": f"{a}+{b}="},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calc", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b)}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def plain_demonstrations(path: Path) -> Path:
    """SFT lines without tools, for templates that have none (Gemma 2/3): a question, its answer."""
    lines = [{"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
             for a, b in ((2, 3), (4, 5), (1, 7), (6, 2))]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def own_model_config(path: Path, run_id: str, redis_url: str, model_dir: Path, *, tools: bool = True,
                     algorithm: dict | None = None, context: int = 512, **model) -> Path:
    demos = tool_demonstrations if tools else plain_demonstrations
    env_config = {"op": "+", "max_operand": 9, "tool": tools, "max_turns": 2 if tools else 1}
    cfg = {
        "run_id": run_id, "redis": {"url": redis_url},
        "model": {"path": str(model_dir), "max_seq_len": context, **model},
        "inference": {"max_n": 4, "max_tokens": 8, "max_prompt_tokens": context - 16, "max_batch": 16,
                      "decode_steps": 4},
        # The entropy bonus moves the weights even when every reward of a group is equal (a random
        # model rarely adds right), so the export is provably the trained policy.
        "trainer": {"groups_per_step": 2, "learning_rate": 0.001, "algorithm": {"entropy_coef": 0.01,
                                                                               "reference": "after_sft",
                                                                               **(algorithm or {})},
                    "sft": {"data": str(demos(path.parent / "demos.jsonl")), "steps": 2,
                            "batch_size": 4, "warmup_steps": 0}},
        "rollout": {"env_name": "arith", "env_config_json": json.dumps(env_config),
                    "group_size": 4, "max_turns": env_config["max_turns"], "max_episode_tokens": context - 12, "concurrent_groups": 2,
                    "sampling": {"temperature": 1.0, "max_tokens": 8}, "rpc_timeout_s": 120.0},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.e2e
@pytest.mark.slow  # ~3.5 min under load; the default tier covers it part by part (see the docstring)
@pytest.mark.timeout(DEMO_TIMEOUT_S + 120)
def test_a_checkpoint_trains_through_every_service_and_exports(tmp_path: Path, redis_url: str, run_id: str) -> None:
    """One run (each costs five services' start and JAX compiles): Qwen2 with two eos ids, bfloat16
    stored weights (published, served and exported in bf16, float32 master in the trainer).
    Llama 3 and Qwen3 load, serve and export through the same code (tests/unit/test_model_source.py,
    test_hf_export.py).

    In the slow tier (CI runs it). The default tier covers each part: a checkpoint resolving to
    version 0 with its tokenizer (tests/unit/test_model_source.py), its template's tool-call
    demonstrations masked for SFT (tests/unit/test_trainer_sft.py), a real inference service serving
    a checkpoint with its family's template and tool calls (tests/contract/test_openai_tool_formats.py),
    export with transformers' logits, bf16 included (tests/unit/test_hf_export.py,
    test_app_export_versions.py), and every service training through the CLI (tests/e2e/test_cli.py)."""
    model_dir = write_checkpoint(tmp_path / "qwen2", "qwen2")
    config = own_model_config(tmp_path / "run.yaml", run_id, redis_url, model_dir, param_dtype="bfloat16")
    _demo_exports_trained_policy(tmp_path, config, model_dir, "bfloat16")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT_S + 120)
def test_a_gemma3_checkpoint_trains_through_every_service_and_exports(tmp_path: Path, redis_url: str,
                                                                     run_id: str) -> None:
    """Gemma 3 (a sliding layer with an 8-token window and a full one, prompts past the window)
    through SFT, RL steps and export, float32 end to end; its template has no tools, so the
    arith env asks plainly. In the slow tier (CI runs it), as the Qwen2 run above is."""
    model_dir = write_checkpoint(tmp_path / "gemma3", "gemma3")
    config = own_model_config(tmp_path / "run.yaml", run_id, redis_url, model_dir, tools=False)
    _demo_exports_trained_policy(tmp_path, config, model_dir, "float32")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT_S + 120)
def test_a_qwen3_moe_checkpoint_trains_with_routing_replay_through_every_service_and_exports(
        tmp_path: Path, redis_url: str, run_id: str) -> None:
    """Qwen3-MoE (8 experts, top 2) served in bf16, with routing replay: the engine records each
    sampled token's experts, the trajectory carries them, the trainer's forward uses them, so no
    recorded token is routed otherwise in the trainer (`routing_mismatch` 0 in every RL step
    record); SFT, RL steps and export as for the dense families. In the slow tier (CI runs it).
    tests/unit/test_routing_replay.py measures the same in process, with and without replay."""
    model_dir = write_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    # Plain turns and a 192-token context: XLA:CPU compiles each MoE program in ~45 s under load
    # (JAX's ragged_dot fallback), and a 512-token tools run needs 134 of them.
    config = own_model_config(tmp_path / "run.yaml", run_id, redis_url, model_dir, param_dtype="bfloat16",
                              algorithm={"routing_replay": True}, tools=False, context=192)
    _demo_exports_trained_policy(tmp_path, config, model_dir, "bfloat16")
    rl = [r for path in (tmp_path / "home").rglob("metrics.jsonl") for r in map(json.loads, path.read_text().splitlines())
          if r.get("phase") == "rl" and "routing_mismatch" in r]
    assert len(rl) >= 2 and all(r["routing_mismatch"] == 0.0 for r in rl), rl


def _demo_exports_trained_policy(tmp_path: Path, config: Path, model_dir: Path, dtype: str) -> None:
    out, report = tmp_path / "exported", tmp_path / "report.json"
    result = arlo("demo", "-c", str(config), "--steps", "2", "--no-eval", "--json", str(report),
                  "--export", str(out), home=tmp_path / "home", timeout=DEMO_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    summary = json.loads(report.read_text())
    assert summary["sft_steps"] == 2 and summary["steps"] >= 2 + 2 and len(summary["rewards"]) >= 2, summary
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["architectures"] == json.loads((model_dir / "config.json").read_text())["architectures"]
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert (out / "generation_config.json").is_file() and hf_cfg["dtype"] == dtype

    from arlo.model.hf import load_hf_model

    ours_model = load_hf_model(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, hf_cfg["vocab_size"], (2, 17))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(ours_model(jnp.asarray(tokens)))
    assert np.abs(ours - theirs).max() < 1e-4
    # The export is the trained policy, not the checkpoint it started from.
    start = np.asarray(load_hf_model(model_dir)(jnp.asarray(tokens)))
    assert np.abs(ours - start).max() > 0


def test_model_errors_come_at_config_load_naming_field_and_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.name: unknown model config 'qwen2\.5-0\.5b'"):
        load_config(overrides={"model": {"name": "qwen2.5-0.5b"}})
    model_dir = write_checkpoint(tmp_path / "qwen2", "qwen2")
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"model\.path: .*tokenizer\.json: missing"):
        load_config(overrides={"model": {"path": str(model_dir)}})
    other = write_checkpoint(tmp_path / "llama", "llama3")
    hf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**hf, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"model\.path: .*config\.json architectures: 'MistralForCausalLM'"):
        load_config(overrides={"model": {"path": str(other)}})
    with pytest.raises(ConfigError, match=r"model\.path: .*not a directory"):
        load_config(overrides={"model": {"path": str(tmp_path / "nowhere")}})
