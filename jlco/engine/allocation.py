"""The engine's batch cache and what it costs: allocation (device cache, or host pool +
device hot buffer when offloaded, split over data ranks under a mesh), the host page
allocator, the host-memory guard, and the sizing queries the planner and `jlco.serve`
ask (device bytes per batch, the largest batch for a device budget), all read off the
same allocation so the plan and the engine cannot disagree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jlco.config import Config
from jlco.sampling.penalize import SeenTokens
from jlco.model import kv_cache
from jlco.model.kv_cache import DecodeCache, cache_layers, init_cache
from jlco.offload.latent import STAT_NAMES, OffloadLatent, share_groups
from jlco.offload.pages import PageAllocator, RankedPages
from jlco.parallel import data as parallel_data
from jlco.parallel import mesh as parallel_mesh


# The in-jit path's chunk under cache.fetch_chunk_rows="auto". Its chunk is a shape of the
# compiled step, so it must not come from a timing: a measured value (the host-driven
# path's, `fetch_schedule.chunk_rows`) varies run to run (128-1024 rows on one CPU box),
# which would give every run its own programs (no persistent-cache hit) and, across
# processes, steps that differ (jlco.serve over several processes runs one SPMD program).
IN_JIT_AUTO_CHUNK_ROWS = 256


def _chunk_rows(cfg: Config) -> int:
    """In-jit fetch moves misses in chunks of this many rows (0 = one padded gather of
    every possible miss); cache.fetch_chunk_rows ("auto": IN_JIT_AUTO_CHUNK_ROWS)
    bounds it."""
    rows = cfg.cache.fetch_chunk_rows
    return max(0, min(IN_JIT_AUTO_CHUNK_ROWS if rows == "auto" else rows, cfg.hot_buffer_rows))


def host_pages(cfg: Config) -> PageAllocator | RankedPages | None:
    """The host page allocator of an offloaded engine (None with offload off): enough
    pages for every slot at engine.max_context_len; with mesh.data > 1 one pool per data
    rank (`RankedPages`, rank-local page ids)."""
    if not cfg.cache.offload:
        return None
    page = cfg.cache.page_size
    pages_per_req = -(-cfg.engine.max_context_len // page)
    ranks = cfg.mesh.data
    if ranks > 1:
        return RankedPages(ranks, cfg.engine.max_batch_size // ranks * pages_per_req, page)
    return PageAllocator(cfg.engine.max_batch_size * pages_per_req, page)


HOST_MEMORY_LIMIT = 0.95   # of physical RAM a host pool may take (vLLM's rule too)


def physical_memory_bytes() -> int | None:
    """This machine's RAM (None where the OS does not say)."""
    import os
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(cfg: Config, pool_bytes: int) -> None:
    """Refuse a host pool in memory (not `storage="file"`) above HOST_MEMORY_LIMIT of the
    machine's RAM: it would swap or be killed mid-run. On a CPU-only process the prefill
    workspace (`prefill_workspace_bytes`) is host memory too and counts beside it, as
    does a full prefix cache (`prefix_cache_bytes`). A ValueError names the fields."""
    ram = physical_memory_bytes()
    if cfg.cache.storage == "file" or ram is None:
        return
    cpu = all(d.platform == "cpu" for d in jax.devices())
    work = prefill_workspace_bytes(cfg) if cpu else 0
    cached = prefix_cache_bytes(cfg)
    if pool_bytes + work + cached <= HOST_MEMORY_LIMIT * ram:
        return
    also = f" (+ {work / 1e9:.1f} GB of prefill workspace)" if work else ""
    if cached:
        also += (f" (+ {cached / 1e9:.1f} GB of prefix cache: cache.prefix_cache_tokens="
                 f"{cfg.cache.prefix_cache_tokens})")
    raise ValueError(
        f"the host pool needs {pool_bytes / 1e9:.1f} GB{also}, above {HOST_MEMORY_LIMIT:.0%} "
        f"of this machine's {ram / 1e9:.1f} GB of RAM: lower engine.max_batch_size "
        f"({cfg.engine.max_batch_size}) or engine.max_context_len "
        f"({cfg.engine.max_context_len}), or use cache.storage='file'")


