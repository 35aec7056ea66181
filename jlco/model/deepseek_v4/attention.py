"""DeepSeek-V4 attention: one shared key/value head of width D (K = V), a sliding window
of W raw tokens, plus per layer type compressed entries — CSA: one entry per m tokens
pooled over an overlapping 2m window, of which the lightning indexer picks top-k per
query; HCA: one entry per m' tokens, all attended. One softmax over every key and a
learned per-head sink; the output's rope slice is rotated back by the query position,
then the grouped output projection (docs/facts.md §7).

Letters: b batch, s queries, L sequence, H heads, D head_dim, T compressed entries,
k picks, g o_groups, m rate, c compressor width (D, or D_I for the indexer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jlco.model.deepseek_v4.blocks import cos_sin, rms_unweighted, rope_tail, rope_table
from jlco.model.deepseek_v4.config import CSA, HCA, V4Config
from jlco.model.layers import Linear, RMSNorm, dtype_of, param

F32 = jnp.float32
NEG_INF = float("-inf")


class Compressor(nnx.Module):
    """Pools every `rate` tokens into one entry: softmax over the window's slots (per
    channel, f32) of gate + learned position bias, weighting the projected values,
    then RMSNorm and RoPE ("compress") at the window's first position. `overlap` (CSA
    and the indexer): the projections are 2c wide, [Ca | Cb]; entry i pools window
    i−1's Ca slots with window i's Cb slots (2·rate slots)."""

    def __init__(self, cfg: V4Config, width: int, rate: int, overlap: bool, *,
                 rngs: nnx.Rngs):
        out = 2 * width if overlap else width
        dt = dtype_of(cfg)
        self.width, self.rate, self.overlap = width, rate, overlap
        self.wkv = Linear(cfg.hidden_size, out, axes=("embed", None), dtype=dt, rngs=rngs)
        self.wgate = Linear(cfg.hidden_size, out, axes=("embed", None), dtype=dt, rngs=rngs)
        self.ape = param(rngs, (rate, out), F32, (None, None), init="zeros")
        self.norm = RMSNorm(width, eps=cfg.rms_norm_eps, dtype=F32, rngs=rngs)
        self.cfg = cfg

    @property
    def rope(self):
        return rope_table(self.cfg, CSA)

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [b, s, d] at positions [b, s] → values [b, s, out], gates [b, s, out] f32
        (the position bias of each token's slot in its window added)."""
        bias = self.ape[...][positions % self.rate]
        return self.wkv(x), self.wgate(x).astype(F32) + bias

    def pool(self, kv: jax.Array, gate: jax.Array, first: jax.Array) -> jax.Array:
        """kv / gate [.., slots, c] → entries [.., c], RoPE'd at positions `first` [..]."""
        probs = jax.nn.softmax(gate, axis=-2).astype(kv.dtype)
        pooled = jnp.sum(kv * probs, axis=-2)
        e = self.norm(pooled).astype(kv.dtype)
        cos, sin = cos_sin(self.rope, first)
        return rope_tail(e, cos, sin)

    def windows(self, kv: jax.Array, gate: jax.Array) -> jax.Array:
        """All complete windows of a sequence from position 0 (at least one): kv / gate
        [b, L, o] → entries [b, L // rate, c]; window 0's Ca slots are empty (zero
        value, −inf gate)."""
        b, L, out = kv.shape
        n, m, c = L // self.rate, self.rate, self.width
        kv = kv[:, :n * m].reshape(b, n, m, out)
        gate = gate[:, :n * m].reshape(b, n, m, out)
        if self.overlap:
            empty_kv = jnp.zeros((b, 1, m, c), kv.dtype)
            empty_gate = jnp.full((b, 1, m, c), NEG_INF, F32)
            ca_kv = jnp.concatenate([empty_kv, kv[:, :-1, :, :c]], axis=1)
            ca_gate = jnp.concatenate([empty_gate, gate[:, :-1, :, :c]], axis=1)
            kv = jnp.concatenate([ca_kv, kv[..., c:]], axis=2)
            gate = jnp.concatenate([ca_gate, gate[..., c:]], axis=2)
        first = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * m, (b, n))
        return self.pool(kv, gate, first)


