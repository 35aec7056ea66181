"""Async scheduling (`engine.async_scheduling`): each plain decode step is queued behind
the one in flight, its input tokens taken from that step's output on the device, and the
earlier step's tokens are emitted while the device works. Every request gets the tokens
and log-probs it gets with it off, bit for bit — greedy and seeded sampling, penalties,
stop tokens, slots reused after a request stopped behind a step in flight, aborts in
flight, offload on and off."""

from __future__ import annotations

import numpy as np
import pytest
from tests.support.engine_workload import BASE, make_prompts

from jlco.engine import overlap
from jlco.engine.core import Engine
from jlco.sampling.constraint import TokenConstraint
from jlco.sampling.penalties import Penalties

SYNC = {"engine__async_scheduling": False}


def _workload(cfg, model, stop_at=None):
    """Six requests through two slots (later ones take the slots earlier ones leave):
    greedy, seeded samples, penalties, log-prob alternatives; `stop_at` {request index:
    stop id}. → (engine, requests)."""
    eng = Engine(cfg, model)
    prompts = make_prompts((5, 70, 40, 90, 12, 33), seed=3)
    stop_at = stop_at or {}
    fields = [dict(), dict(temperature=0.9, seed=7, top_p=0.8),
              dict(penalties=Penalties(presence=0.5, frequency=0.3, repetition=1.2)),
              dict(temperature=1.1, seed=11, top_k=5, top_logprobs=3), dict(top_logprobs=2),
              dict(temperature=0.7, seed=5, penalties=Penalties(frequency=0.8))]
    reqs = [eng.submit(p, n, stop_token_ids=(stop_at[i],) if i in stop_at else (), **f)
            for i, (p, n, f) in enumerate(zip(prompts, (9, 4, 7, 6, 8, 5), fields))]
    eng.run()
    assert all(r.status == "finished" for r in reqs)
    eng.check_no_leaks()
    assert eng.scheduler.slots == [None] * cfg.engine.max_batch_size
    return eng, reqs


def _outputs(reqs):
    return [(r.tokens, r.logprobs, r.top_out, r.finish_reason) for r in reqs]


# offload on: the slow tier (pyproject.toml); offloaded engines elsewhere run async too
@pytest.mark.parametrize("offload", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_tokens_equal_synchronous_steps(model, offload):
    cfg = BASE.replace(cache__offload=offload)
    sync, want = _workload(cfg.replace(**SYNC), model)
    eng, got = _workload(cfg, model)
    assert eng.step_kind.follow and not sync.step_kind.follow
    assert _outputs(got) == _outputs(want)


def test_stop_token_behind_a_step_in_flight(model, monkeypatch):
    # Requests 0 and 2 stop on a token they emit mid-way (known from a first run); the
    # step already queued behind that token is dropped, and the requests that take
    # their slots next get the tokens they get synchronously.
    cfg = BASE.replace(engine__max_batch_size=1)
    _, first = _workload(cfg.replace(**SYNC), model)
    stop_at = {0: first[0].tokens[3], 2: first[2].tokens[2]}
    _, want = _workload(cfg.replace(**SYNC), model, stop_at)
    dropped, live = [], overlap.live

    def counting(pending):
        kept = live(pending)
        dropped.extend(r.id for r in pending.running if r not in kept)
        return kept

    monkeypatch.setattr(overlap, "live", counting)
    _, got = _workload(cfg, model, stop_at)
    assert [r.finish_reason for r in want[:3]] == ["stop", "length", "stop"]
    assert _outputs(got) == _outputs(want)
    assert sorted(dropped) == [got[0].id, got[2].id]   # one discarded step each


def test_abort_in_flight(model):
    eng = Engine(BASE, model)
    a, b = (eng.submit(p, 12) for p in make_prompts((20, 30), seed=4))
    for _ in range(4):
        eng.step()
    assert eng.queue.inflight is not None and a.tokens and b.tokens
    eng.abort(a.id)               # its token in flight is dropped, not emitted
    n = len(a.tokens)
    eng.run()
    assert a.status == "aborted" and len(a.tokens) == n
    eng.check_no_leaks()
    alone = Engine(BASE, model).generate([b.prompt], 12)[0]
    assert (b.tokens, b.logprobs) == (alone.tokens, alone.logprobs)


class _Among(TokenConstraint):
    """Allows the ids in `ids` forever."""

    def __init__(self, ids):
        self.ids = sorted(ids)

    def fill(self, row):
        words = row.view(np.uint32)
        for t in self.ids:
            words[t // 32] |= np.uint32(1 << (t % 32))

    def consume(self, token):
        assert token in self.ids

    stopped = False


def test_constrained_batch_runs_synchronously(model):
    # A constrained request's next mask needs its last token on the host: with one in
    # the batch, the step in flight is emitted before the next is queued.
    eng = Engine(BASE, model)
    calls, dispatch = [], eng.runner.dispatch

    def spy(running, follow=None):
        calls.append((any(r.params.constraint is not None for r in running), follow is not None))
        return dispatch(running, follow)

    eng.runner.dispatch = spy
    free = eng.submit(make_prompts((9,), seed=5)[0], 8)
    eng.step()
    eng.step()
    assert eng.queue.inflight is not None
    held = eng.submit(make_prompts((7,), seed=6)[0], 5, constraint=_Among([3, 17, 40]))
    n = len(free.tokens)
    eng.step()                    # admits it: the free request's step is emitted first
    assert len(free.tokens) == n + 1
    eng.run()
    assert (True, False) in calls and (True, True) not in calls
    assert (False, True) in calls         # the free request alone followed
    assert set(held.tokens) <= {3, 17, 40} and len(held.tokens) == 5
    alone = Engine(BASE, model).generate([free.prompt], 8)[0]
    assert (free.tokens, free.logprobs) == (alone.tokens, alone.logprobs)


def test_async_scheduling_is_a_checked_bool():
    from jlco.config import ConfigError, apply_overrides
    assert BASE.engine.async_scheduling is True
    assert apply_overrides(BASE, ["engine.async_scheduling=false"]).engine.async_scheduling is False
    with pytest.raises(ConfigError, match="engine.async_scheduling"):
        BASE.replace(engine__async_scheduling="yes")
