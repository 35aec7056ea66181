"""Host-driven miss fetch for the engine (`cache.fetch_path="host_driven"`).

Each decode step is a Python loop over layers; every layer runs as jitted phases with
the host in between (docs/architecture.md "Moving rows host→device"):

  pre      whole batch: norm, q / latent / indexer projections (`DecoderLayer.pre`),
           the new latent row into the hot buffer, its indexer key into the cache; the
           new row's bytes go device→host (`HostLatentPool.write`: a donated jitted
           scatter for pinned/unpinned_host, a background thread for "file").
  select   per micro-batch: indexer top-k over the request's own keys and `resolve`
           against its hot buffer → slot ids and the miss list.
  host     per micro-batch: the miss list comes back (one device_get), numpy gathers
           exactly those rows from the pool (a scoped zero-copy view, or the memmap),
           `jax.device_put` sends them in chunks of at most `prefetch_window` rows,
           padded to a power of two (O(log) compiles), a donated jitted scatter writes
           them into the victim slots.
  attend   per micro-batch: sparse MLA over the hot buffer by slot ids.
  post     whole batch: W_UV, o_proj, residual, MLP/MoE (`DecoderLayer.post`).

Overlap: the batch is split into two micro-batches A and B (halves of the slots). The
driver dispatches A.select and B.select, then does A's host work while B.select runs
(JAX dispatch is async), dispatches A.attend, does B's host work while A.attend runs,
then B.attend and post. Only selection and attention are split: they are per-request
computations, so a micro-batch computes the same bits as the whole batch, while the
token-mixing matmuls (projections, MoE) stay on the full batch because XLA picks
different kernels for different row counts (measured: batch 1 vs 2 logits differ by
1.5e-7) and offload must equal offload-off exactly.

Prefetch, honestly: what this path moves ahead of need is (1) the newest token's row,
inserted into the hot buffer by `pre` rather than fetched, (2) the rows selected in the
previous step, kept resident by the hot buffer, and (3) at admission the warm-up set
(top-k of the last prefill queries), fetched in one batch per layer. Misses of the
current step are fetched on demand, not predicted: `prefetch_threads` parallelise the
numpy gather of a large miss list and overlap it with the transfer of earlier chunks;
`prefetch_window` bounds the rows per transfer chunk (0 = one chunk).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.config import Config
from jlco.engine import steps as engine_steps
from jlco.model import kv_cache
from jlco.model.kv_cache import DecodeCache, cache_layers
from jlco.util.buckets import pow2_bucket
from jlco.offload.host_pool import HostLatentPool, host_row_ids
from jlco.offload.hot_buffer import insert_new, resolve
from jlco.offload.latent import STAT_D2H, STAT_HITS, STAT_LOOKUPS, STAT_MISSES, lookup_bound

MIN_ROWS_PER_THREAD = 1024   # below this a split gather costs more than it saves


def resolve_fetch_path(cfg: Config) -> str:
    """The miss-fetch path the engine runs for `cfg`: "in_jit" or "host_driven".

    "auto" is in_jit except for storage "file", whose memmap only the host-driven path
    reads. Measured on the 2-core CPU box (configs/tiny.py, f32 rows, warm median step,
    `python tools/bench_fetch_path.py --batch=2` / `--batch=4`): in_jit 2.5 / 3.6 ms,
    host_driven 11.0 / 14.9 ms (fetch wait 4.2 / 5.3 ms) — per layer it pays ~10
    dispatches and 2 syncs that the single jitted step does not. Re-measure on
    accelerators, where the in-jit gather's padding and host compute cost more."""
    path, storage = cfg.cache.fetch_path, cfg.cache.storage
    if path == "auto":
        return "host_driven" if storage == "file" else "in_jit"
    if path == "in_jit" and storage == "file":
        raise NotImplementedError(
            "cache.fetch_path='in_jit' with cache.storage='file': a jitted step cannot "
            "address an np.memmap pool; use cache.fetch_path='host_driven' (or 'auto')")
    return path


