"""Continuous batching over a paged KV cache: who waits, who runs, who holds which pages. No JAX,
no gRPC.

The engine loop is vLLM v1's: `schedule()` admits waiting requests while pages and the step's
prefill budget last (they are prefilled this step), `grow()` gives every running sequence the
pages its next decode chunk writes, the runner executes one prefill and one decode chunk, and
the engine reports tokens back with `append` / `finish`, which give pages back.

A request is admitted whole (its n samples share one prefill and the prompt's full pages) and in
arrival order: when the head of the queue does not fit, the requests behind it wait too, so a
large request is never starved by a stream of small ones. A full engine queues requests, it never
fails them. When a decode chunk needs pages and none are free, the most recently admitted request
is preempted by recompute (vLLM's default): its full pages go to the prefix cache, it goes back
to the head of the queue with every token it generated, and on readmission each unfinished sample
is prefilled again from its prompt and tokens (mostly cache hits) and goes on with the same random
stream (`PrefillItem.count`). The same recompute continues in-flight samples on new weights at a
swap (`preempt_all`: partial rollouts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from services.inference.pages import PagePool, page_keys, salt_of
from services.inference.requests import SamplingRequest


@dataclass(eq=False, kw_only=True)
class Sequence:
    """One sample of a request while it runs; the engine thread owns it."""

    request: Request
    index: int
    pages: list[int] = field(default_factory=list)
    """Its page table: page i holds positions [i * page_size, (i + 1) * page_size)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    experts: list = field(default_factory=list)
    """With SamplingRequest.return_routing: per token, the experts its predicting position went
    to (numpy int [routed layers, top_k]; routing replay), cut with the tokens."""
    top_ids: list = field(default_factory=list)
    """With SamplingRequest.top_logprobs K > 0: per token, its K most likely tokens (numpy int32
    [K]), cut with the tokens."""
    top_logprobs: list = field(default_factory=list)
    """Their logprobs, per token (numpy float32 [K]), cut with the tokens."""
    kv_versions: set[int] = field(default_factory=set)
    """Policy versions that wrote its KV (its pages are cached for reuse only when it is one)."""
    finish_reason: str | None = None

    @property
    def position(self) -> int:
        """Where the newest token is fed next; the KV is valid below it."""
        return len(self.request.params.prompt) + len(self.token_ids) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> tuple[int, ...]:
        return (*self.request.params.prompt, *self.token_ids)


@dataclass(eq=False, kw_only=True)
class Request:
    id: int
    params: SamplingRequest
    seed: int
    stop_ids: tuple[int, ...]
    seqs: list[Sequence] = field(default_factory=list)
    submitted_at: float = 0.0
    """time.perf_counter() when the engine took the request, and when a step admitted it."""
    admitted_at: float = 0.0
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.seqs = [Sequence(request=self, index=i) for i in range(self.params.n)]

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def resuming(self) -> bool:
        return any(s.token_ids for s in self.seqs)


@dataclass(eq=False, kw_only=True)
class PrefillItem:
    """One prompt row of a step's prefill: its KV from `start` on, and the first token of each
    of `seqs` (they read the row and share its full pages)."""

    tokens: tuple[int, ...]
    start: int
    adapter: int
    seqs: list[Sequence]
    count: int = 0
    """Index of the token sampled in its sample: 0 for a new request, the tokens it already has
    for a resumed one (its random stream goes on where it stopped)."""


@dataclass(kw_only=True, slots=True)
class _Plan:
    item: PrefillItem
    shared: list[int]
    """Cached pages the row starts from (held once more by each of its samples)."""
    fresh_shared: int
    """New full pages written by this prefill and shared by its samples."""
    private: int
    """Pages each sample takes for itself (its partial page and the first decode position's)."""
    rides: bool = False
    """It reads a row planned earlier in the step (the same prompt): no prefill of its own."""
    looked: int = 0
    """Full pages its prefix-cache lookup walked (the prefix stats count them at admission)."""

    @property
    def prefill_tokens(self) -> int:
        return 0 if self.rides else len(self.item.tokens) - self.item.start

    @property
    def pages(self) -> int:
        return self.fresh_shared + self.private * len(self.item.seqs)


def _no_bucket_limit(length: int, start: int) -> int:
    return start


