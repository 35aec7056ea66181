"""Synthetic prefilled contexts, admitted the way a PD-disaggregated decode node receives
them: the prefill node's latent rows and indexer keys arrive as data and go straight
into the request's caches (its host pages when offloaded), with no prefill through the
model. Benchmarks use this to reach 32K–128K contexts on a CPU in seconds.

What the indexer selects decides the hot-buffer hit rate, and it depends on the queries
as much as on the keys: score = Σ_h w_h · ReLU(q_h · k), with signed head weights w_h.
Keys here are isotropic N(0, 1) (after the model's k_norm, keys are roughly unit-scale
per dim). Shaping keys alone cannot make a random-weight model select consistently: the
sign of Σ_h w_h ReLU(q_h · u) flips from token to token, so "salient" keys are chosen one
step and avoided the next. Locality has to come from correlated consecutive queries, as
in real models; `tools/bench_decode.py` gets it by giving all token embeddings a shared
component. Measure the hit rate you get; do not assume it.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jlco.config import Config
from jlco.engine.core import Engine
from jlco.engine.scheduler import Request, RequestError
from jlco.model import kv_cache
from jlco.model.kv_cache import DecodeCache, cache_layers, init_cache

_ROW_BLOCK = 4096   # distinct latent rows generated per layer, then tiled


@partial(jax.jit, static_argnames=("cfg", "n", "max_len"))
def synthetic_cache(cfg: Config, key: jax.Array, *, n: int, max_len: int
                    ) -> DecodeCache:
    """A one-request cache (b = 1, `max_len` positions) holding `n` synthetic tokens in
    every layer: latent rows in `cfg.cache.kv_format` and indexer keys in
    `cfg.cache.indexer_key_format`, written through the cache's own encoders.

    Latent values only need to be valid rows (their content does not change timing), so
    `_ROW_BLOCK` distinct random rows per layer are tiled over the context. Keys are
    distinct per token, N(0, 1) (see the module docstring)."""
    if not 0 < n <= max_len:
        raise ValueError(f"synthetic_cache: n={n} must be in 1..max_len={max_len}")
    m = cfg.model
    cache = init_cache(cfg, batch=1, max_len=max_len)
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    for layer in range(cache_layers(cfg)):
        k_rows, k_keys = jax.random.split(jax.random.fold_in(key, layer))
        block = jax.random.normal(k_rows, (1, min(n, _ROW_BLOCK), m.latent_dim), jnp.float32)
        rows = kv_cache.encode_rows(block, cfg.cache.kv_format, m.qk_rope_head_dim)
        rows = jnp.tile(rows, (1, -(-n // block.shape[1]), 1))[:, :n]
        lat = cache.latent[layer].at[:, :n].set(rows)
        cache = dataclasses.replace(cache, latent=cache.latent[:layer] + (lat,)
                                    + cache.latent[layer + 1:])
        if m.shares_topk(layer):          # IndexShare: the layer caches no keys
            continue
        keys = jax.random.normal(k_keys, (1, n, m.index_head_dim), jnp.float32)
        cache = kv_cache.write_index_key(cache, layer, keys, positions)
    return dataclasses.replace(cache, lengths=jnp.full((1,), n, jnp.int32))


def admit_prefilled(engine: Engine, cache: DecodeCache, max_new_tokens: int,
                    first_token: int = 0) -> Request:
    """Install a finished prefill (`cache`: b = 1, engine.max_context_len positions, e.g.
    from `synthetic_cache`) into a free batch slot, with its own host pages when
    offloaded: what `Engine.step` does after its prefill, minus the prefill.

    `first_token` is the token the prefill node sampled (it counts toward
    max_new_tokens; its log-prob is unknown here: nan). The prompt tokens are not known
    to a decode node, so `Request.prompt` stays empty. With offload the hot buffer starts
    empty (no prefill queries to warm it from): the first decode step fetches the
    request's working set. Raises RequestError naming the field that does not fit."""
    n = int(jax.device_get(cache.lengths)[0])
    max_len = engine.cfg.engine.max_context_len
    if cache.batch != 1 or cache.max_len != max_len:
        raise RequestError(f"cache: must be one request of engine.max_context_len="
                           f"{max_len} positions; got batch {cache.batch}, "
                           f"max_len {cache.max_len}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise RequestError(f"max_new_tokens={max_new_tokens!r}: allowed an integer >= 1")
    vocab = engine.cfg.model.vocab_size
    if not 0 <= first_token < vocab:
        raise RequestError(f"first_token={first_token}: allowed 0..{vocab - 1}")
    sched = engine.scheduler
    req = sched.add_running(n, max_new_tokens)   # RequestError if it cannot
    page_row = None
    if sched.pages is not None:
        page_row = sched.pages.page_table([req.id], engine.runner.pages_per_request)[0]
    engine.runner.install(cache, req.slot, n, page_row)
    sched.append(req, int(first_token), float("nan"))
    return req
