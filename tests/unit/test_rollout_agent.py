"""The episode loop on real parts in process: the inference engine, the env gateway core and the
reward scorer core, joined by thin adapters to the loop's Protocols."""

from __future__ import annotations

import asyncio

import pytest

from arlo.config import InferenceConfig
from arlo.model.source import preset_source
from arlo.proto.v1 import common_pb2
from services.inference.engine import Engine
from services.rollout.agent import EpisodeSpec, Turn, run_episode
from services.rollout.types import EpisodeDoesNotFit
from tests.support.inprocess import TOK, CoreScorer, EngineGenerator, GatewayEnv


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(preset_source("tiny"), config=InferenceConfig(max_n=8, max_tokens=32, max_prompt_tokens=200))


def spec(**kw) -> EpisodeSpec:
    base = dict(env_name="arith", env_config_json="", reward_fn="exact_match", seed=7, max_turns=3,
                max_tokens_per_turn=4, max_episode_tokens=128, run_id="r", group_id="g", group_size=1)
    return EpisodeSpec(**{**base, **kw})


def test_episode_is_token_in_token_out(engine: Engine) -> None:
    gen, env = EngineGenerator(engine), GatewayEnv()
    traj = asyncio.run(run_episode(spec(), TOK, gen, env, CoreScorer()))
    n = len(traj.token_ids)
    assert len(traj.logprobs) == len(traj.loss_mask) == len(traj.policy_versions) == n
    # Every later prompt is exactly the earlier trajectory prefix: nothing was re-tokenized.
    for prompt in gen.prompts:
        assert list(traj.token_ids[: len(prompt)]) == prompt
    assert traj.token_ids[: traj.prompt_length] == TOK.encode_messages(
        [("user", traj.task_id.removeprefix("arith-") + "=")], add_generation_prompt=True, add_bos=True)
    model_tokens = [i for i, m in enumerate(traj.loss_mask) if m]
    assert model_tokens and all(traj.policy_versions[i] == 0 for i in model_tokens)
    assert all(traj.policy_versions[i] == -1 and traj.logprobs[i] == 0.0 for i in range(n) if not traj.loss_mask[i])
    assert 1 <= traj.num_turns <= 3 and env.closed
    assert traj.status in (common_pb2.TRAJECTORY_STATUS_OK, common_pb2.TRAJECTORY_STATUS_TRUNCATED)


def test_turn_and_token_limits_end_the_episode_with_a_reason(engine: Engine) -> None:
    traj = asyncio.run(run_episode(spec(max_turns=1, env_config_json='{"max_turns": 5}'), TOK,
                                   EngineGenerator(engine), GatewayEnv(), CoreScorer()))
    assert traj.num_turns == 1
    assert traj.finish_reason in ("done", "max_turns")
    tight = asyncio.run(run_episode(spec(max_episode_tokens=12), TOK, EngineGenerator(engine), GatewayEnv(),
                                    CoreScorer()))
    # The budget bounds what the model generates; the observation that ends a turn may pass it.
    assert sum(tight.loss_mask) <= 12 - tight.prompt_length
    assert tight.finish_reason in ("done", "max_tokens")


def test_wall_time_limit_ends_the_episode_between_turns_with_a_reason() -> None:
    class SlowWrongPolicy:
        """The first turn at once, the second past the limit: the check between turns ends the
        episode after two whatever the machine's load (the first turn has the whole second)."""
        turns = 0

        async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
            self.turns += 1
            if self.turns > 1:
                await asyncio.sleep(1.1)
            ids = TOK.encode("-1") + [TOK.eos_id]
            return Turn(token_ids=ids, logprobs=[-0.1] * len(ids), policy_versions=[0] * len(ids),
                        finished_by_stop=True)

    traj = asyncio.run(run_episode(spec(max_turns=10, env_config_json='{"max_turns": 10}', max_wall_s=1.0),
                                   TOK, SlowWrongPolicy(), GatewayEnv(), CoreScorer()))
    assert traj.finish_reason == "max_wall_time" and traj.num_turns == 2
    assert traj.status == common_pb2.TRAJECTORY_STATUS_TRUNCATED  # trainable, reward 0: no answer


def test_correct_answer_scores_one() -> None:
    class Oracle:
        async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
            text = TOK.decode(prompt).rsplit("=", 1)[0]
            a, b = text[-3], text[-1]  # "a+b" of single digits
            ids = TOK.encode(str(int(a) + int(b))) + [TOK.eos_id]
            return Turn(token_ids=ids, logprobs=[-0.1] * len(ids), policy_versions=[4] * len(ids),
                        finished_by_stop=True)

    traj = asyncio.run(run_episode(spec(), TOK, Oracle(), GatewayEnv(), CoreScorer()))
    assert traj.status == common_pb2.TRAJECTORY_STATUS_OK and traj.reward == 1.0 and traj.num_turns == 1
    assert traj.reward_components["exact_match"] == 1.0


def test_turn_cut_by_a_stop_string_is_closed_with_the_end_token_as_context() -> None:
    class StopsAtString:  # the engine stopped on a stop string: the turn has no end-of-turn token
        async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
            ids = TOK.encode("calc 3+4")
            return Turn(token_ids=ids, logprobs=[-0.1] * len(ids), policy_versions=[0] * len(ids),
                        finished_by_stop=True)

    traj = asyncio.run(run_episode(spec(max_turns=1, env_config_json='{"tool": true}'), TOK, StopsAtString(),
                                   GatewayEnv(), CoreScorer()))
    n = len(TOK.encode("calc 3+4"))
    start = traj.prompt_length
    assert list(traj.token_ids[start:start + n + 1]) == TOK.encode("calc 3+4") + [TOK.eos_id]
    assert list(traj.loss_mask[start:start + n + 1]) == [1] * n + [0]


