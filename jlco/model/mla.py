"""Multi-head latent attention (MLA) in the absorbed form over the sparse top-k rows.

Only the latent row [c (kv_lora_rank) | k_rope] is cached. q_nope is absorbed into the
latent space by W_UK (the nope half of kv_b_proj), attention runs over the selected
rows, and W_UV (the value half) maps the latent output back to heads (docs/facts.md §1).
A layer that shares its top-k (IndexShare, `ModelConfig.shares_topk`) has no indexer: it
attends over the positions the last full layer before it selected, and (offloaded) over
the hot-buffer slots that layer's plan put them in: the full layer fetched the group's
rows, so a shared layer plans and fetches nothing (`offload.latent`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jlco import native
from jlco.config import ModelConfig
from jlco.model import attention, kv_cache
from jlco.model.indexer import Indexer
from jlco.model.layers import Fused, Linear, RMSNorm, apply_rope_interleaved, dtype_of, param

# q_a_layernorm / kv_a_layernorm eps: fixed, not config.rms_norm_eps, as transformers'
# DeepseekV32 and GlmMoeDsa and DeepSeek's reference build them (GLM-5's rms_norm_eps is
# 1e-5; docs/facts.md §6).
LATENT_NORM_EPS = 1e-6


class Selected(NamedTuple):
    """What a full layer's attention read: top-k positions [b,s,k] and the row ids
    [b,s,k] sparse MLA addressed them by (None after a dense prefill chunk). The shared
    layers after it (IndexShare) attend over the same."""
    positions: jax.Array
    ids: jax.Array | None


class KVUp(nnx.Module):
    """kv_b_proj, the latent → per-head up-projection, kept as its two halves in the
    layout the absorbed products read: W_UK [h, n, c] (queries into latent space) and
    W_UV [h, v, c] (latent output back to heads), each contiguous with the head axis
    leading. HF's [h·(n+v), c] tensor is exactly this split (`jlco.checkpoint.hf_names`);
    slicing one [c, h·(n+v)] weight instead made XLA:CPU copy and transpose both halves
    every step (25–45 ms of a 70 ms step at hidden 512, 8 heads, c 512, 4 layers)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt, h, c = dtype_of(cfg), cfg.num_attention_heads, cfg.kv_lora_rank
        n, v = cfg.qk_nope_head_dim, cfg.v_head_dim
        # One random draw of the whole [c, h·(n+v)] weight, then split, so a random model
        # built from a seed has the same weights as with the unsplit layout.
        full = param(rngs, (c, h * (n + v)), dt, ("kv_lora", "heads"))[...]
        per_head = full.reshape(c, h, n + v).transpose(1, 2, 0)              # [h, n+v, c]
        axes = dict(out_sharding=("heads", None, "kv_lora"), eager_sharding=False)
        self.w_uk = nnx.Param(per_head[:, :n], **axes)
        self.w_uv = nnx.Param(per_head[:, n:], **axes)


