"""The model runner: owns the model state, the batch cache (device, or host pool + device
hot buffer when offloaded), the jitted steps and the offload counters; executes what the
scheduler planned and returns tokens and log-probs. No request bookkeeping: it reads a
request's prompt, slot, sampling fields and tokens so far, and never changes them.

A new request is prefilled alone on a one-request device cache (as a PD-disaggregated
decode node receives a finished prefill), then installed in its slot: with offload its
latent rows go to its host pages and the hot buffer is warmed with the top-k of the last
prefill queries (ESS, the offload design this engine follows). Then `decode` runs one
jitted step for all slots (in-jit fetch), or with `cache.fetch_path="host_driven"` (and
storage "file") the per-layer phases of `jlco.engine.host_driven` with the host fetching
misses in between; with `engine.num_draft_tokens` > 0 the speculative step of
`jlco.engine.speculative`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.config import Config
from jlco.engine import host_driven, steps
from jlco.engine.scheduler import Request
from jlco.engine.transfer import PrefilledRequest
from jlco.model.decode import _logits, prefill
from jlco.model.kv_cache import DecodeCache, cache_layers, init_cache, scan_bucket
from jlco.offload.latent import STAT_NAMES, OffloadLatent
from jlco.offload.metrics import OffloadMetrics
from jlco.offload.pages import PageAllocator, RankedPages
from jlco.pallas import dispatch
from jlco.parallel import data as parallel_data
from jlco.parallel import mesh as parallel_mesh
from jlco.util.buckets import pow2_bucket

WARMUP_QUERIES = 32   # ESS: top-k of the last 32 prefill query positions
MIN_PIECE = 16        # smallest prefill piece shape (fewer distinct compiled shapes)


def _chunk_rows(cfg: Config) -> int:
    """In-jit fetch moves misses in chunks of this many rows (0 = one padded gather of
    every possible miss); the prefetch window bounds it."""
    return max(0, min(cfg.cache.prefetch_window, cfg.staging_capacity))


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
    machine's RAM: it would swap or be killed mid-run. A ValueError names the fields."""
    ram = physical_memory_bytes()
    if cfg.cache.storage == "file" or ram is None or pool_bytes <= HOST_MEMORY_LIMIT * ram:
        return
    raise ValueError(
        f"the host pool needs {pool_bytes / 1e9:.1f} GB, above {HOST_MEMORY_LIMIT:.0%} of this "
        f"machine's {ram / 1e9:.1f} GB of RAM: lower engine.max_batch_size "
        f"({cfg.engine.max_batch_size}) or engine.max_context_len "
        f"({cfg.engine.max_context_len}), or use cache.storage='file'")


def allocate_cache(cfg: Config) -> tuple[DecodeCache, PageAllocator | None]:
    """The engine's batch cache for `cfg.engine.max_batch_size` slots and, offloaded, its
    host page allocator. Offloaded, the latent cache is a host pool per layer (in
    `cfg.cache.storage` memory) behind a device hot buffer; `device_cache_bytes` counts
    exactly this allocation. Under a mesh with data ranks every leaf is split over them
    (`jlco.parallel.data.cache_specs`), allocated in place by one jit."""
    if parallel_data.data_size() > 1:
        return _allocate_split(cfg)
    return _allocate(cfg)


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
    shardings = parallel_data.cache_shardings(shapes, mesh, cfg.cache.storage)
    return jax.jit(build, out_shardings=shardings)(), pages


