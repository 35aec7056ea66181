"""Merging two partial attentions by their log-sum-exp.

Attention of the same queries over two disjoint sets of rows A and B, each normalised
over its own set (out_A = Σ_A p·v / Σ_A p, lse_A = log Σ_A p with p = exp(score)),
combines into the attention over A ∪ B:

  lse = log(exp(lse_A) + exp(lse_B)),  out = exp(lse_A − lse)·out_A + exp(lse_B − lse)·out_B

(the split-k combine of FlashAttention / FlashMLA). The host-driven engine uses it for
the hit/miss split (`cache.split_attention`): the resident rows are attended while the
misses transfer, then the fetched ones, and the two merged here.

Convention of `sparse_mla` (FlashMLA's): a query with no valid row has out 0 and
lse = +inf, so +inf here means "empty part" (weight 0), not an infinite mass. One empty
part returns the other part's out and lse unchanged, bit for bit; both empty gives
out 0, lse +inf. Shapes: out [..., d], lse [...] (f32); the merge runs in f32 and
returns out in out_a's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def merge_by_lse(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array,
                 lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two partial attentions (out [..., d], lse [...]) over disjoint row sets → the
    attention over their union (out, lse), the +inf-for-empty convention kept."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape \
            or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"merge_by_lse: shapes out {out_a.shape} / {out_b.shape}, lse "
                         f"{lse_a.shape} / {lse_b.shape}: allowed out [..., d] twice and "
                         "lse [...] (out's leading dims) twice")
    la = jnp.where(jnp.isposinf(lse_a), -jnp.inf, lse_a.astype(jnp.float32))
    lb = jnp.where(jnp.isposinf(lse_b), -jnp.inf, lse_b.astype(jnp.float32))
    m = jnp.maximum(la, lb)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = jnp.exp(la - m), jnp.exp(lb - m)          # exp(-inf) = 0: an empty part
    total = wa + wb
    empty = total == 0.0
    safe = jnp.where(empty, 1.0, total)
    out = (wa[..., None] * out_a.astype(jnp.float32)
           + wb[..., None] * out_b.astype(jnp.float32)) / safe[..., None]
    lse = jnp.where(empty, jnp.inf, m + jnp.log(safe))
    return jnp.where(empty[..., None], 0.0, out).astype(out_a.dtype), lse
