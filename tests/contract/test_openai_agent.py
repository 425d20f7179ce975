"""Black-box agents as environments, end to end: agent code on the real `openai` client against
a real inference service, the real env gateway and reward cores, a real Redis stream; the
trajectory must be exactly the tokens the engine recorded for the agent's calls."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio as aioredis

from arlo.config import RolloutConfig, SamplingConfig
from arlo.coord import TrajectoryStream, delete_run
from arlo.model.tokenizer import ByteTokenizer
from arlo.proto.v1 import common_pb2
from examples.openai_agent import agent as example
from services.inference.openai_render import encode_conversation
from services.rollout.blackbox import AgentTask, BlackBoxRunner, Call, load_agent
from services.rollout.recorded import GrpcRecordings
from services.rollout.worker import RolloutWorker
from tests.support.inprocess import CoreScorer, GatewayEnv
from tests.support.openai_server import TOKEN, Served

TOK = ByteTokenizer()
pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="session")]
SEEN: dict[str, list] = {}
"""Replies each test agent got, by episode id."""


@pytest.fixture
def served(openai_served: Served) -> Served:
    return openai_served


class KeptRecordings(GrpcRecordings):
    """The production gRPC edge, keeping a copy of what each episode's record was."""

    taken: dict[str, list[Call]]

    async def take(self, episode_id: str) -> list[Call]:
        calls = await super().take(episode_id)
        self.taken[episode_id] = calls
        return calls


def runner(served: Served, agent) -> tuple[BlackBoxRunner, KeptRecordings]:
    recordings = KeptRecordings(served.channel, timeout_s=30)
    recordings.taken = {}
    return BlackBoxRunner(agent=agent, recordings=recordings, token=TOKEN, timeout_s=60), recordings


async def tool_agent(task: AgentTask, client) -> str:
    """Two turns: the reply sent back verbatim, then the tool's result as a `tool` message."""
    messages = list(task.messages)
    first = await client.chat.completions.create(model="x", messages=messages, tools=example.TOOLS, max_tokens=12,
                                                 logprobs=True)
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    call_id = reply.tool_calls[0].id if reply.tool_calls else "call_local"
    messages.append({"role": "tool", "tool_call_id": call_id, "content": example.calculate("2*3")})
    second = await client.chat.completions.create(model="x", messages=messages, tools=example.TOOLS, max_tokens=12,
                                                  logprobs=True)
    SEEN[task.episode_id] = [task, first, second]
    return second.choices[0].message.content or ""


async def rewriting_agent(task: AgentTask, client) -> float:
    """Rewrites its history between calls: the second prompt cannot extend the first."""
    await client.chat.completions.create(model="x", messages=task.messages, max_tokens=6)
    await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "start over"}], max_tokens=6)
    return 0.25


async def broken_agent(task: AgentTask, client) -> str:
    await client.chat.completions.create(model="x", messages=task.messages, max_tokens=4)
    raise RuntimeError("the agent's own bug")


def spec_for(rc: RolloutConfig, run_id: str):
    from services.rollout.agent import EpisodeSpec
    return EpisodeSpec(env_name=rc.env_name, env_config_json="", reward_fn=rc.reward_fn, seed=7, max_turns=3,
                       max_tokens_per_turn=16, max_episode_tokens=256, run_id=run_id, group_id="g", group_size=1,
                       max_wall_s=60)


