"""Host latent pool: per-layer raw-byte latent rows in host memory.

Rows are uint8 `[rows, row_bytes]` (fp8 656-B FlashMLA rows, or bf16/f32 rows bit-cast):
XLA:CPU updates a donated integer array in place in O(row) but rewrites a whole bf16/fp8
array (docs/facts.md §5), and bytes are copied, never re-quantised, so offload equals offload-off
exactly. Storage is the `pinned_host` memory kind (default), `unpinned_host`, or "file"
(an np.memmap, for pools larger than RAM; written by a background thread).

Host row id = page * page_size + offset (pages from `PageAllocator`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import os
import tempfile
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import compute_on as _compute_on_mod
from jax.sharding import SingleDeviceSharding

STORAGES = ("pinned_host", "unpinned_host", "file")
COMPUTE_ON_FORMS = ("auto", "context", "decorator")


def _compute_on_form() -> str:
    """jax 0.10.x: `compute_on` is a context manager (`compute_on2` the decorator);
    jax 0.11 turns `compute_on` itself into the decorator. contextlib-made context
    managers wrap a generator function, which tells the two apart."""
    wrapped = getattr(_compute_on_mod.compute_on, "__wrapped__", None)
    return "context" if inspect.isgeneratorfunction(wrapped) else "decorator"


def _host_decorator(fn: Callable) -> Callable:
    deco = getattr(_compute_on_mod, "compute_on2", None) or _compute_on_mod.compute_on
    params = inspect.signature(deco).parameters
    if "out_memory_spaces" in params:
        return deco(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    if "compute_type" in params and "f" in params:
        return deco(fn, compute_type="device_host")
    return deco("device_host")(fn)


def host_compute(fn: Callable, *args, form: str = "auto"):
    """Run `fn(*args)` as host compute inside jit (`compute_on('device_host')`); the
    outputs stay in host memory space. `form` forces one API shape (tests use both)."""
    if form not in COMPUTE_ON_FORMS:
        raise ValueError(f"host_compute: form={form!r} is invalid: allowed {COMPUTE_ON_FORMS}")
    form = _compute_on_form() if form == "auto" else form
    if form == "context":
        with _compute_on_mod.compute_on("device_host"):
            return fn(*args)
    return _host_decorator(fn)(*args)


def is_host_space(x) -> bool:
    """True when jit types `x` as host memory (pinned_host). unpinned_host arrays are
    typed as device operands on jax 0.10 CPU, so host compute must not be used on them."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def host_row_ids(page_table: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Host row ids of context positions, inside jit. page_table int32 [b, P], positions
    int32 [b, ...] (−1 invalid) → int32 [b, ...], −1 where the position is invalid or its
    page is unassigned."""
    b, num_pages = page_table.shape
    flat = positions.reshape(b, -1)
    page_idx = flat // page_size
    ok = (flat >= 0) & (page_idx < num_pages)
    page = jnp.take_along_axis(page_table, jnp.where(ok, page_idx, 0), axis=1)
    ok &= page >= 0
    rows = jnp.where(ok, page * page_size + flat % page_size, -1)
    return rows.reshape(positions.shape).astype(jnp.int32)


def scatter_to_host(pool: jax.Array, row_ids: jax.Array, rows: jax.Array) -> jax.Array:
    """pool[row_ids] = rows on a host-memory pool (−1 ids dropped). Pure; call it inside a
    jit that donates `pool` and keeps its output on the host memory kind."""
    ids = jnp.where(row_ids < 0, pool.shape[0], row_ids).astype(jnp.int32)
    if not is_host_space(pool):
        return pool.at[ids].set(rows, mode="drop")
    ids = jax.device_put(ids, jax.memory.Space.Host)
    rows = jax.device_put(rows, jax.memory.Space.Host)
    return host_compute(lambda p, i, r: p.at[i].set(r, mode="drop"), pool, ids, rows)


class HostLatentPool:
    """`num_layers` × `num_pages*page_size` latent rows of `row_bytes` bytes on the host."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, row_bytes: int,
                 storage: str = "pinned_host", storage_path: str | None = None,
                 device: jax.Device | None = None, process_memory: bool = False):
        """process_memory: keep the rows in this process's memory as one numpy array
        (written by a background thread, as "file" is) instead of a jax array in
        `storage` memory of `device`: the host-driven path on a mesh, whose rows reach
        every device from one host copy rather than a copy in each device's memory."""
        for name, v in (("num_layers", num_layers), ("num_pages", num_pages),
                        ("page_size", page_size), ("row_bytes", row_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"HostLatentPool: {name}={v!r} is invalid: allowed a positive integer")
        if storage not in STORAGES:
            raise ValueError(f"HostLatentPool: storage={storage!r} is invalid: allowed {STORAGES}")
        if storage == "file" and not storage_path:
            raise ValueError("HostLatentPool: storage_path is required when storage='file'")
        self.num_layers, self.page_size, self.row_bytes = num_layers, page_size, row_bytes
        self.num_rows = num_pages * page_size
        self.storage = storage
        self.device = device or jax.devices()[0]
        self._file: str | None = None
        self._pending: list[concurrent.futures.Future] = []
        self._zero_copy: bool | None = None
        shape = (self.num_rows, row_bytes)
        if storage == "file" or process_memory:
            if storage == "file":
                if storage_path:   # validated at config load; created on first use
                    os.makedirs(storage_path, exist_ok=True)
                fd, self._file = tempfile.mkstemp(prefix="jlco-latent-", suffix=".bin",
                                                  dir=storage_path)
                os.close(fd)
                self._mm = np.memmap(self._file, np.uint8, "w+", shape=(num_layers, *shape))
            else:
                self._mm = np.zeros((num_layers, *shape), np.uint8)
            self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jlco-d2h")
            self._layers = None
        else:
            self.sharding = SingleDeviceSharding(self.device, memory_kind=storage)
            zeros = jax.jit(lambda: jnp.zeros(shape, jnp.uint8), out_shardings=self.sharding)
            self._layers = [zeros() for _ in range(num_layers)]
            self._write = jax.jit(scatter_to_host, donate_argnums=0, out_shardings=self.sharding)

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_rows * self.row_bytes

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is invalid: allowed 0..{self.num_layers - 1}")

    def array(self, layer: int) -> jax.Array:
        """The layer's host jax array, for the in-jit fetch (not for storage='file')."""
        self._check_layer(layer)
        if self._layers is None:
            raise ValueError("HostLatentPool.array: storage='file' (or process memory) has no "
                             "jax array; use view() (host-driven) or fetch via host callback")
        return self._layers[layer]

    def set_array(self, layer: int, array: jax.Array) -> None:
        """Take back a layer's array from a jit that donated `array(layer)` and returned
        the pool (in its memory kind)."""
        self._check_layer(layer)
        if self._layers is None:
            raise ValueError("HostLatentPool.set_array: storage='file' has no jax array")
        if array.shape != self._layers[layer].shape or array.dtype != jnp.uint8:
            raise ValueError(f"HostLatentPool.set_array: got {array.dtype}{list(array.shape)}, "
                             f"allowed uint8{list(self._layers[layer].shape)}")
        self._layers[layer] = array

    def write(self, layer: int, row_ids, rows) -> None:
        """Store rows (uint8 [n, row_bytes], device or host) at host row ids (−1 skipped).
        Asynchronous: a donated jitted scatter on the host memory kind, or for "file" a
        background thread; `flush()` waits."""
        self._check_layer(layer)
        if self._layers is not None:
            self._layers[layer] = self._write(self._layers[layer], jnp.asarray(row_ids, jnp.int32),
                                              jnp.asarray(rows, jnp.uint8))
            return
        self._pending.append(self._io.submit(self._write_file, layer, row_ids, rows))

    def _write_file(self, layer: int, row_ids, rows) -> None:
        ids, data = np.asarray(row_ids), np.asarray(rows)  # blocks this thread on D2H only
        keep = ids >= 0
        self._mm[layer, ids[keep]] = data[keep]

    def flush(self) -> None:
        """Wait for every pending write (and surface any error it raised)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()
        if self._layers is not None:
            jax.block_until_ready(self._layers)

    @contextlib.contextmanager
    def view(self, layer: int) -> Iterator[np.ndarray]:
        """Numpy view of one layer's rows (zero-copy where `zero_copy(layer)` says so).
        Scoped on purpose: a view alive while the next write donates the array forces XLA
        to copy the whole pool (seen: 240 ms for 315 MB) and leaves the view stale."""
        self._check_layer(layer)
        if self._layers is None:
            self.flush()
            yield self._mm[layer]
            return
        v = np.asarray(self._layers[layer])
        try:
            yield v
        finally:
            del v

    def zero_copy(self, layer: int = 0) -> bool:
        """Whether view() aliases the stored bytes (checked once by pointer, not assumed).
        CPU: yes. Elsewhere np.asarray of a host-kind array may copy the whole layer, which
        would make the host-driven path cost a full-layer copy per fetch."""
        if self._layers is None:
            return True
        if self._zero_copy is None:
            arr = self._layers[layer]
            with self.view(layer) as v:
                try:
                    self._zero_copy = v.__array_interface__["data"][0] == arr.unsafe_buffer_pointer()
                except Exception:  # noqa: BLE001 - some backends expose no host pointer
                    self._zero_copy = False
        return self._zero_copy

    def gather(self, layer: int, row_ids) -> np.ndarray:
        """uint8 [n, row_bytes] copy of rows at host row ids (numpy; −1 gives zeros)."""
        ids = np.asarray(row_ids)
        with self.view(layer) as v:
            out = v[np.maximum(ids, 0)]
        out[ids < 0] = 0
        return out

    def close(self) -> None:
        """Drop the storage; for "file" wait for writes and delete the file."""
        if self._layers is not None:
            self._layers = []
            return
        if hasattr(self, "_mm"):
            self.flush()
            self._io.shutdown(wait=True)
            del self._mm
        if self._file is not None:
            os.unlink(self._file)
            self._file = None

    def __enter__(self) -> "HostLatentPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
