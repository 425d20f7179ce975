"""Writes arlo/data/arith_sft.jsonl: demonstrations for the built-in arith task (SFT warm start).

Each line is {"messages": [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]},
the exact shape of the env's first observation and a correct first answer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "arlo" / "data" / "arith_sft.jsonl"


def main(n: int = 400, seed: int = 0) -> None:
    rng = random.Random(seed)
    with OUT.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}="},
                                             {"role": "assistant", "content": str(a + b)}]}) + "\n")


if __name__ == "__main__":
    main()
