"""DeepSeek-V3.2 in Flax NNX: decoder blocks, the model, and the MTP (next-n) layer.
The same class runs GLM-5 (`model_type` glm_moe_dsa), whose differences the config
carries (indexer RoPE, per-layer MLP kinds, layers that share the previous top-k).

Every forward step is the same path: `s` new tokens per request are appended to the
cache at positions lengths[b] + t and attend (sparsely) to everything cached so far, so
prefill chunks and decode steps share one code path and never build an [L, L] matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jlco.config import ModelConfig
from jlco.model import kv_cache
from jlco.model.layers import Linear, RMSNorm, dtype_of, param, rope_cos_sin
from jlco.model.mla import MLA
from jlco.model.moe import MLP, Experts, MoE


def use_native_matmuls(model: nnx.Module) -> int:
    """Route every f32 product of at most `jlco.native.MAX_ROWS` rows (a decode step's)
    through the small-M kernel: each `Linear` (and `Fused`), the routed experts and
    MLA's W_UK / W_UV → how many modules changed. For a model on one XLA:CPU device
    whose kernels `jlco.native.load()` built (`jlco.engine.runner.ModelRunner` does
    this, per `engine.cpu_matmul`)."""
    nodes = [n for _, n in nnx.iter_graph(model) if isinstance(n, (Linear, MLA, Experts))]
    changed = [n for n in nodes if not n.native]
    for node in changed:
        node.native = True
    return len(changed)


def fuse_projections(model: nnx.Module) -> int:
    """`MLA.fuse` and `MLP.fuse` (dense FFN, shared experts) every block of `model` in
    place → how many changed. For a model on one XLA:CPU device
    (`jlco.engine.runner.ModelRunner` does this)."""
    nodes = [n for _, n in nnx.iter_graph(model) if isinstance(n, (MLA, MLP))]
    return sum(node.fuse() for node in nodes)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, moe: bool, *, rngs: nnx.Rngs, layer: int = 0):
        dt = dtype_of(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt, rngs=rngs)
        self.self_attn = MLA(cfg, rngs=rngs, layer=layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt,
                                                rngs=rngs)
        self.mlp = (MoE(cfg, rngs=rngs) if moe else
                    MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dt, rngs=rngs))

    def __call__(self, x, cos, sin, cache, layer: int, positions, kernel_lengths, impl: str,
                 topk=None):
        """→ (block output, cache, the top-k positions its attention used: the next
        layer's when that one shares its top-k)."""
        a, cache, topk = self.self_attn(self.input_layernorm(x), cos, sin, cache, layer,
                                        positions, kernel_lengths, impl, topk)
        return self.residual(x, a), cache, topk

    def pre(self, x, cos, sin):
        """Host-driven phase 1: the attention block's token-wise projections
        (`MLA.pre` of the normed input); selection/attention run per micro-batch."""
        return self.self_attn.pre(self.input_layernorm(x), cos, sin)

    def post(self, x, out):
        """Host-driven phase 3: latent attention output [b,s,h,c] → the block output."""
        return self.residual(x, self.self_attn.post(out, x.dtype))

    def residual(self, x, a):
        """x + attention, then + MLP/MoE (shared by `__call__` and `post`)."""
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nnx.Module):
    """The MTP layer's own final norm + LM head (`model.layers.L.shared_head.*`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt = dtype_of(cfg)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt, rngs=rngs)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, axes=("embed", "vocab"), dtype=dt,
                           rngs=rngs)

    def __call__(self, h):
        return self.head(self.norm(h)).astype(jnp.float32)


class MTPLayer(nnx.Module):
    """Multi-token prediction: h' = eh_proj([enorm(emb(next token)) | hnorm(h)]), one MoE
    block over its own cache layer, then the shared head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt = dtype_of(cfg)
        self.enorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt, rngs=rngs)
        self.hnorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt, rngs=rngs)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, axes=(None, "embed"),
                              dtype=dt, rngs=rngs)
        self.block = DecoderLayer(cfg, moe=True, rngs=rngs, layer=cfg.num_hidden_layers)
        self.shared_head = SharedHead(cfg, rngs=rngs)