def allocate_cache(cfg: Config) -> tuple[DecodeCache, PageAllocator | None]:
    """The engine's batch cache for `cfg.engine.max_batch_size` slots and, offloaded, its
    host page allocator. Offloaded, the latent cache is a host pool per layer (in
    `cfg.cache.storage` memory) behind a device hot buffer; `device_cache_bytes` counts
    exactly this allocation. Under a mesh with data ranks every leaf is split over them
    (`jlco.model.kv_cache.data_specs`), allocated in place by one jit."""
    if parallel_data.data_size() > 1:
        return _allocate_split(cfg)
    cache, pages = _allocate(cfg)
    # Committed where they are, as every step's output is: a step's first call on the
    # fresh cache then compiles the program later calls use (jit keys on commitment).
    return jax.device_put(cache, jax.tree.map(lambda x: x.sharding, cache)), pages


def _allocate_split(cfg: Config) -> tuple[DecodeCache, PageAllocator | None]:
    """`_allocate` with every leaf created in its data-rank shard (nothing whole first)."""
    ranks = parallel_data.data_size()
    if cfg.mesh.data != ranks:
        raise ValueError(f"mesh.data={cfg.mesh.data} but the active mesh has {ranks} data "
                         "ranks: build the engine under jax.set_mesh(make_mesh(cfg))")
    parallel_mesh.check_batch(cfg.engine.max_batch_size, ranks)
    pages = None

    def build():
        nonlocal pages
        cache, pages = _allocate(cfg, host_memory=False)
        return cache
    shapes = jax.eval_shape(build)
    mesh = parallel_mesh.active_mesh()
    shardings = kv_cache.data_shardings(shapes, mesh, cfg.cache.storage)
    return jax.jit(build, out_shardings=shardings)(), pages


def _allocate(cfg: Config, host_memory: bool = True
              ) -> tuple[DecodeCache, PageAllocator | None]:
    pages = host_pages(cfg)
    if pages is None:
        return _with_tables(cfg, init_cache(cfg)), None
    check_host_memory(cfg, pages.num_pages * cfg.cache.page_size * cfg.row_bytes
                      * cache_layers(cfg))
    # Host-driven: the pool is host_driven's HostLatentPool, outside the jitted cache.
    host_driven_path = cfg.resolved_fetch_path() == "host_driven"
    batch, page = cfg.engine.max_batch_size, cfg.cache.page_size
    pages_per_req = pages.num_pages // batch
    n_layers, cap, rb = cache_layers(cfg), cfg.hot_buffer_rows, cfg.row_bytes
    if not host_driven_path and host_memory:
        host = parallel_mesh.replicated(cfg.cache.storage)   # whole on every mesh device
        zeros = jax.jit(lambda: jnp.zeros((pages.num_pages * page, rb), jnp.uint8),
                        out_shardings=host)
    elif not host_driven_path:   # traced by `_allocate_split`, which places it
        def zeros():
            return jnp.zeros((pages.num_pages * page, rb), jnp.uint8)
    # IndexShare: a full layer and the shared layers after it keep one slot table.
    groups = share_groups([cfg.model.shares_topk(i) for i in range(n_layers)])
    tables = groups[-1] + 1
    lat = OffloadLatent(
        rows=jnp.zeros((n_layers, batch, cap, rb), jnp.uint8),
        slot_pos=jnp.full((tables, batch, cap), -1, jnp.int32),
        slot_stamp=jnp.full((tables, batch, cap), -1, jnp.int32),
        slot_pref=jnp.zeros((tables, batch, cap), bool),
        host=() if host_driven_path else tuple(zeros() for _ in range(n_layers)),
        page_table=jnp.full((batch, pages_per_req), -1, jnp.int32),
        step=jnp.int32(0), stats=jnp.zeros((n_layers, len(STAT_NAMES)), jnp.int32),
        policy=cfg.cache.eviction, page_size=page, chunk_rows=_chunk_rows(cfg),
        groups=None if tables == n_layers else groups)
    return _with_tables(cfg, init_cache(cfg, latent=lat)), pages


