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

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tests.support.split_steps import decode_step

from jlco.config import ConfigError, load_config
from jlco.engine.core import Engine
from jlco.engine.speculative import ListDrafter, MTPDrafter
from jlco.model import prefill
from jlco.model.decoder import DeepseekV32
from jlco.model.kv_cache import init_cache

ROOT = pathlib.Path(__file__).resolve().parents[2]
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


def _keep_finished_rows(eng):
    """→ {request id: (MTP-layer latent rows, indexer keys)} of its slot, copied when the
    request leaves it (offload off): a later request's install rewrites the whole slot."""
    layer, spec, runner, kept = BASE.model.num_hidden_layers, eng.runner.spec, eng.runner, {}
    forget = runner.forget

    def keeping(request_id):
        slots = [slot for rid, slot, _, _ in spec.draft_log if rid == request_id]
        if slots and not runner.offload:
            kept[request_id] = (np.asarray(runner.cache.latent[layer][slots[-1]]),
                                np.asarray(runner.cache.index_k[layer][slots[-1]]))
        forget(request_id)
    runner.forget = keeping
    return kept


def _run(cfg, model, prompts, temperature=0.0, **kw):
    eng = Engine(cfg, model, **kw)
    if eng.runner.spec is not None:
        eng.runner.spec.draft_log = []
        eng.finished_rows = _keep_finished_rows(eng)
    reqs = [eng.submit(p, n, temperature=temperature, seed=7) for p, n in zip(prompts, NEW_TOKENS)]
    eng.run()
    assert [r.status for r in reqs] == ["finished"] * len(reqs)
    assert [len(r.tokens) for r in reqs] == list(NEW_TOKENS)   # never more than asked
    eng.check_no_leaks()
    assert eng.scheduler.slots == [None, None]
    if eng.scheduler.pages is not None:
        assert eng.scheduler.pages.used_pages == 0
    if eng.runner.spec is not None:
        assert eng.runner.spec.pend_n == {} and eng.runner.spec._fresh == {}
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
    for a, b in zip(logps, greedy[2]):   # per-token log-prob lists, compared as arrays
        chex.assert_trees_all_close(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)


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


class _MixedDrafter(MTPDrafter):
    """The MTP drafter, except that on every second step of a request (the 2nd, 4th,
    ...) it proposes the true continuation instead: those steps accept all n drafts, so
    the next step's MTP catch-up covers n + 1 positions (random MTP weights alone never
    get a draft accepted). Same `propose`, so it shares the MTP drafter's compile."""

    def __init__(self, truth):
        self.truth, self.calls = truth, {}

    def host_drafts(self, slots, n):
        out = np.full((len(slots), n), -1, np.int32)
        for i, req in enumerate(slots):
            if req is not None:
                k = self.calls[req.id] = self.calls.get(req.id, -1) + 1
                if k % 2 == 1:
                    got = self.truth[req.id][len(req.tokens):len(req.tokens) + n]
                    out[i, :len(got)] = got
        return out


def _mtp_run(model, prompts):
    return _spec_run("mtp", BASE.replace(engine__num_draft_tokens=2), model, prompts)


def _mixed_run(model, prompts, greedy, offload):
    cfg = BASE.replace(engine__num_draft_tokens=2, cache__offload=offload)
    return _spec_run(("mixed", offload), cfg, model, prompts, _MixedDrafter(greedy[1]))


def test_mtp_drafter_exact(model, prompts, greedy):
    eng, toks, logps = _mtp_run(model, prompts)
    _same_as(greedy, toks, logps)
    m = eng.spec_metrics
    assert m.emitted == sum(NEW_TOKENS) - len(NEW_TOKENS)   # the rest came from prefill
    assert 0 < m.drafted and m.accepted <= m.drafted // 4   # random MTP weights


@pytest.mark.slow
def test_mixed_mtp_drafts_exact_offload_on_and_off(model, prompts, greedy):
    off = _mixed_run(model, prompts, greedy, False)
    on = _mixed_run(model, prompts, greedy, True)
    for eng, toks, logps in (off, on):
        _same_as(greedy, toks, logps)
        assert eng.spec_metrics.accepted > 0
    assert on[1:] == off[1:], "offload on must equal offload off bit for bit"
    assert on[0].runner.spec.draft_log == off[0].runner.spec.draft_log
    total = on[0].metrics.snapshot()["total"]
    assert total["misses"] > 0 and total["lookups"] == total["hits"] + total["misses"]


