"""Device hot buffer: per request, per layer, the latent rows reused across steps.

The sparse MLA kernel reads `rows[slot_ids]`, so every selected context position must be
resident before attention: `resolve` maps the step's top-k positions to slots (hit → its
slot; each distinct miss → a victim slot that this step does not reference) and says
which positions to fetch. Static shapes throughout so it runs inside `jax.jit`. The
buffer's slots per request and layer are `Config.hot_buffer_rows`; inside functions
here and in `jlco.offload.fetch` that count is the short local `cap` (or `capacity`).

Victim order is (empty first, then oldest stamp, then lowest position): LRU stamps a slot
with its last-use step, FIFO with its insertion step. Ties inside one step go by
position, so the policy is fully determined and an OrderedDict model (`ReferenceCache`)
reproduces it hit for hit.

No sorts on the engine's path: XLA:CPU sorts made resolution the costliest part of an
offloaded step (~60 ms per layer at b 8, C 2048, k 1024). Victims come from an exact
bitwise k-th-smallest descent over (stamp, position), and the k-th smallest missed
position goes to the k-th victim in slot order. Given `num_positions` (the context
bound), hits come from an inverse map position → slot and the distinct misses, in
order, from a miss bitmap with bit-packed prefix counts; without it a sort-based lookup
gives the same result.
"""

from __future__ import annotations

import collections
from typing import Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

POLICIES = ("lru", "fifo")
_BIG = np.iinfo(np.int32).max


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


def check_capacity(capacity: int, s_q: int, topk: int) -> None:
    """Every selected row must be resident at once: capacity >= s_q * topk
    (`Config.min_hot_buffer_rows` = index_topk * (1 + num_draft_tokens))."""
    if capacity < s_q * topk:
        raise ValueError(f"hot buffer capacity={capacity} is too small: the minimum is "
                         f"s_q * topk = {s_q} * {topk} = {s_q * topk} "
                         "(cache.hot_buffer_rows >= Config.min_hot_buffer_rows)")


def _sorted_lookup(slot_pos, flat):
    """One batch entry, no bound on positions: sort-based lookup. slot_pos [C], flat [M]
    → (hit_slot [M], miss_pos [M] distinct misses ascending, −1 padded; miss_rank [M]
    index into miss_pos of each missing entry, −1 for hits and invalid ones)."""
    order = jnp.argsort(slot_pos)
    keys = slot_pos[order]
    i = jnp.minimum(jnp.searchsorted(keys, flat), slot_pos.shape[0] - 1)
    hit_slot = jnp.where((keys[i] == flat) & (flat >= 0), order[i], -1).astype(jnp.int32)
    miss = (flat >= 0) & (hit_slot < 0)
    uniq = jnp.sort(jnp.where(miss, flat, _BIG))
    first = jnp.concatenate([jnp.ones((1,), bool), uniq[1:] != uniq[:-1]]) & (uniq != _BIG)
    miss_sorted = jnp.sort(jnp.where(first, uniq, _BIG))
    miss_pos = jnp.where(miss_sorted == _BIG, -1, miss_sorted).astype(jnp.int32)
    rank = jnp.searchsorted(miss_sorted, flat).astype(jnp.int32)
    return hit_slot, miss_pos, jnp.where(miss, rank, -1)


def _row_scatter(n: int, fill, idx, vals):
    """[b, n] array of `fill` with out[i, idx[i, j]] = vals[i, j]; idx outside [0, n)
    dropped. One flat 1-D scatter: XLA:CPU's 2-D index scatters cost ~1.4x more."""
    b = idx.shape[0]
    vals = jnp.broadcast_to(vals, idx.shape)
    flat = jnp.where((idx >= 0) & (idx < n), jnp.arange(b, dtype=jnp.int32)[:, None] * n + idx,
                     b * n)
    out = jnp.full((b * n,), fill, vals.dtype)
    return out.at[flat.reshape(-1)].set(vals.reshape(-1), mode="drop").reshape(b, n)


def _row_gather(table, idx):
    """table [b, n] at idx [b, q] (clipped into [0, n)), as one flat gather."""
    b, n = table.shape
    flat = jnp.arange(b, dtype=jnp.int32)[:, None] * n + jnp.clip(idx, 0, n - 1)
    return table.reshape(-1)[flat]


def _bit_prefix(bits):
    """bits bool [b, n] → (words uint32 [b, W], before int32 [b, W]): the bits packed 32
    to a word and the set bits in all earlier words. Prefix counts this way cost a
    cumsum over n/32 words; XLA:CPU's cumsum over n (a reduce_window) took ~13 ms for
    [16, 32768]."""
    b, n = bits.shape
    w = -(-n // 32)
    padded = jnp.pad(bits, ((0, 0), (0, w * 32 - n))).reshape(b, w, 32).astype(jnp.uint32)
    words = jnp.sum(padded << jnp.arange(32, dtype=jnp.uint32), axis=2, dtype=jnp.uint32)
    count = jax.lax.population_count(words).astype(jnp.int32)
    return words, jnp.cumsum(count, axis=1) - count


def _count_below(words, before, idx):
    """Set bits at indices < idx (int32 [b, q], each in [0, n)) of `_bit_prefix`'s bits."""
    low = _row_gather(words, idx >> 5) & (
        jnp.left_shift(jnp.uint32(1), (idx & 31).astype(jnp.uint32)) - jnp.uint32(1))
    return _row_gather(before, idx >> 5) + jax.lax.population_count(low).astype(jnp.int32)


def _ranks(bits):
    """Exclusive prefix count at every index of bits bool [b, n] → int32 [b, n]."""
    b, n = bits.shape
    words, before = _bit_prefix(bits)
    below = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32)) - jnp.uint32(1)
    within = jax.lax.population_count(words[:, :, None] & below).astype(jnp.int32)
    return (before[:, :, None] + within).reshape(b, -1)[:, :n]


