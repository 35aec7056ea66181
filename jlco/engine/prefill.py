"""A request's prefill as the runner runs it: alone, on a one-request device cache, in
pieces fixed by position (`jlco.util.buckets.prompt_pieces`: chunk shapes change float
reduction order, and offload on must equal offload off, a served request the same request
alone, a reused prefix the prefill it replaces, bit for bit), resuming after a reused
prefix (`jlco.engine.prefix`), with the last queries' top-k sets recorded to warm the hot
buffer at admission.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jlco.config import Config
from jlco.engine.scheduler import Request
from jlco.model.kv_cache import DecodeCache, cache_layers, init_cache
from jlco.sampling.sample import first_token, position_logprobs
from jlco.util.buckets import (  # noqa: F401
    MIN_PIECE,
    WARMUP_QUERIES,
    piece_grid,
    prompt_pieces,
    record_rows,
)


@dataclasses.dataclass(eq=False)
class PrefillJob:
    """A request's prefill in progress: its one-request cache and the prompt pieces
    (lo, hi, chunk shape) still to run."""
    req: Request
    page_row: np.ndarray | None
    cache: DecodeCache | None                 # its own [1, max_len] cache, while it runs
    tokens: np.ndarray                        # int32 [1, n]
    pieces: list[tuple[int, int, int]]
    record: bool = False                      # keep the last piece's top-k sets
    max_len: int = 0                          # the cache's positions
    done_pieces: int = 0
    logits: jax.Array | None = None           # at the last prompt position so far
    hidden: jax.Array | None = None           # its final hidden state [1, d]
    warmup: int = 0                           # queries whose top-k warm the hot buffer
    hit: object = None                        # the reused prefix (`prefix.PrefixHit`)
    piece_hidden: jax.Array | None = None     # MTP: the last piece's hidden [1, w, d]
    prev_records: list = dataclasses.field(default_factory=list)  # earlier pieces' records
    prompt_lp: list = dataclasses.field(default_factory=list)     # per piece, when echoing

    def reuse(self, hit) -> None:
        """Skip the pieces a reused prefix (`prefix.PrefixHit`) covers; before the first
        piece runs (matched then, not at admission: a prompt admitted beside the one that
        will cache its prefix finds it once that one has finished)."""
        assert self.done_pieces == 0 and self.cache is None, "reuse: the prefill has started"
        if hit.tokens:
            self.pieces = [p for p in self.pieces if p[0] >= hit.tokens]
            self.hit = hit

    @property
    def resume(self) -> int:
        """Prompt positions reused from the prefix cache (the first piece's lo)."""
        return self.pieces[0][0] if self.pieces else 0

    @property
    def finished(self) -> bool:
        return self.done_pieces == len(self.pieces)

    @property
    def pending_cost(self) -> int:
        """Padded prompt positions left to compute."""
        return sum(c for _, _, c in self.pieces[self.done_pieces:])

    def recording(self, cfg: Config, cache: DecodeCache) -> DecodeCache:
        """The cache for the next piece: with an empty record buffer when it records."""
        shape = self.record_shape(self.done_pieces)
        return cache if shape is None else with_record(cfg, cache, *shape)

    def piece_done(self, hidden, logits_fn, model) -> None:
        """After a piece (its hidden states [1, chunk, d]): a recording piece before the
        last hands its record over (the next piece compiles without one); a request
        echoing its prompt keeps the piece's prompt log-probs (`position_logprobs` of
        `logits_fn(*model, hidden)`); the last keeps `piece_hidden` (MTP fix-up)."""
        lo, hi, width = self.pieces[self.done_pieces]
        last = self.done_pieces == len(self.pieces) - 1
        if not last and self.cache.record is not None:
            self.prev_records.append(self.cache.record)
            self.cache = dataclasses.replace(self.cache, record=None, record_from=None)
        if self.req.params.prompt_logprobs is not None:
            nxt = np.zeros((width,), np.int32)
            follow = self.tokens[0, lo + 1:hi + 1]
            nxt[:len(follow)] = follow
            self.prompt_lp.append(position_logprobs(logits_fn(*model, hidden), nxt))
        if last:
            self.piece_hidden = hidden
        self.done_pieces += 1

    def prompt_result(self) -> list | None:
        """Per prompt position 1 .. n-1: (log-prob of its token, [(id, log-prob)] of the
        request's `prompt_logprobs` most likely), None when it did not ask."""
        k = self.req.params.prompt_logprobs
        if k is None:
            return None
        out = []
        for (lo, hi, _), (lp, ids, lps) in zip(self.pieces, to_host(self.prompt_lp)):
            for r in range(min(hi, len(self.req.prompt) - 1) - lo):
                out.append((float(lp[r]), [(int(i), float(v)) for i, v in zip(ids[r, :k],
                                                                                lps[r, :k])]))
        return out

    def record_shape(self, i: int) -> tuple[int, int] | None:
        """(rows, first row) of piece i's top-k record, or None when it records nothing.
        A piece records its last real queries (at most `record_rows(warmup)`); the last
        pieces record, as many as hold the prompt's last `warmup` queries."""
        if not self.record or i < self._recording_from():
            return None
        lo, hi, width = self.pieces[i]
        rows = min(record_rows(self.warmup), width)
        return rows, max(0, hi - lo - rows)

    def _recording_from(self) -> int:
        need, i = self.warmup, len(self.pieces)
        while i > 0 and need > 0:
            i -= 1
            need -= self.pieces[i][1] - self.pieces[i][0]
        return i

    @property
    def warmup_width(self) -> int:
        """Real queries in the warm-up record (those whose top-k sets warm the buffer)."""
        if not self.record:
            return 0
        lo, hi, _ = self.pieces[-1]
        before = sum(r.shape[2] for r in self.prev_records)
        return min(self.warmup, before + min(self.record_shape(len(self.pieces) - 1)[0], hi - lo))

    def warmup_record(self) -> np.ndarray | None:
        """The top-k of the prompt's last `warmup_width` queries, oldest first, in a
        [L, record_rows(warmup), k] buffer (-1 rows before them: no lookups), or None
        when nothing was recorded. Joined on the host: one warm-up shape per row count,
        whatever the pieces."""
        rec = self.cache.record
        if rec is None:
            return None
        lo, hi, _ = self.pieces[-1]
        parts = [to_host(r[:, 0]) for r in self.prev_records] + [to_host(rec[:, 0])]
        real = min(rec.shape[2], hi - lo)
        return recent_queries(parts[:-1], parts[-1][:, :real], self.warmup_width,
                              record_rows(self.warmup))


def to_host(tree):
    """numpy copies of a tree of arrays, also when they span other processes' devices
    (multi-process meshes: every process calls this in the same order, so the gather of
    an array that is not replicated here is a collective all of them join)."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(one, tree)


def pieces(cfg: Config, n: int) -> list[tuple[int, int, int]]:
    """(lo, hi, compiled width) of an n-token prompt's pieces (`prompt_pieces`)."""
    chunk = cfg.engine.prefill_chunk
    return prompt_pieces(n, chunk, piece_grid(cfg.cache.page_size, chunk))


def start(cfg: Config, req: Request, page_row, max_len: int, warmup_queries: int,
          record: bool) -> PrefillJob:
    """A job for `req.prompt`; with `record` the last piece's top-k sets are kept (for
    the offload warm-up or a PD export). Its one-request cache is allocated by `open_cache` when its first piece runs, not here:
    the engine admits many requests at once but prefills them one after another (oldest
    first), so only the prefill that computes holds a cache (the workspace admission
    plans for, one request's)."""
    n = len(req.prompt)
    w = min(warmup_queries, n)
    return PrefillJob(req, page_row, None, np.asarray([req.prompt], np.int32), pieces(cfg, n),
                      record=bool(w and record), max_len=max_len, warmup=w)


def first_token_of(job: PrefillJob) -> tuple[int, float]:
    """A finished prefill's first token (token, log-prob) from its last logits; the
    request also gets its prompt log-probs (when it echoes) and the first token's
    alternatives (when it asks for `top_logprobs`)."""
    job.req.prompt_logprob_out = job.prompt_result()
    return first_of(job.logits[None, 0], job.req)


def first_of(logits, req) -> tuple[int, float]:
    """A request's first token (token, log-prob) from the logits [1, V] after its prompt
    (a local prefill's or an imported one's); its alternatives go to `req.top_out`."""
    tok, logp, alts = first_token(logits, req)
    if req.params.top_logprobs:
        req.top_out = [alts]
    return tok, logp


def open_cache(cfg: Config, max_len: int) -> DecodeCache:
    """A fresh one-request cache [1, max_len] for a job's first piece."""
    return init_cache(cfg, batch=1, max_len=max_len)


def with_record(cfg: Config, cache: DecodeCache, rows: int, first: int) -> DecodeCache:
    """The cache with an empty record buffer [L, 1, rows, k] keeping the top-k of query
    rows first .. first + rows - 1 of a last piece. Only the last piece carries it: the
    record is part of the compiled shape, so the other pieces compile once whatever the
    prompt's last piece."""
    return dataclasses.replace(cache, record=jnp.full(
        (cache_layers(cfg), 1, rows, cfg.model.index_topk), -1, jnp.int32),
        record_from=jnp.int32(first))


def next_job(jobs, chunk: int) -> PrefillJob:
    """The prefill to advance among `jobs` (oldest first): the oldest that can finish
    within a quarter chunk (at least one piece: a short prompt does not wait minutes
    behind a 128K one), else the oldest. At most two prefills hold a cache at once (the
    planned workspace, `jlco.engine.allocation.prefill_workspace_bytes`); a piece's
    shapes, hence its bits, do not depend on the order."""
    quick = max(chunk // 4, MIN_PIECE)
    started = sum(j.cache is not None for j in jobs)
    for job in jobs:
        if job.pending_cost <= quick and (job.cache is not None or started < 2):
            return job
    return jobs[0]


def recent_queries(earlier: list, last: np.ndarray, count: int, rows: int) -> np.ndarray:
    """The top-k sets of the prompt's last `count` queries, oldest first, as int32
    [L, rows, k] with -1 rows before them (no lookups): so the warm-up stamps query j at
    step - rows + j whatever the pieces. earlier: the records [L, a, k] of the pieces
    before the last that recorded (all their rows real), oldest first; last [L, b, k]:
    the last piece's real rows."""
    both = np.concatenate([*earlier, last], axis=1)[:, max(0, sum(
        e.shape[1] for e in earlier) + last.shape[1] - count):]
    out = np.full((both.shape[0], rows, both.shape[2]), -1, np.int32)
    out[:, rows - both.shape[1]:] = both
    return out
