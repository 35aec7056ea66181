"""The sort-free hot-buffer paths against the sort-based ones: `resolve` with
`num_positions` (inverse map + miss bitmap) equals `resolve` without it field for field;
victim sets follow (empty, oldest stamp, lowest position, lowest slot) on tables whose
stamps and positions span many bits (a numpy lexsort is the reference); fetching into an
all-layer buffer at a row offset writes exactly what a one-layer fetch writes."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlco.offload.fetch import fetch_in_jit
from jlco.offload.hot_buffer import POLICIES, resolve

_sorted = jax.jit(resolve, static_argnums=(4, 5))


def _random_table(rng, b, cap, span, stamp_lo, stamp_hi):
    """Tables with empty slots (some with odd stamps), distinct positions < span."""
    sp = np.full((b, cap), -1, np.int32)
    st = rng.integers(stamp_lo, stamp_hi, (b, cap)).astype(np.int32)
    for i in range(b):
        n = int(rng.integers(0, cap + 1))
        sl = rng.choice(cap, n, replace=False)
        sp[i, sl] = rng.choice(span, n, replace=False)
    st[:, ::3] = np.where(sp[:, ::3] < 0, -1, st[:, ::3])
    return sp, st


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("s_q,k,cap,span", [(1, 8, 8, 40), (3, 4, 19, 30), (2, 16, 40, 5000)])
def test_mapped_resolve_equals_sorted_along_a_trace(policy, s_q, k, cap, span):
    rng = np.random.default_rng(cap + s_q)
    b = 3
    sp = jnp.full((b, cap), -1, jnp.int32)
    st = jnp.full((b, cap), -1, jnp.int32)
    sp2, st2 = sp, st
    prev = rng.integers(0, span, (b, s_q, k))
    for t in range(12):
        # half of the positions repeat last step's (hits), some duplicate, some are −1
        pos = np.where(rng.random((b, s_q, k)) < 0.5, prev, rng.integers(-1, span, (b, s_q, k)))
        prev = pos
        a = _sorted(sp, st, jnp.asarray(pos, jnp.int32), t, policy, None)
        m = _sorted(sp2, st2, jnp.asarray(pos, jnp.int32), t, policy, span)
        for name, x, y in zip(a._fields, a, m):
            # chex takes no err_msg: the dict key names field and step on failure
            chex.assert_trees_all_equal({f"{name} t={t}": np.asarray(x)},
                                        {f"{name} t={t}": np.asarray(y)})
        sp, st, sp2, st2 = a.slot_pos, a.slot_stamp, m.slot_pos, m.slot_stamp
    assert int(a.n_hit.sum()) > 0 and int(a.n_miss.sum()) > 0


@pytest.mark.parametrize("num_positions", [None, 1 << 20])
def test_victims_follow_policy_order_on_wide_stamps_and_positions(num_positions):
    """64 random tables (stamps over ~2^21 values including negatives, positions up to
    2^20, ties on stamps, empty slots with different stamps): resolve evicts exactly the
    first n_miss slots of a lexsort by (empty first, stamp, position, slot), never a hit."""
    rng = np.random.default_rng(7)
    b, cap, k = 64, 24, 12
    sp, st = _random_table(rng, b, cap, 1 << 20, -(1 << 20), 1 << 20)
    st[:, 1::4] = st[:, :1]                      # ties on the stamp, broken by position
    pos = np.where(rng.random((b, 1, k)) < 0.4,
                   np.take_along_axis(sp, rng.integers(0, cap, (b, k)), 1)[:, None],
                   rng.integers(0, 1 << 20, (b, 1, k))).astype(np.int32)
    res = _sorted(jnp.asarray(sp), jnp.asarray(st), jnp.asarray(pos), 1 << 21, "lru",
                  num_positions)
    vic = np.asarray(res.victim_slot)
    for i in range(b):
        hits = set(pos[i].ravel().tolist()) & set(sp[i][sp[i] >= 0].tolist())
        usable = [c for c in range(cap) if sp[i, c] not in hits or sp[i, c] < 0]
        order = sorted(usable, key=lambda c: (sp[i, c] >= 0, st[i, c], sp[i, c], c))
        n = int(res.n_miss[i])
        assert sorted(vic[i, :n].tolist()) == sorted(order[:n]), i
        # k-th smallest missed position went to the k-th victim in slot order
        assert (np.diff(vic[i, :n]) > 0).all()
    assert (np.asarray(res.n_miss) > 0).sum() > b // 2


def test_positions_past_num_positions_are_invalid():
    sp = jnp.full((1, 4), -1, jnp.int32)
    r = resolve(sp, sp, jnp.array([[[3, 9, 10, -1]]], jnp.int32), 0, num_positions=10)
    assert np.asarray(r.slot_ids).tolist()[0][0][2:] == [-1, -1]
    assert np.asarray(r.miss_pos)[0].tolist() == [3, 9, -1, -1]
    with pytest.raises(ValueError, match="num_positions=0"):
        resolve(sp, sp, jnp.zeros((1, 1, 4), jnp.int32), 0, num_positions=0)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_rows", [0, 3])
def test_fetch_into_all_layer_buffer_at_row_offset(chunk_rows):
    """Layer 1 of a [L=3, b=2, C, R] buffer fetched in place through the [L*b, C, R] view
    equals fetching into rows[1] alone; the other layers are untouched."""
    rng = np.random.default_rng(3)
    n_layers, b, cap, rb, page = 3, 2, 8, 5, 4
    host = jnp.asarray(rng.integers(0, 255, (6 * page, rb)), jnp.uint8)
    table = jnp.asarray([[0, 2, 4], [1, 3, 5]], jnp.int32)
    rows = jnp.asarray(rng.integers(0, 255, (n_layers, b, cap, rb)), jnp.uint8)
    sp = jnp.asarray([[-1, 0, 5, -1, 7, -1, -1, 2], [3, -1, -1, -1, -1, -1, -1, -1]], jnp.int32)
    pos = jnp.asarray([[[0, 1, 6, 9, 11]], [[3, 4, 10, 2, 8]]], jnp.int32)
    res = resolve(sp, jnp.zeros_like(sp), pos, 1, num_positions=12)
    fetch = functools.partial(fetch_in_jit, host_layer=host, page_table=table, res=res,
                              page_size=page, chunk_rows=chunk_rows)
    one, _ = fetch(rows[1])
    flat, moved = fetch(rows.reshape(n_layers * b, cap, rb), row_offset=b)
    got = np.asarray(flat).reshape(n_layers, b, cap, rb)
    chex.assert_trees_all_equal(got[1], np.asarray(one))
    chex.assert_trees_all_equal(got[[0, 2]], np.asarray(rows)[[0, 2]])
    n = np.asarray(res.n_miss)
    assert n.sum() > 0 and int(moved) >= n.sum()
    for i in range(b):   # every fetched slot holds its position's host row
        for p, v in zip(np.asarray(res.miss_pos[i, :n[i]]), np.asarray(res.victim_slot[i, :n[i]])):
            hid = int(table[i, p // page]) * page + p % page
            chex.assert_trees_all_equal(got[1, i, v], np.asarray(host[hid]))
