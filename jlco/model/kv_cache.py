"""The on-device decode cache: MLA latent rows as raw bytes, indexer keys, lengths.

Rows are bytes because XLA:CPU rewrites a whole donated bf16/fp8 array on update but
updates integer arrays in place (docs/facts.md §5). All latent-row traffic goes through
`write_latent` and `latent_for_attention`: the offload engine swaps exactly these two
for a host pool + device hot buffer, so nothing else may touch `latent` directly.

Layers: num_hidden_layers main layers, then the MTP layer if the model has one. Each
layer's latent rows, keys and scales are an array of their own (a tuple over layers), not
one stacked array: a layer's keys then feed the indexer's product straight from their
buffer, where slicing a stacked [L, b, t, D] array made XLA:CPU copy the layer's whole
[b, t, D] every step (a cost growing with context; 11 ms a step at 8K, 4 layers).
Indexer keys with key_format "bf16" are stored unquantised in the model dtype (bf16 for
the real model, f32 for the fp32 parity model; f32 arrays update in place too, bf16 ones
are stored as uint16 bits); "fp8" stores e4m3 bytes + one f32 scale per token.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jlco.config import Config
from jlco.model.fp8_emul import quantize_e4m3
from jlco.offload import latent as offload_latent
from jlco.parallel.data import DATA_AXIS
from jlco.util.buckets import MIN_SCAN, pow2_bucket


@partial(jax.tree_util.register_dataclass,
         data_fields=("latent", "index_k", "index_scale", "lengths", "record", "record_from",
                      "seen"),
         meta_fields=("kv_format", "key_format", "d_rope", "scan_len"))
@dataclasses.dataclass(frozen=True)
class DecodeCache:
    latent: Any                       # per layer uint8 [b, t, row_bytes], or OffloadLatent
    index_k: tuple                    # per layer [b, t, D]: f32 | uint16 (bf16 bits) | uint8 (e4m3)
    index_scale: tuple | None         # per layer f32 [b, t] when key_format == "fp8"
    lengths: jax.Array                # int32 [b]: tokens cached per request
    kv_format: str
    key_format: str
    d_rope: int
    # int32 [layers, b, s, k]: the last top-k positions each layer selected (None = off).
    # The engine reads it for the admission warm-up set and for top-k traces.
    record: jax.Array | None = None
    # Positions the indexer scores this call (None = all max_len): a static bucket above
    # every request's length (`scan_bucket`), so a step's indexer cost follows the
    # contexts in the batch, not max_context_len. Static (part of the tree's structure):
    # one compile per bucket; step functions hand the cache back with None.
    scan_len: int | None = None
    # int32 scalar: with a record narrower than the step's queries, the first query row
    # it keeps (a prefill's last piece records its last real queries only).
    record_from: jax.Array | None = None
    # The engine's per-slot penalty tables (`jlco.sampling.penalize.SeenTokens`, leaves
    # [b, ...]), carried from step to step with the cache; the model never reads them.
    seen: Any = None

    @property
    def batch(self) -> int:
        return self.index_k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.index_k[0].shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.index_k)


def cache_layers(cfg: Config) -> int:
    return cfg.model.num_hidden_layers + cfg.model.num_nextn_predict_layers


def _key_storage_dtype(cfg: Config):
    if cfg.cache.indexer_key_format == "fp8":
        return jnp.uint8
    return jnp.float32 if cfg.model.dtype == "float32" else jnp.uint16


def init_cache(cfg: Config, batch: int | None = None, max_len: int | None = None,
               latent: Any = None) -> DecodeCache:
    """Zeroed cache for `batch` requests of up to `max_len` tokens (engine defaults).
    `latent` replaces the device latent array (the offload engine passes its
    OffloadLatent, so the full latent cache is never allocated on device)."""
    b = cfg.engine.max_batch_size if batch is None else batch
    t = cfg.engine.max_context_len if max_len is None else max_len
    if b <= 0 or t <= 0:
        raise ValueError(f"init_cache: batch={b} and max_len={t} must be positive")
    m, n = cfg.model, cache_layers(cfg)
    fp8_keys = cfg.cache.indexer_key_format == "fp8"
    if fp8_keys and m.index_head_dim > 128:
        raise ValueError(f"cache.indexer_key_format='fp8' keeps one scale per token: "
                         f"model.index_head_dim ({m.index_head_dim}) must be <= 128")
    def per_layer(shape, dtype, keys=False):
        # A layer that shares its top-k caches no keys: its entries have a last
        # dimension of 0 (the tuple keeps one entry per layer, and no bytes).
        return tuple(jnp.zeros(shape[:-1] + (0,) if keys and m.shares_topk(i) else shape, dtype)
                     for i in range(n))
    return DecodeCache(
        latent=per_layer((b, t, cfg.row_bytes), jnp.uint8) if latent is None else latent,
        index_k=per_layer((b, t, m.index_head_dim), _key_storage_dtype(cfg), keys=True),
        index_scale=per_layer((b, t), jnp.float32, keys=True) if fp8_keys else None,
        lengths=jnp.zeros((b,), jnp.int32),
        kv_format=cfg.cache.kv_format, key_format=cfg.cache.indexer_key_format,
        d_rope=m.qk_rope_head_dim)


def encode_rows(rows: jax.Array, kv_format: str, d_rope: int) -> jax.Array:
    """Latent rows [..., c + r] float → raw bytes [..., row_bytes]."""
    if kv_format == "fp8":
        from jlco.pallas import fp8_rows
        return fp8_rows.quantize_kv_rows(rows, d_rope=d_rope)
    dt = jnp.float32 if kv_format == "f32" else jnp.bfloat16
    b = jax.lax.bitcast_convert_type(rows.astype(dt), jnp.uint8)       # [..., n, w]
    return b.reshape(*rows.shape[:-1], -1)


def _scatter(arrs: tuple, layer: int, positions: jax.Array, values: jax.Array) -> tuple:
    """arrs[layer][b, positions[b, s]] = values[b, s]; positions past the end are dropped
    (padding tokens of a ragged prefill chunk can fall there)."""
    bidx = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
    new = arrs[layer].at[bidx, positions].set(values, mode="drop")
    return arrs[:layer] + (new,) + arrs[layer + 1:]


def write_latent(cache: DecodeCache, layer: int, rows: jax.Array,
                 positions: jax.Array, shared: bool = False) -> DecodeCache:
    """Store latent rows [b, s, c + r] at token positions [b, s] of `layer` (`shared`:
    the layer shares its top-k; offloaded, it then uses its full layer's slot table)."""
    with jax.named_scope("write_latent"):
        data = encode_rows(rows, cache.kv_format, cache.d_rope)
        if isinstance(cache.latent, offload_latent.OffloadLatent):
            lat = offload_latent.write_latent(cache.latent, layer, data, positions, shared)
            return dataclasses.replace(cache, latent=lat)
        return dataclasses.replace(cache, latent=_scatter(cache.latent, layer, positions, data))


def latent_for_attention(cache: DecodeCache, layer: int, positions: jax.Array,
                         shared_ids: jax.Array | None = None
                         ) -> tuple[DecodeCache, jax.Array, jax.Array]:
    """Rows and global row ids for sparse MLA: positions [b, s, k] (−1 = none) →
    (cache, rows [n, row_bytes], ids [b, s, k] into rows, −1 kept). On device n = b·t and
    ids = b·t + position; offloaded, n = b·m hot slots and misses are fetched first.
    `shared_ids`: a layer that shares its top-k passes the ids its full layer got; an
    offloaded group's full layer has already fetched this layer's rows into the same
    slots, so nothing is planned or fetched again."""
    cache = record_topk(cache, layer, positions)
    if isinstance(cache.latent, offload_latent.OffloadLatent):
        lat, rows, ids = offload_latent.latent_for_attention(cache.latent, layer, positions,
                                                             scan_len=cache.scan_len,
                                                             shared_ids=shared_ids)
        return dataclasses.replace(cache, latent=lat), rows, ids
    lat = cache.latent[layer]
    b, t, row = lat.shape
    ids = jnp.arange(b, dtype=jnp.int32)[:, None, None] * t + positions
    return cache, lat.reshape(b * t, row), jnp.where(positions >= 0, ids, -1).astype(jnp.int32)


def record_topk(cache: DecodeCache, layer: int, positions: jax.Array) -> DecodeCache:
    """Keep this step's top-k positions [b, s, k] when the cache records them: all s
    query rows when the record [L, b, s, k] has as many, else (a narrower record,
    `record_from` set) the rows record_from .. record_from + its width."""
    rec = cache.record
    if rec is None or rec.shape[3:] != positions.shape[2:]:
        return cache
    rows, s = rec.shape[2], positions.shape[1]
    if rows == s:
        part = positions
    elif rows < s and cache.record_from is not None:
        part = jax.lax.dynamic_slice_in_dim(positions, cache.record_from, rows, axis=1)
    else:
        return cache
    return dataclasses.replace(cache, record=rec.at[layer].set(part))


def dense_rows(cache: DecodeCache, layer: int, s_q: int) -> jax.Array | None:
    """The layer's rows [b, t, row] for `attention.sparse_mla_dense` when a chunk of s_q
    queries should attend densely (a device cache, s_q >= DENSE_MIN_S, the scanned
    context t <= DENSE_MAX_T), else None (gather the selected rows)."""
    from jlco.model.attention import DENSE_MAX_T, DENSE_MIN_S
    if isinstance(cache.latent, offload_latent.OffloadLatent) or s_q < DENSE_MIN_S:
        return None
    t = cache.scan_len or cache.max_len
    if t > DENSE_MAX_T:
        return None
    rows = cache.latent[layer]
    return rows if t == rows.shape[1] else rows[:, :t]


def _encode_index_key(cache: DecodeCache, layer: int, k: jax.Array):
    """Keys [b, s, D] as the cache stores them → (values, scales [b, s] or None)."""
    if cache.key_format == "fp8":
        q, scale = quantize_e4m3(k, block=k.shape[-1])
        return jax.lax.bitcast_convert_type(q, jnp.uint8), scale[..., 0]
    if cache.index_k[layer].dtype == jnp.float32:
        return k.astype(jnp.float32), None
    return jax.lax.bitcast_convert_type(k.astype(jnp.bfloat16), jnp.uint16), None


def fresh_index_keys(cache: DecodeCache, layer: int, k: jax.Array, positions: jax.Array):
    """Keys [b, s, D] at positions [b, s] in the form `index_keys` gives cached ones:
    `indexer_topk`'s `fresh` (keys, scales or None, positions)."""
    vals, scale = _encode_index_key(cache, layer, k)
    if vals.dtype == jnp.uint16:
        vals = jax.lax.bitcast_convert_type(vals, jnp.bfloat16)
    return vals, scale, positions


def write_index_key(cache: DecodeCache, layer: int, k: jax.Array,
                    positions: jax.Array, after: jax.Array | None = None) -> DecodeCache:
    """Store indexer keys [b, s, D] (already rotated if the model emulates fp8).

    `after`: int32 values that are never below −1 (top-k positions) computed from reads
    of this layer's keys; the write then depends on them, so XLA orders it after those
    reads and updates the buffer in place (with no data dependency between a read and
    an in-place update of one buffer, XLA:CPU copies the buffer). The offset added to
    the positions, (after < −1), is always 0."""
    with jax.named_scope("write_index_key"):
        if after is not None:
            flag = jax.lax.optimization_barrier(after).reshape(-1)[0] < -1
            positions = positions + flag.astype(positions.dtype)
        vals, scale = _encode_index_key(cache, layer, k)
        if scale is not None:
            return dataclasses.replace(
                cache, index_k=_scatter(cache.index_k, layer, positions, vals),
                index_scale=_scatter(cache.index_scale, layer, positions, scale))
        return dataclasses.replace(cache, index_k=_scatter(cache.index_k, layer, positions, vals))


def scan_bucket(n: int, max_len: int, minimum: int = MIN_SCAN) -> int | None:
    """The `DecodeCache.scan_len` for contexts of at most n positions: the next power of
    two (at least `minimum`), or None when that reaches max_len (scan everything)."""
    b = pow2_bucket(n, minimum)
    return None if b >= max_len else b


def prefill_scan(n: int, max_len: int) -> int | None:
    """The `scan_len` of a prefill chunk whose context reaches n positions: the scan
    bucket while the chunk may attend densely (`dense_rows`: at most DENSE_MAX_T
    positions), else None (all max_len). Past that the bucket would only bound the
    indexer's key scan, and the indexer skips key blocks past every request's length
    itself (`jlco.pallas.indexer_ref`), so a prefill compiles for 4 scan shapes per chunk
    width instead of one per power of two up to max_len."""
    from jlco.model.attention import DENSE_MAX_T
    b = scan_bucket(n, max_len)
    return b if b is not None and b <= DENSE_MAX_T else None


def index_keys(cache: DecodeCache, layer: int) -> tuple[jax.Array, jax.Array | None]:
    """Keys [b, t, D] in the form `indexer_topk` takes (float, or uint8 e4m3 + scale);
    t = cache.scan_len when set (positions beyond it are past every request's length)."""
    k = cache.index_k[layer]
    t = cache.scan_len
    if t is not None:
        k = k[:, :t]
    if cache.key_format == "fp8":
        s = cache.index_scale[layer]
        return k, s if t is None else s[:, :t]
    if k.dtype == jnp.uint16:
        k = jax.lax.bitcast_convert_type(k, jnp.bfloat16)
    return k, None


def layer_view(cache: DecodeCache, layer: int) -> DecodeCache:
    """The cache with only `layer`'s keys and scales (as its layer 0), for code that runs
    one layer under a traced layer index (the host-driven phases); the offloaded latent
    stays whole. `with_layer` puts the view's keys back."""
    scale = None if cache.index_scale is None else (cache.index_scale[layer],)
    return dataclasses.replace(cache, index_k=(cache.index_k[layer],), index_scale=scale)


def batch_rows(view: DecodeCache, b0, nb: int) -> DecodeCache:
    """A `layer_view` with its keys and scales cut to batch rows b0..b0+nb (b0 may be
    traced), for code that selects per micro-batch; the latent and lengths stay whole."""
    def cut(arrs):
        return None if arrs is None else tuple(
            jax.lax.dynamic_slice_in_dim(a, b0, nb, 0) for a in arrs)
    return dataclasses.replace(view, index_k=cut(view.index_k), index_scale=cut(view.index_scale))


def with_layer(cache: DecodeCache, layer: int, view: DecodeCache) -> DecodeCache:
    """`view` (from `layer_view`, possibly updated) with every other layer's keys of
    `cache` around its own."""
    def put(full, one):
        return None if full is None else full[:layer] + one + full[layer + 1:]
    return dataclasses.replace(view, index_k=put(cache.index_k, view.index_k),
                               index_scale=put(cache.index_scale, view.index_scale))


def advance(cache: DecodeCache, n_new: jax.Array) -> DecodeCache:
    """lengths += n_new [b] (real tokens written this step); the offload step counter
    (hot-buffer stamps) moves on."""
    lat = cache.latent
    if isinstance(lat, offload_latent.OffloadLatent):
        lat = offload_latent.next_step(lat)
    return dataclasses.replace(cache, latent=lat, lengths=cache.lengths + n_new.astype(jnp.int32))


def data_specs(cache: DecodeCache) -> DecodeCache:
    """The cache's tree with a PartitionSpec per leaf for data-parallel attention
    (`jlco.parallel.data.per_rank`): batch dimensions over "data", each layer's host pool
    over "data" on its rows (a rank's block of pages), the offload step counter and
    statistics replicated. It lives beside the cache because only the cache knows which
    dimension of each leaf is the batch."""
    P = PartitionSpec
    batch0, batch1 = P(DATA_AXIS), P(None, DATA_AXIS)
    lat = cache.latent
    if isinstance(lat, offload_latent.OffloadLatent):
        lat = dataclasses.replace(lat, rows=batch1, slot_pos=batch1, slot_stamp=batch1,
                                  slot_pref=batch1,
                                  host=tuple(batch0 for _ in lat.host), page_table=batch0,
                                  step=P(), stats=P())
    else:
        lat = tuple(batch0 for _ in lat)
    return dataclasses.replace(
        cache, latent=lat, index_k=tuple(batch0 for _ in cache.index_k),
        index_scale=None if cache.index_scale is None else tuple(batch0 for _ in cache.index_scale),
        lengths=batch0, record=None if cache.record is None else batch1,
        record_from=None if cache.record_from is None else P(),
        seen=None if cache.seen is None else jax.tree.map(lambda _: batch0, cache.seen))


def data_shardings(cache: DecodeCache, mesh, host_memory_kind: str | None) -> DecodeCache:
    """NamedShardings of `data_specs` on `mesh` (the host pool in `host_memory_kind`)."""
    out = jax.tree.map(lambda s: NamedSharding(mesh, s), data_specs(cache),
                       is_leaf=lambda x: isinstance(x, PartitionSpec))
    if isinstance(out.latent, offload_latent.OffloadLatent):
        host = tuple(NamedSharding(mesh, s.spec, memory_kind=host_memory_kind)
                     for s in out.latent.host)
        out = dataclasses.replace(out, latent=dataclasses.replace(out.latent, host=host))
    return out


def sum_rank_stats(cache: DecodeCache) -> DecodeCache:
    """Inside `per_rank`, on the way out: the offload statistics summed over the data
    ranks (each rank counted only its own requests' lookups)."""
    if not isinstance(cache.latent, offload_latent.OffloadLatent):
        return cache
    lat = cache.latent
    return dataclasses.replace(cache, latent=dataclasses.replace(
        lat, stats=jax.lax.psum(lat.stats, DATA_AXIS)))
