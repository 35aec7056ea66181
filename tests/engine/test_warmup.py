"""No compile in a request's path: the warm-up's shape lists are exactly the shapes
prompts and decode steps run, and after `Engine.warm_up` requests of any length
compile nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tests.support.engine_workload import BASE

from jlco.engine import warmup
from jlco.engine.core import Engine
from jlco.model.kv_cache import prefill_scan, scan_bucket
from jlco.util.buckets import prompt_pieces

_COMPILES: list[str] = []
_LISTENING = [False]


def _listener(name, *_args, **_kw):
    # a compile, or a request for one that JAX's persistent cache (on in tests/conftest.py)
    # may answer without compiling: either means the request path needed a new program
    if _LISTENING[0] and ("backend_compile" in name or "compile_requests_use_cache" in name):
        _COMPILES.append(name)


jax.monitoring.register_event_duration_secs_listener(_listener)
jax.monitoring.register_event_listener(_listener)


@pytest.mark.parametrize("chunk, grid, max_len", [(64, 16, 3000), (100, 20, 2500),
                                                  (64, 64, 700), (1100, 64, 5000)])
def test_prefill_shapes_are_every_piece_a_prompt_runs(chunk, grid, max_len):
    want = set()
    for n in range(1, max_len):
        ps = prompt_pieces(n, chunk, grid)
        for i, (lo, _, width) in enumerate(ps):
            scan = prefill_scan(min(lo + width, max_len), max_len)
            want.add(warmup.PieceShape(width, scan, i == len(ps) - 1))
            want.add(warmup.PieceShape(width, scan, False))
    got = set(warmup.prefill_shapes(chunk, grid, max_len, True))
    assert got == want
    assert len(warmup.prefill_shapes(chunk, grid, max_len, True)) == len(got)   # no repeats
    assert not any(p.record for p in warmup.prefill_shapes(chunk, grid, max_len, False))


@pytest.mark.parametrize("s_q", [1, 3])
def test_decode_scans_are_every_step_bucket(s_q):
    max_len = 9000
    want = {scan_bucket(c + s_q, max_len) for c in range(0, max_len - s_q + 1)}
    assert set(warmup.decode_scans(max_len, s_q)) == want


@pytest.mark.slow   # long on 2 CPU cores: the slow tier (pyproject.toml)
def test_no_request_compiles_after_warm_up(model):
    cfg = BASE.replace(cache__offload=True, cache__kv_format="fp8",
                       cache__indexer_key_format="fp8", engine__max_context_len=1100,
                       engine__prefill_chunk=32)
    eng = Engine(cfg, model)
    seen = []
    done = eng.warm_up(lambda d, n, what: seen.append((d, n)))
    # widths 32 (chunks), 16 (the page grid) x scans 1024, all x recording or not
    assert done["prefill_shapes"] == 8 and done["decode_shapes"] == 2
    assert seen[-1] == (10, 10)
    assert eng.prefix_stats() == {"queries": 0, "hits": 0, "pages": 0, "bytes": 0}
    rng = np.random.default_rng(0)
    _COMPILES.clear()
    _LISTENING[0] = True
    try:
        reqs = [eng.submit(list(map(int, rng.integers(0, 500, n))), 3) for n in (5, 40, 70)]
        eng.run()
        late = eng.submit(list(map(int, rng.integers(0, 500, 1030))), 4)   # scan 'all'
        eng.run()
        again = eng.submit(reqs[2].prompt + [1, 2, 3], 3)          # a reused prefix
        eng.run()
    finally:
        _LISTENING[0] = False
    assert all(len(r.tokens) == 3 for r in reqs) and len(late.tokens) == 4
    assert again.cached_tokens == 64 and len(again.tokens) == 3
    assert _COMPILES == [], f"{len(_COMPILES)} compile(s) in the request path"
    eng.check_no_leaks()
