"""Miss fetch: bring the rows `resolve` reported missing from the host pool into the hot
buffer. Two paths behind one interface (`MissFetcher`), chosen per backend and measured:

in_jit       inside the jitted step: gather the missed rows from the pinned_host array
             under `compute_on('device_host')` (indices moved to host first), then
             `device_put` to device and scatter into the victim slots. No Python round
             trip. With `chunk_rows` > 0 a `lax.while_loop` moves fixed-size chunks until
             the real miss count is covered, so ~n_miss rows move instead of b*s_q*k
             (works on jax 0.10.2 CPU: compute_on + device_put inside while_loop). For
             storage "file" the gather is a host callback (`jax.pure_callback`).
host_driven  resolution runs jitted; miss lists come back (one sync); numpy gathers
             exactly those rows from a (zero-copy where possible) view of host storage;
             `device_put` sends them, padded to a power-of-two row count so the scatter
             compiles O(log) times; a donated jitted scatter writes the hot buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jlco.offload.host_pool import (
    HostLatentPool,
    host_compute,
    host_row_ids,
    is_host_space,
)
from jlco.offload.hot_buffer import Resolution

FETCH_PATHS = ("in_jit", "host_driven")


@dataclasses.dataclass
class FetchStats:
    """Rows really missed vs rows moved (incl. padding); ints, or int32 scalars on the
    in-jit path (read them when you record metrics, which syncs)."""
    real_rows: object
    moved_rows: object
    wait_s: float = 0.0


def gather_host_rows(host_layer, row_ids: jax.Array, layer=0) -> jax.Array:
    """uint8 [n, R] device rows at host row ids [n] (−1 → row 0, the caller drops them).

    host_layer: a pinned_host jax array (compute_on gather), an unpinned_host one (plain
    gather: jax 0.10 types it as a device operand), or a HostLatentPool with storage
    "file" (host callback reading the memmap)."""
    ids = jnp.maximum(row_ids, 0).astype(jnp.int32)
    if isinstance(host_layer, HostLatentPool):
        pool = host_layer
        spec = jax.ShapeDtypeStruct((ids.shape[0], pool.row_bytes), jnp.uint8)
        return jax.pure_callback(lambda l, i: pool.gather(int(l), i), spec,
                                 jnp.asarray(layer, jnp.int32), ids)
    if not is_host_space(host_layer):
        return host_layer[ids]
    ids = jax.device_put(ids, jax.memory.Space.Host)
    rows = host_compute(lambda p, i: p[i], host_layer, ids)  # plain indexing: jnp.take fails here
    return jax.device_put(rows, jax.memory.Space.Device)


def _flat_misses(n_rows, cap, page_table, res: Resolution, page_size, row_offset):
    """Real misses first, row-major: host ids [b*M] (−1 padded) and flat hot-buffer
    destinations [b*M] into rows.reshape(n_rows*cap, R) (n_rows*cap = none). Each row's
    misses are a prefix (j < n_miss), so an exclusive prefix sum of n_miss places them:
    no sort."""
    b, m = res.miss_pos.shape
    ids = host_row_ids(page_table, res.miss_pos, page_size)
    dest = jnp.where(res.victim_slot >= 0,
                     (row_offset + jnp.arange(b, dtype=jnp.int32))[:, None] * cap
                     + res.victim_slot, n_rows * cap)
    start = jnp.cumsum(res.n_miss) - res.n_miss
    j = jnp.arange(m, dtype=jnp.int32)[None, :]
    at = jnp.where(j < res.n_miss[:, None], start[:, None] + j, b * m).reshape(-1)
    return (jnp.full((b * m,), -1, jnp.int32).at[at].set(ids.reshape(-1), mode="drop"),
            jnp.full((b * m,), n_rows * cap, jnp.int32).at[at].set(dest.reshape(-1), mode="drop"))


def fetch_in_jit(rows: jax.Array, host_layer, page_table: jax.Array, res: Resolution,
                 page_size: int, chunk_rows: int = 0, layer=0, row_offset=0):
    """Pure, for use inside jit. rows uint8 [n, C, R] → (rows, moved_rows int32), where
    the resolution's batch entry i owns rows[row_offset + i] (n = b and offset 0 for one
    layer's hot buffer; an all-layer buffer viewed as [L*b, C, R] with offset layer*b is
    written in place instead of through a copied layer slice).

    chunk_rows 0: one padded gather of b*M rows. chunk_rows > 0: while_loop over chunks
    until sum(n_miss) rows are covered (moved = ceil(total / chunk) * chunk)."""
    n_rows, cap, rb = rows.shape
    b, m = res.miss_pos.shape
    with jax.named_scope("offload_fetch_in_jit"):
        flat = rows.reshape(n_rows * cap, rb)
        if chunk_rows <= 0:
            ids = host_row_ids(page_table, res.miss_pos, page_size).reshape(-1)
            data = gather_host_rows(host_layer, ids, layer)
            dest = jnp.where(res.victim_slot >= 0,
                             (row_offset + jnp.arange(b, dtype=jnp.int32))[:, None] * cap
                             + res.victim_slot, n_rows * cap).reshape(-1)
            return (flat.at[dest].set(data, mode="drop").reshape(n_rows, cap, rb),
                    jnp.int32(b * m))
        ids, dest = _flat_misses(n_rows, cap, page_table, res, page_size, row_offset)
        n = -(-(b * m) // chunk_rows) * chunk_rows
        ids = jnp.pad(ids, (0, n - b * m), constant_values=-1)
        dest = jnp.pad(dest, (0, n - b * m), constant_values=n_rows * cap)
        total = res.n_miss.sum(dtype=jnp.int32)

        def body(carry):
            i, flat = carry
            sl = jax.lax.dynamic_slice(ids, (i * chunk_rows,), (chunk_rows,))
            dl = jax.lax.dynamic_slice(dest, (i * chunk_rows,), (chunk_rows,))
            data = gather_host_rows(host_layer, sl, layer)
            return i + 1, flat.at[dl].set(data, mode="drop")

        steps, flat = jax.lax.while_loop(lambda c: c[0] * chunk_rows < total, body,
                                         (jnp.int32(0), flat))
        return flat.reshape(n_rows, cap, rb), steps * chunk_rows


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_flat(rows, dest, data):
    b, cap, rb = rows.shape
    return rows.reshape(b * cap, rb).at[dest].set(data, mode="drop").reshape(b, cap, rb)


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def fetch_host_driven(rows: jax.Array, pool: HostLatentPool, layer: int,
                      page_table: np.ndarray, res: Resolution, device=None):
    """Python driver (not jittable). rows uint8 [b, C, R] → (rows, FetchStats)."""
    t0 = time.perf_counter()
    miss_pos, victim = jax.device_get((res.miss_pos, res.victim_slot))  # the one sync
    b, cap, rb = rows.shape
    bi, j = np.nonzero(victim >= 0)
    pos = miss_pos[bi, j]
    page_table = np.asarray(page_table)
    page_idx = pos // pool.page_size
    if (page_idx >= page_table.shape[1]).any() or (page_table[bi, np.minimum(
            page_idx, page_table.shape[1] - 1)] < 0).any():
        raise ValueError(f"fetch_host_driven: layer {layer}: a missed position has no host "
                         "page in page_table (reserve pages before decoding)")
    ids = page_table[bi, page_idx] * pool.page_size + pos % pool.page_size
    n = len(ids)
    nb = _bucket(n)
    data = np.zeros((nb, rb), np.uint8)
    with pool.view(layer) as v:
        data[:n] = v[ids]
    dest = np.full(nb, b * cap, np.int32)
    dest[:n] = bi * cap + victim[bi, j]
    data_d, dest_d = jax.device_put((data, dest), device or rows.sharding)
    wait = time.perf_counter() - t0
    return _scatter_flat(rows, dest_d, data_d), FetchStats(n, nb, wait)


class MissFetcher:
    """One interface over both paths: `fetch(rows, layer, page_table, res)` →
    (rows, FetchStats). `rows` is donated."""

    def __init__(self, pool: HostLatentPool, path: str = "in_jit", chunk_rows: int = 0):
        if path not in FETCH_PATHS:
            raise ValueError(f"MissFetcher: path={path!r} is invalid: allowed {FETCH_PATHS}")
        if not isinstance(chunk_rows, int) or chunk_rows < 0:
            raise ValueError(f"MissFetcher: chunk_rows={chunk_rows!r} is invalid: allowed an integer >= 0")
        self.pool, self.path, self.chunk_rows = pool, path, chunk_rows
        self._warned = False
        self._jit = jax.jit(self._in_jit, donate_argnums=0)

    def _in_jit(self, rows, host_layer, page_table, layer, res):
        src = self.pool if host_layer is None else host_layer
        return fetch_in_jit(rows, src, page_table, res, self.pool.page_size,
                            self.chunk_rows, layer)

    def fetch(self, rows, layer: int, page_table, res: Resolution):
        if self.path == "host_driven":
            if not self._warned and not self.pool.zero_copy(layer):
                self._warned = True
                warnings.warn("host_driven fetch: numpy view of the host pool is not zero-copy "
                              "on this backend; every fetch copies a whole layer")
            return fetch_host_driven(rows, self.pool, layer, page_table, res)
        host_layer = None if self.pool.storage == "file" else self.pool.array(layer)
        if host_layer is None:
            self.pool.flush()
        t0 = time.perf_counter()
        rows, moved = self._jit(rows, host_layer, jnp.asarray(page_table, jnp.int32),
                                jnp.int32(layer), res)
        return rows, FetchStats(res.n_miss.sum(), moved, time.perf_counter() - t0)
