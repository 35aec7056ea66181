"""Prefix reuse (`jlco.engine.prefix`): a prompt that extends one seen before prefills
only the rest, and gets exactly the tokens and log-probs it gets with the prefix cache
off: offload on and off, float32, with MTP drafts, sampled with a seed. Eviction keeps the
cache within its bound, the host pool leaks nothing, and the counters hold hits <=
queries."""

from __future__ import annotations

import numpy as np
import pytest
from tests.support.engine_workload import BASE

from jlco.engine import prefix
from jlco.engine.core import Engine
from jlco.util.buckets import prompt_pieces

CHUNK = 32   # tiny config: page 16, so the tail grid is 16


def _session(seed=3, first=40, turns=3, add=30):
    """Prompts of a growing session: each turn the whole history plus `add` tokens."""
    rng = np.random.default_rng(seed)
    vocab = BASE.model.vocab_size
    hist = list(map(int, rng.integers(0, vocab, first)))
    out = [list(hist)]
    for _ in range(turns - 1):
        hist = hist + list(map(int, rng.integers(0, vocab, add)))
        out.append(list(hist))
    return out


def _run(cfg, model, prompts, new=5, temperature=0.0, seed=0):
    """Each prompt alone, one after another, on one engine → (tokens, logprobs, cached)."""
    eng = Engine(cfg, model)
    out = []
    for p in prompts:
        r = eng.generate([p], new, temperature=temperature, seed=seed)[0]
        out.append((r.tokens, r.logprobs, r.cached_tokens))
    eng.check_no_leaks()
    if eng.scheduler.pages is not None:
        assert eng.scheduler.pages.used_pages == 0
    return eng, out


def _cfg(**kw):
    return BASE.replace(engine__prefill_chunk=CHUNK, **kw)


@pytest.mark.parametrize("offload", [False, True])
def test_reuse_is_exact(model, offload):
    prompts = _session()
    on, got = _run(_cfg(cache__offload=offload), model, prompts)
    _, want = _run(_cfg(cache__offload=offload, cache__prefix_cache=False), model, prompts)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    # 40, 70, 100 tokens: turn 2 reuses turn 1's 2 full pages; turn 3 turn 2's 4 (its
    # 5th, 64..79, is not full in turn 2).
    assert [g[2] for g in got] == [0, 32, 64], "turns 2-3 reuse the previous prompt's pages"
    assert all(w[2] == 0 for w in want)
    s = on.prefix_stats()
    assert s["hits"] == 96 and s["queries"] == sum(map(len, prompts)) and s["hits"] <= s["queries"]


def test_reuse_is_exact_sampled(model):
    prompts = _session(seed=5)
    _, got = _run(_cfg(), model, prompts, temperature=0.8, seed=11)
    _, want = _run(_cfg(cache__prefix_cache=False), model, prompts, temperature=0.8, seed=11)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert got[1][2] > 0


def test_reuse_is_exact_with_mtp():
    """MTP drafts (f32 model): rows of the MTP layer come with the prefix; a cached
    prompt that ended on a page boundary gets its last MTP row recomputed with its
    follower (the fix-up)."""
    from tests.support.engine_workload import make_model
    cfg = _cfg(engine__num_draft_tokens=1).replace(
        model__num_nextn_predict_layers=1, model__dtype="float32")
    model = make_model(cfg)
    first = _session(seed=7, first=64, turns=1)[0]        # 64 = 4 pages: ends on a page
    prompts = [first, first + [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]]
    eng, got = _run(cfg, model, prompts, new=6)
    _, want = _run(cfg.replace(cache__prefix_cache=False), model, prompts, new=6)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert got[1][2] == 64, "the whole first prompt is reused (fix-up at its end)"


