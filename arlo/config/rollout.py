"""`rollout`: sampling, evaluation, the environment mixture and the dataset tasks."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import field

from arlo.config.base import (
    MAX_INT,
    MAX_POLL_S,
    MAX_WAIT_S,
    MIN_POLL_S,
    ConfigError,
    ServerConfig,
    _check,
    _frozen,
    check_ranges,
    ranged,
)
from arlo.jsonfields import parse_json_object


@_frozen
class SamplingConfig:
    """How the policy samples. The trainer computes its logprobs under the same temperature and
    filters (arlo.model.logprobs.sampled_token_logprobs), so its importance ratios compare the
    policy it trains with the one that sampled."""

    temperature: float = ranged(1.0, ge=0, le=10)
    """Sampling temperature; 0 is greedy."""
    top_p: float = ranged(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1 disables. Without top_k it costs the trainer a full vocabulary
    sort per token (top_k caps that to a top-k)."""
    top_k: int = ranged(0, ge=0)
    """Sample among the k most likely tokens; 0 disables. 1 to 20 (with a temperature that samples):
    each token's kept set is recorded and the trainer scores the token over exactly that set
    (filter replay, arlo/filter_replay.py: 4 bytes per id per model token in the stream)."""
    max_tokens: int = ranged(8, ge=1)
    """New tokens per model turn."""
    min_p: float = ranged(0.0, ge=0, lt=1)
    """Drop tokens whose probability is below min_p times the top token's; 0 disables."""
    stop: tuple[str, ...] = ()
    """Strings that end a model turn (kept in the output), e.g. "</tool_call>"; at most 16, each at
    most 64 bytes. A turn ended so is closed with the tokenizer's end-of-turn token as context."""
    stop_token_ids: tuple[int, ...] = ranged((), ge=0)
    """Token ids that end a turn, besides the tokenizer's own stop ids (every eos id of the model)."""
    seed: int | None = ranged(None, ge=0, le=MAX_INT)
    """Set: each turn's sampling seed is derived from it, the task, the episode's place in its group
    and the turn, so a run with the same config and tasks samples the same tokens. null: fresh seeds."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        _check(f"{path}.stop", len(self.stop) <= 16 and all(0 < len(s.encode()) <= 64 for s in self.stop),
               "at most 16 non-empty strings of <= 64 bytes")
        _check(f"{path}.stop_token_ids", len(self.stop_token_ids) <= 32, "at most 32 ids")


@_frozen
class EvalConfig:
    """Held-out evaluation, run by the rollout workers on request and never trained on: each of
    `num_tasks` tasks once greedily and `samples` times at the training temperature."""

    env_config_json: str = ""
    """JSON object merged over each mixture entry's config_json for evaluation, e.g. {"split": "eval"}
    for environments with a held-out split; an entry's own eval_config_json replaces it for that
    entry. Evaluation seeds are 0..num_tasks-1 either way."""
    num_tasks: int = ranged(64, ge=1, le=100_000)
    """Held-out tasks per evaluation and environment (seeds 0..num_tasks-1 of each mixture entry)."""
    samples: int = ranged(4, ge=1, le=64)
    """k of pass@k, and the samples behind the mean sampled reward."""
    every_versions: int = ranged(0, ge=0)
    """`arlo train`/`demo` request an evaluation whenever the version passes a multiple of this
    (and always at the start and the end); 0: start and end only."""
    timeout_s: float = ranged(600.0, gt=0, le=MAX_WAIT_S)
    """Deadline of one evaluation, all the mixture's entries together (num_tasks x (1 + samples)
    episodes each): past it the request reports an error and no figures, so raise it with the
    number of entries."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        try:
            parse_json_object(self.env_config_json.strip(), f"{path}.env_config_json")
        except ValueError as e:
            raise ConfigError(str(e)) from None


TASK_SEEDS = ("auto", "random", "cursor")
_LABEL = re.compile(r"[-\w.]*")


def _check_label(path: str, label: str) -> None:
    """A label names TensorBoard tags (`eval/<label>/...`: TensorBoard turns anything else into
    '_', so "a b" and "a_b" would be one series, and a '/' nests), metric keys and a Redis key."""
    _check(path, bool(_LABEL.fullmatch(label)), f"must be letters, digits, '_', '-' or '.', got {label!r}")


