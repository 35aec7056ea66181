"""The engine's jitted functions: one decode step (model + sampling), installing a
prefilled request into its batch slot, and the offload warm-up at admission.

Each takes the split model (graphdef, state) and the batch cache, donates the cache, and
with offload pins every output's sharding: the host pool must come back in `pinned_host`
memory (a jit left to choose would hand it back as device memory and fail).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jlco.model.kv_cache import DecodeCache
from jlco.offload.fetch import fetch_in_jit
from jlco.offload.host_pool import host_row_ids, scatter_to_host
from jlco.offload.hot_buffer import resolve
from jlco.offload.latent import OffloadLatent
from jlco.parallel import data as parallel_data


def sampling_logits(logits, temps, top_ps, top_ks):
    """The logits a sampled row draws from: logits [b, V] f32 divided by the row's
    temperature (temps [b], 0 = greedy rows are left untempered), then top-k (top_ks [b]
    int32, 0 = off) and top-p (top_ps [b], 1 = off; nucleus over the top-k-renormalised
    distribution, as vLLM applies them) set to -inf outside the kept set (ties with the
    last kept value are kept). The sort over the vocabulary runs only when some row
    filters."""
    scaled = logits / jnp.where(temps > 0, temps, 1.0)[:, None]
    v = logits.shape[-1]

    def filtered(x):
        desc = -jnp.sort(-x, axis=-1)                                   # [b, V]
        k = jnp.where(top_ks > 0, jnp.minimum(top_ks, v), v)
        idx = jnp.arange(v)[None]
        in_k = jnp.where(idx < k[:, None], desc, -jnp.inf)
        probs = jax.nn.softmax(in_k, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs                     # mass above each
        n_p = jnp.where(top_ps < 1.0,
                        jnp.maximum(jnp.sum(before < top_ps[:, None], axis=-1), 1), v)
        keep = jnp.minimum(k, n_p)
        thresh = jnp.take_along_axis(desc, (keep - 1)[:, None], axis=-1)
        # Rows that filter nothing keep their logits bit for bit (a row samples the same
        # alone as beside rows that filter).
        return jnp.where(row_filters[:, None] & (x < thresh), -jnp.inf, x)

    row_filters = (temps > 0) & ((top_ks > 0) | (top_ps < 1.0))
    return jax.lax.cond(jnp.any(row_filters), filtered, lambda x: x, scaled)


def sample_rows(logits, temps, keys, top_ps=None, top_ks=None):
    """logits [b, V] f32, temps [b], keys [b, 2], top_ps [b] (default 1 = off), top_ks
    [b] int32 (default 0 = off) → (tokens [b], logprobs [b]); temp 0 = greedy (top-p/k
    ignored); the log-prob is of the untempered, unfiltered distribution (what
    `--json` reports)."""
    b = logits.shape[0]
    top_ps = jnp.ones((b,), jnp.float32) if top_ps is None else top_ps
    top_ks = jnp.zeros((b,), jnp.int32) if top_ks is None else top_ks
    drawn = jax.vmap(jax.random.categorical)(keys, sampling_logits(logits, temps, top_ps, top_ks))
    tok = jnp.where(temps > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def mask_inactive(cache: DecodeCache, active: jax.Array) -> DecodeCache:
    """Empty batch slots decode a dummy token; keep their length at 0 and, offloaded,
    keep them out of the hot buffer and the counters."""
    cache = dataclasses.replace(cache, lengths=jnp.where(active, cache.lengths, 0))
    if isinstance(cache.latent, OffloadLatent):
        lat = cache.latent
        table = jnp.where(active[:, None], lat.page_table, -1)
        cache = dataclasses.replace(cache, latent=dataclasses.replace(
            lat, page_table=table, stats=jnp.zeros_like(lat.stats)))
    return cache


def forward(graphdef, state, cache: DecodeCache, tokens, active, *, impl):
    """tokens [b, s] appended for the active requests → (logits [b, s, V], cache): the
    verification pass of speculative decoding (s = 1 + drafts)."""
    model = nnx.merge(graphdef, state)
    cache = mask_inactive(cache, active)
    saved_table = cache.latent.page_table if isinstance(cache.latent, OffloadLatent) else None
    h, cache = model(tokens, cache, impl=impl)
    cache = dataclasses.replace(cache, scan_len=None)   # the output tree is the input's
    if saved_table is not None:
        cache = dataclasses.replace(cache, latent=dataclasses.replace(
            cache.latent, page_table=jnp.where(active[:, None], saved_table,
                                               cache.latent.page_table)))
    cache = dataclasses.replace(cache, lengths=jnp.where(active, cache.lengths, 0))
    return model.logits(h), cache


def request_keys(seeds, counts):
    """Sampling keys [b, 2] of token number counts[b] of the requests seeded seeds[b]
    (uint32): the same values as `fold_in(PRNGKey(seed), count)` on the host, derived
    inside the step so the host does no per-request jax work."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counts)


