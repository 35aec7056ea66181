"""Device hot buffer: per request, per layer, the latent rows reused across steps.

The sparse MLA kernel reads `rows[slot_ids]`, so every selected context position must be
resident before attention: `resolve` maps the step's top-k positions to slots (hit → its
slot; each distinct miss → a victim slot that this step does not reference) and says
which positions to fetch. Static shapes throughout so it runs inside `jax.jit`.

Victim order is (empty first, then oldest stamp, then lowest position): LRU stamps a slot
with its last-use step, FIFO with its insertion step. Ties inside one step go by
position, so the policy is fully determined and an OrderedDict model (`ReferenceCache`)
reproduces it hit for hit.
"""

from __future__ import annotations

import collections
from typing import Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

POLICIES = ("lru", "fifo")
_BIG = np.iinfo(np.int32).max


class HotBuffer(NamedTuple):
    """rows uint8 [L, b, C, row_bytes]; slot_pos int32 [L, b, C] (context position held,
    −1 empty); slot_stamp int32 [L, b, C] (last use for LRU, insertion for FIFO)."""
    rows: jax.Array
    slot_pos: jax.Array
    slot_stamp: jax.Array


class Resolution(NamedTuple):
    """One layer's lookup. M = s_q * k. Counts are of DISTINCT valid positions."""
    slot_ids: jax.Array     # int32 [b, s_q, k], −1 where the position is invalid
    miss_pos: jax.Array     # int32 [b, M] distinct missed positions ascending, −1 padded
    victim_slot: jax.Array  # int32 [b, M] slot receiving miss_pos[i], −1 padded
    n_miss: jax.Array       # int32 [b]
    slot_pos: jax.Array     # int32 [b, C] table after this step
    slot_stamp: jax.Array   # int32 [b, C]
    n_hit: jax.Array        # int32 [b]
    n_lookup: jax.Array     # int32 [b]


def init_hot_buffer(num_layers: int, batch: int, capacity: int, row_bytes: int) -> HotBuffer:
    shape = (num_layers, batch, capacity)
    return HotBuffer(jnp.zeros((*shape, row_bytes), jnp.uint8),
                     jnp.full(shape, -1, jnp.int32), jnp.full(shape, -1, jnp.int32))


def clear_requests(hb: HotBuffer, free: jax.Array) -> HotBuffer:
    """Empty every slot of the batch entries where `free` [b] is True (finished/aborted
    request, or a new one taking the batch slot): slots have one owner too."""
    m = free[None, :, None]
    return hb._replace(slot_pos=jnp.where(m, -1, hb.slot_pos),
                       slot_stamp=jnp.where(m, -1, hb.slot_stamp))


def check_capacity(capacity: int, s_q: int, topk: int) -> None:
    """Every selected row must be resident at once: capacity >= s_q * topk
    (`Config.min_staging_capacity` = index_topk * (1 + num_draft_tokens))."""
    if capacity < s_q * topk:
        raise ValueError(f"hot buffer capacity={capacity} is too small: the minimum is "
                         f"s_q * topk = {s_q} * {topk} = {s_q * topk} "
                         "(cache.staging_capacity >= Config.min_staging_capacity)")


def _lookup(table: jax.Array, queries: jax.Array) -> jax.Array:
    """Slot holding each query position in `table` [C] (distinct entries ≥ 0), else −1."""
    order = jnp.argsort(table)
    keys = table[order]
    i = jnp.minimum(jnp.searchsorted(keys, queries), table.shape[0] - 1)
    return jnp.where((keys[i] == queries) & (queries >= 0), order[i], -1).astype(jnp.int32)


