"""The prefetch scheduler's two sizes, derived rather than fixed: the transfer chunk
(`cache.fetch_chunk_rows`) and the layer-ahead prefetch depth (`cache.prefetch_depth`),
when the config leaves them at "auto". Plain arithmetic over measured figures: the
host→device link's bandwidth and its fixed cost per transfer (`jlco.planning.probe.
host_transfer`, or a hardware profile's link figure) and the decode step's time.

Chunk: each chunk pays a fixed cost (a `device_put` and a scatter dispatch) and moves
rows at the link rate; chunks let the host gather later rows while earlier ones move.
A chunk is sized so its transfer takes CHUNK_COST_RATIO times the fixed cost (the cost
then adds at most 1/CHUNK_COST_RATIO to the transfer) — larger chunks would only delay
the overlap — rounded up to a power of two (the scatter compiles per power of two) and
kept in [MIN_CHUNK_ROWS, MAX_CHUNK_ROWS].

Depth: layer L's prediction of layer L+d has d layers of compute to arrive in; the
depth is the fewest layers whose compute covers the transfer of one layer's predicted
rows: ceil(transfer time / layer time), in [1, MAX_DEPTH] (a prediction from further
back is less accurate, and each step the layers before the depth go unpredicted).
"""

from __future__ import annotations

import math

CHUNK_COST_RATIO = 8
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 64, 65536
MAX_DEPTH = 4


def _positive(**values) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                and math.isfinite(v)):
            raise ValueError(f"{name}={v!r} is invalid: allowed a finite number > 0")


def derive_chunk_rows(row_bytes: int, link_bytes_s: float, overhead_s: float) -> int:
    """Rows per transfer chunk: the power of two whose transfer takes at least
    CHUNK_COST_RATIO x the fixed cost per transfer, clamped to [MIN, MAX]_CHUNK_ROWS."""
    _positive(row_bytes=row_bytes, link_bytes_s=link_bytes_s, overhead_s=overhead_s)
    rows = CHUNK_COST_RATIO * overhead_s * link_bytes_s / row_bytes
    pow2 = 1 << max(0, math.ceil(math.log2(max(rows, 1.0))))
    return int(min(MAX_CHUNK_ROWS, max(MIN_CHUNK_ROWS, pow2)))


def derive_depth(rows_per_layer: float, row_bytes: int, link_bytes_s: float,
                 overhead_s: float, layer_s: float) -> int:
    """Layers ahead to predict: ceil(one layer's prefetch transfer / one layer's compute),
    clamped to [1, MAX_DEPTH]."""
    _positive(row_bytes=row_bytes, link_bytes_s=link_bytes_s, overhead_s=overhead_s,
              layer_s=layer_s)
    if rows_per_layer < 0:
        raise ValueError(f"rows_per_layer={rows_per_layer!r} is invalid: allowed >= 0")
    fetch_s = overhead_s + rows_per_layer * row_bytes / link_bytes_s
    return int(min(MAX_DEPTH, max(1, math.ceil(fetch_s / layer_s))))


class PrefetchDepth:
    """`cache.prefetch_depth`: a fixed depth, or "auto": 1 until a step is measured, then
    `derive_depth` from the last step's time per layer and predicted rows per layer
    (its link figures fixed at start-up). The depth changes only which layer predicts
    which; the real selection decides what is read, so any depth gives the same tokens."""

    def __init__(self, setting, num_layers: int, row_bytes: int, link_bytes_s: float,
                 overhead_s: float):
        if setting != "auto" and not (isinstance(setting, int) and 1 <= setting <= MAX_DEPTH):
            raise ValueError(f"prefetch_depth={setting!r} is invalid: allowed 'auto' or an "
                             f"integer in 1..{MAX_DEPTH}")
        self.auto = setting == "auto"
        self.depth = 1 if self.auto else setting
        self.num_layers, self.row_bytes = num_layers, row_bytes
        self.link_bytes_s, self.overhead_s = link_bytes_s, overhead_s

    def observe(self, step_s: float, rows_per_layer: float) -> int:
        """One measured step (wall seconds, predicted rows sent per predicted layer) → the
        depth for the next step."""
        if self.auto and step_s > 0:
            self.depth = derive_depth(rows_per_layer, self.row_bytes, self.link_bytes_s,
                                      self.overhead_s, step_s / self.num_layers)
        return self.depth
