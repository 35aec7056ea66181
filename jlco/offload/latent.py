"""The offloaded latent cache behind the model's two cache seams.

`OffloadLatent` takes the place of the on-device `DecodeCache.latent` array: latent rows
live in a host pool (one pinned_host array per layer, byte rows, paged), the device keeps
per request and layer a hot buffer of `capacity` rows with its slot table. Inside the
jitted step:

  write_latent           new rows → host pool (async D2H scatter) and → hot buffer
                         (the newest token is almost always selected next step);
  latent_for_attention   top-k positions → hits / misses (`resolve`) → fetch misses from
                         the host pool (`fetch_in_jit`) → rows + slot ids for sparse MLA.

Bytes are copied, never re-encoded, so attention reads exactly the bytes the offload-off
cache would: offload on equals offload off bit for bit.
Glossary: L layers, b batch, m hot slots, R row bytes, P pages per request, s, k as usual.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jlco.offload.fetch import fetch_in_jit
from jlco.offload.host_pool import host_row_ids, scatter_to_host
from jlco.offload.hot_buffer import insert_slots, resolve

# Columns of OffloadLatent.stats, accumulated inside jit (read once per step by the engine).
STAT_LOOKUPS, STAT_HITS, STAT_MISSES, STAT_MOVED, STAT_D2H = range(5)
STAT_NAMES = ("lookups", "hits", "misses", "h2d_moved_rows", "d2h_rows")


@partial(jax.tree_util.register_dataclass,
         data_fields=("rows", "slot_pos", "slot_stamp", "host", "page_table", "step", "stats"),
         meta_fields=("policy", "page_size", "chunk_rows"))
@dataclasses.dataclass(frozen=True)
class OffloadLatent:
    rows: jax.Array          # uint8 [L, b, m, R]  device hot buffer
    slot_pos: jax.Array      # int32 [L, b, m]     context position held by a slot, −1 empty
    slot_stamp: jax.Array    # int32 [L, b, m]     last use (LRU) / insertion (FIFO) step
    host: tuple              # L × uint8 [pages*page_size, R] in host memory
    page_table: jax.Array    # int32 [b, P]        host page of each request page, −1 none
    step: jax.Array          # int32 []            decode step counter (slot stamps)
    stats: jax.Array         # int32 [L, 5]        STAT_* counters since the last reset
    policy: str
    page_size: int
    chunk_rows: int

    @property
    def num_positions(self) -> int:
        """Context positions a request can hold (its page-table span): bounds the
        positions `resolve` sees, so it can look them up without sorting."""
        return self.page_table.shape[1] * self.page_size

    @property
    def shape(self) -> tuple[int, ...]:
        """(L, b, m, R), so shape-reading code treats it like the device latent array."""
        return self.rows.shape


def _flat_ids(slot_ids: jax.Array, capacity: int) -> jax.Array:
    """Slot ids [b, s, k] → global row ids into rows[layer].reshape(b*m, R), −1 kept."""
    base = jnp.arange(slot_ids.shape[0], dtype=jnp.int32)[:, None, None] * capacity
    return jnp.where(slot_ids >= 0, base + slot_ids, -1).astype(jnp.int32)


def write_latent(lat: OffloadLatent, layer: int, data: jax.Array,
                 positions: jax.Array) -> OffloadLatent:
    """data uint8 [b, s, R] at positions [b, s] → host pool and hot buffer of `layer`."""
    with jax.named_scope("offload_write_latent"):
        ids = host_row_ids(lat.page_table, positions, lat.page_size)           # [b, s]
        host = list(lat.host)
        host[layer] = scatter_to_host(host[layer], ids.reshape(-1),
                                      data.reshape(-1, data.shape[-1]))
        slots, pos, stamp = insert_slots(lat.slot_pos[layer], lat.slot_stamp[layer],
                                         jnp.where(ids >= 0, positions, -1), lat.step,
                                         lat.policy)
        # Scatter into the whole donated [L, b, m, R] array: writing a rows[layer] slice
        # back would copy the layer's hot buffer every step.
        b, cap = lat.rows.shape[1:3]
        bidx = jnp.broadcast_to(jnp.arange(b)[:, None], slots.shape)
        rows = lat.rows.at[layer, bidx, jnp.where(slots >= 0, slots, cap)].set(data, mode="drop")
        d2h = (ids >= 0).sum(dtype=jnp.int32)
        return dataclasses.replace(
            lat, host=tuple(host), rows=rows,
            slot_pos=lat.slot_pos.at[layer].set(pos),
            slot_stamp=lat.slot_stamp.at[layer].set(stamp),
            stats=lat.stats.at[layer, STAT_D2H].add(d2h))


def latent_for_attention(lat: OffloadLatent, layer: int, positions: jax.Array):
    """positions [b, s, k] (−1 none) → (lat, rows [b*m, R], ids [b, s, k]): every selected
    row resident in the hot buffer, misses fetched exactly from the host pool."""
    with jax.named_scope("offload_latent_for_attention"):
        # Positions without a host page belong to empty batch slots: not looked up.
        paged = host_row_ids(lat.page_table, positions, lat.page_size) >= 0
        positions = jnp.where(paged, positions, -1)
        res = resolve(lat.slot_pos[layer], lat.slot_stamp[layer], positions, lat.step,
                      lat.policy, num_positions=lat.num_positions)
        # Fetch into the whole donated buffer (viewed [L*b, m, R]), in place: fetching
        # into rows[layer] and writing it back copied the layer's hot buffer twice a step.
        n_layers, b, m, r = lat.rows.shape
        rows, moved = fetch_in_jit(lat.rows.reshape(n_layers * b, m, r), lat.host[layer],
                                   lat.page_table, res, lat.page_size, lat.chunk_rows, layer,
                                   row_offset=layer * b)
        rows = rows.reshape(n_layers, b, m, r)
        counts = jnp.stack([res.n_lookup.sum(), res.n_hit.sum(), res.n_miss.sum(),
                            jnp.asarray(moved, jnp.int32), jnp.int32(0)])
        lat = dataclasses.replace(
            lat, rows=rows,
            slot_pos=lat.slot_pos.at[layer].set(res.slot_pos),
            slot_stamp=lat.slot_stamp.at[layer].set(res.slot_stamp),
            stats=lat.stats.at[layer].add(counts.astype(jnp.int32)))
        return lat, rows[layer].reshape(b * m, r), _flat_ids(res.slot_ids, m)


def next_step(lat: OffloadLatent) -> OffloadLatent:
    return dataclasses.replace(lat, step=lat.step + 1)