def _resolve_row(slot_pos, slot_stamp, flat, step, lru: bool):
    """One batch entry: slot_pos/slot_stamp [C], flat [M] positions (−1 invalid)."""
    cap, m = slot_pos.shape[0], flat.shape[0]
    uniq = jnp.sort(jnp.where(flat >= 0, flat, _BIG))
    first = jnp.concatenate([jnp.ones((1,), bool), uniq[1:] != uniq[:-1]]) & (uniq != _BIG)
    u_slot = _lookup(slot_pos, jnp.where(first, uniq, -1))
    u_hit, u_miss = first & (u_slot >= 0), first & (u_slot < 0)
    n_miss = u_miss.sum(dtype=jnp.int32)
    miss_sorted = jnp.sort(jnp.where(u_miss, uniq, _BIG))
    miss_pos = jnp.where(miss_sorted == _BIG, -1, miss_sorted)
    hit_slots = jnp.where(u_hit, u_slot, cap)
    referenced = jnp.zeros((cap,), jnp.int32).at[hit_slots].set(1, mode="drop")
    tier = 2 * referenced + (slot_pos >= 0)  # 0: empty, 1: evictable, 2-3: in use now
    *_, order = jax.lax.sort((tier, slot_stamp, slot_pos, jnp.arange(cap, dtype=jnp.int32)),
                             num_keys=3)
    victim = jnp.where(jnp.arange(m) < n_miss, order[:m], -1).astype(jnp.int32)
    dest = jnp.where(victim >= 0, victim, cap)
    new_pos = slot_pos.at[dest].set(miss_pos, mode="drop")
    new_stamp = slot_stamp.at[dest].set(step, mode="drop")
    if lru:
        new_stamp = new_stamp.at[hit_slots].set(step, mode="drop")
    slot_ids = _lookup(new_pos, flat)
    return (slot_ids, miss_pos, victim, n_miss, new_pos, new_stamp,
            u_hit.sum(dtype=jnp.int32), first.sum(dtype=jnp.int32))


def resolve(slot_pos: jax.Array, slot_stamp: jax.Array, positions: jax.Array, step,
            policy: str = "lru") -> Resolution:
    """Map positions int32 [b, s_q, k] (−1 invalid) to slots of a [b, C] table.

    `step` (int32 scalar, may be traced) stamps the slots used; `policy` is static.
    Duplicated positions within the step share one slot and one fetch.
    """
    if policy not in POLICIES:
        raise ValueError(f"resolve: policy={policy!r} is invalid: allowed {POLICIES}")
    if positions.ndim != 3 or slot_pos.ndim != 2 or slot_pos.shape != slot_stamp.shape:
        raise ValueError(f"resolve: expected positions [b, s_q, k] and slot tables [b, C]; got "
                         f"{positions.shape}, {slot_pos.shape}, {slot_stamp.shape}")
    b, s_q, k = positions.shape
    check_capacity(slot_pos.shape[1], s_q, k)
    step = jnp.asarray(step, jnp.int32)
    with jax.named_scope("hot_buffer_resolve"):
        out = jax.vmap(_resolve_row, in_axes=(0, 0, 0, None, None))(
            slot_pos, slot_stamp, positions.reshape(b, s_q * k).astype(jnp.int32), step,
            policy == "lru")
    slot_ids, *rest = out
    return Resolution(slot_ids.reshape(b, s_q, k), *rest)


def scatter_rows(rows: jax.Array, slots: jax.Array, data: jax.Array) -> jax.Array:
    """rows [b, C, R] with rows[i, slots[i, j]] = data[i, j]; −1 slots are skipped."""
    cap = rows.shape[1]
    dest = jnp.where(slots < 0, cap, slots)
    return jax.vmap(lambda r, d, x: r.at[d].set(x, mode="drop"))(rows, dest, data)


def gather_slots(rows: jax.Array, slot_ids: jax.Array) -> jax.Array:
    """rows [b, C, R] at slot_ids [b, s_q, k] → [b, s_q, k, R] (zeros where −1): what
    the sparse attention kernel reads."""
    g = jax.vmap(lambda r, s: r[jnp.maximum(s, 0)])(rows, slot_ids)
    return jnp.where((slot_ids >= 0)[..., None], g, 0).astype(rows.dtype)


def insert_new(rows: jax.Array, slot_pos: jax.Array, slot_stamp: jax.Array,
               new_pos: jax.Array, new_rows: jax.Array, step, policy: str = "lru"):
    """Put the newest token(s)' rows (new_pos [b, n], new_rows [b, n, R]) in the hot
    buffer: they are almost always selected next step, and inserting now saves the
    fetch. Same victim rule and result as `resolve`, but without its sorts over the slot
    table (n is 1 + drafts): a few O(C) reductions per new token instead, since XLA:CPU
    sorts made this the costliest part of an offloaded decode step.
    Returns (rows, slot_pos, slot_stamp)."""
    slots, slot_pos, slot_stamp = insert_slots(slot_pos, slot_stamp, new_pos, step, policy)
    return scatter_rows(rows, slots, new_rows), slot_pos, slot_stamp


