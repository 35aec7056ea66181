"""Chunked prefill interleaved with decode: a long prompt arriving costs the running
requests at most one chunk of prompt positions per engine step, its tokens are the ones
it gets alone, an abort mid-prefill gives everything back, and a short prompt's
admission warm-up still fetches its top-k rows."""

from __future__ import annotations

import pytest
from tests.support.engine_workload import BASE

from jlco.engine.core import Engine

CHUNK = 16


@pytest.fixture(scope="module")
def cfg():
    return BASE.replace(cache__offload=True, engine__prefill_chunk=CHUNK)


def _tokens(n, seed):
    return [(seed * 37 + 11 * i) % 500 for i in range(n)]


def test_long_prompt_spends_at_most_one_chunk_per_step(cfg, model):
    eng = Engine(cfg, model)
    short = eng.submit(_tokens(8, 1), 30)
    eng.step()                                    # admitted + prefilled (one piece)
    assert short.tokens, "the short prompt's prefill ends within its first step"
    long = eng.submit(_tokens(100, 2), 3)
    spent, steps = [], 0
    while not long.tokens:
        before = sum(j.pending_cost for j in eng._jobs) if eng._jobs else None
        n_short = len(short.tokens)
        eng.step()
        steps += 1
        after = sum(j.pending_cost for j in eng._jobs) if eng._jobs else 0
        if before is not None:
            spent.append(before - after)
        # With async scheduling a step's tokens are emitted by the next call.
        lag = steps == 1 and eng.step_kind.follow
        assert len(short.tokens) == n_short + (not lag), "the running request decoded every step"
    # 100 = 6 chunks of 16 + a tail piece of the page grid (16, the recorded one)
    assert steps >= 5 and max(spent) <= 2 * CHUNK, spent
    eng.run()
    eng.check_no_leaks()
    alone = Engine(cfg, model)
    ref = alone.generate([_tokens(100, 2)], 3)[0]
    assert long.tokens == ref.tokens


def test_short_prompt_overtakes_a_long_prefill(cfg, model):
    # A short prompt arriving while a long one prefills gets its first token first (it
    # does not wait for every chunk of the long one); at most two prefills hold a
    # cache; both get the tokens they get alone.
    eng = Engine(cfg, model)
    long = eng.submit(_tokens(140, 6), 3)
    eng.step()
    assert not long.tokens and eng.num_prefilling == 1
    short = eng.submit(_tokens(10, 7), 3)
    eng.step()
    assert short.tokens and not long.tokens, "the short prompt waited for the long one"
    while eng.step():
        assert sum(j.cache is not None for j in eng._jobs) <= 2
    alone = Engine(cfg, model)
    assert [long.tokens, short.tokens] == [
        r.tokens for r in alone.generate([_tokens(140, 6), _tokens(10, 7)], 3)]


def test_abort_during_prefill_frees_slot_and_pages(cfg, model):
    eng = Engine(cfg, model)
    req = eng.submit(_tokens(120, 3), 4)
    eng.step()
    assert eng.num_prefilling == 1 and not req.tokens
    eng.abort(req.id)
    assert eng.num_prefilling == 0 and req.status == "aborted"
    eng.check_no_leaks()
    assert eng.scheduler.pages.used_pages == 0 and eng.scheduler.slots == [None, None]
    # the slot is usable again
    again = eng.generate([_tokens(20, 4)], 2)[0]
    assert len(again.tokens) == 2


def test_short_prompt_warm_up_fetches_its_rows(cfg, model):
    eng = Engine(cfg, model)
    eng.generate([_tokens(5, 5)], 2)
    assert eng.runner.warmup_rows > 0


def test_host_pool_above_the_machines_ram_is_refused(cfg, monkeypatch):
    from jlco.engine import allocation as runner
    monkeypatch.setattr(runner, "physical_memory_bytes", lambda: 1 << 16)   # 64 KiB of RAM
    with pytest.raises(ValueError, match=r"above 95% of this machine's.*max_batch_size"):
        runner.allocate_cache(cfg)
    monkeypatch.setattr(runner, "physical_memory_bytes", lambda: 1 << 40)
    runner.allocate_cache(cfg)


def test_long_prompts_past_the_pool_wait_and_finish(cfg, model):
    # More long prompts than the host pool holds: the ones that fit are admitted, the
    # rest wait for pages (the server refuses past its queue: 429), at most two prefill
    # caches are ever live (the planned workspace), and every request finishes.
    from jlco.engine.scheduler import RequestError
    eng = Engine(cfg, model)
    with pytest.raises(RequestError, match="max_context_len"):
        eng.submit(_tokens(cfg.engine.max_context_len, 9), 1)      # longer than the context
    reqs = [eng.submit(_tokens(150, 10 + i), 2) for i in range(5)]
    peak_jobs = peak_live = 0
    while eng.step():
        peak_jobs = max(peak_jobs, eng.num_prefilling)
        peak_live = max(peak_live, sum(j.cache is not None for j in eng._jobs))
        assert len(eng.scheduler.waiting) >= 5 - cfg.engine.max_batch_size - sum(
            r.status == "finished" for r in reqs)
    assert all(r.status == "finished" and len(r.tokens) == 2 for r in reqs)
    assert peak_jobs <= cfg.engine.max_batch_size and peak_live <= 2
    eng.check_no_leaks()


def test_recent_queries_joins_the_last_pieces():
    import numpy as np

    from jlco.engine.prefill import recent_queries
    a = np.arange(4).reshape(1, 4, 1) + 100                  # queries 100..103 (all real)
    b = np.arange(2).reshape(1, 2, 1) + 200
    last = np.array([[[7], [8]]])                            # its 2 real rows
    out = recent_queries([a, b], last, 5, 8)
    assert out[0, :, 0].tolist() == [-1, -1, -1, 103, 200, 201, 7, 8]
    assert recent_queries([], last, 2, 4)[0, :, 0].tolist() == [-1, -1, 7, 8]


@pytest.mark.parametrize("n", [5, 40, 70, 100])
def test_warm_up_record_covers_the_last_queries(cfg, model, n):
    """The admission warm-up sees the top-k of the prompt's last min(32, n) queries even
    when its last piece holds fewer (the piece before it records too)."""
    from jlco.engine.scheduler import Request
    eng = Engine(cfg, model)
    job = eng.runner.start_prefill(Request(-1, _tokens(n, 3), 1), None, record=True)
    while not job.finished:
        eng.runner.prefill_piece(job)
    rec = job.warmup_record()
    assert job.warmup_width == min(32, n) and rec.shape[1] == (16 if n < 16 else 32)
    real = (rec[:cfg.model.num_hidden_layers, :, 0] >= 0).sum(axis=1)   # MTP layer: idle
    assert (real == min(32, n)).all(), real
