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

from jlco.engine.inputs import StepInputs
from jlco.model import kv_cache
from jlco.model.kv_cache import DecodeCache
from jlco.offload.fetch import fetch_in_jit
from jlco.offload.host_pool import host_row_ids, scatter_to_host
from jlco.offload.hot_buffer import Resolution, resolve
from jlco.offload.latent import STAT_PREF_UNUSED, OffloadLatent, table_groups
from jlco.parallel import data as parallel_data
from jlco.parallel import mesh as parallel_mesh
from jlco.sampling import penalize
from jlco.sampling.sample import sample


def open_step(cache: DecodeCache, active: jax.Array):
    """The start of every step: empty batch slots decode a dummy token, so their length
    is held at 0 and, offloaded, their page table is hidden (no lookups, no host writes)
    and the per-step counters restart. → (cache, the page table to restore, or None)."""
    cache = dataclasses.replace(cache, lengths=jnp.where(active, cache.lengths, 0))
    if not isinstance(cache.latent, OffloadLatent):
        return cache, None
    lat = cache.latent
    table = jnp.where(active[:, None], lat.page_table, -1)
    # rows loaded ahead of need in a slot whose request has left were never used
    left = lat.slot_pref & ~active[None, :, None]
    per_table = left.sum(axis=(1, 2), dtype=jnp.int32)
    per_layer = per_table if lat.groups is None else per_table[jnp.asarray(lat.groups)]
    cache = dataclasses.replace(cache, latent=dataclasses.replace(
        lat, page_table=table, slot_pref=lat.slot_pref & ~left,
        stats=jnp.zeros_like(lat.stats).at[:, STAT_PREF_UNUSED].set(per_layer)))
    return cache, lat.page_table


def close_step(cache: DecodeCache, active: jax.Array, saved_table, lengths=None):
    """The end of every step: the page table `open_step` hid comes back, lengths (the
    cache's own, or `lengths` [b] where speculation rolls rejected drafts back) stay 0
    in empty slots, and the scan bound is dropped (the output tree is the input's)."""
    if saved_table is not None:
        cache = dataclasses.replace(cache, latent=dataclasses.replace(
            cache.latent, page_table=jnp.where(active[:, None], saved_table,
                                               cache.latent.page_table)))
    lengths = cache.lengths if lengths is None else lengths
    return dataclasses.replace(cache, lengths=jnp.where(active, lengths, 0), scan_len=None)


def forward(graphdef, state, cache: DecodeCache, tokens, active, *, impl):
    """tokens [b, s] appended for the active requests → (logits [b, s, V], cache)."""
    model = nnx.merge(graphdef, state)
    cache, saved = open_step(cache, active)
    h, cache = model(tokens, cache, impl=impl)
    return model.logits(h), close_step(cache, active, saved)


def decode_step(graphdef, state, cache: DecodeCache, inputs: StepInputs, *, impl):
    """inputs.tokens [b, 1] → (next tokens [b], logprobs [b], cache). One jit, one sync
    (the caller reads tokens, logprobs and the offload counters together)."""
    logits, cache = forward(graphdef, state, cache, inputs.tokens, inputs.active, impl=impl)
    return sample_and_count(logits[:, -1], inputs, cache)


def sample_and_count(logits, inputs: StepInputs, cache: DecodeCache):
    """logits [b, V] → (next tokens [b], logprobs, cache), the active slots' tokens
    counted in the cache's penalty tables."""
    tok, logp = sample(logits, inputs.sampling, cache.seen)
    seen = penalize.count(cache.seen, tok[:, None], inputs.active.astype(jnp.int32))
    return tok, logp, dataclasses.replace(cache, seen=seen)


