"""Every shape the engine can run, compiled before it serves, so a request never waits
for a compile (a first request at a new prompt length used to: 8.7 s TTFT against a
53 ms median).

What varies between calls, and so between compiled programs:
  prefill pieces (`jlco.engine.prefill.pieces`): the compiled width (engine.prefill_chunk
    for whole chunks, the page grid `piece_grid` for the tail) × the scan shape
    (`kv_cache.prefill_scan` of the piece's end: the scan buckets up to DENSE_MAX_T,
    then None) × for a last piece whether it records its top-k sets (offload: always);
  decode steps (plain or speculative): the scan bucket of the longest running context
    (`kv_cache.scan_bucket`);
  prefix reuse (`jlco.engine.prefix`): one load and one read program, and with MTP the
    fix-up, whose shapes are those of the prefill pieces.
A prefill shape runs once on an empty one-request cache with one real token: the indexer
skips key blocks past the length and attention reads few rows, so a 4096-query piece at
the 128K scan shape costs its compile, not a 128K prefill. A decode shape runs as a step
with every slot empty (lengths held at 0, no lookups, no host writes: `steps.open_step`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import numpy as np

from jlco.engine import prefill as engine_prefill
from jlco.model.kv_cache import prefill_scan, scan_bucket
from jlco.util.buckets import piece_grid, record_rows
from jlco.util.memory import release_free_memory


@dataclasses.dataclass(frozen=True)
class PieceShape:
    width: int             # compiled query positions
    scan: int | None       # the cache's scan_len (None: all max_len)
    record: bool           # carries the top-k record buffer (a recording last piece)


def _bounds(lo: int, hi: int) -> list[int]:
    """lo, hi and every power of two between: the values at which a bucket changes."""
    out, p = {lo, hi}, 1
    while p < hi:
        if p > lo:
            out.add(p)
        p *= 2
    return sorted(out)


def _scans(first: int, max_len: int, rule, last: int | None = None) -> list[int | None]:
    """Scan shapes `rule(x, max_len)` for contexts x in first..last (default max_len)."""
    return sorted({rule(x, max_len) for x in _bounds(first, last or max_len)},
                  key=lambda s: max_len if s is None else s)


def prefill_shapes(chunk: int, grid: int, max_len: int, record: bool) -> list[PieceShape]:
    """Every prefill piece shape a prompt of 1 .. max_len - 1 tokens can run: whole
    chunks end at chunk, 2·chunk, ...; tail pieces of `grid` at any grid step. Either
    can be a prompt's last piece, which records when `record`."""
    shapes = []
    for width in dict.fromkeys((min(chunk, max_len), grid)):
        for s in _scans(width, max_len, prefill_scan):
            shapes += [PieceShape(width, s, False)] + ([PieceShape(width, s, True)] * record)
    return list(dict.fromkeys(shapes))


def warmup_prompts(cfg, max_prompt: int, longest: int) -> list[list[int]]:
    """The warm-up requests: a prompt whose last piece is a tail piece and one whose last
    piece is a whole chunk (the record's shape is also that of the admission's
    hot-buffer warm-up and `prefill.recent_queries`), one of `longest` tokens, and a prompt that
    extends one ending on a page (a prefix reuse, with the MTP fix-up), each at most
    `max_prompt` tokens."""
    page, chunk = cfg.cache.page_size, cfg.engine.prefill_chunk
    lengths = sorted({min(n, max_prompt) for n in (1, chunk, longest, 2 * page, 3 * page)})
    vocab = cfg.model.vocab_size
    return [[(7 * i) % vocab for i in range(n)] for n in lengths]


def decode_scans(max_len: int, s_q: int = 1) -> list[int | None]:
    """Every decode step's scan bucket (contexts 1 .. max_len, + s_q - 1 drafts)."""
    return _scans(s_q, max_len, scan_bucket)


def compile_all(runner, progress: Callable[[int, int, str], None] | None = None) -> dict:
    """Run every prefill and decode shape of `runner` once (each compiles, or loads from
    the persistent compilation cache) → {"prefill_shapes", "decode_shapes", "seconds"}.
    progress(done, total, what) after each."""
    cfg = runner.cfg
    chunk = cfg.engine.prefill_chunk
    pieces = prefill_shapes(chunk, piece_grid(cfg.cache.page_size, chunk), runner.max_len,
                            runner.offload and runner.warmup_queries > 0)
    s_q = 1 + cfg.engine.num_draft_tokens
    scans = decode_scans(runner.max_len, s_q)
    total, t0, last = len(pieces) + len(scans), time.perf_counter(), None
    # Largest first: a program's compile scratch and first run are the warm-up's peak
    # memory, lowest while few programs are resident yet (the process's VmHWM).
    for i, s in enumerate(reversed(scans)):
        last = compile_decode(runner, s)
        release_free_memory()   # each compile leaves ~200 MB free in malloc's arenas
        if progress is not None:
            progress(i + 1, total, f"decode scan {s or 'all'}")
    if last is not None:
        runner.stepper.warm_up_follow(last)   # async scheduling's input merge
    by_size = sorted(pieces, key=lambda p: (p.width, p.scan or runner.max_len, p.record),
                     reverse=True)
    for i, p in enumerate(by_size):
        compile_piece(runner, p.width, p.scan, p.record)
        release_free_memory()
        if progress is not None:
            progress(len(scans) + i + 1, total, f"prefill width {p.width}, scan "
                                                f"{p.scan or 'all'}{', record' if p.record else ''}")
    return {"prefill_shapes": len(pieces), "decode_shapes": len(scans),
            "seconds": time.perf_counter() - t0}


def compile_piece(runner, width: int, scan: int | None, record: bool) -> None:
    """Run a prefill piece of this shape once, on an empty cache with one token."""
    cache = engine_prefill.open_cache(runner.cfg, runner.max_len)
    if record:
        rows = min(record_rows(runner.warmup_queries), width)
        cache = engine_prefill.with_record(runner.cfg, cache, rows, 0)
    logits = runner.run_piece(None, cache, np.zeros((1, 1), np.int32), 0, 1, width, scan)[0]
    jax.block_until_ready(logits)


def compile_decode(runner, scan: int | None):
    """Run a decode step at scan bucket `scan` with every slot empty → the pending step
    (`jlco.engine.decode.PendingDecode`), finished."""
    pending, runner.cache = runner.stepper.dispatch(runner.cache, [], scan=scan)
    jax.block_until_ready(pending.arrays)
    return pending


def warm_up(engine, progress=None, longest: int = 48) -> dict:
    """`compile_all`, then short requests through `engine` (`warmup_prompts`: the
    install, hot-buffer warm-up, first-token, prefix and bookkeeping programs) →
    {"prefill_shapes", "decode_shapes", "seconds"}. The engine is left as it was (no
    request, no pages, an empty prefix cache with zeroed counters)."""
    t0 = time.perf_counter()
    own = getattr(engine.runner, "compile_all", None)   # a runner with its own shapes (V4)
    done = own(progress) if own is not None else compile_all(engine.runner, progress)
    cfg = engine.cfg
    for prompt in warmup_prompts(cfg, cfg.engine.max_context_len - 2, longest):
        engine.generate([prompt], 2)
    engine.check_no_leaks()
    if engine.runner.prefix is not None:
        engine.runner.prefix.reset(counters=True)
    return dict(done, seconds=time.perf_counter() - t0)
