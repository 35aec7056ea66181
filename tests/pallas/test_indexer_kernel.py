"""Lightning-indexer kernel == plain-jnp reference, in Pallas interpret mode on CPU.

Both kernel variants run here: the Triton-style one (lengths as a normal input) and the
Mosaic-style one (lengths in SMEM, clamped key index map, integer fp8 decode). Random
float inputs make exact score ties improbable, so top-k is compared as sets of positions
and the sorted scores must agree.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlco.pallas import indexer as ix
from jlco.pallas import indexer_ref as ixr

STYLES = ("triton", "mosaic")


def _inputs(seed, *, b, s_q, h, d, length, key_format, q_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, s_q, h, d)), q_dtype)
    w = jnp.asarray(rng.standard_normal((b, s_q, h)) * (h * d) ** -0.5, jnp.float32)
    keys = rng.standard_normal((b, length, d)).astype(np.float32)
    if key_format == "fp8":
        k = jnp.asarray(keys).astype(jnp.float8_e4m3fn)
        k = jax.lax.bitcast_convert_type(k, jnp.uint8)
        scale = jnp.asarray(2.0 ** rng.integers(-3, 3, (b, length)), jnp.float32)
        return q, w, k, scale
    kdt = jnp.bfloat16 if key_format == "bf16" else jnp.float32
    return q, w, jnp.asarray(keys, kdt), None


def _check(out, ref, lengths, s_q, topk):
    (idx, sc), (ridx, rsc) = [jax.tree.map(np.asarray, x) for x in (out, ref)]
    chex.assert_shape([idx, sc, ridx], (len(lengths), s_q, topk))   # [b, s_q, topk]
    chex.assert_type([idx, sc], [np.int32, np.float32])
    for b in range(idx.shape[0]):
        for t in range(s_q):
            p = int(lengths[b]) - s_q + t
            n_valid = max(0, min(topk, p + 1))
            got, want = idx[b, t], ridx[b, t]
            assert (got[n_valid:] == -1).all() and np.isneginf(sc[b, t, n_valid:]).all()
            assert ((got[:n_valid] >= 0) & (got[:n_valid] <= p)).all(), "causality broken"
            assert set(got[:n_valid].tolist()) == set(want[:n_valid].tolist())
            # interpret-mode kernel vs jnp reference: same math (bf16/fp8 keys decode
            # exactly, f32 accumulation), different summation order over head/key tiles.
            chex.assert_trees_all_close(sc[b, t, :n_valid], rsc[b, t, :n_valid],
                                        rtol=2e-5, atol=2e-5)


CASES = [  # (b, s_q, h, d, length, lengths, topk, key_format, block_n)
    (3, 1, 16, 64, 384, [384, 200, 0], 64, "f32", 128),
    (3, 3, 4, 32, 256, [256, 17, 2], 40, "f32", 128),
    (2, 2, 24, 64, 200, [200, 131], 32, "bf16", 128),
    (2, 3, 8, 128, 512, [511, 300], 96, "fp8", 256),
    (2, 1, 64, 128, 256, [256, 5], 300, "bf16", 128),
]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}sq{c[1]}h{c[2]}{c[7]}")
def test_kernel_matches_ref(style, case):
    b, s_q, h, d, length, lengths, topk, fmt, block_n = case
    q, w, k, scale = _inputs(sum(map(ord, fmt)) + h, b=b, s_q=s_q, h=h, d=d, length=length,
                             key_format=fmt)
    lengths = jnp.asarray(lengths, jnp.int32)
    key_format = "fp8" if fmt == "fp8" else "bf16"
    ref = ixr.indexer_topk_ref(q, w, k, lengths, topk, k_scale=scale, key_format=key_format)
    out = ix.indexer_topk(q, w, k, lengths, topk, k_scale=scale, key_format=key_format,
                          block_n=block_n, backend=style, interpret=True)
    _check(out, ref, lengths, s_q, topk)


def test_auto_backend_on_cpu_runs_interpret_kernel():
    q, w, k, _ = _inputs(7, b=2, s_q=2, h=8, d=32, length=128, key_format="f32")
    lengths = jnp.asarray([128, 60], jnp.int32)
    ref = ixr.indexer_topk_ref(q, w, k, lengths, 16)
    out = ix.indexer_topk(q, w, k, lengths, 16)
    _check(out, ref, lengths, 2, 16)


def test_scores_mask_future_and_empty_slots():
    q, w, k, _ = _inputs(3, b=2, s_q=3, h=4, d=16, length=128, key_format="f32")
    lengths = jnp.asarray([10, 0], jnp.int32)
    scores = np.asarray(ix.indexer_scores(q, w, k, lengths, backend="mosaic", interpret=True))
    for t in range(3):
        p = 10 - 3 + t
        assert np.isfinite(scores[0, t, :p + 1]).all()
        assert np.isneginf(scores[0, t, p + 1:]).all()
    assert np.isneginf(scores[1]).all()
    idx, sc = ix.indexer_topk(q, w, k, lengths, 8, backend="triton", interpret=True)
    assert (np.asarray(idx[1]) == -1).all() and np.isneginf(np.asarray(sc[1])).all()


def test_fp8_every_code_decodes_like_xla():
    """The Mosaic path decodes e4m3 bytes with integer ops; all 254 finite codes must give
    XLA's float8 conversion (NaN codes 0x7f/0xff excluded)."""
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.int32)
    want = jax.lax.bitcast_convert_type(jnp.asarray(codes, jnp.uint8), jnp.float8_e4m3fn)
    got = ix._decode_e4m3(jnp.asarray(codes))
    chex.assert_trees_all_equal(np.asarray(got), np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("bad, match", [
    (dict(weights=jnp.zeros((1, 1, 3))), "weights"),
    (dict(k_cache=jnp.zeros((1, 8, 16), jnp.uint8)), "k_cache"),
    (dict(lengths=jnp.zeros((2,), jnp.int32)), "lengths"),
    (dict(key_format="fp4"), "key_format"),
    (dict(topk=0), "topk"),
    (dict(backend="cuda"), "backend"),
    (dict(key_format="fp8", k_cache=jnp.zeros((1, 8, 16), jnp.uint8)), "k_scale"),
])
def test_bad_inputs_name_the_argument(bad, match):
    args = dict(q=jnp.zeros((1, 1, 4, 16)), weights=jnp.zeros((1, 1, 4)),
                k_cache=jnp.zeros((1, 8, 16)), lengths=jnp.ones((1,), jnp.int32), topk=4)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ix.indexer_topk(**args, interpret=True)


@pytest.mark.parametrize("style, blocks", [
    ("triton", dict(block_n=32, block_h=16, steps=4)),
    ("triton", dict(block_n=64, block_h=16, steps=1)),
    ("mosaic", dict(block_n=128, block_h=8)),
])
def test_block_shapes_do_not_change_scores(style, blocks):
    """Multi-tile programs (Triton `steps`), a padded key axis and split head blocks must
    all give the reference scores."""
    q, w, k, _ = _inputs(11, b=2, s_q=2, h=32, d=32, length=384, key_format="f32")
    lengths = jnp.asarray([384, 90], jnp.int32)
    got = ix._score_call(q, w, k, lengths, None, style=style, blocks=blocks, interpret=True)
    want = ixr.indexer_scores_ref(q, w, k, lengths)
    chex.assert_shape(got, want.shape)   # [b, s_q, L]
    # interpret-mode kernel vs jnp reference, f32 throughout: only the summation order over
    # tiles (multi-step programs, split head blocks) differs.
    chex.assert_trees_all_close(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("key_format", ["bf16", "fp8"])
def test_reference_key_blocks_give_the_same_scores(monkeypatch, key_format):
    # The reference forms the per-head logits a key block at a time when they would be
    # large. Blocking keys changes no reduction over d, but XLA:CPU may pick a different
    # dot kernel for a [.., 1024] block than for the whole [.., 3000] (seen on one CPU:
    # 1.9e-6 apart at magnitude 3), so the scores agree to f32 rounding, not to the bit.
    # The engine never compares a blocked score with an unblocked one: both sides of each
    # of its equalities (offload on / off, served / alone) run the same shapes.
    q, w, k, scale = _inputs(3, b=2, s_q=4, h=8, d=32, length=3000, key_format=key_format)
    lengths = jnp.asarray([3000, 1700], jnp.int32)
    whole = ixr.indexer_scores_ref(q, w, k, lengths, k_scale=scale, key_format=key_format)
    monkeypatch.setattr(ixr, "REF_BLOCK_ELEMS", 4 * 8 * 1024)   # blocks of 1024 keys
    blocked = ixr.indexer_scores_ref(q, w, k, lengths, k_scale=scale, key_format=key_format)
    np.testing.assert_array_equal(np.isinf(blocked), np.isinf(whole))   # the same masked keys
    chex.assert_trees_all_close(blocked, whole, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("key_format", ["bf16", "fp8"])
@pytest.mark.parametrize("topk", [16, 300])
@pytest.mark.parametrize("longest", [2600, 1000])
@pytest.mark.parametrize("s_q", [3, 24])
def test_streamed_topk_equals_the_whole_row(monkeypatch, key_format, topk, longest, s_q):
    # Long prefill chunks stream the keys with a running top-k (bounded memory); the
    # positions and scores must be those of `select_topk` over the whole score row, ties
    # included (duplicated keys give equal scores: the lower position must win), for a
    # ragged batch, a tail block shorter than the others, blocks past every length
    # (skipped) and a top-k past some lengths; s_q 24 scores in query tiles of 8.
    q, w, k, scale = _inputs(5, b=2, s_q=s_q, h=8, d=32, length=2600, key_format=key_format)
    k = k.at[:, 1700:1900].set(k[:, 100:300])
    if scale is not None:
        scale = scale.at[:, 1700:1900].set(scale[:, 100:300])
    lengths = jnp.asarray([longest, 250], jnp.int32)
    monkeypatch.setattr(ixr, "REF_BLOCK_ELEMS", s_q * 8 * 512)           # blocks of 512 keys
    monkeypatch.setattr(ixr, "REF_CHUNK_BLOCK", 512)
    monkeypatch.setattr(ixr, "REF_CHUNK_TILE", 8)
    assert ixr.ref_key_block(s_q, 8, 2600, topk) == 512
    got = ixr.indexer_topk_ref.__wrapped__(q, w, k, lengths, topk, k_scale=scale,
                                          key_format=key_format)
    scores = ixr.indexer_scores_ref(q, w, k, lengths, k_scale=scale, key_format=key_format)
    want = ix.select_topk(scores, topk)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert (np.asarray(got[0])[1] == -1).any() == (topk > 250 - s_q + 1)


@pytest.mark.parametrize("key_format", ["f32", "fp8"])
def test_chunk_scores_in_tiles_equal_one_einsum(key_format):
    # Prefill chunks score one head at a time in query tiles (4x faster on XLA:CPU);
    # only the summation order over heads differs from the all-heads einsum.
    q, w, k, scale = _inputs(8, b=1, s_q=32, h=16, d=32, length=700, key_format=key_format)
    ops = ixr._ref_operands(q, w, k, "fp8" if key_format == "fp8" else "bf16")
    lengths = jnp.asarray([700], jnp.int32)
    tiled = ixr._ref_block_scores(ops, scale, lengths, 0, 700, 32)
    kf = ixr._float_keys(ops[2]).astype(jnp.float32)     # ops keep the stored bytes
    logits = jnp.einsum("bthd,bsd->bths", q, kf, precision="highest")
    if scale is not None:
        logits = logits * scale[:, None, None, :]
    plain = jnp.einsum("bths,bth->bts", jnp.maximum(logits, 0), w, precision="highest")
    p = 700 - 32 + jnp.arange(32)[None, :, None]
    plain = jnp.where(jnp.arange(700)[None, None, :] <= p, plain, -jnp.inf)
    np.testing.assert_array_equal(np.isinf(tiled), np.isinf(plain))
    chex.assert_trees_all_close(tiled, plain, rtol=1e-5, atol=1e-5)


def test_the_reference_runs_no_native_kernel_and_the_cpu_path_does():
    """The kernels are checked against `indexer_topk_ref`: it must not itself run the
    native XLA:CPU kernels (`jlco.native`) those checks also cover; the CPU serving path
    (`native_cpu=True`, chosen by `jlco.pallas.dispatch`) does, with the same result."""
    from jlco import native
    q, w, k, _ = _inputs(3, b=2, s_q=1, h=8, d=32, length=600, key_format="f32")
    lengths = jnp.asarray([600, 250], jnp.int32)

    def hlo(native_cpu):
        return ixr.indexer_topk_ref.lower(q, w, k, lengths, 64,
                                          native_cpu=native_cpu).as_text()
    assert native.TOP_K not in hlo(False) and native.INDEXER_SCORES not in hlo(False)
    if native.available():
        assert native.TOP_K in hlo(True)
    plain = ixr.indexer_topk_ref(q, w, k, lengths, 64)
    served = ixr.indexer_topk_ref(q, w, k, lengths, 64, native_cpu=True)
    np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(served[0]))
    np.testing.assert_allclose(np.asarray(plain[1]), np.asarray(served[1]), rtol=1e-6)