class MLA(nnx.Module):
    native = False      # W_UK / W_UV on the small-M kernel (`Linear.native`)

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        dt, h = dtype_of(cfg), cfg.num_attention_heads
        self.cfg = cfg
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, axes=("embed", "q_lora"),
                               dtype=dt, rngs=rngs)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS, dtype=dt, rngs=rngs)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, axes=("q_lora", "heads"),
                               dtype=dt, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.latent_dim,
                                         axes=("embed", "kv_lora"), dtype=dt, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=LATENT_NORM_EPS, dtype=dt, rngs=rngs)
        self.kv_b_proj = KVUp(cfg, rngs=rngs)
        self.o_proj = Linear(h * cfg.v_head_dim, cfg.hidden_size, axes=("heads", "embed"),
                             dtype=dt, rngs=rngs)
        self.indexer = None if cfg.shares_topk(layer) else Indexer(cfg, rngs=rngs)
        self.x_proj = self.qr_proj = None       # `fuse`

    def fuse(self) -> bool:
        """Run the projections that read the same input as one matmul each
        (`layers.Fused`): q_a | kv_a | indexer wk | indexer weights_proj (the last when
        it has the model's dtype) of x, q_b | indexer wq_b of the normed q latent. The
        separate weights are dropped (held once). For one XLA:CPU device
        (`jlco.engine.runner`); the checkpoint loader and the mesh use the separate form.
        → whether it changed anything (False: already fused)."""
        if self.x_proj is not None:
            return False
        ix = self.indexer
        xs = [self.q_a_proj, self.kv_a_proj_with_mqa]
        qs = [self.q_b_proj]
        if ix is not None:
            xs.append(ix.wk)
            if ix.weights_proj.weight.dtype == ix.wk.weight.dtype:
                xs.append(ix.weights_proj)
                ix.weights_proj = None
            qs.append(ix.wq_b)
            ix.wk = ix.wq_b = None
        self.x_proj, self.qr_proj = nnx.data(Fused(*xs)), nnx.data(Fused(*qs))
        self.q_a_proj = self.kv_a_proj_with_mqa = self.q_b_proj = None
        return True

    def latent(self, x, cos, sin, kv=None):
        """New latent rows [b,s,c+r]: normed c | RoPE'd k_rope (de-interleaved layout);
        kv: kv_a_proj_with_mqa(x) already computed."""
        kv = self.kv_a_proj_with_mqa(x) if kv is None else kv
        c, k_rope = jnp.split(kv, [self.cfg.kv_lora_rank], axis=-1)
        return jnp.concatenate([self.kv_a_layernorm(c), apply_rope_interleaved(k_rope, cos, sin)],
                               axis=-1)

    def queries(self, qr, cos, sin):
        """Absorbed queries [b,s,h,c+r] = [q_nope·W_UK | RoPE(q_rope)]."""
        return self.absorb(*self.head_queries(qr, cos, sin))

    def head_queries(self, qr, cos, sin, q=None):
        """Per-head queries before absorption: q_nope [b,s,h,n], RoPE(q_rope) [b,s,h,r];
        q: q_b_proj(qr) already computed."""
        cfg = self.cfg
        b, s, _ = qr.shape
        q = self.q_b_proj(qr) if q is None else q
        q = q.reshape(b, s, cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_rope = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
        return q_nope, apply_rope_interleaved(q_rope, cos, sin)

    def absorb(self, q_nope, q_rope):
        """Per-head queries → absorbed [b,s,h,c+r]."""
        b, s, h, n = q_nope.shape
        # Head-major [h, b·s, n] × [h, n, c]: a batched product with the queries on the
        # left. Written "bshn,hnc->bshc", XLA:CPU put W_UK on the left and contracted its
        # non-minor axis: 1.8 ms vs 0.13 ms a layer at batch 4 (83 vs 67 µs at batch 1,
        # 7.8 vs 4.0 ms for a 512-token chunk); the same bits.
        qh = jnp.transpose(q_nope.astype(jnp.float32).reshape(b * s, h, n), (1, 0, 2))
        w_uk = self.kv_b_proj.w_uk[...].astype(jnp.float32)
        if self.native and native.supports(qh[0], w_uk):
            q_abs = native.batched(qh, w_uk)
        else:
            q_abs = jnp.einsum("hmn,hnc->hmc", qh, w_uk)
        q_abs = jnp.transpose(q_abs, (1, 0, 2)).reshape(b, s, h, -1)
        return jnp.concatenate([q_abs.astype(q_nope.dtype), q_rope], axis=-1)

    def pre(self, x, cos, sin):
        """Token-wise projections of one step (no cache access) → (latent rows
        [b,s,c+r], absorbed queries [b,s,h,c+r], indexer q [b,s,H,D], indexer key [b,s,D],
        indexer weights [b,s,H]); the three indexer values are None in a layer that shares
        its top-k. The host-driven engine runs this phase on the whole batch, then
        selection and attention per micro-batch, so each phase is shared with `__call__`
        and both paths compute the same bits."""
        latent, heads, iq, ik, iw = self.projections(x, cos, sin)
        return latent, self.absorb(*heads), iq, ik, iw

    def projections(self, x, cos, sin):
        """`pre` with the queries per head, not yet absorbed ((q_nope, q_rope))."""
        # Fused (`fuse`): x → q_a | kv_a [| wk [| weights_proj]], qr → q_b [| wq_b].
        k = w = q = iq = None
        if self.x_proj is None:
            qa, kv = self.q_a_proj(x), None
        else:
            qa, kv, k, w = (*self.x_proj(x), None, None)[:4]
        qr = self.q_a_layernorm(qa)
        if self.qr_proj is not None:
            q, iq = (*self.qr_proj(qr), None)[:2]
        heads = self.head_queries(qr, cos, sin, q)
        if self.indexer is None:
            return self.latent(x, cos, sin, kv), heads, None, None, None
        iq, ik, iw = self.indexer.project(x, qr, cos, sin, q=iq, k=k, w=w)
        return self.latent(x, cos, sin, kv), heads, iq, ik, iw

    def attend(self, q, rows, ids, kv_format: str, impl: str):
        """Sparse MLA over byte rows [n, R] addressed by ids [b,s,k] → latent-space
        output [b,s,h,c] (per request: the host-driven engine calls it per micro-batch)."""
        out, _ = attention.sparse_mla(q, rows, ids, self.cfg.softmax_scale, kv_format=kv_format,
                                      d_rope=self.cfg.qk_rope_head_dim, impl=impl)
        return out

    def post(self, out, dtype):
        """Latent-space attention output [b,s,h,c] → W_UV → o_proj → [b,s,d]."""
        out, w_uv = out.astype(jnp.float32), self.kv_b_proj.w_uv[...].astype(jnp.float32)
        b, s, h, c = out.shape
        if self.native and native.supports(out[:, :, 0], w_uv):
            # Head-major rows [h, b·s, c] against W_UV as stored ([h, v, c]: nt).
            oh = native.batched(jnp.transpose(out.reshape(b * s, h, c), (1, 0, 2)), w_uv,
                                transposed=True)
            o = jnp.transpose(oh, (1, 0, 2)).reshape(b, s, h, -1)
        else:
            o = jnp.einsum("bshc,hvc->bshv", out, w_uv)
        return self.out(o, dtype)

    def out(self, o, dtype):
        """Per-head attention output [b,s,h,v] → o_proj → [b,s,d]."""
        b, s = o.shape[:2]
        return self.o_proj(o.reshape(b, s, -1).astype(dtype))

    def dense(self, heads, rows, positions_k, kv_format: str, dtype):
        """A prefill chunk's attention over its request's whole layer of rows [b,t,row]
        (each query masked to its top-k), from its per-head queries (q_nope, q_rope), in
        whichever form costs fewer FLOPs for the chunk (`attention.heads_cheaper`) →
        [b,s,d]."""
        cfg = self.cfg
        kw = dict(kv_format=kv_format, d_rope=cfg.qk_rope_head_dim)
        q_nope, q_rope = heads
        if not attention.heads_cheaper(q_nope.shape[1], cfg.kv_lora_rank,
                                       cfg.qk_nope_head_dim, cfg.v_head_dim):
            out = attention.sparse_mla_dense(self.absorb(q_nope, q_rope), rows, positions_k,
                                             cfg.softmax_scale, **kw)
            return self.post(out, dtype)
        o = attention.mla_dense_heads(q_nope, q_rope, rows, positions_k,
                                      self.kv_b_proj.w_uk[...], self.kv_b_proj.w_uv[...],
                                      cfg.softmax_scale, **kw)
        return self.out(o, dtype)

    def write(self, cache: kv_cache.DecodeCache, layer, key_layer, latent, ik, positions):
        """This step's new latent rows [b,s,c+r] and indexer keys [b,s,D] into the cache
        at positions [b,s] (`key_layer`: the keys' layer index, 0 in a `layer_view`;
        ik None: no keys to write — a layer that shares its top-k caches none, and
        `__call__` writes them after selection where `attention.fresh_keys_first`)."""
        cache = kv_cache.write_latent(cache, layer, latent, positions,
                                      shared=self.indexer is None)
        if ik is None:
            return cache
        return kv_cache.write_index_key(cache, key_layer, ik, positions)

    def select(self, cache: kv_cache.DecodeCache, key_layer, iq, iw, kernel_lengths, impl: str,
               ik=None, positions=None):
        """The indexer's top-k positions [b,s,k] over the cached keys of `key_layer`. With
        `ik` (this step's keys [b,s,D] at positions [b,s]) where
        `attention.fresh_keys_first`: those positions are scored from `ik`, written to the
        cache or not; elsewhere the cache must hold them."""
        keys, scale = kv_cache.index_keys(cache, key_layer)
        fresh = None
        if ik is not None and attention.fresh_keys_first(impl, iq.shape[1]):
            fresh = kv_cache.fresh_index_keys(cache, key_layer, ik, positions)
        return self.indexer.topk(iq, iw, keys, scale, kernel_lengths, cache.key_format, impl,
                                 fresh)

    def __call__(self, x, cos, sin, cache: kv_cache.DecodeCache, layer: int,
                 positions, kernel_lengths, impl: str, topk=None):
        """One MLA block of a step: `projections` (`pre`, queries per head), `write`,
        `select` (or, in a layer that shares its top-k, the previous full layer's
        `topk`), then the selected rows
        (`kv_cache.latent_for_attention`: offloaded, misses fetched in the jit), `attend`
        and `post` → (output, cache, `Selected`: the top-k positions [b,s,k] used and
        the row ids they were read by, which a following shared layer reuses). The
        host-driven engine runs the same methods as separate phases."""
        with jax.named_scope("mla"):
            latent, heads, iq, ik, iw = self.projections(x, cos, sin)
            # Keys scored before they are written (`attention.fresh_keys_first`), the
            # write then ordered after the read (`write_index_key`'s `after`).
            first = ik is not None and attention.fresh_keys_first(impl, x.shape[1])
            cache = self.write(cache, layer, layer, latent, None if first else ik, positions)
            shared_ids = None
            if self.indexer is not None:
                positions_k = self.select(cache, layer, iq, iw, kernel_lengths, impl,
                                          ik, positions)
                if first:
                    cache = kv_cache.write_index_key(cache, layer, ik, positions,
                                                     after=positions_k)
            elif topk is None:
                raise ValueError(f"layer {layer} shares its top-k (indexer_types) but no "
                                 "earlier full layer's top-k was given")
            else:
                positions_k, shared_ids = topk
            dense = kv_cache.dense_rows(cache, layer, x.shape[1])
            if dense is not None:   # a prefill chunk over a short context
                cache = kv_cache.record_topk(cache, layer, positions_k)
                return (self.dense(heads, dense, positions_k, cache.kv_format, x.dtype),
                        cache, Selected(positions_k, None))
            cache, rows, ids = kv_cache.latent_for_attention(cache, layer, positions_k,
                                                             shared_ids)
            out = self.attend(self.absorb(*heads), rows, ids, cache.kv_format, impl)
            return self.post(out, x.dtype), cache, Selected(positions_k, ids)
