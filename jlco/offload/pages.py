"""Host page allocator: every page of the host latent pool has exactly one owner.

Pages are the unit of host-pool ownership (docs/architecture.md "Memory and admission"): a
request owns the pages that hold its latent rows, finishing or aborting it returns all
of them, and a leak is a bug `check()` catches. Host row id = page * page_size + offset.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterable, Sequence

import numpy as np


class HostPoolFull(RuntimeError):
    """Not enough free host pages for a request; the message names request and counts."""


class PageLeakError(AssertionError):
    """Page accounting is inconsistent (a page owned twice, lost, or never returned)."""


class PageAllocator:
    """Pages of one host pool, handed out lowest-id first (deterministic layouts)."""

    def __init__(self, num_pages: int, page_size: int):
        for name, v in (("num_pages", num_pages), ("page_size", page_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"PageAllocator: {name}={v!r} is invalid: allowed a positive integer")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages))  # a heap
        self._owner: list[Hashable | None] = [None] * num_pages
        self._pages: dict[Hashable, list[int]] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def requests(self) -> tuple[Hashable, ...]:
        return tuple(self._pages)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_of(self, request_id: Hashable) -> tuple[int, ...]:
        return tuple(self._pages.get(request_id, ()))

    def owner_of(self, page: int) -> Hashable | None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"owner_of: page={page} is invalid: allowed 0..{self.num_pages - 1}")
        return self._owner[page]

    def reserve(self, request_id: Hashable, num_tokens: int) -> tuple[int, ...]:
        """Grow `request_id`'s pages so they hold `num_tokens` tokens IN TOTAL (idempotent:
        the engine passes the context length it is about to reach). All-or-nothing."""
        if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"reserve: num_tokens={num_tokens!r} is invalid: allowed an integer >= 0")
        if request_id is None:
            raise ValueError("reserve: request_id=None is invalid: None marks an empty batch slot")
        pages = self._pages.setdefault(request_id, [])
        extra = self.pages_needed(int(num_tokens)) - len(pages)
        if extra > len(self._free):
            if not pages:
                del self._pages[request_id]
            raise HostPoolFull(
                f"host pool full: request {request_id!r} needs {extra} more page(s) "
                f"({num_tokens} tokens, page_size {self.page_size}) but only "
                f"{len(self._free)} of {self.num_pages} are free")
        for _ in range(max(extra, 0)):
            p = heapq.heappop(self._free)
            self._owner[p] = request_id
            pages.append(p)
        return tuple(pages)

    def release(self, request_id: Hashable) -> int:
        """Return every page of a finished, aborted or failed request; unknown ids are a
        no-op (abort may race with finish). Returns the number of pages freed."""
        pages = self._pages.pop(request_id, [])
        for p in pages:
            self._owner[p] = None
            heapq.heappush(self._free, p)
        return len(pages)

    def page_table(self, request_ids: Sequence[Hashable | None], max_pages: int) -> np.ndarray:
        """int32 [b, max_pages]: row i lists request_ids[i]'s pages in token order, −1
        past its end (None = an empty batch slot, all −1)."""
        table = np.full((len(request_ids), max_pages), -1, np.int32)
        for i, rid in enumerate(request_ids):
            if rid is None:
                continue
            pages = self._pages.get(rid)
            if pages is None:
                raise KeyError(f"page_table: request {rid!r} holds no pages")
            if len(pages) > max_pages:
                raise ValueError(f"page_table: request {rid!r} holds {len(pages)} pages, "
                                 f"more than max_pages={max_pages}")
            table[i, :len(pages)] = pages
        return table

    def check(self, expect_requests: Iterable[Hashable] | None = None) -> None:
        """Raise PageLeakError unless every page is free xor owned by exactly one live
        request (and, if given, the live requests are exactly `expect_requests`)."""
        owned = [p for ps in self._pages.values() for p in ps]
        if len(owned) != len(set(owned)):
            raise PageLeakError("a page is listed under more than one request")
        if set(owned) & set(self._free) or len(owned) + len(self._free) != self.num_pages:
            raise PageLeakError(f"pages lost: {len(owned)} owned + {len(self._free)} free "
                                f"!= {self.num_pages}")
        for rid, ps in self._pages.items():
            if any(self._owner[p] != rid for p in ps):
                raise PageLeakError(f"owner table disagrees with request {rid!r}'s pages")
        if any(self._owner[p] is not None for p in self._free):
            raise PageLeakError("a free page still names an owner")
        if expect_requests is not None and set(self._pages) != set(expect_requests):
            raise PageLeakError(f"live requests {sorted(map(repr, self._pages))} != expected "
                                f"{sorted(map(repr, expect_requests))}")


class RankedPages:
    """The host pools of `ranks` data ranks (`jlco.parallel.data`), one PageAllocator of
    `pages_per_rank` pages each: a request's pages all come from the rank it is pinned to
    at its first `reserve`, and its page ids are local to that rank's pool block. Counts
    (num_pages, free_pages, used_pages) are over all ranks; the PageAllocator interface
    otherwise holds, so one-rank engines and tests read both alike."""

    def __init__(self, ranks: int, pages_per_rank: int, page_size: int):
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ValueError(f"RankedPages: ranks={ranks!r} is invalid: allowed an integer >= 1")
        self.ranks = [PageAllocator(pages_per_rank, page_size) for _ in range(ranks)]
        self.page_size = page_size
        self.pages_per_rank = pages_per_rank
        self.num_pages = ranks * pages_per_rank
        self._rank: dict[Hashable, int] = {}

    @property
    def free_pages(self) -> int:
        return sum(a.free_pages for a in self.ranks)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    @property
    def requests(self) -> tuple[Hashable, ...]:
        return tuple(self._rank)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def rank_of(self, request_id: Hashable) -> int | None:
        return self._rank.get(request_id)

    def usage(self, rank: int) -> float:
        """Fraction of `rank`'s pages in use."""
        a = self.ranks[rank]
        return a.used_pages / a.num_pages

    def pages_of(self, request_id: Hashable) -> tuple[int, ...]:
        r = self._rank.get(request_id)
        return () if r is None else self.ranks[r].pages_of(request_id)

    def reserve(self, request_id: Hashable, num_tokens: int, rank: int | None = None
                ) -> tuple[int, ...]:
        """PageAllocator.reserve on the request's rank: the one it already holds pages on,
        else `rank`, else the rank with the most free pages. Page ids are rank-local."""
        held = self._rank.get(request_id)
        if held is not None and rank is not None and rank != held:
            raise ValueError(f"reserve: request {request_id!r} holds pages on rank {held}, "
                             f"not rank {rank}")
        if held is None and rank is None:
            rank = max(range(len(self.ranks)), key=lambda r: (self.ranks[r].free_pages, -r))
        r = held if held is not None else rank
        if not 0 <= r < len(self.ranks):
            raise ValueError(f"reserve: rank={r!r} is invalid: allowed 0..{len(self.ranks) - 1}")
        pages = self.ranks[r].reserve(request_id, num_tokens)
        self._rank[request_id] = r
        return pages

    def release(self, request_id: Hashable) -> int:
        r = self._rank.pop(request_id, None)
        return 0 if r is None else self.ranks[r].release(request_id)

    def page_table(self, request_ids: Sequence[Hashable | None], max_pages: int) -> np.ndarray:
        """As PageAllocator.page_table, with each request's rank-local page ids."""
        table = np.full((len(request_ids), max_pages), -1, np.int32)
        for i, rid in enumerate(request_ids):
            if rid is None:
                continue
            r = self._rank.get(rid)
            if r is None:
                raise KeyError(f"page_table: request {rid!r} holds no pages")
            table[i] = self.ranks[r].page_table([rid], max_pages)[0]
        return table

    def check(self, expect_requests: Iterable[Hashable] | None = None) -> None:
        for r, a in enumerate(self.ranks):
            a.check(expect_requests=None)
            if set(a.requests) != {rid for rid, k in self._rank.items() if k == r}:
                raise PageLeakError(f"rank {r}: its pool's requests disagree with the rank map")
        if expect_requests is not None and set(self._rank) != set(expect_requests):
            raise PageLeakError(f"live requests {sorted(map(repr, self._rank))} != expected "
                                f"{sorted(map(repr, expect_requests))}")
