"""Request bookkeeping for the engine, in plain Python (no jax): requests and their
states, the waiting queue, batch-slot assignment, host-page reservation and release,
admission, abort, finish and stop conditions.

Each engine step asks `Scheduler.schedule()` what to run: the requests admitted this step
(each with its slot, and its host pages reserved when the latent cache is offloaded), to
be prefilled, and the requests to decode. The runner executes that plan and the engine
hands every produced token back through `append`, which applies the stop conditions
(max_new_tokens, stop token ids) and frees slot and pages of a finished request. Nothing
here touches a device, so it is tested without a model (tests/engine/test_scheduler.py).

Admission is first come, first served: the head of the queue waits until a slot is free
and, offloaded, until the host pool has the pages for its whole context
(prompt + max_new_tokens); requests behind it wait too (no overtaking, so a long request
is never starved by short ones).

With data-parallel attention (`ranks` > 1, `jlco.parallel.data`) the slots are split in
`ranks` contiguous blocks and the host pool in one page pool per rank
(`RankedPages`): a request is pinned at admission to the rank, among those with a free
slot and room for its pages, whose host pool is least used (then: fewest running
requests, lowest rank), and keeps its slot and pages there until it ends.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from jlco.offload.pages import HostPoolFull, PageAllocator, RankedPages
from jlco.sampling.errors import REFUSALS, RequestError  # noqa: F401 (re-exported)
from jlco.sampling.params import SamplingParams, as_int, is_token

STATUSES = ("waiting", "running", "finished", "aborted")
FINISH_REASONS = ("length", "stop", "abort")
@dataclasses.dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()   # checked against the engine (`check_request`)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    status: str = "waiting"          # one of STATUSES
    slot: int | None = None
    finish_reason: str | None = None  # one of FINISH_REASONS once done
    num_drafted: int = 0             # speculative decoding: draft tokens proposed for it
    num_accepted: int = 0            # ... and accepted
    cached_tokens: int = 0           # prompt positions reused from the prefix cache
    # Filled by the runner: per prompt position 1..n-1 (logprob, [(id, logprob), ...]);
    # per generated token with alternatives, [(id, logprob), ...].
    prompt_logprob_out: list | None = None
    top_out: list = dataclasses.field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.status in ("finished", "aborted")

    @property
    def context_len(self) -> int:
        """Positions the request may occupy: prompt + every token it may generate."""
        return len(self.prompt) + self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. `prefills`: requests admitted this step, each with `slot` set (to
    be prefilled, in order, chunk by chunk over the following steps; a finished prefill
    emits the request's first token). `decodes`: the running requests whose prefill has
    finished (they hold a token to decode from), by slot."""
    prefills: tuple[Request, ...]
    decodes: tuple[Request, ...]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


@dataclasses.dataclass(frozen=True)
class RankStatus:
    """One data rank: requests in its slots, requests pinned to it so far, and the
    fraction of its host pages in use (None with the latent cache on device)."""
    running: int
    admitted: int
    host_usage: float | None


@dataclasses.dataclass(frozen=True)
class HostPoolStatus:
    """The host page pool: pages reserved, pages in all, tokens a page holds, and pages
    owned by no running request (a leak: should stay 0)."""
    used_pages: int
    num_pages: int
    page_size: int
    leaked_pages: int


@dataclasses.dataclass(frozen=True)
class AdmissionStatus:
    """Admission as it stands, for readers outside the engine thread (the server's
    health, queue bound and metrics): counts copied out of the scheduler, so a reader
    never walks its lists while the engine changes them. `pool_usage`, `watermarks`
    and `paused` are per pool ("host" offloaded, "device" = batch slots)."""
    waiting: int
    running: int
    slots: int
    pool_usage: dict[str, float]
    watermarks: dict[str, tuple[float, float] | None]
    paused: dict[str, bool]
    ranks: tuple[RankStatus, ...]
    host_pool: HostPoolStatus | None

    @property
    def free_slots(self) -> int:
        return self.slots - self.running

    def holding_pool(self) -> str | None:
        """The pool whose watermark holds admission: paused, or above its high watermark
        (the next step pauses it); None when admission is open."""
        for pool, paused in self.paused.items():
            marks = self.watermarks[pool]
            if marks is not None and (paused or self.pool_usage.get(pool, 0.0) > marks[0]):
                return pool
        return None


