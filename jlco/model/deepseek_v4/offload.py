"""DeepSeek-V4's CSA compressed entries offloaded: a host pool per CSA layer with a
device hot buffer, in place of the state's `comp["entries"]` array
(`jlco.model.deepseek_v4.state` reads either).

Each batch slot owns T = max_len // rate host rows (one page of T rows; entry i of slot s
at host row s·T + i), an entry stored as its bytes (head_dim values of the model dtype).
Inside the jitted decode step an entry completed by the step is written to the host pool
(`scatter_to_host`), and the indexer's picks are resolved against the slot's hot buffer
(`jlco.offload.hot_buffer.resolve`: hits, and each distinct miss a victim slot) and the
misses fetched from the host pool (`jlco.offload.fetch.fetch_in_jit`), so attention reads
the very bytes the on-device entries hold: offload on equals offload off bit for bit.
The HCA entries, the window, the open-window buffers and the indexer's keys stay on
device. The prefill runs on a one-request on-device state; `install` copies its entries
to the slot's host rows and empties the slot's hot buffer.

Glossary: b slots, T entries per slot, C hot rows per slot, R bytes per entry, D values.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jlco.offload.fetch import fetch_in_jit
from jlco.offload.host_pool import host_row_ids, scatter_to_host
from jlco.offload.hot_buffer import Resolution, resolve

# Per store, summed over steps: picks resolved (distinct entries of the running slots), in
# the hot buffer, fetched from the host pool, host rows the padded fetch moved, and rows
# the admission warm-ups fetched (`OffloadEntries.warm`, outside the decode steps).
STAT_NAMES = ("lookups", "hits", "misses", "h2d_moved_rows", "warmup_rows")


@partial(jax.tree_util.register_dataclass,
         data_fields=("rows", "slot_pos", "slot_stamp", "host", "page_table", "step",
                      "stats"),
         meta_fields=("width", "dtype", "policy"))
@dataclasses.dataclass(frozen=True)
class OffloadEntries:
    rows: jax.Array          # uint8 [b, C, R] device hot buffer
    slot_pos: jax.Array      # int32 [b, C] entry held by a hot slot, −1 empty
    slot_stamp: jax.Array    # int32 [b, C] last use (LRU) / insertion (FIFO) step
    host: jax.Array          # uint8 [b·T, R] host pool
    page_table: jax.Array    # int32 [b, 1] the slot's page (its index)
    step: jax.Array          # int32 [] decode steps (the stamps)
    stats: jax.Array         # int32 [4] STAT_NAMES, summed over steps
    width: int               # D
    dtype: str
    policy: str = "lru"

    @property
    def entries(self) -> int:
        return self.host.shape[0] // self.page_table.shape[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        """As the on-device entries array's: (b, T, D)."""
        return (self.page_table.shape[0], self.entries, self.width)

    def write(self, rows_idx, idx: jax.Array, entries: jax.Array) -> "OffloadEntries":
        """Entries [b, n, D] at indices idx [b, n] (>= T: none) to the host pool."""
        del rows_idx   # each slot's page is its own
        t = self.entries
        ids = host_row_ids(self.page_table, jnp.where(idx < t, idx, -1), t)
        data = to_bytes(entries.astype(self.dtype))
        return dataclasses.replace(self, host=scatter_to_host(
            self.host, ids.reshape(-1), data.reshape(-1, data.shape[-1])))

    def gather(self, ids: jax.Array, ok: jax.Array) -> tuple[jax.Array, "OffloadEntries"]:
        """The picked entries: ids [b, s, k] (where ok) → ([b, s, k, D], store), hits
        read from the hot buffer, misses fetched from the host pool first."""
        t = self.entries
        res = resolve(self.slot_pos, self.slot_stamp, jnp.where(ok, ids, -1), self.step,
                      self.policy, num_positions=t)
        rows, moved = fetch_in_jit(self.rows, self.host, self.page_table, res, t)
        b = rows.shape[0]
        picked = rows[jnp.arange(b)[:, None, None], jnp.maximum(res.slot_ids, 0)]
        keys = jnp.where(ok[..., None], from_bytes(picked, self.dtype, self.width), 0)
        stats = self.stats + jnp.stack([res.n_lookup.sum(), res.n_hit.sum(),
                                        res.n_miss.sum(), moved, 0]).astype(jnp.int32)
        return keys, dataclasses.replace(self, rows=rows, slot_pos=res.slot_pos,
                                         slot_stamp=res.slot_stamp, step=self.step + 1,
                                         stats=stats)

    def install(self, slot, entries: jax.Array) -> "OffloadEntries":
        """A one-request state's entries [1, T, D] as slot `slot`'s host rows; its hot
        buffer emptied."""
        t = self.entries
        ids = slot * t + jnp.arange(t, dtype=jnp.int32)
        return dataclasses.replace(
            self, host=scatter_to_host(self.host, ids, to_bytes(entries[0].astype(self.dtype))),
            slot_pos=self.slot_pos.at[slot].set(-1), slot_stamp=self.slot_stamp.at[slot].set(-1))


    def warm(self, slot, record: jax.Array) -> "OffloadEntries":
        """ESS's admission warm-up, as the MLA engine's (`jlco.engine.steps.warm_up`): the
        picks of a prefill's last queries, record int32 [w, k] (oldest first, −1 none),
        resolved in order into slot `slot`'s (empty) table, query q stamped step − w + q
        (older than the next decode step), then every entry the table ends up holding
        fetched from the host pool (which `install` has just written) in one gather."""
        t, w = self.entries, record.shape[0]

        def body(q, carry):
            pos, stamp = carry
            res = resolve(pos[None], stamp[None], record[q][None, None], self.step - w + q,
                          self.policy, num_positions=t)
            return res.slot_pos[0], res.slot_stamp[0]
        pos, stamp = jax.lax.fori_loop(0, w, body, (self.slot_pos[slot], self.slot_stamp[slot]))
        held = pos >= 0
        plan = Resolution(   # load every held slot with its entry's row
            slot_ids=None, miss_pos=jnp.where(held, pos, -1)[None],
            victim_slot=jnp.where(held, jnp.arange(pos.shape[0], dtype=jnp.int32), -1)[None],
            n_miss=held.sum(dtype=jnp.int32)[None], slot_pos=None, slot_stamp=None,
            n_hit=None, n_lookup=None)
        rows, _ = fetch_in_jit(self.rows, self.host, self.page_table[slot][None], plan, t,
                               row_offset=slot)
        return dataclasses.replace(
            self, rows=rows, slot_pos=self.slot_pos.at[slot].set(pos),
            slot_stamp=self.slot_stamp.at[slot].set(stamp),
            stats=self.stats.at[STAT_NAMES.index("warmup_rows")].add(held.sum()))


