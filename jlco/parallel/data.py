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
tpu-inference's DP attention do. Which dimension of each cache leaf is the batch is the
cache's own knowledge (`jlco.model.kv_cache.data_specs`): this package sits below the
model and imports none of it.

With mesh.data = 1 nothing here changes a step: `per_rank` returns the function itself.
A prefill runs on its one-request cache outside the shard_map (every rank computes it,
replicated); installing it writes only the owning rank's slot and pool block.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

DATA_AXIS = "data"
P = PartitionSpec


def data_size() -> int:
    """Ranks of the "data" axis of the mesh set by `jax.set_mesh` (1 without one); read
    from the abstract mesh, so it also answers inside a trace."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 1
    return dict(mesh.shape).get(DATA_AXIS, 1)


def per_rank(fn, roles: tuple[str, ...], out_roles: tuple[str, ...],
             cache_specs: Callable, cache_out: Callable):
    """`fn` run on each data rank's shards (`jax.shard_map` over "data"), or `fn` itself
    with one rank. roles / out_roles name each argument / output: "cache" (the decode
    cache, split by `cache_specs(cache)`, a PartitionSpec per leaf, and passed through
    `cache_out` on each rank on the way out: `jlco.model.kv_cache.data_specs` and
    `sum_rank_stats`, given by the caller because this package sits below the model),
    "batch" (split on its leading dimension), "rep" (replicated), "sum" (an output
    summed over ranks). Call it inside jit (the specs follow the cache given)."""
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
            out = tuple(cache_out(o) if r == "cache" else
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