@dataclasses.dataclass(frozen=True)
class RequestFields:
    """A request as `check_request` accepted it: the prompt as Python ints and the
    sampling parameters checked against the engine (`SamplingParams.check`)."""
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()


def check_request(prompt: Sequence[int], max_new_tokens: int,
                  params: SamplingParams | None = None, *, vocab_size: int,
                  max_context_len: int) -> RequestFields:
    """The one check of a request against the engine, for every way in (queued, claimed
    after a PD import, prefilled for export): → RequestFields, or RequestError naming
    the first bad field. `params` (default: greedy) checked its own fields when made."""
    vocab = vocab_size
    prompt = [as_int(t) for t in prompt]
    if not prompt or not all(is_token(t, vocab) for t in prompt):
        raise RequestError(f"prompt: must be a non-empty list of token ids in 0..{vocab - 1}",
                           "prompt")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise RequestError(f"max_new_tokens={max_new_tokens!r}: allowed an integer >= 1",
                           "max_new_tokens")
    if len(prompt) + max_new_tokens > max_context_len:
        raise RequestError(f"len(prompt) + max_new_tokens = {len(prompt) + max_new_tokens} "
                           f"exceeds engine.max_context_len={max_context_len}",
                           "max_new_tokens", "too_long")
    if params is not None and not isinstance(params, SamplingParams):
        raise TypeError(f"params={params!r}: allowed a SamplingParams or None")
    params = SamplingParams() if params is None else params
    return RequestFields(prompt, max_new_tokens, params.check(vocab, max_new_tokens))