class DeepseekV32(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt = dtype_of(cfg)
        self.cfg = cfg
        self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), dt, ("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(cfg, cfg.is_moe_layer(i), rngs=rngs, layer=i)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt, rngs=rngs)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, axes=("embed", "vocab"), dtype=dt,
                              rngs=rngs)
        self.mtp = MTPLayer(cfg, rngs=rngs) if cfg.num_nextn_predict_layers == 1 else None

    def embed(self, tokens: jax.Array) -> jax.Array:
        return self.embed_tokens[...][tokens]

    def __call__(self, tokens: jax.Array, cache: kv_cache.DecodeCache,
                 n_new: jax.Array | None = None, *, impl: str = "auto"):
        """tokens [b,s] at positions cache.lengths[b] + t → (final-normed hidden [b,s,d],
        cache with lengths += n_new). n_new [b] ≤ s marks the real tokens of a ragged
        prefill chunk; the rest are padding whose rows land past each request's length."""
        if cache.num_layers < self.cfg.num_hidden_layers:
            raise ValueError(f"cache has {cache.num_layers} layers; model needs "
                             f"{self.cfg.num_hidden_layers}")
        x, cos, sin, positions, kernel_lengths = self.inputs(tokens, cache)
        topk = None     # the last full layer's top-k, for the layers that share it
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                x, cache, topk = layer(x, cos, sin, cache, i, positions, kernel_lengths, impl,
                                       topk)
        return self.finish(x, cache, n_new)

    def finish(self, x: jax.Array, cache: kv_cache.DecodeCache, n_new: jax.Array | None = None):
        """After the last layer: final norm, lengths advanced by n_new [b] (default all s
        tokens) → (final-normed hidden [b,s,d], cache). Shared with the host-driven
        engine, which runs the layers one by one."""
        b, s = x.shape[:2]
        n_new = jnp.full((b,), s, jnp.int32) if n_new is None else n_new
        return self.norm(x), kv_cache.advance(cache, n_new)

    def inputs(self, tokens: jax.Array, cache: kv_cache.DecodeCache):
        """tokens [b,s] → (embeddings [b,s,d], RoPE cos/sin, positions [b,s] =
        lengths[b] + t, kernel lengths [b] = lengths + s): what every layer takes
        (shared with the host-driven engine, which runs the layers one by one)."""
        s = tokens.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]
        cos, sin = rope_cos_sin(self.cfg, positions)
        return self.embed(tokens), cos, sin, positions, cache.lengths + s

    def logits(self, h: jax.Array) -> jax.Array:
        """LM head over final-normed hidden states → f32 logits."""
        return self.lm_head(h).astype(jnp.float32)

    def mtp_logits(self, h: jax.Array, next_tokens: jax.Array, cache: kv_cache.DecodeCache,
                   start: jax.Array, *, impl: str = "auto"):
        """Draft logits from the main model's final-normed hidden h [b,s,d] at positions
        start[b] + t combined with the tokens that follow them, next_tokens [b,s]
        → (draft logits [b,s,V] predicting the token after next, MTP hidden, cache).

        The MTP block keeps its own latent/indexer rows in cache layer num_hidden_layers at
        the same positions (its lengths are implied by `start`, not cache.lengths)."""
        x, cos, sin, positions, kernel_lengths = self.mtp_inputs(h, next_tokens, start)
        with jax.named_scope("mtp"):
            x, cache, _ = self.mtp.block(x, cos, sin, cache, self.cfg.num_hidden_layers,
                                         positions, kernel_lengths, impl)
        return self.mtp.shared_head(x), x, cache

    def mtp_inputs(self, h: jax.Array, next_tokens: jax.Array, start: jax.Array):
        """What the MTP block takes (`mtp_logits` before its block; shared with the
        host-driven engine, which runs the block as phases) → (x [b,s,d], RoPE cos/sin,
        positions [b,s] = start[b] + t, kernel lengths [b] = start + s)."""
        if self.mtp is None:
            raise ValueError("mtp_logits: model has no MTP layer (num_nextn_predict_layers=0)")
        mtp, s = self.mtp, h.shape[1]
        positions = start[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]
        cos, sin = rope_cos_sin(self.cfg, positions)
        e = mtp.enorm(self.embed(next_tokens))
        x = mtp.eh_proj(jnp.concatenate([e, mtp.hnorm(h)], axis=-1))
        return x, cos, sin, positions, start + s
