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
           `jax.device_put` sends them in chunks of at most `fetch_chunk_rows` rows,
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

Prefetch: what this path moves ahead of need is (1) the newest token's row, inserted
into the hot buffer by `pre` rather than fetched, (2) the rows selected in the previous
step, kept resident by the hot buffer, (3) at admission the warm-up set (top-k of the
last prefill queries), fetched in one batch per layer, (4) an IndexShare group's rows,
planned and fetched once at its full layer, and (5) with `cache.prefetch_ahead` the
predicted rows of the full layer d = `cache.prefetch_depth` ahead: after layer L's
selection, `_predict` runs layer L+d's indexer on L's input and plans the predicted
misses (`plan_prefetch`: victim slots flagged as prefetched); their rows are gathered
and sent while L's attention and post run, and L+d's real selection fetches only what
the prediction missed (exact: the real top-k decides). Depth "auto" is re-derived
after each step from its time and the rows predicted (`jlco.offload.schedule`).
The rest is fetched on demand: `prefetch_threads` parallelise the numpy gather of a
large miss list and overlap it with the transfer of earlier chunks; `fetch_chunk_rows`
bounds the rows per transfer chunk (0 = one chunk; "auto" derived from the measured
transfer path, `jlco.engine.fetch_schedule`).

Split attention (`cache.split_attention`): each micro-batch's attention over the rows
already resident is dispatched before its misses are fetched, the fetched rows are
attended after, and the two partial results merged by log-sum-exp
(`jlco.pallas.lse_merge`): within f32 rounding of one attention.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.config import Config
from jlco.engine import fetch_schedule, speculative
from jlco.engine import steps as engine_steps
from jlco.engine.inputs import StepInputs
from jlco.model import attention, kv_cache
from jlco.model.kv_cache import DecodeCache, cache_layers
from jlco.offload.host_fetch import HostFetcher, miss_list
from jlco.offload.host_pool import HostLatentPool, host_row_ids
from jlco.offload.latent import (follows, group_layers, plan_prefetch, resolve_selection,
                                 table_groups)
from jlco.pallas.lse_merge import merge_by_lse
from jlco.parallel import mesh as parallel_mesh


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


# ---- jitted phases (layer and micro-batch start are traced: one compile per layer kind).
# Each phase is a piece of the one decode step (`engine_steps`, `MLA.__call__`), cut where
# the host has work: the same functions compute the same bits on both paths.
@functools.partial(jax.jit, donate_argnums=2)
def _begin(graphdef, state, cache: DecodeCache, tokens, active):
    """`engine_steps.open_step`, then the model's inputs (embed, positions, RoPE)."""
    cache, saved = engine_steps.open_step(cache, active)
    x, cos, sin, positions, kernel_lengths = nnx.merge(graphdef, state).inputs(tokens, cache)
    return cache, saved, x, cos, sin, positions, kernel_lengths


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _pre(spec, leaves, cache: DecodeCache, layer, x, cos, sin, positions):
    """Projections and the cache writes of `MLA.__call__` (`MLA.write`: the new latent
    row into the hot buffer — the host pool is outside the jit — and the indexer key).
    → (cache, q, (indexer q, weights, key), host ids [b*s], row bytes [b*s, R]) for the
    caller's `HostLatentPool.write`; the key goes to `_select` too, which scores it as
    `MLA.__call__` does (`MLA.select`), so both paths compute the same bits."""
    block = _block(spec, leaves)
    latent, q, iq, ik, iw = block.pre(x, cos, sin)
    # `cache` is a `kv_cache.layer_view`: this layer's keys are its layer 0.
    cache = block.self_attn.write(cache, layer, 0, latent, ik, positions)
    lat = cache.latent
    ids = host_row_ids(lat.page_table, positions, lat.page_size)
    data = kv_cache.encode_rows(latent, cache.kv_format, cache.d_rope)
    return cache, q, (iq, iw, ik), ids.reshape(-1), data.reshape(-1, data.shape[-1])


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2, static_argnames=("nb", "impl"))
def _select(spec, leaves, cache: DecodeCache, layer, b0, indexer_in, positions, kernel_lengths,
            topk=None, slot_ids=None, predicted=None, *, nb: int, impl: str):
    """Micro-batch [b0, b0+nb): top-k (`MLA.select`; in a layer that shares its top-k,
    the last full layer's `topk` [nb,s,k] instead), the lookup half of
    `offload.latent.latent_for_attention` (`resolve_selection`) → (cache, slot ids
    [nb,s,k], missed host ids [nb,M], flat destinations [nb,M] into
    rows[layer].reshape(b*m, R), −1 = none, the top-k used). `slot_ids`: a shared
    layer of a grouped table, whose full layer planned (and fetched) for it: only the
    record, no lookup, no miss list (None, None). `predicted` [nb,s,k]: the layer-ahead
    prediction of this micro-batch's top-k, whose accuracy is counted."""
    if topk is None:
        view = kv_cache.batch_rows(cache, b0, nb)
        iq, iw, ik = (_slice(a, b0, nb) for a in indexer_in)
        topk = _block(spec, leaves).self_attn.select(
            view, 0, iq, iw, _slice(kernel_lengths, b0, nb), impl, ik,
            _slice(positions, b0, nb))
    rec = cache.record
    if rec is not None and rec.shape[2:] == topk.shape[1:]:
        cache = dataclasses.replace(cache, record=rec.at[layer].set(
            jax.lax.dynamic_update_slice_in_dim(rec[layer], topk, b0, 0)))
    if slot_ids is not None:
        return cache, slot_ids, None, None, topk
    lat, res = resolve_selection(cache.latent, layer, topk, cache.scan_len, b0, predicted)
    miss_ids, dest = miss_list(res, _slice(lat.page_table, b0, nb), lat.page_size,
                               lat.rows.shape[2], b0)
    return dataclasses.replace(cache, latent=lat), res.slot_ids, miss_ids, dest, topk


