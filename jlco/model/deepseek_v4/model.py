"""DeepSeek-V4 in Flax NNX: the decoder layer (hyper-connection → attention →
hyper-connection → MoE, on N residual streams) and the model (embedding copied into the N
streams, the hyper head, norm, LM head) with its stateless full-sequence forward;
prefill and decode over a state are `jlco.model.deepseek_v4.state`.

Parameter names follow the checkpoint's (DeepSeek's) names, so
`jlco.checkpoint.deepseek_v4` maps them one to one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jlco.model.deepseek_v4.attention import V4Attention
from jlco.model.deepseek_v4.blocks import HyperConnection, HyperHead, hc_merge
from jlco.model.deepseek_v4.config import V4Config
from jlco.model.deepseek_v4.moe import V4MoE
from jlco.model.layers import Linear, RMSNorm, dtype_of, param

F32 = jnp.float32


class V4DecoderLayer(nnx.Module):
    def __init__(self, cfg: V4Config, layer: int, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.hc_attn = HyperConnection(cfg, rngs=rngs)
        self.attn_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=F32, rngs=rngs)
        self.attn = V4Attention(cfg, layer, rngs=rngs)
        self.hc_ffn = HyperConnection(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=F32, rngs=rngs)
        self.ffn = V4MoE(cfg, cfg.mlp_layer_types[layer] == "hash_moe", rngs=rngs)

    def attn_input(self, streams):
        post, comb, x = self.hc_attn(streams)
        return post, comb, self.attn_norm(x).astype(streams.dtype)

    def ffn_block(self, streams, tokens):
        post, comb, x = self.hc_ffn(streams)
        y = self.ffn(self.ffn_norm(x).astype(streams.dtype), tokens)
        return hc_merge(streams, y, post, comb)

    def __call__(self, streams: jax.Array, tokens: jax.Array, positions: jax.Array):
        """Full sequence: streams [b, L, N, d] → streams."""
        post, comb, x = self.attn_input(streams)
        streams = hc_merge(streams, self.attn(x, positions), post, comb)
        return self.ffn_block(streams, tokens)


class DeepseekV4(nnx.Module):
    def __init__(self, cfg: V4Config, *, rngs: nnx.Rngs):
        dt, d = dtype_of(cfg), cfg.hidden_size
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, d), dt, ("vocab", "embed"))
        self.layers = nnx.List([V4DecoderLayer(cfg, i, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.hc_head = HyperHead(cfg, rngs=rngs)
        self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=F32, rngs=rngs)
        self.head = Linear(d, cfg.vocab_size, axes=("embed", "vocab"), dtype=dt, rngs=rngs)

    def streams(self, tokens: jax.Array) -> jax.Array:
        """tokens [b, s] → the embedding copied into the N streams [b, s, N, d]."""
        x = self.embed[...][tokens]
        return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], self.cfg.hc_mult, x.shape[-1]))

    def logits(self, streams: jax.Array) -> jax.Array:
        h = self.norm(self.hc_head(streams)).astype(streams.dtype)
        return self.head(h).astype(F32)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [b, L] from position 0, no state → logits [b, L, V] f32."""
        b, L = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (b, L))
        streams = self.streams(tokens)
        for layer in self.layers:
            streams = layer(streams, tokens, positions)
        return self.logits(streams)