class Indexer(nnx.Module):
    """CSA's lightning indexer: its own overlapping compressor at D_I gives the keys;
    score(p, i) = Σ_h w_h · ReLU(q_h · K_i) · D_I^−½, w = weights_proj(x) · H_I^−½."""

    def __init__(self, cfg: V4Config, *, rngs: nnx.Rngs):
        dt = dtype_of(cfg)
        self.cfg = cfg
        self.compressor = Compressor(cfg, cfg.index_head_dim, cfg.compress_rate_csa, True,
                                     rngs=rngs)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim,
                           axes=("q_lora", "index_heads"), dtype=dt, rngs=rngs)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, axes=("embed", None),
                                   dtype=dt, rngs=rngs)

    def queries(self, x, qr, cos, sin) -> tuple[jax.Array, jax.Array]:
        """→ q [b, s, H_I, D_I] (RoPE'd, f32), w [b, s, H_I] f32."""
        cfg = self.cfg
        b, s, _ = x.shape
        q = self.wq_b(qr).reshape(b, s, cfg.index_n_heads, cfg.index_head_dim)
        w = self.weights_proj(x).astype(F32) * cfg.index_n_heads ** -0.5
        return rope_tail(q, cos, sin).astype(F32), w

    def scores(self, q: jax.Array, w: jax.Array, keys: jax.Array) -> jax.Array:
        """q [b, s, H, c], w [b, s, H], keys [b, T, c] → [b, s, T] f32."""
        dots = jnp.einsum("bshc,btc->bsht", q, keys.astype(F32))
        dots = jax.nn.relu(dots) * self.cfg.index_head_dim ** -0.5
        return jnp.einsum("bsht,bsh->bst", dots, w)


