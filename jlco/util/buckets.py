"""Power-of-two buckets: the one rule by which lengths become static shapes (prompt
contexts, prefill chunks, indexer scan lengths, fetch chunks), so each bucket compiles
once and the persistent compilation cache reuses it. The engine's prefill pieces and
indexer scan buckets are defined here, below both the engine and the planner that
costs them (`jlco.planning.roofline.prefill_cost`)."""

from __future__ import annotations


def pow2_bucket(n: int, minimum: int = 1, cap: int = 0) -> int:
    """The smallest power of two >= max(n, minimum), at most `cap` (0 = no cap)."""
    b = 1 << (max(int(n), minimum) - 1).bit_length()
    return min(b, cap) if cap else b


WARMUP_QUERIES = 32   # ESS: top-k of the last 32 prefill query positions warm the hot buffer
MIN_PIECE = 16        # smallest prefill piece shape (fewer distinct compiled shapes)
MIN_SCAN = 1024       # smallest indexer scan bucket


def prompt_pieces(n: int, chunk: int, warmup: int) -> list[tuple[int, int, int]]:
    """Prompt pieces (lo, hi, compiled width) of an n-token prompt. Each piece computes a
    power-of-two bucket of its width (at most `chunk`): a short prompt does not pay for
    a whole chunk, and the compiled shapes stay few. The last `warmup` queries run as
    one piece (its bucket: the recorded top-k sets have the piece's shape)."""
    out = [(lo, min(lo + chunk, n - warmup), pow2_bucket(min(chunk, n - warmup - lo), MIN_PIECE,
                                                         chunk))
           for lo in range(0, n - warmup, chunk)]
    if warmup:
        out.append((n - warmup, n, pow2_bucket(warmup, MIN_PIECE)))
    return out
