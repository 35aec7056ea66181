"""No compile in a request's path: the warm-up's shape lists are exactly the shapes
prompts and decode steps run, and after `Engine.warm_up` requests of any length
compile nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tests.support.engine_workload import BASE

from jlco.engine import prefill as engine_prefill, warmup
from jlco.engine.core import Engine
from jlco.model.kv_cache import prefill_scan, scan_bucket

_COMPILES: list[str] = []
_LISTENING = [False]


def _listener(name, _secs, **_kw):
    if _LISTENING[0] and "backend_compile" in name:
        _COMPILES.append(name)


jax.monitoring.register_event_duration_secs_listener(_listener)


@pytest.mark.parametrize("chunk, max_len, wq", [(64, 3000, 32), (100, 2500, 20), (64, 700, 0)])
def test_prefill_shapes_are_every_piece_a_prompt_runs(chunk, max_len, wq):
    want = set()
    for n in range(1, max_len):
        ps = engine_prefill.pieces(n, chunk, min(wq, n))
        for i, (_, hi, width) in enumerate(ps):
            last = bool(wq) and i == len(ps) - 1
            want.add(warmup.PieceShape(width, prefill_scan(hi, max_len), last))
    got = set(warmup.prefill_shapes(chunk, max_len, wq, True))
    assert got == want
    assert len(warmup.prefill_shapes(chunk, max_len, wq, True)) == len(got)   # no repeats


@pytest.mark.parametrize("s_q", [1, 3])
def test_decode_scans_are_every_step_bucket(s_q):
    max_len = 9000
    want = {scan_bucket(c + s_q, max_len) for c in range(0, max_len - s_q + 1)}
    assert set(warmup.decode_scans(max_len, s_q)) == want


def test_no_request_compiles_after_warm_up(model):
    cfg = BASE.replace(cache__offload=True, cache__kv_format="fp8",
                       cache__indexer_key_format="fp8", engine__max_context_len=1100,
                       engine__prefill_chunk=32)
    eng = Engine(cfg, model)
    seen = []
    done = eng.warm_up(lambda d, n, what: seen.append((d, n)))
    # widths 16, 32 x scans 1024, all; recording last pieces: 16 x 1024, 32 x both
    assert done["prefill_shapes"] == 7 and done["decode_shapes"] == 2
    assert seen[-1] == (9, 9)
    rng = np.random.default_rng(0)
    _COMPILES.clear()
    _LISTENING[0] = True
    try:
        reqs = [eng.submit(list(map(int, rng.integers(0, 500, n))), 3) for n in (5, 40, 70)]
        eng.run()
        late = eng.submit(list(map(int, rng.integers(0, 500, 1030))), 4)   # scan 'all'
        eng.run()
    finally:
        _LISTENING[0] = False
    assert all(len(r.tokens) == 3 for r in reqs) and len(late.tokens) == 4
    assert _COMPILES == [], f"{len(_COMPILES)} compile(s) in the request path"
    eng.check_no_leaks()