def _hot_ids(rows, layer, b0, slot_ids, nb: int):
    """Micro-batch [b0, b0+nb)'s hot rows [nb*m, R] and its slot ids [nb,s,k] as row ids
    into them (−1 kept)."""
    hot = _slice(rows[layer], b0, nb)                                     # [nb, m, R]
    _, m, r = hot.shape
    base = jnp.arange(nb, dtype=jnp.int32)[:, None, None] * m
    return hot.reshape(nb * m, r), jnp.where(slot_ids >= 0, base + slot_ids, -1).astype(
        jnp.int32)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("nb", "kv_format", "impl"))
def _attend(spec, leaves, rows, layer, b0, q, slot_ids, *, nb: int, kv_format: str,
            impl: str):
    """Sparse MLA of micro-batch [b0, b0+nb) over its hot-buffer rows → [nb,s,h,c]."""
    hot, ids = _hot_ids(rows, layer, b0, slot_ids, nb)
    return _block(spec, leaves).self_attn.attend(_slice(q, b0, nb), hot, ids, kv_format, impl)


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("nb", "kv_format", "impl", "missed"))
def _attend_part(spec, leaves, rows, layer, b0, q, slot_ids, dest, *, nb: int,
                 kv_format: str, impl: str, missed: bool):
    """Hit/miss split attention (`cache.split_attention`): sparse MLA of micro-batch
    [b0, b0+nb) over only the rows resident before this step's fetch (`missed` False:
    slots the miss list `dest` [nb, M] does not refill, readable while the misses
    transfer) or only the refilled ones (`missed` True, after the fetch) → (out
    [nb,s,h,c], lse [nb,s,h]; +inf where the part is empty), for `merge_by_lse`."""
    hot, ids = _hot_ids(rows, layer, b0, slot_ids, nb)
    n = hot.shape[0]
    local = jnp.where(dest >= 0, dest - b0 * (n // nb), n).reshape(-1)
    refilled = jnp.zeros((n + 1,), bool).at[local].set(True)
    keep = (ids >= 0) & (refilled[jnp.where(ids >= 0, ids, n)] == missed)
    mla = _block(spec, leaves).self_attn
    return attention.sparse_mla(_slice(q, b0, nb), hot, jnp.where(keep, ids, -1),
                                mla.cfg.softmax_scale, kv_format=kv_format,
                                d_rope=mla.cfg.qk_rope_head_dim, impl=impl)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("impl",))
def _predict(spec, leaves, view: DecodeCache, layer, x, cos, sin, positions, kernel_lengths,
             *, impl: str):
    """Layer-ahead prefetch (`cache.prefetch_ahead`): `layer`'s indexer (its norm,
    projections and top-k over its cached keys, `view` a `kv_cache.layer_view` of it) on
    the input x of the layer before it (known while that layer computes) → its predicted
    top-k [b,s,k] (this step's own positions dropped: their rows are not in the pool
    yet), planned against its hot buffer (`plan_prefetch`) → ((slot_pos, slot_stamp,
    slot_pref, stats) after the plan, missed host ids [b,M], flat destinations [b,M],
    the prediction). Only the small tables come back: the hot buffer is read, not
    copied."""
    block = _block(spec, leaves)
    _, _, iq, ik, iw = block.pre(x, cos, sin)
    guess = block.self_attn.select(view, 0, iq, iw, kernel_lengths, impl, ik, positions)
    guess = jnp.where(guess < positions[:, :1, None], guess, -1)
    lat, res = plan_prefetch(view.latent, layer, guess, view.scan_len)
    miss_ids, dest = miss_list(res, lat.page_table, lat.page_size, lat.rows.shape[2])
    return (lat.slot_pos, lat.slot_stamp, lat.slot_pref, lat.stats), miss_ids, dest, guess


@functools.partial(jax.jit, static_argnums=0)
def _post(spec, leaves, x, outs):
    return _block(spec, leaves).post(x, jnp.concatenate(outs, axis=0))


def _end_forward(graphdef, state, cache: DecodeCache, x, active, saved_table):
    """The model's `finish` (final norm, lengths advanced) and `engine_steps.close_step`
    → (logits, cache)."""
    model = nnx.merge(graphdef, state)
    h, cache = model.finish(x, cache)
    return model.logits(h), engine_steps.close_step(cache, active, saved_table)


_end = jax.jit(_end_forward, donate_argnums=2)


@functools.partial(jax.jit, donate_argnums=2)
def _end_decode(graphdef, state, cache, x, saved_table, inputs: StepInputs):
    logits, cache = _end_forward(graphdef, state, cache, x, inputs.active, saved_table)
    return engine_steps.sample_and_count(logits[:, -1], inputs, cache)


@functools.partial(jax.jit, donate_argnums=2)
def _spec_begin(graphdef, state, cache: DecodeCache, inputs: StepInputs, pend_n):
    """A speculative step's start (`speculative.spec_step` before its drafter):
    `engine_steps.open_step` → (cache, saved page table, lengths before, x_L [b])."""
    cache, saved = engine_steps.open_step(cache, inputs.active)
    return cache, saved, cache.lengths, speculative.last_tokens(inputs, pend_n)


@jax.jit
def _mtp_inputs(graphdef, state, h, next_tokens, start):
    """`DeepseekV32.mtp_inputs`: what the MTP block takes."""
    return nnx.merge(graphdef, state).mtp_inputs(h, next_tokens, start)


@jax.jit
def _mtp_draft(graphdef, state, x, last):
    """The MTP head over the block's output x [b,s,d] → (the draft at each row's
    position `last` [b], its hidden [b, d]), as `speculative.MTPDrafter.propose`."""
    logits = nnx.merge(graphdef, state).mtp.shared_head(x)
    rows = jnp.arange(x.shape[0])
    return jnp.argmax(logits[rows, last], axis=-1).astype(jnp.int32), x[rows, last]


@functools.partial(jax.jit, static_argnames=("drafter", "n"))
def _propose(graphdef, state, cache, inputs, *, drafter, n: int):
    """A drafter that reads no latent rows (`Drafter.needs_mtp_cache` false) → drafts."""
    return drafter.propose(nnx.merge(graphdef, state), cache, inputs, n=n, impl="xla")[0]


@jax.jit
def _step_inputs(graphdef, state, cache: DecodeCache, tokens):
    """`DeepseekV32.inputs` on a cache the step already opened."""
    return nnx.merge(graphdef, state).inputs(tokens, cache)


@functools.partial(jax.jit, donate_argnums=2, static_argnames=("rule",))
def _spec_end(graphdef, state, cache: DecodeCache, x, saved, inputs: StepInputs, before,
              drafts, *, rule: str):
    """The model's `finish`, then `speculative.finish_spec`."""
    model = nnx.merge(graphdef, state)
    h, cache = model.finish(x, cache)
    return speculative.finish_spec(model, h, cache, saved, inputs, before, drafts, rule=rule)


_warm_up_tables = jax.jit(functools.partial(engine_steps.warm_up, fetch=False),
                          donate_argnums=0)


def _close(pool: HostLatentPool, fetcher: HostFetcher) -> None:
    fetcher.close()
    pool.close()


def _ahead_of(cfg: Config, i: int, n_layers: int, depth: int) -> int | None:
    """The layer predicted while main layer i computes: i + depth, when it is a main
    layer that runs its own indexer (a shared layer's rows come with its full layer's)."""
    t = i + depth
    return t if t < n_layers and not cfg.model.shares_topk(t) else None


def _prefetch(fetcher: HostFetcher, metrics, cache: DecodeCache, layer: int, miss_ids, dest):
    """The predicted misses of `layer` (and of the shared layers of its group) into the
    victim slots `plan_prefetch` gave them; counted in `metrics` (None: not recorded) as
    rows moved host→device (h2d_rows / h2d_moved_rows), not as a fetch wait (no
    attention waits on them). → (cache, rows sent)."""
    members = group_layers(cache.latent, layer)
    ids, dest = jax.device_get((miss_ids, dest))
    keep = dest >= 0
    rows, moved = fetcher.send(cache.latent.rows, members, ids[keep], dest[keep])
    if metrics is not None:
        for m in members:
            metrics.update(m, h2d_rows=int(keep.sum()), h2d_moved_rows=moved)
    return (dataclasses.replace(cache, latent=dataclasses.replace(cache.latent, rows=rows)),
            int(keep.sum()))


class HostDriven:
    """The engine's host-driven fetch path. Owns the host pool (pinned_host,
    unpinned_host or an np.memmap file) and the gather threads; `decode_step`,
    `forward`, `install` and `warm_up` take and return what the engine's jitted in-jit
    functions do, so `Engine` swaps them in and nothing else changes."""

    def __init__(self, cfg: Config, graphdef, state, *, impl: str, num_pages: int, metrics):
        self.cfg, self.impl, self.metrics = cfg, impl, metrics
        model = nnx.merge(graphdef, state)
        specs: dict = {}

        def phases(block):
            graphdef, state = nnx.split(block)
            leaves, treedef = jax.tree.flatten(state)
            return specs.setdefault((graphdef, treedef), _Spec(graphdef, treedef)), tuple(leaves)

        self.layers = [phases(layer) for layer in model.layers]
        self.mtp_block = None if model.mtp is None else phases(model.mtp.block)
        self.page_size = cfg.cache.page_size
        # On a mesh: one pool in this process's memory, rows sent to every device that
        # holds them (the hot buffer's sharding), not a pool per device.
        mesh = parallel_mesh.active_mesh() is not None
        self.pool = HostLatentPool(cache_layers(cfg), num_pages, self.page_size, cfg.row_bytes,
                                   storage=cfg.cache.storage,
                                   storage_path=cfg.cache.storage_path, process_memory=mesh)
        self.fetcher = HostFetcher(self.pool, fetch_schedule.chunk_rows(cfg),
                                   cfg.cache.prefetch_threads,
                                   parallel_mesh.replicated() if mesh else None)
        # Data ranks hand out rank-local page ids (`offload.pages.RankedPages`); the one
        # pool here holds rank r's pages from r * pages_per_rank on.
        ranks = cfg.mesh.data
        self._rank_pages = (cfg.engine.max_batch_size // ranks, num_pages // ranks)
        self._finalizer = weakref.finalize(self, _close, self.pool, self.fetcher)
        self.micro = micro_batches(cfg.engine.max_batch_size)
        self._ids = [jnp.int32(i) for i in range(cache_layers(cfg))]
        self._b0 = {b0: jnp.int32(b0) for b0, _ in self.micro}
        self._install = jax.jit(engine_steps.install, donate_argnums=0)
        self.depth = (fetch_schedule.prefetch_depth(cfg, len(self.layers))
                      if cfg.cache.prefetch_ahead else None)

    def close(self) -> None:
        """Wait for pending writes, stop the gather threads, drop the pool (a "file"
        pool deletes its file). Also runs when the driver is garbage-collected."""
        self._finalizer()

    # ---- the engine's entry points ---------------------------------------------
    def forward(self, graphdef, state, cache: DecodeCache, tokens, active):
        """As `engine_steps.forward`: tokens [b, s] → (logits [b, s, V], cache)."""
        cache, saved, x = self._layers(graphdef, state, cache, tokens, active, record=False)
        return _end(graphdef, state, cache, x, active, saved)

    def decode_step(self, graphdef, state, cache: DecodeCache, inputs: StepInputs):
        """As `engine_steps.decode_step`: → (tokens [b], logprobs [b], cache)."""
        cache, saved, x = self._layers(graphdef, state, cache, inputs.tokens, inputs.active,
                                       record=True)
        return _end_decode(graphdef, state, cache, x, saved, inputs)

    def install(self, cache: DecodeCache, temp: DecodeCache, slot, n, page_row, seen_row=None):
        """As `engine_steps.install`, plus the prefilled rows into the host pool. With data
        ranks the slot's page table holds pool-wide page ids (rank-local ids + the rank's
        first page), so every phase addresses the one pool."""
        slots_per_rank, pages_per_rank = self._rank_pages
        table = np.asarray(page_row)
        table = np.where(table >= 0, table + int(slot) // slots_per_rank * pages_per_rank, -1)
        page_row = jnp.asarray(table, jnp.int32)
        cache = self._install(cache, temp, slot, n, page_row, seen_row)
        n, p = int(n), self.page_size
        pos = np.arange(temp.max_len)
        page = table[np.minimum(pos // p, len(table) - 1)]
        ids = np.where((pos < n) & (pos // p < len(table)) & (page >= 0), page * p + pos % p, -1)
        for layer in range(len(self._ids)):
            self.pool.write(layer, ids, temp.latent[layer][0])
        return cache

    def warm_up(self, cache: DecodeCache, slot, record):
        """As `engine_steps.warm_up`: the same tables, then the resident rows fetched in
        one batch per slot table (an IndexShare group's layers together). → (cache,
        rows missed during the warm-up sequence)."""
        cache, fetched = _warm_up_tables(cache, slot, record)
        lat, s = cache.latent, int(slot)
        pos, table = jax.device_get((lat.slot_pos[:, s], lat.page_table[s]))
        cap, p, rows = lat.rows.shape[2], self.page_size, lat.rows
        for t, members in enumerate(table_groups(lat)):
            held = np.nonzero(pos[t] >= 0)[0]
            q = pos[t, held]
            rows, _ = self.fetcher.send(rows, members, table[q // p] * p + q % p,
                                        s * cap + held)
        return dataclasses.replace(cache, latent=dataclasses.replace(lat, rows=rows)), fetched

    def spec_step(self, graphdef, state, cache: DecodeCache, pend_h, inputs: StepInputs,
                  pend_n, host_drafts, *, drafter, n: int, rule: str):
        """As `speculative.spec_step`, every attention block (the MTP block's included)
        run as phases with the host fetching misses in between. MTP drafts run the
        MTP block here; another drafter's `propose` runs in one jit and must read no
        latent rows."""
        cache, saved, before, last = _spec_begin(graphdef, state, cache, inputs, pend_n)
        draft_in = speculative.DraftInputs(pend_h, inputs.tokens, pend_n, host_drafts)
        if drafter.needs_mtp_cache:
            drafts, cache = self._mtp_drafts(graphdef, state, cache, draft_in, before, n)
        else:
            drafts = _propose(graphdef, state, cache, draft_in, drafter=drafter, n=n)
        tokens = jnp.concatenate([last[:, None], drafts], axis=1)
        x, cos, sin, positions, lengths = _step_inputs(graphdef, state, cache, tokens)
        cache, x = self._run_layers(cache, x, cos, sin, positions, lengths, record=True)
        return _spec_end(graphdef, state, cache, x, saved, inputs, before, drafts, rule=rule)

    def _mtp_drafts(self, graphdef, state, cache, d: "speculative.DraftInputs", lengths, n):
        """`speculative.MTPDrafter.propose` with the MTP block as phases → (drafts [b, n],
        cache): the catch-up over each slot's pending positions, then the chain."""
        layer = self.cfg.model.num_hidden_layers
        gd, st = self.mtp_block
        h, tok, start, last = d.pend_h, d.pend_tok, lengths - d.pend_n, d.pend_n - 1
        drafts = []
        for j in range(n):
            x, cos, sin, positions, klen = _mtp_inputs(graphdef, state, h, tok, start)
            cache, x = self._layer(layer, gd, st, cache, x, cos, sin, positions, klen, True,
                                   [(None, None)] * len(self.micro))
            draft, hx = _mtp_draft(graphdef, state, x, last)
            drafts.append(draft)
            h, tok, start, last = hx[:, None], draft[:, None], lengths + j, jnp.zeros_like(last)
        host = d.host_drafts
        return jnp.where(host >= 0, host, jnp.stack(drafts, axis=1)), cache

    # ---- one step --------------------------------------------------------------
    def _layers(self, graphdef, state, cache, tokens, active, record: bool):
        cache, saved, x, cos, sin, positions, lengths = _begin(graphdef, state, cache,
                                                               tokens, active)
        cache, x = self._run_layers(cache, x, cos, sin, positions, lengths, record)
        return cache, saved, x

    def _run_layers(self, cache, x, cos, sin, positions, lengths, record: bool):
        """Every main layer over the step's inputs → (cache, last layer's output)."""
        # The last full layer's (top-k, slot ids) per micro-batch.
        topk = [(None, None)] * len(self.micro)
        ahead = None if self.depth is None else {"sent": [], "depth": self.depth.depth}
        t0 = time.perf_counter()
        for i, (gd, st) in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                cache, x = self._layer(i, gd, st, cache, x, cos, sin, positions, lengths,
                                       record, topk, ahead)
        if ahead is not None and ahead["sent"]:   # `cache.prefetch_depth="auto"`
            self.depth.observe(time.perf_counter() - t0, float(np.mean(ahead["sent"])))
        return cache, x

    def _layer(self, i, gd, st, cache, x, cos, sin, positions, lengths, record: bool, topk,
               ahead: dict | None = None):
        """One layer, two micro-batches overlapped (see the module docstring). `topk`
        holds the last full layer's (top-k, slot ids) per micro-batch: a layer that
        shares it (IndexShare) reads it, a full layer replaces it. With grouped slot
        tables the full layer's plan and fetch cover the shared layers after it
        (`group_layers`), so a shared layer only attends. `ahead` (main layers with
        `cache.prefetch_ahead`): layer → its predicted top-k; this layer's prediction is
        read (its accuracy counted) and the one of the full layer `depth` ahead made
        (`_predict_next`); "sent" collects the rows each prediction sent."""
        layer, shared = self._ids[i], self.cfg.model.shares_topk(i)
        full, cache = cache, kv_cache.layer_view(cache, i)
        cache, q, indexer_in, new_ids, new_rows = _pre(gd, st, cache, layer, x, cos, sin,
                                                       positions)
        self.pool.write(i, new_ids, new_rows)
        follow = follows(cache.latent, shared)
        members = group_layers(cache.latent, i)
        guess = None if ahead is None else ahead.pop(i, None)
        selected = []
        for j, (b0, nb) in enumerate(self.micro):
            prev, prev_ids = topk[j] if shared else (None, None)
            cache, slot_ids, miss_ids, dest, used = _select(
                gd, st, cache, layer, self._b0[b0], indexer_in, positions, lengths, prev,
                prev_ids if follow else None, None if guess is None else guess[b0:b0 + nb],
                nb=nb, impl=self.impl)
            topk[j] = (used, slot_ids)
            selected.append((b0, nb, slot_ids, miss_ids, dest))
        plan = target = None
        if ahead is not None:
            target = _ahead_of(self.cfg, i, len(self.layers), ahead["depth"])
        if target is not None:
            cache, plan = self._predict_next(i, target, full, cache, x, cos, sin, positions,
                                             lengths)
            ahead[target] = plan[-1]
        cache, outs = self._attend_all(gd, st, cache, layer, q, selected, members, record)
        x = _post(gd, st, x, tuple(outs))
        if plan is not None:   # the predicted misses move while post runs
            cache, sent = _prefetch(self.fetcher, self.metrics if record else None, cache,
                                    target, *plan[:2])
            ahead["sent"].append(sent)
        return kv_cache.with_layer(full, i, cache), x

    # ---- layer-ahead prefetch (`cache.prefetch_ahead`) ---------------------------
    def _predict_next(self, i, nxt, full, cache, x, cos, sin, positions, lengths):
        """Dispatch layer nxt's prediction from layer i's input x (`_predict`) → (cache
        with its plan in the slot tables, (missed host ids, destinations, predicted
        top-k))."""
        view = kv_cache.layer_view(kv_cache.with_layer(full, i, cache), nxt)
        gd, st = self.layers[nxt]
        tables, miss_ids, dest, guess = _predict(gd, st, view, self._ids[nxt], x, cos, sin,
                                                 positions, lengths, impl=self.impl)
        slot_pos, slot_stamp, slot_pref, stats = tables
        lat = dataclasses.replace(cache.latent, slot_pos=slot_pos, slot_stamp=slot_stamp,
                                  slot_pref=slot_pref, stats=stats)
        return dataclasses.replace(cache, latent=lat), (miss_ids, dest, guess)


    def _attend_all(self, gd, st, cache, layer, q, selected, members, record: bool):
        """Each micro-batch's misses fetched, then its attention → (cache, outs). With
        `cache.split_attention` the attention over the resident rows of every
        micro-batch is dispatched before any fetch (the device computes it while the
        host gathers and sends the misses), the fetched rows are attended after, and
        the two merged by log-sum-exp (`merge_by_lse`); a micro-batch that missed
        nothing takes its resident part as is."""
        kw = dict(kv_format=cache.kv_format, impl=self.impl)
        split = self.cfg.cache.split_attention
        hits = [_attend_part(gd, st, cache.latent.rows, layer, self._b0[b0], q, slot_ids,
                             dest, nb=nb, missed=False, **kw)
                if split and miss_ids is not None else None
                for b0, nb, slot_ids, miss_ids, dest in selected]
        outs = []
        for (b0, nb, slot_ids, miss_ids, dest), hit in zip(selected, hits):
            moved = 0
            if miss_ids is not None:
                rows, moved = self._fetch(cache.latent.rows, members, miss_ids, dest, record)
                cache = dataclasses.replace(cache, latent=dataclasses.replace(cache.latent,
                                                                              rows=rows))
            if hit is None:
                outs.append(_attend(gd, st, cache.latent.rows, layer, self._b0[b0], q,
                                    slot_ids, nb=nb, **kw))
            elif not moved:
                outs.append(hit[0])
            else:
                miss = _attend_part(gd, st, cache.latent.rows, layer, self._b0[b0], q,
                                    slot_ids, dest, nb=nb, missed=True, **kw)
                outs.append(merge_by_lse(*hit, *miss)[0])
        return cache, outs

    # ---- host work (the transfer itself: jlco.offload.host_fetch) -----------------
    def _fetch(self, rows, layers: tuple[int, ...], miss_ids, dest, record: bool):
        """The miss list back (the one sync), the rows of every layer of the group
        gathered and sent together; the time blocked here is the full layer's fetch
        wait, the rows moved are counted for each layer. → (rows, rows moved per layer
        incl. padding)."""
        t0 = time.perf_counter()
        rows, moved = self.fetcher.fetch(rows, layers, miss_ids, dest)
        if record:
            wait = time.perf_counter() - t0
            for n, layer in enumerate(layers):
                self.metrics.update(layer, h2d_moved_rows=moved,
                                    fetch_wait_s=0.0 if n else wait)
        return rows, moved