def oldest_first(picks: jax.Array, pos) -> jax.Array:
    """A `picks` ring [w, k] (query p at row p % w) of a request at `pos` tokens → its
    last w queries' picks, oldest first (rows before position 0: none, −1)."""
    w = picks.shape[0]
    return picks[(pos - w + jnp.arange(w)) % w]


def to_bytes(x: jax.Array) -> jax.Array:
    """[..., D] values → uint8 [..., D·itemsize], their bytes."""
    raw = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return raw.reshape(*x.shape[:-1], -1) if raw.ndim > x.ndim else raw


def from_bytes(raw: jax.Array, dtype: str, width: int) -> jax.Array:
    """uint8 [..., D·itemsize] → [..., D] of `dtype` (the bytes `to_bytes` wrote)."""
    size = jnp.dtype(dtype).itemsize
    if size == 1:
        return jax.lax.bitcast_convert_type(raw, jnp.dtype(dtype))
    return jax.lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], width, size),
                                        jnp.dtype(dtype))


def offload_entries(batch: int, entries: int, width: int, dtype: str, capacity: int,
                    storage: str = "pinned_host", policy: str = "lru") -> OffloadEntries:
    """An empty store: b slots of `entries` host rows, `capacity` hot rows each."""
    row = width * jnp.dtype(dtype).itemsize
    host = jax.device_put(np.zeros((batch * entries, row), np.uint8), SingleDeviceSharding(
        jax.devices()[0], memory_kind=storage))
    return OffloadEntries(
        jnp.zeros((batch, capacity, row), jnp.uint8), jnp.full((batch, capacity), -1, jnp.int32),
        jnp.full((batch, capacity), -1, jnp.int32), host,
        jnp.arange(batch, dtype=jnp.int32)[:, None], jnp.int32(0),
        jnp.zeros((len(STAT_NAMES),), jnp.int32),
        width, str(jnp.dtype(dtype)), policy)


def offload_state(cfg, state: dict, capacity: int, storage: str = "pinned_host",
                  policy: str = "lru") -> dict:
    """`state` (init_state's) with every CSA layer's compressed entries offloaded."""
    from jlco.model.deepseek_v4.config import CSA
    layers = []
    for kind, st in zip(cfg.layer_types, state["layers"]):
        if kind == CSA:
            b, t, d = st["comp"]["entries"].shape
            st = dict(st, comp=dict(st["comp"], entries=offload_entries(
                b, t, d, st["comp"]["entries"].dtype, capacity, storage, policy)))
        layers.append(st)
    return dict(state, layers=layers)


def install(batch: dict, slot, one: dict) -> dict:
    """`state.install` for a batch whose CSA entries are offloaded: those go to the slot's
    host rows (`OffloadEntries.install`), every other leaf into its slot; a prefill that
    recorded its picks (`init_state(record=w)`) warms the slot's hot buffer with them."""
    def put(big, row):
        return big.at[slot].set(row[0])
    layers = []
    for big, small in zip(batch["layers"], one["layers"]):
        out = {}
        for name, part in big.items():
            if isinstance(part, dict) and isinstance(part.get("entries"), OffloadEntries):
                rest = {k: v for k, v in part.items() if k != "entries"}
                out[name] = dict(jax.tree.map(put, rest, {k: small[name][k] for k in rest}),
                                 entries=part["entries"].install(slot, small[name]["entries"]))
            else:
                out[name] = jax.tree.map(put, part, small[name])
        if "picks" in small and isinstance(out.get("comp", {}).get("entries"), OffloadEntries):
            out["comp"]["entries"] = out["comp"]["entries"].warm(
                slot, oldest_first(small["picks"][0], one["pos"][0]))
        layers.append(out)
    return {"pos": put(batch["pos"], one["pos"]), "layers": layers}


def entry_stats(state: dict) -> dict[str, int]:
    """STAT_NAMES of the offloaded entries, summed over layers and steps."""
    total = np.asarray(layer_stats(state)).sum(axis=0)
    return dict(zip(STAT_NAMES, (int(v) for v in total)))


def layer_stats(state: dict) -> jax.Array:
    """int32 [layers, STAT_NAMES] so far, per model layer: a layer without offloaded
    entries (sliding, HCA) has a row of zeros. Traceable: a step's counters are the
    difference of this after and before it."""
    rows = [st["comp"]["entries"].stats
            if isinstance(st.get("comp", {}).get("entries"), OffloadEntries)
            else jnp.zeros((len(STAT_NAMES),), jnp.int32) for st in state["layers"]]
    return jnp.stack(rows)