def topk_picks(scores: jax.Array, valid: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k of scores [b, s, T] among the valid entries → (ids [b, s, k], ok [b, s, k]):
    picks past the valid ones (fewer than k) are not ok."""
    top, ids = jax.lax.top_k(jnp.where(valid, scores, NEG_INF), k)
    ok = jnp.take_along_axis(valid, ids, axis=-1) & (top > NEG_INF)
    return ids, ok


def attend(q: jax.Array, parts, sink: jax.Array, scale: float) -> jax.Array:
    """One softmax over several key sets plus a per-head sink logit (dropped after).
    q [b, s, H, D]; each part (keys, ok): keys [b, K, D] shared by the queries or
    [b, s, K, D] per query, ok [b, s, K] bool. Keys are the values (K = V). → [b, s, H, D]."""
    logits = []
    for keys, ok in parts:
        sub = "bshd,bkd->bshk" if keys.ndim == 3 else "bshd,bskd->bshk"
        lg = jnp.einsum(sub, q.astype(F32), keys.astype(F32)) * scale
        logits.append(jnp.where(ok[:, :, None, :], lg, NEG_INF))
    b, s, h, _ = q.shape
    sinks = jnp.broadcast_to(sink.astype(F32)[None, None, :, None], (b, s, h, 1))
    probs = jax.nn.softmax(jnp.concatenate(logits + [sinks], axis=-1), axis=-1)
    out, start = 0.0, 0
    for (keys, _), lg in zip(parts, logits):
        p = probs[..., start:start + lg.shape[-1]]
        start += lg.shape[-1]
        sub = "bshk,bkd->bshd" if keys.ndim == 3 else "bshk,bskd->bshd"
        out = out + jnp.einsum(sub, p, keys.astype(F32))
    return out.astype(q.dtype)


class V4Attention(nnx.Module):
    def __init__(self, cfg: V4Config, layer: int, *, rngs: nnx.Rngs):
        dt, d, h, dh = dtype_of(cfg), cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        g = cfg.o_groups
        self.cfg, self.kind = cfg, cfg.layer_types[layer]
        self.wq_a = Linear(d, cfg.q_lora_rank, axes=("embed", "q_lora"), dtype=dt, rngs=rngs)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps, dtype=F32, rngs=rngs)
        self.wq_b = Linear(cfg.q_lora_rank, h * dh, axes=("q_lora", "heads"), dtype=dt,
                           rngs=rngs)
        self.wkv = Linear(d, dh, axes=("embed", None), dtype=dt, rngs=rngs)
        self.norm = RMSNorm(dh, eps=cfg.rms_norm_eps, dtype=F32, rngs=rngs)
        self.wo_a = param(rngs, (g, h * dh // g, cfg.o_lora_rank), dt, (None, "heads", None))
        self.wo_b = Linear(g * cfg.o_lora_rank, d, axes=(None, "embed"), dtype=dt, rngs=rngs)
        self.attn_sink = param(rngs, (h,), F32, ("heads",), init="zeros")
        compressor = indexer = None
        if self.kind == CSA:
            compressor = Compressor(cfg, dh, cfg.compress_rate_csa, True, rngs=rngs)
            indexer = Indexer(cfg, rngs=rngs)
        elif self.kind == HCA:
            compressor = Compressor(cfg, dh, cfg.compress_rate_hca, False, rngs=rngs)
        self.compressor, self.indexer = nnx.data(compressor), nnx.data(indexer)

    @property
    def rope(self):
        return rope_table(self.cfg, self.kind)

    def project(self, x: jax.Array, positions: jax.Array):
        """x [b, s, d] at positions [b, s] → q [b, s, H, D], kv [b, s, D] (both RoPE'd),
        qr [b, s, q_lora] (the indexer's query input), (cos, sin)."""
        cfg = self.cfg
        b, s, _ = x.shape
        cos, sin = cos_sin(self.rope, positions)
        qr = self.q_norm(self.wq_a(x)).astype(x.dtype)
        q = self.wq_b(qr).reshape(b, s, cfg.num_attention_heads, cfg.head_dim)
        q = rope_tail(rms_unweighted(q, cfg.rms_norm_eps), cos, sin)
        kv = rope_tail(self.norm(self.wkv(x)).astype(x.dtype), cos, sin)
        return q, kv, qr, (cos, sin)

    def output(self, o: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """o [b, s, H, D] → [b, s, d]: the rope slice rotated back by the query position,
        then the grouped projection (group j: heads j·H/g …) and wo_b."""
        b, s = o.shape[:2]
        o = rope_tail(o, cos, -sin).reshape(b, s, self.cfg.o_groups, -1)
        w = self.wo_a[...]
        grouped = jnp.einsum("bsgi,gio->bsgo", o.astype(w.dtype), w)
        return self.wo_b(grouped.reshape(b, s, -1))

    def attend(self, q, parts):
        return attend(q, parts, self.attn_sink[...], self.cfg.head_dim ** -0.5)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Full sequence from position 0, no state: x [b, L, d] → [b, L, d]. The plain
        form of `jlco.model.deepseek_v4.state.attention_chunk` (which equals it)."""
        cfg = self.cfg
        b, L, _ = x.shape
        q, kv, qr, (cos, sin) = self.project(x, positions)
        pos = jnp.arange(L)
        band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - cfg.sliding_window)
        parts = [(kv, jnp.broadcast_to(band, (b, L, L)))]
        if self.compressor is not None and L >= self.compressor.rate:
            entries = self.compressor.windows(*self.compressor.project(x, positions))
            n = entries.shape[1]
            visible = jnp.arange(n) < ((positions + 1) // self.compressor.rate)[..., None]
            if self.indexer is not None:
                ic = self.indexer.compressor
                keys = ic.windows(*ic.project(x, positions))
                iq, w = self.indexer.queries(x, qr, cos, sin)
                ids, ok = topk_picks(self.indexer.scores(iq, w, keys), visible,
                                     min(cfg.index_topk, n))
                b_i, s_i = jnp.indices(ids.shape[:2])
                visible = jnp.zeros(visible.shape, bool).at[
                    b_i[..., None], s_i[..., None], ids].max(ok)
            parts.append((entries, visible))
        return self.output(self.attend(q, parts), cos, sin)
