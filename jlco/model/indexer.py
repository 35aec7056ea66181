"""Lightning indexer (DSA): scores every cached token per query, keeps the top-k.

docs/facts.md §1: q = wq_b(qr), k = LayerNorm(wk(x)); both split [rope | nope] (rope FIRST,
unlike MLA) with non-interleaved RoPE; weights = weights_proj(x) · H^-0.5 · D^-0.5;
score = Σ_h w_h · ReLU(q_h · k). GLM-5 (glm_moe_dsa) rotates the same rope slice with
interleaved RoPE instead (docs/facts.md §6). With `cfg.indexer_fp8` the deployed numerics
are emulated: Hadamard-rotate q and k, round both through e4m3 with UE8M0 scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jlco.config import ModelConfig
from jlco.model import attention, fp8_emul, kv_cache
from jlco.model.layers import (
    LayerNorm,
    Linear,
    apply_rope_half,
    apply_rope_interleaved,
    dtype_of,
)


class Indexer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt = dtype_of(cfg)
        h, d = cfg.index_n_heads, cfg.index_head_dim
        self.cfg = cfg
        self.wq_b = Linear(cfg.q_lora_rank, h * d, axes=("q_lora", "index_heads"), dtype=dt,
                           rngs=rngs)
        self.wk = Linear(cfg.hidden_size, d, axes=("embed", None), dtype=dt, rngs=rngs)
        self.k_norm = LayerNorm(d, eps=1e-6, dtype=dt, rngs=rngs)
        # f32 like the released checkpoint / transformers (_keep_in_fp32_modules).
        self.weights_proj = Linear(cfg.hidden_size, h, axes=("embed", None), dtype=jnp.float32,
                                   rngs=rngs)

    def project(self, x: jax.Array, qr: jax.Array, cos: jax.Array, sin: jax.Array,
                q=None, k=None, w=None):
        """→ q [b,s,H,D], k [b,s,D] (RoPE'd, emulated-fp8 if enabled), weights [b,s,H].
        q / k / w given: wq_b(qr) / wk(x) / weights_proj(x) already computed (by a
        `layers.Fused` of the MLA layer, whose own weights then are None)."""
        cfg, r = self.cfg, self.cfg.qk_rope_head_dim
        b, s, _ = x.shape
        with jax.named_scope("indexer_project"):
            q = self.wq_b(qr) if q is None else q
            q = q.reshape(b, s, cfg.index_n_heads, cfg.index_head_dim)
            k = self.k_norm(self.wk(x) if k is None else k)
            rope = apply_rope_interleaved if cfg.indexer_rope_interleaved else apply_rope_half
            q = jnp.concatenate([rope(q[..., :r], cos, sin), q[..., r:]], axis=-1)
            k = jnp.concatenate([rope(k[..., :r], cos, sin), k[..., r:]], axis=-1)
            if cfg.indexer_fp8:
                block = fp8_emul.indexer_block(cfg.index_head_dim)
                q = fp8_emul.fp8_roundtrip(fp8_emul.hadamard_rotate(q), block)
                k = fp8_emul.fp8_roundtrip(fp8_emul.hadamard_rotate(k), block)
            scale = (cfg.index_n_heads ** -0.5) * (cfg.index_head_dim ** -0.5)
            w = (self.weights_proj(x.astype(jnp.float32)) if w is None else w) * scale
        return q, k, w

    def topk(self, q, w, keys, k_scale, kernel_lengths, key_format: str, impl: str,
             fresh=None):
        """Top-k positions [b,s,topk] (−1 pad) of queries q/w over cached keys [b,t,D]
        (and `fresh` ones, `attention.indexer_topk`). Separate from `__call__` so the
        host-driven engine can run selection per micro-batch (every request's top-k
        depends on its own keys only)."""
        idx, _ = attention.indexer_topk(q, w, keys, kernel_lengths, self.cfg.index_topk,
                                        k_scale=k_scale, key_format=key_format, impl=impl,
                                        fresh=fresh)
        return idx

    def __call__(self, x, qr, cos, sin, cache: kv_cache.DecodeCache, layer: int,
                 positions: jax.Array, kernel_lengths: jax.Array, impl: str):
        """Append this step's keys to the cache, then top-k positions [b,s,topk] (−1 pad)."""
        q, k, w = self.project(x, qr, cos, sin)
        cache = kv_cache.write_index_key(cache, layer, k, positions)
        keys, scale = kv_cache.index_keys(cache, layer)
        return self.topk(q, w, keys, scale, kernel_lengths, cache.key_format, impl), cache
