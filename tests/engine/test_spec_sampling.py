"""Speculative decoding at temperature > 0 (`engine.spec_sampling`). The rejection rule
(`rejection_accept`) emits tokens distributed as the target p, whatever the draft (a
synthetic case over many keys); in the engine "rejection" is reproducible (same seed,
same tokens, alone or beside other requests), reports per-request drafted / accepted
counts, and with top_k = 1 is greedy; "per_token" with top-p / top-k draws the plain
engine's tokens. (Greedy speculative == greedy plain: tests/engine/test_speculative.py.)"""

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jlco.config import load_config
from jlco.engine.core import Engine
from jlco.engine.speculative import ListDrafter
from jlco.model.decoder import DeepseekV32
from jlco.sampling.sample import rejection_accept

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = load_config(ROOT / "configs/tiny.py").replace(
    engine__attention_impl="xla", engine__max_batch_size=2, engine__max_context_len=96)
V = BASE.model.vocab_size
# Three requests on two slots (the third joins as one leaves). Prompts >= 32 tokens: the
# prefill's last-32-queries piece has one shape for all of them (one compile).
PROMPT_LENS, NEW_TOKENS, SEEDS = (40, 33, 36), (12, 9, 10), (7, 8, 9)
N_KEYS = 20000


# ---- the rule alone -------------------------------------------------------------------
def _emitted(logits, drafts, n_keys=N_KEYS, seed=0):
    """Draw the rule over n_keys keys → (tokens [K, s], accepted leading drafts [K])."""
    s = logits.shape[0]
    keys = jax.random.split(jax.random.PRNGKey(seed), n_keys * s).reshape(n_keys, s, 2)
    tok, acc = jax.jit(jax.vmap(rejection_accept, in_axes=(None, None, 0)))(
        jnp.asarray(logits), jnp.asarray(drafts, jnp.int32), keys)
    return np.asarray(tok), np.asarray(jnp.cumprod(acc.astype(jnp.int32), axis=1).sum(axis=1))


def _assert_distributed_as(samples, p):
    """Counts of `samples` against probabilities p: zero where p is 0, and Pearson's
    chi-square over the rest below its mean + 6 standard deviations (dof + 6 sqrt(2 dof),
    ~ 24 for the 6 tokens here): loose enough that sampling noise never fails it (the
    keys are fixed, but the margin survives a PRNG change), tight enough to catch mass
    moved between tokens (0.02 moved at n = 20000 samples adds >= 0.02^2 n / p >= 20 per
    token changed, p <= 0.4, and two tokens change)."""
    counts = np.bincount(samples, minlength=p.size)
    assert counts[p == 0].sum() == 0, np.flatnonzero(counts * (p == 0))
    want = p[p > 0] * samples.size
    chi2 = float(((counts[p > 0] - want) ** 2 / want).sum())
    dof = int((p > 0).sum()) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)
    # The same read as frequencies: each within 5 worst-case binomial standard errors
    # (0.5 / sqrt(n)).
    chex.assert_trees_all_close(counts / samples.size, p, rtol=0,
                                atol=2.5 / np.sqrt(samples.size))


def _target():
    """Two positions' sampling logits over 8 tokens (-inf = filtered out by top-k/p)."""
    p = np.array([[0.35, 0.25, 0.15, 0.1, 0.08, 0.07, 0.0, 0.0],
                  [0.05, 0.4, 0.3, 0.1, 0.1, 0.05, 0.0, 0.0]])
    return np.where(p > 0, np.log(np.maximum(p, 1e-30)), -np.inf).astype(np.float32), p


@pytest.mark.parametrize("draft", [0, 2, 6], ids=["likely", "mid", "filtered-out"])
def test_rejection_first_token_is_distributed_as_p(draft):
    logits, p = _target()
    tok, acc = _emitted(logits, [draft])
    _assert_distributed_as(tok[:, 0], p[0])
    # The draft is kept exactly when accepted, with probability p(d) (K-sample binomial
    # error <= 0.0035; 0.015 is > 4 sigma).
    chex.assert_trees_all_equal(acc == 1, tok[:, 0] == draft)
    chex.assert_trees_all_close((acc == 1).mean(), p[0, draft], rtol=0, atol=0.015)


def test_rejection_chain_emits_p_at_every_position():
    """Two drafts: token 1 is emitted only after draft 1 was accepted and is then
    distributed as p_1 (accepted draft 2 or the residual); the bonus token after both
    drafts (position 2) as p_2."""
    logits, p = _target()
    logits = np.concatenate([logits, logits[:1]])               # p_2 = p_0
    tok, acc = _emitted(logits, [0, 2], n_keys=2 * N_KEYS)
    first = acc >= 1
    # P(first draft accepted) = p_0(0) = 0.35 of 40000 keys: ~14000 samples of token 1.
    _assert_distributed_as(tok[first, 1], p[1])
    _assert_distributed_as(tok[acc == 2, 2], p[0])
    # P(both accepted) = p_0(0) p_1(2); binomial error at 40000 keys ~ 0.0016.
    chex.assert_trees_all_close((acc == 2).mean(), p[0, 0] * p[1, 2], rtol=0, atol=0.008)


def test_rejection_point_mass_target_is_deterministic():
    """top_k = 1 leaves one finite logit: p is a point mass, so the rule must emit it
    (accepted when the draft is it, the residual or bonus otherwise), never a filtered
    token, over every key."""
    row = np.full((8,), -np.inf, np.float32)
    row[3] = 0.0
    tok, acc = _emitted(np.stack([row, row]), [3], n_keys=500)
    assert (tok == 3).all() and (acc == 1).all()
    tok, acc = _emitted(np.stack([row, row]), [5], n_keys=500)
    assert (tok[:, 0] == 3).all() and (acc == 0).all()


