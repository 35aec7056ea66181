"""The model's only entry points for its two hot loops: sparse MLA and indexer top-k.

Both go to `jlco.pallas.dispatch`, which picks the kernel or its plain-jnp `*_ref` (the
one reference of each kernel lives beside it in `jlco.pallas`), so `impl` switches
between them without the model noticing (docs/facts.md §2 has the contracts). What is
the model's own here: the latent rows' decoding from the cache's byte form, and the
dense form of sparse MLA for prefill chunks over short contexts.
Glossary: b batch, s query tokens per request, h heads, k selected rows (top-k),
t cached positions, c latent nope width (kv_lora_rank), r rope width, d head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlco.pallas import dispatch, fp8_rows

_KV_FORMATS = ("f32", "bf16", "fp8")
_KEY_FORMATS = ("bf16", "fp8")


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: allowed one of {allowed}")


def decode_rows(rows: jax.Array, kv_format: str, d_rope: int) -> jax.Array:
    """Kernel-form latent rows (float values, or fp8 row bytes) → f32 [..., c + r]."""
    _check("kv_format", kv_format, _KV_FORMATS)
    if kv_format == "fp8":
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


def sparse_mla_dense(q, rows, positions, softmax_scale, *, kv_format, d_rope):
    """Sparse MLA for a prefill chunk, computed densely: every query scores all t cached
    rows of its request in one matmul and keeps only its own top-k (a mask), instead of
    gathering s·k rows. Same function as `sparse_mla` (softmax over the selected rows),
    another summation order. q [b,s,h,c+r]; rows [b,t,row] (bytes or float, one
    request's whole layer); positions [b,s,k] (−1 = none) → out [b,s,h,c].

    Why: a chunk's s queries select overlapping rows, and XLA:CPU's gathered batched
    products move s·k·row bytes (300 MB per 512-token chunk and layer at k 256, f32
    rows) at a fraction of its matmul speed. For t ≤ DENSE_MAX_T one dense product is
    faster; for decode (s = 1) and long contexts the gather is (`MLA.__call__` chooses).
    `mla_dense_heads` is the same attention with the rows up-projected per head."""
    with jax.named_scope("sparse_mla_dense"):
        kv = _dense_kv(rows, kv_format, d_rope)                                # [b,t,c+r]
        d_nope = kv.shape[-1] - d_rope

        def attend(qt, sel):
            logits = jnp.einsum("bshd,btd->bsht", qt.astype(jnp.float32), kv) * softmax_scale
            # Full row width, then slice the output (slicing kv copies it on XLA:CPU).
            return _masked_softmax_out(logits, sel, kv, q.dtype)[..., :d_nope]

        return _tiled(attend, (q,), positions, kv.shape[1])


def mla_dense_heads(q_nope, q_rope, rows, positions, w_uk, w_uv, softmax_scale, *,
                    kv_format, d_rope):
    """`sparse_mla_dense` in the per-head form transformers computes (not absorbed): the
    t cached latents are up-projected once per chunk to per-head keys k = c·W_UKᵀ and
    values v = c·W_UVᵀ, and each query scores them over n + r dims and sums v dims,
    instead of c + r and c in latent space. The same function (softmax over the
    selected rows, then W_UV), another summation order. Per chunk and head it costs
    t·(c·(n+v) + s·(n+r+v)) multiply-adds against s·t·(2c+r) absorbed: fewer once
    s > c·(n+v) / (2c−n−v) (`heads_cheaper`; 171 queries at c 512, n 128, r 64, v 128;
    1.9× fewer at a 512-token chunk).
    q_nope [b,s,h,n], q_rope [b,s,h,r] (RoPE'd); rows [b,t,row]; positions [b,s,k];
    w_uk [h,n,c], w_uv [h,v,c] → out [b,s,h,v] (W_UV applied: `MLA.post` skips it)."""
    with jax.named_scope("mla_dense_heads"):
        kv = _dense_kv(rows, kv_format, d_rope)                                # [b,t,c+r]
        c = kv.shape[-1] - d_rope
        latent, k_rope = kv[..., :c], kv[..., c:]
        k_nope = jnp.einsum("btc,hnc->bthn", latent, w_uk.astype(jnp.float32))
        v = jnp.einsum("btc,hvc->bthv", latent, w_uv.astype(jnp.float32))

        def attend(qn, qr, sel):
            logits = (jnp.einsum("bshn,bthn->bsht", qn.astype(jnp.float32), k_nope)
                      + jnp.einsum("bshr,btr->bsht", qr.astype(jnp.float32), k_rope))
            return _masked_softmax_out(logits * softmax_scale, sel, v, q_nope.dtype,
                                       per_head=True)

        return _tiled(attend, (q_nope, q_rope), positions, kv.shape[1])


def heads_cheaper(s_q: int, c: int, n: int, v: int) -> bool:
    """Whether `mla_dense_heads` does fewer FLOPs than `sparse_mla_dense` for a chunk of
    s_q queries (latent rank c, nope dims n, value dims v)."""
    return s_q * (2 * c - n - v) > c * (n + v)


def _dense_kv(rows, kv_format, d_rope):
    """One request's whole layer of rows [b,t,row] → f32 [b,t,c+r]."""
    b, t, _ = rows.shape
    kv = decode_rows(kernel_rows(rows.reshape(b * t, -1), kv_format), kv_format, d_rope)
    return kv.reshape(b, t, -1)


def _masked_softmax_out(logits, sel, vals, dtype, per_head=False):
    """Softmax of logits [b,w,h,t] over the selected positions sel [b,w,t] and its sum of
    vals ([b,t,d], or per head [b,t,h,d]) → [b,w,h,d] (zeros where nothing is selected)."""
    logits = jnp.where(sel[:, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1)
    out = jnp.einsum("bsht,bthd->bshd" if per_head else "bsht,btd->bshd", p, vals)
    empty = denom == 0
    return jnp.where(empty[..., None], 0.0, out / jnp.where(empty, 1.0, denom)[..., None]
                     ).astype(dtype)


def _tiled(attend, qs, positions, t):
    """attend(*query tiles, sel) over DENSE_TILE_S queries at a time (sel [b,w,t]: the
    positions each query selected): the [b, s, h, t] scores of a whole 4,096-query chunk
    were the prefill's largest transient (the serve process's peak RSS)."""
    b, s_q = positions.shape[:2]
    tile = DENSE_TILE_S if s_q > DENSE_TILE_S and s_q % DENSE_TILE_S == 0 else s_q

    def one(args):              # one tile: queries [b,w,...], positions [b,w,k]
        *qt, pt = args
        w = pt.shape[1]
        bi = jnp.arange(b)[:, None, None]
        si = jnp.arange(w)[None, :, None]
        sel = jnp.zeros((b, w, t), bool).at[bi, si, jnp.where(pt >= 0, pt, t)
                                            ].set(True, mode="drop")        # [b,w,t]
        return attend(*qt, sel)

    if tile == s_q:
        return one((*qs, positions))
    n = s_q // tile
    split = lambda x: jnp.moveaxis(x.reshape(b, n, tile, *x.shape[2:]), 1, 0)  # noqa: E731
    out = jax.lax.map(one, tuple(split(x) for x in (*qs, positions)))          # [n,b,w,h,d]
    return jnp.moveaxis(out, 0, 1).reshape(b, s_q, *out.shape[3:])


DENSE_MAX_T = 4096    # cached positions up to which a prefill chunk attends densely
DENSE_TILE_S = 512    # queries a dense chunk scores at once (its [b, w, h, t] transient)
DENSE_MIN_S = 16      # query tokens from which it does (speculative steps have s <= 8)


def sparse_mla(q, kv_cache, indices, softmax_scale, *, kv_format, d_rope, impl="auto"):
    """Absorbed sparse MLA. q [b,s,h,c+r]; kv_cache rows [n, c+r] float (or their raw
    uint8 bytes) for kv_format f32/bf16, [n, row_bytes] uint8 for fp8; indices [b,s,k]
    global row ids (−1 invalid) → (out [b,s,h,c], lse [b,s,h]). A query whose indices
    are all −1 yields out 0 and lse +inf (FlashMLA's convention)."""
    _check("impl", impl, dispatch.IMPLS)
    _check("kv_format", kv_format, _KV_FORMATS)
    return dispatch.sparse_mla(q, kernel_rows(kv_cache, kv_format), indices, softmax_scale,
                               kv_format=kv_format, d_rope=d_rope, impl=impl)


def indexer_topk(q, weights, k_cache, lengths, topk, *, k_scale=None, key_format="bf16",
                 impl="auto", fresh=None):
    """Lightning-indexer top-k. q [b,s,h,d], weights [b,s,h] (all scales folded in),
    k_cache [b,t,d] float (uint8 e4m3 bytes + k_scale [b,t] f32 when key_format='fp8'),
    lengths [b] including the s new tokens → (indices [b,s,topk] positions, −1 pad;
    scores). `fresh` (keys, scales, positions [b,s]): keys k_cache need not hold yet
    (`jlco.pallas.indexer_ref.indexer_topk_ref`; only where `fresh_keys_first`)."""
    _check("impl", impl, dispatch.IMPLS)
    _check("key_format", key_format, _KEY_FORMATS)
    if key_format == "fp8" and k_scale is None:
        raise ValueError("indexer_topk: key_format='fp8' needs k_scale")
    return dispatch.indexer_topk(q, weights, k_cache, lengths, topk, k_scale=k_scale,
                                 key_format=key_format, impl=impl, fresh=fresh)


def fresh_keys_first(impl: str, s_q: int) -> bool:
    """Whether a step of s_q queries scores the cached keys before writing its own
    (passing them as `fresh`): where the plain-XLA indexer runs a decode-sized step
    (impl "xla", or "auto" on a CPU backend; s_q below the chunk size). XLA:CPU then
    reads the key cache in place and updates it after; written first, the update and
    the read of one buffer cost it a copy of every layer's keys a step. The kernels
    read the cache as written (`dispatch.indexer_topk`), so elsewhere the order stays."""
    from jlco.pallas.indexer_ref import REF_CHUNK_MIN_S
    cpu = impl == "xla" or (impl == "auto" and jax.default_backend() == "cpu")
    return cpu and s_q < REF_CHUNK_MIN_S
