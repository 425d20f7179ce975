"""`arlo export` from a trainer's Orbax checkpoint: named, or with no trainer answering the newest
under trainer.checkpoint_dir; transformers loads the result with the policy's logits (1e-4)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.app.cli import main
from arlo.app.export import ExportError, export_run
from arlo.config import TrainerConfig, load_config
from services.trainer.checkpoint import Checkpointer, CheckpointMeta
from services.trainer.learner import Learner

_SKIP = "needs the hf extra: pip install -e '.[hf]'"
torch = pytest.importorskip("torch", reason=_SKIP)
transformers = pytest.importorskip("transformers", reason=_SKIP)


def test_a_checkpoint_exports_with_the_policys_logits(tmp_path: Path, redis_url: str, run_id: str) -> None:
    cfg = load_config(overrides={"run_id": run_id, "redis": {"url": redis_url},
                                 "model": {"name": "tiny", "param_dtype": "bfloat16"},
                                 "trainer": {"checkpoint_dir": str(tmp_path / "ckpt")}})
    learner = Learner(cfg.model.source(), cfg=TrainerConfig())
    with pytest.raises(ExportError, match="holds no checkpoint"):
        export_run(cfg, tmp_path / "none", token=None)  # no trainer published, nothing on disk
    ckpt = Checkpointer(cfg.trainer.checkpoint_dir)
    ckpt.start_save(learner.state, learner.opt_state, CheckpointMeta(version=3, step=3, params_sha256=""))
    ckpt.wait()
    ckpt.close()
    # No trainer answers for this run: the newest checkpoint under trainer.checkpoint_dir.
    result = export_run(cfg, tmp_path / "newest", token=None)
    assert result.num_bytes < 0.6 * learner.model_cfg.num_params() * 4  # bfloat16 on disk
    config = tmp_path / "run.yaml"
    config.write_text(f"run_id: {run_id}\nmodel: {{name: tiny, param_dtype: bfloat16}}\n")
    assert main(["export", "-c", str(config), "--out", str(tmp_path / "named"),
                 "--checkpoint", str(tmp_path / "ckpt" / "00000003")]) == 0
    tokens = np.random.default_rng(0).integers(0, 263, (2, 13))
    ours = np.asarray(nnx.merge(learner.graphdef, learner.serving_state())(jnp.asarray(tokens)))
    for out in ("newest", "named"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = hf(torch.tensor(tokens)).logits.numpy()
        assert np.abs(ours - theirs).max() < 1e-4
