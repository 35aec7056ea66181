"""Speculative decoding in the engine: whatever the drafts, greedy speculative decoding
must emit EXACTLY the tokens of plain greedy decoding, with offload on and off (equal to
each other bit for bit), requests joining and leaving, and nothing leaked. The MTP
drafter (random weights: acceptance ≈ 0) must draft what a from-scratch MTP pass over
the same sequence predicts (so its cache rows are right); an oracle list drafter must
cut the step count; a half-right one must be accepted part of the time."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jlco import decode
from jlco.config import ConfigError, load_config
from jlco.engine import Engine
from jlco.kv_cache import init_cache
from jlco.model import DeepseekV32
from jlco.speculative import ListDrafter, MTPDrafter

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE = load_config(ROOT / "configs/tiny.py").replace(
    engine__attention_impl="xla", engine__max_batch_size=2, engine__max_context_len=160)
V = BASE.model.vocab_size
# Five requests on two slots: later ones join as earlier ones leave; the last finishes at
# prefill (one token). Prompts longer than index_topk (32) make the indexer select.
PROMPT_LENS, NEW_TOKENS = (5, 70, 40, 90, 12), (9, 4, 7, 6, 1)


@pytest.fixture(scope="module")
def model():
    return DeepseekV32(BASE.model, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [list(map(int, rng.integers(0, V, n))) for n in PROMPT_LENS]


def _run(cfg, model, prompts, temperature=0.0, **kw):
    eng = Engine(cfg, model, **kw)
    if eng.spec is not None:
        eng.spec.draft_log = []
    reqs = [eng.submit(p, n, temperature, seed=7) for p, n in zip(prompts, NEW_TOKENS)]
    eng.run()
    assert [r.status for r in reqs] == ["finished"] * len(reqs)
    assert [len(r.tokens) for r in reqs] == list(NEW_TOKENS)   # never more than asked
    eng.check_no_leaks()
    assert eng.slots == [None, None]
    if eng.pages is not None:
        assert eng.pages.used_pages == 0
    if eng.spec is not None:
        assert eng.spec.pend_n == {} and eng.spec._fresh == {}
    return eng, [r.tokens for r in reqs], [r.logprobs for r in reqs]


@pytest.fixture(scope="module")
def greedy(model, prompts):
    eng, toks, logps = _run(BASE, model, prompts)
    return eng.step_count, toks, logps


def _same_as(greedy, toks, logps):
    """Tokens exactly; log-probs within f32 summation-order noise: a verification step
    runs s_q = 1 + n query rows through the matmuls where plain decode runs 1, and XLA
    may block the reduction differently (on XLA:CPU they came out bit-equal)."""
    assert toks == greedy[1]
    for a, b in zip(logps, greedy[2]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


_RUNS = {}


def _spec_run(key, cfg, model, prompts, drafter=None):
    if key not in _RUNS:
        _RUNS[key] = _run(cfg, model, prompts, drafter=drafter)
    return _RUNS[key]


def _oracle(greedy, wrong_every=0):
    """Proposes the true continuation; with wrong_every=k, every k-th draft is wrong."""
    truth = greedy[1]

    def propose(req, n):
        out = truth[req.id][len(req.tokens):len(req.tokens) + n]
        if wrong_every:
            out = [(t + 1) % V if (j + 1) % wrong_every == 0 else t for j, t in enumerate(out)]
        return out
    return ListDrafter(propose)


def test_mtp_drafter_exact_offload_on_and_off(model, prompts, greedy):
    cfg = BASE.replace(engine__num_draft_tokens=2)
    off = _spec_run("mtp_off", cfg, model, prompts)
    on = _spec_run("mtp_on", cfg.replace(cache__offload=True), model, prompts)
    for eng, toks, logps in (off, on):
        _same_as(greedy, toks, logps)
        m = eng.spec.metrics
        assert m.emitted == sum(NEW_TOKENS) - len(NEW_TOKENS)   # the rest came from prefill
        assert m.drafted > 0 and m.accepted <= m.drafted
    assert on[1:] == off[1:], "offload on must equal offload off bit for bit"
    assert on[0].spec.draft_log == off[0].spec.draft_log
    total = on[0].metrics.snapshot()["total"]
    assert total["misses"] > 0 and total["lookups"] == total["hits"] + total["misses"]


def _reference_mtp_argmax(model, seq):
    """From scratch, one chunk: the main model over seq, then the MTP block over every
    position p with token p+1 → argmax [T-1] (index p predicts token p+2)."""
    graphdef, state = nnx.split(model)
    cache = init_cache(BASE, batch=1, max_len=len(seq))
    _, h, cache = decode.decode_step(graphdef, state, cache, jnp.asarray([seq], jnp.int32),
                                     impl="xla")
    logits, _, _ = decode.mtp_step(graphdef, state, cache, h[:, :-1],
                                   jnp.asarray([seq[1:]], jnp.int32),
                                   jnp.zeros((1,), jnp.int32), impl="xla")
    return np.asarray(jnp.argmax(logits[0], axis=-1))


def test_mtp_drafts_match_from_scratch_mtp(model, prompts):
    """The first draft of every step is the MTP prediction at position L-1 from
    (h_{L-1}, x_L): equal to a from-scratch MTP pass only if the engine's MTP cache
    rows (prefill chunks, catch-up after each verification, rejected rows rewritten)
    hold the right bytes."""
    eng, toks, _ = _spec_run("mtp_off", BASE.replace(engine__num_draft_tokens=2), model,
                             prompts)
    checked = 0
    for rid in (1, 3):   # 70 and 90 prompt tokens: several steps, sparse selection
        seq = prompts[rid] + toks[rid]
        ref = _reference_mtp_argmax(model, seq)
        n_prompt = len(prompts[rid])
        for req, count, drafts in eng.spec.draft_log:
            if req == rid:
                assert drafts[0] == ref[n_prompt + count - 2], (rid, count)
                checked += 1
    assert checked >= 6


@pytest.mark.parametrize("offload", [False, True])
def test_oracle_drafts_cut_steps(model, prompts, greedy, offload):
    cfg = BASE.replace(engine__num_draft_tokens=3, cache__offload=offload)
    eng, toks, logps = _spec_run(("oracle", offload), cfg, model, prompts, _oracle(greedy))
    _same_as(greedy, toks, logps)
    m = eng.spec.metrics
    assert m.acceptance_rate == 1.0 and m.accepted == m.drafted > 0
    assert m.mean_accepted_tokens > 2.0
    assert eng.step_count < greedy[0]
    if offload:
        off = _RUNS.get(("oracle", False))
        if off is not None:
            assert (toks, logps) == (off[1], off[2])


def test_half_right_drafts(model, prompts, greedy):
    cfg = BASE.replace(engine__num_draft_tokens=3)
    eng, toks, logps = _spec_run("half", cfg, model, prompts, _oracle(greedy, wrong_every=2))
    _same_as(greedy, toks, logps)
    m = eng.spec.metrics
    assert 0.2 < m.acceptance_rate < 0.8
    assert greedy[0] > eng.step_count


def test_sampling_draws_the_plain_engine_tokens(model, prompts, greedy):
    """temperature > 0: each position is sampled with the request's own per-token key,
    so with drafts equal to the plain engine's samples the same sequence comes out."""
    _, plain, plain_logp = _run(BASE, model, prompts, temperature=0.9)
    assert plain != greedy[1], "temperature 0.9 should leave greedy's path"
    drafter = ListDrafter(lambda req, n: plain[req.id][len(req.tokens):len(req.tokens) + n])
    eng, toks, logps = _run(BASE.replace(engine__num_draft_tokens=3), model, prompts,
                            temperature=0.9, drafter=drafter)
    assert toks == plain
    for a, b in zip(logps, plain_logp):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert eng.spec.metrics.acceptance_rate == 1.0


