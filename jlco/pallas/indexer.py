"""Lightning-indexer scoring kernel (DeepSeek Sparse Attention) and its top-k selection.

Every decode step the indexer reads the *whole* indexer-key cache of every request
(64 heads x 128 dims of queries against L keys), so it is the one part of DSA whose cost
grows with context. The kernel streams key blocks once and keeps all heads of all
`s_q` queries in registers/VMEM, computing

    score[b, t, s] = sum_h weights[b, t, h] * ReLU(q[b, t, h] . k[b, s])     (s <= p_t)

with `p_t = lengths[b] - s_q + t` (causal) and -inf elsewhere. Key blocks that lie wholly
past a request's length are neither computed nor (on TPU) fetched, so a ragged batch costs
what its real tokens cost. Selection is `lax.top_k` over the [b, s_q, L] scores.

Dimension letters: b batch, t query (s_q), h index head, d head dim, s / n key position.
Backends: Triton (cuda), Mosaic (tpu), interpret mode (any, used on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jlco import native
from jlco.pallas import tuning

KEY_FORMATS = ("bf16", "fp8")
BACKENDS = ("auto", "triton", "mosaic")
NEG_INF = float("-inf")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def validate(q, weights, k_cache, lengths, topk, k_scale, key_format):
    """Shape/dtype checks with messages that name the argument: a wrong layout here would
    otherwise surface as an opaque Pallas block-shape error or as silently wrong scores."""
    if key_format not in KEY_FORMATS:
        raise ValueError(f"key_format={key_format!r} is invalid: allowed {KEY_FORMATS}")
    if q.ndim != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a float array [b, s_q, H, D]; got {q.dtype}{q.shape}")
    b, s_q, h, d = q.shape
    if weights.shape != (b, s_q, h):
        raise ValueError(f"weights must have shape [b, s_q, H]={(b, s_q, h)}; got {weights.shape}")
    if k_cache.ndim != 3 or k_cache.shape[0] != b or k_cache.shape[2] != d:
        raise ValueError(f"k_cache must have shape [b, L, D] with b={b}, D={d}; "
                         f"got {k_cache.shape}")
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be an integer array of shape [b]={(b,)}; "
                         f"got {lengths.dtype}{lengths.shape}")
    if not isinstance(topk, int) or isinstance(topk, bool) or topk <= 0:
        raise ValueError(f"topk={topk!r} is invalid: allowed a positive int")
    if key_format == "fp8":
        if k_cache.dtype != jnp.uint8:
            raise ValueError(f"k_cache must be uint8 e4m3 bytes for key_format='fp8'; "
                             f"got {k_cache.dtype}")
        if k_scale is None or k_scale.shape != k_cache.shape[:2]:
            raise ValueError(f"k_scale must have shape [b, L]={k_cache.shape[:2]} for "
                             f"key_format='fp8'; got {None if k_scale is None else k_scale.shape}")
    else:
        if not jnp.issubdtype(k_cache.dtype, jnp.floating):
            raise ValueError(f"k_cache must be a float array for key_format='bf16'; "
                             f"got {k_cache.dtype} (use key_format='fp8' for uint8 bytes)")
        if k_scale is not None:
            raise ValueError("k_scale is only allowed with key_format='fp8'")


def compute_dtype(q_dtype, k_dtype):
    """Both MMA operands share one dtype; fp8 keys are exact in bf16."""
    if k_dtype == jnp.uint8:
        k_dtype = jnp.bfloat16
    return jnp.promote_types(q_dtype, k_dtype)


def _decode_e4m3(codes):
    """int32 e4m3fn codes (0..255) -> f32, by building the f32 bit pattern: Mosaic has no
    fp8 type on every TPU generation, integer ops and a bitcast it always has. (Code 0x7f,
    e4m3's NaN, decodes as 480; quantisers never write it.)"""
    sign, exp, man = codes >> 7, (codes >> 3) & 15, codes & 7
    normal = jax.lax.bitcast_convert_type(
        (sign << 31) | ((exp + 120) << 23) | (man << 20), jnp.float32)
    subnormal = (man.astype(jnp.float32) * (2.0 ** -9)
                 * (1 - 2 * sign).astype(jnp.float32))
    return jnp.where(exp == 0, subnormal, normal)


def _score_tile(length, n0, sub, qs, ws, k_ref, s_ref, o_ref, *, s_q, block_n,
                compute_dtype, int_fp8):
    """Scores of keys n0 .. n0+block_n (sub-tile `sub` of this program's key window)."""
    cols = pl.ds(sub * block_n, block_n)
    k = k_ref[cols, :]                                                    # [n, d]
    if int_fp8:
        k = _decode_e4m3(k.astype(jnp.int32))
    k = k.astype(compute_dtype)
    scale = s_ref[:, cols].astype(jnp.float32) if s_ref is not None else None   # [1, n]
    pos = n0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    precision = (jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    for t in range(s_q):
        acc = jnp.zeros((1, block_n), jnp.float32)
        for qh, w in zip(qs[t], ws[t]):                                   # [h, d], [h, 1]
            logits = jax.lax.dot_general(                                 # [h, n]
                qh, k, (((1,), (1,)), ((), ())), precision=precision,
                preferred_element_type=jnp.float32)
            if scale is not None:
                logits = logits * scale
            acc = acc + jnp.sum(w * jnp.maximum(logits, 0.0), axis=0, keepdims=True)
        visible = pos <= length - s_q + t
        o_ref[pl.ds(t, 1), cols] = jnp.where(visible, acc, NEG_INF)


def _score_body(length, q_ref, w_ref, k_ref, s_ref, o_ref, *, s_q, n_heads, block_h,
                block_n, steps, compute_dtype, int_fp8):
    """One (request, key window) program: all queries x all heads against `steps` tiles of
    `block_n` keys. Queries and weights are loaded once per program and stay in registers
    (Triton) / VMEM (Mosaic) while the key tiles stream past."""
    qs = [[q_ref[t, pl.ds(h0, block_h), :].astype(compute_dtype)
           for h0 in range(0, n_heads, block_h)] for t in range(s_q)]
    ws = [[w_ref[t, pl.ds(h0, block_h), :] for h0 in range(0, n_heads, block_h)]
          for t in range(s_q)]
    tile = functools.partial(_score_tile, length, qs=qs, ws=ws, k_ref=k_ref, s_ref=s_ref,
                             o_ref=o_ref, s_q=s_q, block_n=block_n,
                             compute_dtype=compute_dtype, int_fp8=int_fp8)

    first = pl.program_id(1) * steps      # read outside the loop: interpret mode needs it

    def step(sub, carry):
        n0 = (first + sub) * block_n

        @pl.when(n0 < length)
        def _compute():
            tile(n0, sub)

        @pl.when(n0 >= length)
        def _skip():
            o_ref[:, pl.ds(sub * block_n, block_n)] = jnp.full(
                (s_q, block_n), NEG_INF, jnp.float32)
        return carry

    if steps == 1:
        step(0, 0)
    else:
        jax.lax.fori_loop(0, steps, step, 0)


def _triton_kernel(len_ref, q_ref, w_ref, k_ref, *rest, **kw):
    *s_ref, o_ref = rest
    _score_body(len_ref[...], q_ref, w_ref, k_ref, s_ref[0] if s_ref else None, o_ref, **kw)


def _mosaic_kernel(len_ref, q_ref, w_ref, k_ref, *rest, **kw):
    *s_ref, o_ref = rest
    length = len_ref[pl.program_id(0)]
    _score_body(length, q_ref, w_ref, k_ref, s_ref[0] if s_ref else None, o_ref, **kw)


def _shrink_to_divisor(block, length, minimum):
    """Halve `block` (down to `minimum`) until it divides `length`: a key axis that is not a
    multiple of the tile costs a padded copy of the whole key cache every call."""
    while block > minimum and length % block:
        block //= 2
    return block


def _prepare(q, weights, k_cache, k_scale, *, block_h, block_n, pad_pow2, int_fp8):
    """Pads heads (zero q rows and zero weights add exactly 0), the head dim (zero columns
    add 0 to q.k) and the key axis to the block grid; bit-casts fp8 bytes to float8 unless
    the kernel decodes the integer codes itself (`int_fp8`)."""
    b, s_q, h, d = q.shape
    length = k_cache.shape[1]
    hp = -(-h // block_h) * block_h
    dp = _next_pow2(max(d, 16)) if pad_pow2 else d
    lp = -(-length // block_n) * block_n
    q = jnp.pad(q, ((0, 0), (0, 0), (0, hp - h), (0, dp - d)))
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, 0), (0, hp - h)))[..., None]
    if k_cache.dtype == jnp.uint8 and not int_fp8:
        k_cache = jax.lax.bitcast_convert_type(k_cache, jnp.float8_e4m3fn)
    if dp != d or lp != length:
        k_cache = jnp.pad(k_cache, ((0, 0), (0, lp - length), (0, dp - d)))
    scale = None
    if k_scale is not None:
        scale = jnp.pad(k_scale.astype(jnp.float32), ((0, 0), (0, lp - length)))[:, None, :]
    return q, w, k_cache, scale, lp


def _score_call(q, weights, k_cache, lengths, k_scale, *, style, blocks, interpret):
    """Builds and runs the scoring pallas_call for one backend style -> [b, s_q, L] f32."""
    b, s_q, h, d = q.shape
    length = k_cache.shape[1]
    block_n, block_h = blocks["block_n"], blocks["block_h"]
    steps = 1
    if style == "triton":
        block_n = _shrink_to_divisor(_next_pow2(max(16, min(block_n, length))), length, 16)
        block_h = _next_pow2(max(16, min(block_h, h)))
        steps = max(1, min(blocks.get("steps", 1), -(-length // block_n)))
        while steps > 1 and length % (block_n * steps):
            steps -= 1
    else:
        block_n = length if length <= block_n else _shrink_to_divisor(block_n, length, 128)
        block_h = h if h <= block_h or h % block_h else block_h
    window = block_n * steps
    int_fp8 = style == "mosaic" and k_cache.dtype == jnp.uint8
    q, w, k, scale, lp = _prepare(q, weights, k_cache, k_scale, block_h=block_h,
                                  block_n=window, pad_pow2=style == "triton", int_fp8=int_fp8)
    hp, dp = q.shape[2], q.shape[3]
    cdt = compute_dtype(q.dtype, k_cache.dtype)
    kw = dict(s_q=s_q, n_heads=hp, block_h=block_h, block_n=block_n, steps=steps,
              compute_dtype=cdt, int_fp8=int_fp8)
    grid = (b, lp // window)
    out_shape = jax.ShapeDtypeStruct((b, s_q, lp), jnp.float32)
    operands = [q, w, k] + ([scale] if scale is not None else [])
    if style == "triton":
        specs = [pl.BlockSpec((None,), lambda i, j: (i,)),
                 pl.BlockSpec((None, s_q, hp, dp), lambda i, j: (i, 0, 0, 0)),
                 pl.BlockSpec((None, s_q, hp, 1), lambda i, j: (i, 0, 0, 0)),
                 pl.BlockSpec((None, window, dp), lambda i, j: (i, j, 0))]
        if scale is not None:
            specs.append(pl.BlockSpec((None, 1, window), lambda i, j: (i, 0, j)))
        out = pl.pallas_call(
            functools.partial(_triton_kernel, **kw), out_shape=out_shape, grid=grid,
            in_specs=specs,
            out_specs=pl.BlockSpec((None, s_q, window), lambda i, j: (i, 0, j)),
            compiler_params=pltriton.CompilerParams(
                num_warps=blocks.get("num_warps", 4), num_stages=blocks.get("num_stages", 2)),
            interpret=interpret, name="indexer_scores_triton",
        )(lengths, *operands)
    else:
        out = _mosaic_call(kw, grid, out_shape, lengths, operands, interpret)
    return out[:, :, :length]


def _mosaic_call(kw, grid, out_shape, lengths, operands, interpret):
    """TPU variant: lengths ride in SMEM (scalar prefetch) so the key index_map can clamp
    to the request's last valid block; repeated block indices skip the HBM->VMEM copy."""
    block_n, s_q = kw["block_n"], kw["s_q"]
    q, w, k = operands[:3]
    hp, dp = q.shape[2], q.shape[3]

    def k_map(i, j, lens):
        # lax.div (truncating) is exact for the non-negative operand and, unlike `//`,
        # needs no sign fix-up, which Mosaic cannot lower without a TPU to query.
        last = jax.lax.div(jnp.maximum(lens[i] - 1, 0), block_n)
        return i, jnp.minimum(j, last), 0

    specs = [pl.BlockSpec((None, s_q, hp, dp), lambda i, j, lens: (i, 0, 0, 0)),
             pl.BlockSpec((None, s_q, hp, 1), lambda i, j, lens: (i, 0, 0, 0)),
             pl.BlockSpec((None, block_n, dp), k_map)]
    if len(operands) == 4:
        specs.append(pl.BlockSpec(
            (None, 1, block_n), lambda i, j, lens: (i, 0, k_map(i, j, lens)[1])))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=grid, in_specs=specs,
        out_specs=pl.BlockSpec((None, s_q, block_n), lambda i, j, lens: (i, 0, j)))
    return pl.pallas_call(
        functools.partial(_mosaic_kernel, **kw), out_shape=out_shape, grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret, name="indexer_scores_mosaic",
    )(lengths, *operands)


def _blocks(platform, q, k_cache, key_format, block_n):
    found = tuning.lookup("indexer", platform=platform, dtype=key_format,
                          context=k_cache.shape[1], heads=q.shape[2])
    return dict(found, block_n=block_n) if block_n is not None else found


def indexer_scores(q, weights, k_cache, lengths, *, k_scale=None, key_format="bf16",
                   block_n=None, backend="auto", interpret=False):
    """Masked indexer scores [b, s_q, L] f32 (-inf where a key is not visible)."""
    validate(q, weights, k_cache, lengths, 1, k_scale, key_format)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid: allowed {BACKENDS}")
    lengths = lengths.astype(jnp.int32)
    args = (q, weights, k_cache, lengths, k_scale)

    def run(style, platform, interp):
        blocks = _blocks(platform, q, k_cache, key_format, block_n)
        return _score_call(*args, style=style, blocks=blocks, interpret=interp)

    with jax.named_scope("indexer_scores"):
        if backend == "triton":
            return run("triton", "cpu" if interpret else "cuda", interpret)
        if backend == "mosaic":
            return run("mosaic", "cpu" if interpret else "tpu", interpret)
        if interpret:
            return run("triton", "cpu", True)
        return jax.lax.platform_dependent(
            cuda=lambda: run("triton", "cuda", False),
            tpu=lambda: run("mosaic", "tpu", False),
            default=lambda: run("triton", "cpu", True))


def select_topk(scores, topk, native_cpu: bool = False):
    """Top-k positions per query; -1 / -inf where fewer than `topk` keys are visible.
    `lax.top_k` orders by descending score and breaks ties by lower position; with
    `native_cpu` a CPU backend runs `jlco.native.top_k` (the same result, bit for bit),
    without it `lax.top_k` itself (the plain-jnp reference)."""
    b, s_q, length = scores.shape
    if topk > length:
        scores = jnp.pad(scores, ((0, 0), (0, 0), (0, topk - length)),
                         constant_values=NEG_INF)
    with jax.named_scope("indexer_select"):
        vals, idx = native.top_k(scores, topk) if native_cpu else jax.lax.top_k(scores, topk)
    valid = vals > NEG_INF
    return jnp.where(valid, idx, -1).astype(jnp.int32), jnp.where(valid, vals, NEG_INF)


@functools.partial(jax.jit, static_argnames=("topk", "key_format", "block_n", "backend",
                                             "interpret"))
def indexer_topk(q, weights, k_cache, lengths, topk, *, k_scale=None, key_format="bf16",
                 block_n=None, backend="auto", interpret=False):
    """Lightning-indexer top-k: (indices [b, s_q, topk] int32, scores [b, s_q, topk] f32).

    `weights` already carry every scale (w * H^-0.5 * D^-0.5); query t of request b sits at
    position lengths[b] - s_q + t and sees keys 0..that position.
    """
    validate(q, weights, k_cache, lengths, topk, k_scale, key_format)
    scores = indexer_scores(q, weights, k_cache, lengths, k_scale=k_scale,
                            key_format=key_format, block_n=block_n, backend=backend,
                            interpret=interpret)
    return select_topk(scores, topk, native_cpu=True)
