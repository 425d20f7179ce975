"""`arlo plan` (arlo/app/plan.py and the services' memory_plan modules) against what runs measure.

The measured figure is XLA's own peak for the program the service really compiles and runs:
the learner's `_rl_step` lowered with the learner's arrays after a real step, and the engine's
decode and prefill programs with its real weights and cache (arguments + outputs - aliased +
temporaries, `compiled.memory_analysis()`). Process RSS is no measure on XLA:CPU: its
allocations come and go through malloc arenas that keep freed pages, and the JAX runtime's own
hundreds of MB dwarf a tiny step. The plan builds the same programs from ShapeDtypeStructs
alone; these tests hold the two within 15% (the issue's bar), on one device and on a faked mesh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from arlo.data import resource_path

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15


def arlo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "arlo.app.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


def measured_peaks(config: Path | None, devices: int, timeout: float = 280) -> dict[str, int]:
    """The real trainer step's and engine programs' XLA peaks for `config`, after a real step
    (a subprocess: the faked devices must be set before JAX starts)."""
    code = textwrap.dedent(f"""
        import json, jax, numpy as np
        from arlo.config import load_config
        from arlo.distributed import make_mesh
        from arlo.memory_plan import compiled_figures
        from services.inference.engine import Engine
        from services.trainer.batching import Batch
        from services.trainer.memory_plan import trainer_plan
        from services.inference.memory_plan import engine_plan
        from services.trainer.learner import Learner
        cfg = load_config({str(config) if config else None!r})
        tc, devices = cfg.trainer, {devices}
        mesh = make_mesh(tc.mesh, path="trainer.mesh") if devices > 1 else None
        learner = Learner(cfg.model_source(), cfg=tc, mesh=mesh, sampling=cfg.rollout.sampling)
        plan = trainer_plan(cfg, "", devices)
        groups, size, length = tc.groups_per_step, cfg.rollout.group_size, plan["length"]
        rows = groups * size
        rng = np.random.default_rng(0)
        batch = Batch(tokens_bt=rng.integers(0, 200, (rows, length)).astype(np.int32),
                      behaviour_logprobs_bt=np.full((rows, length), -2.0, np.float32),
                      mask_bt=np.ones((rows, length), np.float32), rewards_gk=rng.random((groups, size)).astype(np.float32),
                      token_rewards_bt=np.zeros((rows, length), np.float32), trajectory_ids=(), num_tokens=rows * length)
        assert np.isfinite(learner.step(batch).loss)  # it runs, on the arrays measured next
        rewards_gk, device_rows = learner.device_inputs(batch, mini_batches=1)
        key = learner._replicated(jax.random.key_data(jax.random.key(0)))
        compiled = learner._rl_step.lower(learner.state, learner.opt_state, learner.ref_state, device_rows,
                                          learner._replicated(rewards_gk), key, 1, **learner.step_kwargs).compile()
        engine = Engine(cfg.model_source(), config=cfg.inference, mesh=None)
        eplan = engine_plan(cfg, "", 1)
        from services.inference.device_programs import decode_jit
        from services.inference.runner import _decode_batch
        r = engine.runner
        decode = decode_jit.lower(r.graphdef, r.decode_steps, eplan["decode"]["window"], r.cache_sharding,
                                   engine.state, r.cache, _decode_batch([], eplan["decode"]["rows"], r.table_len)).compile()
        print(json.dumps({{"trainer_measured": compiled_figures(compiled)["peak_bytes"],
                          "trainer_planned": plan["step_peak_bytes"],
                          "decode_measured": compiled_figures(decode)["peak_bytes"],
                          "decode_planned": eplan["decode"]["peak_bytes"]}}))
    """)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def within(planned: int, measured: int) -> bool:
    return abs(planned - measured) <= TOLERANCE * measured


def test_plan_of_the_demo_writes_positive_figures_and_a_verdict(tmp_path: Path) -> None:
    out = arlo("plan", "--json", str(tmp_path / "plan.json"), "--device-gb", "16")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "activations / temporaries" in out.stdout and "verdict: fits" in out.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["config"] == str(resource_path("demo.yaml")) and plan["fits"] is True
    for key in ("parameters_bytes", "optimizer_bytes", "temporaries_bytes", "step_peak_bytes", "total_bytes"):
        assert plan["trainer"][key] > 0, key
    for key in ("parameters_bytes", "kv_cache_bytes", "temporaries_bytes", "total_bytes"):
        assert plan["inference"][key] > 0, key
    # The demo: 8 groups x 8 samples of the 64-token bucket (demo.yaml).
    assert (plan["trainer"]["rows"], plan["trainer"]["length"]) == (64, 64)
    # AdamW holds two moments per parameter.
    assert plan["trainer"]["optimizer_bytes"] >= 2 * plan["trainer"]["parameters_bytes"]


def test_plan_of_the_demo_matches_its_measured_step_within_15_percent() -> None:
    got = measured_peaks(resource_path("demo.yaml"), 1)
    assert within(got["trainer_planned"], got["trainer_measured"]), got
    assert within(got["decode_planned"], got["decode_measured"]), got


@pytest.mark.slow  # ~1 min alone, minutes on a loaded 2-core host: three compiles of a 25M model's step
@pytest.mark.timeout(660)
def test_plan_of_a_bench_step_on_a_mesh_matches_its_measured_step(tmp_path: Path) -> None:
    """bench/train_step.py's default step (small preset, 4 x 4 rows of 256) with remat and a
    logprob chunk, on a faked 4-device fsdp x tensor mesh."""
    config = tmp_path / "run.yaml"
    config.write_text("model: {name: small}\n"
                      "trainer: {groups_per_step: 4, remat: full, logprob_chunk: 64, mesh: {axis_sizes: [1, 2, 2]}}\n"
                      "rollout: {group_size: 4, max_episode_tokens: 256}\n"
                      "inference: {max_batch: 16, max_n: 4, max_tokens: 64, max_prompt_tokens: 64}\n")
    got = measured_peaks(config, 4, timeout=600)
    assert within(got["trainer_planned"], got["trainer_measured"]), got
    assert within(got["decode_planned"], got["decode_measured"]), got


@pytest.mark.timeout(600)  # two compiles in subprocesses, one after the other
def test_plan_of_a_lora_run_matches_its_measured_step(tmp_path: Path) -> None:
    """With trainer.lora the step trains the adapters beside a frozen base: the plan counts
    adapter-sized parameters and AdamW, the base apart, and still equals the real step's peak."""
    config = tmp_path / "run.yaml"
    text = resource_path("demo.yaml").read_text().replace("trainer:\n", "trainer:\n  lora: {rank: 4}\n", 1)
    config.write_text(text)
    got = measured_peaks(config, 1)
    assert within(got["trainer_planned"], got["trainer_measured"]), got
    plan = json.loads(subprocess.run(
        [sys.executable, "-m", "services.trainer.memory_plan", "--config", str(config)], cwd=ROOT,
        capture_output=True, text=True, timeout=280, check=True).stdout.strip().splitlines()[-1])
    assert plan["lora_rank"] == 4 and 0 < plan["parameters_bytes"] < plan["frozen_base_bytes"]
    assert plan["optimizer_bytes"] < plan["frozen_base_bytes"]  # AdamW over the adapters alone