# ---- in the engine --------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return DeepseekV32(BASE.model, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [list(map(int, rng.integers(0, V, n))) for n in PROMPT_LENS]


def _run(cfg, model, prompts, which=None, *, temperature, top_p=1.0, top_k=0, drafter=None):
    """Requests `which` (default all) of `prompts` → (engine, their tokens, per-step spec
    outputs [(running ids, drafted, accepted, emitted counts)], the requests)."""
    eng = Engine(cfg, model, drafter=drafter)
    steps = []
    if eng.runner.spec is not None:
        def recording(rec):
            out = rec.output
            steps.append(([r.id for r in rec.running], out.drafted, out.accepted,
                          [len(t) for t in out.tokens]))
        eng.add_step_observer(recording)
    which = range(len(prompts)) if which is None else which
    reqs = [eng.submit(prompts[i], NEW_TOKENS[i], temperature=temperature, seed=SEEDS[i],
                       top_p=top_p, top_k=top_k) for i in which]
    eng.run()
    assert [len(r.tokens) for r in reqs] == [NEW_TOKENS[i] for i in which]
    eng.check_no_leaks()
    return eng, [r.tokens for r in reqs], steps, reqs


def _greedy_drafter(greedy):
    """Proposes greedy's continuation at the request's position (the request id is its
    index in `prompts`): often the likeliest token at a low temperature."""
    return ListDrafter(lambda req, n: greedy[req.id][len(req.tokens):len(req.tokens) + n])


@pytest.fixture(scope="module")
def greedy(model, prompts):
    return _run(BASE, model, prompts, temperature=0.0)[1]


# The random tiny model's next-token distribution is nearly flat (greedy's log-prob
# ~ -5.8 against log(1/512) = -6.2): top_k = 3 gives greedy drafts an acceptance of
# roughly a third, so both accepts and rejections happen.
REJECTION = {"temperature": 0.5, "top_k": 3}


@pytest.fixture(scope="module")
def rejection(model, prompts, greedy):
    cfg = BASE.replace(engine__num_draft_tokens=3, engine__spec_sampling="rejection")
    return _run(cfg, model, prompts, drafter=_greedy_drafter(greedy), **REJECTION)


def test_rejection_is_reproducible_alone_and_in_a_batch(model, prompts, greedy, rejection):
    toks = rejection[1]
    assert toks != greedy, "sampling should leave greedy's path somewhere"
    cfg = BASE.replace(engine__num_draft_tokens=3, engine__spec_sampling="rejection")
    again = _run(cfg, model, prompts, drafter=_greedy_drafter(greedy), **REJECTION)[1]
    assert again == toks
    for i in range(len(prompts)):
        # Alone, the request's id is 0: the drafter is told its prompt index instead.
        truth = {0: greedy[i]}
        alone = _run(cfg, model, prompts, [i], drafter=_greedy_drafter(truth), **REJECTION)
        assert alone[1] == [toks[i]], i


def test_rejection_reports_drafted_and_accepted(rejection):
    eng, _, steps, reqs = rejection
    m = eng.spec_metrics
    assert sum(sum(d) for _, d, _, _ in steps) == m.drafted > 0
    assert sum(sum(a) for _, _, a, _ in steps) == m.accepted > 0
    assert m.accepted < m.drafted, "top_k = 3 should reject some greedy drafts"
    for ids, drafted, accepted, emitted in steps:
        assert len(ids) == len(drafted) == len(accepted) == len(emitted)
        for d, a, e in zip(drafted, accepted, emitted):
            assert 0 <= a <= d <= 3 and e == a + 1
    # The engine adds each step's counts to the request (`DecodeOutput.drafted/accepted`).
    assert [r.num_drafted for r in reqs] == [
        sum(d[ids.index(r.id)] for ids, d, _, _ in steps if r.id in ids) for r in reqs]
    assert [r.num_accepted for r in reqs] == [
        sum(a[ids.index(r.id)] for ids, _, a, _ in steps if r.id in ids) for r in reqs]


def test_rejection_with_top_k_one_is_greedy(model, prompts, greedy):
    """top_k = 1 makes every p a point mass at the argmax: rejection then accepts a
    draft exactly when greedy would, and redraws the argmax, so greedy's tokens come out
    (filters reach the speculative step)."""
    cfg = BASE.replace(engine__num_draft_tokens=3, engine__spec_sampling="rejection")
    eng, toks, _, _ = _run(cfg, model, prompts, temperature=0.8, top_k=1,
                        drafter=_greedy_drafter(greedy))
    assert toks == greedy
    assert eng.spec_metrics.acceptance_rate == 1.0


def test_per_token_with_filters_draws_the_plain_engine_tokens(model, prompts):
    """"per_token" with top-p / top-k: every position is drawn with the plain engine's
    key and filters, so drafts equal to the plain engine's samples are all accepted and
    the same tokens come out."""
    kw = {"temperature": 0.9, "top_p": 0.9, "top_k": 50}
    plain = _run(BASE, model, prompts, **kw)[1]
    cfg = BASE.replace(engine__num_draft_tokens=3, engine__spec_sampling="per_token")
    eng, toks, _, _ = _run(cfg, model, prompts, drafter=_greedy_drafter(plain), **kw)
    assert toks == plain
    assert eng.spec_metrics.acceptance_rate == 1.0
