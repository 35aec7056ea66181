"""Sparse MLA decode (DeepSeek Sparse Attention over the latent cache), FlashMLA contract.

Each query token attends, with all its heads, to the top-k latent rows the indexer chose
(global row ids, -1 = none). Scores use the full d_qk = d_nope + d_rope dot product
(absorbed q_nope . c_nope + q_rope . k_rope); the value is the d_nope latent (d_v = d_nope).

  q [b, s_q, h, d_qk], kv_cache [n, d_qk] float ("bf16"/"f32") or [n, row_bytes] uint8
  ("fp8", FlashMLA layout, see fp8_rows.py), indices [b, s_q, topk] int32
  -> out [b, s_q, h, d_nope] (q.dtype), lse [b, s_q, h] f32 (natural log; +inf and out 0
     for a query with no valid index). Duplicated ids count once per occurrence.

Note lse is [b, s_q, h] (FlashMLA returns [b, h, s_q]): it lines up with out.

Backends: "triton" (Pallas GPU, sparse_mla_triton.py), "mosaic_tpu" (sparse_mla_tpu.py),
"auto" (one jitted call that lowers to the Triton kernel for cuda, the Mosaic kernel for
tpu, and the interpret-mode kernel elsewhere, via lax.platform_dependent). topk is padded
with -1 up to a multiple of block_k; heads are padded up to a multiple of block_h only when
the default Triton block_h exceeds h (tl.dot needs >= 16 rows).
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from jlco.pallas.fp8_rows import dequantize_kv_rows, fp8_nope_dim
from jlco.pallas.sparse_mla_tpu import sparse_mla_tpu
from jlco.pallas.sparse_mla_triton import sparse_mla_triton

KV_FORMATS = ("bf16", "f32", "fp8")
BACKENDS = ("auto", "triton", "mosaic_tpu")
# Kernel run on CPU (interpret mode) by backend="auto". Both kernels interpret in about the
# same time on test shapes (~0.7-1.1 s per call including compile, 2-core CPU); the
# Triton-style one needs no DMA/semaphore emulation, so it is the simpler one to debug.
CPU_INTERPRET_BACKEND = "triton"
GPU_TARGET_PROGRAMS = 264  # Triton default: ~2 programs per SM on H100/H200 (132 SMs)
MAX_AUTO_SPLITS = 8


def _check_inputs(q, kv_cache, indices, softmax_scale, kv_format, d_v, d_rope):
    """Validate the contract; returns d_nope."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    if q.ndim != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a float array [b, s_q, h, d_qk], got {q.dtype}{q.shape}")
    if indices.ndim != 3 or indices.shape[:2] != q.shape[:2]:
        raise ValueError(f"indices must be [b, s_q, topk] = [{q.shape[0]}, {q.shape[1]}, topk],"
                         f" got {indices.shape}")
    if indices.dtype != jnp.int32:
        raise ValueError(f"indices must be int32, got {indices.dtype}")
    if indices.shape[2] < 1:
        raise ValueError("indices: topk must be >= 1")
    if kv_cache.ndim != 2:
        raise ValueError(f"kv_cache must be rows [n, width], got shape {kv_cache.shape}")
    d_qk = q.shape[3]
    if not isinstance(d_rope, int) or not 0 < d_rope < d_qk:
        raise ValueError(f"d_rope must be an int in (0, d_qk={d_qk}), got {d_rope!r}")
    d_nope = d_qk - d_rope
    if kv_format == "fp8":
        if kv_cache.dtype != jnp.uint8:
            raise ValueError(f"kv_cache must be uint8 for kv_format 'fp8', got {kv_cache.dtype}")
        try:
            got = fp8_nope_dim(kv_cache.shape[1], d_rope)
        except ValueError as e:
            raise ValueError(f"kv_cache: {e}") from None
        if got != d_nope:
            raise ValueError(f"kv_cache: fp8 row width {kv_cache.shape[1]} holds d_nope={got},"
                             f" but q has d_qk - d_rope = {d_nope}")
    else:
        if not jnp.issubdtype(kv_cache.dtype, jnp.floating):
            raise ValueError(f"kv_cache must be a float array for kv_format {kv_format!r}, "
                             f"got {kv_cache.dtype}")
        if kv_cache.shape[1] != d_qk:
            raise ValueError(f"kv_cache row width {kv_cache.shape[1]} must equal q's d_qk "
                             f"{d_qk} for kv_format {kv_format!r}")
    if d_v is not None and d_v != d_nope:
        raise ValueError(f"d_v must be None or d_qk - d_rope = {d_nope}, got {d_v}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise ValueError(f"softmax_scale must be a Python float, got {softmax_scale!r}")
    return d_nope


def sparse_mla_decode_ref(q, kv_cache, indices, softmax_scale, *, kv_format, d_v=None,
                          d_rope=64, block_h=None, block_k=None, backend="auto",
                          interpret=False, num_splits=None, num_warps=None, num_stages=None):
    """Plain-jnp reference (gather + f32 softmax); same contract. Block/backend arguments
    are accepted so callers can swap the two functions, and ignored."""
    del block_h, block_k, backend, interpret, num_splits, num_warps, num_stages
    d_nope = _check_inputs(q, kv_cache, indices, softmax_scale, kv_format, d_v, d_rope)
    return _ref(q, kv_cache, indices, float(softmax_scale), kv_format=kv_format,
                d_nope=d_nope, d_rope=d_rope)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "kv_format", "d_nope", "d_rope"))
