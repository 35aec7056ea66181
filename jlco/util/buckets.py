"""Power-of-two buckets: the one rule by which lengths become static shapes (prompt
contexts, prefill chunks, indexer scan lengths, fetch chunks), so each bucket compiles
once and the persistent compilation cache reuses it."""

from __future__ import annotations


def pow2_bucket(n: int, minimum: int = 1, cap: int = 0) -> int:
    """The smallest power of two >= max(n, minimum), at most `cap` (0 = no cap)."""
    b = 1 << (max(int(n), minimum) - 1).bit_length()
    return min(b, cap) if cap else b
