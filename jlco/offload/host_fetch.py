"""Host-driven miss fetch: the transfer of `cache.fetch_path="host_driven"`, the one the
engine runs and tools/bench_fetch.py measures.

The jitted selection hands back a miss list (`miss_list`: host row ids and flat
hot-buffer destinations); `HostFetcher` takes it back in one sync, numpy gathers exactly
those rows from a scoped view of the pool (zero-copy where the backend allows it; where
not, every fetch copies a whole layer, which is warned once), `jax.device_put` sends
them in chunks of at most `chunk_rows` rows, each padded to a power of two so the
scatter compiles O(log) times, and a donated jitted scatter writes them into the victim
slots of the all-layer hot buffer in place. A large miss list is gathered on threads
(numpy's take releases the GIL), so later chunks gather while earlier ones transfer.
An IndexShare group (a full layer and the shared layers reusing its top-k) has one miss
list: `fetch` / `send` take the group's layers, gather each one's rows at the same ids
into one [G, n, R] buffer, and move it in one `device_put` per chunk.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jlco.offload.host_pool import HostLatentPool, host_row_ids
from jlco.offload.hot_buffer import Resolution
from jlco.util.buckets import pow2_bucket

MIN_ROWS_PER_THREAD = 1024   # below this a split gather costs more than it saves


def miss_list(res: Resolution, page_table: jax.Array, page_size: int, capacity: int,
              b0=0) -> tuple[jax.Array, jax.Array]:
    """Inside jit: the resolution of batch entries [b0, b0+nb) (page_table: their rows
    [nb, P]) → (host row ids int32 [nb, M], flat destinations int32 [nb, M] into
    rows[layer].reshape(b * capacity, R)), −1 = none: what `HostFetcher.fetch` takes."""
    nb = res.miss_pos.shape[0]
    slot0 = (b0 + jnp.arange(nb, dtype=jnp.int32))[:, None] * capacity
    dest = jnp.where(res.victim_slot >= 0, slot0 + res.victim_slot, -1)
    return host_row_ids(page_table, res.miss_pos, page_size), dest


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(rows, layers, dest, data):
    """rows[layers[g]].flat[dest] = data[g] for each layer g of a group (layers int32
    [G], dest [n] with −1 / past the end dropped, data [G, n, R])."""
    n_layers, b, m, r = rows.shape
    end = n_layers * b * m
    at = jnp.where((dest >= 0) & (dest < b * m), layers[:, None] * (b * m) + dest[None], end)
    flat = rows.reshape(end, r).at[at.reshape(-1)].set(data.reshape(-1, r), mode="drop")
    return flat.reshape(n_layers, b, m, r)


class HostFetcher:
    """Fetches pool rows into the hot buffer rows uint8 [L, b, m, R] (donated) from the
    host: `fetch` from a device miss list, `send` from host ids already on the host.
    Owns the gather threads, not the pool."""

    def __init__(self, pool: HostLatentPool, chunk_rows: int = 0, threads: int = 1,
                 device: jax.Device | jax.sharding.Sharding | None = None):
        """device: where the fetched rows go (a device, or the hot buffer's sharding on a
        mesh; default the first device)."""
        if not isinstance(chunk_rows, int) or chunk_rows < 0:
            raise ValueError(f"HostFetcher: chunk_rows={chunk_rows!r} is invalid: allowed an "
                             "integer >= 0 (0 = one transfer)")
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"HostFetcher: threads={threads!r} is invalid: allowed an "
                             "integer >= 1")
        self.pool, self.window, self.threads = pool, chunk_rows, threads
        self.device = device or jax.devices()[0]
        # Layer indices as device arrays made once per group: the scatter's layers are
        # traced, so one compile serves every group size and no call converts ints.
        self._layers: dict[tuple[int, ...], jax.Array] = {}
        self._io = concurrent.futures.ThreadPoolExecutor(threads,
                                                         thread_name_prefix="jlco-gather")
        if not pool.zero_copy():
            warnings.warn("host_driven fetch: the numpy view of the host pool is not "
                          "zero-copy on this backend; every fetch copies a whole layer")

    def close(self) -> None:
        """Stop the gather threads (after any gather in flight)."""
        self._io.shutdown(wait=True)

    def fetch(self, rows, layer, miss_ids, dest):
        """`miss_list`'s arrays back to the host (the one sync), then `send` the rows they
        name (`layer`: one layer, or a tuple: one IndexShare group, one plan). → (rows,
        rows moved per layer incl. padding)."""
        ids, dest = jax.device_get((miss_ids, dest))
        keep = dest >= 0
        return self.send(rows, layer, ids[keep], dest[keep])

    def send(self, rows, layer, ids: np.ndarray, dest: np.ndarray):
        """rows[l].flat[dest] = pool rows of layer l at host ids, for `layer` (an int, or
        a tuple of a group's layers: gathered into one buffer, one transfer per chunk),
        in chunks of at most `chunk_rows` rows. → (rows, rows moved per layer incl.
        padding)."""
        layers = layer if isinstance(layer, tuple) else (layer,)
        n = len(ids)
        if n == 0:
            return rows, 0
        if (ids < 0).any():
            raise RuntimeError(f"host-driven fetch: layer {layers[0]}: a missed position has "
                               "no host page (pages must be reserved before decoding)")
        if layers not in self._layers:
            self._layers[layers] = jnp.asarray(layers, jnp.int32)
        step = self.window or n
        chunks = [(a, min(a + step, n)) for a in range(0, n, step)]
        bufs = [np.zeros((len(layers), pow2_bucket(b - a, cap=self.window),
                          self.pool.row_bytes), np.uint8) for a, b in chunks]
        background = len(chunks) > 1 or n >= 2 * MIN_ROWS_PER_THREAD
        moved = 0
        with contextlib.ExitStack() as stack:
            views = [stack.enter_context(self.pool.view(i)) for i in layers]
            work = [[f for g, v in enumerate(views)
                     for f in self._gather(v, ids[a:b], buf[g], background)]
                    for (a, b), buf in zip(chunks, bufs)]
            for (a, b), buf, pieces in zip(chunks, bufs, work):
                for f in pieces:
                    f.result()
                d = np.full(buf.shape[1], -1, np.int32)
                d[:b - a] = dest[a:b]
                data_d, dest_d = jax.device_put((buf, d), self.device)
                rows = _scatter(rows, self._layers[layers], dest_d, data_d)
                moved += buf.shape[1]
        return rows, moved

    def _gather(self, view: np.ndarray, ids: np.ndarray, out: np.ndarray,
                background: bool) -> list:
        """Copy view[ids] into out[:len(ids)]: inline, or on the gather threads (split
        into parts of >= MIN_ROWS_PER_THREAD rows) so later chunks gather while earlier
        ones transfer. → futures to wait for."""
        n = len(ids)
        if not background:
            np.take(view, ids, axis=0, out=out[:n])
            return []
        parts = max(1, min(self.threads, n // MIN_ROWS_PER_THREAD))
        bounds = np.linspace(0, n, parts + 1).astype(int)
        return [self._io.submit(np.take, view, ids[a:b], 0, out[a:b])
                for a, b in zip(bounds[:-1], bounds[1:])]