def test_abort_mid_run_frees_everything(model, prompts):
    eng = Engine(BASE.replace(engine__num_draft_tokens=2, cache__offload=True), model)
    a, b, c = (eng.submit(p, 12) for p in prompts[1:4])
    eng.step()
    eng.step()
    eng.abort(a.id)
    eng.check_no_leaks()
    eng.run()
    assert a.status == "aborted" and b.status == c.status == "finished"
    assert len(b.tokens) == len(c.tokens) == 12
    assert eng.pages.used_pages == 0 and eng.spec.pend_n == {}


def test_errors_name_the_field(model):
    no_mtp_cfg = dataclasses.replace(BASE.model, num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match="engine.num_draft_tokens"):
        BASE.replace(model=no_mtp_cfg, engine__num_draft_tokens=1)
    with pytest.raises(ValueError, match="drafter"):
        Engine(BASE, model, drafter=MTPDrafter())
    no_mtp = DeepseekV32(no_mtp_cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="engine.num_draft_tokens"):
        Engine(BASE.replace(engine__num_draft_tokens=1), no_mtp)
    with pytest.raises(ValueError, match="trace_path"):
        Engine(BASE.replace(engine__num_draft_tokens=1), model, trace_path="/tmp/x.trc")
    with pytest.raises(NotImplementedError, match="fetch_path"):
        Engine(BASE.replace(engine__num_draft_tokens=1, cache__offload=True,
                            cache__fetch_path="host_driven"), model)


def test_generate_cli_with_drafts(prompts, greedy):
    """`python -m jlco.generate --num_draft_tokens 2` on the random tiny model (the
    same weights as the fixture: seed 0) emits plain greedy's tokens and reports
    acceptance on stderr."""
    cmd = [sys.executable, "-m", "jlco.generate", "--num_draft_tokens", "2", "--impl", "xla",
           "--offload", "--json", "--max_new_tokens", str(NEW_TOKENS[0]),
           "--prompt_ids", ",".join(map(str, prompts[0]))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == greedy[1][0]
    assert "speculative: 2 drafts/step" in proc.stderr and "acceptance" in proc.stderr
