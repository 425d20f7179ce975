"""The generation engine core: a continuous-batching loop over one model, no gRPC.

vLLM v1's loop on its own thread: `schedule` (admit waiting requests into free slots)
-> `execute` (prefill the admitted ones, then one decode chunk of `decode_steps` tokens for
every running sequence, all on the device) -> `update` (append tokens, apply stop strings,
finish, free slots, notify callers). Callers on any thread `submit` and get a handle whose
callbacks fire per chunk (streaming) and at the end.

The policy is one reference to (state, versions) (policy.py). `swap` replaces it between two
engine steps: no drain, no restart; a chunk runs under one policy and each token records its
version, so one completion may span versions. With several LoRA adapter slots (several runs over
one base) each request names its slot and each slot has its own version.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from arlo.compile_watch import ahead_of_use
from arlo.config import InferenceConfig
from arlo.model import abstract_model
from arlo.model.kv_budget import kv_layout
from arlo.model.kv_cache import KVCache
from arlo.model.sharding import fitted_state_shardings
from arlo.model.source import ModelSource, cast_state
from arlo.routing_replay import routing_shape
from services.inference.engine_records import ChunkRecord, EngineStats, RequestHandle
from services.inference.idle_compile import IdleCompiler
from services.inference.pages import PagePool
from services.inference.policy import initial_policy, published, replaced
from services.inference.programs import Key, row_floor
from services.inference.requests import (
    MAX_STOP_IDS,
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    OnDone,
    OnTokens,
    Sample,
    SamplingRequest,
    TokenDelta,
    stop_string_cut,
    validate_request,
)
from services.inference.runner import Emitted, Runner, abstract
from services.inference.scheduler import Request, Scheduler
from services.inference.scheduler import Sequence as Seq

__all__ = [
    "MAX_STOP_IDS", "MAX_STOP_STRINGS", "MAX_STOP_STRING_BYTES", "ChunkRecord", "Engine",
    "RequestHandle", "Sample", "SamplingRequest", "TokenDelta", "validate_request",
]

log = logging.getLogger(__name__)


class Engine:
    """One model, one swappable policy, many concurrent requests batched on one device loop."""

    def __init__(self, source: ModelSource, *, config: InferenceConfig | None = None,
                 mesh: Mesh | None = None, adapters: int = 0, recompute_on_swap: bool = False) -> None:
        """`source`: the decoder, tokenizer and version-0 weights (a checkpoint or a preset's
        seed), in the source's param_dtype. `config`: the run's inference section (slots,
        limits, KV budget; its `server` and `mesh` are the service's business). `mesh`: shard
        the weights by their logical axes and the KV cache (slots over the data axes, kv heads
        over `tensor`) across its devices; None serves from the default device. `adapters`: a LoRA
        source's adapters held at once (> 1: several runs over one base, each request naming its
        slot, each slot swapped and versioned on its own); 0 or 1: one. `recompute_on_swap`: partial
        rollouts (rollout.partial): at a swap, the swapped slot's in-flight samples stop at a token boundary and go on
        under the new weights with their KV recomputed by them; False: they go on over the KV the
        old weights wrote. Either way each token keeps the version that sampled it."""
        self.config = config or InferenceConfig()
        self.config.validate("inference")
        self.model_name = source.name
        base = source.cfg
        if adapters > 1:
            if base.lora is None:
                raise ValueError(f"adapters={adapters}: the model has no LoRA adapters (trainer.lora.rank is 0)")
            if base.lora.train_norms:
                raise ValueError(f"adapters={adapters}: trainer.lora.train_norms trains the norms too, and an engine "
                                 "serving several adapters holds one set of norms; serve one adapter per engine")
            base = dataclasses.replace(base, lora=dataclasses.replace(base.lora, slots=adapters))
        self.adapter_slots = max(adapters, 1)
        slot_len = min(base.max_seq_len, self.config.max_seq_len or base.max_seq_len)
        self.model_cfg = dataclasses.replace(base, max_seq_len=slot_len)
        self.routing = routing_shape(base)
        """(routed layers, top_k, num_experts); None for a model without routed experts."""
        self.tokenizer = source.tokenizer()
        self.graphdef, abstract = nnx.split(abstract_model(base))
        abstract = cast_state(abstract, source.param_dtype)
        # Committed to the device(s), as every swapped-in state will be (see swap): jit keys its
        # programs on placement, and a mismatch would recompile everything on the first swap.
        # The placement comes from the abstract state, so a checkpoint streams straight into it.
        placement = jax.devices()[0] if mesh is None else fitted_state_shardings(abstract, mesh)
        self.mesh = mesh
        self._policy = initial_policy(source, abstract, placement, slots=adapters)
        self.kv = kv_layout(self.config, self.model_cfg)
        self.max_seqs = self.kv.max_seqs
        device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
        min_rows = row_floor(self.config.min_rows, platform=device.platform, params=base.num_params())
        self.runner = Runner(self.graphdef, self.model_cfg, pages=self.kv.pages, page_size=self.kv.page_size,
                             max_seqs=self.max_seqs, slot_len=slot_len, decode_steps=self.config.decode_steps,
                             max_prefill_rows=self.config.max_prefill_rows, max_n=self.config.max_n, min_rows=min_rows,
                             mesh=mesh, top_logprobs=self.config.max_top_logprobs,
                             attention_kernel=self.config.attention_kernel)
        self.scheduler = Scheduler(max_seqs=self.max_seqs, prefill_tokens=self.config.prefill_tokens,
                                   pool=PagePool(self.runner.pages, self.kv.page_size),
                                   prefill_start=self.runner.prefill_start)
        self.recompute_on_swap = recompute_on_swap
        self._served_versions: tuple[int, ...] = self._policy.versions
        self.stats = EngineStats()
        self.timeline: deque[ChunkRecord] = deque(maxlen=4096)
        self._ids = itertools.count(1)
        self._cv = threading.Condition()
        self._swap_lock = threading.Lock()
        self._inbox: list[Request] = []
        self._cancels: list[int] = []
        self._handles: dict[int, RequestHandle] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._busy_until = time.monotonic()  # when the loop last had work
        self._idle_compiler: IdleCompiler | None = None  # warm_up's deferred programs (idle_compile.py)
        self._avals: tuple[nnx.State, KVCache] | None = None

    # ----- policy -----

    @property
    def version(self) -> int:
        return self._policy.version

    @property
    def state(self) -> nnx.State:
        return self._policy.state

    @property
    def versions(self) -> tuple[int, ...]:
        """The version served per adapter slot."""
        return self._policy.versions

    @property
    def published_state(self) -> nnx.State:
        """What a publish carries: the whole policy, or with LoRA its adapters alone (the base is
        this engine's own, loaded once and never replaced)."""
        return self.published_state_of(0)

    @property
    def published_scope(self) -> str:
        """What a publish this engine installs holds: "adapters" (LoRA) or "model" (the whole policy)."""
        return "model" if self.model_cfg.lora is None else "adapters"

    def published_state_of(self, adapter: int) -> nnx.State:
        """`published_state` of adapter slot `adapter`."""
        return published(self._policy, self.model_cfg, adapter)

    def swap(self, state: nnx.State, version: int, *, adapter: int = 0) -> None:
        """Installs new weights for the next engine step; one reference assignment, so a chunk
        sees old or new weights, never a mix. Raises ValueError for an old version or a state
        whose tree, shapes or dtypes differ (it would recompile every program). With LoRA,
        `state` may be the adapters alone (`published_state`'s shape): they join the served base
        unmerged, so the engine computes x@W + scale*(x@A)@B exactly as the trainer does. With
        several adapter slots, `adapter` names the slot replaced; the others serve on untouched."""
        with self._swap_lock:
            self._policy = replaced(self._policy, self.model_cfg, state, version, adapter)
            self.stats.swaps += 1

    # ----- requests -----

    @property
    def max_seq_len(self) -> int:
        return self.model_cfg.max_seq_len

    def submit(self, req: SamplingRequest, *, on_tokens: OnTokens | None = None,
               on_done: OnDone | None = None) -> RequestHandle:
        """Queues a request (thread-safe); raises ValueError for a bad one."""
        return self.submit_many([req], on_tokens=on_tokens, on_done=on_done)[0]

    def validate(self, req: SamplingRequest) -> None:
        """Raises ValueError naming what this engine refuses in `req` (what submit would raise)."""
        validate_request(req, self.config, vocab_size=self.model_cfg.vocab_size, max_seq_len=self.max_seq_len)
        if not 0 <= req.adapter < self.adapter_slots:
            raise ValueError(f"adapter {req.adapter}: this engine holds {self.adapter_slots} adapter slot(s)")
        if req.return_routing and routing_shape(self.model_cfg) is None:
            raise ValueError(f"return_routing: model {self.model_name!r} has no routed experts")

    def submit_many(self, reqs: list[SamplingRequest], *, on_tokens: OnTokens | None = None,
                    on_done: OnDone | Sequence[OnDone] | None = None) -> list[RequestHandle]:
        """Queues requests that the loop sees together (so they can share their first step);
        all are validated before any is queued. `on_done`: one callback for all, or one per request."""
        for req in reqs:
            self.validate(req)
        dones = list(on_done) if isinstance(on_done, Sequence) else [on_done] * len(reqs)
        if len(dones) != len(reqs):
            raise ValueError(f"{len(dones)} on_done callbacks for {len(reqs)} requests")
        requests = [self._request(req) for req in reqs]
        handles = [RequestHandle(r.id, on_tokens, done) for r, done in zip(requests, dones, strict=True)]
        self.start()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is stopped")
            self._handles.update((h.id, h) for h in handles)
            self._inbox.extend(requests)
            self.stats.requests += len(requests)
            self._cv.notify()
        return handles

    def _request(self, req: SamplingRequest) -> Request:
        if not isinstance(req.prompt, tuple):  # the prefix cache and the shared rows key on it (hashable)
            req = dataclasses.replace(req, prompt=tuple(int(t) for t in req.prompt))
        seed = req.seed if req.seed is not None else secrets.randbits(64)  # never a shared stream
        stop_ids = tuple(req.stop_token_ids) or (() if req.ignore_eos else (self.tokenizer.eos_id,))
        return Request(id=next(self._ids), params=req, seed=seed, stop_ids=stop_ids, submitted_at=time.perf_counter())

    def cancel(self, request_id: int) -> None:
        """Frees the request's slots at the next chunk boundary (thread-safe, idempotent)."""
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify()

    def generate(self, req: SamplingRequest, timeout: float | None = None) -> list[Sample]:
        """Blocking convenience: submit and wait."""
        return self.submit(req).result(timeout)

    def programs(self) -> int:
        """Distinct bucketed shapes run so far: the programs this engine needed."""
        return len(self.runner.shapes)

    def warm_up(self) -> int:
        """Compiles every program a request within this engine's limits can need, when they are
        at most `inference.warmup_programs` (before the engine takes traffic: the loop must not be
        running); returns how many it compiled. The limits decide the count: `max_prompt_tokens`,
        `max_tokens`, `max_batch`, `max_n` and `max_prefill_rows`."""
        limit = self.max_seq_len - 1
        keys = self.runner.program_set(max_prompt=min(self.config.max_prompt_tokens, limit),
                                       max_tokens=min(self.config.max_tokens, limit), recompute=self.preemptible)
        if len(keys) > self.config.warmup_programs:
            if self.config.compile_when_idle and self.config.warmup_programs > 0:  # 0: no warm-up at all
                self._idle_compiler = IdleCompiler(keys, idle_s=self._idle_s, compile_one=self._compile_ahead)
                self._avals = (abstract(self.state), abstract(self.runner.cache))
                self.runner.warm = set()  # filled as they compile; a shape used before its turn is late
                log.info("warm-up deferred: the limits allow %d programs (inference.warmup_programs = %d); they "
                         "compile while the engine is idle, or on first use", len(keys), self.config.warmup_programs,
                         extra={"programs": len(keys)})
                return 0
            log.warning("warm-up skipped: the limits allow %d programs (inference.warmup_programs = %d); they "
                        "compile on first use, mid-run. Tighten max_prompt_tokens, max_tokens, max_batch or "
                        "max_prefill_rows to the workload", len(keys), self.config.warmup_programs,
                        extra={"programs": len(keys)})
            return 0
        started = time.perf_counter()
        self.runner.warm_up(self.state, keys)
        log.info("warm-up: %d programs compiled in %.1fs", len(keys), time.perf_counter() - started,
                 extra={"programs": len(keys)})
        return len(keys)

    @property
    def preemptible(self) -> bool:
        """Whether samples may be preempted and resumed by a prefill of their prompt and tokens:
        partial rollouts, or fewer pages than every sequence at full length needs."""
        return self.recompute_on_swap or self.runner.pages < self.max_seqs * self.runner.table_len

    def _idle_s(self) -> float:
        """How long the engine has had nothing to do (0 while it has work)."""
        with self._cv:
            if self._inbox or self._cancels or self.scheduler.has_work():
                return 0.0
            return time.monotonic() - self._busy_until

    def _compile_ahead(self, key: Key) -> bool:
        """The idle compiler's job: compiles `key` unless a request already did."""
        assert self._avals is not None and self.runner.warm is not None
        if key in self.runner.shapes:
            return False
        with ahead_of_use(lambda: key not in self.runner.shapes):
            self.runner.compile_program(key, *self._avals)
        self.runner.warm.add(key)
        return True

    def metrics(self) -> dict[str, int | float]:
        """A snapshot for heartbeats and /metrics (read from another thread: plain ints only)."""
        s, pool, sched = self.stats, self.scheduler.pool, self.scheduler
        running = sched.running_seqs()
        return {
            "weight_version": self.version, "requests": s.requests, "generated_tokens": s.generated_tokens,
            "waiting": len(sched.waiting), "running": len(sched.running), "slots": self.max_seqs,
            "programs": self.programs(), "mean_batch": s.decode_rows / max(s.decode_chunks, 1),
            "largest_batch": s.largest_batch, "swaps": s.swaps, "batch_occupancy": running / self.max_seqs,
            "kv_pages": pool.num_pages, "kv_pages_used": pool.used_pages, "kv_page_size": pool.page_size,
            "kv_use": pool.used_pages / pool.num_pages, "kv_pages_cached": pool.cached_pages,
            "prefix_hit_rate": pool.stats.hit_rate, "prefix_hit_tokens": pool.stats.hit_tokens,
            "prefix_lookup_tokens": pool.stats.lookup_tokens, "prefix_evictions": pool.stats.evictions,
            "preemptions": sched.preemptions, "recomputed": s.recomputed, "aborted": s.aborted, "busy_s": round(s.busy_s, 3),
            "prefill_tokens": self.runner.prefill_tokens,
            "prefill_rows": self.runner.prefill_rows, "shared_prefills": self.runner.shared_prefills,
            "warm_programs": len(self.runner.warm or ()), "late_programs": len(self.runner.late),
        }

    # ----- the loop -----

    def start(self) -> None:
        with self._cv:
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._loop, name="inference-engine", daemon=True)
                self._thread.start()
        if self._idle_compiler is not None:
            self._idle_compiler.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stops the loop; requests still queued or running end with an error."""
        if self._idle_compiler is not None:
            self._idle_compiler.stop()
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(RuntimeError("the engine stopped"))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._inbox or self._cancels or self.scheduler.has_work()):
                    self._cv.wait()
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            for req in inbox:
                try:
                    self.scheduler.add(req)
                except Exception as e:  # that request alone: the loop must live on
                    self._fail_requests([req], e)
            for request_id in cancels:
                self._abort(request_id)
            started = time.perf_counter()
            try:
                self._step()
            except Exception as e:  # a device failure must not kill the loop: fail what ran, serve on
                log.exception("engine step failed; failing the running requests")
                self._fail_running(e)
            self.stats.busy_s += time.perf_counter() - started
            self._busy_until = time.monotonic()

    def _step(self) -> None:
        policy = self._policy  # read once: the whole step runs under one version
        if policy.versions != self._served_versions:
            if self.recompute_on_swap:  # only the swapped slots' samples: the others' KV is still theirs
                swapped = {slot for slot, (new, old) in enumerate(zip(policy.versions, self._served_versions,
                                                                      strict=True)) if new != old}
                self.stats.recomputed += self.scheduler.preempt_all(adapters=swapped)
            self._served_versions = policy.versions
        items = self.scheduler.schedule(policy.versions, steps=self.config.decode_steps)
        for req, error in self.scheduler.take_refused():
            log.error("request %d could not be scheduled (%s: %s); it fails alone", req.id, type(error).__name__, error)
            self._fail_requests([req], error)
        now = time.perf_counter()
        for item in items:
            for seq in item.seqs:
                seq.request.admitted_at = seq.request.admitted_at or now
        if items:
            self.stats.prefills += 1
            emitted = self.runner.prefill(policy.state, items)
            self.scheduler.pool.written()
            for em in emitted:
                self._apply(em, policy.versions[em.seq.request.params.adapter])
        self.scheduler.grow(self.config.decode_steps)
        seqs = self.scheduler.decoding()
        if not seqs:
            return
        positions = sum(s.position for s in seqs)
        started = time.perf_counter()
        emitted = self.runner.decode(policy.state, seqs)
        self.timeline.append(ChunkRecord(start=started, end=time.perf_counter(), steps=self.config.decode_steps,
                                          rows=len(seqs), positions=positions,
                                          version=policy.version))
        self.stats.decode_chunks += 1
        self.stats.decode_rows += len(seqs)
        self.stats.largest_batch = max(self.stats.largest_batch, len(seqs))
        for em in emitted:
            self._apply(em, policy.versions[em.seq.request.params.adapter])

    def _apply(self, em: Emitted, version: int) -> None:
        """The update half: new tokens, stop ids, max tokens, stop strings, then notify."""
        seq, req = em.seq, em.seq.request
        if not em.token_ids:
            return
        before = len(seq.token_ids)
        self.scheduler.append(seq, em.token_ids, em.logprobs, version)
        routing = req.params.return_routing
        if routing:
            assert em.experts is not None and len(em.experts) == len(em.token_ids), "the programs record experts"
            seq.experts.extend(em.experts)
        k = req.params.top_logprobs
        if k:  # the programs return the engine's K alternatives per token: the request's first k of them
            assert em.top_ids is not None and em.top_logprobs is not None, "the programs return top_logprobs"
            seq.top_ids.extend(em.top_ids[:, :k])
            seq.top_logprobs.extend(em.top_logprobs[:, :k])
        reason = None
        if seq.token_ids[-1] in req.stop_ids:
            reason = "stop"
        elif len(seq.token_ids) >= req.params.max_tokens:
            reason = "length"
        cut = stop_string_cut(self.tokenizer.decode, seq.token_ids, req.params.stop_strings, checked=before)
        if cut is not None:
            del seq.token_ids[cut:], seq.logprobs[cut:], seq.versions[cut:], seq.experts[cut:]
            del seq.top_ids[cut:], seq.top_logprobs[cut:]
            reason = "stop"
        self.stats.generated_tokens += len(seq.token_ids) - before
        if reason is not None:
            self.scheduler.finish(seq, reason)
        handle = self._handles.get(req.id)
        if handle is None:
            return
        handle._tokens(TokenDelta(sample=seq.index, token_ids=tuple(seq.token_ids[before:]),
                                  logprobs=tuple(seq.logprobs[before:]),
                                  policy_versions=tuple(seq.versions[before:]), finish_reason=reason,
                                  routed_experts=_stacked(seq.experts[before:], self.routing) if routing else None,
                                  **_top(seq, k, before)))
        if req.done:
            self._complete(req)

    def _complete(self, req: Request) -> None:
        handle = self._handles.pop(req.id, None)
        if handle is not None:
            now = time.perf_counter()
            queue_s = (req.admitted_at or now) - req.submitted_at  # an abort may come before admission
            engine_s = now - req.admitted_at if req.admitted_at else 0.0
            routing = self.routing if req.params.return_routing else None
            handle._done([_sample(seq, queue_s, engine_s, routing) for seq in req.seqs])

    def _abort(self, request_id: int) -> None:
        req = self.scheduler.abort(request_id)
        if req is not None:
            self.stats.aborted += 1
            self._complete(req)

    def _fail_running(self, error: BaseException) -> None:
        self._fail_requests(list(self.scheduler.iter_running()), error)
        # A failed program may have consumed the donated cache: start from a fresh one.
        self.scheduler.reset()
        self.runner.reset_cache()

    def _fail_requests(self, reqs: Sequence[Request], error: BaseException) -> None:
        """Ends each of `reqs` (waiting, running or never queued) with `error`."""
        for req in reqs:
            self.scheduler.abort(req.id)
            with self._cv:
                handle = self._handles.pop(req.id, None)
            if handle is not None:
                handle._done(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            handles, self._handles = self._handles, {}
            self._inbox.clear()
        for handle in handles.values():
            handle._done(error)


def _sample(seq: Seq, queue_s: float, engine_s: float, routing: tuple[int, int, int] | None = None) -> Sample:
    """`routing`: (routed layers, top_k, num_experts) when the request asked for its routing."""
    return Sample(token_ids=list(seq.token_ids), logprobs=list(seq.logprobs), policy_versions=list(seq.versions),
                  finish_reason=seq.finish_reason or "abort", queue_s=queue_s, engine_s=engine_s,
                  routed_experts=None if routing is None else _stacked(seq.experts, routing),
                  **_top(seq, seq.request.params.top_logprobs))


def _top(seq: Seq, k: int, start: int = 0) -> dict[str, np.ndarray | None]:
    """Sample's / TokenDelta's top_ids and top_logprobs from token `start` on: [tokens, k] each,
    None when the request asked for none (k = 0)."""
    if not k:
        return {"top_ids": None, "top_logprobs": None}
    ids, lps = seq.top_ids[start:], seq.top_logprobs[start:]
    return {"top_ids": np.stack(ids).astype(np.int32) if ids else np.zeros((0, k), np.int32),
            "top_logprobs": np.stack(lps).astype(np.float32) if lps else np.zeros((0, k), np.float32)}


def _stacked(experts: list, routing: tuple[int, int, int] | None) -> np.ndarray:
    """int32 [tokens, routed layers, top_k] of a sequence's per-token records."""
    assert routing is not None
    layers, top_k, _ = routing
    return np.stack(experts).astype(np.int32) if experts else np.zeros((0, layers, top_k), np.int32)