def test_plan_takes_a_config_json_alone_and_a_faked_mesh(tmp_path: Path) -> None:
    hf = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 4096, "rope_theta": 1e6, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    out = arlo("plan", "--hf-config", str(tmp_path / "config.json"), "--devices", "2", "--device-gb", "0.001",
               "--json", str(tmp_path / "plan.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["trainer"]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1} and plan["inference"]["devices"] == 2
    # A 1 MiB device holds none of it.
    assert plan["fits"] is False and "does NOT fit" in out.stdout


@pytest.mark.parametrize(("args", "says"), [
    (["--devices", "0"], "--devices: must be >= 1"),
    (["--hf-config", "/nonexistent/config.json"], "no such file"),
])
def test_bad_arguments_are_refused_before_compiling(args: list[str], says: str) -> None:
    out = arlo("plan", *args, timeout=60)
    assert out.returncode == 2 and says in out.stdout + out.stderr


def test_a_bad_config_names_its_field(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("trainer: {groups_per_step: 0}\n")
    out = arlo("plan", "-c", str(config), timeout=60)
    assert out.returncode == 2 and "trainer.groups_per_step" in out.stdout + out.stderr


def test_a_bad_model_shape_in_the_config_json_is_an_error_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    out = arlo("plan", "--hf-config", str(tmp_path / "config.json"))
    assert out.returncode == 1 and "model_type" in out.stdout + out.stderr
