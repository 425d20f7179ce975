"""`arlo export --version N` reaches every version (issue 33: 0 meant "the newest", so the initial
weights could not be exported, and before the first publish it said no trainer answered). Version
0 is the model source itself: exported from a transformers-written checkpoint, transformers loads
it with the checkpoint's own logits (1e-4); with nothing held, the error says what is."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from arlo.app.cli import main
from arlo.app.export import ExportError, export_run
from arlo.config import load_config
from tests.support.hf_checkpoints import write_checkpoint

_SKIP = "needs the hf extra: pip install -e '.[hf]'"
torch = pytest.importorskip("torch", reason=_SKIP)
transformers = pytest.importorskip("transformers", reason=_SKIP)


def logits(model_dir: Path, tokens: np.ndarray) -> np.ndarray:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.numpy()


def test_version_0_exports_the_checkpoint_it_was_loaded_from(tmp_path: Path, redis_url: str, run_id: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARLO_HOME", str(tmp_path / "home"))
    model_dir = write_checkpoint(tmp_path / "qwen2", "qwen2")
    config = tmp_path / "run.yaml"
    config.write_text(f"run_id: {run_id}\nredis: {{url: '{redis_url}'}}\nmodel: {{path: '{model_dir}'}}\n")
    # No trainer, no pointer: version 0 needs neither.
    assert main(["export", "-c", str(config), "--out", str(tmp_path / "v0"), "--version", "0"]) == 0
    tokens = np.random.default_rng(0).integers(0, 300, (2, 17))
    assert np.abs(logits(tmp_path / "v0", tokens) - logits(model_dir, tokens)).max() < 1e-4


def test_with_nothing_held_the_error_says_so_and_names_version_0(tmp_path: Path, redis_url: str, run_id: str) -> None:
    cfg = load_config(overrides={"run_id": run_id, "redis": {"url": redis_url}})
    with pytest.raises(ExportError, match=r"no version published yet .* exports with --version 0"):
        export_run(cfg, tmp_path / "newest", token=None)
    with_dir = load_config(overrides={"run_id": run_id, "redis": {"url": redis_url},
                                      "trainer": {"checkpoint_dir": str(tmp_path / "ckpt")}})
    with pytest.raises(ExportError, match=r"no version published yet.*holds no checkpoint of version 5"):
        export_run(with_dir, tmp_path / "v5", token=None, version=5)
    assert main(["export", "--out", str(tmp_path / "neg"), "--version", "-1"]) == 2