def test_sampling_seed_makes_an_episode_repeat(engine: Engine) -> None:
    class Recording(EngineGenerator):
        def __init__(self) -> None:
            super().__init__(engine, temperature=1.0)
            self.seeds: list[int | None] = []

        async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
            self.seeds.append(seed)
            return await super().generate(prompt, max_tokens=max_tokens, session_id=session_id, seed=seed)

    def run(sampling_seed: int | None) -> tuple[list[int], list[int | None]]:
        gen = Recording()
        traj = asyncio.run(run_episode(spec(sampling_seed=sampling_seed, env_config_json='{"max_turns": 3}'), TOK,
                                       gen, GatewayEnv(), CoreScorer()))
        return list(traj.token_ids), gen.seeds

    first, seeds = run(3)
    assert run(3) == (first, seeds)
    assert all(s is not None for s in seeds) and len(set(seeds)) == len(seeds)  # a seed per turn
    assert run(4)[0] != first
    assert set(run(None)[1]) == {None}  # unset: the engine draws fresh seeds


def test_group_members_get_their_own_seeds() -> None:
    from arlo.config import RolloutConfig, SamplingConfig
    from services.rollout.worker import RolloutWorker

    def members(seed: int | None) -> list[int | None]:
        cfg = RolloutConfig(group_size=4, sampling=SamplingConfig(seed=seed))
        worker = RolloutWorker(cfg, run_id="r", tokenizer=TOK, gen=None, env=None, scorer=None, stream=None)
        return [worker._member(spec(), cfg.mixture[0], i).sampling_seed for i in range(4)]

    assert members(None) == [None] * 4
    seeds = members(1)
    assert len(set(seeds)) == 4 and members(1) == seeds and members(2) != seeds


def test_the_environments_step_reward_is_recorded_at_the_end_of_its_turn() -> None:
    class Oracle:
        async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
            text = TOK.decode(prompt).rsplit("=", 1)[0]
            ids = TOK.encode(str(int(text[-3]) + int(text[-1]))) + [TOK.eos_id]
            return Turn(token_ids=ids, logprobs=[-0.1] * len(ids), policy_versions=[4] * len(ids),
                        finished_by_stop=True)

    traj = asyncio.run(run_episode(spec(), TOK, Oracle(), GatewayEnv(), CoreScorer()))
    # The arith env itself pays 1.0 for the right answer on the step that ends the episode.
    assert [(r.token_end, r.reward) for r in traj.turn_rewards] == [(len(traj.token_ids), 1.0)]
    assert traj.loss_mask[traj.turn_rewards[0].token_end - 1] == 1  # the turn's last model token


def test_every_turn_gets_its_step_reward_even_when_zero(engine: Engine) -> None:
    traj = asyncio.run(run_episode(spec(max_turns=3, env_config_json='{"max_turns": 3}'), TOK,
                                   EngineGenerator(engine), GatewayEnv(), CoreScorer()))
    assert len(traj.turn_rewards) == traj.num_turns
    ends = [r.token_end for r in traj.turn_rewards]
    assert ends == sorted(ends) and all(traj.loss_mask[e - 1] == 1 for e in ends)


def first_prompt_length() -> int:
    """The tokens of spec()'s first prompt under the template (its task, seed 7)."""
    traj = asyncio.run(run_episode(spec(max_turns=1), TOK, OnlyAnswer(), GatewayEnv(), CoreScorer()))
    return traj.prompt_length


class OnlyAnswer:
    prompts: list[list[int]]

    def __init__(self) -> None:
        self.prompts = []

    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        self.prompts.append(list(prompt))
        ids = (TOK.encode("calc 1+1") + [TOK.eos_id])[:max_tokens]
        return Turn(token_ids=ids, logprobs=[-0.1] * len(ids), policy_versions=[0] * len(ids), finished_by_stop=True)


def test_a_first_prompt_that_leaves_no_room_to_generate_is_refused_naming_the_limits() -> None:
    """Issue 33: a tools prompt longer than the episode budget generated nothing, silently (every
    trajectory dead-lettered for having no model token, and the run waited)."""
    n = first_prompt_length()
    env = GatewayEnv()
    with pytest.raises(EpisodeDoesNotFit, match=rf"first prompt is {n} tokens.*rollout\.max_episode_tokens is {n}"
                                                 rf".*at least {n + 4}"):
        asyncio.run(run_episode(spec(max_episode_tokens=n), TOK, OnlyAnswer(), env, CoreScorer()))
    assert env.closed  # its session is closed all the same
    with pytest.raises(EpisodeDoesNotFit, match=rf"over inference\.max_prompt_tokens {n - 1}: set it to at least {n}"):
        asyncio.run(run_episode(spec(max_prompt_tokens=n - 1), TOK, OnlyAnswer(), GatewayEnv(), CoreScorer()))
    # One token of room is room: the episode runs.
    traj = asyncio.run(run_episode(spec(max_episode_tokens=n + 1, max_turns=1), TOK, OnlyAnswer(), GatewayEnv(),
                                   CoreScorer()))
    assert sum(traj.loss_mask) == 1


def test_a_later_prompt_past_inference_max_prompt_tokens_ends_the_episode_instead_of_a_refused_call() -> None:
    n = first_prompt_length()
    gen = OnlyAnswer()
    traj = asyncio.run(run_episode(spec(max_prompt_tokens=n, max_turns=3, env_config_json='{"max_turns": 3, "tool": true}'),
                                   TOK, gen, GatewayEnv(), CoreScorer()))
    assert len(gen.prompts) == 1 and all(len(p) <= n for p in gen.prompts)
    assert traj.finish_reason == "max_tokens" and traj.status == common_pb2.TRAJECTORY_STATUS_TRUNCATED
