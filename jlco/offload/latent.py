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

IndexShare groups (GLM-5 "shared" layers, `ModelConfig.shares_topk`): a full layer and
the shared layers after it attend over the same positions every step, so their slot
tables would stay identical; they keep ONE table (`OffloadLatent.groups` maps each layer
to its table). The full layer plans the group's misses once (`resolve_selection`) and
fetches the missed rows of every layer of the group in one transfer; a shared layer only
writes its new row into the slot the group's table gives it and attends by the full
layer's slot ids (`latent_for_attention(shared_ids=...)`).
Glossary: L layers, b batch, m hot slots, R row bytes, P pages per request, s, k as usual.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jlco.offload.fetch import fetch_in_jit
from jlco.offload.host_pool import host_row_ids, scatter_to_host
from jlco.offload.hot_buffer import Resolution, insert_slots, resolve

# Columns of OffloadLatent.stats, accumulated inside jit (read once per step by the engine).
# PREF_USED: lookups that hit a row loaded ahead of need (the admission warm-up, the
# layer-ahead prefetch) and not used since; PREF_UNUSED: such rows evicted, or left when
# their request ended, unused. PREDICTED: distinct positions the layer-ahead prediction
# chose for a layer (`plan_prefetch`); PREDICTED_CORRECT: distinct positions the layer's
# real top-k then selected among them (accuracy = correct / lookups of that layer).
STAT_LOOKUPS, STAT_HITS, STAT_MISSES, STAT_MOVED, STAT_D2H, STAT_PREF_USED, \
    STAT_PREF_UNUSED, STAT_PREDICTED, STAT_PREDICTED_CORRECT = range(9)
STAT_NAMES = ("lookups", "hits", "misses", "h2d_moved_rows", "d2h_rows", "prefetch_used",
              "prefetch_unused", "predicted", "predicted_correct")

# Batch rows one loop iteration of `update_rows` updates on XLA:CPU (empty slots skipped).
# Measured (configs/128k.py with the tiny model, batch 32, one request): 1 → 10.3 ms a
# step, 2 → 11.0, 8 → 13.2, every row → 24.7; with 8 of 32 rows busy 2 and 4 do best.
ROW_GROUP = 2


@partial(jax.tree_util.register_dataclass,
         data_fields=("rows", "slot_pos", "slot_stamp", "slot_pref", "host", "page_table",
                      "step", "stats"),
         meta_fields=("policy", "page_size", "chunk_rows", "groups"))
@dataclasses.dataclass(frozen=True)
class OffloadLatent:
    rows: jax.Array          # uint8 [L, b, m, R]  device hot buffer
    slot_pos: jax.Array      # int32 [G, b, m]     context position held by a slot, −1 empty
    slot_stamp: jax.Array    # int32 [G, b, m]     last use (LRU) / insertion (FIFO) step
    slot_pref: jax.Array     # bool  [G, b, m]     loaded ahead of need, not used since
    host: tuple              # L × uint8 [pages*page_size, R] in host memory
    page_table: jax.Array    # int32 [b, P]        host page of each request page, −1 none
    step: jax.Array          # int32 []            decode step counter (slot stamps)
    stats: jax.Array         # int32 [L, 7]        STAT_* counters since the last reset
    policy: str
    page_size: int
    chunk_rows: int
    # The slot table (index into slot_pos / slot_stamp, G of them) of each of the L
    # layers: an IndexShare group shares its full layer's (`share_groups`). None: one
    # table per layer (G = L).
    groups: tuple | None = None

    @property
    def num_positions(self) -> int:
        """Context positions a request can hold (its page-table span): bounds the
        positions `resolve` sees, so it can look them up without sorting."""
        return self.page_table.shape[1] * self.page_size

    @property
    def shape(self) -> tuple[int, ...]:
        """(L, b, m, R), so shape-reading code treats it like the device latent array."""
        return self.rows.shape


