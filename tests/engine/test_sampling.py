"""Sampling filters (`sampling.sampling_logits`, `sampling.sample_rows`) against an independent
float64 numpy reference of temperature, then top-k, then top-p over the top-k
renormalised distribution (vLLM's order), ties with the last kept value kept: the kept
sets, greedy rows, top_k = 1, bit-identical unfiltered rows beside filtering ones, and
the sampled frequencies."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlco.sampling.sample import sample_rows, sampling_logits

V = 64
# (temperature, top_p, top_k): no filter, top-p only, top-k only, k = V and k > V (filter
# nothing), top-p near 1, a narrow nucleus, and both (rows 3, 4, 9: with this data the
# nucleus over the top-k renormalised distribution is smaller than top-p over the full
# one cut to k, so the order is tested).
PARAMS = [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (2.0, 0.8, 6), (1.5, 0.6, 4),
          (2.0, 0.3, 0), (1.0, 1.0, V), (0.9, 1.0, V + 7), (0.8, 0.999, 0), (3.0, 0.95, 12)]


def reference_keep(logits, temp, top_p, top_k):
    """Plain numpy, float64, one row → (kept bool [V], smallest distance between top_p and
    a cumulative mass, i.e. how far the row is from a float-rounding tie)."""
    s = np.asarray(logits, np.float64) / temp
    keep = np.ones(s.shape, bool)
    if 0 < top_k < s.size:
        keep &= s >= np.sort(s)[::-1][top_k - 1]
    margin = np.inf
    if top_p < 1.0:
        idx = np.flatnonzero(keep)
        p = np.exp(s[idx] - s[idx].max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        above = np.cumsum(p[order]) - p[order]        # mass ranked before each token
        n = max(1, int((above < top_p).sum()))
        keep &= s >= s[idx[order[n - 1]]]
        margin = float(np.abs(above - top_p).min())
    return keep, margin


def reference_probs(logits, temp, top_p, top_k):
    keep, _ = reference_keep(logits, temp, top_p, top_k)
    s = np.asarray(logits, np.float64) / temp
    p = np.where(keep, np.exp(s - s[keep].max()), 0.0)
    return p / p.sum()


def _args(params):
    temps, top_ps, top_ks = zip(*params)
    return (jnp.asarray(temps, jnp.float32), jnp.asarray(top_ps, jnp.float32),
            jnp.asarray(top_ks, jnp.int32))


@pytest.fixture(scope="module")
def logits():
    return np.random.default_rng(0).normal(0.0, 3.0, (len(PARAMS), V)).astype(np.float32)


def test_kept_sets_match_reference(logits):
    out = np.asarray(jax.jit(sampling_logits)(jnp.asarray(logits), *_args(PARAMS)))
    for row, (t, p, k) in enumerate(PARAMS):
        keep, margin = reference_keep(logits[row], t, p, k)
        # The kernel sums f32 probabilities (a cumulative mass of <= 64 terms is off by a
        # few 1e-6 at most): one within that of top_p could flip a token; the fixed data
        # keep clear of it.
        assert margin > 1e-5, (row, margin)
        chex.assert_trees_all_equal(np.isfinite(out[row]), keep)
        # Kept logits are the tempered ones: jnp and numpy both divide in f32
        # (correctly rounded), but XLA may fold the division into a multiplication by
        # the reciprocal: 1 ulp.
        chex.assert_trees_all_close(out[row][keep], logits[row][keep] / np.float32(t),
                                    rtol=2e-7, atol=0)


def test_ties_at_the_threshold_are_kept():
    row = np.zeros((V,), np.float32)
    row[:4] = [3.0, 1.0, 1.0, 0.5]
    row[4:] = -20.0
    # top-p 0.8: the nucleus ends at the first 1.0 (mass above it 0.76 < 0.8), its tie
    # stays; top-k 2: the second-largest value is 1.0, both copies stay.
    params = [(1.0, 0.8, 0), (1.0, 1.0, 2)]
    out = np.asarray(sampling_logits(jnp.asarray(np.stack([row, row])), *_args(params)))
    for got, (t, p, k) in zip(out, params):
        keep, _ = reference_keep(row, t, p, k)
        chex.assert_trees_all_equal(np.flatnonzero(keep), np.arange(3))
        chex.assert_trees_all_equal(np.isfinite(got), keep)


def test_greedy_rows_ignore_filters(logits):
    params = [(0.0, 0.1, 3), (0.0, 1.0, 0), (0.0, 0.5, 0)]
    x = jnp.asarray(logits[:3])
    chex.assert_trees_all_equal(np.asarray(sampling_logits(x, *_args(params))), logits[:3])
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    tok, logp = sample_rows(x, *_args(params)[:1], keys, *_args(params)[1:])
    chex.assert_trees_all_equal(np.asarray(tok), logits[:3].argmax(-1).astype(np.int32))
    # The reported log-prob is of the untempered, unfiltered distribution; f32 log-softmax
    # against float64: a few ulp of values ~ -1.
    want = jax.nn.log_softmax(logits[:3].astype(np.float64), axis=-1)
    chex.assert_trees_all_close(np.asarray(logp), np.asarray(want)[np.arange(3), tok],
                                rtol=0, atol=1e-5)


def test_top_k_one_is_argmax(logits):
    n = 50
    x = jnp.asarray(np.repeat(logits[:1], n, axis=0))
    params = [(1.5, 1.0, 1)] * n
    keys = jax.random.split(jax.random.PRNGKey(5), n)
    tok, _ = sample_rows(x, _args(params)[0], keys, *_args(params)[1:])
    chex.assert_trees_all_equal(np.asarray(tok), np.full((n,), logits[0].argmax(), np.int32))


def test_unfiltered_row_is_bit_identical_beside_a_filtering_row(logits):
    """Row 0 (no filter) draws the same tokens with the same keys whether row 1 filters
    (the sort branch runs) or not (the identity branch)."""
    n = 200
    keys = jax.random.split(jax.random.PRNGKey(7), 2 * n).reshape(n, 2, 2)
    x = jnp.asarray(logits[:2])

    @jax.jit
    def draws(top_ps, top_ks):
        temps = jnp.asarray([0.8, 0.8], jnp.float32)
        return jax.vmap(lambda k: sample_rows(x, temps, k, top_ps, top_ks))(keys)

    plain = draws(jnp.asarray([1.0, 1.0]), jnp.asarray([0, 0], jnp.int32))
    beside = draws(jnp.asarray([1.0, 0.5]), jnp.asarray([0, 4], jnp.int32))
    chex.assert_trees_all_equal(np.asarray(plain[0][:, 0]), np.asarray(beside[0][:, 0]))
    chex.assert_trees_all_equal(np.asarray(plain[1][:, 0]), np.asarray(beside[1][:, 0]))
    assert (np.asarray(plain[0][:, 1]) != np.asarray(beside[0][:, 1])).any()
    rows = np.asarray(sampling_logits(x, jnp.asarray([0.8, 0.8]), jnp.asarray([1.0, 0.5]),
                                      jnp.asarray([0, 4], jnp.int32)))
    chex.assert_trees_all_equal(rows[0], np.asarray(x[0] / jnp.float32(0.8)))


@pytest.mark.parametrize("params", [(1.0, 0.8, 0), (0.7, 0.9, 6)])
def test_sampled_frequencies_follow_the_kept_distribution(params):
    n, v = 20000, 16
    row = np.random.default_rng(2).normal(0.0, 1.5, (v,)).astype(np.float32)
    keep, margin = reference_keep(row, *params)
    assert margin > 1e-5 and 1 < keep.sum() < v, (margin, keep)   # a real nucleus
    temps, top_ps, top_ks = (jnp.full((n,), a) for a in _args([params]))
    keys = jax.random.split(jax.random.PRNGKey(11), n)
    tok, _ = jax.jit(sample_rows)(jnp.broadcast_to(jnp.asarray(row), (n, v)), temps, keys,
                                  top_ps, top_ks)
    freq = np.bincount(np.asarray(tok), minlength=v) / n
    assert freq[~keep].sum() == 0.0
    # Binomial standard error sqrt(p(1-p)/n) <= 0.5/sqrt(20000) = 0.0035 per token, so
    # 0.02 is > 5 sigma: a wrong renormalisation (a token's share off by >= 0.02) fails.
    chex.assert_trees_all_close(freq, reference_probs(row, *params), rtol=0, atol=0.02)
