"""Data-parallel attention: each rank of the mesh's "data" axis owns a contiguous block of
the engine's batch slots, and with them those requests' indexer keys, hot buffer, slot
tables, page table and host pool (its block of every layer's pool array, in the host
memory of the devices of that rank).

The engine's jitted steps (decode, install, warm-up) run per rank inside
`jax.shard_map` over "data" only: every request's attention, hot-buffer lookup, miss
fetch and new-row write touch the rank's own shards, never another rank's, and the routed
experts inside the step stay split over "expert" (`jlco.parallel.expert`, the tokens of
one rank). Parameters are replicated over "data" and keep their "expert"/"tensor" split.
Page ids in a rank's page table are local to its pool block (`jlco.offload.pages.
RankedPages` hands them out); the scheduler pins a request to a rank at admission and
balances ranks by host-pool usage (`jlco.engine.scheduler`), as SGLang's and
tpu-inference's DP attention do.

With mesh.data = 1 nothing here changes a step: `per_rank` returns the function itself.
A prefill runs on its one-request cache outside the shard_map (every rank computes it,
replicated); installing it writes only the owning rank's slot and pool block.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jlco.model.kv_cache import DecodeCache
from jlco.offload.latent import OffloadLatent

DATA_AXIS = "data"
P = PartitionSpec


def data_size() -> int:
    """Ranks of the "data" axis of the mesh set by `jax.set_mesh` (1 without one); read
    from the abstract mesh, so it also answers inside a trace."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 1
    return dict(mesh.shape).get(DATA_AXIS, 1)


def cache_specs(cache: DecodeCache) -> DecodeCache:
    """The cache's tree with a PartitionSpec per leaf: batch dimensions over "data",
    each layer's host pool over "data" on its rows (a rank's block of pages), the
    offload step counter and statistics replicated."""
    batch0, batch1 = P(DATA_AXIS), P(None, DATA_AXIS)
    lat = cache.latent
    if isinstance(lat, OffloadLatent):
        lat = dataclasses.replace(lat, rows=batch1, slot_pos=batch1, slot_stamp=batch1,
                                  host=tuple(batch0 for _ in lat.host), page_table=batch0,
                                  step=P(), stats=P())
    else:
        lat = tuple(batch0 for _ in lat)
    return dataclasses.replace(
        cache, latent=lat, index_k=tuple(batch0 for _ in cache.index_k),
        index_scale=None if cache.index_scale is None else tuple(batch0 for _ in cache.index_scale),
        lengths=batch0, record=None if cache.record is None else batch1)


def cache_shardings(cache: DecodeCache, mesh, host_memory_kind: str | None):
    """NamedShardings of `cache_specs` on `mesh` (the host pool in `host_memory_kind`)."""
    out = jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(cache),
                       is_leaf=lambda x: isinstance(x, PartitionSpec))
    if isinstance(out.latent, OffloadLatent):
        host = tuple(NamedSharding(mesh, s.spec, memory_kind=host_memory_kind)
                     for s in out.latent.host)
        out = dataclasses.replace(out, latent=dataclasses.replace(out.latent, host=host))
    return out


def _psum_stats(cache: DecodeCache) -> DecodeCache:
    if not isinstance(cache.latent, OffloadLatent):
        return cache
    lat = cache.latent
    return dataclasses.replace(cache, latent=dataclasses.replace(
        lat, stats=jax.lax.psum(lat.stats, DATA_AXIS)))


def per_rank(fn, roles: tuple[str, ...], out_roles: tuple[str, ...]):
    """`fn` run on each data rank's shards (`jax.shard_map` over "data"), or `fn` itself
    with one rank. roles / out_roles name each argument / output: "cache" (the
    DecodeCache, split by `cache_specs`; its offload statistics summed over ranks on the
    way out), "batch" (split on its leading dimension), "rep" (replicated), "sum" (an
    output summed over ranks). Call it inside jit (the specs follow the cache given)."""
    def wrapped(*args):
        if data_size() == 1:
            return fn(*args)
        specs = {"batch": P(DATA_AXIS), "rep": P(), "sum": P()}
        cache = next(a for a, r in zip(args, roles) if r == "cache")
        specs["cache"] = cache_specs(cache)

        def body(*a):
            out = fn(*a)
            single = len(out_roles) == 1
            out = (out,) if single else tuple(out)
            out = tuple(_psum_stats(o) if r == "cache" else
                        jax.lax.psum(o, DATA_AXIS) if r == "sum" else o
                        for o, r in zip(out, out_roles))
            return out[0] if single else out

        out_specs = tuple(specs[r] for r in out_roles)
        return jax.shard_map(body, in_specs=tuple(specs[r] for r in roles),
                             out_specs=out_specs[0] if len(out_specs) == 1 else out_specs,
                             axis_names={DATA_AXIS}, check_vma=False)(*args)
    return wrapped


def local_slot(slot: jax.Array, slots_per_rank: int) -> jax.Array:
    """Inside `per_rank`: the rank-local index of global batch slot `slot`, or
    slots_per_rank (out of range: updates with mode="drop" skip it) on other ranks."""
    local = slot - jax.lax.axis_index(DATA_AXIS) * slots_per_rank
    return jnp.where((local >= 0) & (local < slots_per_rank), local, slots_per_rank)