def install(cache: DecodeCache, temp: DecodeCache, slot, n, page_row, seen_row=None):
    """Copy a prefilled single-request cache `temp` (b = 1) into batch slot `slot` with
    length n, and its penalty tables `seen_row` (`penalize.SeenTokens.row`) into the
    slot's. Offloaded: latent rows go to the host pool at the request's pages
    (page_row int32 [P]) and its hot-buffer slots are emptied."""
    def put(big, small):   # per-layer tuples: [b, ...] <- [1, ...]
        return tuple(x.at[slot].set(y[0], mode="drop") for x, y in zip(big, small))
    new = dataclasses.replace(
        cache, index_k=put(cache.index_k, temp.index_k),
        index_scale=None if cache.index_scale is None else put(cache.index_scale, temp.index_scale),
        lengths=cache.lengths.at[slot].set(n, mode="drop"),
        seen=cache.seen if seen_row is None else penalize.seat(cache.seen, slot, seen_row))
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
        slot_stamp=lat.slot_stamp.at[:, slot].set(-1, mode="drop"),
        slot_pref=lat.slot_pref.at[:, slot].set(False, mode="drop"))
    return dataclasses.replace(new, latent=lat)


def install_on_rank(cache: DecodeCache, temp: DecodeCache, slot, n, page_row, seen_row=None):
    """`install` as one data rank runs it (`jlco.parallel.data.per_rank`): the rank that
    owns global slot `slot` writes it and its pool block, the others nothing. Without
    data ranks, `install`."""
    if parallel_data.data_size() > 1:
        slot = parallel_data.local_slot(slot, cache.batch)
        if page_row is not None:
            page_row = jnp.where(slot < cache.batch, page_row, -1)
    return install(cache, temp, slot, n, page_row, seen_row)


def warm_up_on_rank(cache: DecodeCache, slot, record):
    """`warm_up` as one data rank runs it: the owner of global slot `slot` warms it, the
    others look nothing up (their fetched count is 0). Without data ranks, `warm_up`."""
    if parallel_data.data_size() > 1:
        slot = parallel_data.local_slot(slot, cache.batch)
        record = jnp.where(slot < cache.batch, record, -1)
    return warm_up(cache, slot, record)


def warm_up(cache: DecodeCache, slot, record, *, fetch: bool = True):
    """ESS's admission warm-up: insert the top-k positions of the last prefill queries
    (record int32 [L, w, k], oldest query first) into the slot's hot buffer in order,
    so step 0 finds most rows resident. Query q is stamped step - w + q: older than the
    next decode step, in insertion order.
    Once per slot table: an IndexShare group's shared layers recorded their full
    layer's top-k, so the full layer's record plans the group's table.
    The rows follow the table, not the sequence: resolution depends on positions only,
    so after the loop each slot holds the row of the position its table names, and one
    gather per group (every layer of the group in one transfer) fills exactly those
    slots, scattered straight into the whole buffer as the decode step's fetch is. The
    same bytes a fetch per query would leave. (Fetching into a gathered slot copy and
    writing it back failed on XLA:GPU, jax 0.11.2: the host offloader turned that
    write-back into host compute and its verifier refused it.)
    fetch=False updates the slot tables only (the host-driven path then sends the rows
    that ended up resident). → (cache, rows missed during the sequence, counted per
    layer)."""
    lat = cache.latent
    rows, pos, stamp, pref = lat.rows, lat.slot_pos, lat.slot_stamp, lat.slot_pref
    table = lat.page_table[slot][None]
    fetched = jnp.int32(0)
    for t, members in enumerate(table_groups(lat)):
        def body(q, carry, lead=members[0], n=len(members)):
            p, s, missed = carry
            stamp_q = lat.step - record.shape[1] + q
            res = resolve(p[None], s[None], record[lead, q][None, None], stamp_q, lat.policy,
                          num_positions=lat.num_positions)
            return res.slot_pos[0], res.slot_stamp[0], missed + n * res.n_miss.sum()
        p, s, fetched = jax.lax.fori_loop(0, record.shape[1], body,
                                          (pos[t, slot], stamp[t, slot], fetched))
        if fetch:   # into the whole buffer viewed [L*b, C, R], as the decode step does
            n_layers, b, cap, rb = rows.shape
            rows = fetch_in_jit(rows.reshape(n_layers * b, cap, rb),
                                tuple(lat.host[i] for i in members), table,
                                resident_plan(p, (slot >= 0) & (slot < b)), lat.page_size,
                                row_offset=tuple(i * b + slot for i in members))[0]
            rows = rows.reshape(n_layers, b, cap, rb)
        pos = pos.at[t, slot].set(p, mode="drop")
        stamp = stamp.at[t, slot].set(s, mode="drop")
        pref = pref.at[t, slot].set(p >= 0, mode="drop")   # every row is ahead of need
    lat = dataclasses.replace(lat, rows=rows, slot_pos=pos, slot_stamp=stamp, slot_pref=pref)
    return dataclasses.replace(cache, latent=lat), fetched