@_frozen
class RolloutEnvConfig:
    """One environment of the run's mixture (`rollout.envs`)."""

    name: str
    """Environment name at the gateway (a built-in such as "dataset", a plugin or a remote one)."""
    config_json: str = ""
    """JSON object passed to Reset, e.g. the dataset's path and field mapping."""
    reward_fn: str = "exact_match"
    """Reward function the reward service scores this environment's answers with."""
    weight: float = ranged(1.0, gt=0)
    """Share of groups drawn from this entry: weight / sum of weights."""
    label: str = ""
    """Name of this entry in trajectories (Trajectory.env_name), metrics and its task cursor; empty
    means `name`. Set it when two entries use the same environment (two datasets). Letters,
    digits, '_', '-' and '.' only: it names TensorBoard tags."""
    seeds: str = "auto"
    """How group seeds are chosen: "cursor" takes the next one from a durable Redis counter
    (every task once per epoch, across restarts), "random" draws one; "auto" is "cursor" for the
    dataset environment and "random" for the others."""
    eval_config_json: str = ""
    """JSON object merged over config_json for this entry's held-out evaluation, instead of
    rollout.eval.env_config_json (empty: that one applies; "{}": evaluate on config_json as is)."""
    max_tokens: int = ranged(0, ge=0)
    """New tokens per model turn in this entry's episodes; 0 = rollout.sampling.max_tokens. A
    mixture of entries with different budgets gives a run episodes of different lengths (a long
    tail: a few tasks that need long answers among many short ones); inference.max_tokens and
    rollout.max_episode_tokens must cover the longest."""

    @property
    def key(self) -> str:
        return self.label or self.name

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        _check(f"{path}.name", bool(self.name), "must be set")
        _check(f"{path}.seeds", self.seeds in TASK_SEEDS, f"must be one of {', '.join(TASK_SEEDS)}")
        _check_label(f"{path}.label", self.label)
        for name in ("config_json", "eval_config_json"):
            try:
                parse_json_object(getattr(self, name).strip(), f"{path}.{name}")
            except ValueError as e:
                raise ConfigError(str(e)) from None


DATASET_FORMATS = ("auto", "jsonl", "parquet", "hf")
DATASET_SPLITS = ("all", "train", "eval")
DATASET_ANSWER_FORMATS = ("text", "last_integer", "normalized")
DATASET_MAX_TURNS = 32


