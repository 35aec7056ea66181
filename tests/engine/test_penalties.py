"""Penalties, logit bias, min_tokens and min-p on the device (`jlco.sampling.penalize`),
checked against a numpy reference over `transformers`' own logits in float32: every
greedy token is the reference's argmax after the request's rules and its log-prob the
reference's log-softmax; a request without rules decodes as it does alone, bit for bit,
beside one with them; speculative steps (drafts accepted and rejected) emit the plain
steps' tokens; bad fields are refused naming them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
from tests.support.hf_reference import build_hf_model, hf_tensors, t2n

from jlco.checkpoint.hf_names import model_from_hf
from jlco.config import load_config
from jlco.engine.core import Engine
from jlco.engine.scheduler import RequestError
from jlco.engine.speculative import ListDrafter
from jlco.model.decoder import DeepseekV32
from jlco.sampling.penalties import MAX_LOGIT_BIAS, Penalties

CFG = load_config("configs/tiny.py").replace(engine__attention_impl="xla",
                                             engine__max_batch_size=2,
                                             engine__max_context_len=96,
                                             engine__prefill_chunk=32)
V = CFG.model.vocab_size
RULES = Penalties(presence=0.7, frequency=0.4, repetition=1.6, min_tokens=4,
                  logit_bias=((3, 2.5), (11, -100.0), (17, 1.0)))


@pytest.fixture(scope="module")
def pair():
    ref = build_hf_model(CFG.model, seed=0, init_std=0.1, bias_std=0.05)
    return ref, model_from_hf(CFG.model, hf_tensors(ref), mtp=False)


def _prompts():
    rng = np.random.default_rng(5)
    return [list(map(int, rng.integers(0, V, n))) for n in (37, 45)]


def reference_rules(logits, prompt, generated, p: Penalties, stops):
    """The rules in numpy, vLLM's order: min_tokens, bias, repetition, frequency, presence."""
    x = np.asarray(logits, np.float64).copy()
    if len(generated) < p.min_tokens:
        x[list(stops)] = -np.inf
    for t, v in p.logit_bias:
        x[t] += v
    counts = np.bincount(np.asarray(generated, np.int64), minlength=V)
    seen = counts > 0
    seen[prompt] = True
    x = np.where(seen, np.where(x > 0, x / p.repetition, x * p.repetition), x)
    return x - p.frequency * counts - p.presence * (counts > 0)


def _hf_last(ref, ids):
    with torch.no_grad():
        return t2n(ref(torch.tensor([ids])).logits[0, -1].double())


def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


# offload on: the slow tier (pyproject.toml); offload on == off is test_engine.py's
@pytest.mark.parametrize("offload", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_greedy_tokens_follow_the_reference_rules(pair, offload):
    ref, model = pair
    plain, ruled = _prompts()
    solo = Engine(CFG, model)
    alone = solo.submit(plain, 10)
    solo.run()
    eng = Engine(CFG.replace(cache__offload=offload), model)
    # The stop id min_tokens holds back is the token the model picks first unpenalised.
    stop = int(np.argmax(_hf_last(ref, ruled)))
    free = eng.submit(plain, 10)
    req = eng.submit(ruled, 10, stop_token_ids=[stop], penalties=RULES)
    eng.run()
    assert free.tokens == alone.tokens and free.logprobs == alone.logprobs
    assert req.tokens[0] != stop and len(req.tokens) >= RULES.min_tokens
    for i, tok in enumerate(req.tokens):
        want = reference_rules(_hf_last(ref, ruled + req.tokens[:i]), ruled, req.tokens[:i],
                               RULES, [stop])
        assert tok == int(np.argmax(want)), i
        assert abs(req.logprobs[i] - _log_softmax(want)[tok]) < 1e-4, i
    assert 11 not in req.tokens                          # biased by -100


@pytest.mark.slow   # the slow tier; the plain engine's penalty tests stay in the default one
def test_speculative_steps_emit_the_plain_tokens():
    model = DeepseekV32(CFG.model, rngs=nnx.Rngs(0))     # with its MTP layer
    prompts = _prompts()
    kw = dict(stop_token_ids=[1], penalties=RULES)
    plain = Engine(CFG, model)
    want = [plain.submit(p, 12, **kw) for p in prompts]
    plain.run()
    oracle = ListDrafter(lambda r, n: want[r.id].tokens[len(r.tokens):len(r.tokens) + n])
    wrong = ListDrafter(lambda r, n: [5] * n)
    for drafter in (None, oracle, wrong):
        eng = Engine(CFG.replace(engine__num_draft_tokens=3), model, drafter=drafter)
        got = [eng.submit(p, 12, **kw) for p in prompts]
        eng.run()
        assert [g.tokens for g in got] == [w.tokens for w in want], drafter
        np.testing.assert_allclose([g.logprobs for g in got], [w.logprobs for w in want],
                                   atol=1e-5)
        if drafter is oracle:
            assert sum(g.num_accepted for g in got) > 0


def test_min_p_keeps_only_likely_tokens(pair):
    ref, model = pair
    prompt = _prompts()[0]
    eng = Engine(CFG, model)
    req = eng.submit(prompt, 8, temperature=1.5, seed=3, min_p=0.3)
    eng.run()
    for i, tok in enumerate(req.tokens):
        logits = _hf_last(ref, prompt + req.tokens[:i]) / 1.5
        p = np.exp(_log_softmax(logits))
        assert p[tok] >= 0.3 * p.max() * (1 - 1e-4), i


def test_penalty_fields_are_checked(pair):
    eng = Engine(CFG, pair[1])
    prompt = _prompts()[0]
    for rules, field in ((Penalties(presence=2.5), "presence_penalty"),
                         (Penalties(frequency=-3), "frequency_penalty"),
                         (Penalties(repetition=0.0), "repetition_penalty"),
                         (Penalties(min_tokens=9), "min_tokens"),
                         (Penalties(logit_bias=((V, 1.0),)), "logit_bias"),
                         (Penalties(logit_bias=((1, 101.0),)), "logit_bias"),
                         (Penalties(logit_bias=tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1))),
                          "logit_bias")):
        with pytest.raises(RequestError) as err:
            eng.submit(prompt, 8, penalties=rules)
        assert err.value.field == field, rules
    with pytest.raises(RequestError, match="min_p"):
        eng.submit(prompt, 8, min_p=1.5)