def _reference_mtp(model, seq):
    """From scratch, one chunk: the main model over seq, then the MTP block over every
    position p with token p+1 → (argmax [T-1]: index p predicts token p+2; the MTP
    hidden [1, T-1, d]; the cache holding every MTP row)."""
    graphdef, state = nnx.split(model)
    cache = init_cache(BASE, batch=1, max_len=len(seq))
    _, h, cache = decode_step(graphdef, state, cache, jnp.asarray([seq], jnp.int32),
                                     impl="xla")
    logits, x, cache = prefill.mtp_step(graphdef, state, cache, h[:, :-1],
                                       jnp.asarray([seq[1:]], jnp.int32),
                                       jnp.zeros((1,), jnp.int32), impl="xla")
    return np.asarray(jnp.argmax(logits[0], axis=-1)), x, cache


# "mixed" (a drafter mixing MTP and fixed drafts): the slow tier, with the other tests
# of that drafter
@pytest.mark.parametrize("run", ["mtp", pytest.param("mixed", marks=pytest.mark.slow)])
def test_mtp_drafts_match_from_scratch_mtp(model, prompts, greedy, run):
    """Every MTP step's drafts equal a from-scratch MTP pass over the final sequence:
    d_1 is the MTP prediction at L-1 from (h_{L-1}, x_L), d_2 the chained one at L from
    (the MTP's own hidden at L-1, d_1), over true rows 0..L-1 and the chain's row L.
    Equal only if the engine's MTP cache rows (prefill chunks, catch-up of 1 or n + 1
    positions after each verification, rejected rows rewritten) hold the right bytes."""
    eng = (_mtp_run(model, prompts) if run == "mtp" else
           _mixed_run(model, prompts, greedy, False))[0]
    rid = 3   # 90 prompt tokens: several steps, sparse selection in every layer
    seq, n_prompt = prompts[rid] + greedy[1][rid], len(prompts[rid])
    ref, x, cache = _reference_mtp(model, seq)
    graphdef, state = nnx.split(model)
    log = [(slot, count, drafts) for req, slot, count, drafts in eng.runner.spec.draft_log
           if req == rid]
    steps = [(count, drafts) for _, count, drafts in log]
    if run == "mixed":   # even steps are the MTP's (odd ones the oracle's)
        steps = steps[0::2]
    assert len(steps) >= 2
    for count, (d1, d2) in steps:
        pos = n_prompt + count - 1                    # L: position of the last token x_L
        assert d1 == ref[pos - 1], count
        chained, _, _ = prefill.mtp_step(graphdef, state, jax.tree.map(jnp.copy, cache),
                                        x[:, pos - 1:pos], jnp.asarray([[d1]], jnp.int32),
                                        jnp.asarray([pos], jnp.int32), impl="xla")
        assert d2 == int(jnp.argmax(chained[0, 0])), count
    # Random MTP weights make drafts insensitive to the attention context, so compare
    # the MTP layer's rows themselves: every position before the last step's L holds
    # (h_p, x_{p+1})'s latent row and indexer key (copied when the request left its slot).
    upto, layer = n_prompt + log[-1][1] - 1, BASE.model.num_hidden_layers
    rows, keys = eng.finished_rows[rid]
    got = rows[:upto].view(np.float32)
    want = np.asarray(cache.latent[layer][0, :upto]).view(np.float32)
    # f32 both sides, but the engine built these rows in batched verification steps (s_q =
    # 1 + drafts, 2 slots) and the reference in one from-scratch pass: different matmul
    # blocking and summation order; O(1) rows, so 1e-4 relative with a 1e-5 floor near zero.
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(keys[:upto], np.asarray(cache.index_k[layer][0, :upto]),
                                rtol=1e-4, atol=1e-5)


