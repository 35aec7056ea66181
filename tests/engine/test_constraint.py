"""Constrained decoding in the engine (`jlco.sampling.constraint`), with plain-Python
constraints: the device applies each row's mask (a forced sequence comes out exactly,
with log-prob 0; an allowed set is never left, sampled or greedy, plain, offloaded and
speculative), the request stops when its constraint does, and a free request beside a
constrained one decodes as it does alone, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jlco.config import load_config
from jlco.engine.core import Engine
from jlco.model.decoder import DeepseekV32
from jlco.sampling.constraint import TokenConstraint, apply_mask, host_masks

CFG = load_config("configs/tiny.py").replace(engine__attention_impl="xla",
                                             engine__max_batch_size=2,
                                             engine__max_context_len=96,
                                             engine__prefill_chunk=32)
V = CFG.model.vocab_size


def _set_bits(row, ids):
    words = row.view(np.uint32)
    for t in ids:
        words[t // 32] |= np.uint32(1 << (t % 32))


class Forced(TokenConstraint):
    """Allows exactly `seq`, one token at a time, then stops."""

    def __init__(self, seq):
        self.seq, self.i = list(seq), 0

    def fill(self, row):
        _set_bits(row, [self.seq[self.i]])

    def consume(self, token):
        assert token == self.seq[self.i]
        self.i += 1

    @property
    def stopped(self):
        return self.i == len(self.seq)


class Among(TokenConstraint):
    """Allows the ids in `ids` forever."""

    def __init__(self, ids):
        self.ids, self.taken = sorted(ids), []

    def fill(self, row):
        _set_bits(row, self.ids)

    def consume(self, token):
        self.taken.append(token)

    stopped = False


@pytest.fixture(scope="module")
def model():
    return DeepseekV32(CFG.model, rngs=nnx.Rngs(0))


def _prompts():
    rng = np.random.default_rng(6)
    return [list(map(int, rng.integers(0, V, n))) for n in (36, 41)]


IDS = list(range(0, V, 3))   # the allowed set of test_an_allowed_set_is_never_left


@pytest.fixture(scope="module")
def plain_runs(model):
    """What a fresh plain engine (CFG) emits for the requests several tests compare
    against, each computed once per module: (the sampled request alone, the free
    request's greedy tokens alone, the greedy tokens constrained to IDS)."""
    plain, other = _prompts()
    solo = Engine(CFG, model)
    alone = solo.submit(plain, 8, temperature=1.0, seed=4)
    solo.run()
    ref = Engine(CFG, model).generate([other], 12)[0]
    eng = Engine(CFG, model)
    want = eng.submit(plain, 12, constraint=Among(IDS))
    eng.run()
    return alone, ref, want


def test_masks_pack_as_llguidance_does():
    """Bit i of word w is id 32 w + i; the device unpacks the host's packing."""
    import jax.numpy as jnp
    on, allowed = host_masks([Among([0, 31, 32, 63, V - 1]), None], 2, V, [0, 1])
    out = np.asarray(apply_mask(jnp.zeros((2, V)), jnp.asarray(on), jnp.asarray(allowed)))
    assert list(np.flatnonzero(out[0] == 0)) == [0, 31, 32, 63, V - 1]
    assert (out[1] == 0).all()


@pytest.mark.parametrize("offload", [False, True])
def test_a_forced_sequence_comes_out_and_stops(model, plain_runs, offload):
    plain, other = _prompts()
    seq = [5, 200, 7, 7, 300]
    alone = plain_runs[0]
    eng = Engine(CFG.replace(cache__offload=offload), model)
    free = eng.submit(plain, 8, temperature=1.0, seed=4)
    req = eng.submit(other, 8, temperature=1.0, seed=2, constraint=Forced(seq))
    eng.run()
    assert req.tokens == seq and req.finish_reason == "stop"
    assert req.logprobs == [0.0] * len(seq)
    assert free.tokens == alone.tokens and free.logprobs == alone.logprobs


@pytest.mark.parametrize("drafts", [0, 2])
def test_an_allowed_set_is_never_left(model, plain_runs, drafts):
    prompts = _prompts()
    ids = IDS
    _, ref, want = plain_runs
    cfg = CFG.replace(engine__num_draft_tokens=drafts)
    for temp in (0.0, 1.5):
        eng = Engine(cfg, model)
        c = Among(ids)
        req = eng.submit(prompts[0], 12, temperature=temp, seed=1, constraint=c)
        free = eng.submit(prompts[1], 12)
        eng.run()
        assert len(req.tokens) == 12 and all(t % 3 == 0 for t in req.tokens), req.tokens
        assert c.taken == req.tokens
        assert free.tokens == ref.tokens
    # greedy under the mask is the masked argmax: the plain engine's constrained tokens
    eng = Engine(cfg, model)
    got = eng.submit(prompts[0], 12, constraint=Among(ids))
    eng.run()
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
