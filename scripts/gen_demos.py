"""Writes arlo/data/arith_tool_sft.jsonl: the demo's SFT demonstrations, made by the task itself.

The environment's own demonstrator (services/env_gateway/envs/arith.py `demonstration`) plays
the demo config's task on training-split seeds; it calls the tool only TOOL_PROB of the time,
so the warm-started policy is imperfect and RL has something to add. Deterministic; `--check`
fails when the committed file is stale (a test runs it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from arlo.config import load_config  # noqa: E402
from services.env_gateway.envs.arith import demonstration  # noqa: E402

DEMO_CONFIG = ROOT / "arlo" / "data" / "demo.yaml"
OUT = ROOT / "arlo" / "data" / "arith_tool_sft.jsonl"
COUNT = 2000
TOOL_PROB = 0.3


def render() -> str:
    cfg = load_config(DEMO_CONFIG)
    env_config = {**json.loads(cfg.rollout.env_config_json), "split": "train"}
    rng = random.Random(0)
    lines = []
    for _ in range(COUNT):
        messages = demonstration(rng.randrange(2**31), env_config, tool_prob=TOOL_PROB, rng=rng)
        lines.append(json.dumps({"messages": [{"role": r, "content": c} for r, c in messages]}))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed file is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/gen_demos.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {COUNT} demonstrations to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
