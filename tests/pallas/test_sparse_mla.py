"""Sparse MLA decode kernels (interpret mode on CPU) against the reference, and the fp8 row
layout against an independent numpy / ml_dtypes implementation."""
import math

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jlco.pallas.fp8_rows import (
    dequantize_kv_rows,
    fp8_row_bytes,
    pow2_scale,
    quantize_kv_rows,
)
from jlco.pallas.sparse_mla import sparse_mla_decode, sparse_mla_decode_ref

# ---------------------------------------------------------------- fp8 rows


def _np_quantize(rows, d_rope):
    """Independent FlashMLA-layout quantiser: math.frexp for the scale, ml_dtypes casts."""
    rows = np.asarray(rows, np.float32)
    d_nope = rows.shape[-1] - d_rope
    out = []
    for row in rows.reshape(-1, rows.shape[-1]):
        groups = row[:d_nope].reshape(-1, 128)
        scales = []
        for g in groups:
            ratio = max(float(np.float32(np.abs(g).max()) / np.float32(448)), 1e-4)
            mant, exp = math.frexp(np.float32(ratio))  # ratio = mant * 2^exp, mant in [.5, 1)
            scales.append(2.0 ** (exp - 1 if mant == 0.5 else exp))
        scales = np.asarray(scales, np.float32)
        codes = (groups / scales[:, None]).astype(ml_dtypes.float8_e4m3fn)
        rope = row[d_nope:].astype(ml_dtypes.bfloat16)
        out.append(np.concatenate([codes.reshape(-1).view(np.uint8), scales.view(np.uint8),
                                   rope.view(np.uint8)]))
    return np.stack(out).reshape(*rows.shape[:-1], -1)


@pytest.mark.parametrize("d_qk,d_rope", [(576, 64), (144, 16)])
def test_quantize_matches_numpy_layout(d_qk, d_rope):
    x = jax.random.normal(jax.random.key(1), (6, d_qk)) * jnp.array([[1e-6], [1e-3], [1], [7],
                                                                     [300], [5e4]])
    got = np.asarray(quantize_kv_rows(x, d_rope))
    chex.assert_shape(got, (6, fp8_row_bytes(d_qk - d_rope, d_rope)))
    chex.assert_type(got, np.uint8)
    chex.assert_trees_all_equal(got, _np_quantize(x, d_rope))
    if d_qk == 576:
        assert got.shape[1] == 656  # FlashMLA row size for DeepSeek-V3.2


def test_pow2_scale_exact_at_boundaries():
    amax = np.array([0, 448, 448 * (1 + 2 ** -23), 449, 1, 3e-2, 1e-4 * 448, 2.0 ** 100],
                    np.float32)
    got = np.asarray(pow2_scale(jnp.asarray(amax)))
    want = [2.0 ** math.ceil(math.log2(max(float(a) / 448, 1e-4))) for a in amax]
    want[2] = 2.0  # just above 448 -> next power; float log2 rounds this case to 0
    chex.assert_trees_all_equal(got, np.asarray(want, np.float32))


def test_dequantize_exact_in_bf16_and_close_to_input():
    x = jax.random.normal(jax.random.key(2), (3, 5, 576)) * 4
    b = quantize_kv_rows(x)
    f32 = dequantize_kv_rows(b, dtype=jnp.float32)
    bf16 = dequantize_kv_rows(b, dtype=jnp.bfloat16)
    chex.assert_trees_all_equal(np.asarray(bf16.astype(jnp.float32)), np.asarray(f32))
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 of the group's scale range.
    rel = np.abs(np.asarray(f32[..., :512] - x[..., :512])) / np.abs(np.asarray(x[..., :512]))
    assert np.median(rel) < 2 ** -4
    chex.assert_trees_all_equal(np.asarray(f32[..., 512:]),
                                np.asarray(x[..., 512:].astype(jnp.bfloat16), np.float32))


def test_round_trip_bytes():
    """quantise(dequantise(b)) == b, except a group whose largest code is exactly 224: its
    dequantised amax is scale*224 = 448*scale/2, so re-quantising picks scale/2 and codes x2
    (same values). The docs/facts.md §2 exactness claim holds for the values in every group."""
    x = jax.random.normal(jax.random.key(3), (64, 576)) * 2
    b = quantize_kv_rows(x)
    deq = dequantize_kv_rows(b, dtype=jnp.float32)
    b2 = quantize_kv_rows(deq)
    chex.assert_trees_all_equal(np.asarray(dequantize_kv_rows(b2, dtype=jnp.float32)),
                                np.asarray(deq))
    codes = np.asarray(b[:, :512]).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    edge = np.abs(codes.reshape(64, 4, 128)).max(-1) == 224  # [rows, groups]
    diff_nope = (np.asarray(b) != np.asarray(b2))[:, :512].reshape(64, 4, 128).any(-1)
    chex.assert_trees_all_equal(diff_nope & ~edge, np.zeros_like(edge))
    chex.assert_trees_all_equal(np.asarray(b)[:, 528:], np.asarray(b2)[:, 528:])
    ok = ~edge.any(-1)
    assert ok.sum() > 32
    chex.assert_trees_all_equal(np.asarray(b)[ok], np.asarray(b2)[ok])