def _allocate(cfg: Config, host_memory: bool = True
              ) -> tuple[DecodeCache, PageAllocator | None]:
    pages = host_pages(cfg)
    if pages is None:
        return init_cache(cfg), None
    check_host_memory(cfg, pages.num_pages * cfg.cache.page_size * cfg.row_bytes
                      * cache_layers(cfg))
    # Host-driven: the pool is host_driven's HostLatentPool, outside the jitted cache.
    host_driven_path = host_driven.resolve_fetch_path(cfg) == "host_driven"
    batch, page = cfg.engine.max_batch_size, cfg.cache.page_size
    pages_per_req = pages.num_pages // batch
    n_layers, cap, rb = cache_layers(cfg), cfg.staging_capacity, cfg.row_bytes
    if not host_driven_path and host_memory:
        host = parallel_mesh.replicated(cfg.cache.storage)   # whole on every mesh device
        zeros = jax.jit(lambda: jnp.zeros((pages.num_pages * page, rb), jnp.uint8),
                        out_shardings=host)
    elif not host_driven_path:   # traced by `_allocate_split`, which places it
        def zeros():
            return jnp.zeros((pages.num_pages * page, rb), jnp.uint8)
    lat = OffloadLatent(
        rows=jnp.zeros((n_layers, batch, cap, rb), jnp.uint8),
        slot_pos=jnp.full((n_layers, batch, cap), -1, jnp.int32),
        slot_stamp=jnp.full((n_layers, batch, cap), -1, jnp.int32),
        host=() if host_driven_path else tuple(zeros() for _ in range(n_layers)),
        page_table=jnp.full((batch, pages_per_req), -1, jnp.int32),
        step=jnp.int32(0), stats=jnp.zeros((n_layers, len(STAT_NAMES)), jnp.int32),
        policy=cfg.cache.eviction, page_size=page, chunk_rows=_chunk_rows(cfg))
    return init_cache(cfg, latent=lat), pages


def device_cache_bytes(cfg: Config, batch: int) -> int:
    """Device bytes of the cache `allocate_cache` makes for `batch` slots, from its
    abstract shapes (nothing is allocated, so real-model configs are cheap): every leaf
    but the offloaded host pool (`OffloadLatent.host`) lives in device memory."""
    # Whole-batch shapes (data ranks split the same bytes, and need not divide `batch`).
    cfg = cfg.replace(engine__max_batch_size=batch, mesh__data=1)
    shapes = jax.eval_shape(lambda: _allocate(cfg)[0])
    host = shapes.latent.host if isinstance(shapes.latent, OffloadLatent) else ()
    return _nbytes(shapes) - _nbytes(host)


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


# A prefill's first token, compiled once (called eagerly, `sample_rows`' lax.cond would be
# traced and compiled again for every request).
_sample_first = jax.jit(steps.sample_rows)


@jax.jit
def _oldest_first(record, w):
    """The recorded top-k of a last prefill piece [L, bucket, k] whose first w queries are
    real: those w last (oldest first), the padding queries before them as -1 (no lookups),
    so the warm-up stamps query j at step - w + j whatever the bucket."""
    bucket = record.shape[1]
    real = jnp.where((jnp.arange(bucket) < w)[None, :, None], record, -1)
    return jnp.roll(real, bucket - w, axis=1)


def sample_key(seed: int, count: int) -> np.ndarray:
    """The sampling key of a request's token number `count` (0 = the prefill's token):
    one stream per request, independent of batch and slot."""
    return np.asarray(jax.random.fold_in(jax.random.PRNGKey(seed), count))


@dataclasses.dataclass(frozen=True)
class DecodeOutput:
    """One decode step: per decoded request (in the order given), the tokens it emitted
    (1, or up to 1 + drafts with speculative decoding) and their log-probs; with
    speculative decoding also the drafts proposed for it and how many were accepted."""
    tokens: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    seconds: float
    drafted: tuple[int, ...] = ()
    wait_seconds: float = 0.0           # of `seconds`, blocked waiting for the device
    accepted: tuple[int, ...] = ()


@dataclasses.dataclass(eq=False)
class PrefillJob:
    """A request's prefill in progress: its one-request cache `temp` and the prompt
    pieces (lo, hi, chunk shape) still to run."""
    req: Request
    page_row: np.ndarray | None
    temp: DecodeCache | None
    tokens: np.ndarray                        # int32 [1, n]
    pieces: list[tuple[int, int, int]]
    done_pieces: int = 0
    logits: jax.Array | None = None           # at the last prompt position so far
    hidden: jax.Array | None = None           # its final hidden state [1, d]

    @property
    def finished(self) -> bool:
        return self.done_pieces == len(self.pieces)

    @property
    def pending_cost(self) -> int:
        """Padded prompt positions left to compute."""
        return sum(c for _, _, c in self.pieces[self.done_pieces:])


@dataclasses.dataclass(frozen=True)
class PendingDecode:
    """A dispatched decode step: the device arrays to read (`arrays`), or the finished
    output (`done`) for steps that ran to the end."""
    running: tuple[Request, ...]
    t0: float
    arrays: tuple | None = None
    done: DecodeOutput | None = None