async def test_a_tool_using_agent_becomes_the_exact_recorded_tokens(served: Served) -> None:
    run, recordings = runner(served, tool_agent)
    env = GatewayEnv()
    try:
        traj = await run(spec_for(RolloutConfig(env_name="arith"), "r"), TOK, None, env, CoreScorer())
    finally:
        env.shutdown()
    assert traj.status == common_pb2.TRAJECTORY_STATUS_OK, traj.error
    assert traj.num_turns == 2 and traj.finish_reason == "done"
    one, two = recordings.taken[traj.id]
    task, first, second = SEEN[traj.id]
    # The whole trajectory is the last call's prompt + its sampled tokens, and that prompt
    # extends the first call's prompt + sampled tokens: one sequence, nothing re-tokenized.
    assert list(traj.token_ids) == [*two.prompt, *two.choices[0].token_ids]
    assert list(two.prompt[:len(one.prompt) + len(one.choices[0].token_ids)]) == [*one.prompt,
                                                                                   *one.choices[0].token_ids]
    assert traj.prompt_length == len(one.prompt)
    assert list(one.prompt) == encode_conversation(TOK, task.messages, example.TOOLS)
    mask, lps, versions = list(traj.loss_mask), list(traj.logprobs), list(traj.policy_versions)
    for start, choice, reply in ((len(one.prompt), one.choices[0], first), (len(two.prompt), two.choices[0], second)):
        end = start + len(choice.token_ids)
        assert mask[start:end] == [1] * len(choice.token_ids) and versions[start:end] == [0] * len(choice.token_ids)
        assert list(choice.logprobs) == lps[start:end]
        assert lps[start:end] == pytest.approx([e.logprob for e in reply.choices[0].logprobs.content], abs=1e-6)
    assert sum(mask) == len(one.choices[0].token_ids) + len(two.choices[0].token_ids)
    assert all(v == -1 for v, m in zip(versions, mask, strict=True) if m == 0)
    assert TOK.decode(two.prompt).endswith("6")  # the tool's result reached the model
    assert await recordings.take(traj.id) == []  # the record was handed over and deleted


async def test_an_agent_that_rewrites_history_trains_on_its_last_segment(served: Served) -> None:
    run, recordings = runner(served, rewriting_agent)
    env = GatewayEnv()
    try:
        traj = await run(spec_for(RolloutConfig(env_name="arith"), "r"), TOK, None, env, CoreScorer())
    finally:
        env.shutdown()
    _, last = recordings.taken[traj.id]
    assert traj.reward == 0.25 and traj.status == common_pb2.TRAJECTORY_STATUS_OK  # a float is the reward
    assert list(traj.token_ids) == [*last.prompt, *last.choices[0].token_ids] and traj.num_turns == 1
    assert run.stats["segments_dropped"] == 1


async def test_a_failing_agent_is_an_error_episode_naming_the_failure(served: Served) -> None:
    run, _ = runner(served, broken_agent)
    env = GatewayEnv()
    try:
        traj = await run(spec_for(RolloutConfig(env_name="arith"), "r"), TOK, None, env, CoreScorer())
    finally:
        env.shutdown()
    assert traj.status == common_pb2.TRAJECTORY_STATUS_ERROR and "RuntimeError: the agent's own bug" in traj.error


async def test_the_example_agent_trains_through_the_worker_and_the_stream(served: Served, redis_url: str) -> None:
    run_id = f"bb-{uuid.uuid4().hex[:8]}"
    rc = RolloutConfig(env_name="arith", reward_fn="exact_match", group_size=2, agent="examples.openai_agent.agent:run",
                       sampling=SamplingConfig(max_tokens=16), episode_timeout_s=60)
    run, recordings = runner(served, load_agent(rc.agent))
    redis = aioredis.from_url(redis_url)
    env = GatewayEnv()
    stream = TrajectoryStream(redis, run_id, consumer="rollout")
    try:
        await stream.ensure_group()
        worker = RolloutWorker(rc, run_id=run_id, tokenizer=TOK, gen=None, env=env, scorer=CoreScorer(),
                               stream=stream, seed=0, episode_fn=run)
        trajs = await worker.run_group(11)
        entries = await TrajectoryStream(redis, run_id, consumer="trainer").read(10, 100)
    finally:
        env.shutdown()
        await delete_run(redis, run_id)
        await redis.aclose()
    assert [t.status for t in trajs] == [common_pb2.TRAJECTORY_STATUS_OK] * 2, [t.error for t in trajs]
    assert sorted(e.trajectory.id for e in entries) == sorted(t.id for t in trajs)
    for t in trajs:
        calls = recordings.taken[t.id]
        assert t.num_turns == len(calls) == 2 and t.env_name == "arith"
        assert list(t.token_ids) == [*calls[-1].prompt, *calls[-1].choices[0].token_ids]