def _ref(q, kv_cache, indices, softmax_scale, *, kv_format, d_nope, d_rope):
    with jax.named_scope("sparse_mla_decode_ref"):
        valid = indices >= 0
        rows = kv_cache[jnp.where(valid, indices, 0)]  # [b, s, k, width]
        if kv_format == "fp8":
            rows = dequantize_kv_rows(rows, d_rope=d_rope, dtype=jnp.float32)
        rows = rows.astype(jnp.float32)
        hp = lax.Precision.HIGHEST
        # Operand orders chosen for XLA:CPU, where this reference is the serving path:
        # gathered rows as the big left operand (k rows × d) and the full row width in the
        # value product, slicing the output rather than the rows. The textbook orders
        # ("bshd,bskd->bshk", rows[..., :d_nope]) ran 4-6x slower in a 512-token prefill
        # chunk (batched products with only h rows each, and a copy of the sliced rows).
        s = jnp.einsum("bskd,bshd->bshk", rows, q.astype(jnp.float32), precision=hp)
        s = jnp.where(valid[:, :, None, :], s * softmax_scale, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(m == -jnp.inf, 0.0, m)
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=-1)
        empty = l == 0.0
        safe_l = jnp.where(empty, 1.0, l)
        out = jnp.einsum("bshk,bskd->bshd", p, rows, precision=hp)[..., :d_nope]
        out = jnp.where(empty[..., None], 0.0, out / safe_l[..., None])
        lse = jnp.where(empty, jnp.inf, m[..., 0] + jnp.log(safe_l))
        return out.astype(q.dtype), lse


def _pow2_floor(x):
    return 1 << (max(int(x), 1).bit_length() - 1)


