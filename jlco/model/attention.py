"""The model's only entry points for its two hot loops: sparse MLA and indexer top-k.

Both follow the Pallas kernels' contracts (docs/facts.md §2) so `impl` can switch between the
plain-jnp versions here and `jlco.pallas.dispatch` without the model noticing.
Glossary: b batch, s query tokens per request, h heads, k selected rows (top-k),
t cached positions, c latent nope width (kv_lora_rank), r rope width, d head dim.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

_IMPLS = ("auto", "xla", "pallas", "interpret")
_KV_FORMATS = ("f32", "bf16", "fp8")
_KEY_FORMATS = ("bf16", "fp8")


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: allowed one of {allowed}")


def _dispatch():
    """`jlco.pallas.dispatch` when it is present (helper K2's module), else None."""
    try:
        return importlib.import_module("jlco.pallas.dispatch")
    except ModuleNotFoundError:
        return None


def decode_rows(rows: jax.Array, kv_format: str, d_rope: int) -> jax.Array:
    """Kernel-form latent rows (float values, or fp8 row bytes) → f32 [..., c + r]."""
    _check("kv_format", kv_format, _KV_FORMATS)
    if kv_format == "fp8":
        from jlco.pallas import fp8_rows
        return fp8_rows.dequantize_kv_rows(rows, d_rope=d_rope).astype(jnp.float32)
    return rows.astype(jnp.float32)


def kernel_rows(rows: jax.Array, kv_format: str) -> jax.Array:
    """Rows in the kernels' form: raw uint8 row bytes of f32/bf16 rows (as a byte cache or
    an offload hot buffer holds them) are bit-cast to [n, c + r] floats; fp8 rows and rows
    that are already float pass through."""
    if kv_format == "fp8" or rows.dtype != jnp.uint8:
        return rows
    dt, width = (jnp.float32, 4) if kv_format == "f32" else (jnp.bfloat16, 2)
    n, row = rows.shape
    return jax.lax.bitcast_convert_type(rows.reshape(n, row // width, width), dt)


def sparse_mla_xla(q, kv_cache, indices, softmax_scale, *, kv_format, d_rope):
    """Gather the selected latent rows and attend over them (absorbed MLA).

    A query whose indices are all −1 yields out 0 and lse +inf (FlashMLA's convention).
    """
    with jax.named_scope("sparse_mla_xla"):
        valid = indices >= 0
        rows = kv_cache[jnp.where(valid, indices, 0)]                      # [b,s,k,row]
        kv = decode_rows(rows, kv_format, d_rope)                          # [b,s,k,c+r]
        d_nope = kv.shape[-1] - d_rope
        logits = jnp.einsum("bshd,bskd->bshk", q.astype(jnp.float32), kv) * softmax_scale
        logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(logits - m_safe)
        denom = jnp.sum(p, axis=-1)
        out = jnp.einsum("bshk,bskc->bshc", p, kv[..., :d_nope])
        empty = denom == 0
        out = jnp.where(empty[..., None], 0.0, out / jnp.where(empty, 1.0, denom)[..., None])
        lse = jnp.where(empty, jnp.inf, jnp.log(jnp.where(empty, 1.0, denom)) + m_safe[..., 0])
        return out.astype(q.dtype), lse


def sparse_mla_dense(q, rows, positions, softmax_scale, *, kv_format, d_rope):
    """Sparse MLA for a prefill chunk, computed densely: every query scores all t cached
    rows of its request in one matmul and keeps only its own top-k (a mask), instead of
    gathering s·k rows. Same function as `sparse_mla` (softmax over the selected rows),
    another summation order. q [b,s,h,c+r]; rows [b,t,row] (bytes or float, one
    request's whole layer); positions [b,s,k] (−1 = none) → out [b,s,h,c].

    Why: a chunk's s queries select overlapping rows, and XLA:CPU's gathered batched
    products move s·k·row bytes (300 MB per 512-token chunk and layer at k 256, f32
    rows) at a fraction of its matmul speed. For t ≤ DENSE_MAX_T one dense product is
    faster; for decode (s = 1) and long contexts the gather is (`MLA.__call__` chooses)."""
    with jax.named_scope("sparse_mla_dense"):
        b, t, _ = rows.shape
        kv = decode_rows(kernel_rows(rows.reshape(b * t, -1), kv_format), kv_format, d_rope)
        kv = kv.reshape(b, t, -1)                                            # [b,t,c+r]
        d_nope = kv.shape[-1] - d_rope
        s_q = positions.shape[1]
        bi = jnp.arange(b)[:, None, None]
        si = jnp.arange(s_q)[None, :, None]
        sel = jnp.zeros((b, s_q, t), bool).at[bi, si, jnp.where(positions >= 0, positions, t)
                                              ].set(True, mode="drop")     # [b,s,t]
        logits = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), kv) * softmax_scale
        logits = jnp.where(sel[:, :, None, :], logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = jnp.sum(p, axis=-1)
        # Full row width, then slice the output (slicing kv copies it on XLA:CPU).
        out = jnp.einsum("bsht,btd->bshd", p, kv)[..., :d_nope]
        empty = denom == 0
        out = jnp.where(empty[..., None], 0.0, out / jnp.where(empty, 1.0, denom)[..., None])
        return out.astype(q.dtype)


DENSE_MAX_T = 4096    # cached positions up to which a prefill chunk attends densely
DENSE_MIN_S = 16      # query tokens from which it does (speculative steps have s <= 8)


def indexer_scores_xla(q, weights, k, lengths):
    """score[b,s,t] = Σ_h w[b,s,h] · ReLU(q[b,s,h]·k[b,t]); −inf where t is after the query."""
    s_q, t_max = q.shape[1], k.shape[1]
    logits = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), k.astype(jnp.float32))
    scores = jnp.einsum("bsh,bsht->bst", weights.astype(jnp.float32), jax.nn.relu(logits))
    qpos = lengths[:, None] - s_q + jnp.arange(s_q)[None, :]                  # [b,s]
    visible = jnp.arange(t_max)[None, None, :] <= qpos[:, :, None]
    return jnp.where(visible, scores, -jnp.inf)


