"""In-jit miss fetch: bring the rows `resolve` reported missing from the host pool into
the hot buffer inside the jitted step (`cache.fetch_path="in_jit"`, through
`jlco.offload.latent.latent_for_attention`). The host-driven path is
`jlco.offload.host_fetch`.

The missed rows are gathered from the pinned_host array under
`compute_on('device_host')` (indices moved to host first), then `device_put` to device
and scattered into the victim slots: no Python round trip. With `chunk_rows` > 0 a
`lax.while_loop` moves fixed-size chunks until the real miss count is covered, so ~n_miss
rows move instead of b*s_q*k (works on jax 0.10.2 CPU: compute_on + device_put inside
while_loop).

An IndexShare group (a full layer and the shared layers that reuse its top-k) has one
plan: the same missed positions go to the same victim slots in every layer of the group,
so their rows are gathered from each layer's pool at the same ids, stacked on the host
and moved in ONE transfer [G, n, R], then written by one scatter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlco.offload.host_pool import host_compute, host_row_ids, is_host_space
from jlco.offload.hot_buffer import Resolution


def gather_host_rows(host_layer, row_ids: jax.Array) -> jax.Array:
    """uint8 [n, R] device rows at host row ids [n] (−1 → row 0, the caller drops them).

    host_layer: a pinned_host jax array (compute_on gather) or an unpinned_host one
    (plain gather: jax 0.10 types it as a device operand); or a tuple of G such arrays
    (one IndexShare group's layers) → [G, n, R], stacked on the host and moved in one
    device_put."""
    ids = jnp.maximum(row_ids, 0).astype(jnp.int32)
    group = isinstance(host_layer, tuple)
    hosts = host_layer if group else (host_layer,)
    if not is_host_space(hosts[0]):
        return jnp.stack([h[ids] for h in hosts]) if group else host_layer[ids]
    ids = jax.device_put(ids, jax.memory.Space.Host)
    if group:   # plain indexing: jnp.take fails here
        rows = host_compute(lambda i, *ps: jnp.stack([p[i] for p in ps]), ids, *hosts)
    else:
        rows = host_compute(lambda p, i: p[i], host_layer, ids)
    return jax.device_put(rows, jax.memory.Space.Device)


def _gather_group(host_layers: tuple, ids: jax.Array, dest: jax.Array, offsets: tuple,
                  cap: int, end: int):
    """Rows of every layer of a group at host ids [n], one transfer, and their flat
    destinations: dest [n] (`end` = none) is the first layer's, shifted by each layer's
    row offset past the first → (data [G*n, R], dest [G*n])."""
    if len(host_layers) == 1:
        return gather_host_rows(host_layers[0], ids), dest
    data = gather_host_rows(host_layers, ids)
    shift = [(o - offsets[0]) * cap for o in offsets]
    dests = jnp.concatenate([jnp.where(dest < end, dest + d, end) for d in shift])
    return data.reshape(-1, data.shape[-1]), dests


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
                 page_size: int, chunk_rows: int = 0, row_offset=0):
    """Pure, for use inside jit. rows uint8 [n, C, R] → (rows, moved_rows int32 per
    layer), where the resolution's batch entry i owns rows[row_offset + i] (n = b and
    offset 0 for one layer's hot buffer; an all-layer buffer viewed as [L*b, C, R] with
    offset layer*b is written in place instead of through a copied layer slice).
    host_layer and row_offset may be tuples (one IndexShare group's layers and their
    offsets): the one plan `res` fetches every layer's rows in one transfer per chunk.

    chunk_rows 0: one padded gather of b*M rows. chunk_rows > 0: while_loop over chunks
    until sum(n_miss) rows are covered (moved = ceil(total / chunk) * chunk)."""
    hosts = host_layer if isinstance(host_layer, tuple) else (host_layer,)
    offsets = row_offset if isinstance(row_offset, tuple) else (row_offset,)
    if len(hosts) != len(offsets):
        raise ValueError(f"fetch_in_jit: {len(hosts)} host layers but {len(offsets)} "
                         "row offsets: allowed one offset per layer")
    n_rows, cap, rb = rows.shape
    b, m = res.miss_pos.shape
    end = n_rows * cap
    with jax.named_scope("offload_fetch_in_jit"):
        flat = rows.reshape(end, rb)
        if chunk_rows <= 0:
            ids = host_row_ids(page_table, res.miss_pos, page_size).reshape(-1)
            dest = jnp.where(res.victim_slot >= 0,
                             (offsets[0] + jnp.arange(b, dtype=jnp.int32))[:, None] * cap
                             + res.victim_slot, end).reshape(-1)
            data, dest = _gather_group(hosts, ids, dest, offsets, cap, end)
            return (flat.at[dest].set(data, mode="drop").reshape(n_rows, cap, rb),
                    jnp.int32(b * m))
        ids, dest = _flat_misses(n_rows, cap, page_table, res, page_size, offsets[0])
        n = -(-(b * m) // chunk_rows) * chunk_rows
        ids = jnp.pad(ids, (0, n - b * m), constant_values=-1)
        dest = jnp.pad(dest, (0, n - b * m), constant_values=end)
        total = res.n_miss.sum(dtype=jnp.int32)

        def body(carry):
            i, flat = carry
            sl = jax.lax.dynamic_slice(ids, (i * chunk_rows,), (chunk_rows,))
            dl = jax.lax.dynamic_slice(dest, (i * chunk_rows,), (chunk_rows,))
            data, dl = _gather_group(hosts, sl, dl, offsets, cap, end)
            return i + 1, flat.at[dl].set(data, mode="drop")

        steps, flat = jax.lax.while_loop(lambda c: c[0] * chunk_rows < total, body,
                                         (jnp.int32(0), flat))
        return flat.reshape(n_rows, cap, rb), steps * chunk_rows