def _blocks(backend, h, topk, block_h, block_k):
    """Block sizes for one kernel; returns (block_h, block_k, padded heads)."""
    if backend == "triton":
        if block_h is None:  # largest of 64/32/16 dividing h, else 16 with padded heads
            block_h = 64
            while block_h > 16 and h % block_h:
                block_h //= 2
        block_k = block_k or max(16, min(32, _pow2_floor(topk)))
    else:
        block_h = block_h or (h if h <= 128 or h % 128 else 128)
        block_k = block_k or min(128, -(-topk // 8) * 8)
    return block_h, block_k, -(-h // block_h) * block_h


def _check_blocks(backend, h, block_h, block_k, explicit_h, interpret):
    if explicit_h is not None and (explicit_h < 1 or h % explicit_h):
        raise ValueError(f"block_h must divide the head count {h}, got {explicit_h}")
    if block_k < 1:
        raise ValueError(f"block_k must be >= 1, got {block_k}")
    if backend == "triton" and not interpret:
        for name, v in (("block_h", block_h), ("block_k", block_k)):
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16 for the Triton kernel "
                                 f"(tl.dot tile), got {v}")


def _splits(backend, interpret, programs, n_blocks, num_splits):
    """Top-k splits for the Triton kernel: enough programs for ~2 waves on a 132-SM GPU
    (a decode batch of a few tokens x 2 head blocks would leave most SMs idle)."""
    if backend != "triton":
        return 1
    if num_splits is not None:
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        return num_splits
    if interpret:
        return 1
    want = -(-GPU_TARGET_PROGRAMS // programs)
    return max(1, min(MAX_AUTO_SPLITS, n_blocks, 1 << (want - 1).bit_length()))


def _run_kernel(backend, interpret, q, kv, idx, softmax_scale, *, fp8, d_nope, d_rope,
                block_h, block_k, num_splits, num_warps, num_stages):
    """One kernel on flattened tokens: q [B, h, d_qk], idx [B, topk]."""
    h, topk = q.shape[1], idx.shape[1]
    explicit_h = block_h
    block_h, block_k, h_pad = _blocks(backend, h, topk, block_h, block_k)
    _check_blocks(backend, h, block_h, block_k, explicit_h, interpret)
    splits = _splits(backend, interpret, q.shape[0] * (h_pad // block_h),
                     -(-topk // block_k), num_splits)
    k_pad = -(-topk // (block_k * splits)) * block_k * splits
    if k_pad != topk:
        idx = jnp.pad(idx, ((0, 0), (0, k_pad - topk)), constant_values=-1)
    if h_pad != h:
        q = jnp.pad(q, ((0, 0), (0, h_pad - h), (0, 0)))
    common = dict(fp8=fp8, d_nope=d_nope, d_rope=d_rope, block_h=block_h, block_k=block_k,
                  interpret=interpret)
    if backend == "triton":
        out, lse = sparse_mla_triton(q, kv, idx, softmax_scale, num_splits=splits,
                                     num_warps=num_warps or 8,
                                     num_stages=num_stages or 2, **common)
    else:
        out, lse = sparse_mla_tpu(q, kv, idx, softmax_scale, **common)
    return out[:, :h], lse[:, :h]


@functools.partial(jax.jit, static_argnames=(
    "softmax_scale", "kv_format", "d_rope", "block_h", "block_k", "backend", "interpret",
    "num_splits", "num_warps", "num_stages"))
def _decode(q, kv_cache, indices, softmax_scale, *, kv_format, d_rope, block_h, block_k,
            backend, interpret, num_splits, num_warps, num_stages):
    b, s_q, h, d_qk = q.shape
    qf = q.reshape(b * s_q, h, d_qk)
    idx = indices.reshape(b * s_q, indices.shape[2])
    run = functools.partial(_run_kernel, softmax_scale=softmax_scale, fp8=kv_format == "fp8",
                            d_nope=d_qk - d_rope, d_rope=d_rope, block_h=block_h,
                            block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                            num_stages=num_stages)
    with jax.named_scope("sparse_mla_decode"):
        if backend != "auto":
            out, lse = run(backend, interpret, qf, kv_cache, idx)
        elif interpret:
            out, lse = run(CPU_INTERPRET_BACKEND, True, qf, kv_cache, idx)
        else:
            out, lse = lax.platform_dependent(
                qf, kv_cache, idx,
                cuda=functools.partial(run, "triton", False),
                tpu=functools.partial(run, "mosaic_tpu", False),
                default=functools.partial(run, CPU_INTERPRET_BACKEND, True))
    return out.reshape(b, s_q, h, -1), lse.reshape(b, s_q, h)


def sparse_mla_decode(q, kv_cache, indices, softmax_scale, *, kv_format, d_v=None, d_rope=64,
                      block_h=None, block_k=None, backend="auto", interpret=False,
                      num_splits=None, num_warps=None, num_stages=None):
    """Sparse MLA decode with a Pallas kernel; contract in the module docstring.

    block_h: heads per program (must divide h); default 64-ish on GPU (each gathered row
    block is reused by block_h heads), all heads (<= 128) on TPU. block_k: rows per
    inner step (topk is padded with -1 to a multiple). Triton only: num_splits (top-k
    splits merged by lse; default fills ~2 waves of a 132-SM GPU, 1 in interpret mode),
    num_warps (8), num_stages (2).
    softmax_scale must be a Python float (it is baked into the kernel).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check_inputs(q, kv_cache, indices, softmax_scale, kv_format, d_v, d_rope)
    return _decode(q, kv_cache, indices, float(softmax_scale), kv_format=kv_format,
                   d_rope=d_rope, block_h=block_h, block_k=block_k, backend=backend,
                   interpret=bool(interpret), num_splits=num_splits, num_warps=num_warps,
                   num_stages=num_stages)
