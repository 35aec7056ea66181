"""Offload metrics per layer: the numbers users ask peers for (docs/facts.md §4) — lookups,
hits, misses, bytes each way (real rows and rows moved incl. padding, so a padded fetch
path cannot hide its cost), time spent waiting on fetches, and prefetch usefulness."""

from __future__ import annotations

import threading

import numpy as np

COUNTERS = ("lookups", "hits", "misses", "h2d_rows", "h2d_moved_rows", "d2h_rows",
            "prefetch_used", "prefetch_unused", "predicted", "predicted_correct")


class OffloadMetrics:
    """Per-layer counters. `update` takes Python ints or jax scalars (read here, which
    syncs: record once per step, not inside the layer loop, where latency matters)."""

    def __init__(self, num_layers: int, row_bytes: int, shared: tuple[bool, ...] | None = None):
        """`shared`: per layer, whether it reuses the top-k of the full layer before it
        (IndexShare); its rows are planned and fetched by that full layer's step."""
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"OffloadMetrics: num_layers={num_layers!r} is invalid: "
                             "allowed a positive integer")
        if not isinstance(row_bytes, int) or row_bytes <= 0:
            raise ValueError(f"OffloadMetrics: row_bytes={row_bytes!r} is invalid: "
                             "allowed a positive integer")
        shared = tuple(bool(x) for x in shared) if shared is not None else (False,) * num_layers
        if len(shared) != num_layers:
            raise ValueError(f"OffloadMetrics: shared has {len(shared)} entries: allowed "
                             f"num_layers={num_layers}")
        self.num_layers, self.row_bytes, self.shared = num_layers, row_bytes, shared
        # A server scrapes from another thread: snapshots never see a half-made update
        # (hits + misses == lookups in every snapshot).
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self._c = {k: np.zeros(self.num_layers, np.int64) for k in COUNTERS}
        self._wait = np.zeros(self.num_layers, np.float64)

    def update(self, layer: int, *, lookups=0, hits=0, misses=0, h2d_rows=0,
               h2d_moved_rows=0, d2h_rows=0, fetch_wait_s=0.0, prefetch_used=0,
               prefetch_unused=0, predicted=0, predicted_correct=0) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"OffloadMetrics.update: layer={layer} is invalid: allowed "
                             f"0..{self.num_layers - 1}")
        vals = dict(lookups=lookups, hits=hits, misses=misses, h2d_rows=h2d_rows,
                    h2d_moved_rows=h2d_moved_rows, d2h_rows=d2h_rows,
                    prefetch_used=prefetch_used, prefetch_unused=prefetch_unused,
                    predicted=predicted, predicted_correct=predicted_correct)
        vals = {k: int(np.sum(np.asarray(v))) for k, v in vals.items()}
        for k, v in vals.items():
            if v < 0:
                raise ValueError(f"OffloadMetrics.update: {k}={v} is invalid: allowed >= 0")
        with self._lock:
            for k, v in vals.items():
                self._c[k][layer] += v
            self._wait[layer] += float(fetch_wait_s)

    def total_fetch_wait_s(self) -> float:
        """Seconds spent waiting on fetches, all layers."""
        with self._lock:
            return float(self._wait.sum())

    def hit_rate(self, layer: int | None = None) -> float:
        """Hits / lookups for one layer, or over all layers (nan before any lookup)."""
        sl = slice(None) if layer is None else layer
        look = self._c["lookups"][sl].sum()
        return float(self._c["hits"][sl].sum() / look) if look else float("nan")

    def health(self) -> dict:
        """The prefetch scheduler's health numbers, per layer and summed: rows_needed (rows
        attention read), rows_hit (resident from an earlier step), rows_prefetched_used
        (loaded ahead of need — the admission warm-up — then read), rows_prefetched_unused
        (loaded ahead and evicted, or left when the request ended, unread), rows_on_demand
        (fetched by the step that needed them: the critical path), h2d_bytes / d2h_bytes
        (the decode steps' rows each way) and fetch_wait_s (host-driven path: time steps
        waited on fetches; the in-jit path's wait is inside the step). rows_needed =
        rows_hit + rows_prefetched_used + rows_on_demand, per layer. With the
        layer-ahead prefetch (`cache.prefetch_ahead`): rows_predicted (distinct positions
        the prediction chose for the layer) and rows_predicted_correct (of those, the ones
        its real top-k selected): recall = correct / rows_needed, precision = correct /
        rows_predicted; both 0 with the prefetch off. An IndexShare shared layer's rows
        were fetched by its group's full layer before it attends: the full layer's
        on-demand rows are its prefetched-used rows, and it has none on demand (the
        raw counters in `snapshot` keep the group's lookups, hits and misses)."""
        snap = self.snapshot()
        per = snap["per_layer"]
        sh = self.shared
        layers = {
            "rows_needed": per["lookups"],
            "rows_hit": [h - u for h, u in zip(per["hits"], per["prefetch_used"])],
            "rows_prefetched_used": [u + m if s else u for u, m, s in
                                     zip(per["prefetch_used"], per["misses"], sh)],
            "rows_prefetched_unused": per["prefetch_unused"],
            "rows_on_demand": [0 if s else m for m, s in zip(per["misses"], sh)],
            "h2d_bytes": per["h2d_bytes"], "d2h_bytes": per["d2h_bytes"],
            "fetch_wait_s": per["fetch_wait_s"],
            "rows_predicted": per["predicted"],
            "rows_predicted_correct": per["predicted_correct"]}
        return {"per_layer": layers, "total": {k: sum(v) for k, v in layers.items()}}

    def snapshot(self) -> dict:
        """Plain-Python dict: per-layer lists, totals, bytes and hit rates."""
        with self._lock:
            c = {k: v.copy() for k, v in self._c.items()}
            wait = self._wait.copy()
        per = {k: v.tolist() for k, v in c.items()}
        per["h2d_bytes"] = (c["h2d_rows"] * self.row_bytes).tolist()
        per["h2d_moved_bytes"] = (c["h2d_moved_rows"] * self.row_bytes).tolist()
        per["d2h_bytes"] = (c["d2h_rows"] * self.row_bytes).tolist()
        per["fetch_wait_s"] = wait.tolist()
        per["hit_rate"] = [h / n if n else float("nan")
                           for h, n in zip(per["hits"], per["lookups"])]
        looked = sum(per["lookups"])
        total = {k: sum(v) for k, v in per.items() if k != "hit_rate"}
        total["hit_rate"] = sum(per["hits"]) / looked if looked else float("nan")
        return {"row_bytes": self.row_bytes, "per_layer": per, "total": total}
