"""Offload metrics per layer: the numbers users ask peers for (docs/facts.md §4) — lookups,
hits, misses, bytes each way (real rows and rows moved incl. padding, so a padded fetch
path cannot hide its cost), time spent waiting on fetches, and prefetch usefulness."""

from __future__ import annotations

import numpy as np

COUNTERS = ("lookups", "hits", "misses", "h2d_rows", "h2d_moved_rows", "d2h_rows",
            "prefetch_used", "prefetch_unused")


class OffloadMetrics:
    """Per-layer counters. `update` takes Python ints or jax scalars (read here, which
    syncs: record once per step, not inside the layer loop, where latency matters)."""

    def __init__(self, num_layers: int, row_bytes: int):
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"OffloadMetrics: num_layers={num_layers!r} is invalid: allowed a positive integer")
        if not isinstance(row_bytes, int) or row_bytes <= 0:
            raise ValueError(f"OffloadMetrics: row_bytes={row_bytes!r} is invalid: allowed a positive integer")
        self.num_layers, self.row_bytes = num_layers, row_bytes
        self.reset()

    def reset(self) -> None:
        self._c = {k: np.zeros(self.num_layers, np.int64) for k in COUNTERS}
        self._wait = np.zeros(self.num_layers, np.float64)

    def update(self, layer: int, *, lookups=0, hits=0, misses=0, h2d_rows=0,
               h2d_moved_rows=0, d2h_rows=0, fetch_wait_s=0.0, prefetch_used=0,
               prefetch_unused=0) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"OffloadMetrics.update: layer={layer} is invalid: allowed "
                             f"0..{self.num_layers - 1}")
        vals = dict(lookups=lookups, hits=hits, misses=misses, h2d_rows=h2d_rows,
                    h2d_moved_rows=h2d_moved_rows, d2h_rows=d2h_rows,
                    prefetch_used=prefetch_used, prefetch_unused=prefetch_unused)
        for k, v in vals.items():
            v = int(np.sum(np.asarray(v)))
            if v < 0:
                raise ValueError(f"OffloadMetrics.update: {k}={v} is invalid: allowed >= 0")
            self._c[k][layer] += v
        self._wait[layer] += float(fetch_wait_s)

    def record_fetch(self, layer: int, res, stats) -> None:
        """Counts of one `resolve` + fetch (Resolution, FetchStats)."""
        self.update(layer, lookups=res.n_lookup, hits=res.n_hit, misses=res.n_miss,
                    h2d_rows=stats.real_rows, h2d_moved_rows=stats.moved_rows,
                    fetch_wait_s=stats.wait_s)

    def hit_rate(self, layer: int | None = None) -> float:
        """Hits / lookups for one layer, or over all layers (nan before any lookup)."""
        sl = slice(None) if layer is None else layer
        look = self._c["lookups"][sl].sum()
        return float(self._c["hits"][sl].sum() / look) if look else float("nan")

    def snapshot(self) -> dict:
        """Plain-Python dict: per-layer lists, totals, bytes and hit rates."""
        per = {k: v.tolist() for k, v in self._c.items()}
        per["h2d_bytes"] = (self._c["h2d_rows"] * self.row_bytes).tolist()
        per["h2d_moved_bytes"] = (self._c["h2d_moved_rows"] * self.row_bytes).tolist()
        per["d2h_bytes"] = (self._c["d2h_rows"] * self.row_bytes).tolist()
        per["fetch_wait_s"] = self._wait.tolist()
        per["hit_rate"] = [self.hit_rate(i) for i in range(self.num_layers)]
        total = {k: (sum(v) if k != "hit_rate" else self.hit_rate()) for k, v in per.items()}
        return {"row_bytes": self.row_bytes, "per_layer": per, "total": total}