def _mapped_lookup(slot_pos, flat, num_positions: int):
    """`_sorted_lookup` for a batch [b, C] / [b, M] whose positions are < num_positions,
    without sorts: an inverse map position → slot (scatter of the table) gives the hits
    by a gather, and a miss bitmap over positions with its prefix counts gives the
    distinct misses in ascending order and each one's rank. O(b·(T + C + M)) element
    work; the sorts it replaces cost ~60 ms per layer at b 8, C 2048, M 1024 on XLA:CPU."""
    cap, t = slot_pos.shape[1], num_positions
    slot_of = _row_scatter(t, -1, slot_pos, jnp.arange(cap, dtype=jnp.int32)[None])
    valid = (flat >= 0) & (flat < t)
    hit_slot = jnp.where(valid, _row_gather(slot_of, flat), -1)
    miss = valid & (hit_slot < 0)
    bitmap = _row_scatter(t, False, jnp.where(miss, flat, -1), True)
    rank = jnp.where(miss, _count_below(*_bit_prefix(bitmap), jnp.clip(flat, 0, t - 1)), -1)
    miss_pos = _row_scatter(flat.shape[1], -1, rank, flat)
    return hit_slot, miss_pos, rank


def _kth_smallest(x, k):
    """Per row of x int32 [b, C] (values >= 0; _BIG = excluded) the k-th smallest value
    (k int32 [b]; rows with k = 0 give 0), by a bitwise descent: the largest v with
    count(x < v) < k. As many O(b·C) passes as the largest value has bits — a handful
    for slot stamps, log2(context) for positions, none when no row needs one."""
    top = jnp.max(jnp.where((x < _BIG) & (k > 0)[:, None], x, 0))
    nbits = 32 - jax.lax.clz(top)

    def body(i, ans):
        cand = ans | jnp.left_shift(jnp.int32(1), nbits - 1 - i)
        return jnp.where((x < cand[:, None]).sum(1, dtype=jnp.int32) < k, cand, ans)

    nbits = jnp.where(jnp.any(k > 0), nbits, 0)
    return jax.lax.fori_loop(0, nbits, body, jnp.zeros(x.shape[:1], jnp.int32))


def _smallest(mask, key, need, tiebreak=None):
    """mask bool [b, C] → the `need` [b] entries of mask smallest by (key, tiebreak,
    slot index); mask must hold at least `need` per row. Rows taking all of their mask
    and rows taking none cost no descent; ties on `key` are broken by a descent over
    `tiebreak`, or, when it is None, by slot index (prefix counts, no descent)."""
    def norm(sel, v):
        lo = jnp.min(jnp.where(sel, v, _BIG), axis=1, keepdims=True)
        return jnp.where(sel, v - lo, _BIG)
    part = (need > 0) & (need < mask.sum(1, dtype=jnp.int32))
    k = jnp.where(part, need, 0)
    s = norm(mask, key)
    t1 = _kth_smallest(s, k)
    below = s < t1[:, None]
    tie = mask & (s == t1[:, None])
    k2 = (k - below.sum(1, dtype=jnp.int32))[:, None]
    if tiebreak is None:
        within = _ranks(tie) < k2
    else:
        p = norm(tie, tiebreak)
        within = p <= _kth_smallest(p, k2[:, 0])[:, None]
    sel = (below | (tie & within)) & part[:, None]
    return mask & (sel | ((need > 0) & ~part)[:, None])


def _choose_victims(slot_pos, slot_stamp, referenced, n_miss):
    """bool [b, C]: n_miss slots per row in the policy's order — empty first, then oldest
    stamp, then lowest position (then lowest slot, which only separates empty slots) —
    never one referenced this step. Exact selection without sorting the table."""
    empty = slot_pos < 0
    n_empty = empty.sum(1, dtype=jnp.int32)
    take = _smallest(empty, slot_stamp, jnp.minimum(n_miss, n_empty))
    return take | _smallest(~empty & ~referenced, slot_stamp,
                            jnp.maximum(n_miss - n_empty, 0), tiebreak=slot_pos)


