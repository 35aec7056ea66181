"""DeepSeek-V4's MoE block: every layer routes (no dense layers). `moe` layers pick the
top-k of sqrt(softplus(logits)) (or sigmoid) plus a correction bias, no expert groups;
`hash_moe` layers take the experts from a frozen token-id table (`tid2eid`) and only
weight them by the learned gate. Routed and shared experts clamp SwiGLU's inputs at
swiglu_limit. The routed experts are jlco's `Experts` (grouped / per-expert / dense
dispatch) with the clamped activation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jlco.model.deepseek_v4.config import V4Config
from jlco.model.layers import dtype_of, param
from jlco.model.moe import MLP, Experts
from jlco.parallel import expert as expert_parallel

F32 = jnp.float32


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, limit)) · clip(up, ±limit)."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


class ClampedExperts(Experts):
    def __init__(self, cfg: V4Config, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.limit = cfg.swiglu_limit

    def act(self, gate, up):
        return clamped_swiglu(gate, up, self.limit)

    def __call__(self, x, w, ids):
        if expert_parallel.parallel_size() > 1 and not self.per_expert:
            return expert_parallel.experts_parallel(
                x, w, ids, self.gate_proj[...], self.up_proj[...], self.down_proj[...],
                act=self.act)
        return super().__call__(x, w, ids)


class ClampedMLP(MLP):
    def __init__(self, d: int, inter: int, limit: float, *, dtype, rngs: nnx.Rngs):
        super().__init__(d, inter, dtype=dtype, rngs=rngs)
        self.limit = limit

    def act(self, gate, up):
        return clamped_swiglu(gate, up, self.limit)


class V4Router(nnx.Module):
    """Gate weight [d, E]; `bias` (moe) steers selection only; `tid2eid` [V, k] (hash)."""

    def __init__(self, cfg: V4Config, hashed: bool, *, rngs: nnx.Rngs):
        self.cfg, self.hashed = cfg, hashed
        e = cfg.n_routed_experts
        self.weight = param(rngs, (cfg.hidden_size, e), dtype_of(cfg), ("embed", None))
        if hashed:   # random: k distinct experts per token id (a checkpoint's replace it)
            draw = jax.random.uniform(rngs.params(), (cfg.vocab_size, e))
            table = jnp.argsort(draw, axis=-1)[:, :cfg.num_experts_per_tok].astype(jnp.int32)
            self.tid2eid = nnx.Param(table, out_sharding=(None, None), eager_sharding=False)
        else:
            self.bias = param(rngs, (e,), F32, (None,), init="zeros")

    def __call__(self, x: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [n, d], tokens [n] → (weights [n, k] f32, expert ids [n, k] int32)."""
        cfg = self.cfg
        with jax.named_scope("v4_router"):
            w = self.weight[...]
            logits = jnp.einsum("nd,de->ne", x.astype(w.dtype), w).astype(F32)
            if cfg.scoring_func == "sqrtsoftplus":
                scores = jnp.sqrt(jax.nn.softplus(logits))
            else:
                scores = jax.nn.sigmoid(logits)
            if self.hashed:
                ids = self.tid2eid[...][tokens]
            else:
                _, ids = jax.lax.top_k(scores + self.bias[...], cfg.num_experts_per_tok)
            picked = jnp.take_along_axis(scores, ids, axis=1)
            picked = picked / (jnp.sum(picked, axis=-1, keepdims=True) + 1e-20)
            return picked * cfg.routed_scaling_factor, ids.astype(jnp.int32)


class V4MoE(nnx.Module):
    def __init__(self, cfg: V4Config, hashed: bool, *, rngs: nnx.Rngs):
        self.gate = V4Router(cfg, hashed, rngs=rngs)
        self.experts = ClampedExperts(cfg, rngs=rngs)
        self.shared_experts = ClampedMLP(cfg.hidden_size, cfg.moe_intermediate_size,
                                         cfg.swiglu_limit, dtype=dtype_of(cfg), rngs=rngs)

    def __call__(self, x: jax.Array, tokens: jax.Array) -> jax.Array:
        """x [b, s, d], tokens [b, s] → [b, s, d]."""
        with jax.named_scope("v4_moe"):
            flat = x.reshape(-1, x.shape[-1])
            w, ids = self.gate(flat, tokens.reshape(-1))
            y = self.experts(flat, w, ids).reshape(x.shape)
            return y + self.shared_experts(x)
