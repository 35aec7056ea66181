"""Sparse MLA decode, Pallas Mosaic TPU kernel.

Grid (b*s_q, h/block_h). The indices are scalar-prefetched into SMEM so the kernel can
address the cache, which stays in HBM (`pl.ANY`): each selected row is one DMA
(`make_async_copy`) into a VMEM buffer of block_k rows; two buffers alternate so the
DMAs of block kb+1 are in flight while block kb is computed. All block_h heads (default:
all heads) share each fetched row block.

A second, VMEM copy of the indices ([topk/block_k, block_k] per token) gives the validity
mask as a vector; reading it from SMEM would be one scalar load per row.

fp8 rows arrive as raw bytes. Mosaic has no reliable u8 -> fp8 bitcast or sub-word lane
shuffles on every TPU generation, so decoding uses only int32 vector ops and the MXU:
e4m3 codes are decoded by bit manipulation; the little-endian f32 scales and bf16 rope
values are reassembled from their bytes by multiplying the byte tile with a 0/1/256
selector matrix (bytes and weights are exact in bf16, sums stay below 2^16, so the
product is exact at any matmul precision).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_NT = (((1,), (1,)), ((), ()))


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _decode_e4m3(codes):
    """int32 e4m3fn codes (0..255) -> f32 values. NaN codes are never written by
    quantize_kv_rows and decode as +-480."""
    sign = codes >> 7
    exp = (codes >> 3) & 15
    man = codes & 7
    normal = lax.bitcast_convert_type((sign << 31) | ((exp + 120) << 23) | (man << 20),
                                      jnp.float32)
    subnormal = man.astype(jnp.float32) * (2.0 ** -9) * (1 - 2 * sign).astype(jnp.float32)
    return jnp.where(exp == 0, subnormal, normal)


def _byte_pairs(tail, first, count, stride):
    """u16 little-endian words at byte offsets first + stride*j (j < count) of each row of
    `tail` [rows, t] (f32 byte values) -> [rows, count] int32, via an exact selector matmul
    (contracting the byte axis of both operands, so no transpose is needed)."""
    t = tail.shape[1]
    src = lax.broadcasted_iota(jnp.int32, (count, t), 1)
    word = first + stride * lax.broadcasted_iota(jnp.int32, (count, t), 0)
    sel = jnp.where(src == word, 1.0, jnp.where(src == word + 1, 256.0, 0.0))
    return _dot(tail, sel, _NT).astype(jnp.int32)


def _decode_fp8_block(raw, *, d_nope, d_rope, chunk, cdtype):
    """uint8 rows [block_k, row_bytes] -> nope chunks [block_k, chunk], rope [block_k, d_rope]."""
    n_chunks = d_nope // chunk
    tail = raw[:, d_nope:].astype(jnp.int32).astype(jnp.float32)
    lo = _byte_pairs(tail, 0, n_chunks, 4)
    hi = _byte_pairs(tail, 2, n_chunks, 4)
    scales = lax.bitcast_convert_type((hi << 16) | lo, jnp.float32)  # [block_k, n_chunks]
    rope_bits = _byte_pairs(tail, 4 * n_chunks, d_rope, 2) << 16  # [block_k, d_rope]
    rope = lax.bitcast_convert_type(rope_bits, jnp.float32)
    vals = []
    for c in range(n_chunks):
        codes = raw[:, c * chunk:(c + 1) * chunk].astype(jnp.int32)
        vals.append((_decode_e4m3(codes) * scales[:, c:c + 1]).astype(cdtype))
    return vals, rope.astype(cdtype)


def _kernel(idx_smem, idx_vmem, q_ref, kv_hbm, out_ref, lse_ref, buf, sem, m_ref, l_ref,
            acc_ref, *, fp8, d_nope, d_rope, block_k, n_blocks, softmax_scale, cdtype):
    token = pl.program_id(0)
    chunk = 128 if d_nope % 128 == 0 else d_nope
    n_chunks = d_nope // chunk

    def row_copy(slot, t, row):
        return pltpu.make_async_copy(kv_hbm.at[pl.ds(row, 1)], buf.at[slot, pl.ds(t, 1)],
                                     sem.at[slot])

    def start_block(kb, slot):
        def one(t, c):
            row_copy(slot, t, jnp.maximum(idx_smem[token, kb * block_k + t], 0)).start()
            return c
        lax.fori_loop(0, block_k, one, 0)

    def wait_block(slot):
        def one(t, c):
            row_copy(slot, t, 0).wait()
            return c
        lax.fori_loop(0, block_k, one, 0)

    start_block(0, 0)
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def body(kb, carry):
        slot = kb % 2

        @pl.when(kb + 1 < n_blocks)
        def _():
            start_block(kb + 1, 1 - slot)

        wait_block(slot)
        raw = buf[slot]
        if fp8:
            vals, rope = _decode_fp8_block(raw, d_nope=d_nope, d_rope=d_rope, chunk=chunk,
                                           cdtype=cdtype)
        else:
            vals = [raw[:, c * chunk:(c + 1) * chunk].astype(cdtype) for c in range(n_chunks)]
            rope = raw[:, d_nope:].astype(cdtype)
        s = _dot(q_ref[:, d_nope:].astype(cdtype), rope, _NT)
        for c in range(n_chunks):
            s = s + _dot(q_ref[:, c * chunk:(c + 1) * chunk].astype(cdtype), vals[c], _NT)
        valid = idx_vmem[pl.ds(kb, 1), :] >= 0  # [1, block_k]
        s = jnp.where(valid, s * softmax_scale, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)
        l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_new
        pv = jnp.concatenate([_dot(p.astype(cdtype), v) for v in vals], axis=1)
        acc_ref[...] = acc_ref[...] * alpha + pv
        return carry

    lax.fori_loop(0, n_blocks, body, 0)
    l = l_ref[...]
    empty = l == 0.0
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    out_ref[...] = (acc_ref[...] * inv_l).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m_ref[...] + jnp.log(jnp.where(empty, 1.0, l)))


def sparse_mla_tpu(q, kv, idx, softmax_scale, *, fp8, d_nope, d_rope, block_h, block_k,
                   interpret):
    """q [B, h, d_qk], kv [n, width], idx [B, topk] (topk % block_k == 0, h % block_h == 0)
    -> out [B, h, d_nope] (q.dtype), lse [B, h] f32."""
    big, h, d_qk = q.shape
    topk = idx.shape[1]
    n_blocks = topk // block_k
    cdtype = q.dtype if fp8 else jnp.promote_types(q.dtype, kv.dtype)
    kernel = functools.partial(
        _kernel, fp8=fp8, d_nope=d_nope, d_rope=d_rope, block_k=block_k, n_blocks=n_blocks,
        softmax_scale=float(softmax_scale), cdtype=cdtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(big, h // block_h),
        in_specs=[
            pl.BlockSpec((None, n_blocks, block_k), lambda i, j, ids: (i, 0, 0)),
            pl.BlockSpec((None, block_h, d_qk), lambda i, j, ids: (i, j, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[
            pl.BlockSpec((None, block_h, d_nope), lambda i, j, ids: (i, j, 0)),
            pl.BlockSpec((None, block_h, 1), lambda i, j, ids: (i, j, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((2, block_k, kv.shape[1]), kv.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((block_h, 1), jnp.float32),
            pltpu.VMEM((block_h, 1), jnp.float32),
            pltpu.VMEM((block_h, d_nope), jnp.float32),
        ],
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((big, h, d_nope), q.dtype),
                   jax.ShapeDtypeStruct((big, h, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="sparse_mla_decode_tpu",
    )(idx, idx.reshape(big, n_blocks, block_k), q, kv)
    return out, lse[..., 0]