def resident_plan(slot_pos: jax.Array, valid) -> Resolution:
    """A fetch plan that loads every occupied slot of one table (slot_pos int32 [C], −1
    empty) with its position's row; empty slots keep their bytes, and nothing is loaded
    unless `valid` (a slot this rank owns). Only the fields `fetch_in_jit` reads with
    chunk_rows=0 are set."""
    occupied = (slot_pos >= 0) & valid
    victim = jnp.where(occupied, jnp.arange(slot_pos.shape[0], dtype=jnp.int32), -1)
    return Resolution(slot_ids=None, miss_pos=jnp.where(occupied, slot_pos, -1)[None],
                      victim_slot=victim[None], n_miss=occupied.sum(dtype=jnp.int32)[None],
                      slot_pos=None, slot_stamp=None, n_hit=None, n_lookup=None)


class BoundStep:
    """A step `fn(graphdef, state, *rest)` jitted with the model's leaves flattened once.
    Called with the graphdef and State each time, jit would hash the graphdef (nnx hashes
    its whole node tree: 0.30 ms a call at 4 layers) and flatten the State's Variables in
    Python (0.07 ms) before the device starts: a fifth of a 1.7 ms roofline step at batch 1.
    `jit` gets `bound(leaves, *rest)` and jits it (donation and roles shift by one)."""

    def __init__(self, fn, graphdef, state, jit):
        leaves, treedef = jax.tree.flatten(state)
        self._state, self._leaves = state, leaves

        def bound(leaves, *rest):
            return fn(graphdef, jax.tree.unflatten(treedef, leaves), *rest)

        self._jitted = jit(bound)

    def _leaves_for(self, state):
        if state is not self._state:
            raise ValueError("a BoundStep runs the model state it was built with")
        return self._leaves

    def __call__(self, graphdef, state, *rest):
        return self._jitted(self._leaves_for(state), *rest)

    def lower(self, graphdef, state, *rest):
        return self._jitted.lower(self._leaves_for(state), *rest)


def jit_on_cache(fn, cache: DecodeCache, offload: bool, donate: int, outs: tuple[str, ...],
                 roles: tuple[str, ...] = (), shardings=None):
    """jit `fn`, donating its cache argument (`donate`). Offloaded, every output's
    sharding is pinned ("cache" = `cache`'s own shardings, else the device): the host
    pool must come back in host memory (left to choose, jit declares device memory and
    fails). With data-parallel attention `fn` runs per data rank
    (`parallel_data.per_rank`; `roles` name its arguments, `outs` its outputs: "cache",
    "batch" [b, ...] per slot, "rep" replicated, "sum" summed over ranks).
    shardings: the cache's leaves' shardings when `cache` is a template of them
    (default: read off `cache`)."""
    if roles:
        fn = parallel_data.per_rank(fn, roles, outs, kv_cache.data_specs,
                                    kv_cache.sum_rank_stats)
    if not offload:
        return jax.jit(fn, donate_argnums=donate)
    dev = parallel_mesh.replicated()
    shardings = cache_shardings(cache) if shardings is None else shardings
    shard = tuple(shardings if o == "cache" else dev for o in outs)
    return jax.jit(fn, donate_argnums=donate,
                   out_shardings=shard[0] if len(shard) == 1 else shard)


def cache_shardings(cache: DecodeCache):
    """The shardings `cache`'s leaves live in, as the mesh names them."""
    return jax.tree.map(lambda x: parallel_mesh.on_mesh(x.sharding), cache)

