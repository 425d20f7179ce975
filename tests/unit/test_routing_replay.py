"""Routing replay ("R3", `trainer.algorithm.routing_replay`) end to end on a tiny Qwen3-MoE written
by transformers (8 experts, top-2, 2 routed layers).

The engine records, per generated token, the experts every routed layer chose at the position
that sampled it; they equal the router's choice of a full forward at those positions (greedy,
float32), survive the Completion bytes, the rollout's trajectory and the trainer's batch; the
trainer's forward with replay uses exactly them (routing_mismatch 0), and with replay off reports
the mismatch it measures (bf16 serving against the trainer's float32 forward). Malformed routing
bytes dead-letter the trajectory; a dense model and trainer.pack refuse the setting at config load.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.config import AlgorithmConfig, TrainerConfig
from arlo.model.source import resolve_model
from arlo.proto.v1 import common_pb2
from arlo.routing_replay import pack_experts, routing_bytes, routing_shape, unpack_experts

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

PROMPTS = [(5, 17, 42, 99, 7), tuple(range(30, 52)), (3, 1, 4, 1, 5, 9, 2, 6)]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.hf_checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("qwen3_moe_r3"), "qwen3_moe")


def _generate(moe_dir: Path, dtype: str, temperature: float, stop: tuple[str, ...] = (), kernel: str = "xla") -> list:
    from arlo.config import InferenceConfig
    from services.inference.engine import Engine, SamplingRequest

    source = resolve_model(name="tiny", path=str(moe_dir), tokenizer="", seed=0, max_seq_len=64, dtype=dtype,
                           param_dtype=dtype)
    engine = Engine(source, config=InferenceConfig(max_n=2, max_tokens=MAX_TOKENS, max_prompt_tokens=32, max_batch=8,
                                                   max_seq_len=64, decode_steps=4, page_size=16,
                                                   attention_kernel=kernel))
    try:
        handles = engine.submit_many([SamplingRequest(prompt=p, n=2, max_tokens=MAX_TOKENS, temperature=temperature,
                                                      ignore_eos=True, seed=i, return_routing=True, stop_strings=stop)
                                      for i, p in enumerate(PROMPTS)])
        return [h.result(300) for h in handles]
    finally:
        engine.close()


@functools.partial(jax.jit, static_argnums=0)
def _routed(graphdef: nnx.GraphDef, state: nnx.State, tokens_bt: jax.Array) -> jax.Array:
    _, routings = nnx.merge(graphdef, state).hidden_routed(tokens_bt)
    return jnp.stack([r.experts_btk for r in routings], axis=2)  # [b, t, layers, k]


def test_engine_records_the_routers_choice_and_the_bytes_round_trip(moe_dir: Path) -> None:
    from services.inference.server import to_completion

    source = resolve_model(name="tiny", path=str(moe_dir), tokenizer="", seed=0, max_seq_len=64)
    layers, top_k, num_experts = routing_shape(source.cfg)
    assert (top_k, num_experts) == (2, 8) and layers == 2
    from arlo.model import abstract_model

    graphdef, state = nnx.split(abstract_model(source.cfg))[0], source.initial_state(dtype="float32")
    results = _generate(moe_dir, "float32", 0.0)
    for prompt, samples in zip(PROMPTS, results, strict=True):
        for sample in samples:
            tokens = [*prompt, *sample.token_ids]
            assert sample.routed_experts.shape == (len(sample.token_ids), layers, top_k)
            full = np.asarray(_routed(graphdef, state, jnp.asarray([tokens[:-1]], jnp.int32)))[0]
            # Token i was sampled from position len(prompt) - 1 + i (prefill's last token, then each fed token).
            at = full[len(prompt) - 1:]
            np.testing.assert_array_equal(np.sort(sample.routed_experts, -1), np.sort(at, -1))
            data = to_completion(sample, routing_shape(source.cfg)).routed_experts
            assert len(data) == len(sample.token_ids) * routing_bytes(source.cfg)
            back = unpack_experts(data, tokens=len(sample.token_ids), routed_layers=layers, top_k=top_k,
                                  num_experts=num_experts)
            np.testing.assert_array_equal(back, sample.routed_experts)
    # A stop string cuts the experts with the tokens (greedy: the same tokens up to the cut).
    first = results[0][0]
    text = source.tokenizer().decode(first.token_ids[:4])
    stop = text.strip()[-2:]
    assert stop
    cut = _generate(moe_dir, "float32", 0.0, stop=(stop,))[0][0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) <= 4
    assert cut.routed_experts.shape[0] == len(cut.token_ids)
    np.testing.assert_array_equal(cut.routed_experts, first.routed_experts[: len(cut.token_ids)])


def test_the_in_place_kernel_decode_records_what_the_gather_decode_records(moe_dir: Path) -> None:
    """inference.attention_kernel: pallas (JAX's paged-attention kernel, interpret mode here) on the
    MoE model: the same greedy tokens and the same experts at every token as the gather path."""
    for a_samples, b_samples in zip(_generate(moe_dir, "float32", 0.0, kernel="pallas"),
                                    _generate(moe_dir, "float32", 0.0), strict=True):
        for a, b in zip(a_samples, b_samples, strict=True):
            assert a.token_ids == b.token_ids
            np.testing.assert_array_equal(np.sort(a.routed_experts, -1), np.sort(b.routed_experts, -1))


def test_the_wire_format() -> None:
    experts = np.array([[[1, 7], [0, 3]], [[2, 5], [6, 4]]])
    assert pack_experts(experts, 8) == bytes([1, 7, 0, 3, 2, 5, 6, 4])
    wide = pack_experts(np.array([[[300, 1]]]), 512)
    assert wide == (300).to_bytes(2, "little") + (1).to_bytes(2, "little")
    with pytest.raises(ValueError, match="routed_experts has 3 bytes"):
        unpack_experts(b"abc", tokens=1, routed_layers=2, top_k=2, num_experts=8)


def test_moe_replays_only_the_marked_tokens() -> None:
    from arlo.model.config import ModelConfig, MoeShape
    from arlo.model.moe import MoE

    cfg = ModelConfig(vocab_size=16, dim=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, mlp_dim=8,
                      max_seq_len=8, moe=MoeShape(num_experts=4, top_k=2, mlp_dim=4))
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 3, 8))
    _, own = moe.routed(x)
    recorded = (own.experts_btk + 1) % 4  # a different set at every token
    replay = jnp.array([[1.0, 0.0, 1.0]])
    _, routing = moe.routed(x, recorded, replay_bt=replay)
    used = np.asarray(routing.experts_btk)
    np.testing.assert_array_equal(used[0, [0, 2]], np.asarray(recorded)[0, [0, 2]])
    np.testing.assert_array_equal(used[0, 1], np.asarray(own.experts_btk)[0, 1])
    np.testing.assert_array_equal(np.asarray(routing.own_btk), np.asarray(own.experts_btk))


def _trajectories(results: list, num_experts: int) -> list[list[common_pb2.Trajectory]]:
    """One group per prompt, its samples as the rollout's builder lays them out (services/rollout/agent.py)."""
    from services.rollout.agent import EpisodeSpec, Turn, _Builder, _trajectory

    groups = []
    for g, (prompt, samples) in enumerate(zip(PROMPTS, results, strict=True)):
        members = []
        for k, s in enumerate(samples):
            b = _Builder()
            b.add_context(list(prompt))
            b.add_model(Turn(token_ids=s.token_ids, logprobs=s.logprobs, policy_versions=s.policy_versions,
                             finished_by_stop=False, routed_experts=pack_experts(s.routed_experts, num_experts)))
            spec = EpisodeSpec(env_name="e", env_config_json="", reward_fn="", seed=0, max_turns=1,
                               max_tokens_per_turn=MAX_TOKENS, max_episode_tokens=64, run_id="r", group_id=f"g{g}",
                               group_size=len(samples))
            traj = _trajectory(spec, f"{g}-{k}", "t", b, len(prompt), "done", 1, None, common_pb2.Timings())
            traj.reward = float(k)
            assert traj.routed_experts == pack_experts(s.routed_experts, num_experts)
            members.append(traj)
        groups.append(members)
    return groups


def test_trainer_replays_the_recorded_experts(moe_dir: Path) -> None:
    """bf16 serving, the trainer's float32 forward: with replay its routing is the sampler's
    (routing_mismatch 0); without, the mismatch it measures is reported (printed with the mean
    |logprob mismatch| of both, the issue's figures)."""
    from services.trainer.batching import build_batch
    from services.trainer.learner import Learner

    source = resolve_model(name="tiny", path=str(moe_dir), tokenizer="", seed=0, max_seq_len=64)
    shape = routing_shape(source.cfg)
    groups = _trajectories(_generate(moe_dir, "bfloat16", 1.0), shape[2])
    batch = build_batch(groups, 64, 0, routing=shape)
    assert batch.experts_btlk is not None and batch.experts_btlk.dtype == np.uint8
    assert batch.replay_bt.sum() == batch.mask_bt.sum()  # every model token has its record, at t - 1
    np.testing.assert_array_equal(batch.replay_bt[:, :-1], batch.mask_bt[:, 1:])
    figures = {}
    for replay in (True, False):
        # ppo_epochs 2: the proximal policy's forward replays too.
        learner = Learner(source, cfg=TrainerConfig(learning_rate=1e-6, ppo_epochs=2,
                                                    algorithm=AlgorithmConfig(routing_replay=replay)))
        m = learner.step(batch)
        assert not m.skipped and np.isfinite(m.loss)
        figures[replay] = (m.extra["routing_mismatch"], m.extra["routing_own_mismatch"], m.extra["logprob_mismatch"])
    print(f"\nrouting replay on: routing_mismatch {figures[True][0]:.4f} (own router {figures[True][1]:.4f}), "
          f"mean |logprob mismatch| {figures[True][2]:.5f}; off: routing_mismatch {figures[False][0]:.4f}, "
          f"mean |logprob mismatch| {figures[False][2]:.5f}")
    assert figures[True][0] == 0.0
    assert figures[False][0] == figures[False][1]  # without replay the forward's experts are the router's own


def test_malformed_routing_bytes_dead_letter_the_trajectory(moe_dir: Path) -> None:
    from services.trainer.core.groups import GroupAssembler, validate_trajectory

    source = resolve_model(name="tiny", path=str(moe_dir), tokenizer="", seed=0, max_seq_len=64)
    per_token = routing_bytes(source.cfg)
    assert per_token == 2 * 2  # 2 routed layers x top-2 x 1 byte
    traj = common_pb2.Trajectory(id="a", group_id="g", group_size=2, token_ids=[1, 2, 3, 4],
                                 logprobs=[0, 0, -1, -1], loss_mask=[0, 0, 1, 1], policy_versions=[-1, -1, 0, 0],
                                 routed_experts=bytes(2 * per_token))
    assert validate_trajectory(traj, per_token) is None
    traj.routed_experts = bytes(2 * per_token + 1)
    assert "routed_experts" in validate_trajectory(traj, per_token)
    assembler = GroupAssembler(max_staleness=4, routing_bytes=per_token)
    assembler.add([("1-0", traj)])
    assert assembler.drops.malformed == 1 and not assembler.pending


def test_config_refuses_a_dense_model_and_pack(moe_dir: Path) -> None:
    from arlo.config import ConfigError, RunConfig, from_dict

    with pytest.raises(ConfigError, match=r"trainer\.algorithm\.routing_replay.*no routed experts"):
        from_dict(RunConfig, {"model": {"name": "tiny"},
                              "trainer": {"algorithm": {"routing_replay": True}}}).validate()
    with pytest.raises(ConfigError, match=r"trainer\.pack.*trainer\.algorithm\.routing_replay"):
        from_dict(RunConfig, {"model": {"path": str(moe_dir)},
                              "trainer": {"pack": True, "algorithm": {"routing_replay": True}}}).validate()
    from_dict(RunConfig, {"model": {"path": str(moe_dir)}, "trainer": {"algorithm": {"routing_replay": True}}}).validate()


@pytest.mark.timeout(600)
def test_the_warm_up_compiles_the_step_that_replays(moe_dir: Path) -> None:
    """With routing replay every batch carries the sampler's experts: a warm-up without them left
    each batch length to compile mid-run (18 late compiles of ~1 min in the through-services run)."""
    from arlo.compile_watch import CompileWatch
    from services.trainer.batching import build_batch
    from services.trainer.learner import Learner
    from services.trainer.warmup import warm_up_learner

    source = resolve_model(name="tiny", path=str(moe_dir), tokenizer="", seed=0, max_seq_len=64)
    shape = routing_shape(source.cfg)
    groups = _trajectories(_generate(moe_dir, "bfloat16", 1.0), shape[2])
    batch = build_batch(groups, 64, 0, routing=shape)
    learner = Learner(source, cfg=TrainerConfig(groups_per_step=len(groups),
                                                algorithm=AlgorithmConfig(routing_replay=True)))
    watch = CompileWatch().install()
    try:
        warm_up_learner(learner, lengths=[batch.tokens_bt.shape[1]], groups=len(groups), group_size=len(groups[0]))
        watch.mark_warm()
        assert not learner.step(batch).skipped
        assert watch.late == 0, list(watch.late_names)
    finally:
        watch.close()