def test_two_requests_sharing_a_prefix_at_once(model):
    """Submitted together: the second finds the first's pages once the first's prefill
    ends (matched at its first piece), tokens as without reuse."""
    base = _session(seed=9, first=80, turns=1)[0]
    prompts = [base + [1, 2, 3], base + [4, 5, 6, 7]]
    cfg = _cfg(cache__offload=True)
    eng = Engine(cfg, model)
    reqs = [eng.submit(p, 4) for p in prompts]
    eng.run()
    ref = Engine(cfg.replace(cache__prefix_cache=False), model)
    want = [ref.generate([p], 4)[0].tokens for p in prompts]
    assert [r.tokens for r in reqs] == want
    assert reqs[0].cached_tokens == 0 and reqs[1].cached_tokens == 80
    eng.check_no_leaks()


def test_eviction_bounds_the_cache(model):
    """A cache of 4 pages keeps the most recent prefix's head; nothing leaks."""
    cfg = _cfg(cache__offload=True, cache__prefix_cache_tokens=64)
    a, b = _session(seed=1, first=70, turns=1)[0], _session(seed=2, first=70, turns=1)[0]
    assert a[:16] != b[:16]
    eng, got = _run(cfg, model, [a, b, a + [5, 6]])
    s = eng.prefix_stats()
    assert s["pages"] <= 4 and s["bytes"] > 0
    assert got[2][2] == 0, "a's pages were evicted by b's"
    assert eng.reset_prefix_cache() == s["pages"] and eng.prefix_stats()["pages"] == 0


def test_lru_takes_the_tail_first():
    c = prefix.PrefixCache(page_size=2, capacity=3, mtp=False)
    pieces = prompt_pieces(9, 4, 2)

    def read(lo, hi):
        z = np.zeros((1, hi - lo, 3), np.uint8)
        return z, z, None
    c.insert(list(range(9)), pieces, 0, read, None)      # 4 pages, capacity 3
    assert c.stats()["pages"] == 3
    hit = c.match(list(range(9)) + [1], prompt_pieces(10, 4, 2))
    assert hit.tokens == 4 and len(hit.entries) == 2     # head kept (pages 0-2), resume at 4


def test_pieces_are_fixed_by_position():
    """The piece that computes a position does not depend on where the prompt ends,
    except when the position's whole chunk fits (then it is that chunk)."""
    for n in range(1, 200):
        for m in range(n, 200):
            a, b = prompt_pieces(n, 32, 16), prompt_pieces(m, 32, 16)
            for q in range(n):
                pa = next(p for p in a if p[0] <= q < p[1])
                pb = next(p for p in b if p[0] <= q < p[1])
                if (q // 32 + 1) * 32 <= n or (q // 32 + 1) * 32 > m:
                    assert (pa[0], pa[2]) == (pb[0], pb[2]), (n, m, q)


def _prefilled_rows(eng, prompt):
    """Every cache layer's rows and keys at the prompt's positions after `eng` prefills
    it (the one-request cache, before install)."""
    import jax
    from jlco.engine.scheduler import Request
    job = eng.runner.start_prefill(Request(-1, list(prompt), 1), None)
    while not job.finished:
        eng.runner.prefill_piece(job)
    n = len(prompt)
    lat, keys = jax.device_get((job.cache.latent, job.cache.index_k))
    return job.resume, [np.asarray(x[0, :n]) for x in lat + keys]


def test_reused_cache_rows_are_the_prefills_bits():
    """The cache a reusing prefill ends with equals, bit for bit and on every layer (the
    MTP layer's fixed-up row included), the cache of a prefill from token 0."""
    from tests.support.engine_workload import make_model
    cfg = _cfg(engine__num_draft_tokens=1).replace(
        model__num_nextn_predict_layers=1, model__dtype="float32")
    model = make_model(cfg)
    first = _session(seed=7, first=64, turns=1)[0]
    second = first + list(range(1, 18))
    eng = Engine(cfg, model)
    eng.generate([first], 2)
    resumed, got = _prefilled_rows(eng, second)
    _, want = _prefilled_rows(Engine(cfg.replace(cache__prefix_cache=False), model), second)
    assert resumed == 64
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
