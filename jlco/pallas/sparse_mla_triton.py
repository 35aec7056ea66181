"""Sparse MLA decode, Pallas Triton-style kernel (GPU; also the CPU interpret kernel).

Grid (b*s_q, h/block_h): one program owns block_h heads of one query token and streams
its top-k rows in blocks of block_k, gathering them straight from the whole cache with
`kv_ref[ids, pl.ds(...)]` (Triton has no scalar prefetch; the ids are a normal input).
Every gathered row block is reused by all block_h heads, which is what makes sparse MLA
compute-bound rather than gather-bound (one 1152-byte row feeds block_h x 2 x 1088 FLOPs).

Triton needs power-of-two value shapes, so the 576-wide row is never loaded whole: the
nope part is loaded as d_nope/128 chunks of 128 and the rope part (64) separately, each a
power-of-two load from the same cache ref (no copy of the cache is made in the wrapper).
fp8 rows are decoded in registers: e4m3 bytes bitcast to float8 then widened; the f32
scale of each 128-chunk is rebuilt from its 4 bytes and applied to the [heads, rows]
score / probability tile instead of the [rows, 128] values (fewer multiplies); rope bf16 is
rebuilt from two stride-2 byte loads.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_NT = (((1,), (1,)), ((), ()))  # contract the last dim of both operands: a @ b.T


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    """f32-accumulated dot; f32 inputs ask for full precision (Triton would use tf32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _load_u32(kv_ref, rows, offset):
    """Little-endian u32 at byte `offset` of each gathered row -> [block_k] uint32."""
    word = kv_ref[rows, offset].astype(jnp.uint32)
    for i in range(1, 4):
        word = word | (kv_ref[rows, offset + i].astype(jnp.uint32) << (8 * i))
    return word


def _load_chunks(kv_ref, rows, *, fp8, d_nope, d_rope, chunk, cdtype):
    """Gather one row block: nope chunks [block_k, chunk], their scales, rope [block_k, d_rope]."""
    n_chunks = d_nope // chunk
    vals, scales = [], []
    for c in range(n_chunks):
        v = kv_ref[rows, pl.ds(c * chunk, chunk)]
        if fp8:
            v = lax.bitcast_convert_type(v, jnp.float8_e4m3fn)
            scales.append(lax.bitcast_convert_type(_load_u32(kv_ref, rows, d_nope + 4 * c),
                                                   jnp.float32))
        vals.append(v.astype(cdtype))
    if fp8:
        base = d_nope + 4 * n_chunks
        lo = kv_ref[rows, pl.ds(base, d_rope, stride=2)].astype(jnp.uint16)
        hi = kv_ref[rows, pl.ds(base + 1, d_rope, stride=2)].astype(jnp.uint16)
        rope = lax.bitcast_convert_type(lo | (hi << 8), jnp.bfloat16)
    else:
        rope = kv_ref[rows, pl.ds(d_nope, d_rope)]
    return vals, scales or None, rope.astype(cdtype)


def _kernel(idx_ref, q_ref, kv_ref, out_ref, lse_ref, *, fp8, d_nope, d_rope, chunk,
            block_k, n_blocks, softmax_scale, cdtype):
    """One (token, head block, top-k split): normalised partial output and its lse
    (-inf when the split has no valid row; the wrapper merges splits)."""
    block_h = q_ref.shape[0]
    first_block = pl.program_id(2) * n_blocks
    n_chunks = d_nope // chunk
    q_nope = [q_ref[:, pl.ds(c * chunk, chunk)].astype(cdtype) for c in range(n_chunks)]
    q_rope = q_ref[:, pl.ds(d_nope, d_rope)].astype(cdtype)

    def body(kb, carry):
        m, l, accs = carry
        ids = idx_ref[pl.ds((first_block + kb) * block_k, block_k)]
        valid = ids >= 0
        rows = jnp.where(valid, ids, 0)
        vals, scales, rope = _load_chunks(kv_ref, rows, fp8=fp8, d_nope=d_nope,
                                          d_rope=d_rope, chunk=chunk, cdtype=cdtype)
        s = _dot(q_rope, rope, _NT)
        for c in range(n_chunks):
            sc = _dot(q_nope[c], vals[c], _NT)
            s = s + (sc * scales[c][None, :] if fp8 else sc)
        s = jnp.where(valid[None, :], s * softmax_scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all-invalid so far: no NaN
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        new_accs = []
        for c in range(n_chunks):
            pc = (p * scales[c][None, :]) if fp8 else p
            new_accs.append(accs[c] * alpha[:, None] + _dot(pc.astype(cdtype), vals[c]))
        return m_new, l, new_accs

    m0 = jnp.full((block_h,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((block_h,), jnp.float32)
    acc0 = [jnp.zeros((block_h, chunk), jnp.float32) for _ in range(n_chunks)]
    m, l, accs = lax.fori_loop(0, n_blocks, body, (m0, l0, acc0))
    empty = l == 0.0
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    for c in range(n_chunks):
        out_ref[:, pl.ds(c * chunk, chunk)] = (accs[c] * inv_l[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def _merge_splits(out, lse):
    """out [S, B, h, d] f32, lse [S, B, h] (-inf = empty split) -> merged out, lse (+inf
    when every split is empty). Why: small batches need top-k splits to fill the GPU."""
    m = jnp.max(lse, axis=0)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lse - m_safe)  # [S, B, h]
    total = jnp.sum(w, axis=0)
    empty = total == 0.0
    merged = jnp.einsum("sbh,sbhd->bhd", w, out) / jnp.where(empty, 1.0, total)[..., None]
    return merged, jnp.where(empty, jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))


def sparse_mla_triton(q, kv, idx, softmax_scale, *, fp8, d_nope, d_rope, block_h, block_k,
                      num_splits, num_warps, num_stages, interpret):
    """q [B, h, d_qk], kv [n, width], idx [B, topk] (topk % (block_k*num_splits) == 0,
    h % block_h == 0) -> out [B, h, d_nope] (q.dtype), lse [B, h] f32."""
    big, h, d_qk = q.shape
    topk = idx.shape[1]
    chunk = 128 if d_nope % 128 == 0 else d_nope
    cdtype = q.dtype if fp8 else jnp.promote_types(q.dtype, kv.dtype)
    kernel = functools.partial(
        _kernel, fp8=fp8, d_nope=d_nope, d_rope=d_rope, chunk=chunk, block_k=block_k,
        n_blocks=topk // block_k // num_splits, softmax_scale=float(softmax_scale),
        cdtype=cdtype)
    part_dtype = q.dtype if num_splits == 1 else jnp.float32
    out, lse = pl.pallas_call(
        kernel,
        grid=(big, h // block_h, num_splits),
        in_specs=[
            pl.BlockSpec((None, topk), lambda i, j, k: (i, 0)),
            pl.BlockSpec((None, block_h, d_qk), lambda i, j, k: (i, j, 0)),
            pl.BlockSpec(kv.shape, lambda i, j, k: (0, 0)),  # whole cache: rows are gathered
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_h, d_nope), lambda i, j, k: (k, i, j, 0)),
            pl.BlockSpec((None, None, block_h), lambda i, j, k: (k, i, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((num_splits, big, h, d_nope), part_dtype),
                   jax.ShapeDtypeStruct((num_splits, big, h), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_mla_decode_triton",
    )(idx, q, kv)
    if num_splits == 1:
        return out[0], jnp.where(lse[0] == -jnp.inf, jnp.inf, lse[0])
    out, lse = _merge_splits(out, lse)
    return out.astype(q.dtype), lse
