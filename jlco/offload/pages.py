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
