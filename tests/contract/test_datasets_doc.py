"""docs/datasets.md's examples run: examples/datasets/run.yaml (a mixture) and tasks.yaml (the
`rollout.tasks` short form) load, their dataset entry serves
episodes from a real gateway (held-out split disjoint from train, metadata in Reset), the doc
shows the YAML verbatim, and the gateway reads no dataset outside env_gateway.dataset_roots."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from arlo.config import load_config
from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc import make_channel
from services.env_gateway.__main__ import start_env_gateway
from services.rollout.evaluation import eval_env_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "datasets"
TOKEN, TOKEN_ENV = "datasets-token", "ARLO_TEST_DATASETS_TOKEN"


@pytest.fixture
async def stub(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[env_pb2_grpc.EnvironmentStub]:
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = load_config(EXAMPLE / "run.yaml", {"auth": {"token_env": TOKEN_ENV},
                                             "env_gateway": {"server": {"port": 0, "metrics_port": -1}}})
    running = await start_env_gateway(cfg)
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            yield env_pb2_grpc.EnvironmentStub(channel)
    finally:
        await running.stop(None)


@pytest.mark.parametrize(("marker", "example"), [("run-config", "run.yaml"), ("tasks-config", "tasks.yaml")])
def test_doc_shows_the_example_config(marker: str, example: str) -> None:
    doc = (ROOT / "docs" / "datasets.md").read_text()
    block = re.search(rf"<!-- example: {marker} -->\n```yaml\n(.*?)```", doc, re.DOTALL)
    assert block and block.group(1) in (EXAMPLE / example).read_text()


@pytest.mark.parametrize("example", ["run.yaml", "tasks.yaml"])
async def test_example_dataset_episodes_through_the_gateway(stub: env_pb2_grpc.EnvironmentStub, example: str) -> None:
    cfg = load_config(EXAMPLE / example).rollout
    if example == "run.yaml":
        assert [(e.key, e.weight) for e in cfg.mixture] == [("squares", 3.0), ("arith", 1.0)]
        assert json.loads(eval_env_config(cfg, "arith")) == {"split": "eval"}  # each entry has its held-out tasks
    else:  # the short form: one dataset entry, its held-out config derived from its split
        assert [(e.name, e.key) for e in cfg.mixture] == [("dataset", "squares")]
    train_json, eval_json = cfg.mixture[0].config_json, eval_env_config(cfg, "squares")
    rows = {json.loads(line)["id"]: json.loads(line) for line in (EXAMPLE / "squares.jsonl").read_text().splitlines()}
    seen: dict[str, set[str]] = {"train": set(), "eval": set()}
    for split, config_json in (("train", train_json), ("eval", eval_json)):
        for seed in range(len(rows)):
            reset = await stub.Reset(env_pb2.ResetRequest(env_name="dataset", config_json=config_json, seed=seed),
                                     timeout=10)
            row = rows[reset.task_id.removeprefix("dataset-")]
            assert reset.observation[0].content == row["question"]
            assert json.loads(reset.metadata_json) == {"difficulty": row["difficulty"]}
            step = await stub.Step(env_pb2.StepRequest(session_id=reset.session_id,
                                                       action=f"It is {row['answer']}."), timeout=10)
            assert step.done and step.answer == step.reference == row["answer"]
            seen[split].add(row["id"])
    assert seen["train"].isdisjoint(seen["eval"]) and seen["eval"]
    assert seen["train"] | seen["eval"] == set(rows)


async def test_a_path_outside_the_dataset_roots_is_invalid_argument(stub: env_pb2_grpc.EnvironmentStub) -> None:
    # The default root is the gateway's working directory (here the repository root); symlink
    # escapes are tests/unit/test_env_dataset.py's.
    for path in ("/etc/passwd", "examples/../../etc/passwd"):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Reset(env_pb2.ResetRequest(env_name="dataset", config_json=json.dumps({"path": path})),
                             timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert path in refused.value.details() and "env_gateway.dataset_roots" in refused.value.details()
