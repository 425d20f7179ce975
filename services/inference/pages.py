"""The paged KV cache's bookkeeping: which device page holds what, who holds it, and the prefix
cache over full pages. Pure Python, no JAX: the runner only sees page tables.

A sequence's KV lives in fixed-size pages listed by its page table; it takes a page when it
grows into one and gives every page back when it ends, so the batch in flight is bounded by the
pages free, not by slots x max_seq_len. Page 0 is the null page: table entries past a sequence's
pages point at it, so padding rows and the positions a bucketed write runs past land there.

Prefix cache (vLLM's automatic prefix caching): a page that is FULL of KV written under one
(adapter, weight version) is content-addressed by a chained digest of every token up to its end
(`page_keys`). A later request whose prompt starts with the same tokens under the same version
finds those pages and shares them by reference (refcounted): the G samples of a group, a system
prompt and tool schemas every episode repeats, an episode's earlier turns. Only full pages are
shared, so sharing never needs a copy: the partial page at a prompt's end is each sequence's own
(the copy-on-write point is the page boundary before the first differing token; the few tokens
past it are prefilled again). The version is in the key, so a weight swap invalidates nothing
explicitly: the old version's pages stop matching and are evicted first as they age.

A page no sequence holds but the cache names stays resident ("idle") until a new allocation
needs it: idle pages are evicted least recently used first, after the never-cached free ones.
Pages written by the prefill of the step being scheduled are "pending": a request that would
read one in the same step waits one step (the prefill writes them after the step's reads).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

NULL_PAGE = 0


def page_keys(tokens: Sequence[int], page_size: int, *, salt: bytes, pages: int | None = None) -> list[bytes]:
    """Chained digests of the first `pages` full pages of `tokens` (default: every full page):
    key i names the KV of tokens[0 : (i+1) * page_size] under `salt` (adapter and version)."""
    full = len(tokens) // page_size if pages is None else min(pages, len(tokens) // page_size)
    keys, prev = [], salt
    for i in range(full):
        chunk = tokens[i * page_size:(i + 1) * page_size]
        prev = hashlib.blake2b(prev + b"".join(t.to_bytes(4, "little", signed=True) for t in chunk),
                               digest_size=16).digest()
        keys.append(prev)
    return keys


def salt_of(adapter: int, version: int) -> bytes:
    return f"{adapter}:{version}".encode()


@dataclass(kw_only=True, slots=True)
class PrefixStats:
    lookup_tokens: int = 0
    """Prompt tokens that could have come from the cache (every full page a lookup walked)."""
    hit_tokens: int = 0
    """Of those, the tokens whose KV was found (not prefilled again)."""
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class PagePool:
    """Pages 1..num_pages of the device pool (0 is the null page)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"PagePool: num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.stats = PrefixStats()
        self.reset()

    def reset(self) -> None:
        """Forgets everything (the device pool was replaced: no page holds valid KV)."""
        self._free = list(range(self.num_pages, 0, -1))  # pop() gives the lowest page first
        self._refs = [0] * (self.num_pages + 1)
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        self.pending: set[int] = set()

    @property
    def free_pages(self) -> int:
        """Pages an allocation can take now (never used, or idle in the cache)."""
        return len(self._free) + len(self._idle)

    @property
    def used_pages(self) -> int:
        """Pages some sequence holds."""
        return self.num_pages - self.free_pages

    @property
    def cached_pages(self) -> int:
        return len(self._page_of)

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages, each held once; None (and nothing taken) when fewer are free."""
        if n > self.free_pages:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._idle.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
                self.stats.evictions += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def lookup(self, keys: Sequence[bytes]) -> tuple[list[int], bool]:
        """(the cached pages of the longest run of `keys` from the first, whether the run stopped
        at a page still pending this step). Takes nothing and counts nothing: a request waiting for
        pages looks up again every step, so the scheduler counts a lookup once, when it admits
        (`count_lookup`)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            if page in self.pending:
                return pages, True
            pages.append(page)
        return pages, False

    def count_lookup(self, looked: int, hit: int) -> None:
        """An admitted prompt walked `looked` full pages and reads `hit` of them from the cache."""
        self.stats.lookup_tokens += looked * self.page_size
        self.stats.hit_tokens += hit * self.page_size

    def acquire(self, pages: Sequence[int], times: int = 1) -> None:
        """Holds cached `pages` `times` more times (each sequence that reads them holds them once)."""
        for page in pages:
            if self._refs[page] == 0:
                self._idle.pop(page, None)
            self._refs[page] += times

    def release(self, pages: Sequence[int]) -> None:
        for page in pages:
            assert self._refs[page] > 0, f"page {page} released more often than held"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def register(self, key: bytes, page: int, *, pending: bool = False) -> bool:
        """Names a held, full page by its key; False when the key already names another page (two
        sequences wrote the same prefix: the later copy stays private and is freed with them)."""
        if key in self._page_of or page in self._key_of:
            return self._page_of.get(key) == page
        self._page_of[key], self._key_of[page] = page, key
        if pending:
            self.pending.add(page)
        return True

    def written(self) -> None:
        """The step's prefill ran: its pages now hold what their keys say."""
        self.pending.clear()

    def holders(self, page: int) -> int:
        return self._refs[page]
