"""The dataset environment on real files: JSONL, Parquet written by pyarrow, and a directory
written by `datasets.save_to_disk`; field mapping, held-out split, epoch order, tools, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from services.env_gateway.envs.dataset import DatasetEnv
from services.env_gateway.envs.dataset_source import DatasetRoots, DatasetStore

ROWS = [{"id": f"t{i}", "question": f"What is {i} + {i}?", "solution": str(2 * i), "tests": [f"assert f({i})"],
         "level": i % 3} for i in range(40)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pa = pytest.importorskip("pyarrow", reason="the `data` extra (pyarrow) is not installed")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_hf(path: Path, rows: list[dict[str, Any]]) -> Path:
    datasets = pytest.importorskip("datasets", reason="the `data` extra (datasets) is not installed")
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


WRITERS = {"jsonl": (write_jsonl, "tasks.jsonl"), "parquet": (write_parquet, "tasks.parquet"),
           "hf": (write_hf, "tasks_hf")}


def config(path: Path, **extra: Any) -> dict[str, Any]:
    return {"path": str(path), "prompt_field": "question", "answer_field": "solution", "id_field": "id",
            "metadata_fields": "tests, level", **extra}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_every_format_maps_fields_and_gives_each_task_once_per_epoch(tmp_path: Path, fmt: str) -> None:
    writer, name = WRITERS[fmt]
    path = writer(tmp_path / name, ROWS)
    env, cfg = DatasetEnv(DatasetStore(DatasetRoots([tmp_path]))), config(path, system_prompt="Be brief.")
    epochs = []
    for epoch in range(2):
        ids = []
        for seed in range(epoch * len(ROWS), (epoch + 1) * len(ROWS)):
            reset = env.reset(seed, cfg)
            row = ROWS[int(reset.task_id.removeprefix("dataset-t"))]
            assert [(m.role, m.content) for m in reset.observation] == [("system", "Be brief."),
                                                                      ("user", row["question"])]
            assert reset.metadata == {"tests": row["tests"], "level": row["level"]} and reset.tools_json == "[]"
            ids.append(reset.task_id)
        assert sorted(ids) == sorted(f"dataset-{r['id']}" for r in ROWS)  # every task once
        epochs.append(ids)
    assert epochs[0] != epochs[1]  # the second epoch is reshuffled
    assert env.reset(3, cfg).task_id == DatasetEnv(DatasetStore(DatasetRoots([tmp_path]))).reset(3, cfg).task_id  # same seed, same task
    assert env.reset(3, cfg).task_id != env.reset(3, {**cfg, "shuffle_seed": 1}).task_id or \
        env.reset(4, cfg).task_id != env.reset(4, {**cfg, "shuffle_seed": 1}).task_id


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_single_turn_answer_is_the_reply(tmp_path: Path, fmt: str) -> None:
    writer, name = WRITERS[fmt]
    env = DatasetEnv(DatasetStore(DatasetRoots([tmp_path])))
    reset = env.reset(0, config(writer(tmp_path / name, ROWS)))
    row = next(r for r in ROWS if f"dataset-{r['id']}" == reset.task_id)
    step = env.step(f"  {row['solution']} \n")
    assert step.done and step.answer == step.reference == row["solution"] and step.reward == 1.0


def test_held_out_split_is_disjoint_and_covers_the_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    env = DatasetEnv(DatasetStore(DatasetRoots([tmp_path])))
    parts = {split: {env.reset(s, config(path, split=split, eval_fraction=0.25)).task_id for s in range(200)}
             for split in ("train", "eval")}
    assert parts["train"].isdisjoint(parts["eval"])
    assert parts["train"] | parts["eval"] == {f"dataset-{r['id']}" for r in ROWS}
    assert 4 <= len(parts["eval"]) <= 18
    # By id, not position: reversed rows hold out the same tasks.
    reversed_path = write_jsonl(tmp_path / "r.jsonl", ROWS[::-1])
    assert {env.reset(s, config(reversed_path, split="eval", eval_fraction=0.25)).task_id
            for s in range(200)} == parts["eval"]


def test_messages_field_and_integer_answers(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "system", "content": "Count."}, {"role": "user", "content": "1,2,3?"}],
             "answer": 3}]
    env = DatasetEnv(DatasetStore(DatasetRoots([tmp_path])))
    reset = env.reset(5, {"path": str(write_jsonl(tmp_path / "m.jsonl", rows)), "messages_field": "messages",
                          "answer_format": "last_integer"})
    assert [m.role for m in reset.observation] == ["system", "user"] and reset.task_id == "dataset-0"
    step = env.step("There are 3.")
    assert (step.answer, step.reference, step.reward) == ("3", "3", 1.0)


def test_calculator_tool_multi_turn(tmp_path: Path) -> None:
    rows = [{"prompt": "What is 4821 * 337?", "answer": str(4821 * 337)}]
    env = DatasetEnv(DatasetStore(DatasetRoots([tmp_path])))
    reset = env.reset(0, {"path": str(write_jsonl(tmp_path / "c.jsonl", rows)), "tool": True, "max_turns": 3,
                          "answer_format": "last_integer"})
    assert json.loads(reset.tools_json)[0]["function"]["name"] == "calculator"
    tool = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "4821 * 337"}}</tool_call>')
    assert not tool.done and tool.observation[0].role == "tool" and tool.observation[0].content == "1624677"
    final = env.step(f"The product is {tool.observation[0].content}.")
    assert final.done and final.answer == final.reference == "1624677"


@pytest.mark.parametrize(("extra", "rows", "match"), [
    ({"answer_field": "nope"}, ROWS, r"answer_field: column 'nope' is not in .*; its columns are \['id'"),
    ({"metadata_fields": "tests,nope"}, ROWS, r"metadata_fields \(nope\): column 'nope'"),
    ({"split": "eval"}, ROWS, r"split 'eval' needs eval_fraction in \(0, 1\)"),
    ({"format": "csv"}, ROWS, r"format must be one of"),
    ({}, [{"question": "", "solution": "1", "id": "a", "tests": [], "level": 0}], r"row 0: question must be a non-empty"),
    ({"bogus": 1}, ROWS, r"dataset config: unknown key\(s\) \['bogus'\]"),
])
def test_bad_configs_and_rows_name_the_field(tmp_path: Path, extra: dict[str, Any], rows: list[dict[str, Any]],
                                             match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DatasetEnv(DatasetStore(DatasetRoots([tmp_path]))).reset(0, config(write_jsonl(tmp_path / "t.jsonl", rows), **extra))


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    env = DatasetEnv(DatasetStore(DatasetRoots([tmp_path])))
    with pytest.raises(ValueError, match="does not exist"):
        env.reset(0, {"path": str(tmp_path / "none.jsonl")})
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x", "answer": "1"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        env.reset(0, {"path": str(tmp_path / "bad.jsonl")})
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError):
        env.reset(0, {"path": str(tmp_path / "bad.parquet")})


def test_a_rewritten_file_is_read_again(tmp_path: Path) -> None:
    store, path = DatasetStore(DatasetRoots([tmp_path])), tmp_path / "t.jsonl"
    write_jsonl(path, [{"prompt": "a?", "answer": "1"}])
    env = DatasetEnv(store)
    assert env.reset(0, {"path": str(path)}).observation[0].content == "a?"
    write_jsonl(path, [{"prompt": "bb?", "answer": "2"}, {"prompt": "bb?", "answer": "2"}])
    assert env.reset(0, {"path": str(path)}).observation[0].content == "bb?"


def test_a_save_to_disk_directory_saved_again_in_place_is_read_again(tmp_path: Path) -> None:
    """save_to_disk over the same directory rewrites its files in place: the directory's own
    mtime and size stay the same, so they alone would keep serving the old rows."""
    store, path = DatasetStore(DatasetRoots([tmp_path])), tmp_path / "ds"
    write_hf(path, [{"prompt": "a?", "answer": "1"}])
    env = DatasetEnv(store)
    assert env.reset(0, {"path": str(path)}).observation[0].content == "a?"
    write_hf(path, [{"prompt": "bb?", "answer": "2"}, {"prompt": "bb?", "answer": "2"}])
    assert env.reset(0, {"path": str(path)}).observation[0].content == "bb?"


def test_dataset_dict_needs_a_split_name(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the `data` extra (datasets) is not installed")
    rows = [{"prompt": "p?", "answer": "1"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    env = DatasetEnv(DatasetStore(DatasetRoots([tmp_path])))
    with pytest.raises(ValueError, match=r"holds the splits \['test', 'train'\]: set hf_split"):
        env.reset(0, {"path": str(tmp_path / "dd")})
    assert env.reset(0, {"path": str(tmp_path / "dd"), "hf_split": "test"}).task_id == "dataset-0"


def test_only_paths_under_the_dataset_roots_are_read(tmp_path: Path) -> None:
    """The path comes from a client's config JSON: `..`, absolute paths and symlinks that lead
    out of env_gateway.dataset_roots are refused before the file is touched."""
    root, outside = tmp_path / "data", tmp_path / "private"
    root.mkdir()
    outside.mkdir()
    write_jsonl(root / "ok.jsonl", [{"prompt": "in?", "answer": "1"}])
    secret = write_jsonl(outside / "secret.jsonl", [{"prompt": "the secret", "answer": "s"}])
    (root / "escape.jsonl").symlink_to(secret)
    (root / "door").symlink_to(outside, target_is_directory=True)
    (root / "inner.jsonl").symlink_to(root / "ok.jsonl")  # a symlink that stays inside is fine
    env = DatasetEnv(DatasetStore(DatasetRoots([root])))
    assert env.reset(0, {"path": str(root / "ok.jsonl")}).observation[0].content == "in?"
    assert env.reset(0, {"path": str(root / "inner.jsonl")}).observation[0].content == "in?"
    for path in (secret, root / "escape.jsonl", root / "door" / "secret.jsonl", root / ".." / "private" / "secret.jsonl",
                 outside / "missing.jsonl", Path("/etc/passwd")):
        with pytest.raises(ValueError, match=r"outside the directories the gateway reads datasets from "
                                             r"\(env_gateway.dataset_roots: \[.*data'\]\)") as refused:
            env.reset(0, {"path": str(path)})
        assert str(path) in str(refused.value) and "the secret" not in str(refused.value)


def test_relative_paths_and_roots_are_from_the_working_directory(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "t.jsonl", [{"prompt": "rel?", "answer": "1"}])
    write_jsonl(tmp_path / "top.jsonl", [{"prompt": "top?", "answer": "1"}])
    monkeypatch.chdir(tmp_path / "data")
    env = DatasetEnv(DatasetStore(DatasetRoots(["."])))
    assert env.reset(0, {"path": "t.jsonl"}).observation[0].content == "rel?"
    with pytest.raises(ValueError, match=r"path '../top.jsonl' is outside"):
        env.reset(0, {"path": "../top.jsonl"})
    with pytest.raises(ValueError, match=r"env_gateway.dataset_roots: 'nowhere' .* is not a directory"):
        DatasetRoots(["nowhere"])
    (tmp_path / "data" / "loop").symlink_to("loop")  # a ValueError (INVALID_ARGUMENT), not INTERNAL
    with pytest.raises(ValueError, match=r"path 'loop/t.jsonl' cannot be resolved: Symlink loop"):
        env.reset(0, {"path": "loop/t.jsonl"})
    nothing = DatasetEnv(DatasetStore(DatasetRoots([])))  # dataset_roots: [] reads no file at all
    with pytest.raises(ValueError, match="outside"):
        nothing.reset(0, {"path": "t.jsonl"})


def test_save_to_disk_members_leading_out_of_the_roots_are_refused(tmp_path: Path) -> None:
    """load_from_disk opens the files a save_to_disk directory's JSON names, joined as they are:
    a data file named `../..`, a split named `../x`, a symlinked member or JSON file, or a
    directory read as Parquet (pyarrow reads every file in it) must not lead out of the roots."""
    root, outside = tmp_path / "data", tmp_path / "private"
    root.mkdir()
    secret = write_hf(outside / "secret", [{"prompt": "the secret", "answer": "s"}])
    arrow = next(secret.glob("*.arrow"))
    env = DatasetEnv(DatasetStore(DatasetRoots([root])))

    def refused(path: Path, match: str = "refers to a file outside") -> None:
        with pytest.raises(ValueError, match=match) as e:
            env.reset(0, {"path": str(path)})
        assert "the secret" not in str(e.value)

    for i, name in enumerate((f"../../private/secret/{arrow.name}", str(arrow))):
        named = write_hf(root / f"named{i}", [{"prompt": "in?", "answer": "1"}])
        state = json.loads((named / "state.json").read_text())
        (named / "state.json").write_text(json.dumps({**state, "_data_files": [{"filename": name}]}))
        refused(named, "is not a file name in its directory")
    linked = write_hf(root / "linked", [{"prompt": "in?", "answer": "1"}])
    member = next(linked.glob("*.arrow"))
    member.unlink()
    member.symlink_to(arrow)
    refused(linked)
    json_link = write_hf(root / "json_link", [{"prompt": "in?", "answer": "1"}])
    (json_link / "state.json").unlink()
    (json_link / "state.json").symlink_to(secret / "state.json")
    refused(json_link)
    datasets = pytest.importorskip("datasets")
    for split in ("../../private/secret", "train"):
        dd = root / f"dd{len(split)}"
        datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "in?", "answer": "1"}])}).save_to_disk(str(dd))
        assert env.reset(0, {"path": str(dd)}).observation[0].content == "in?"  # as saved: read
        env = DatasetEnv(DatasetStore(DatasetRoots([root])))  # a fresh gateway: nothing cached
        (dd / "dataset_dict.json").write_text(json.dumps({"splits": [split]}))
        if split == "train":
            shutil.rmtree(dd / "train")
            (dd / "train").symlink_to(secret, target_is_directory=True)
        refused(dd, "refers to a file outside" if split == "train" else "is not a split name")
    parquet_dir = root / "pq"
    parquet_dir.mkdir()
    (parquet_dir / "a.parquet").symlink_to(write_parquet(outside / "s.parquet", [{"prompt": "the secret", "answer": "s"}]))
    with pytest.raises(ValueError, match="is a directory: format 'parquet' reads a file") as e:
        env.reset(0, {"path": str(parquet_dir), "format": "parquet"})
    assert "the secret" not in str(e.value)


def test_a_directory_swapped_for_a_symlink_after_the_check_is_refused_once_open(tmp_path: Path) -> None:
    """Checked, then opened: the open file is checked again against where the path leads now."""
    root, outside = tmp_path / "data", tmp_path / "private"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    write_jsonl(root / "sub" / "t.jsonl", [{"prompt": "in?", "answer": "1"}])
    write_jsonl(outside / "t.jsonl", [{"prompt": "the secret", "answer": "s"}])
    roots = DatasetRoots([root])
    checked = roots.resolve(root / "sub" / "t.jsonl")
    (root / "sub").rename(root / "old")
    (root / "sub").symlink_to(outside, target_is_directory=True)  # the swap, between check and open
    with pytest.raises(ValueError, match="outside"):
        roots.open(checked)
    (root / "sub").unlink()
    (root / "old").rename(root / "sub")
    with roots.open(checked) as f:
        assert b"in?" in f.read()


def test_arlos_state_directory_is_never_read_under_a_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`arlo up` keeps its token, config and JSON-line logs in ./.arlo, inside the default root
    ".": a log line is a JSON object, so it would be served as a task's prompt."""
    from arlo.config import EnvGatewayConfig
    from services.env_gateway.registry import default_registry
    from services.env_gateway.spec import EnvContext

    home = tmp_path / ".arlo"
    (home / "logs").mkdir(parents=True)
    log = write_jsonl(home / "logs" / "trainer.log", [{"message": "a private log line", "service": "trainer"}])
    write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "in?", "answer": "1"}])
    monkeypatch.setenv("ARLO_HOME", str(home))
    registry = default_registry(EnvContext(EnvGatewayConfig(dataset_roots=(str(tmp_path),))))
    env = registry.create(registry.get("dataset"))
    assert env.reset(0, {"path": str(tmp_path / "ok.jsonl")}).observation[0].content == "in?"
    with pytest.raises(ValueError, match=r"in arlo's own state directory .*\$ARLO_HOME") as e:
        env.reset(0, {"path": str(log), "format": "jsonl", "prompt_field": "message", "answer_field": "service"})
    assert "a private log line" not in str(e.value)
    listed = DatasetEnv(DatasetStore(DatasetRoots([tmp_path, home / "logs"], private=[home])))  # on purpose
    assert listed.reset(0, {"path": str(log), "format": "jsonl", "prompt_field": "message", "answer_field": "service"}).observation