@_frozen
class DatasetConfig:
    """The `dataset` environment's config (its Reset config_json; the fields of `rollout.tasks`):
    a task file and the mapping of its columns. Declared here once, for the environment
    (services/env_gateway/envs/dataset.py) and the rollout's short form alike."""

    path: str = ""
    """The dataset: a .jsonl/.parquet file or a save_to_disk directory, on the gateway's disk
    (under env_gateway.dataset_roots)."""
    format: str = "auto"
    """"jsonl", "parquet", "hf" (save_to_disk), or "auto" from the path."""
    hf_split: str = ""
    """Which split of a saved DatasetDict (empty: its only one)."""
    prompt_field: str = "prompt"
    """Column holding the prompt text (the user message)."""
    messages_field: str = ""
    """Column holding a list of {role, content} messages; when set it is used instead of prompt_field."""
    answer_field: str = "answer"
    """Column holding the reference answer (non-strings are written as JSON)."""
    id_field: str = ""
    """Column with a stable task id (empty: the row number). The held-out split is drawn by id."""
    metadata_fields: str = ""
    """Comma-separated columns returned as the task's metadata (Reset's metadata_json), e.g. "tests"."""
    system_prompt: str = ""
    """A system message put before the prompt (not with messages_field)."""
    split: str = "all"
    """"train" or "eval": the part of a fixed partition by task id; "all" for separate files."""
    eval_fraction: float = ranged(0.0, ge=0, le=1)
    """Share of the tasks held out as "eval" (with split "train"/"eval")."""
    split_seed: int = ranged(0, ge=0)
    """Seeds the partition: change it and another set of tasks is held out."""
    shuffle_seed: int = ranged(0, ge=0)
    """Seeds every epoch's order (epoch e is shuffled by (shuffle_seed, e))."""
    answer_format: str = "text"
    """How the final reply becomes the answer: "text" (stripped), "last_integer", or "normalized"
    (lower case, no punctuation or articles; the reference is normalised the same way)."""
    tool: bool = False
    """The agent has a calculator tool; the episode ends at its first reply without a tool call."""
    max_turns: int = ranged(1, ge=1, le=DATASET_MAX_TURNS)
    """Turns before the episode ends unanswered (only matters with tool)."""

    def validate(self, path: str = "") -> None:
        """ValueError naming the key (the environment prefixes "dataset config: "); with `path`, a
        ConfigError prefixed with it."""
        check_ranges(self, path)
        try:
            self._validate()
        except ValueError as e:
            if path:
                raise ConfigError(f"{path}: {e}") from None
            raise

    def _validate(self) -> None:
        if not self.path:
            raise ValueError("path is required: a .jsonl or .parquet file or a save_to_disk directory")
        for name, allowed in (("format", DATASET_FORMATS), ("split", DATASET_SPLITS),
                              ("answer_format", DATASET_ANSWER_FORMATS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if not (self.prompt_field or self.messages_field):
            raise ValueError("set prompt_field or messages_field")
        if not self.answer_field:
            raise ValueError("answer_field is required")
        if self.split != "all" and not 0 < self.eval_fraction < 1:
            raise ValueError(f"split {self.split!r} needs eval_fraction in (0, 1); for separate train and "
                             "eval files use split 'all' and a different path for evaluation")

    @property
    def metadata_columns(self) -> tuple[str, ...]:
        return tuple(f.strip() for f in self.metadata_fields.split(",") if f.strip())


@_frozen
class TasksConfig(DatasetConfig):
    """`rollout.tasks`: the short form of a run on one dataset. Set `path` (and the field mapping,
    the dataset environment's keys) and the run's mixture is the one `dataset` entry it describes;
    leave `path` empty (the default) and it is off. For several environments use `rollout.envs`."""

    reward_fn: str = "exact_match"
    """Reward function the reward service scores the answers with (a built-in or a plugin)."""
    label: str = ""
    """Name of the tasks in trajectories, metrics and the task cursor; empty means "dataset".
    Letters, digits, '_', '-' and '.' only."""
    eval_path: str = ""
    """A separate held-out file (with split "all"). Empty: with split "train", evaluation takes the
    "eval" part of the same partition; with split "all", rollout.eval.env_config_json applies."""

    def validate(self, path: str = "rollout.tasks") -> None:
        check_ranges(self, path)
        if not self.path:  # off: any other key set means a forgotten path, and a run on arith
            given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
            _check(f"{path}.path", not given, f"must be set when {', '.join(given)} "
                   f"{'is' if len(given) == 1 else 'are'} (without a path rollout.tasks is off)")
            return
        super(TasksConfig, self).validate(path)  # noqa: UP008 (a slotted dataclass has no __class__ cell)
        _check(f"{path}.split", self.split != "eval", "'eval' would train on the held-out tasks (and evaluate "
               "on them too): use 'train', and evaluation takes the 'eval' part")
        _check_label(f"{path}.label", self.label)
        _check(f"{path}.eval_path", not self.eval_path or self.split == "all",
               f"is a separate held-out file: use it with split 'all', not {self.split!r}")

    def entry(self, eval_env_config_json: str = "") -> RolloutEnvConfig:
        """The `rollout.envs` entry this is short for; `eval_env_config_json` (rollout.eval's) is
        merged under the held-out override this derives from split/eval_path."""
        dataset = {f.name: getattr(self, f.name) for f in dataclasses.fields(DatasetConfig)
                   if getattr(self, f.name) != f.default}
        held_out = {"path": self.eval_path} if self.eval_path else {"split": "eval"} if self.split == "train" else {}
        eval_json = ""
        if held_out:
            eval_json = json.dumps({**parse_json_object(eval_env_config_json.strip(), "rollout.eval.env_config_json"),
                                    **held_out})
        return RolloutEnvConfig(name="dataset", label=self.label, config_json=json.dumps(dataset),
                                reward_fn=self.reward_fn, eval_config_json=eval_json)


@_frozen
class RolloutConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50055, metrics_port=9105))
    """Where the rollout service listens."""
    env_name: str = "arith"
    """Environment the training episodes run in (served by the env gateway)."""
    env_config_json: str = ""
    """JSON object passed to the environment at each reset; empty = {}."""
    reward_fn: str = "exact_match"
    """Reward function (reward service) that scores each episode's final answer."""
    group_size: int = ranged(4, ge=1, le=1024)
    """Samples per task (a GRPO group): their rewards are compared with each other."""
    max_turns: int = ranged(3, ge=1)
    """Model turns per episode at most."""
    max_episode_tokens: int = ranged(256, ge=1)
    """Tokens per episode at most, its first prompt (messages and tool schemas under the chat
    template) and observations included: the trainer's longest batch row. A tools prompt alone
    can be hundreds of tokens; a first prompt that leaves no room to generate is refused
    (`arlo train` stops, naming this field and the length it needs). At most model.max_seq_len
    and inference.max_seq_len where those are set; inference.max_prompt_tokens must hold the first
    prompt, and a later turn's prompt past it ends the episode (finish_reason "max_tokens")."""
    episode_timeout_s: float = ranged(120.0, gt=0, le=MAX_WAIT_S)
    """Wall-time limit of an episode: no turn starts after it (finish_reason "max_wall_time")."""
    concurrent_groups: int = ranged(4, ge=1)
    """Groups in flight per worker."""
    partial: bool = False
    """Partial rollouts (AReaL's interruptible generation): at a weight swap, generations in flight
    stop at a token boundary and go on under the new weights, their KV recomputed by them (mostly a
    prefill of what they have), so every token after the swap is the new policy's exactly. False:
    they go on over the KV the old weights wrote. Either way each token keeps the version that
    sampled it, the staleness bound counts a trajectory by its oldest token, and the trainer's
    off-policy correction (trainer.algorithm: decoupled PPO / truncated IS) weighs the mix."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How the policy samples during training episodes."""
    rpc_timeout_s: float = ranged(30.0, gt=0, le=MAX_WAIT_S)
    """Deadline of each call to inference, the env gateway and the reward service."""
    batch_window_s: float = ranged(0.001, ge=0, le=1)
    """Generate calls to one inference replica, and Score calls, that arrive within this of each
    other leave as one GenerateBatch / ScoreBatch (at most 8 windows after the first); inference
    admits a batch at once. 0 sends one call each: a group's first turns then reach the engine at
    different steps and share their prompt's prefill less (about two per group instead of one).
    At 596k, a sync burst of 32 Generates went from 4-5 prefills to 1 (services/rollout/coalescing.py)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation (greedy and pass@k), reported apart from the training reward."""
    envs: tuple[RolloutEnvConfig, ...] = ()
    """A mixture of environments, each group drawn from one by weight; empty means the one entry
    {name: env_name, config_json: env_config_json, reward_fn: reward_fn}. Evaluation runs every entry."""
    task_lease_s: float = ranged(900.0, gt=0, le=MAX_WAIT_S)
    """A cursor-drawn task not finished this long after it was handed out (its worker died) is
    handed out again: at-least-once. Keep it above the longest a group can take."""
    agent: str = ""
    """A black-box agent, "module:function" naming `async def run(task, client) -> str | float`: it
    drives the policy through the OpenAI endpoint instead of the built-in turn loop (docs/openai.md)."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    """Tasks from a dataset file, the short form of a one-entry `envs` (docs/datasets.md): its
    path, field mapping and reward_fn. Set, it replaces env_name/env_config_json/reward_fn."""
    admission_poll_s: float = ranged(2.0, ge=MIN_POLL_S, le=MAX_POLL_S)
    """The staleness gate wakes on Redis pub/sub events (a new version, a version served, a stale
    drop, a finished group); it also re-checks this often in case an event was lost."""

    @property
    def mixture(self) -> tuple[RolloutEnvConfig, ...]:
        """`envs`, or the dataset entry `tasks` is short for, or the single entry the
        env_name/env_config_json/reward_fn fields describe."""
        if self.envs:
            return self.envs
        if self.tasks.path:
            return (self.tasks.entry(self.eval.env_config_json),)
        return (RolloutEnvConfig(name=self.env_name, config_json=self.env_config_json, reward_fn=self.reward_fn),)

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        self.server.validate(f"{path}.server")
        self.sampling.validate(f"{path}.sampling")
        self.eval.validate(f"{path}.eval")
        keys: set[str] = set()
        for i, entry in enumerate(self.envs):
            entry.validate(f"{path}.envs[{i}]")
            _check(f"{path}.envs[{i}].label", entry.key not in keys,
                   f"two entries are both called {entry.key!r}: give one a label")
            keys.add(entry.key)
        self.tasks.validate(f"{path}.tasks")
        if self.tasks.path:
            _check(f"{path}.tasks", not self.envs, "set rollout.tasks (one dataset) or rollout.envs (a mixture), "
                   "not both; a dataset in a mixture is an envs entry with name: dataset")
            defaults = RolloutConfig()
            for name in ("env_name", "env_config_json", "reward_fn"):
                _check(f"{path}.{name}", getattr(self, name) == getattr(defaults, name),
                       f"conflicts with rollout.tasks, which sets the environment"
                       f"{' (give reward_fn under rollout.tasks)' if name == 'reward_fn' else ''}: remove it")
        _check(f"{path}.agent", not self.agent or self.agent.count(":") == 1 and all(self.agent.split(":")),
               'must be "module:function" (or empty for the built-in loop)')
