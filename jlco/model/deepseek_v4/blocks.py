"""DeepSeek-V4's small pieces: its two RoPEs (interleaved pairs on the *last* r dims, in
place), the weightless RMSNorm, and the manifold-constrained hyper-connections (N
residual streams mixed by a Sinkhorn-normalised matrix) with the hyper head.

Letters (docs/facts.md §7): b batch, s tokens, N hc_mult streams, d hidden, r rope dims.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.model.deepseek_v4.config import SLIDING, V4Config
from jlco.model.layers import inv_frequencies, param

F32 = jnp.float32


def rope_table(cfg: V4Config, layer_type: str) -> tuple[np.ndarray, float]:
    """(inverse frequencies [r/2], cos/sin scale) of a layer type's RoPE: "main"
    (rope_theta, never YaRN) for sliding_attention, "compress" (compress_rope_theta,
    YaRN if configured) for CSA / HCA, their compressors and the indexer."""
    r = cfg.qk_rope_head_dim
    if layer_type == SLIDING:
        return inv_frequencies(r, cfg.rope_theta, None), 1.0
    scale = cfg.rope_attention_factor if cfg.rope_scaling is not None else 1.0
    return inv_frequencies(r, cfg.compress_rope_theta, cfg.rope_scaling), scale


def cos_sin(table: tuple[np.ndarray, float], positions: jax.Array):
    """cos, sin [..., r/2] f32 at integer positions [...]."""
    inv_freq, scale = table
    ang = positions.astype(F32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(ang) * scale, jnp.sin(ang) * scale


def rope_tail(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the interleaved pairs (x0, x1), (x2, x3), ... of the last 2·cos.shape[-1]
    dims of x, written back in place (layout [nope | rope] kept: V4's values carry the
    rope dims into the output). x [..., s, (h,) D]; cos/sin [..., s, r/2] (a head axis is
    broadcast when x has one more dim). Negate sin to rotate back."""
    r = 2 * cos.shape[-1]
    extra = x.ndim - cos.ndim
    c = cos.reshape(cos.shape[:-1] + (1,) * extra + cos.shape[-1:])
    s = sin.reshape(c.shape)
    rope = x[..., -r:].astype(F32)
    ev, od = rope[..., 0::2], rope[..., 1::2]
    rot = jnp.stack([ev * c - od * s, od * c + ev * s], axis=-1).reshape(rope.shape)
    return jnp.concatenate([x[..., :-r], rot.astype(x.dtype)], axis=-1)


def rms_unweighted(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis (mean of squares in f32), no weight."""
    ms = jnp.mean(jnp.square(x.astype(F32)), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + eps).astype(x.dtype)


class HyperConnection(nnx.Module):
    """One mixing site (before attention, or before the MoE): from the N streams X
    [.., N, d] it computes pre [N] (collapse weights), post [N] (how the block's output
    is spread back) and comb [N, N] (stream mixing, projected towards doubly stochastic
    by Sinkhorn), all in f32. `fn` is stored [N·d, (2+N)·N] (jax layout)."""

    def __init__(self, cfg: V4Config, *, rngs: nnx.Rngs):
        n, d = cfg.hc_mult, cfg.hidden_size
        self.cfg = cfg
        self.fn = param(rngs, (n * d, (2 + n) * n), F32, ("embed", None))
        self.base = param(rngs, ((2 + n) * n,), F32, (None,), init="zeros")
        self.scale = param(rngs, (3,), F32, (None,), init="ones")

    def __call__(self, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """streams [.., N, d] → (post [.., N], comb [.., N, N], collapsed [.., d])."""
        cfg, n = self.cfg, self.cfg.hc_mult
        with jax.named_scope("hyper_connection"):
            flat = rms_unweighted(streams.reshape(*streams.shape[:-2], -1).astype(F32),
                                  cfg.rms_norm_eps)
            y = jnp.einsum("...i,io->...o", flat, self.fn[...])
            base, scale = self.base[...], self.scale[...]
            pre = jax.nn.sigmoid(y[..., :n] * scale[0] + base[:n]) + cfg.hc_eps
            post = 2 * jax.nn.sigmoid(y[..., n:2 * n] * scale[1] + base[n:2 * n])
            logits = (y[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*y.shape[:-1], n, n)
            comb = sinkhorn(jax.nn.softmax(logits, axis=-1) + cfg.hc_eps,
                            cfg.hc_sinkhorn_iters, cfg.hc_eps)
            collapsed = jnp.einsum("...n,...nd->...d", pre, streams.astype(F32))
            return post, comb, collapsed.astype(streams.dtype)


def sinkhorn(comb: jax.Array, iters: int, eps: float) -> jax.Array:
    """Columns normalised, then iters − 1 rounds of rows then columns (the reference's
    order: 20 iterations = 1 + 19 rounds)."""
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps)
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    return comb


def hc_merge(streams: jax.Array, block_out: jax.Array, post: jax.Array,
             comb: jax.Array) -> jax.Array:
    """New streams X'_k = post_k · out + Σ_j comb[j, k] · X_j (combᵀ·X: comb is not
    symmetric), in the streams' dtype."""
    dt = streams.dtype
    mixed = jnp.einsum("...jk,...jd->...kd", comb.astype(dt), streams)
    return post.astype(dt)[..., None] * block_out.astype(dt)[..., None, :] + mixed


class HyperHead(nnx.Module):
    """The final collapse of the N streams before the model norm and the LM head:
    weights sigmoid(f · fn · scale + base) + hc_eps, no mixing matrix."""

    def __init__(self, cfg: V4Config, *, rngs: nnx.Rngs):
        n, d = cfg.hc_mult, cfg.hidden_size
        self.cfg = cfg
        self.fn = param(rngs, (n * d, n), F32, ("embed", None))
        self.base = param(rngs, (n,), F32, (None,), init="zeros")
        self.scale = param(rngs, (1,), F32, (None,), init="ones")

    def __call__(self, streams: jax.Array) -> jax.Array:
        flat = rms_unweighted(streams.reshape(*streams.shape[:-2], -1).astype(F32),
                              self.cfg.rms_norm_eps)
        mix = jnp.einsum("...i,io->...o", flat, self.fn[...])
        pre = jax.nn.sigmoid(mix * self.scale[...] + self.base[...]) + self.cfg.hc_eps
        return jnp.einsum("...n,...nd->...d", pre, streams.astype(F32)).astype(streams.dtype)