def _assign(slot_pos, slot_stamp, hit_slot, miss_pos, miss_rank, step, lru: bool):
    """Victims for the misses and the updated table. The k-th smallest missed position
    goes to the k-th victim in slot order (the victim SET follows the policy; which of
    them holds which position does not change any later decision)."""
    cap = slot_pos.shape[1]
    m = miss_pos.shape[1]
    n_miss = (miss_pos >= 0).sum(1, dtype=jnp.int32)
    referenced = _row_scatter(cap, False, hit_slot, True)
    take = _choose_victims(slot_pos, slot_stamp, referenced, n_miss)
    vrank = _ranks(take)
    victim = _row_scatter(m, -1, jnp.where(take, vrank, -1),
                          jnp.arange(cap, dtype=jnp.int32)[None])
    new_pos = jnp.where(take, _row_gather(miss_pos, vrank), slot_pos)
    stamped = take | referenced if lru else take
    new_stamp = jnp.where(stamped, step, slot_stamp)
    slot_ids = jnp.where(hit_slot >= 0, hit_slot,
                         jnp.where(miss_rank >= 0, _row_gather(victim, miss_rank), -1))
    n_hit = referenced.sum(1, dtype=jnp.int32)
    return (slot_ids.astype(jnp.int32), miss_pos, victim, n_miss, new_pos, new_stamp, n_hit,
            n_hit + n_miss)


def resolve(slot_pos: jax.Array, slot_stamp: jax.Array, positions: jax.Array, step,
            policy: str = "lru", num_positions: int | None = None) -> Resolution:
    """Map positions int32 [b, s_q, k] (−1 invalid) to slots of a [b, C] table.

    `step` (int32 scalar, may be traced) stamps the slots used; `policy` is static.
    Duplicated positions within the step share one slot and one fetch.
    `num_positions` (static): a bound on positions (the context length); with it the
    lookup runs without sorts (positions >= it are treated as invalid). Without it a
    sort-based lookup gives the same result.
    """
    if policy not in POLICIES:
        raise ValueError(f"resolve: policy={policy!r} is invalid: allowed {POLICIES}")
    if positions.ndim != 3 or slot_pos.ndim != 2 or slot_pos.shape != slot_stamp.shape:
        raise ValueError(f"resolve: expected positions [b, s_q, k] and slot tables [b, C]; got "
                         f"{positions.shape}, {slot_pos.shape}, {slot_stamp.shape}")
    if num_positions is not None and (not isinstance(num_positions, int) or num_positions < 1):
        raise ValueError(f"resolve: num_positions={num_positions!r} is invalid: allowed None "
                         "or an integer >= 1")
    b, s_q, k = positions.shape
    check_capacity(slot_pos.shape[1], s_q, k)
    step = jnp.asarray(step, jnp.int32)
    flat = positions.reshape(b, s_q * k).astype(jnp.int32)
    with jax.named_scope("hot_buffer_resolve"):
        if num_positions is None:
            hit_slot, miss_pos, rank = jax.vmap(_sorted_lookup)(slot_pos, flat)
        else:
            hit_slot, miss_pos, rank = _mapped_lookup(slot_pos, flat, num_positions)
        slot_ids, *rest = _assign(slot_pos, slot_stamp, hit_slot, miss_pos, rank, step,
                                  policy == "lru")
    return Resolution(slot_ids.reshape(b, s_q, k), *rest)


def scatter_rows(rows: jax.Array, slots: jax.Array, data: jax.Array) -> jax.Array:
    """rows [b, C, R] with rows[i, slots[i, j]] = data[i, j]; −1 slots are skipped."""
    cap = rows.shape[1]
    dest = jnp.where(slots < 0, cap, slots)
    return jax.vmap(lambda r, d, x: r.at[d].set(x, mode="drop"))(rows, dest, data)


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
    invalid; slot_pos [C]; slot_stamp [C]). Victims in `resolve`'s order (tier, stamp,
    position, slot); the k-th smallest missed position goes to the k-th victim in slot
    order, as `resolve` pairs them."""
    cap, n = slot_pos.shape[0], new_pos.shape[0]
    eq = slot_pos[None, :] == new_pos[:, None]                                 # [n, C]
    hit = eq.any(axis=1) & (new_pos >= 0)
    hit_slot = jnp.where(hit, jnp.argmax(eq, axis=1), -1).astype(jnp.int32)
    dup = jnp.tril(new_pos[:, None] == new_pos[None, :], -1).any(axis=1)
    miss = (new_pos >= 0) & ~hit & ~dup
    referenced = jnp.zeros((cap,), bool).at[jnp.where(hit, hit_slot, cap)].set(True, mode="drop")
    tier = jnp.where(referenced, 2, 0) + (slot_pos >= 0)
    big = jnp.iinfo(jnp.int32).max
    missed = jnp.sort(jnp.where(miss, new_pos, big))
    chosen = []
    for j in range(n):
        v = _lexmin_slot((tier, slot_stamp, slot_pos))
        take = missed[j] != big
        chosen.append(jnp.where(take, v, cap))
        tier = jnp.where(take, tier.at[v].set(4), tier)   # taken: never chosen again
    victims = jnp.sort(jnp.stack(chosen))   # slot order, unused (cap) last, as resolve pairs
    new_p = slot_pos.at[victims].set(missed, mode="drop")
    new_s = slot_stamp.at[victims].set(step, mode="drop")
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