def micro_batches(batch: int) -> tuple[tuple[int, int], ...]:
    """(first slot, size) of the two micro-batches: halves, the first one larger."""
    first = -(-batch // 2)
    return ((0, first),) if first == batch else ((0, first), (first, batch - first))


def _slice(a, b0, nb: int, axis: int = 0):
    return jax.lax.dynamic_slice_in_dim(a, b0, nb, axis)


class _Spec:
    """Static jit key of one layer kind: its graphdef and state treedef. One shared
    instance per kind, hashed and compared by identity: a GraphDef hashes and compares
    deeply (ms per call), and nnx state flattening is Python too, so phases take flat
    leaves plus this key and dispatch through jit's C++ path."""

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef


def _block(spec: _Spec, leaves):
    return nnx.merge(spec.graphdef, jax.tree.unflatten(spec.treedef, leaves))


# ---- jitted phases (layer and micro-batch start are traced: one compile per layer kind)
@functools.partial(jax.jit, donate_argnums=2)
def _begin(graphdef, state, cache: DecodeCache, tokens, active):
    """engine_steps.forward's prologue: mask empty slots, embed, positions, RoPE."""
    cache = engine_steps.mask_inactive(cache, active)
    x, cos, sin, positions, kernel_lengths = nnx.merge(graphdef, state).inputs(tokens, cache)
    return cache, cache.latent.page_table, x, cos, sin, positions, kernel_lengths


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _pre(spec, leaves, cache: DecodeCache, layer, x, cos, sin, positions):
    """Projections; new latent row → hot buffer (as `offload.latent.write_latent`, whose
    host scatter is the caller's `HostLatentPool.write`); new indexer key → cache.
    → (cache, q, indexer q, indexer weights, host ids [b*s], row bytes [b*s, R])."""
    latent, q, iq, ik, iw = _block(spec, leaves).pre(x, cos, sin)
    data = kv_cache.encode_rows(latent, cache.kv_format, cache.d_rope)
    lat = cache.latent
    ids = host_row_ids(lat.page_table, positions, lat.page_size)
    rows, pos, stamp = insert_new(lat.rows[layer], lat.slot_pos[layer], lat.slot_stamp[layer],
                                  jnp.where(ids >= 0, positions, -1), data, lat.step,
                                  lat.policy)
    lat = dataclasses.replace(
        lat, rows=lat.rows.at[layer].set(rows), slot_pos=lat.slot_pos.at[layer].set(pos),
        slot_stamp=lat.slot_stamp.at[layer].set(stamp),
        stats=lat.stats.at[layer, STAT_D2H].add((ids >= 0).sum(dtype=jnp.int32)))
    # `cache` is a `kv_cache.layer_view`: this layer's keys are its layer 0.
    cache = kv_cache.write_index_key(dataclasses.replace(cache, latent=lat), 0, ik, positions)
    return cache, q, iq, iw, ids.reshape(-1), data.reshape(-1, data.shape[-1])


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2, static_argnames=("nb", "impl"))
def _select(spec, leaves, cache: DecodeCache, layer, b0, iq, iw, kernel_lengths, *,
            nb: int, impl: str):
    """Micro-batch [b0, b0+nb): top-k, resolve (as `offload.latent.latent_for_attention`)
    → (cache, slot ids [nb,s,k], missed host ids [nb,M], flat destinations [nb,M] into
    rows[layer].reshape(b*m, R), −1 = none)."""
    keys, scale = kv_cache.index_keys(cache, 0)   # a `kv_cache.layer_view`
    topk = _block(spec, leaves).self_attn.indexer.topk(
        _slice(iq, b0, nb), _slice(iw, b0, nb), _slice(keys, b0, nb),
        None if scale is None else _slice(scale, b0, nb), _slice(kernel_lengths, b0, nb),
        cache.key_format, impl)
    rec = cache.record
    if rec is not None and rec.shape[2:] == topk.shape[1:]:
        cache = dataclasses.replace(cache, record=rec.at[layer].set(
            jax.lax.dynamic_update_slice_in_dim(rec[layer], topk, b0, 0)))
    lat = cache.latent
    table = _slice(lat.page_table, b0, nb)
    topk = jnp.where(host_row_ids(table, topk, lat.page_size) >= 0, topk, -1)
    res = resolve(_slice(lat.slot_pos[layer], b0, nb), _slice(lat.slot_stamp[layer], b0, nb),
                  topk, lat.step, lat.policy, num_positions=lookup_bound(lat, cache.scan_len))
    counts = jnp.zeros_like(lat.stats[layer]).at[
        jnp.array([STAT_LOOKUPS, STAT_HITS, STAT_MISSES])].set(
        jnp.stack([res.n_lookup.sum(), res.n_hit.sum(), res.n_miss.sum()]).astype(jnp.int32))
    lat = dataclasses.replace(
        lat, stats=lat.stats.at[layer].add(counts),
        slot_pos=lat.slot_pos.at[layer].set(
            jax.lax.dynamic_update_slice_in_dim(lat.slot_pos[layer], res.slot_pos, b0, 0)),
        slot_stamp=lat.slot_stamp.at[layer].set(
            jax.lax.dynamic_update_slice_in_dim(lat.slot_stamp[layer], res.slot_stamp, b0, 0)))
    cap = lat.rows.shape[2]
    slot0 = (b0 + jnp.arange(nb, dtype=jnp.int32))[:, None] * cap
    dest = jnp.where(res.victim_slot >= 0, slot0 + res.victim_slot, -1)
    miss_ids = host_row_ids(table, res.miss_pos, lat.page_size)
    return dataclasses.replace(cache, latent=lat), res.slot_ids, miss_ids, dest


