"""Plain-jnp reference of the lightning indexer (`jlco.pallas.indexer`'s contract): what
every backend without a kernel runs (XLA:CPU in production), and what the kernels are
tested against. Scores are formed a key block at a time with a running top-k, so memory
stays one block's logits whatever the context; decode steps may pass their own new keys
as `fresh` (scored from them, not from the cache), so XLA:CPU can read the key cache in
place before the step writes it.

Plain jnp by default: the kernels (and the native XLA:CPU kernels) are checked against
it. `native_cpu=True` is the serving path on a CPU backend, which `jlco.pallas.dispatch`
chooses: the same stream with a decode step's scores and every top-k merge in
`jlco.native`'s kernels (the top-k bit for bit `lax.top_k`'s; the scores within f32
rounding of the einsums).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlco import native
from jlco.pallas.indexer import NEG_INF, compute_dtype, validate, select_topk

REF_BLOCK_ELEMS = 1 << 26   # f32 per-head logits [s_q, H, keys] of one key block (s_q < 16)
REF_STEP_BLOCK = 65536      # most keys per block of a decode step's stream (s_q < 16)
REF_CHUNK_MIN_S = 16        # queries from which a call is a prefill chunk (tiled scoring)
REF_CHUNK_BLOCK = 4096      # keys per block of a chunk's stream (one top-k merge each)
REF_CHUNK_TILE = 128        # queries per tile of a chunk's block scores


def ref_key_block(s_q: int, heads: int, length: int, topk: int = 1) -> int:
    """Keys per block of the reference's stream, a power of two at most `length`. For
    prefill chunks (s_q >= REF_CHUNK_MIN_S) REF_CHUNK_BLOCK (at least `topk`): scores
    are formed in tiles (`_chunk_scores`), so the block only sets how often the running
    top-k merges (XLA:CPU's top-k costs 10 ns per element in rows of 1K, 7 ns in rows
    of 4K). Else (decode steps) s_q·H·block at most REF_BLOCK_ELEMS and block at most
    REF_STEP_BLOCK, at least 256 and `topk`: a step of 32 requests at 128K would
    otherwise form 32 x [H, 128K] logits at once (1.1 GB on the tiny model). The cap was
    16,384: a context just past it (16,408 keys) then ran a loop of one block plus a
    24-key block, each copying its keys twice (a dynamic slice, then the transpose):
    23.9 vs 19.8 ms a batch-1 step at 16K (configs/bench_llamacpp.py); at 32,768 a
    32K context (32,792 keys) likewise doubled the step (28.2 ms, 15.1 at 16K): one
    block scores the cache in place, a stream copies every block it slices. At 65,536
    the largest block's logits are 32 requests x 64 heads x 64K f32 = 537 MB. It depends
    on the query shape only, never on the batch, so a micro-batch (the host-driven
    engine) scores with the same block shapes as the whole batch."""
    if s_q >= REF_CHUNK_MIN_S:
        blk = max(REF_CHUNK_BLOCK, topk)
    else:
        blk = max(256, min(REF_BLOCK_ELEMS // max(1, s_q * heads), REF_STEP_BLOCK), topk)
    return min(1 << (blk.bit_length() - 1), length)


def _float_keys(k):
    """Keys as floats: uint8 e4m3 bytes (key_format 'fp8') viewed as float8_e4m3fn."""
    return jax.lax.bitcast_convert_type(k, jnp.float8_e4m3fn) if k.dtype == jnp.uint8 else k


def _ref_operands(q, weights, k_cache, key_format):
    """(queries, weights f32, keys as stored, compute dtype) (`validate` has checked that
    fp8 keys, and only they, are uint8). The keys stay in their storage bytes: each key
    block is viewed as e4m3 and widened after it is sliced (`_ref_block_scores`), since
    XLA:CPU materialises a bitcast-convert of the whole cache (a step at 128K held every
    layer's [b, L, D] e4m3 copy and its f16 widening: 1.6 GB of 2.2 GB of temporaries)."""
    del key_format
    cdt = compute_dtype(q.dtype, k_cache.dtype)
    return q.astype(cdt), weights.astype(jnp.float32), k_cache, cdt


def _head_scores(qc, wf, kb, sb):
    """Σ_h w_h · ReLU(q_h · k) [b, t, n] for a few queries [b, t, H, D] against keys
    kb [b, n, D] (scales sb [b, n] or None), one head at a time: each head's [t, n]
    logits stay in cache and are consumed as they are made (one einsum over all heads
    writes [t, H, n] to memory and reads it back: 4x slower on a 2-core CPU)."""
    acc = None
    for h in range(qc.shape[2]):
        logits = jnp.einsum("btd,bsd->bts", qc[:, :, h], kb, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
        if sb is not None:
            logits = logits * sb[:, None, :]
        term = jnp.maximum(logits, 0.0) * wf[:, :, h, None]
        acc = term if acc is None else acc + term
    return acc


def _chunk_scores(qc, wf, kb, sb):
    """`_head_scores` of a chunk's queries, REF_CHUNK_TILE queries at a time (the
    largest power of two up to it that divides s_q) → [b, s_q, n]."""
    b, s_q, heads, d = qc.shape
    tq = 1
    while tq * 2 <= REF_CHUNK_TILE and s_q % (tq * 2) == 0:
        tq *= 2
    qt = qc.reshape(b, s_q // tq, tq, heads, d).transpose(1, 0, 2, 3, 4)
    wt = wf.reshape(b, s_q // tq, tq, heads).transpose(1, 0, 2, 3)
    out = jax.lax.map(lambda a: _head_scores(a[0], a[1], kb, sb), (qt, wt))   # [n, b, tq, w]
    return out.transpose(1, 0, 2, 3).reshape(b, s_q, kb.shape[1])


def _raw_scores(qc, wf, kb, sb, s_q):
    """Unmasked Σ_h w_h · ReLU(q_h · k) [b, s_q, n] of keys kb [b, n, D] (scales sb)."""
    if s_q >= REF_CHUNK_MIN_S:
        return _chunk_scores(qc, wf, kb, sb)
    # Keys on the left: [n, D] contracting its minor axis is the row-major operand
    # XLA:CPU's dot takes as is; with the queries on the left it first copied the keys
    # into [D, n] every step (1.2 ms a layer at 16K on the 2-core box).
    logits = jnp.einsum("bsd,bthd->bsth", kb, qc, precision=jax.lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
    if sb is not None:
        logits = logits * sb[:, :, None, None]
    return jnp.einsum("bsth,bth->bts", jnp.maximum(logits, 0.0), wf,
                      precision=jax.lax.Precision.HIGHEST)


def _scores(qc, wf, kb, sb, s_q, cdt, native_cpu=False):
    """`_raw_scores` of keys kb in their storage dtype; with `native_cpu` a decode step's
    bf16 / f32 keys go to the native kernel (`jlco.native.indexer_scores`: the heads in
    vector lanes, 2-3x XLA's two einsums)."""
    if native_cpu and sb is None and s_q < REF_CHUNK_MIN_S and \
            native.indexer_scores_supported(qc, kb):
        return native.indexer_scores(qc, wf, kb)
    return _raw_scores(qc, wf, kb.astype(cdt), sb, s_q)


def _top_k(x, k, native_cpu=False):
    """`lax.top_k`, or with `native_cpu` the native kernel's (bit for bit the same)."""
    return native.top_k(x, k) if native_cpu else jax.lax.top_k(x, k)


def _fresh_scores(ops, fresh, native_cpu=False):
    """(scores [b, s_q, s] of the fresh keys, their positions [b, s]) or None."""
    if fresh is None:
        return None
    qc, wf, _, cdt = ops
    keys, scale, positions = fresh
    sb = None if scale is None else scale.astype(jnp.float32)
    return (_scores(qc, wf, _float_keys(keys), sb, qc.shape[1], cdt, native_cpu),
            positions.astype(jnp.int32))


def _ref_block_scores(ops, k_scale, lengths, lo, width, s_q, fresh=None, native_cpu=False):
    """Masked scores [b, s_q, width] f32 of keys lo .. lo+width (lo may be traced);
    `fresh` (`_fresh_scores`): those positions take the fresh keys' scores."""
    qc, wf, k, cdt = ops
    kb = _float_keys(jax.lax.dynamic_slice_in_dim(k, lo, width, axis=1))
    sb = None
    if k_scale is not None:
        sb = jax.lax.dynamic_slice_in_dim(k_scale, lo, width, axis=1).astype(jnp.float32)
    scores = _scores(qc, wf, kb, sb, s_q, cdt, native_cpu)
    cols = lo + jnp.arange(width)
    if fresh is not None:
        f_scores, f_pos = fresh
        for j in range(f_pos.shape[1]):
            hit = cols[None, None, :] == f_pos[:, j, None, None]
            scores = jnp.where(hit, f_scores[:, :, j:j + 1], scores)
    p = lengths.astype(jnp.int32)[:, None, None] - s_q + jnp.arange(s_q)[None, :, None]
    return jnp.where(cols[None, None, :] <= p, scores, NEG_INF)


def indexer_scores_ref(q, weights, k_cache, lengths, *, k_scale=None, key_format="bf16"):
    """Plain-jnp masked scores [b, s_q, L] f32, the reference for `indexer_scores`: the
    per-head logits are formed a key block at a time (`ref_key_block`); blocking the keys
    changes no reduction (those run over D and H). The whole [b, s_q, L] row is returned:
    for tests and small shapes; `indexer_topk_ref` never forms it."""
    validate(q, weights, k_cache, lengths, 1, k_scale, key_format)
    b, s_q, heads = q.shape[:3]
    length = k_cache.shape[1]
    ops = _ref_operands(q, weights, k_cache, key_format)
    scale = k_scale if key_format == "fp8" else None
    blk = ref_key_block(s_q, heads, length)
    return jnp.concatenate([_ref_block_scores(ops, scale, lengths, lo, min(blk, length - lo), s_q)
                            for lo in range(0, length, blk)], axis=-1)


def _merge_block(carry, scores, lo, topk, native_cpu=False):
    """Running top-k (vals, positions) merged with one block's scores [b, s_q, w]. The
    running entries come first and hold lower positions, and `lax.top_k` keeps the
    lower index of equal values, so the order is the whole row's: descending score,
    ties to the lower position."""
    vals, idx = carry
    pos = jnp.broadcast_to(lo + jnp.arange(scores.shape[-1], dtype=jnp.int32), scores.shape)
    v, j = _top_k(jnp.concatenate([vals, scores], axis=-1), topk, native_cpu)
    return v, jnp.take_along_axis(jnp.concatenate([idx, pos], axis=-1), j, axis=-1)


def _stream_topk(ops, k_scale, lengths, topk, length, blk, s_q, fresh, native_cpu=False):
    """Top-k over the key blocks with a running top-k: memory is one block's logits and
    scores, whatever the context (a 4096-query chunk over 128K keys would otherwise
    hold a [4096, 128K] score row, and XLA:CPU kept every block's logits live at once)."""
    b = lengths.shape[0]
    carry = (jnp.full((b, s_q, topk), NEG_INF, jnp.float32),
             jnp.full((b, s_q, topk), -1, jnp.int32))

    def body(i, c):
        lo = i * blk
        return _merge_block(c, _ref_block_scores(ops, k_scale, lengths, lo, blk, s_q, fresh,
                                                 native_cpu), lo, topk, native_cpu)

    # Blocks wholly past every request's length hold no visible key: skipped (the scan
    # bucket can be twice the longest context).
    n_full = length // blk
    longest = jnp.max(lengths).astype(jnp.int32)
    live = jnp.clip((longest + blk - 1) // blk, 0, n_full)
    carry = jax.lax.fori_loop(0, live, body, carry)
    if length % blk:
        lo = n_full * blk
        carry = jax.lax.cond(longest > lo, lambda c: _merge_block(
            c, _ref_block_scores(ops, k_scale, lengths, lo, length - lo, s_q, fresh,
                                 native_cpu), lo, topk, native_cpu),
            lambda c: c, carry)
    vals, idx = carry
    valid = vals > NEG_INF
    return jnp.where(valid, idx, -1), jnp.where(valid, vals, NEG_INF)


@functools.partial(jax.jit, static_argnames=("topk", "key_format", "block_n", "backend",
                                             "interpret", "native_cpu"))
def indexer_topk_ref(q, weights, k_cache, lengths, topk, *, k_scale=None, key_format="bf16",
                     block_n=None, backend="auto", interpret=False, fresh=None,
                     native_cpu=False):
    """Plain-jnp reference of `indexer_topk` (same contract; block/backend args ignored).
    One key block: the whole score row and `select_topk`; more: streamed blocks with a
    running top-k (`_stream_topk`), the same positions and scores.

    `fresh` = (keys [b, s, D] in k_cache's dtype, scales [b, s] with fp8 else None,
    positions [b, s]): the keys at those positions, whether or not k_cache holds them
    yet (`write_fresh`); their scores come from `fresh`. A decode step scores the cache
    as it was before its own keys are written, so XLA:CPU reads the cache buffer in
    place and then updates it in place (see `jlco.model.mla`). `native_cpu`: the CPU
    serving path's native kernels (module docstring)."""
    del block_n, backend, interpret
    validate(q, weights, k_cache, lengths, topk, k_scale, key_format)
    _validate_fresh(fresh, k_cache)
    b, s_q, heads = q.shape[:3]
    length = k_cache.shape[1]
    ops = _ref_operands(q, weights, k_cache, key_format)
    scale = k_scale if key_format == "fp8" else None
    blk = ref_key_block(s_q, heads, length, topk)
    with jax.named_scope("indexer_topk_ref"):
        f = _fresh_scores(ops, fresh, native_cpu)
        if blk >= length:
            return select_topk(_ref_block_scores(ops, scale, lengths, 0, length, s_q, f,
                                                 native_cpu), topk, native_cpu)
        return _stream_topk(ops, scale, lengths, topk, length, blk, s_q, f, native_cpu)


def _validate_fresh(fresh, k_cache):
    if fresh is None:
        return
    keys, scale, positions = fresh
    b, _, d = k_cache.shape
    if keys.ndim != 3 or keys.shape[0] != b or keys.shape[2] != d or keys.dtype != k_cache.dtype:
        raise ValueError(f"fresh keys must be {k_cache.dtype}[b={b}, s, D={d}] like k_cache; "
                         f"got {keys.dtype}{keys.shape}")
    if positions.shape != keys.shape[:2] or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"fresh positions must be integers [b, s]={keys.shape[:2]}; "
                         f"got {positions.dtype}{positions.shape}")
    if (scale is None) != (keys.dtype != jnp.uint8) or (
            scale is not None and scale.shape != keys.shape[:2]):
        raise ValueError("fresh scales [b, s] are needed with (and only with) fp8 keys")


def write_fresh(k_cache, k_scale, fresh):
    """k_cache (and k_scale) with the `fresh` keys written at their positions (positions
    past the end dropped): what a kernel, which reads only k_cache, is given."""
    if fresh is None:
        return k_cache, k_scale
    keys, scale, positions = fresh
    bidx = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
    k_cache = k_cache.at[bidx, positions].set(keys, mode="drop")
    if scale is not None:
        k_scale = k_scale.at[bidx, positions].set(scale, mode="drop")
    return k_cache, k_scale
