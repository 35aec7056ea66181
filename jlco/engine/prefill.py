"""A request's prefill as the runner runs it: alone, on a one-request device cache, in
pieces whose shapes depend on the prompt only (chunk shapes change float reduction order,
and offload on must equal offload off, a served request the same request alone, bit for
bit), with the last queries' top-k sets recorded to warm the hot buffer at admission.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jlco.config import Config
from jlco.engine.scheduler import Request
from jlco.model.kv_cache import DecodeCache, cache_layers, init_cache
from jlco.util.buckets import MIN_PIECE, WARMUP_QUERIES, prompt_pieces  # noqa: F401



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

    @property
    def finished(self) -> bool:
        return self.done_pieces == len(self.pieces)

    @property
    def pending_cost(self) -> int:
        """Padded prompt positions left to compute."""
        return sum(c for _, _, c in self.pieces[self.done_pieces:])

    @property
    def warmup_width(self) -> int:
        """Queries of the last piece (those whose top-k sets warm the hot buffer)."""
        return self.pieces[-1][1] - self.pieces[-1][0]

    def warmup_record(self) -> jax.Array | None:
        """The recorded top-k of the last piece, oldest query first [L, bucket, k]
        (`oldest_first`), or None when nothing was recorded."""
        rec = self.cache.record
        return None if rec is None else oldest_first(rec[:, 0], jnp.int32(self.warmup_width))


pieces = prompt_pieces   # (lo, hi, compiled width) per piece: `jlco.util.buckets`


def start(cfg: Config, req: Request, page_row, max_len: int, warmup_queries: int,
          record: bool) -> PrefillJob:
    """A job for `req.prompt`; with `record` the last piece's top-k sets are kept (for
    the offload warm-up or a PD export). Its one-request cache is allocated by
    `open_cache` when its first piece runs, not here: the engine admits many requests
    at once but prefills them one after another (oldest first), so only the prefill
    that computes holds a cache (the workspace admission plans for, one request's)."""
    n = len(req.prompt)
    w = min(warmup_queries, n)
    job_pieces = pieces(n, cfg.engine.prefill_chunk, w)
    return PrefillJob(req, page_row, None, np.asarray([req.prompt], np.int32), job_pieces,
                      record=bool(w and record), max_len=max_len)


def open_cache(cfg: Config, max_len: int) -> DecodeCache:
    """A fresh one-request cache [1, max_len] for a job's first piece."""
    return init_cache(cfg, batch=1, max_len=max_len)


def with_record(cfg: Config, cache: DecodeCache, width: int) -> DecodeCache:
    """The cache with an empty record buffer [L, 1, width, k] for a last piece of
    compiled width `width`. Only the last piece carries it: the record is part of the
    compiled shape, so the other pieces compile once whatever the prompt's last piece."""
    return dataclasses.replace(cache, record=jnp.full(
        (cache_layers(cfg), 1, width, cfg.model.index_topk), -1, jnp.int32))


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


@jax.jit
def oldest_first(record, w):
    """The recorded top-k of a last prefill piece [L, bucket, k] whose first w queries are
    real: those w last (oldest first), the padding queries before them as -1 (no lookups),
    so the warm-up stamps query j at step - w + j whatever the bucket."""
    bucket = record.shape[1]
    real = jnp.where((jnp.arange(bucket) < w)[None, :, None], record, -1)
    return jnp.roll(real, bucket - w, axis=1)