class ModelRunner:
    """Device side of the engine for `cfg.engine.max_batch_size` slots."""

    def __init__(self, cfg: Config, model, *, impl: str | None = None,
                 trace_path: str | None = None, warmup_queries: int = WARMUP_QUERIES,
                 drafter=None):
        """trace_path: record every decode step's top-k positions (request, step, layer,
        ids) to a `jlco.planning.trace` file. warmup_queries: how many final prefill
        queries' top-k sets warm a new request's hot buffer (0 = none). drafter: a
        `jlco.engine.speculative.Drafter` (default: the MTP layer) when
        cfg.engine.num_draft_tokens > 0."""
        if isinstance(warmup_queries, bool) or not isinstance(warmup_queries, int) \
                or warmup_queries < 0:
            raise ValueError(f"warmup_queries={warmup_queries!r}: allowed an integer >= 0")
        self.cfg = cfg
        self.warmup_queries = warmup_queries
        self.impl = dispatch.resolve(impl or cfg.engine.attention_impl)
        self.graphdef, self.state = nnx.split(model)
        self.batch = cfg.engine.max_batch_size
        self.max_len = cfg.engine.max_context_len
        self.offload = cfg.cache.offload
        self.metrics = OffloadMetrics(cache_layers(cfg), cfg.row_bytes) if self.offload else None
        self.warmup_rows = 0   # rows fetched by admission warm-ups (all layers)
        self._imported: dict[int, tuple] = {}   # unclaimed imports: (payload, page row)
        self.cache, self.pages = allocate_cache(cfg)
        # Positions cached per slot, mirrored on the host so choosing a step's indexer
        # scan bucket (`kv_cache.scan_bucket`) needs no device read.
        self.slot_len = np.zeros((self.batch,), np.int64)
        self.host = None       # the host-driven fetch path, when cfg selects it
        if self.offload and host_driven.resolve_fetch_path(cfg) == "host_driven":
            self.host = host_driven.HostDriven(cfg, self.graphdef, self.state, impl=self.impl,
                                               num_pages=self.pages.num_pages,
                                               metrics=self.metrics)
        self.trace = None
        if trace_path is not None:
            from jlco.planning.trace import TraceWriter
            self.trace = TraceWriter(trace_path, {"source": "engine", "config": cfg.name,
                                                  "topk": cfg.model.index_topk,
                                                  "num_layers": cache_layers(cfg)})
            self.cache = dataclasses.replace(self.cache, record=jnp.full(
                (cache_layers(cfg), self.batch, 1, cfg.model.index_topk), -1, jnp.int32))
        self._jit_step = self.host.decode_step if self.host is not None else self.jit(
            functools.partial(steps.decode_step, impl=self.impl), 2, ("batch", "batch", "cache"),
            ("rep", "rep", "cache") + ("batch",) * 7)
        # Speculative decoding replaces decode() and the prefill pieces.
        self.spec = None
        if cfg.engine.num_draft_tokens:
            from jlco.engine.speculative import Speculator
            self.spec = Speculator(self, drafter)
        elif drafter is not None:
            raise ValueError("drafter: needs engine.num_draft_tokens >= 1 (it is 0)")

    @property
    def pages_per_request(self) -> int:
        """Width of a slot's page-table row (offload only)."""
        return self.cache.latent.page_table.shape[1]

    # ---- jitted functions ---------------------------------------------------------
    def cache_shardings(self):
        return jax.tree.map(lambda x: parallel_mesh.on_mesh(x.sharding), self.cache)

    def jit(self, fn, donate: int, outs: tuple[str, ...], roles: tuple[str, ...] = ()):
        """jit `fn`, donating the cache argument. Offloaded, every output's sharding is
        pinned ("cache" = the cache's own shardings, else the device): the host pool must
        come back in host memory (left to choose, jit declares device memory and fails).
        With data-parallel attention `fn` runs per data rank (`parallel_data.per_rank`;
        `roles` name its arguments, `outs` its outputs: "cache", "batch" [b, ...] per
        slot, "rep" replicated, "sum" summed over ranks)."""
        if roles:
            fn = parallel_data.per_rank(fn, roles, outs)
        if not self.offload:
            return jax.jit(fn, donate_argnums=donate)
        dev = parallel_mesh.replicated()
        cache = self.cache_shardings()
        shard = tuple(cache if o == "cache" else dev for o in outs)
        return jax.jit(fn, donate_argnums=donate,
                       out_shardings=shard[0] if len(shard) == 1 else shard)

    @functools.cached_property
    def _jit_forward(self):
        if self.host is not None:
            return self.host.forward
        return self.jit(functools.partial(steps.forward, impl=self.impl), 2, ("batch", "cache"),
                        ("rep", "rep", "cache", "batch", "batch"))

    @functools.cached_property
    def _jit_install(self):
        if self.host is not None:
            return self.host.install
        return self.jit(steps.install_on_rank, 0, ("cache",), ("cache", "rep", "rep", "rep", "rep"))

    @functools.cached_property
    def _jit_warm_up(self):
        if self.host is not None:
            return self.host.warm_up
        return self.jit(steps.warm_up_on_rank, 0, ("cache", "sum"), ("cache", "rep", "rep"))

    # ---- prefill ------------------------------------------------------------------
    def start_prefill(self, req: Request, page_row: np.ndarray | None, *,
                      record: bool = False) -> PrefillJob:
        """A chunked prefill of `req.prompt` for slot `req.slot` (offloaded: into the host
        pages `page_row`); advance it with `prefill_piece`, end it with `finish_prefill`.
        Its pieces are the same whatever else runs: chunk shapes change float reduction
        order, and offload on must equal offload off (and a served request the same
        request alone) bit for bit."""
        cfg, n = self.cfg, len(req.prompt)
        temp = init_cache(cfg, batch=1, max_len=self.max_len)
        w = min(self.warmup_queries, n)
        # Each piece computes a power-of-two bucket of its width (at most prefill_chunk): a
        # short prompt does not pay for a whole chunk, and the compiled shapes stay few.
        # The last w queries run as one piece (its bucket: the recorded top-k sets have
        # the piece's shape) so their top-k sets are recorded for the warm-up.
        chunk = cfg.engine.prefill_chunk
        pieces = [(lo, min(lo + chunk, n - w), pow2_bucket(min(chunk, n - w - lo), MIN_PIECE,
                                                           chunk))
                  for lo in range(0, n - w, chunk)]
        if w:
            pieces.append((n - w, n, pow2_bucket(w, MIN_PIECE)))
            if self.offload or record:
                temp = dataclasses.replace(temp, record=jnp.full(
                    (cache_layers(cfg), 1, pieces[-1][2], cfg.model.index_topk), -1, jnp.int32))
        return PrefillJob(req, page_row, temp, np.asarray([req.prompt], np.int32), pieces)

    def prefill_piece(self, job: PrefillJob) -> int:
        """Run the job's next piece (queued on the device, no sync) → its cost in prompt
        positions computed (the piece's padded width)."""
        lo, hi, chunk = job.pieces[job.done_pieces]
        job.logits, job.hidden, job.temp = self._prefill_piece(job.req, job.temp, job.tokens,
                                                               lo, hi, chunk)
        job.done_pieces += 1
        return chunk

    def finish_prefill(self, job: PrefillJob) -> tuple[int, float]:
        """Install a finished prefill in its batch slot (offloaded: warm its hot buffer)
        and sample its first token → (token, log-prob)."""
        assert job.finished, "finish_prefill: pieces left"
        req, n = job.req, len(job.req.prompt)
        self.install(job.temp, req.slot, n, job.page_row)
        if job.temp.record is not None and self.offload:
            w = job.pieces[-1][1] - job.pieces[-1][0]
            self.cache, fetched = self._jit_warm_up(self.cache, jnp.int32(req.slot),
                                                    _oldest_first(job.temp.record[:, 0], jnp.int32(w)))
            self.warmup_rows += int(fetched)
        tok, logp = _sample_first(
            job.logits[None, 0].astype(jnp.float32), jnp.asarray([req.temperature], jnp.float32),
            sample_key(req.seed, 0)[None], jnp.asarray([req.top_p], jnp.float32),
            jnp.asarray([req.top_k], jnp.int32))
        job.temp = None
        return int(tok[0]), float(logp[0])

    # ---- PD disaggregation: a prefill leaves one engine and enters another ----------
    def export_prefill(self, job: PrefillJob, max_new_tokens: int) -> PrefilledRequest:
        """A finished prefill (started with record=True) as a `PrefilledRequest`."""
        assert job.finished, "export_prefill: pieces left"
        n, temp = len(job.req.prompt), job.temp
        host = jax.device_get((temp.latent, temp.index_k, temp.index_scale, temp.record,
                               job.hidden))
        latent, keys, scales, rec, hidden = host
        w = job.pieces[-1][1] - job.pieces[-1][0]
        record = None if rec is None else np.asarray(
            _oldest_first(rec[:, 0], jnp.int32(w)))[:, -w:].astype(np.int32)
        return PrefilledRequest(
            prompt=list(job.req.prompt), max_new_tokens=max_new_tokens,
            latent=[np.asarray(x[0, :n]) for x in latent],
            index_k=[np.asarray(x[0, :n]) for x in keys],
            index_scale=None if scales is None else [np.asarray(x[0, :n]) for x in scales],
            record=record, hidden=np.asarray(hidden[0], np.float32))

    def import_prefill(self, req: Request, p: PrefilledRequest, page_row) -> None:
        """Hold an imported prefill (checked with `p.check(cfg)`) for slot `req.slot`
        until a request claims it (`first_token`). It is installed only then: while the
        slot idles, decode steps write their dummy token into idle slots."""
        self._imported[req.id] = (p, page_row)

    def first_token(self, req: Request) -> tuple[int, float]:
        """Install a claimed import in its slot as `finish_prefill` installs a local
        prefill (offloaded: rows to its host pages, hot buffer warmed with the payload's
        top-k sets) and sample its first token with `req`'s fields from the logits of
        the imported final hidden state."""
        p, page_row = self._imported.pop(req.id)
        n = len(p.prompt)
        temp = init_cache(self.cfg, batch=1, max_len=self.max_len)

        def put(arrs, vals):
            return tuple(a.at[0, :n].set(jnp.asarray(v)) for a, v in zip(arrs, vals))
        temp = dataclasses.replace(
            temp, latent=put(temp.latent, p.latent), index_k=put(temp.index_k, p.index_k),
            index_scale=None if p.index_scale is None else put(temp.index_scale, p.index_scale),
            lengths=jnp.full((1,), n, jnp.int32))
        self.install(temp, req.slot, n, page_row)
        if p.record is not None and self.offload:
            self.cache, fetched = self._jit_warm_up(self.cache, jnp.int32(req.slot),
                                                    jnp.asarray(p.record))
            self.warmup_rows += int(fetched)
        h = jnp.asarray(p.hidden[None]).astype(jnp.dtype(self.cfg.model.dtype))
        if self.spec is not None:
            self.spec._fresh[req.id] = h
        logits = _logits(self.graphdef, self.state, h)
        tok, logp = _sample_first(
            logits[None, 0].astype(jnp.float32), jnp.asarray([req.temperature], jnp.float32),
            sample_key(req.seed, 0)[None], jnp.asarray([req.top_p], jnp.float32),
            jnp.asarray([req.top_k], jnp.int32))
        return int(tok[0]), float(logp[0])

    def prefill(self, req: Request, page_row: np.ndarray | None) -> tuple[int, float]:
        """Prefill `req.prompt` whole (every piece of `start_prefill`), install it and
        sample its first token → (token, log-prob)."""
        job = self.start_prefill(req, page_row)
        while not job.finished:
            self.prefill_piece(job)
        return self.finish_prefill(job)

    def install(self, temp: DecodeCache, slot: int, n: int, page_row) -> None:
        """A finished one-request prefill `temp` (n positions) into batch slot `slot`,
        its latent rows into the host pages `page_row` when offloaded."""
        page_row = None if page_row is None else jnp.asarray(page_row, jnp.int32)
        self.cache = self._jit_install(self.cache, temp, jnp.int32(slot), jnp.int32(n), page_row)
        self.slot_len[slot] = n

    def _prefill_piece(self, req: Request, temp: DecodeCache, toks, lo: int, hi: int,
                       chunk: int):
        """Prompt positions lo..hi-1 into `temp` → (logits at hi-1, hidden, temp);
        speculative decoding also fills the MTP layer's rows."""
        if self.spec is not None:
            return self.spec.prefill(req, temp, toks, lo, hi, chunk)
        return prefill((self.graphdef, self.state), temp, toks[:, lo:hi], chunk=chunk,
                       impl=self.impl)

    # ---- decode -------------------------------------------------------------------
    def decode(self, running: Sequence[Request]) -> DecodeOutput:
        """One decode step for the running requests (every other slot idles)."""
        return self.collect(self.dispatch(running))

    def dispatch(self, running: Sequence[Request]) -> PendingDecode:
        """Queue one decode step on the device and return at once (JAX's async dispatch):
        the host can do the next step's work while the device computes; `collect` waits.
        Speculative and host-driven steps run to the end here (their host work sits
        between device phases)."""
        t0 = time.perf_counter()
        if self.spec is not None:
            tok, logp, sec, drafted, accepted = self.spec.step(running)
            out = DecodeOutput(tok, logp, sec, drafted=drafted, accepted=accepted)
            # Ran to the end: count it as device time (its host share is not separable).
            return PendingDecode(tuple(running), t0,
                                 done=dataclasses.replace(out, wait_seconds=out.seconds))
        tokens = np.zeros((self.batch, 1), np.int32)
        active = np.zeros((self.batch,), bool)
        temps = np.zeros((self.batch,), np.float32)
        seeds = np.zeros((self.batch,), np.uint32)
        counts = np.zeros((self.batch,), np.int32)
        top_ps = np.ones((self.batch,), np.float32)
        top_ks = np.zeros((self.batch,), np.int32)
        for r in running:
            s = r.slot
            tokens[s, 0], active[s], temps[s] = r.tokens[-1], True, r.temperature
            seeds[s], counts[s], top_ps[s], top_ks[s] = r.seed, len(r.tokens), r.top_p, r.top_k
        scan = scan_bucket(max(int(self.slot_len[r.slot]) for r in running) + 1, self.max_len)
        tok, logp, cache = self._jit_step(self.graphdef, self.state,
                                          dataclasses.replace(self.cache, scan_len=scan),
                                          tokens, active, temps, seeds, counts, top_ps, top_ks)
        self.cache = dataclasses.replace(cache, scan_len=None)
        for r in running:
            self.slot_len[r.slot] += 1
        # Copies: a prefill installed before `collect` donates the cache these live in.
        stats = jnp.copy(self.cache.latent.stats) if self.offload else None
        rec = None if self.cache.record is None else jnp.copy(self.cache.record)
        return PendingDecode(tuple(running), t0, arrays=(tok, logp, stats, rec))

    def collect(self, pending: PendingDecode) -> DecodeOutput:
        """Wait for a dispatched step → its tokens (one sync for tokens, log-probs and the
        offload counters)."""
        if pending.done is not None:
            return pending.done
        running = pending.running
        t_wait = time.perf_counter()
        jax.block_until_ready(pending.arrays)
        waited = time.perf_counter() - t_wait
        tok, logp, stats, rec = jax.device_get(pending.arrays)
        seconds = time.perf_counter() - pending.t0
        if stats is not None:
            self.record_stats(stats)
        if self.trace is not None:
            for r in running:
                for layer in range(rec.shape[0]):
                    ids = rec[layer, r.slot, 0]
                    self.trace.record(r.id, len(r.tokens) - 1, layer, ids[ids >= 0])
        return DecodeOutput(tuple((int(tok[r.slot]),) for r in running),
                            tuple((float(logp[r.slot]),) for r in running), seconds,
                            wait_seconds=waited)

    def record_stats(self, stats: np.ndarray) -> None:
        for layer, row in enumerate(stats):
            c = dict(zip(STAT_NAMES, (int(v) for v in row)))
            self.metrics.update(layer, lookups=c["lookups"], hits=c["hits"], misses=c["misses"],
                                h2d_rows=c["misses"], h2d_moved_rows=c["h2d_moved_rows"],
                                d2h_rows=c["d2h_rows"])

    def forward(self, tokens, active) -> np.ndarray:
        """Append tokens [batch, s] to the active slots' caches → logits [batch, s, V]:
        the verification pass of speculative decoding (s = 1 + drafts)."""
        logits, self.cache = self._jit_forward(self.graphdef, self.state, self.cache,
                                               np.asarray(tokens, np.int32),
                                               np.asarray(active, bool))
        return np.asarray(logits)

    def forget(self, request_id: int) -> None:
        """A request left its slot (finished or aborted): drop what the runner keeps for
        it (speculative decoding's pending hidden states and keys)."""
        self._imported.pop(request_id, None)
        if self.spec is not None:
            self.spec.forget(request_id)

    def close(self) -> None:
        """Close the trace file and the host-driven pool (its file, if any)."""
        if self.trace is not None:
            self.trace.close()
        if self.host is not None:
            self.host.close()