def indexer_topk_xla(q, weights, k_cache, lengths, topk, *, k_scale=None, key_format="bf16"):
    with jax.named_scope("indexer_topk_xla"):
        if key_format == "fp8":   # uint8 e4m3 bytes × per-token scale
            k = jax.lax.bitcast_convert_type(k_cache, jnp.float8_e4m3fn).astype(jnp.float32)
            k = k * k_scale[..., None].astype(jnp.float32)
        else:
            k = k_cache.astype(jnp.float32)
        scores = indexer_scores_xla(q, weights, k, lengths)
        vals, idx = jax.lax.top_k(scores, min(topk, scores.shape[-1]))
        idx = jnp.where(jnp.isfinite(vals), idx, -1).astype(jnp.int32)
        pad = topk - idx.shape[-1]
        if pad > 0:   # fewer cached positions than topk: pad as "no row"
            idx = jnp.pad(idx, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
            vals = jnp.pad(vals, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
        return idx, vals


def sparse_mla(q, kv_cache, indices, softmax_scale, *, kv_format, d_rope, impl="auto"):
    """Absorbed sparse MLA. q [b,s,h,c+r]; kv_cache rows [n, c+r] float (or their raw
    uint8 bytes) for kv_format f32/bf16, [n, row_bytes] uint8 for fp8; indices [b,s,k] global row ids (−1 invalid)
    → (out [b,s,h,c], lse [b,s,h])."""
    _check("impl", impl, _IMPLS)
    _check("kv_format", kv_format, _KV_FORMATS)
    kv_cache = kernel_rows(kv_cache, kv_format)
    mod = _dispatch()
    if mod is not None:
        return mod.sparse_mla(q, kv_cache, indices, softmax_scale, kv_format=kv_format,
                              d_rope=d_rope, impl=impl)
    if impl == "pallas":
        raise ValueError("impl='pallas' requested but jlco.pallas.dispatch is not available")
    return sparse_mla_xla(q, kv_cache, indices, softmax_scale, kv_format=kv_format, d_rope=d_rope)


def indexer_topk(q, weights, k_cache, lengths, topk, *, k_scale=None, key_format="bf16",
                 impl="auto"):
    """Lightning-indexer top-k. q [b,s,h,d], weights [b,s,h] (all scales folded in),
    k_cache [b,t,d] float (uint8 e4m3 bytes + k_scale [b,t] f32 when key_format='fp8'), lengths [b]
    including the s new tokens → (indices [b,s,topk] positions, −1 pad; scores)."""
    _check("impl", impl, _IMPLS)
    _check("key_format", key_format, _KEY_FORMATS)
    if key_format == "fp8" and k_scale is None:
        raise ValueError("indexer_topk: key_format='fp8' needs k_scale")
    mod = _dispatch()
    if mod is not None:
        return mod.indexer_topk(q, weights, k_cache, lengths, topk, k_scale=k_scale,
                                key_format=key_format, impl=impl)
    if impl == "pallas":
        raise ValueError("impl='pallas' requested but jlco.pallas.dispatch is not available")
    return indexer_topk_xla(q, weights, k_cache, lengths, topk, k_scale=k_scale,
                            key_format=key_format)