def test_oracle_drafts_cut_steps(model, prompts, greedy):
    cfg = BASE.replace(engine__num_draft_tokens=3)
    eng, toks, logps = _spec_run("oracle", cfg, model, prompts, _oracle(greedy))
    _same_as(greedy, toks, logps)
    m = eng.spec_metrics
    assert m.acceptance_rate == 1.0 and m.accepted == m.drafted > 0
    assert m.mean_accepted_tokens > 2.0
    assert eng.step_count < greedy[0]


def test_half_right_drafts(model, prompts, greedy):
    cfg = BASE.replace(engine__num_draft_tokens=3)
    eng, toks, logps = _spec_run("half", cfg, model, prompts, _oracle(greedy, wrong_every=2))
    _same_as(greedy, toks, logps)
    m = eng.spec_metrics
    assert 0.2 < m.acceptance_rate < 0.8
    assert greedy[0] > eng.step_count


def test_sampling_draws_the_plain_engine_tokens(model, prompts, greedy):
    """temperature > 0 with engine.spec_sampling="per_token": each position is sampled
    with the request's own per-token key, so with drafts equal to the plain engine's
    samples the same sequence comes out."""
    _, plain, plain_logp = _run(BASE, model, prompts, temperature=0.9)
    assert plain != greedy[1], "temperature 0.9 should leave greedy's path"
    drafter = ListDrafter(lambda req, n: plain[req.id][len(req.tokens):len(req.tokens) + n])
    eng, toks, logps = _run(BASE.replace(engine__num_draft_tokens=3,
                                         engine__spec_sampling="per_token"),
                            model, prompts, temperature=0.9, drafter=drafter)
    assert toks == plain
    for a, b in zip(logps, plain_logp):   # f32 summation-order noise, as in _same_as
        chex.assert_trees_all_close(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    assert eng.spec_metrics.acceptance_rate == 1.0


@pytest.mark.slow   # the slow tier; test_engine.py keeps an abort test in the default one
def test_abort_mid_run_frees_everything(model, prompts, greedy):
    eng = Engine(BASE.replace(engine__num_draft_tokens=2, cache__offload=True), model,
                 drafter=_MixedDrafter(greedy[1]))   # shares the mixed run's compile
    a, b, c = (eng.submit(p, 12) for p in prompts[1:4])
    eng.step()
    eng.step()
    eng.abort(a.id)
    eng.check_no_leaks()
    eng.run()
    assert a.status == "aborted" and b.status == c.status == "finished"
    assert len(b.tokens) == len(c.tokens) == 12
    assert eng.scheduler.pages.used_pages == 0 and eng.runner.spec.pend_n == {}


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


@pytest.mark.slow   # long on 2 CPU cores: the slow tier (pyproject.toml)
@pytest.mark.parametrize("n", [1, 2])
def test_mtp_host_driven_exact(model, prompts, greedy, n):
    """The host-driven fetch path (every attention block, the MTP block's included, as
    phases with the host fetching misses) speculates with MTP drafts: greedy's tokens."""
    cfg = BASE.replace(engine__num_draft_tokens=n, cache__offload=True,
                       cache__storage="unpinned_host")
    jit_eng, _, _ = _run(cfg, model, prompts)
    eng, toks, logps = _run(cfg.replace(cache__fetch_path="host_driven"), model, prompts)
    assert eng.runner.host is not None and jit_eng.runner.host is None
    _same_as(greedy, toks, logps)
    assert eng.runner.spec.draft_log == jit_eng.runner.spec.draft_log   # the same drafts


@pytest.mark.e2e
def test_generate_cli_with_drafts(prompts, greedy):
    """`python -m jlco.generate --num_draft_tokens 2` on the random tiny model (the
    same weights as the fixture: seed 0) emits plain greedy's tokens and reports
    acceptance on stderr."""
    cmd = [sys.executable, "-m", "jlco.generate", "--num_draft_tokens", "2", "--impl", "xla",
           "--json", "--max_new_tokens", str(NEW_TOKENS[0]),
           "--prompt_ids", ",".join(map(str, prompts[0]))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == greedy[1][0]
    assert "speculative: 2 drafts/step" in proc.stderr and "acceptance" in proc.stderr
