"""Trace format, synthetic generator and cache-replay invariants."""
import importlib.util
import pathlib

import chex
import numpy as np
import pytest

from jlco.planning import trace

_spec = importlib.util.spec_from_file_location(
    "cache_study", pathlib.Path(__file__).parents[2] / "tools" / "cache_study.py")
cache_study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cache_study)

CLASSIC = [[x] for x in (1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)]


def _hits(sets, cap, policy):
    return trace.replay(sets, cap, policy).hits


def test_classic_reference_string():
    # textbook paging counts for 1,2,3,4,1,2,5,1,2,3,4,5 (12 lookups)
    assert [_hits(CLASSIC, c, "fifo") for c in (3, 4)] == [3, 2]  # Belady's anomaly
    assert [_hits(CLASSIC, c, "lru") for c in (3, 4)] == [2, 4]
    assert [_hits(CLASSIC, c, "belady") for c in (3, 4)] == [5, 6]


def test_set_semantics_by_hand():
    # cap 3: {1,2} {2,3} {1,4} {2,3}: LRU evicts 2 at step 2 (1 is pinned), 1 at step 3
    sets = [[1, 2], [2, 3], [1, 4], [2, 3]]
    st = trace.replay(sets, 3, "lru")
    assert (st.lookups, st.hits) == (8, 3)
    assert st.misses_per_step.tolist() == [2, 1, 1, 1]
    # cap 2: {1,2} {1,3}: row 1 is older than 2 but serves the step, so 2 goes; {2} misses
    assert _hits([[1, 2], [1, 3], [2]], 2, "lru") == 1
    assert _hits([[1, 2], [1, 3], [1]], 2, "lru") == 2
    # duplicates and -1 (invalid) are not lookups
    st = trace.replay([[5, 5, -1, 6], [6, -1]], 2, "fifo")
    assert (st.lookups, st.hits) == (3, 1)


def test_capacity_below_step_set_is_rejected():
    with pytest.raises(ValueError, match="capacity="):
        trace.replay([[1, 2, 3]], 2, "lru")
    with pytest.raises(ValueError, match="policy="):
        trace.replay([[1]], 2, "random")


def _random_sets(seed, steps=40, universe=60, k=6):
    rng = np.random.default_rng(seed)
    return [rng.choice(universe, k, replace=False) for _ in range(steps)]


@pytest.mark.parametrize("kind", ["random", "synthetic"])
def test_belady_dominates_and_stack_policies_are_monotone(kind):
    if kind == "random":
        cases = [(_random_sets(s), 6) for s in range(4)]
    else:
        cases = [(trace.synthetic_layer(1024, 64, 30, ov, 2, 1.5, seed=3), 128)
                 for ov in (0.0, 0.4, 0.8)]
    for sets, k in cases:
        caps = [k, k + 3, 2 * k, 3 * k, 5 * k]
        h = {p: [_hits(sets, c, p) for c in caps] for p in trace.POLICIES}
        for i in range(len(caps)):
            assert h["belady"][i] >= h["lru"][i] and h["belady"][i] >= h["fifo"][i]
        assert h["lru"] == sorted(h["lru"]) and h["belady"] == sorted(h["belady"])
        ranks, n = trace.lru_stack_ranks(sets, warmup=2)
        for c in caps:
            st = trace.replay(sets, c, "lru", warmup=2)
            assert st.lookups - st.hits == int((ranks >= c).sum())


def test_trace_roundtrip_and_truncation(tmp_path):
    path = tmp_path / "t.trace"
    with trace.TraceWriter(path, {"context": 99}) as w:
        w.record(0, 0, 1, np.array([3, 1, 2], np.int32))
        w.record(1, 0, 0, np.arange(5))
        w.record(0, 1, 1, np.array([], np.int32))
    tr = trace.read_trace(path)
    assert tr.meta == {"context": 99} and len(tr) == 3
    assert [s.tolist() for s in tr.sets(0, 1)] == [[3, 1, 2], []]
    assert tr.keys() == [(0, 1), (1, 0)]
    # a writer killed mid-record: header says 10 ids, only 2 made it to disk
    partial = trace._REC.pack(2, 0, 0, 10) + np.arange(2, dtype="<i4").tobytes()
    path.write_bytes(path.read_bytes() + partial)
    assert len(trace.read_trace(path)) == 3
    with pytest.raises(ValueError, match="ids must be"):
        trace.TraceWriter(tmp_path / "u.trace").record(0, 0, 0, np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="not a jlco trace"):
        (tmp_path / "bad").write_bytes(b"nope")
        trace.read_trace(tmp_path / "bad")


def test_synthetic_overlap_follows_profile():
    prof = trace.ess_overlap_profile(61)
    assert prof[0] == 0.0 and 0.7 <= prof[1:17].min() and prof[17:45].max() <= 0.6
    for ov in (0.0, 0.45, 0.8):
        sets = trace.synthetic_layer(4096, 128, 14, ov, seed=1)
        got = np.mean([np.intersect1d(a, b).size / 128 for a, b in zip(sets[3:], sets[4:])])
        assert abs(got - max(ov, 128 / 4096)) < 0.1, (ov, got)
        assert all(s.size == 128 for s in sets)
        # new tokens tend to be selected: the newest position is in each set
        assert sum(int(s.max()) >= 4096 for s in sets) == len(sets)


def test_cache_study_report(tmp_path):
    tr = trace.synthetic_trace(512, 32, 3, 12, requests=2, queries_per_step=2, accept=1.5)
    path = tmp_path / "s.trace"
    tr.write(path)
    tr2 = trace.read_trace(path)
    chex.assert_trees_all_equal(tr.ids, tr2.ids)
    assert tr2.meta["num_layers"] == 3
    out = cache_study.study(tr2, [64, 128, 256])
    hr = out["hit_rate"]
    assert set(hr) == set(trace.POLICIES) and set(out["lookups"]) == {0, 1, 2}
    for l in range(3):
        assert hr["belady"][64][l] >= hr["lru"][64][l]
        assert hr["lru"][64][l] <= hr["lru"][256][l]