class Scheduler:
    def __init__(self, *, max_seqs: int, prefill_tokens: int, pool: PagePool,
                 prefill_start: Callable[[int, int], int] = _no_bucket_limit) -> None:
        """`max_seqs`: sequences decoded together at most. `prefill_start(length, cached)`: where a
        prompt of `length` tokens with `cached` tokens found in the cache starts its prefill (the
        runner's buckets may give a reuse up: `Buckets.prefill_shape`)."""
        if max_seqs < 1 or prefill_tokens < 1:
            raise ValueError("Scheduler: max_seqs and prefill_tokens must be >= 1")
        self.max_seqs = max_seqs
        self.prefill_tokens = prefill_tokens
        self.pool = pool
        self._prefill_start = prefill_start
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.preemptions = 0
        self._planned: dict[tuple[int, tuple[int, ...]], _Plan] = {}
        self._refused: list[tuple[Request, Exception]] = []

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def running_seqs(self) -> int:
        return sum(1 for r in self.running.values() for s in r.seqs if not s.finished)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        if req.params.n > self.max_seqs:
            raise ValueError(f"n={req.params.n} exceeds the engine's {self.max_seqs} sequences in flight")
        self.waiting.append(req)

    # ----- admission -----

    def schedule(self, versions: tuple[int, ...], *, steps: int = 0) -> list[PrefillItem]:
        """Admits waiting requests, in order, while sequences, pages and this step's prefill budget
        last; returns the prefill rows to run. `versions`: the version served per adapter slot.
        `steps`: the decode chunk that follows; the pages its growth takes (`grow`), the running
        sequences' and the admitted ones', are kept free, so a request is never admitted only to
        be preempted for them before its first chunk (its prefill wasted)."""
        items: list[PrefillItem] = []
        budget = self.prefill_tokens
        self._planned.clear()
        keep = self._growth(steps)
        in_flight = self.running_seqs()
        while self.waiting:
            req = self.waiting[0]
            live = [s for s in req.seqs if not s.finished]
            if in_flight + len(live) > self.max_seqs:
                break
            try:
                plans = self._plans(req, live, versions[req.params.adapter])
            except Exception as e:  # nothing taken yet: that request leaves alone, the queue moves on
                self.waiting.popleft()
                self._refused.append((req, e))
                continue
            if plans is None:  # it would read pages this step's prefill has yet to write
                break
            tokens = sum(p.prefill_tokens for p in plans)
            if items and tokens > budget:
                break
            growth = sum(len(p.item.seqs) * self._first_growth(len(p.item.tokens), steps) for p in plans)
            if not self._take_pages(plans, keep=keep + growth):
                break
            keep += growth
            in_flight += len(live)
            self.waiting.popleft()
            self.running[req.id] = req
            for plan in plans:
                self._register_prompt(plan, versions[req.params.adapter])
                if not plan.rides:
                    self.pool.count_lookup(plan.looked, len(plan.shared))
            budget -= tokens
            items += [p.item for p in plans]
        return items

    def take_refused(self) -> list[tuple[Request, Exception]]:
        """Requests `schedule` could not plan (each with why), taken out of the queue; once each."""
        refused, self._refused = self._refused, []
        return refused

    def _plans(self, req: Request, live: list[Sequence], version: int) -> list[_Plan] | None:
        adapter = req.params.adapter
        if not req.resuming:
            same = self._planned.get((adapter, req.params.prompt))
            if same is not None:  # same prompt, same step: ride on the row planned first
                item = PrefillItem(tokens=same.item.tokens, start=same.item.start, adapter=adapter, seqs=live)
                prefix = same.item.seqs[0].pages[: len(same.shared) + same.fresh_shared]
                return [_Plan(item=item, shared=prefix, fresh_shared=0, private=same.private, rides=True)]
            plan = self._plan(req.params.prompt, live, adapter, version, count=0)
            return None if plan is None else [plan]
        plans = []
        for seq in live:  # each resumed sample has tokens of its own: a row each
            plan = self._plan(seq.tokens, [seq], adapter, version, count=len(seq.token_ids))
            if plan is None:
                return None
            plans.append(plan)
        return plans

    def _plan(self, tokens: tuple[int, ...], seqs: list[Sequence], adapter: int, version: int,
              *, count: int) -> _Plan | None:
        size, length = self.page_size, len(tokens)
        # At least the last token is prefilled: its logits give the token sampled next.
        keys = page_keys(tokens, size, salt=salt_of(adapter, version), pages=(length - 1) // size)
        cached, blocked = self.pool.lookup(keys)
        if blocked:
            return None
        start = self._prefill_start(length, len(cached) * size)
        cached = cached[: start // size]
        full = length // size
        item = PrefillItem(tokens=tokens, start=len(cached) * size, adapter=adapter, seqs=seqs, count=count)
        return _Plan(item=item, shared=cached, fresh_shared=full - len(cached),
                     private=self.pool.pages_for(length + 1) - full, looked=len(keys))

    def _growth(self, steps: int) -> int:
        """Pages the running sequences take for a decode chunk of `steps` (0: none)."""
        if steps <= 0:
            return 0
        return sum(max(self.pool.pages_for(seq.position + steps) - len(seq.pages), 0)
                   for req in self.running.values() for seq in req.seqs if not seq.finished and seq.token_ids)

    def _first_growth(self, length: int, steps: int) -> int:
        """Pages a sample prefilled over `length` tokens takes for its first decode chunk, past
        the first decode position's page it is admitted with."""
        return max(self.pool.pages_for(length + steps) - self.pool.pages_for(length + 1), 0) if steps > 0 else 0

    def _take_pages(self, plans: list[_Plan], *, keep: int = 0) -> bool:
        """Gives the plans' samples their pages, leaving `keep` pages free; False (nothing taken)
        when the pool cannot."""
        # Cached pages are held before the allocation, which would otherwise evict idle ones.
        for plan in plans:
            self.pool.acquire(plan.shared, times=len(plan.item.seqs))
        need = sum(p.pages for p in plans)
        pages = self.pool.allocate(need) if self.pool.free_pages - need >= keep else None
        if pages is None:
            for plan in plans:
                for _ in plan.item.seqs:
                    self.pool.release(plan.shared)
            return False
        for plan in plans:
            n = len(plan.item.seqs)
            fresh, pages = pages[: plan.fresh_shared], pages[plan.fresh_shared:]
            self.pool.acquire(fresh, times=n - 1)  # allocate held each once
            for seq in plan.item.seqs:
                own, pages = pages[: plan.private], pages[plan.private:]
                seq.pages = [*plan.shared, *fresh, *own]
                seq.kv_versions = set()
        return True

    def _register_prompt(self, plan: _Plan, version: int) -> None:
        """Names the prompt's new full pages now (pending until the prefill writes them), so the
        requests of the next steps that share the prefix find them."""
        item = plan.item
        keys = page_keys(item.tokens, self.page_size, salt=salt_of(item.adapter, version))
        table = item.seqs[0].pages
        for i in range(len(plan.shared), len(plan.shared) + plan.fresh_shared):
            self.pool.register(keys[i], table[i], pending=True)
        for seq in item.seqs:
            seq.kv_versions.add(version)
        if item.count == 0:
            self._planned.setdefault((item.adapter, item.tokens), plan)

    # ----- decoding -----

    def grow(self, steps: int) -> None:
        """Gives every running sequence the pages its next `steps` positions need, preempting the
        most recently admitted requests while the pool cannot."""
        for req in list(self.running.values()):
            for seq in req.seqs:
                if seq.finished or not seq.token_ids or req.id not in self.running:
                    continue
                need = self.pool.pages_for(seq.position + steps) - len(seq.pages)
                while need > 0:
                    pages = self.pool.allocate(need)
                    if pages is not None:
                        seq.pages += pages
                        break
                    victim = next(reversed(self.running.values()))
                    self.preempt(victim)
                    if victim is req:
                        break
                    need = self.pool.pages_for(seq.position + steps) - len(seq.pages)

    def decoding(self) -> list[Sequence]:
        """Every running sequence with a token to feed, in admission order."""
        return [s for r in self.running.values() for s in r.seqs if not s.finished and s.token_ids]

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[float], version: int) -> None:
        seq.token_ids.extend(tokens)
        seq.logprobs.extend(logprobs)
        seq.versions.extend([version] * len(tokens))
        seq.kv_versions.add(version)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sample and gives its pages back (its full pages stay cached for reuse)."""
        assert not seq.finished, "a sample finishes once"
        seq.finish_reason = reason
        self._release(seq)
        if seq.request.done:
            self.running.pop(seq.request.id, None)

    def preempt(self, req: Request) -> None:
        """Gives back the pages of a running request and queues it first, to be recomputed."""
        self.running.pop(req.id, None)
        for seq in req.seqs:
            self._release(seq)
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def preempt_all(self, adapters: Collection[int] | None = None) -> int:
        """Preempts every running request (their KV is recomputed on the weights served next), or
        those of the adapter slots `adapters` (the slots a swap replaced); returns how many."""
        reqs = [r for r in self.running.values() if adapters is None or r.params.adapter in adapters]
        for req in reversed(reqs):  # the earliest admitted ends up first in the queue
            self.preempt(req)
        return len(reqs)

    def abort(self, request_id: int) -> Request | None:
        """Drops a waiting or running request at once; returns it, or None if unknown or done."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                for seq in req.seqs:
                    if not seq.finished:
                        seq.finish_reason = "abort"
                return req
        req = self.running.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self._release(seq)
        return req

    def reset(self) -> None:
        """Forgets every page (the device pool was replaced); running requests must be gone."""
        self.pool.reset()

    def iter_running(self) -> Iterator[Request]:
        return iter(list(self.running.values()))

    def _release(self, seq: Sequence) -> None:
        pages, seq.pages = seq.pages, []
        if not pages:
            return
        if len(seq.kv_versions) == 1:  # one version wrote all of it: the full pages are reusable
            valid = seq.tokens[: max(seq.position, 0)]
            keys = page_keys(valid, self.page_size, salt=salt_of(seq.request.params.adapter,
                                                                 next(iter(seq.kv_versions))))
            for key, page in zip(keys, pages, strict=False):
                self.pool.register(key, page)
        self.pool.release(pages)