def _with_tables(cfg: Config, cache: DecodeCache) -> DecodeCache:
    """The batch cache with each slot's penalty tables (`jlco.sampling.penalize`)."""
    return dataclasses.replace(cache, seen=SeenTokens.zeros(cache.batch, cfg.model.vocab_size))


def device_cache_bytes(cfg: Config, batch: int) -> int:
    """Device bytes of the cache `allocate_cache` makes for `batch` slots, from its
    abstract shapes (nothing is allocated, so real-model configs are cheap): every leaf
    but the offloaded host pool (`OffloadLatent.host`) lives in device memory."""
    # Whole-batch shapes (data ranks split the same bytes, and need not divide `batch`).
    cfg = cfg.replace(engine__max_batch_size=batch, mesh__data=1)
    shapes = jax.eval_shape(lambda: _allocate(cfg)[0])
    host = shapes.latent.host if isinstance(shapes.latent, OffloadLatent) else ()
    return _nbytes(shapes) - _nbytes(host)


def prefill_workspace_bytes(cfg: Config) -> int:
    """Device bytes prefills hold while they run, whatever the prompts' lengths: a
    one-request [1, max_len] cache each (`jlco.engine.prefill.open_cache`) and one chunk's
    working set. With the plain-XLA ops (`engine.attention_impl` "xla", what "auto" is
    on CPU): the indexer's streamed key block (its scores [chunk, block] f32,
    `jlco.pallas.indexer_ref.ref_key_block`, merged with the running top-k; the per-head
    logits are formed a query tile at a time) and the top-k latent rows the chunk's
    queries attend over, gathered and decoded to f32. With the kernels: the indexer's
    score row [chunk, max_len] f32 (sparse MLA reads its rows in the kernel). The engine
    runs one prefill at a time, and a short one beside it (`prefill.next_job`): two
    caches and one working set are the whole prefill workspace."""
    from jlco.pallas import dispatch
    from jlco.pallas.indexer_ref import ref_key_block
    m, chunk, ctx = cfg.model, cfg.engine.prefill_chunk, cfg.engine.max_context_len
    one = jax.eval_shape(lambda: init_cache(cfg, batch=1, max_len=ctx))
    if dispatch.resolve(cfg.engine.attention_impl) != "xla":
        return 2 * _nbytes(one) + 4 * chunk * ctx
    block = ref_key_block(chunk, m.index_n_heads, ctx, m.index_topk)
    indexer = 4 * chunk * (3 * block + 4 * m.index_topk)
    rows = 4 * chunk * m.index_topk * (m.kv_lora_rank + m.qk_rope_head_dim)
    return 2 * _nbytes(one) + indexer + rows


def prefix_pages(cfg: Config) -> int:
    """Pages the prefix cache holds at most (`cache.prefix_cache_tokens`, 0 = two full
    contexts: a session at max_context_len and the one before it)."""
    tokens = cfg.cache.prefix_cache_tokens or 2 * cfg.engine.max_context_len
    return -(-tokens // cfg.cache.page_size)


def prefix_cache_bytes(cfg: Config) -> int:
    """Host bytes of a full prefix cache: every cache layer's latent row, indexer key
    and scale per position (`jlco.engine.prefix.PageEntry`), 0 when it is off."""
    if not cfg.cache.prefix_cache:
        return 0
    one = jax.eval_shape(lambda: init_cache(cfg, batch=1, max_len=cfg.cache.page_size))
    return prefix_pages(cfg) * (_nbytes(one) - _nbytes(one.lengths))


def _nbytes(tree) -> int:
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def batch_for_budget(cfg: Config, device_bytes: float, *, other_bytes: float = 0.0,
                     other_bytes_per_slot: float = 0.0) -> int:
    """Largest batch whose engine cache fits in `device_bytes` beside `other_bytes`
    (weights, runtime reserve) and `other_bytes_per_slot` (activations), by the engine's
    own allocation: bytes per slot and batch-independent bytes (offload counters) from
    `device_cache_bytes` at batch 1 and 2. Not capped by engine.max_batch_size."""
    one, two = device_cache_bytes(cfg, 1), device_cache_bytes(cfg, 2)
    per_slot, fixed = two - one, 2 * one - two
    return max(0, int((device_bytes - other_bytes - fixed) // (per_slot + other_bytes_per_slot)))