def insert_slots(slot_pos: jax.Array, slot_stamp: jax.Array, new_pos: jax.Array, step,
                 policy: str = "lru"):
    """`insert_new` without the row write: → (slots int32 [b, n], −1 where new_pos is
    invalid; slot_pos; slot_stamp), so a caller can scatter the rows straight into a
    bigger (e.g. all-layer, donated) array instead of a copied slice of it."""
    if policy not in POLICIES:
        raise ValueError(f"insert_new: policy={policy!r} is invalid: allowed {POLICIES}")
    step = jnp.asarray(step, jnp.int32)
    with jax.named_scope("hot_buffer_insert_new"):
        return jax.vmap(_insert_row, in_axes=(0, 0, 0, None, None))(
            slot_pos, slot_stamp, new_pos.astype(jnp.int32), step, policy == "lru")


def _insert_row(slot_pos, slot_stamp, new_pos, step, lru: bool):
    """One batch entry of `insert_new`: new_pos [n] → (slot of each [n], −1 where
    invalid; slot_pos [C]; slot_stamp [C]). Misses take victims in `_resolve_row`'s order
    (tier, stamp, position, slot), lowest missed position first."""
    cap, n = slot_pos.shape[0], new_pos.shape[0]
    eq = slot_pos[None, :] == new_pos[:, None]                                 # [n, C]
    hit = eq.any(axis=1) & (new_pos >= 0)
    hit_slot = jnp.where(hit, jnp.argmax(eq, axis=1), -1).astype(jnp.int32)
    dup = jnp.tril(new_pos[:, None] == new_pos[None, :], -1).any(axis=1)
    miss = (new_pos >= 0) & ~hit & ~dup
    referenced = jnp.zeros((cap,), bool).at[jnp.where(hit, hit_slot, cap)].set(True, mode="drop")
    tier = jnp.where(referenced, 2, 0) + (slot_pos >= 0)
    big = jnp.iinfo(jnp.int32).max
    new_p, new_s = slot_pos, slot_stamp
    missed = jnp.sort(jnp.where(miss, new_pos, big))
    for j in range(n):
        p = missed[j]
        v = _lexmin_slot((tier, slot_stamp, slot_pos))
        take = p != big
        new_p = jnp.where(take, new_p.at[v].set(p), new_p)
        new_s = jnp.where(take, new_s.at[v].set(step), new_s)
        tier = jnp.where(take, tier.at[v].set(4), tier)   # taken: never chosen again
    if lru:
        new_s = new_s.at[jnp.where(hit, hit_slot, cap)].set(step, mode="drop")
    eq = new_p[None, :] == new_pos[:, None]
    slots = jnp.where(eq.any(axis=1) & (new_pos >= 0), jnp.argmax(eq, axis=1), -1)
    return slots.astype(jnp.int32), new_p, new_s


def _lexmin_slot(keys) -> jax.Array:
    """Index of the lexicographically smallest (keys..., slot index) entry, by O(C)
    reductions instead of a sort."""
    mask = jnp.ones(keys[0].shape, bool)
    for k in keys:
        m = jnp.min(jnp.where(mask, k, jnp.iinfo(jnp.int32).max))
        mask &= k == m
    return jnp.argmax(mask).astype(jnp.int32)


class ReferenceCache:
    """Plain-Python model of one request's hot buffer (positions only), written with an
    OrderedDict whose front is the next victim. Independent of `resolve` on purpose:
    tests require the same hits and the same resident set step by step."""

    def __init__(self, capacity: int, policy: str = "lru"):
        if policy not in POLICIES:
            raise ValueError(f"ReferenceCache: policy={policy!r} is invalid: allowed {POLICIES}")
        self.capacity, self.policy = capacity, policy
        self.order: collections.OrderedDict[int, None] = collections.OrderedDict()

    def step(self, positions: Iterable[int]) -> tuple[int, int]:
        """Look up one step's positions; returns (distinct hits, distinct misses)."""
        want = sorted({int(p) for p in positions if p >= 0})
        hits = {p for p in want if p in self.order}
        misses = [p for p in want if p not in hits]
        if len(want) > self.capacity:
            raise ValueError(f"ReferenceCache: {len(want)} distinct positions > capacity {self.capacity}")
        to_evict = max(0, len(self.order) + len(misses) - self.capacity)
        victims = []
        for p in self.order:
            if len(victims) == to_evict:
                break
            if p not in hits:
                victims.append(p)
        for p in victims:
            del self.order[p]
        for p in want:
            if p not in hits:
                self.order[p] = None
            elif self.policy == "lru":
                self.order.move_to_end(p)
        return len(hits), len(misses)

    def resident(self) -> set[int]:
        return set(self.order)
