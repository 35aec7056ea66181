"""resolve() against the independent OrderedDict reference, crafted traces with known
hit counts, duplicates, invalid ids, capacity checks, insert_new, and the engine's
install emptying only the installed slot's tables."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.support.engine_workload import BASE

from jlco.engine.steps import install
from jlco.model.kv_cache import cache_layers, init_cache
from jlco.offload.hot_buffer import POLICIES, ReferenceCache, insert_new, resolve, scatter_rows
from jlco.offload.latent import STAT_NAMES, OffloadLatent

_resolve = jax.jit(resolve, static_argnums=4)


def _empty(b, capacity, row_bytes):
    """An empty hot buffer of one layer: rows [b, C, R] and its slot tables [b, C]."""
    return (jnp.zeros((b, capacity, row_bytes), jnp.uint8),
            jnp.full((b, capacity), -1, jnp.int32), jnp.full((b, capacity), -1, jnp.int32))


def gather_slots(rows, slot_ids):
    """rows [b, C, R] at slot_ids [b, s_q, k] → [b, s_q, k, R] (zeros where −1): what the
    sparse attention kernel reads."""
    rows, sid = np.asarray(rows), np.asarray(slot_ids)
    got = rows[np.arange(rows.shape[0])[:, None, None], np.maximum(sid, 0)]
    return np.where((sid >= 0)[..., None], got, 0).astype(rows.dtype)


def _run_trace(trace, capacity, policy):
    """trace int [steps, b, s_q, k] → per-step (n_hit, n_miss) [steps, b]; checks the
    reference and slot-table invariants at every step."""
    steps, b = trace.shape[:2]
    sp = jnp.full((b, capacity), -1, jnp.int32)
    st = jnp.full((b, capacity), -1, jnp.int32)
    refs = [ReferenceCache(capacity, policy) for _ in range(b)]
    hits = np.zeros((steps, b), int)
    for t in range(steps):
        pos = trace[t]
        r = _resolve(sp, st, jnp.asarray(pos, jnp.int32), t, policy)
        sp, st = r.slot_pos, r.slot_stamp
        for i in range(b):
            ref_hit, ref_miss = refs[i].step(pos[i].ravel())
            assert (int(r.n_hit[i]), int(r.n_miss[i])) == (ref_hit, ref_miss), (t, i)
            assert int(r.n_lookup[i]) == ref_hit + ref_miss
            table = np.asarray(sp[i])
            assert set(table[table >= 0].tolist()) == refs[i].resident(), (t, i)
            assert len(set(table[table >= 0].tolist())) == (table >= 0).sum()
            sid = np.asarray(r.slot_ids[i])
            chex.assert_trees_all_equal(sid >= 0, np.asarray(pos[i] >= 0))
            chex.assert_trees_all_equal(table[sid[pos[i] >= 0]], np.asarray(pos[i][pos[i] >= 0]))
            miss = np.asarray(r.miss_pos[i])
            vic = np.asarray(r.victim_slot[i])
            n = int(r.n_miss[i])
            assert (miss[n:] == -1).all() and (vic[n:] == -1).all()
            assert (np.diff(miss[:n]) > 0).all() and len(set(vic[:n])) == n
            chex.assert_trees_all_equal(table[vic[:n]], miss[:n])
            hits[t, i] = ref_hit
    return hits


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("s_q,k,extra", [(1, 8, 0), (3, 4, 0), (1, 8, 9), (3, 4, 7)])
def test_random_traces_match_reference(policy, s_q, k, extra):
    rng = np.random.default_rng(s_q * 100 + k + extra)
    cap = s_q * k + extra
    trace = rng.integers(-1, 3 * cap, (25, 2, s_q, k))   # duplicates and −1s included
    hits = _run_trace(trace, cap, policy)
    assert hits.sum() > 0


def test_crafted_trace_known_hits_lru_vs_fifo():
    # capacity 4, k 2. After step 3, LRU has evicted {2,3}, FIFO {0,2}: step 4 asks {0,2}.
    trace = np.array([[0, 1], [2, 3], [0, 4], [1, 5], [0, 2]])[:, None, None, :]
    assert _run_trace(trace, 4, "lru")[:, 0].tolist() == [0, 0, 1, 0, 1]
    assert _run_trace(trace, 4, "fifo")[:, 0].tolist() == [0, 0, 1, 0, 0]


@pytest.mark.parametrize("policy", POLICIES)
def test_sliding_window_reuse(policy):
    # step t selects [t, t+k): k-1 of k rows are reused each step.
    k, steps = 6, 10
    trace = (np.arange(steps)[:, None] + np.arange(k))[:, None, None, :]
    hits = _run_trace(trace, k, policy)
    assert hits.sum() == (steps - 1) * (k - 1)


def test_duplicates_share_one_slot_and_one_miss():
    pos = jnp.array([[[5, 5, -1], [5, 7, 7]]], jnp.int32)      # b 1, s_q 2, k 3
    _, sp, st = _empty(1, 6, 4)
    r = resolve(sp, st, pos, 0)
    assert int(r.n_miss[0]) == 2 and int(r.n_lookup[0]) == 2
    sid = np.asarray(r.slot_ids[0])
    assert sid[0, 0] == sid[0, 1] == sid[1, 0] and sid[0, 2] == -1 and sid[1, 1] == sid[1, 2]
    assert np.asarray(r.miss_pos[0]).tolist() == [5, 7, -1, -1, -1, -1]


def test_capacity_below_minimum_names_it():
    _, sp, st = _empty(1, 5, 4)
    with pytest.raises(ValueError, match=r"minimum is s_q \* topk = 2 \* 3 = 6"):
        resolve(sp, st, jnp.zeros((1, 2, 3), jnp.int32), 0)
    with pytest.raises(ValueError, match="policy='mru'"):
        resolve(sp, st, jnp.zeros((1, 1, 3), jnp.int32), 0, "mru")


@pytest.mark.parametrize("policy", POLICIES)
def test_insert_new_then_resolve_hits_and_matches_reference(policy):
    b, cap, rb = 2, 4, 3
    rows, sp, st = _empty(b, cap, rb)
    refs = [ReferenceCache(cap, policy) for _ in range(b)]
    ins = jax.jit(functools.partial(insert_new, policy=policy))
    for t in range(6):
        new_pos = jnp.array([[t], [t + 100]], jnp.int32)
        new_rows = jnp.stack([jnp.full((1, rb), t + 1), jnp.full((1, rb), t + 50)]).astype(jnp.uint8)
        rows, sp, st = ins(rows, sp, st, new_pos, new_rows, t)
        for i in range(b):
            refs[i].step([int(new_pos[i, 0])])
        sel = jnp.array([[[t, max(t - 3, 0)]], [[t + 100, 100]]], jnp.int32)
        r = resolve(sp, st, sel, t, policy)
        for i in range(b):
            assert (int(r.n_hit[i]), int(r.n_miss[i])) == refs[i].step(np.asarray(sel[i]).ravel())
        assert int(r.n_hit[0]) >= 1 and int(r.n_hit[1]) >= 1     # the new token is a hit
        got = gather_slots(rows, r.slot_ids)
        assert (got[0, 0, 0] == t + 1).all() and (got[1, 0, 0] == t + 50).all()
        sp, st = r.slot_pos, r.slot_stamp


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_insert_new_equals_resolve_then_scatter(policy):
    """insert_new's sort-free path must give resolve's slots, tables and rows exactly.
    Each of 64 batch entries is a random case: tables with empty slots and tied stamps,
    new positions that hit, miss, repeat or are invalid (−1)."""
    rng = np.random.default_rng(1)
    b, cap, n = 64, 6, 3
    sp, st = np.full((b, cap), -1, np.int32), np.full((b, cap), -1, np.int32)
    for i in range(b):
        k = int(rng.integers(0, cap + 1))
        sl = rng.choice(cap, k, replace=False)
        sp[i, sl], st[i, sl] = rng.choice(12, k, replace=False), rng.integers(0, 3, k)
    new_pos = rng.integers(-1, 12, (b, n)).astype(np.int32)
    rows = rng.integers(0, 255, (b, cap, 2)).astype(np.uint8)
    new_rows = rng.integers(0, 255, (b, n, 2)).astype(np.uint8)
    res = resolve(jnp.asarray(sp), jnp.asarray(st), jnp.asarray(new_pos)[:, None], 5, policy)
    want = (scatter_rows(jnp.asarray(rows), res.slot_ids[:, 0], jnp.asarray(new_rows)),
            res.slot_pos, res.slot_stamp)
    got = insert_new(jnp.asarray(rows), jnp.asarray(sp), jnp.asarray(st),
                     jnp.asarray(new_pos), jnp.asarray(new_rows), 5, policy)
    for g, w in zip(got, want):
        chex.assert_trees_all_equal(np.asarray(g), np.asarray(w))
    assert (np.asarray(res.n_hit) > 0).any() and (np.asarray(res.n_miss) > 1).any()


def test_install_empties_only_the_installed_slot():
    """A request taking a batch slot starts with none of its predecessor's rows: the
    engine's install empties that slot's tables in every layer and nothing else."""
    cfg = BASE.replace(cache__offload=True)
    n_layers, b, cap, rb = cache_layers(cfg), 2, 4, cfg.row_bytes
    lat = OffloadLatent(
        rows=jnp.zeros((n_layers, b, cap, rb), jnp.uint8),
        slot_pos=jnp.ones((n_layers, b, cap), jnp.int32),
        slot_stamp=jnp.ones((n_layers, b, cap), jnp.int32),
        slot_pref=jnp.ones((n_layers, b, cap), bool),
        host=tuple(jnp.zeros((16, rb), jnp.uint8) for _ in range(n_layers)),
        page_table=jnp.full((b, 2), -1, jnp.int32), step=jnp.int32(0),
        stats=jnp.zeros((n_layers, len(STAT_NAMES)), jnp.int32), policy="lru", page_size=8,
        chunk_rows=0)
    cache = init_cache(cfg, batch=b, max_len=16, latent=lat)
    temp = init_cache(cfg, batch=1, max_len=16)
    out = install(cache, temp, 1, 3, jnp.array([0, -1], jnp.int32)).latent
    sp = np.asarray(out.slot_pos)
    assert (sp[:, 1] == -1).all() and (sp[:, 0] == 1).all()
    st = np.asarray(out.slot_stamp)
    assert (st[:, 1] == -1).all() and (st[:, 0] == 1).all()
    pref = np.asarray(out.slot_pref)      # nothing of the predecessor counts as prefetched
    assert not pref[:, 1].any() and pref[:, 0].all()
