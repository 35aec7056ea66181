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


def piece_grid(page_size: int, chunk: int) -> int:
    """Width of a prompt's tail pieces: the smallest multiple of the page size that is at
    least MIN_PIECE, at most `chunk`. Prefix reuse resumes a prefill at a piece boundary,
    so a reused prefix loses less than one grid step."""
    grid = page_size * -(-MIN_PIECE // page_size)
    return min(grid, chunk)


def prompt_pieces(n: int, chunk: int, grid: int) -> list[tuple[int, int, int]]:
    """Prompt pieces (lo, hi, compiled width) of an n-token prompt, fixed by position:
    whole chunks [j·chunk, (j+1)·chunk) while they fit, then the tail in pieces of `grid`
    positions at lo = last chunk end + i·grid (the last one padded). The piece that
    computes position q, and its shape, depend on q and on whether q's chunk fits in the
    prompt, not on where the prompt ends inside the tail: a longer prompt with the same
    prefix computes that prefix's rows in the same pieces, with the same float reduction
    order, so rows cached from one prompt are the rows another would compute
    (`jlco.engine.prefix`)."""
    if not (isinstance(grid, int) and 0 < grid <= chunk):
        raise ValueError(f"prompt_pieces: grid={grid!r}: allowed an integer in 1..{chunk}")
    full = n // chunk * chunk
    out = [(lo, lo + chunk, chunk) for lo in range(0, full, chunk)]
    out += [(lo, min(lo + grid, n), grid) for lo in range(full, n, grid)]
    return out


def record_rows(warmup: int) -> int:
    """Rows of a last piece's top-k record (the admission warm-up's query count, as a
    compiled shape): `warmup` rounded up to a power of two, at least MIN_PIECE."""
    return pow2_bucket(warmup, MIN_PIECE)