@pytest.mark.parametrize("call,match", [
    (lambda: quantize_kv_rows(jnp.zeros((2, 576), jnp.int32)), "rows must be a float"),
    (lambda: quantize_kv_rows(jnp.zeros((2, 560))), "multiple of 128"),
    (lambda: quantize_kv_rows(jnp.zeros((2, 576)), d_rope=0), "d_rope"),
    (lambda: dequantize_kv_rows(jnp.zeros((2, 656), jnp.int8)), "must be uint8"),
    (lambda: dequantize_kv_rows(jnp.zeros((2, 650), jnp.uint8)), "row width 650"),
])
def test_fp8_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()

# ---------------------------------------------------------------- kernels


def _case(seed, *, b=2, s_q=1, h=4, d_qk=144, d_rope=16, n=80, topk=40, fmt="f32",
          q_dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k[0], (b, s_q, h, d_qk), jnp.float32).astype(q_dtype)
    rows = jax.random.normal(k[1], (n, d_qk), jnp.float32)
    kv = {"fp8": lambda: quantize_kv_rows(rows, d_rope), "bf16": lambda: rows.astype(
        jnp.bfloat16), "f32": lambda: rows}[fmt]()
    # ~1/4 invalid (-1), duplicates by construction (topk ~ n/2 drawn with replacement).
    idx = jax.random.randint(k[2], (b, s_q, topk), -n // 3, n)
    idx = jnp.where(idx < 0, -1, idx).astype(jnp.int32)
    idx = idx.at[0, s_q - 1].set(-1)  # one query with no valid row at all
    idx = idx.at[-1, 0, :6].set(jnp.array([5, 5, 5, 7, 7, -1], jnp.int32))  # duplicates
    return q, kv, idx


# (fmt, q dtype, atol/rtol on out). f32 everywhere: only summation order differs. bf16: the
# kernel rounds p to bf16 before the PV dot (as FlashMLA does), 2^-9 relative on a convex
# combination of |v| <~ 4 values, plus bf16 output rounding -> 2e-2. fp8 rows are
# dequantised exactly, so the error budget is that of the q/compute dtype.
TOLS = {("f32", jnp.float32): 2e-5, ("fp8", jnp.float32): 2e-5, ("bf16", jnp.bfloat16): 2e-2,
        ("fp8", jnp.bfloat16): 2e-2, ("bf16", jnp.float32): 2e-5}
CASES = [  # backend, fmt, q dtype, s_q, h, d_qk, d_rope, topk
    ("triton", "f32", jnp.float32, 1, 4, 144, 16, 40),
    ("triton", "bf16", jnp.bfloat16, 3, 16, 144, 16, 40),
    ("triton", "fp8", jnp.float32, 3, 4, 144, 16, 64),
    ("triton", "fp8", jnp.bfloat16, 1, 16, 576, 64, 40),
    ("triton", "bf16", jnp.float32, 1, 4, 576, 64, 24),
    ("mosaic_tpu", "f32", jnp.float32, 3, 16, 144, 16, 40),
    ("mosaic_tpu", "bf16", jnp.bfloat16, 1, 4, 576, 64, 40),
    ("mosaic_tpu", "fp8", jnp.float32, 1, 16, 576, 64, 40),
    ("mosaic_tpu", "fp8", jnp.bfloat16, 3, 4, 144, 16, 24),
]


def _assert_matches(out, lse, ref_out, ref_lse, tol):
    """Kernel against the reference with the TOLS budget (why: see TOLS). lse gets 10x the
    absolute budget: it is a log-sum-exp of scores |q.k|*scale that reach ~10 here, and the
    per-score rounding error scales with that magnitude; out is a convex combination of
    |v| <~ 4 values, so tol is both its absolute and relative budget."""
    chex.assert_type(out, ref_out.dtype)
    chex.assert_type(lse, jnp.float32)
    chex.assert_trees_all_equal(np.isinf(lse), np.isinf(ref_lse))
    chex.assert_trees_all_close(np.asarray(lse), np.asarray(ref_lse), atol=10 * tol, rtol=tol)
    chex.assert_trees_all_close(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                                atol=tol, rtol=tol)


@pytest.mark.parametrize("backend,fmt,q_dtype,s_q,h,d_qk,d_rope,topk", CASES)
def test_kernel_matches_reference(backend, fmt, q_dtype, s_q, h, d_qk, d_rope, topk):
    q, kv, idx = _case(s_q * h + topk, s_q=s_q, h=h, d_qk=d_qk, d_rope=d_rope, topk=topk,
                       fmt=fmt, q_dtype=q_dtype)
    kw = dict(kv_format=fmt, d_rope=d_rope)
    out, lse = sparse_mla_decode(q, kv, idx, 0.3, backend=backend, interpret=True,
                                 block_k=16, **kw)
    ref_out, ref_lse = sparse_mla_decode_ref(q, kv, idx, 0.3, **kw)
    chex.assert_shape(out, (*q.shape[:3], d_qk - d_rope))  # [b, s, h, d_v]
    chex.assert_shape(lse, q.shape[:3])  # [b, s, h]
    _assert_matches(out, lse, ref_out, ref_lse, TOLS[(fmt, q_dtype)])
    # the query with no valid row: exactly zero output
    chex.assert_trees_all_equal(np.asarray(out[0, s_q - 1], np.float32),
                                np.zeros((h, d_qk - d_rope), np.float32))
    assert np.isinf(np.asarray(lse[0, s_q - 1])).all() and (np.asarray(lse[0, s_q - 1]) > 0).all()


def test_reference_against_numpy_loop():
    """The reference itself, against a per-query numpy softmax (duplicates count twice)."""
    q, kv, idx = _case(7, s_q=2, fmt="f32")
    ref_out, ref_lse = sparse_mla_decode_ref(q, kv, idx, 0.3, kv_format="f32", d_rope=16)
    qn, kvn, idn = (np.asarray(a, np.float64) for a in (q, kv, idx))
    for bi, si in np.ndindex(*idn.shape[:2]):
        rows = kvn[idn[bi, si][idn[bi, si] >= 0].astype(int)]
        if not len(rows):
            continue
        s = qn[bi, si] @ rows.T * 0.3
        lse = np.log(np.exp(s).sum(-1))
        # f32 reference vs float64 numpy: only f32 rounding of the scores and the exp-sum;
        # rtol 1e-5 is ~100 f32 ulps on an lse of magnitude ~10.
        chex.assert_trees_all_close(np.asarray(ref_lse[bi, si]), lse, rtol=1e-5, atol=0)
        out = np.exp(s - lse[:, None]) @ rows[:, :128]
        # f32 vs float64 on a convex combination of O(1) rows: f32 softmax weights carry
        # ~1e-6 relative error, amplified by cancellation; rtol 1e-4, and atol 1e-5 for
        # outputs that cancel to near zero.
        chex.assert_trees_all_close(np.asarray(ref_out[bi, si]), out, rtol=1e-4, atol=1e-5)
    assert idn[-1, 0, 0] == idn[-1, 0, 1] == 5


@pytest.mark.parametrize("backend,interpret,block_h,block_k,splits", [
    ("auto", False, None, None, None), ("auto", False, 16, 32, 2), ("mosaic_tpu", True, 8, 8,
                                                                    None),
    ("triton", True, 2, 40, None), ("triton", True, 16, 16, 3)])
def test_backends_and_block_sizes(backend, interpret, block_h, block_k, splits):
    """backend='auto' without interpret goes through lax.platform_dependent, which traces
    every branch and on CPU runs the interpret-mode kernel; explicit blocks (topk padded
    with -1 when block_k does not divide it) and top-k splits merged by lse agree too (the
    query with no valid id makes every split empty: out 0, lse +inf after the merge)."""
    q, kv, idx = _case(11, s_q=2, h=16, topk=36, fmt="bf16", q_dtype=jnp.bfloat16)
    kw = dict(kv_format="bf16", d_rope=16)
    out, lse = sparse_mla_decode(q, kv, idx, 0.5, block_h=block_h, block_k=block_k,
                                 backend=backend, interpret=interpret, num_splits=splits, **kw)
    _assert_matches(out, lse, *sparse_mla_decode_ref(q, kv, idx, 0.5, **kw), 2e-2)


def _bad(**over):
    q, kv, idx = _case(0)
    args = dict(q=q, kv_cache=kv, indices=idx, softmax_scale=0.1, kv_format="f32", d_rope=16)
    args.update(over)
    return args


@pytest.mark.parametrize("over,match", [
    (dict(kv_format="int4"), "kv_format must be one of"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(q=jnp.zeros((2, 4, 144))), "q must be a float array"),
    (dict(indices=jnp.zeros((2, 1, 8), jnp.uint32)), "indices must be int32"),
    (dict(indices=jnp.zeros((2, 3, 8), jnp.int32)), "indices must be"),
    (dict(kv_cache=jnp.zeros((10, 128))), "row width 128 must equal"),
    (dict(kv_cache=jnp.zeros((10, 144), jnp.uint8), kv_format="fp8"), "kv_cache: fp8 row"),
    (dict(kv_cache=jnp.zeros((10, 144)), kv_format="fp8"), "kv_cache must be uint8"),
    (dict(d_rope=144), "d_rope must be"),
    (dict(d_v=64), "d_v must be None or"),
    (dict(num_splits=0), "num_splits must be >= 1"),
    (dict(block_h=3), "block_h must divide"),
    (dict(block_h=2, backend="triton"), "power of two >= 16"),
    (dict(block_h=2), "power of two >= 16"),  # auto traces the Triton branch too
    (dict(softmax_scale=jnp.float32(0.1)), "softmax_scale must be a Python float"),
])
def test_bad_inputs(over, match):
    args = _bad(**over)
    with pytest.raises(ValueError, match=match):
        sparse_mla_decode(**args)
