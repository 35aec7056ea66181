"""`merge_by_lse` (the hit/miss split attention's combine) against one attention over the
union, with the sparse MLA reference (`sparse_mla_decode_ref`) computing both parts and
the whole on random inputs, including queries whose parts are empty (lse = +inf)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jlco.pallas.lse_merge import merge_by_lse
from jlco.pallas.sparse_mla import sparse_mla_decode_ref

B, S, H, D_NOPE, D_ROPE, N, K = 3, 2, 4, 16, 8, 40, 12
# f32 rounding of a re-associated softmax sum: outputs are O(1) averages of O(1) values;
# the measured max |difference| is 4.8e-7 over 20 seeds, so 2e-6 is a 4x margin, and a wrong weight
# (e.g. lse_a and lse_b swapped, or a part dropped) moves outputs by 1e-2 or more.
ATOL = 2e-6


def _attend(q, kv, idx):
    return sparse_mla_decode_ref(q, kv, idx, 0.3, kv_format="f32", d_rope=D_ROPE)


def _inputs(seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, S, H, D_NOPE + D_ROPE)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(N, D_NOPE + D_ROPE)), jnp.float32)
    idx = np.stack([[rng.permutation(N)[:K] for _ in range(S)] for _ in range(B)])
    idx[0, 0, 5:] = -1                                      # a short selection
    idx[2, 1, :] = -1                                       # a query selecting nothing
    return q, kv, idx.astype(np.int32), rng


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merge_equals_unsplit_attention(seed):
    q, kv, idx, rng = _inputs(seed)
    in_a = rng.random(idx.shape) < 0.5
    in_a[1, 0, :] = True                                    # b part empty for this query
    in_a[1, 1, :] = False                                   # a part empty for this query
    a = jnp.asarray(np.where(in_a, idx, -1))
    b = jnp.asarray(np.where(in_a, -1, idx))
    (out_a, lse_a), (out_b, lse_b) = _attend(q, kv, a), _attend(q, kv, b)
    want_out, want_lse = _attend(q, kv, jnp.asarray(idx))
    out, lse = merge_by_lse(out_a, lse_a, out_b, lse_b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=0, atol=ATOL)
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite],
                               rtol=0, atol=ATOL)
    # the empty-query convention: nothing selected → out 0, lse +inf (both parts empty)
    assert np.all(np.isposinf(np.asarray(lse)[2, 1])) and not np.asarray(out)[2, 1].any()
    assert np.array_equal(np.isposinf(np.asarray(lse)), np.isposinf(np.asarray(want_lse)))
    # one part empty: the other part comes back bit for bit
    np.testing.assert_array_equal(np.asarray(out)[1, 0], np.asarray(out_a)[1, 0])
    np.testing.assert_array_equal(np.asarray(lse)[1, 0], np.asarray(lse_a)[1, 0])
    np.testing.assert_array_equal(np.asarray(out)[1, 1], np.asarray(out_b)[1, 1])
    np.testing.assert_array_equal(np.asarray(lse)[1, 1], np.asarray(lse_b)[1, 1])


def test_merge_weighs_parts_by_their_mass():
    """By hand: part a has twice b's mass (lse a = log 2 + lse b) → out = (2·a + b) / 3."""
    out_a, out_b = jnp.ones((1, 2)), jnp.full((1, 2), 4.0)
    out, lse = merge_by_lse(out_a, jnp.log(jnp.asarray([2.0])), out_b, jnp.zeros((1,)))
    np.testing.assert_allclose(np.asarray(out), [[2.0, 2.0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), [np.log(3.0)], rtol=1e-6)


def test_merge_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="merge_by_lse: shapes"):
        merge_by_lse(jnp.zeros((2, 3)), jnp.zeros((2,)), jnp.zeros((2, 4)), jnp.zeros((2,)))
