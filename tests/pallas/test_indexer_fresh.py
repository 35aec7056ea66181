"""`fresh` keys (a decode step scores the cache as it was before its own keys are written,
`jlco.model.attention.fresh_keys_first`): the same top-k as writing first, in the
reference (single block and streamed) and through the kernels, and the decode step
XLA:CPU compiles then copies no layer's key cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.pallas.test_indexer_kernel import _check, _inputs
from tests.support.decode_hlo import compiled_decode_step

from jlco.pallas import dispatch
from jlco.pallas import indexer as ix
from jlco.pallas import indexer_ref as ixr


def _fresh(k, scale, positions, seed):
    """New keys for `positions` [b, s] in k's dtype (stale rows left in k there)."""
    rng = np.random.default_rng(seed)
    b, s = positions.shape
    new = rng.standard_normal((b, s, k.shape[2])).astype(np.float32)
    if k.dtype == jnp.uint8:
        keys = jax.lax.bitcast_convert_type(jnp.asarray(new).astype(jnp.float8_e4m3fn), jnp.uint8)
        return keys, jnp.asarray(2.0 ** rng.integers(-3, 3, (b, s)), jnp.float32), positions
    return jnp.asarray(new, k.dtype), None, positions


@pytest.mark.parametrize("key_format", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("streamed", [False, True])
def test_fresh_keys_score_as_if_written(monkeypatch, key_format, s_q, streamed):
    # Ragged batch: request 1's fresh positions run past the end of the cache (dropped,
    # like the write drops them) and request 2's step is its first tokens.
    if streamed:
        monkeypatch.setattr(ixr, "REF_BLOCK_ELEMS", s_q * 8 * 256)      # blocks of 256 keys
    q, w, k, scale = _inputs(3, b=3, s_q=s_q, h=8, d=64, length=700, key_format=key_format)
    lengths = jnp.asarray([650, 700 + s_q - 1, s_q], jnp.int32)
    positions = lengths[:, None] - s_q + jnp.arange(s_q)[None]
    fresh = _fresh(k, scale, positions, 4)
    fmt = "fp8" if key_format == "fp8" else "bf16"
    written, wscale = ixr.write_fresh(k, scale, fresh)
    assert not np.array_equal(np.asarray(written), np.asarray(k))
    want = ixr.indexer_topk_ref.__wrapped__(q, w, written, lengths, 64, k_scale=wscale,
                                           key_format=fmt)
    got = ixr.indexer_topk_ref.__wrapped__(q, w, k, lengths, 64, k_scale=scale,
                                          key_format=fmt, fresh=fresh)
    _check(got, want, np.asarray(lengths), s_q, 64)
    # keys already written: the same again (the host-driven engine writes first)
    again = ixr.indexer_topk_ref.__wrapped__(q, w, written, lengths, 64, k_scale=wscale,
                                            key_format=fmt, fresh=fresh)
    for a, b in zip(again, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kernel_is_given_the_written_cache():
    q, w, k, scale = _inputs(5, b=2, s_q=2, h=16, d=64, length=384, key_format="bf16")
    lengths = jnp.asarray([384, 100], jnp.int32)
    fresh = _fresh(k, scale, lengths[:, None] - 2 + jnp.arange(2)[None], 6)
    got = dispatch.indexer_topk(q, w, k, lengths, 32, key_format="bf16", impl="interpret",
                                fresh=fresh)
    want = dispatch.indexer_topk(q, w, k, lengths, 32, key_format="bf16", impl="xla",
                                 fresh=fresh)
    _check(got, want, np.asarray(lengths), 2, 32)


@pytest.mark.parametrize("bad, match", [
    (lambda k, s, p: (k[:, :, :8], s, p), "fresh keys"),
    (lambda k, s, p: (k.astype(jnp.bfloat16), s, p), "fresh keys"),
    (lambda k, s, p: (k, s, p[:, :1]), "fresh positions"),
    (lambda k, s, p: (k, jnp.ones(p.shape), p), "fresh scales"),
])
def test_bad_fresh_keys_are_named(bad, match):
    q, w, k, _ = _inputs(1, b=1, s_q=2, h=4, d=32, length=64, key_format="f32")
    lengths = jnp.asarray([64], jnp.int32)
    fresh = bad(*_fresh(k, None, jnp.asarray([[62, 63]], jnp.int32), 2))
    with pytest.raises(ValueError, match=match):
        ixr.indexer_topk_ref(q, w, k, lengths, 8, key_format="bf16", fresh=fresh)


@pytest.mark.parametrize("batch", [1, 4])
def test_decode_step_copies_no_key_cache(batch):
    # Written before they were scored, XLA:CPU copied (transposed) every layer's keys
    # each step: 1.2 ms a layer at 16K on the 2-core box.
    _, run, hlo = compiled_decode_step(batch, 512)
    key_shape = "[%d,%d,%d]" % run.cache.index_k[0].shape
    t, d = run.cache.index_k[0].shape[1:]
    copies = [ln for ln in hlo.splitlines()
              if (" copy(" in ln or "copy_" in ln.split("=")[0])
              and (key_shape in ln or f"[{d},{t}]" in ln or f"[{t},{d}]" in ln)]
    assert not copies, copies
