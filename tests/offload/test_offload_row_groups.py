"""Empty batch slots cost nothing in the offloaded step's hot-buffer bookkeeping, and
skipping them changes no bit: `update_rows` (a loop over groups of the rows with work on
XLA:CPU) equals the row-wise function over the whole batch, for every group size and any
pattern of rows with work; `write_latent` / `latent_for_attention` leave the same state
along a trace whichever group size runs them, and the lookup bounded by the indexer's
scan length equals the one bounded by the page table."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlco.offload import latent
from jlco.offload.hot_buffer import insert_slots, resolve

L, B, CAP, K, S_Q, SPAN = 2, 6, 24, 8, 2, 200
PATTERNS = {"none": [], "one": [4], "two apart": [0, 5], "half": [1, 2, 4],
            "all but one": [0, 1, 2, 3, 5], "all": list(range(B))}


def _tables(rng):
    sp = np.full((L, B, CAP), -1, np.int32)
    st = np.full((L, B, CAP), -1, np.int32)
    for layer in range(L):
        for i in range(B):
            n = int(rng.integers(0, CAP + 1))
            sl = rng.choice(CAP, n, replace=False)
            sp[layer, i, sl] = rng.choice(SPAN, n, replace=False)
            st[layer, i, sl] = rng.integers(0, 9, n)
    return jnp.asarray(sp), jnp.asarray(st)


def _positions(rng, rows, shape):
    pos = np.full(shape, -1, np.int32)
    pos[rows] = rng.integers(-1, SPAN, (len(rows),) + shape[1:])
    return jnp.asarray(pos)


def _lookup(tables, inputs):
    r = resolve(*tables, *inputs, 9, "lru", num_positions=SPAN)
    return (r.slot_pos, r.slot_stamp), (r.slot_ids, r.miss_pos, r.victim_slot, r.n_miss,
                                        r.n_hit, r.n_lookup)


def _insert(tables, inputs):
    slots, p, s = insert_slots(*tables, *inputs, 9, "lru")
    return (p, s), (slots,)


@jax.jit(static_argnames="group")
def _grouped_and_whole(sp, st, pos, new, *, group):
    """(update_rows of _lookup and of _insert on layer 1, both over every row)."""
    got = latent.update_rows((pos >= 0).any(axis=(1, 2)), 1, (sp, st), (pos,),
                             (-1, -1, -1, 0, 0, 0), _lookup, group=group)
    ins = latent.update_rows((new >= 0).any(axis=1), 1, (sp, st), (new,), (-1,), _insert,
                             group=group)
    return got, ins, _lookup((sp[1], st[1]), (pos,)), _insert((sp[1], st[1]), (new,))


@pytest.mark.parametrize("group", [1, 2, 4, B])
def test_update_rows_equals_every_row(group):
    """resolve and insert_slots through update_rows (layer 1 of 2) == over every row, for
    each pattern of rows with work (grouped and batched branches both taken); layer 0
    untouched."""
    rng = np.random.default_rng(group)
    for pattern, rows in PATTERNS.items():
        sp, st = _tables(rng)
        pos = _positions(rng, rows, (B, S_Q, K))
        new = _positions(rng, rows, (B, S_Q))
        (tables, outs), (itables, iouts), want, want_ins = _grouped_and_whole(
            sp, st, pos, new, group=group)
        chex.assert_trees_all_equal({pattern: outs}, {pattern: want[1]})
        chex.assert_trees_all_equal({pattern: iouts}, {pattern: want_ins[1]})
        for t, i, w, wi, orig in zip(tables, itables, want[0], want_ins[0], (sp, st)):
            chex.assert_trees_all_equal({pattern: (t[1], i[1], t[0], i[0])},
                                        {pattern: (w, wi, orig[0], orig[0])})
        if rows:
            assert int(want[1][3].sum()) > 0, pattern   # something missed: real work


def _offload_latent(rng, active):
    page, pages = 8, SPAN // 8 + 1
    table = np.full((B, pages), -1, np.int32)
    for n, i in enumerate(active):
        table[i] = np.arange(pages) + n * pages
    rb = 6
    host = tuple(jnp.asarray(rng.integers(0, 255, (B * pages * page, rb)), jnp.uint8)
                 for _ in range(L))
    return latent.OffloadLatent(
        rows=jnp.zeros((L, B, CAP, rb), jnp.uint8),
        slot_pos=jnp.full((L, B, CAP), -1, jnp.int32),
        slot_stamp=jnp.full((L, B, CAP), -1, jnp.int32),
        slot_pref=jnp.zeros((L, B, CAP), bool), host=host,
        page_table=jnp.asarray(table), step=jnp.int32(0),
        stats=jnp.zeros((L, len(latent.STAT_NAMES)), jnp.int32), policy="lru",
        page_size=page, chunk_rows=5)


def _step(lat, data, new_pos, pos, scan_len):
    ids = None
    for layer in range(L):
        lat = latent.write_latent(lat, layer, data, new_pos)
        lat, rows, ids = latent.latent_for_attention(lat, layer, pos, scan_len=scan_len)
    return latent.next_step(lat), rows, ids


@pytest.mark.parametrize("active", [[3], [0, 2, 5], list(range(B))])
def test_offloaded_step_state_same_for_every_group_size(monkeypatch, active):
    """Eight steps of write + lookup + fetch on both layers, empty slots beside: hot
    buffer, slot tables, host pool, counters, rows and ids are equal bit for bit with
    ROW_GROUP 1, 2 and the whole batch, and with the lookup bounded by a scan length."""
    runs = {}
    for variant in ("group 1", "group 2", "batch", "scan bound"):
        monkeypatch.setattr(latent, "ROW_GROUP", {"group 1": 1, "group 2": 2}.get(variant, B))
        rng = np.random.default_rng(0)
        lat = _offload_latent(rng, active)
        step = jax.jit(_step, static_argnums=4)
        out = []
        for t in range(8):
            length = 120 + 2 * t
            new_pos = np.full((B, S_Q), -1, np.int32)
            new_pos[active] = length + np.arange(S_Q)
            pos = np.full((B, S_Q, K), -1, np.int32)
            pos[active] = rng.integers(0, length + S_Q, (len(active), S_Q, K))
            data = rng.integers(0, 255, (B, S_Q, 6)).astype(np.uint8)
            lat, rows, ids = step(lat, data, new_pos, pos,
                                  160 if variant == "scan bound" else None)
            out.append((np.asarray(rows), np.asarray(ids),
                        jax.tree.map(np.asarray, lat)))
        runs[variant] = out
    for variant in ("group 1", "group 2", "scan bound"):
        chex.assert_trees_all_equal(runs[variant], runs["batch"])
    stats = runs["batch"][-1][2].stats
    assert stats[:, latent.STAT_HITS].sum() > 0 and stats[:, latent.STAT_MISSES].sum() > 0
    empty = [i for i in range(B) if i not in active]
    assert (runs["batch"][-1][2].slot_pos[:, empty] == -1).all()


def test_lookup_bound():
    """The scan length bounds the lookup when it is below the page-table span."""
    lat = _offload_latent(np.random.default_rng(0), [0])
    assert latent.lookup_bound(lat, None) == lat.num_positions
    assert latent.lookup_bound(lat, 64) == 64
    assert latent.lookup_bound(lat, 1 << 20) == lat.num_positions
