"""Prompt log-probs (`echo`, lm-eval's loglikelihood) and the first token's alternatives:
the engine's equal transformers' log-softmax of its own logits on the same checkpoint in
float32 (within 1e-4), over prompts that span whole chunks and tail pieces; the top-k
lists are the distribution's k most likely ids in order; a request that echoes computes
every position (no prefix reuse)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.support.hf_reference import build_hf_model, hf_tensors, t2n

from jlco.checkpoint.hf_names import model_from_hf
from jlco.config import load_config
from jlco.engine.core import Engine

CFG = load_config("configs/tiny.py").replace(engine__attention_impl="xla",
                                             engine__max_batch_size=2,
                                             engine__max_context_len=160,
                                             engine__prefill_chunk=32)


@pytest.fixture(scope="module")
def pair():
    ref = build_hf_model(CFG.model, seed=0, init_std=0.1, bias_std=0.05)
    return ref, model_from_hf(CFG.model, hf_tensors(ref), mtp=False)


def _hf_logprobs(ref, prompt):
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0].double()
    return t2n(torch.log_softmax(logits, -1))          # [n, V]: row q predicts q + 1


@pytest.mark.parametrize("offload", [False, True])
def test_prompt_logprobs_equal_transformers(pair, offload):
    ref, model = pair
    rng = np.random.default_rng(4)
    prompt = list(map(int, rng.integers(0, CFG.model.vocab_size, 77)))   # 2 chunks + tail
    eng = Engine(CFG.replace(cache__offload=offload), model)
    eng.generate([prompt[:40]], 1)                      # a cached prefix (not used: echo)
    req = eng.submit(prompt, 1, prompt_logprobs=3, top_logprobs=2)
    eng.run()
    want = _hf_logprobs(ref, prompt)
    got = req.prompt_logprob_out
    assert req.cached_tokens == 0 and len(got) == len(prompt) - 1
    lp = np.array([g[0] for g in got])
    np.testing.assert_allclose(lp, want[np.arange(76), prompt[1:]], atol=1e-4, rtol=0)
    for q, (_, top) in enumerate(got):
        assert [i for i, _ in top] == list(np.argsort(-want[q])[:3]), q
        np.testing.assert_allclose([v for _, v in top], np.sort(want[q])[::-1][:3], atol=1e-4)
    # the generated token: its log-prob and alternatives from the last position's row
    assert req.tokens[0] == int(np.argmax(want[-1]))
    assert abs(req.logprobs[0] - want[-1].max()) < 1e-4
    assert [i for i, _ in req.top_out[0]] == list(np.argsort(-want[-1])[:2])


def test_logprob_fields_are_checked(pair):
    eng = Engine(CFG, pair[1])
    from jlco.engine.scheduler import RequestError
    for kw in (dict(prompt_logprobs=21), dict(top_logprobs=-1), dict(prompt_logprobs=True)):
        with pytest.raises(RequestError, match=next(iter(kw))):
            eng.submit([1, 2, 3], 1, **kw)


@pytest.mark.parametrize("offload", [False, True])
def test_every_generated_token_gets_its_alternatives(pair, offload):
    """top_logprobs on decoded tokens (the decode step's `top_alternatives`): each
    token's k most likely ids and log-probs equal transformers' on the same sequence; a
    request beside it without alternatives gets none (and the same tokens as alone)."""
    ref, model = pair
    rng = np.random.default_rng(6)
    prompt = list(map(int, rng.integers(0, CFG.model.vocab_size, 45)))
    other = list(map(int, rng.integers(0, CFG.model.vocab_size, 30)))
    eng = Engine(CFG.replace(cache__offload=offload), model)
    req = eng.submit(prompt, 5, top_logprobs=4)
    plain = eng.submit(other, 5)
    eng.run()
    want = _hf_logprobs(ref, prompt + req.tokens[:-1])[len(prompt) - 1:]     # [5, V]
    assert req.tokens == [int(np.argmax(w)) for w in want]
    assert len(req.top_out) == 5 and plain.top_out == []
    for w, top, lp in zip(want, req.top_out, req.logprobs):
        assert [i for i, _ in top] == list(np.argsort(-w)[:4])
        np.testing.assert_allclose([v for _, v in top], np.sort(w)[::-1][:4], atol=1e-4)
        assert abs(top[0][1] - lp) < 1e-5
    alone = Engine(CFG.replace(cache__offload=offload), model).generate([other], 5)[0]
    assert plain.tokens == alone.tokens


def test_speculative_steps_give_the_same_alternatives():
    """With MTP drafts each emitted token (accepted drafts and the bonus token alike)
    carries the alternatives the plain step gives it (f32, greedy)."""
    from tests.support.engine_workload import make_model
    cfg = CFG.replace(model__num_nextn_predict_layers=1)
    model = make_model(cfg)
    prompt = list(range(3, 60))
    plain = Engine(cfg, model).generate([prompt], 6)[0]
    spec_eng = Engine(cfg.replace(engine__num_draft_tokens=1), model)
    spec = spec_eng.submit(prompt, 6, top_logprobs=3)
    spec_eng.run()
    ref = Engine(cfg, model)
    want = ref.submit(prompt, 6, top_logprobs=3)
    ref.run()
    assert spec.tokens == want.tokens == plain.tokens and len(spec.top_out) == 6
    assert spec_eng.spec_metrics.drafted > 0
    for a, b in zip(spec.top_out, want.top_out):
        assert [i for i, _ in a] == [i for i, _ in b]
        np.testing.assert_allclose([v for _, v in a], [v for _, v in b], atol=1e-5)