@functools.partial(jax.jit, static_argnums=0, static_argnames=("nb", "kv_format", "impl"))
def _attend(spec, leaves, rows, layer, b0, q, slot_ids, *, nb: int, kv_format: str,
            impl: str):
    """Sparse MLA of micro-batch [b0, b0+nb) over its hot-buffer rows → [nb,s,h,c]."""
    hot = _slice(rows[layer], b0, nb)                                     # [nb, m, R]
    _, m, r = hot.shape
    base = jnp.arange(nb, dtype=jnp.int32)[:, None, None] * m
    ids = jnp.where(slot_ids >= 0, base + slot_ids, -1).astype(jnp.int32)
    return _block(spec, leaves).self_attn.attend(
        _slice(q, b0, nb), hot.reshape(nb * m, r), ids, kv_format, impl)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(rows, layer, dest, data):
    """rows[layer].flat[dest] = data (dest −1 / past the end dropped)."""
    _, b, m, r = rows.shape
    flat = rows[layer].reshape(b * m, r)
    flat = flat.at[jnp.where(dest < 0, b * m, dest)].set(data, mode="drop")
    return rows.at[layer].set(flat.reshape(b, m, r))


@functools.partial(jax.jit, static_argnums=0)
def _post(spec, leaves, x, outs):
    return _block(spec, leaves).post(x, jnp.concatenate(outs, axis=0))


def _end_forward(graphdef, state, cache: DecodeCache, x, active, saved_table):
    """engine_steps.forward's epilogue: final norm, advance, restore tables, logits."""
    model = nnx.merge(graphdef, state)
    h, cache = model.norm(x), kv_cache.advance(cache, jnp.full((x.shape[0],), x.shape[1],
                                                                jnp.int32))
    lat = cache.latent
    cache = dataclasses.replace(cache, latent=dataclasses.replace(
        lat, page_table=jnp.where(active[:, None], saved_table, lat.page_table)))
    cache = dataclasses.replace(cache, lengths=jnp.where(active, cache.lengths, 0))
    return model.logits(h), cache


_end = jax.jit(_end_forward, donate_argnums=2)


@functools.partial(jax.jit, donate_argnums=2)
def _end_decode(graphdef, state, cache, x, active, saved_table, temps, seeds, counts, top_ps,
                top_ks):
    logits, cache = _end_forward(graphdef, state, cache, x, active, saved_table)
    tok, logp = engine_steps.sample_rows(logits[:, -1], temps,
                                         engine_steps.request_keys(seeds, counts), top_ps, top_ks)
    return tok, logp, cache


@functools.partial(jax.jit, donate_argnums=0)
def _warm_up_tables(cache: DecodeCache, slot, record):
    """`engine_steps.warm_up` without the data: the same resolve sequence over the last
    prefill queries' top-k (record [L, w, k]) updates the slot's tables; the rows that
    end up resident are fetched afterwards in one batch per layer (resolution depends
    on positions only, so the result is the same hot buffer). → (cache, misses)."""
    lat = cache.latent
    pos, stamp = lat.slot_pos, lat.slot_stamp
    fetched = jnp.int32(0)
    for layer in range(record.shape[0]):
        def body(q, carry):
            p, s, n = carry
            stamp_q = lat.step - record.shape[1] + q
            res = resolve(p[None], s[None], record[layer, q][None, None], stamp_q, lat.policy,
                          num_positions=lat.num_positions)
            return res.slot_pos[0], res.slot_stamp[0], n + res.n_miss.sum()
        p, s, fetched = jax.lax.fori_loop(0, record.shape[1], body,
                                          (pos[layer, slot], stamp[layer, slot], fetched))
        pos, stamp = pos.at[layer, slot].set(p), stamp.at[layer, slot].set(s)
    lat = dataclasses.replace(lat, slot_pos=pos, slot_stamp=stamp)
    return dataclasses.replace(cache, latent=lat), fetched