class Scheduler:
    """Slots and pages of one engine. `pages` is the offloaded host pool's allocator
    (None with the latent cache on device: then only slots limit admission)."""

    def __init__(self, num_slots: int, max_context_len: int, vocab_size: int,
                 pages: PageAllocator | RankedPages | None = None, *,
                 host_watermarks: tuple[float, float] | None = None,
                 device_watermarks: tuple[float, float] | None = None, ranks: int = 1):
        """host_watermarks / device_watermarks: (high, low) fractions of the host pool's
        pages / of the batch slots; above `high` admission pauses until usage is at most
        `low` again (None: no watermark). ranks: data-parallel attention ranks (slots
        split evenly; with pages, a RankedPages of as many ranks)."""
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots={num_slots!r}: allowed an integer >= 1")
        if not isinstance(ranks, int) or ranks < 1 or num_slots % ranks:
            raise ValueError(f"ranks={ranks!r}: allowed an integer >= 1 dividing "
                             f"num_slots={num_slots}")
        if ranks > 1 and pages is not None and len(getattr(pages, "ranks", ())) != ranks:
            raise ValueError(f"pages: a RankedPages of {ranks} ranks is needed with ranks={ranks}")
        self.num_ranks = ranks
        self.admitted_per_rank = [0] * ranks   # requests pinned to each rank so far
        for name, marks in (("host_watermarks", host_watermarks),
                            ("device_watermarks", device_watermarks)):
            if marks is not None and not 0 < marks[1] < marks[0] <= 1:
                raise ValueError(f"{name}={marks!r}: allowed (high, low) with 0 < low < "
                                 "high <= 1")
        self.watermarks = {"host": host_watermarks, "device": device_watermarks}
        self.paused = {"host": False, "device": False}
        self.max_context_len = max_context_len
        self.vocab_size = vocab_size
        self.pages = pages
        self.slots: list[Request | None] = [None] * num_slots
        self.waiting: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()

    # ---- requests -----------------------------------------------------------------
    def add(self, prompt: Sequence[int], max_new_tokens: int,
            params: SamplingParams | None = None) -> Request:
        """Check (`check_request`) and queue a request sampling with `params` (default:
        greedy); a bad field raises RequestError naming it."""
        f = check_request(prompt, max_new_tokens, params, vocab_size=self.vocab_size,
                          max_context_len=self.max_context_len)
        req = Request(next(self._ids), f.prompt, f.max_new_tokens, f.params)
        self.requests[req.id] = req
        self.waiting.append(req)
        return req

    def add_running(self, context_len: int, max_new_tokens: int) -> Request:
        """Admit, outside the queue, a request whose prefill happened elsewhere (a
        PD-disaggregated decode node): a free slot and pages for `context_len` +
        `max_new_tokens` positions now, or RequestError (kind "no_slot" / "no_pages"
        when it may fit later). Its prompt is unknown here (empty)."""
        if None not in self.slots:
            raise RequestError(f"no free batch slot (engine.max_batch_size={len(self.slots)})",
                               kind="no_slot")
        if context_len + max_new_tokens > self.max_context_len:
            raise RequestError(f"context {context_len} + max_new_tokens {max_new_tokens} "
                               f"exceeds engine.max_context_len={self.max_context_len}",
                               "max_new_tokens", "too_long")
        req = Request(next(self._ids), [], max_new_tokens)
        rank = self._choose_rank(context_len + max_new_tokens)
        try:
            self._reserve(req.id, context_len + max_new_tokens, 0 if rank is None else rank)
        except HostPoolFull as err:
            raise RequestError(str(err), kind="no_pages") from err
        self.requests[req.id] = req
        self._place(req, rank)
        return req

    def abort(self, request_id: int) -> None:
        """Abort a waiting or running request (unknown ids raise RequestError; a request
        already done is left as it is)."""
        self.finish(request_id, "abort")

    def finish(self, request_id: int, reason: str) -> None:
        """End a waiting or running request early: "abort" (status aborted) or "stop"
        (finished; the caller matched a stop string). Unknown ids raise RequestError; a
        request already done is left as it is."""
        if reason not in ("abort", "stop"):
            raise ValueError(f"reason={reason!r}: allowed 'abort' or 'stop'")
        req = self.requests.get(request_id)
        if req is None:
            raise RequestError(f"request_id={request_id!r}: no such request", "request_id",
                               "not_found")
        if req.done:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req, "aborted" if reason == "abort" else "finished", reason)

    # ---- one step -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Admit what fits (slots, then pages), and plan this step."""
        admitted = []
        while self.waiting and None in self.slots and self.admission_paused() is None:
            req = self.waiting[0]
            rank = self._choose_rank(req.context_len)
            if rank is None:
                break   # waits until pages come back
            self._reserve(req.id, req.context_len, rank)
            self.waiting.pop(0)
            self._place(req, rank)
            admitted.append(req)
        decodes = tuple(r for r in self.slots if r is not None and r.tokens)
        return SchedulerOutput(tuple(admitted), decodes)

    def pool_usage(self) -> dict[str, float]:
        """Fraction of each pool in use: host pages reserved (offload on), batch slots."""
        use = {"device": sum(r is not None for r in self.slots) / len(self.slots)}
        if self.pages is not None:
            use["host"] = self.pages.used_pages / self.pages.num_pages
        return use

    def admission_paused(self) -> str | None:
        """The pool ("host" or "device") whose watermark holds admission now, or None.
        Above a pool's high watermark admission pauses; it resumes at or below low."""
        for pool, frac in self.pool_usage().items():
            marks = self.watermarks[pool]
            if marks is None:
                continue
            high, low = marks
            if self.paused[pool] and frac <= low:
                self.paused[pool] = False
            elif not self.paused[pool] and frac > high:
                self.paused[pool] = True
        return next((p for p in ("host", "device") if self.paused[p]), None)

    def status(self) -> AdmissionStatus:
        """A copy of admission's counts (`AdmissionStatus`), safe to read off-thread."""
        slots = list(self.slots)
        live = {r.id for r in slots if r is not None}
        pool = None
        if self.pages is not None:
            leaked = sum(len(self.pages.pages_of(rid)) for rid in set(self.pages.requests) - live)
            pool = HostPoolStatus(self.pages.used_pages, self.pages.num_pages,
                                  self.pages.page_size, leaked)
        ranks = tuple(RankStatus(int(use["running"]), n, use.get("host"))
                      for use, n in zip(self.rank_usage(), list(self.admitted_per_rank)))
        return AdmissionStatus(
            waiting=len(self.waiting), running=sum(r is not None for r in slots),
            slots=len(slots), pool_usage=self.pool_usage(), watermarks=dict(self.watermarks),
            paused=dict(self.paused), ranks=ranks, host_pool=pool)

    def append(self, req: Request, token: int, logprob: float) -> bool:
        """Record one generated token; → True when it finished the request (its slot
        and pages are free again). Tokens for a request that is done are refused."""
        if req.status != "running":
            raise RequestError(f"request {req.id} is {req.status}: cannot take tokens")
        req.tokens.append(int(token))
        req.logprobs.append(float(logprob))
        c = req.params.constraint
        if c is not None:
            c.consume(int(token))
        if int(token) in req.params.stop_token_ids or (c is not None and c.stopped):
            self._release(req, "finished", "stop")
        elif len(req.tokens) >= req.max_new_tokens:
            self._release(req, "finished", "length")
        return req.done

    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    # ---- accounting ---------------------------------------------------------------
    def check_no_leaks(self) -> None:
        """Every slot and page is owned by a running request, and nothing else."""
        owners = [r.id for r in self.slots if r is not None]
        if len(owners) != len(set(owners)):
            raise AssertionError(f"a request holds two batch slots: {owners}")
        for i, r in enumerate(self.slots):
            if r is not None and (r.status != "running" or r.slot != i):
                raise AssertionError(f"slot {i} holds request {r.id} ({r.status}, slot {r.slot})")
        if self.pages is not None:
            self.pages.check(expect_requests=set(owners))

    def rank_of_slot(self, slot: int) -> int:
        return slot // (len(self.slots) // self.num_ranks)

    def rank_usage(self) -> list[dict[str, float]]:
        """Per data rank: running requests and, offloaded, the fraction of its host
        pages in use."""
        per = len(self.slots) // self.num_ranks
        out = []
        for r in range(self.num_ranks):
            use = {"running": float(sum(s is not None for s in self.slots[r * per:(r + 1) * per]))}
            if self.pages is not None:
                pool = self._pool(r)
                use["host"] = pool.used_pages / pool.num_pages
            out.append(use)
        return out

    def _pool(self, rank: int) -> PageAllocator:
        """The page pool of `rank` (the only one without data ranks)."""
        return self.pages.ranks[rank] if self.num_ranks > 1 else self.pages

    def _choose_rank(self, num_tokens: int) -> int | None:
        """The rank a new request of `num_tokens` positions goes to (a free slot and, with
        pages, room for them there; least-used host pool first), None when none fits."""
        per = len(self.slots) // self.num_ranks
        fits = []
        for r, use in enumerate(self.rank_usage()):
            if None not in self.slots[r * per:(r + 1) * per]:
                continue
            if self.pages is not None:
                pool = self._pool(r)
                if pool.pages_needed(num_tokens) > pool.free_pages:
                    continue
            fits.append((use.get("host", 0.0), use["running"], r))
        return min(fits)[2] if fits else None

    def _reserve(self, request_id: int, num_tokens: int, rank: int) -> None:
        if self.pages is None:
            return
        if self.num_ranks > 1:
            self.pages.reserve(request_id, num_tokens, rank)
        else:
            self.pages.reserve(request_id, num_tokens)

    def _place(self, req: Request, rank: int | None = None) -> None:
        per = len(self.slots) // self.num_ranks
        lo = 0 if rank is None else rank * per
        slot = self.slots.index(None, lo, len(self.slots) if rank is None else lo + per)
        req.slot, req.status = slot, "running"
        self.slots[slot] = req
        self.admitted_per_rank[self.rank_of_slot(slot)] += 1

    def _release(self, req: Request, status: str, reason: str) -> None:
        req.status, req.finish_reason = status, reason
        if req.slot is not None:
            self.slots[req.slot] = None
            req.slot = None
        if self.pages is not None and req.id in self.pages.requests:
            self.pages.release(req.id)