def share_groups(shared) -> tuple[int, ...]:
    """`OffloadLatent.groups` for layers whose `shared` flags (bool per cache layer,
    `ModelConfig.shares_topk`) say which reuse the top-k of the full layer before them:
    a full layer opens a new table, a shared one uses the open one."""
    groups: list[int] = []
    for i, s in enumerate(shared):
        if i == 0 and s:
            raise ValueError("share_groups: layer 0 shares its top-k, but no full layer "
                             "comes before it")
        groups.append(groups[-1] + (not s) if groups else 0)
    return tuple(groups)


def table_index(lat: OffloadLatent, layer):
    """The slot table of `layer` (an int, or traced in the host-driven phases)."""
    if lat.groups is None:
        return layer
    if isinstance(layer, int):
        return lat.groups[layer]
    return jnp.asarray(lat.groups, jnp.int32)[layer]


def group_layers(lat: OffloadLatent, layer: int) -> tuple[int, ...]:
    """The layers that share `layer`'s slot table, ascending (its IndexShare group)."""
    if lat.groups is None:
        return (layer,)
    return tuple(i for i, g in enumerate(lat.groups) if g == lat.groups[layer])


def table_groups(lat: OffloadLatent) -> tuple[tuple[int, ...], ...]:
    """Per slot table, the layers that use it (the first one is the full layer)."""
    n = lat.rows.shape[0]
    if lat.groups is None:
        return tuple((i,) for i in range(n))
    return tuple(tuple(i for i in range(n) if lat.groups[i] == g)
                 for g in range(max(lat.groups) + 1))


def _group_mask(lat: OffloadLatent, layer) -> jax.Array:
    """bool [L]: the layers sharing `layer`'s table (per-layer counters go to each)."""
    n = lat.stats.shape[0]
    if lat.groups is None:
        return jnp.arange(n) == layer
    return jnp.asarray(lat.groups, jnp.int32) == table_index(lat, layer)


def follows(lat: OffloadLatent, shared: bool) -> bool:
    """A layer that shares its top-k uses its full layer's table (and plan) when the
    latent groups its tables; without groups it plans on its own table."""
    return bool(shared) and lat.groups is not None


def _resident_slots(table: jax.Array, new_pos: jax.Array) -> jax.Array:
    """The slot of table [b, m] holding each position of new_pos [b, s] (−1 where none
    does, or the position is invalid): where a shared layer writes its new row."""
    eq = table[:, None, :] == new_pos[:, :, None]                             # [b, s, m]
    return jnp.where(eq.any(-1) & (new_pos >= 0), jnp.argmax(eq, -1), -1).astype(jnp.int32)


def _flat_ids(slot_ids: jax.Array, capacity: int) -> jax.Array:
    """Slot ids [b, s, k] → global row ids into rows[layer].reshape(b*m, R), −1 kept."""
    base = jnp.arange(slot_ids.shape[0], dtype=jnp.int32)[:, None, None] * capacity
    return jnp.where(slot_ids >= 0, base + slot_ids, -1).astype(jnp.int32)


def update_rows(has_work: jax.Array, layer: int, tables: tuple, inputs: tuple, fills: tuple,
                fn, group: int | None = None):
    """Apply a row-wise update to the batch rows that have work, on XLA:CPU skipping the
    rest. tables: [L, b, ...] arrays whose `layer` rows `fn` updates (donated: written
    in place); inputs: [b, ...] arrays; fn(table rows, input rows) → (new table rows,
    output rows), each row on its own (as `resolve` and `insert_slots` are), leaving a
    row without work (has_work bool [b] False) unchanged with outputs equal to `fills`
    (one scalar per output). → (tables, outputs [b, ...]): fn over the whole batch, bit
    for bit.

    The slot-table work is O(rows * capacity) per layer: at 32 slots with one request
    the empty rows were most of an offloaded step on XLA:CPU. There, when the rows with
    work fit in groups of g = min(group or ROW_GROUP, b) filling at most half the batch,
    a `lax.while_loop` gathers g of them at a time (ascending; the last group is filled
    up with rows without work), so empty slots cost nothing; a fuller batch runs `fn` on
    every row at once, cheaper than gathering them. Other backends always run `fn` on
    every row (measured on XLA:CPU only; on an accelerator a row's update is a few
    short kernels, and a data-dependent loop or branch adds latency of its own).
    """
    new, outs = _update_layer_rows(has_work, tuple(t[layer] for t in tables), inputs, fills,
                                   fn, group)
    return tuple(t.at[layer].set(v) for t, v in zip(tables, new)), outs