def _close(pool: HostLatentPool, io: concurrent.futures.ThreadPoolExecutor) -> None:
    io.shutdown(wait=True)
    pool.close()


class HostDriven:
    """The engine's host-driven fetch path. Owns the host pool (pinned_host,
    unpinned_host or an np.memmap file) and the gather threads; `decode_step`,
    `forward`, `install` and `warm_up` take and return what the engine's jitted in-jit
    functions do, so `Engine` swaps them in and nothing else changes."""

    def __init__(self, cfg: Config, graphdef, state, *, impl: str, num_pages: int, metrics):
        self.cfg, self.impl, self.metrics = cfg, impl, metrics
        model = nnx.merge(graphdef, state)
        specs: dict = {}
        self.layers = []
        for layer in model.layers:
            graphdef, state = nnx.split(layer)
            leaves, treedef = jax.tree.flatten(state)
            spec = specs.setdefault((graphdef, treedef), _Spec(graphdef, treedef))
            self.layers.append((spec, tuple(leaves)))
        self.page_size = cfg.cache.page_size
        self.pool = HostLatentPool(cache_layers(cfg), num_pages, self.page_size, cfg.row_bytes,
                                   storage=cfg.cache.storage,
                                   storage_path=cfg.cache.storage_path)
        self.window, self.threads = cfg.cache.prefetch_window, cfg.cache.prefetch_threads
        self._io = concurrent.futures.ThreadPoolExecutor(self.threads,
                                                         thread_name_prefix="jlco-gather")
        self._finalizer = weakref.finalize(self, _close, self.pool, self._io)
        self.micro = micro_batches(cfg.engine.max_batch_size)
        self._ids = [jnp.int32(i) for i in range(cache_layers(cfg))]
        self._b0 = {b0: jnp.int32(b0) for b0, _ in self.micro}
        self._install = jax.jit(engine_steps.install, donate_argnums=0)
        self.device = jax.devices()[0]
        if not self.pool.zero_copy():
            warnings.warn("host_driven fetch: the numpy view of the host pool is not "
                          "zero-copy on this backend; every fetch copies a whole layer")

    def close(self) -> None:
        """Wait for pending writes, stop the gather threads, drop the pool (a "file"
        pool deletes its file). Also runs when the driver is garbage-collected."""
        self._finalizer()

    # ---- the engine's entry points ---------------------------------------------
    def forward(self, graphdef, state, cache: DecodeCache, tokens, active):
        """As `engine_steps.forward`: tokens [b, s] → (logits [b, s, V], cache)."""
        cache, saved, x = self._layers(graphdef, state, cache, tokens, active, record=False)
        return _end(graphdef, state, cache, x, active, saved)

    def decode_step(self, graphdef, state, cache: DecodeCache, tokens, active, temps, seeds,
                    counts, top_ps, top_ks):
        """As `engine_steps.decode_step`: → (tokens [b], logprobs [b], cache)."""
        cache, saved, x = self._layers(graphdef, state, cache, tokens, active, record=True)
        return _end_decode(graphdef, state, cache, x, active, saved, temps, seeds, counts,
                           top_ps, top_ks)

    def install(self, cache: DecodeCache, temp: DecodeCache, slot, n, page_row):
        """As `engine_steps.install`, plus the prefilled rows into the host pool."""
        cache = self._install(cache, temp, slot, n, page_row)
        table, n, p = np.asarray(page_row), int(n), self.page_size
        pos = np.arange(temp.max_len)
        page = table[np.minimum(pos // p, len(table) - 1)]
        ids = np.where((pos < n) & (pos // p < len(table)) & (page >= 0), page * p + pos % p, -1)
        for layer in range(len(self._ids)):
            self.pool.write(layer, ids, temp.latent[layer][0])
        return cache

    def warm_up(self, cache: DecodeCache, slot, record):
        """As `engine_steps.warm_up`: the same tables, then the resident rows fetched in
        one batch per layer. → (cache, rows missed during the warm-up sequence)."""
        cache, fetched = _warm_up_tables(cache, slot, record)
        lat, s = cache.latent, int(slot)
        pos, table = jax.device_get((lat.slot_pos[:, s], lat.page_table[s]))
        cap, p, rows = lat.rows.shape[2], self.page_size, lat.rows
        for layer in range(pos.shape[0]):
            held = np.nonzero(pos[layer] >= 0)[0]
            q = pos[layer, held]
            rows, _ = self._send(rows, layer, table[q // p] * p + q % p, s * cap + held)
        return dataclasses.replace(cache, latent=dataclasses.replace(lat, rows=rows)), fetched

    # ---- one step --------------------------------------------------------------
    def _layers(self, graphdef, state, cache, tokens, active, record: bool):
        cache, saved, x, cos, sin, positions, lengths = _begin(graphdef, state, cache,
                                                               tokens, active)
        for i, (gd, st) in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                cache, x = self._layer(i, gd, st, cache, x, cos, sin, positions, lengths,
                                       record)
        return cache, saved, x

    def _layer(self, i, gd, st, cache, x, cos, sin, positions, lengths, record: bool):
        """One layer, two micro-batches overlapped (see the module docstring)."""
        layer = self._ids[i]
        full, cache = cache, kv_cache.layer_view(cache, i)
        cache, q, iq, iw, new_ids, new_rows = _pre(gd, st, cache, layer, x, cos, sin, positions)
        self.pool.write(i, new_ids, new_rows)
        selected = []
        for b0, nb in self.micro:
            cache, slot_ids, miss_ids, dest = _select(gd, st, cache, layer, self._b0[b0], iq, iw,
                                                      lengths, nb=nb, impl=self.impl)
            selected.append((b0, nb, slot_ids, miss_ids, dest))
        outs = []
        for b0, nb, slot_ids, miss_ids, dest in selected:
            rows = self._fetch(cache.latent.rows, i, miss_ids, dest, record)
            cache = dataclasses.replace(cache, latent=dataclasses.replace(cache.latent, rows=rows))
            outs.append(_attend(gd, st, rows, layer, self._b0[b0], q, slot_ids, nb=nb,
                                kv_format=cache.kv_format, impl=self.impl))
        return kv_cache.with_layer(full, i, cache), _post(gd, st, x, tuple(outs))

    # ---- host work ---------------------------------------------------------------
    def _fetch(self, rows, layer: int, miss_ids, dest, record: bool):
        """The miss list back (the one sync), rows gathered and sent; the time blocked
        here is the layer's fetch wait."""
        t0 = time.perf_counter()
        ids, dest = jax.device_get((miss_ids, dest))
        keep = dest >= 0
        rows, moved = self._send(rows, layer, ids[keep], dest[keep])
        if record:
            self.metrics.update(layer, h2d_moved_rows=moved,
                                fetch_wait_s=time.perf_counter() - t0)
        return rows

    def _send(self, rows, layer: int, ids: np.ndarray, dest: np.ndarray):
        """rows[layer].flat[dest] = pool rows at host ids, in chunks of at most
        `prefetch_window` rows. → (rows, rows moved incl. padding)."""
        n = len(ids)
        if n == 0:
            return rows, 0
        if (ids < 0).any():
            raise RuntimeError(f"host-driven fetch: layer {layer}: a missed position has no "
                               "host page (pages must be reserved before decoding)")
        step = self.window or n
        chunks = [(a, min(a + step, n)) for a in range(0, n, step)]
        bufs = [np.zeros((pow2_bucket(b - a, cap=self.window), self.pool.row_bytes), np.uint8)
                for a, b in chunks]
        background = len(chunks) > 1 or n >= 2 * MIN_ROWS_PER_THREAD
        moved = 0
        with self.pool.view(layer) as v:
            work = [self._gather(v, ids[a:b], buf, background)
                    for (a, b), buf in zip(chunks, bufs)]
            for (a, b), buf, pieces in zip(chunks, bufs, work):
                for f in pieces:
                    f.result()
                d = np.full(len(buf), -1, np.int32)
                d[:b - a] = dest[a:b]
                data_d, dest_d = jax.device_put((buf, d), self.device)
                rows = _scatter(rows, self._ids[layer], dest_d, data_d)
                moved += len(buf)
        return rows, moved

    def _gather(self, view: np.ndarray, ids: np.ndarray, out: np.ndarray,
                background: bool) -> list:
        """Copy view[ids] into out[:len(ids)]: inline, or on the gather threads (split
        into parts of >= MIN_ROWS_PER_THREAD rows; numpy's take releases the GIL) so
        later chunks gather while earlier ones transfer. → futures to wait for."""
        n = len(ids)
        if not background:
            np.take(view, ids, axis=0, out=out[:n])
            return []
        parts = max(1, min(self.threads, n // MIN_ROWS_PER_THREAD))
        bounds = np.linspace(0, n, parts + 1).astype(int)
        return [self._io.submit(np.take, view, ids[a:b], 0, out[a:b])
                for a, b in zip(bounds[:-1], bounds[1:])]