def decode_step(graphdef, state, cache: DecodeCache, tokens, active, temps, seeds, counts,
                top_ps, top_ks, *, impl):
    """tokens [b, 1] → (next tokens [b], logprobs [b], cache). One jit, one sync (the
    caller reads tokens, logprobs and the offload counters together). seeds [b] uint32,
    counts [b] int32: each request's sampling stream and position in it; top_ps [b],
    top_ks [b] int32: nucleus and top-k filters (1 / 0 = off)."""
    logits, cache = forward(graphdef, state, cache, tokens, active, impl=impl)
    tok, logp = sample_rows(logits[:, -1], temps, request_keys(seeds, counts), top_ps, top_ks)
    return tok, logp, cache


def install(cache: DecodeCache, temp: DecodeCache, slot, n, page_row):
    """Copy a prefilled single-request cache `temp` (b = 1) into batch slot `slot` with
    length n. Offloaded: latent rows go to the host pool at the request's pages
    (page_row int32 [P]) and its hot-buffer slots are emptied."""
    def put(big, small):   # per-layer tuples: [b, ...] <- [1, ...]
        return tuple(x.at[slot].set(y[0], mode="drop") for x, y in zip(big, small))
    new = dataclasses.replace(
        cache, index_k=put(cache.index_k, temp.index_k),
        index_scale=None if cache.index_scale is None else put(cache.index_scale, temp.index_scale),
        lengths=cache.lengths.at[slot].set(n, mode="drop"))
    if not isinstance(cache.latent, OffloadLatent):
        return dataclasses.replace(new, latent=put(cache.latent, temp.latent))
    lat = cache.latent
    t = temp.max_len
    positions = jnp.where(jnp.arange(t) < n, jnp.arange(t), -1)[None]
    ids = host_row_ids(page_row[None], positions, lat.page_size)[0]
    host = tuple(scatter_to_host(h, ids, temp.latent[i][0]) for i, h in enumerate(lat.host))
    lat = dataclasses.replace(
        lat, host=host, page_table=lat.page_table.at[slot].set(page_row, mode="drop"),
        slot_pos=lat.slot_pos.at[:, slot].set(-1, mode="drop"),
        slot_stamp=lat.slot_stamp.at[:, slot].set(-1, mode="drop"))
    return dataclasses.replace(new, latent=lat)


def install_on_rank(cache: DecodeCache, temp: DecodeCache, slot, n, page_row):
    """`install` as one data rank runs it (`jlco.parallel.data.per_rank`): the rank that
    owns global slot `slot` writes it and its pool block, the others nothing. Without
    data ranks, `install`."""
    if parallel_data.data_size() > 1:
        slot = parallel_data.local_slot(slot, cache.batch)
        if page_row is not None:
            page_row = jnp.where(slot < cache.batch, page_row, -1)
    return install(cache, temp, slot, n, page_row)


def warm_up_on_rank(cache: DecodeCache, slot, record):
    """`warm_up` as one data rank runs it: the owner of global slot `slot` warms it, the
    others look nothing up (their fetched count is 0). Without data ranks, `warm_up`."""
    if parallel_data.data_size() > 1:
        slot = parallel_data.local_slot(slot, cache.batch)
        record = jnp.where(slot < cache.batch, record, -1)
    return warm_up(cache, slot, record)


def warm_up(cache: DecodeCache, slot, record):
    """ESS's admission warm-up: insert the top-k positions of the last prefill queries
    (record int32 [L, w, k], oldest query first) into the slot's hot buffer in order,
    fetching them from the host pool, so step 0 finds most rows resident. Query q is
    stamped step - w + q: older than the next decode step, in insertion order."""
    lat = cache.latent
    rows, pos, stamp = lat.rows, lat.slot_pos, lat.slot_stamp
    table = lat.page_table[slot][None]
    fetched = jnp.int32(0)
    for layer in range(record.shape[0]):
        def body(q, carry):
            r, p, s, n = carry
            stamp_q = lat.step - record.shape[1] + q
            res = resolve(p[None], s[None], record[layer, q][None, None], stamp_q, lat.policy,
                          num_positions=lat.num_positions)
            r, _ = fetch_in_jit(r[None], lat.host[layer], table, res, lat.page_size)
            return r[0], res.slot_pos[0], res.slot_stamp[0], n + res.n_miss.sum()
        r, p, s, fetched = jax.lax.fori_loop(
            0, record.shape[1], body,
            (rows[layer, slot], pos[layer, slot], stamp[layer, slot], fetched))
        rows, pos, stamp = (rows.at[layer, slot].set(r, mode="drop"),
                            pos.at[layer, slot].set(p, mode="drop"),
                            stamp.at[layer, slot].set(s, mode="drop"))
    lat = dataclasses.replace(lat, rows=rows, slot_pos=pos, slot_stamp=stamp)
    return dataclasses.replace(cache, latent=lat), fetched

