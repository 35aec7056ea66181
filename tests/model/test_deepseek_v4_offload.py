"""`jlco.model.deepseek_v4.offload`'s admission warm-up on a small store (no model): the
picks ring read oldest first, `OffloadEntries.warm` filling one slot's hot buffer with
the last queries' picks (LRU order, the bytes the host pool holds) and counting its rows,
and a decode-style gather of those picks then hitting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jlco.model.deepseek_v4.offload import STAT_NAMES, offload_entries, oldest_first, to_bytes


def test_picks_ring_reads_oldest_first():
    ring = jnp.asarray([[40, 41], [10, 11], [20, 21], [30, 31]])   # query p at row p % 4
    np.testing.assert_array_equal(oldest_first(ring, 5),            # queries 1, 2, 3, 4
                                  [[10, 11], [20, 21], [30, 31], [40, 41]])
    short = jnp.full((4, 2), -1).at[0].set(7).at[1].set(8)          # a 2-token prompt
    np.testing.assert_array_equal(oldest_first(short, 2), [[-1, -1]] * 2 + [[7, 7], [8, 8]])


def test_warm_fills_one_slot_with_the_last_picks():
    store = offload_entries(batch=2, entries=16, width=4, dtype="float32", capacity=4)
    values = jnp.arange(16 * 4, dtype=jnp.float32).reshape(1, 16, 4) + 100
    store = store.install(1, values)
    record = jnp.asarray([[3, 5, -1], [5, 7, 9], [11, 9, 2]], jnp.int32)   # oldest first
    warm = jax.jit(lambda s, r: s.warm(1, r))(store, record)
    held = np.asarray(warm.slot_pos[1])
    # 6 distinct picks, 4 rows: LRU keeps the last query's (11, 9, 2) and 7 (query 1)
    assert sorted(held.tolist()) == [2, 7, 9, 11]
    assert (np.asarray(warm.slot_pos[0]) == -1).all()                # slot 0 untouched
    rows = np.asarray(warm.rows[1])
    for slot, entry in enumerate(held):
        np.testing.assert_array_equal(rows[slot], np.asarray(to_bytes(values[0, entry])))
    stats = dict(zip(STAT_NAMES, np.asarray(warm.stats).tolist()))
    assert stats == dict(lookups=0, hits=0, misses=0, h2d_moved_rows=0, warmup_rows=4)
    ids = jnp.asarray([[[0]], [[9]]]) * jnp.ones((2, 1, 2), jnp.int32)
    ids = ids.at[1, 0, 1].set(2)
    ok = jnp.asarray([[[False, False]], [[True, True]]])
    keys, after = jax.jit(lambda s, i, o: s.gather(i, o))(warm, ids, ok)
    np.testing.assert_array_equal(keys[1, 0], values[0, jnp.asarray([9, 2])])
    got = dict(zip(STAT_NAMES, np.asarray(after.stats).tolist()))
    assert (got["lookups"], got["hits"], got["misses"]) == (2, 2, 0)   # warm: no fetch
    cold = jax.jit(lambda s, i, o: s.gather(i, o))(store, ids, ok)[1]
    assert dict(zip(STAT_NAMES, np.asarray(cold.stats).tolist()))["misses"] == 2
