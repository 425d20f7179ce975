"""`rollout.tasks`, the short form of a one-dataset run: it expands to the `dataset` entry of
`rollout.envs` it is short for (the dataset config declared once), derives the held-out config
from its split, and refuses settings it would silently override."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arlo.config import ConfigError, DatasetConfig, dump_config, load_config
from services.rollout.evaluation import eval_env_config
from services.rollout.mixture import uses_cursor

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "datasets"
TASKS = {"path": "t.jsonl", "prompt_field": "question", "split": "train", "eval_fraction": 0.25}


def dataset(config_json: str) -> DatasetConfig:
    return DatasetConfig(**json.loads(config_json))


def test_the_short_form_is_the_long_forms_entry() -> None:
    short = load_config(EXAMPLE / "tasks.yaml").rollout
    (long_entry, _arith) = load_config(EXAMPLE / "run.yaml").rollout.mixture
    (entry,) = short.mixture
    assert (entry.name, entry.key, entry.reward_fn, entry.weight) == ("dataset", "squares", "exact_match", 1.0)
    assert dataset(entry.config_json) == dataset(long_entry.config_json) and uses_cursor(entry)
    long_eval = eval_env_config(load_config(EXAMPLE / "run.yaml").rollout, "squares")
    assert dataset(eval_env_config(short)) == dataset(long_eval)


def test_held_out_config_follows_the_split() -> None:
    def held_out(tasks: dict, **rollout) -> dict:
        cfg = load_config(overrides={"rollout": {"tasks": tasks, **rollout}}).rollout
        return json.loads(eval_env_config(cfg))

    base = {"path": "t.jsonl", "prompt_field": "question"}
    assert held_out(TASKS) == {**base, "split": "eval", "eval_fraction": 0.25}
    assert held_out({**TASKS, "split": "all", "eval_fraction": 0.0, "eval_path": "e.jsonl"}) == {**base, "path": "e.jsonl"}
    # With split "all" and no eval file, rollout.eval.env_config_json applies as for any entry;
    # with a derived override it is merged under it.
    assert held_out(base, eval={"env_config_json": '{"max_turns": 2}'}) == {**base, "max_turns": 2}
    assert held_out(TASKS, eval={"env_config_json": '{"split": "all", "max_turns": 2}'})["split"] == "eval"


def test_unset_tasks_change_nothing_and_a_config_round_trips(tmp_path: Path) -> None:
    assert load_config().rollout.mixture[0].name == "arith"
    cfg = load_config(EXAMPLE / "tasks.yaml")
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").rollout.mixture == cfg.rollout.mixture


@pytest.mark.parametrize(("rollout", "match"), [
    ({"envs": [{"name": "arith"}]}, r"rollout.tasks: set rollout.tasks \(one dataset\) or rollout.envs"),
    ({"env_name": "guess_number"}, r"rollout.env_name: conflicts with rollout.tasks"),
    ({"env_config_json": '{"op": "*"}'}, r"rollout.env_config_json: conflicts with rollout.tasks"),
    ({"reward_fn": "math"}, r"rollout.reward_fn: conflicts with rollout.tasks.*give reward_fn under rollout.tasks"),
])
def test_conflicting_environment_settings_are_refused(rollout: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides={"rollout": {"tasks": TASKS, **rollout}})


@pytest.mark.parametrize(("tasks", "match"), [
    ({"path": "t.jsonl", "split": "train"}, r"rollout.tasks: split 'train' needs eval_fraction in \(0, 1\)"),
    ({**TASKS, "eval_path": "e.jsonl"}, r"rollout.tasks.eval_path: is a separate held-out file: use it with split 'all'"),
    ({"eval_path": "e.jsonl"}, r"rollout.tasks.path: must be set when eval_path is \(without a path"),
    ({"prompt_field": "q", "reward_fn": "math"}, r"rollout.tasks.path: must be set when prompt_field, reward_fn are"),
    ({**TASKS, "split": "eval"}, r"rollout.tasks.split: 'eval' would train on the held-out tasks"),
    ({**TASKS, "answer_format": "words"}, r"rollout.tasks: answer_format must be one of"),
    ({**TASKS, "bogus": 1}, r"rollout.tasks: unknown field\(s\) \['bogus'\]"),
])
def test_bad_tasks_name_the_field(tasks: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides={"rollout": {"tasks": tasks}})
