"""OffloadMetrics: counts, bytes, hit rates, reset, argument checks."""
import math

import jax.numpy as jnp
import pytest

from jlco.offload.metrics import OffloadMetrics


def test_counts_bytes_and_hit_rates():
    m = OffloadMetrics(3, 656)
    m.update(0, lookups=10, hits=7, misses=3, h2d_rows=3, h2d_moved_rows=4, fetch_wait_s=0.5)
    m.update(0, lookups=jnp.array([5, 5]), hits=jnp.array([5, 3]), misses=jnp.int32(2))
    m.update(2, lookups=4, hits=1, misses=3, d2h_rows=2, prefetch_used=5, prefetch_unused=1)
    s = m.snapshot()
    p, t = s["per_layer"], s["total"]
    assert p["lookups"] == [20, 0, 4] and p["hits"] == [15, 0, 1] and p["misses"] == [5, 0, 3]
    assert p["h2d_bytes"] == [3 * 656, 0, 0] and p["h2d_moved_bytes"] == [4 * 656, 0, 0]
    assert p["d2h_bytes"] == [0, 0, 2 * 656] and p["fetch_wait_s"] == [0.5, 0.0, 0.0]
    assert p["prefetch_used"] == [0, 0, 5] and p["prefetch_unused"] == [0, 0, 1]
    assert p["hit_rate"][0] == 0.75 and math.isnan(p["hit_rate"][1]) and p["hit_rate"][2] == 0.25
    assert t["lookups"] == 24 and t["hit_rate"] == 16 / 24 == m.hit_rate()
    m.reset()
    assert m.snapshot()["total"]["lookups"] == 0 and math.isnan(m.hit_rate())


def test_bad_arguments():
    m = OffloadMetrics(2, 8)
    with pytest.raises(ValueError, match="layer=2"):
        m.update(2, hits=1)
    with pytest.raises(ValueError, match="hits=-1"):
        m.update(0, hits=-1)
    with pytest.raises(ValueError, match="num_layers=0"):
        OffloadMetrics(0, 8)
    with pytest.raises(ValueError, match="shared has 1 entries"):
        OffloadMetrics(2, 8, (True,))


def test_a_shared_layers_rows_come_from_its_full_layer():
    """IndexShare: the group's counters (the same lookups, hits, misses for the full and
    the shared layer) read, for the shared layer, as rows its full layer fetched ahead:
    prefetched and used, none on demand; rows_needed still adds up."""
    m = OffloadMetrics(2, 8, (False, True))
    for layer in (0, 1):
        m.update(layer, lookups=10, hits=6, misses=4, prefetch_used=2)
    h = m.health()["per_layer"]
    assert h["rows_on_demand"] == [4, 0] and h["rows_prefetched_used"] == [2, 6]
    assert h["rows_hit"] == [4, 4]
    for i in (0, 1):
        assert h["rows_needed"][i] == (h["rows_hit"][i] + h["rows_prefetched_used"][i]
                                       + h["rows_on_demand"][i])
    assert m.snapshot()["per_layer"]["misses"] == [4, 4]     # the raw counters are kept
