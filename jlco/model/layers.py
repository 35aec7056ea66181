"""Small building blocks shared by the model: parameter helper, Linear, norms, YaRN RoPE.

Weights are kept in jax layout (`[in, out]`); `jlco.checkpoint.hf_names` transposes the torch
`[out, in]` tensors once at load time. Every parameter declares its logical sharding axes
where it is created (`out_sharding` metadata, eager sharding off) so `nnx.eval_shape`
yields a tree that a mesh rules object can map to shardings without materialising it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco import native
from jlco.config import ModelConfig, RopeScaling


def dtype_of(cfg: ModelConfig) -> jnp.dtype:
    return jnp.dtype(cfg.dtype)


def param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, axes: tuple[str | None, ...],
          init: str = "normal", std: float = 0.02) -> nnx.Param:
    """A parameter with logical axis names; `init` only matters for random test models."""
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} do not match shape {shape}")
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class Linear(nnx.Module):
    """y = x @ W, W stored `[in, out]`; computes in the weight's dtype. With `native`
    set (`jlco.model.decoder.use_native_matmuls`, one XLA:CPU device) an f32 product of
    at most `native.MAX_ROWS` rows runs the small-M kernel (`jlco.native`)."""

    native = False

    def __init__(self, d_in: int, d_out: int, *, axes: tuple[str | None, str | None],
                 dtype, rngs: nnx.Rngs):
        self.weight = param(rngs, (d_in, d_out), dtype, axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        x = x.astype(w.dtype)
        if self.native and native.supports(x, w):
            return native.linear(x, w)
        return jnp.einsum("...i,io->...o", x, w)


class Fused(Linear):
    """Several `Linear`s that read the same input, as one matmul over their weights
    concatenated `[in, Σ out]`; returns each one's output. At batch 1 a matvec is bound
    by the bytes it reads, and XLA:CPU runs one of a few hundred KB on one core at
    13-17 GB/s, one of a few MB at 22-32 GB/s (both cores): one MLA layer's q_a | kv_a
    | indexer wk | weights_proj (all of x) ran 94 → 75 µs, q_b | indexer wq_b (of the
    normed q latent) 139 → 94 µs, an expert's gate | up 43 → 36 µs
    (docs/journal/2026-12-04.md, session 17). Each output column is the same dot product as before."""

    def __init__(self, *linears: Linear):
        ws = [lin.weight[...] for lin in linears]
        if len({w.dtype for w in ws}) != 1 or len({w.shape[0] for w in ws}) != 1:
            raise ValueError("Fused: the weights must share their dtype and input size, "
                             f"got {[(w.shape, str(w.dtype)) for w in ws]}")
        self.sizes = tuple(int(w.shape[1]) for w in ws)
        self.weight = nnx.Param(jnp.concatenate(ws, axis=1))

    def __call__(self, x: jax.Array) -> list[jax.Array]:
        return jnp.split(super().__call__(x), np.cumsum(self.sizes)[:-1].tolist(), axis=-1)


class RMSNorm(nnx.Module):
    """RMSNorm computed in f32; the normalised value is cast back before the weight
    multiply, as the reference does, so bf16 runs round in the same place."""

    def __init__(self, dim: int, *, eps: float, dtype, rngs: nnx.Rngs):
        self.weight = param(rngs, (dim,), dtype, ("norm",), init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        y = (xf * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return self.weight[...] * y


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (the indexer's k_norm, eps 1e-6), computed in f32."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype, rngs: nnx.Rngs):
        self.weight = param(rngs, (dim,), dtype, ("norm",), init="ones")
        self.bias = param(rngs, (dim,), dtype, ("norm",), init="zeros")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _pow_f32(base: float, exponent: np.ndarray) -> np.ndarray:
    """base ** exponent (f32) correctly rounded to f32: computed in float64, rounded once.

    Why: an angle is position x inverse frequency, so a relative error e of a frequency
    becomes an angle error of position x e, growing with context. numpy's f32 `pow` is
    off by one ulp for some exponents (rope 64, theta 1e4: 4 of 32; via YaRN's blend,
    2 ulps of inv_freq), which transformers' and DeepSeek's f32 torch `pow` are not: at
    16K positions that is a 5e-4 rad rotation of those dims on one side only (issue 26,
    docs/journal/2026-12-02.md "Long-context parity")."""
    return (float(base) ** exponent.astype(np.float64)).astype(np.float32)


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [d_rope/2] (f32) and the cos/sin scale (YaRN attention factor).

    YaRN blends interpolated (÷factor) and original frequencies with a linear ramp
    between the dims that complete beta_fast and beta_slow rotations over the original
    context (floored/ceiled, as DeepSeek's reference and transformers do).
    """
    rs = cfg.rope_scaling
    inv_freq = inv_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, rs)
    if rs is None:
        return inv_freq, 1.0
    if rs.mscale and rs.mscale_all_dim:
        att = _yarn_mscale(rs.factor, rs.mscale) / _yarn_mscale(rs.factor, rs.mscale_all_dim)
    else:
        att = _yarn_mscale(rs.factor, 1.0)
    return inv_freq, float(att)


def inv_frequencies(dim: int, base: float, rs: RopeScaling | None) -> np.ndarray:
    """RoPE inverse frequencies [dim/2] (f32) of `dim` rotated dims, YaRN-blended when
    `rs` is set (DeepSeek-V4's "compress" RoPE uses this with its own cos/sin scale)."""
    pos_freqs = _pow_f32(base, np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extra = (1.0 / pos_freqs).astype(np.float32)
    if rs is None:
        return extra
    inter = (1.0 / (rs.factor * pos_freqs)).astype(np.float32)

    def corr_dim(rot: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (rot * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(math.floor(corr_dim(rs.beta_fast)), 0)
    high = min(math.ceil(corr_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)
    return (inter * (1 - keep) + extra * keep).astype(np.float32)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., d_rope/2] in f32 for integer positions [...]."""
    inv_freq, att = rope_frequencies(cfg)
    with jax.named_scope("rope_cos_sin"):
        ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
        return jnp.cos(ang) * att, jnp.sin(ang) * att


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """MLA RoPE: rotates pairs (x0, x1), (x2, x3), ... Output is de-interleaved
    ([all rotated evens | all rotated odds]) like transformers; q and k both use it, so
    q·k is unchanged and the cache stores k_rope in this layout. x [..., s, (h,) d],
    cos/sin [..., s, d/2] broadcast over a head axis when x has one more dim."""
    c, s = _broadcast(cos, sin, x)
    x1, x2 = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    y = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return y.astype(x.dtype)


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Indexer RoPE: non-interleaved (half split, NeoX style) — docs/facts.md §1."""
    c, s = _broadcast(cos, sin, x)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].astype(jnp.float32), x[..., h:].astype(jnp.float32)
    y = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return y.astype(x.dtype)


def _broadcast(cos: jax.Array, sin: jax.Array, x: jax.Array):
    extra = x.ndim - cos.ndim
    if extra < 0:
        raise ValueError(f"rope: x rank {x.ndim} < cos rank {cos.ndim}")
    shape = cos.shape[:-1] + (1,) * extra + cos.shape[-1:]
    return cos.reshape(shape), sin.reshape(shape)