def _update_layer_rows(has_work, tables, inputs, fills, fn, group):
    """`update_rows` on one layer's tables [b, ...] → (tables, outputs)."""
    b = has_work.shape[0]
    g = min(ROW_GROUP if group is None else group, b)

    def every_row(tables):
        new, outs = fn(tables, inputs)
        return tuple(new), tuple(outs)

    if g >= b:
        return every_row(tables)
    shapes = jax.eval_shape(lambda t: fn(t, inputs)[1], tables)
    w = has_work.astype(jnp.int32)
    n = w.sum()
    before = jnp.cumsum(w) - w                      # rows with work before each row
    ar = jnp.arange(b, dtype=jnp.int32)
    key = jnp.where(has_work, before, n + ar - before)
    order = jnp.zeros((b,), jnp.int32).at[key].set(ar)        # a permutation of 0..b-1

    def group_step(c):
        i, tables, outs = c
        rows = jax.lax.dynamic_slice(order, (i * g,), (g,))   # (i + 1) * g <= b / 2
        new, outs_g = fn(tuple(t[rows] for t in tables), tuple(x[rows] for x in inputs))
        return (i + 1, tuple(t.at[rows].set(v) for t, v in zip(tables, new)),
                tuple(o.at[rows].set(v) for o, v in zip(outs, outs_g)))

    def grouped(tables):
        outs = tuple(jnp.full(x.shape, f, x.dtype) for x, f in zip(shapes, fills))
        _, tables, outs = jax.lax.while_loop(lambda c: c[0] * g < n, group_step,
                                             (jnp.int32(0), tables, outs))
        return tables, outs

    def cpu(tables):
        return jax.lax.cond(-(-n // g) * g * 2 <= b, grouped, every_row, tables)

    return jax.lax.platform_dependent(tables, cpu=cpu, default=every_row)


def write_latent(lat: OffloadLatent, layer: int, data: jax.Array,
                 positions: jax.Array, shared: bool = False) -> OffloadLatent:
    """data uint8 [b, s, R] at positions [b, s] → host pool and hot buffer of `layer`
    (`layer` may be traced when the latent has no in-jit pool, `host == ()`).
    `shared` (static): the layer shares its top-k; with grouped tables its full layer
    has already inserted these positions into the group's table (and planned the
    step), so the rows go to the slots that hold them now, the table untouched: a
    position the full layer's plan evicted again is not written (its slot holds a
    fetched row), as a second insert + plan on an identical table would leave it."""
    with jax.named_scope("offload_write_latent"):
        ids = host_row_ids(lat.page_table, positions, lat.page_size)           # [b, s]
        host = list(lat.host)
        if host:   # no in-jit pool: the host-driven path writes its own (HostLatentPool)
            host[layer] = scatter_to_host(host[layer], ids.reshape(-1),
                                          data.reshape(-1, data.shape[-1]))
        new_pos = jnp.where(ids >= 0, positions, -1).astype(jnp.int32)
        t = table_index(lat, layer)
        if follows(lat, shared):
            pos, stamp = lat.slot_pos, lat.slot_stamp
            slots = _resident_slots(lat.slot_pos[t], new_pos)
        else:
            def insert(tables, inputs):
                slots, pos, stamp = insert_slots(*tables, *inputs, lat.step, lat.policy)
                return (pos, stamp), (slots,)

            (pos, stamp), (slots,) = update_rows((new_pos >= 0).any(axis=1), t,
                                                 (lat.slot_pos, lat.slot_stamp), (new_pos,),
                                                 (-1,), insert)
        # Scatter into the whole donated [L, b, m, R] array: writing a rows[layer] slice
        # back would copy the layer's hot buffer every step.
        b, cap = lat.rows.shape[1:3]
        bidx = jnp.broadcast_to(jnp.arange(b)[:, None], slots.shape)
        at = jnp.where(slots >= 0, slots, cap)
        rows = lat.rows.at[layer, bidx, at].set(data, mode="drop")
        # A slot given to a new row loses its loaded-ahead row: unused if it was unread.
        pref = lat.slot_pref[t]
        evicted = jnp.where(slots >= 0, pref[bidx, jnp.minimum(at, cap - 1)], False)
        evicted = evicted & (lat.slot_pos[t][bidx, jnp.minimum(at, cap - 1)] != new_pos)
        wasted = jnp.where(_group_mask(lat, layer), evicted.sum(dtype=jnp.int32), 0)
        d2h = (ids >= 0).sum(dtype=jnp.int32)
        return dataclasses.replace(
            lat, host=tuple(host), rows=rows, slot_pos=pos, slot_stamp=stamp,
            slot_pref=lat.slot_pref.at[t].set(pref.at[bidx, at].set(False, mode="drop")),
            stats=lat.stats.at[layer, STAT_D2H].add(d2h).at[:, STAT_PREF_UNUSED].add(wasted))


def resolve_selection(lat: OffloadLatent, layer, positions: jax.Array,
                      scan_len: int | None = None, b0=0,
                      predicted: jax.Array | None = None) -> tuple[OffloadLatent, Resolution]:
    """The lookup half of `latent_for_attention`, for batch rows b0..b0+nb: positions
    [nb, s, k] (−1 none) of `layer` → hits / misses against the hot buffer (`resolve`;
    rows that select nothing are skipped, `update_rows`), the slot table and the
    lookup / hit / miss counters updated (of every layer of the table's group: each
    attends over these rows). Positions without a host page belong to empty batch
    slots and are not looked up. The host-driven path calls this per micro-batch
    (`b0`, `layer` traced), the in-jit path on the whole batch. `predicted` [nb, s, k]:
    the layer-ahead prediction of these positions (`plan_prefetch`); the distinct
    positions it got right are counted (STAT_PREDICTED_CORRECT)."""
    nb = positions.shape[0]
    table = jax.lax.dynamic_slice_in_dim(lat.page_table, b0, nb, 0)
    positions = jnp.where(host_row_ids(table, positions, lat.page_size) >= 0, positions, -1)
    bound = lookup_bound(lat, scan_len)

    def lookup(tables, inputs):
        res = resolve(*tables, *inputs, lat.step, lat.policy, num_positions=bound)
        return (res.slot_pos, res.slot_stamp), (res.slot_ids, res.miss_pos, res.victim_slot,
                                                res.n_miss, res.n_hit, res.n_lookup)

    ti = table_index(lat, layer)

    def rows_of(t):
        return jax.lax.dynamic_slice_in_dim(t[ti], b0, nb, 0)
    (pos, stamp), (slot_ids, miss, victim, n_miss, n_hit, n_lookup) = _update_layer_rows(
        (positions >= 0).any(axis=(1, 2)), (rows_of(lat.slot_pos), rows_of(lat.slot_stamp)),
        (positions,), (-1, -1, -1, 0, 0, 0), lookup, None)
    res = Resolution(slot_ids, miss, victim, n_miss, pos, stamp, n_hit, n_lookup)
    pref, used, wasted = prefetch_use(rows_of(lat.slot_pref), slot_ids, victim)
    counts = jnp.zeros_like(lat.stats[0]).at[
        jnp.array([STAT_LOOKUPS, STAT_HITS, STAT_MISSES, STAT_PREF_USED, STAT_PREF_UNUSED])
    ].set(jnp.stack([n_lookup.sum(), n_hit.sum(), n_miss.sum(), used, wasted]
                    ).astype(jnp.int32))
    counts = jnp.where(_group_mask(lat, layer)[:, None], counts[None], 0)
    if predicted is not None:
        right = _common_positions(positions, predicted, bound)
        counts = counts.at[:, STAT_PREDICTED_CORRECT].add(
            jnp.where(jnp.arange(counts.shape[0]) == layer, right, 0))

    def put(t, v):
        return t.at[ti].set(jax.lax.dynamic_update_slice_in_dim(t[ti], v, b0, 0))
    return dataclasses.replace(lat, slot_pos=put(lat.slot_pos, pos),
                               slot_stamp=put(lat.slot_stamp, stamp),
                               slot_pref=put(lat.slot_pref, pref),
                               stats=lat.stats + counts), res


def _position_marks(positions: jax.Array, bound: int) -> jax.Array:
    """positions [b, s, k] (−1 none) → bool [b, bound]: which positions appear."""
    b = positions.shape[0]
    flat = positions.reshape(b, -1)
    ok = (flat >= 0) & (flat < bound)
    return jnp.zeros((b, bound + 1), bool).at[
        jnp.arange(b)[:, None], jnp.where(ok, flat, bound)].set(True)[:, :bound]


def _common_positions(a: jax.Array, b: jax.Array, bound: int) -> jax.Array:
    """Distinct positions (< bound) that both a and b [n, s, k] hold, summed over n."""
    return (_position_marks(a, bound) & _position_marks(b, bound)).sum(dtype=jnp.int32)


def plan_prefetch(lat: OffloadLatent, layer, predicted: jax.Array,
                  scan_len: int | None = None) -> tuple[OffloadLatent, Resolution]:
    """The layer-ahead prefetch's plan: predicted top-k positions [b, s, k] of `layer`
    (−1 none; positions without a host page dropped) → the predicted rows not resident
    get victim slots now (`resolve`, so the capacity bound holds), flagged loaded
    ahead of need (slot_pref: read later → prefetched_used, evicted unread →
    prefetched_unused). Rows already resident keep their stamps (a prediction is not a
    use, so the eviction order the real selection sees is unchanged for them); the
    victims are stamped with this step. Counts STAT_PREDICTED (distinct predicted
    positions) on `layer` and the loaded-ahead rows the victims evict unread; the
    lookup counters are the real selection's. → (lat, the resolution: its miss_pos /
    victim_slot name the rows to fetch). Exact by construction: the real selection
    later resolves against whatever is resident."""
    b = predicted.shape[0]
    predicted = jnp.where(host_row_ids(lat.page_table, predicted, lat.page_size) >= 0,
                          predicted, -1)
    bound = lookup_bound(lat, scan_len)
    ti = table_index(lat, layer)
    pos0, stamp0, pref0 = lat.slot_pos[ti], lat.slot_stamp[ti], lat.slot_pref[ti]

    def lookup(tables, inputs):
        res = resolve(*tables, *inputs, lat.step, lat.policy, num_positions=bound)
        return (res.slot_pos, res.slot_stamp), (res.slot_ids, res.miss_pos, res.victim_slot,
                                                res.n_miss, res.n_hit, res.n_lookup)

    (pos, stamp), (slot_ids, miss, victim, n_miss, n_hit, n_lookup) = _update_layer_rows(
        (predicted >= 0).any(axis=(1, 2)), (pos0, stamp0), (predicted,),
        (-1, -1, -1, 0, 0, 0), lookup, None)
    rows = jnp.arange(b)[:, None]
    m = pos0.shape[1]
    refilled = jnp.zeros((b, m + 1), bool).at[rows, jnp.where(victim >= 0, victim, m)].set(
        True)[:, :m]
    wasted = (pref0 & refilled).sum(dtype=jnp.int32)
    stamp = jnp.where(refilled, stamp, stamp0)
    n = lat.stats.shape[0]
    counts = jnp.zeros_like(lat.stats).at[:, STAT_PREF_UNUSED].set(
        jnp.where(_group_mask(lat, layer), wasted, 0)).at[:, STAT_PREDICTED].set(
        jnp.where(jnp.arange(n) == layer, n_lookup.sum(dtype=jnp.int32), 0))
    res = Resolution(slot_ids, miss, victim, n_miss, pos, stamp, n_hit, n_lookup)
    return dataclasses.replace(
        lat, slot_pos=lat.slot_pos.at[ti].set(pos), slot_stamp=lat.slot_stamp.at[ti].set(stamp),
        slot_pref=lat.slot_pref.at[ti].set(pref0 | refilled), stats=lat.stats + counts), res


def prefetch_use(pref: jax.Array, slot_ids: jax.Array, victim: jax.Array):
    """One lookup's effect on the rows loaded ahead of need: pref bool [b, m] (those
    rows, not used since), slot_ids [b, s, k] (the slot each selected position reads, −1
    none), victim [b, M] (slots refilled by this lookup's misses, −1 none) → (pref after
    it, rows used now, rows evicted unused). A slot read and not refilled was a hit."""
    b, m = pref.shape
    rows = jnp.arange(b)[:, None]

    def marks(ids):
        flat = ids.reshape(b, -1)
        return jnp.zeros((b, m + 1), bool).at[rows, jnp.where(flat >= 0, flat, m)].set(
            True)[:, :m]
    read, refilled = marks(slot_ids), marks(victim)
    used = pref & read & ~refilled
    wasted = pref & refilled
    return pref & ~read & ~refilled, used.sum(dtype=jnp.int32), wasted.sum(dtype=jnp.int32)


def lookup_bound(lat: OffloadLatent, scan_len: int | None) -> int:
    """The `num_positions` bound `resolve` looks positions up under: the indexer's scan
    length when set (top-k positions all lie below it), else the page-table span. The
    lookup's inverse map and miss bitmap are [b, bound]: at max_context_len (135168)
    they were most of an offloaded step with few requests in many slots."""
    return lat.num_positions if scan_len is None else min(lat.num_positions, scan_len)


def latent_for_attention(lat: OffloadLatent, layer: int, positions: jax.Array,
                         scan_len: int | None = None, shared_ids: jax.Array | None = None):
    """positions [b, s, k] (−1 none, all < scan_len when given) → (lat, rows [b*m, R],
    ids [b, s, k]): every selected row resident in the hot buffer, misses fetched exactly
    from the host pool. The plan is made once per table group: the full layer's call
    fetches the missed rows of every layer in its group in one transfer, and a shared
    layer's call (`shared_ids`: the ids its full layer returned, grouped tables) plans
    and fetches nothing."""
    n_layers, b, m, r = lat.rows.shape
    if shared_ids is not None and lat.groups is not None:
        return lat, lat.rows[layer].reshape(b * m, r), shared_ids
    with jax.named_scope("offload_latent_for_attention"):
        lat, res = resolve_selection(lat, layer, positions, scan_len)
        # Fetch into the whole donated buffer (viewed [L*b, m, R]), in place: fetching
        # into rows[layer] and writing it back copied the layer's hot buffer twice a step.
        members = group_layers(lat, layer)
        rows, moved = fetch_in_jit(lat.rows.reshape(n_layers * b, m, r),
                                   tuple(lat.host[i] for i in members), lat.page_table, res,
                                   lat.page_size, lat.chunk_rows,
                                   row_offset=tuple(i * b for i in members))
        rows = rows.reshape(n_layers, b, m, r)
        moved = jnp.where(_group_mask(lat, layer), jnp.asarray(moved, jnp.int32), 0)
        lat = dataclasses.replace(lat, rows=rows,
                                  stats=lat.stats.at[:, STAT_MOVED].add(moved))
        return lat, rows[layer].reshape(b * m, r), _flat_ids(res.slot_ids, m)


def next_step(lat: OffloadLatent) -> OffloadLatent:
    return dataclasses.replace(lat, step=lat.step + 1)
