"""Peak host memory of loading a checkpoint through `ModelSource.initial_state`.

`python -m bench.load_memory [--hidden 1024 --layers 4] [--json PATH]` writes a Qwen2
checkpoint with transformers (float32 and bfloat16 on disk), then loads it in a fresh
subprocess per case (stored as float32, and as bfloat16) and reports the peak resident set
(VmHWM) above the process's resident set just before the load, against the loaded state's
bytes. The bar (docs/architecture.md): at most ~1.5x the model's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import check_json_arg, int_at_least, print_table, run_main, write_json


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(path: str, param_dtype: str) -> dict[str, float]:
    """Runs in the subprocess: one load, its figures."""
    import jax
    import numpy as np

    from arlo.model.source import resolve_model

    source = resolve_model(name="", path=path, tokenizer="", seed=0, param_dtype=param_dtype)
    source.abstract_state()  # trace the abstract model before the baseline
    before = _status("VmRSS")
    state = source.initial_state(jax.devices()[0])
    jax.block_until_ready(state)
    peak = _status("VmHWM")
    model_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
    return {"model_mb": model_bytes / 1e6, "peak_above_baseline_mb": (peak - before) / 1e6,
            "ratio": (peak - before) / model_bytes}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int_at_least(1), default=1024)
    parser.add_argument("--layers", type=int_at_least(1), default=4)
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.child:
        check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    from tests.support.hf_checkpoints import write_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for disk in ("float32", "bfloat16"):
            path = write_checkpoint(Path(tmp) / disk, "qwen2", layers=args.layers, hidden=args.hidden, dtype=disk)
            disk_mb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6
            for stored in ("float32", "bfloat16"):
                env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
                out = subprocess.run([sys.executable, "-m", "bench.load_memory", "--child", str(path), stored],
                                     env=env, capture_output=True, text=True, check=True).stdout
                rows.append({"on_disk": disk, "disk_mb": round(disk_mb, 1), "param_dtype": stored,
                             **{k: round(v, 2) for k, v in json.loads(out.splitlines()[-1]).items()}})
    columns = list(rows[0])
    print_table("peak RSS of loading a checkpoint (ModelSource.initial_state)", columns,
                [[r[c] for c in columns] for r in rows])
    write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    run_main(main)
