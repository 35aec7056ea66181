"""The decode engine: a fixed batch of request slots decoded together, with the MLA
latent cache on device (offload off) or in host memory behind a device hot buffer
(offload on). Requests join when a slot and their memory are free, leave when done or
aborted, and every page and slot they held returns.

A new request is prefilled alone on a one-request device cache (as a PD-disaggregated
decode node receives a finished prefill), then installed in its slot: with offload its
latent rows go to its host pages and the hot buffer is warmed with the top-k of the last
prefill queries (ESS). Then each `step()` runs one jitted decode step for all slots
(in-jit fetch), or with `cache.fetch_path="host_driven"` (and storage "file") the
per-layer phases of `jlco.engine_host` with the host fetching misses in between.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jlco import engine_host, engine_steps
from jlco.config import Config
from jlco.decode import prefill
from jlco.kv_cache import DecodeCache, cache_layers, init_cache
from jlco.offload.latent import STAT_NAMES, OffloadLatent
from jlco.offload.metrics import OffloadMetrics
from jlco.offload.pages import PageAllocator

WARMUP_QUERIES = 32   # ESS: top-k of the last 32 prefill query positions


class RequestError(ValueError):
    """A request field is invalid; the message names it and what is allowed."""


@dataclasses.dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    status: str = "waiting"          # waiting | running | finished | aborted
    slot: int | None = None

    @property
    def done(self) -> bool:
        return self.status in ("finished", "aborted")


def _chunk_rows(cfg: Config) -> int:
    """In-jit fetch moves misses in chunks of this many rows (0 = one padded gather of
    every possible miss); the prefetch window bounds it."""
    return max(0, min(cfg.cache.prefetch_window, cfg.staging_capacity))


def allocate_cache(cfg: Config) -> tuple[DecodeCache, PageAllocator | None]:
    """The engine's batch cache for `cfg.engine.max_batch_size` slots and, offloaded, its
    host page allocator. Offloaded, the latent cache is a host pool per layer (in
    `cfg.cache.storage` memory) behind a device hot buffer; `device_cache_bytes` counts
    exactly this allocation."""
    if not cfg.cache.offload:
        return init_cache(cfg), None
    # Host-driven: the pool is engine_host's HostLatentPool, outside the jitted cache.
    host_driven = engine_host.resolve_fetch_path(cfg) == "host_driven"
    batch, page = cfg.engine.max_batch_size, cfg.cache.page_size
    pages_per_req = -(-cfg.engine.max_context_len // page)
    num_pages = batch * pages_per_req
    n_layers, cap, rb = cache_layers(cfg), cfg.staging_capacity, cfg.row_bytes
    if not host_driven:
        host = SingleDeviceSharding(jax.devices()[0], memory_kind=cfg.cache.storage)
        zeros = jax.jit(lambda: jnp.zeros((num_pages * page, rb), jnp.uint8), out_shardings=host)
    lat = OffloadLatent(
        rows=jnp.zeros((n_layers, batch, cap, rb), jnp.uint8),
        slot_pos=jnp.full((n_layers, batch, cap), -1, jnp.int32),
        slot_stamp=jnp.full((n_layers, batch, cap), -1, jnp.int32),
        host=() if host_driven else tuple(zeros() for _ in range(n_layers)),
        page_table=jnp.full((batch, pages_per_req), -1, jnp.int32),
        step=jnp.int32(0), stats=jnp.zeros((n_layers, len(STAT_NAMES)), jnp.int32),
        policy=cfg.cache.eviction, page_size=page, chunk_rows=_chunk_rows(cfg))
    return init_cache(cfg, latent=lat), PageAllocator(num_pages, page)


def device_cache_bytes(cfg: Config, batch: int) -> int:
    """Device bytes of the cache `allocate_cache` makes for `batch` slots, from its
    abstract shapes (nothing is allocated, so real-model configs are cheap): every leaf
    but the offloaded host pool (`OffloadLatent.host`) lives in device memory."""
    cfg = cfg.replace(engine__max_batch_size=batch)
    shapes = jax.eval_shape(lambda: allocate_cache(cfg)[0])
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


class Engine:
    """Continuous batching over `cfg.engine.max_batch_size` slots (s_q = 1 per step, or
    1 + engine.num_draft_tokens with speculative decoding)."""

    def __init__(self, cfg: Config, model, *, impl: str | None = None,
                 trace_path: str | None = None, warmup_queries: int = WARMUP_QUERIES,
                 drafter=None):
        """trace_path: record every decode step's top-k positions (request, step, layer,
        ids) to a `jlco.trace` file. warmup_queries: how many final prefill queries'
        top-k sets warm a new request's hot buffer (0 = none). drafter: a
        `jlco.speculative.Drafter` (default: the MTP layer) when
        cfg.engine.num_draft_tokens > 0."""
        if not isinstance(warmup_queries, int) or warmup_queries < 0:
            raise ValueError(f"warmup_queries={warmup_queries!r}: allowed an integer >= 0")
        self.cfg = cfg
        self.warmup_queries = warmup_queries
        self.impl = impl or cfg.engine.attention_impl
        self.graphdef, self.state = nnx.split(model)
        self.batch = cfg.engine.max_batch_size
        self.max_len = cfg.engine.max_context_len
        self.offload = cfg.cache.offload
        self.slots: list[Request | None] = [None] * self.batch
        self.waiting: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.step_count = 0
        self.step_seconds: list[float] = []
        self.metrics = OffloadMetrics(cache_layers(cfg), cfg.row_bytes) if self.offload else None
        self.pages = None
        self.warmup_rows = 0   # rows fetched by admission warm-ups (all layers)
        self.cache = self._init_cache()
        self.trace = None
        if trace_path is not None:
            from jlco.trace import TraceWriter
            self.trace = TraceWriter(trace_path, {"source": "engine", "config": cfg.name,
                                                  "topk": cfg.model.index_topk,
                                                  "num_layers": cache_layers(cfg)})
            self.cache = dataclasses.replace(self.cache, record=jnp.full(
                (cache_layers(cfg), self.batch, 1, cfg.model.index_topk), -1, jnp.int32))
        self._jit_step = self._compile_step()
        # Speculative decoding (jlco.speculative) replaces step() and the prefill.
        self.spec = None
        if cfg.engine.num_draft_tokens:
            from jlco.speculative import Speculator
            self.spec = Speculator(self, drafter)
        elif drafter is not None:
            raise ValueError("drafter: needs engine.num_draft_tokens >= 1 (it is 0)")

    # ---- construction -------------------------------------------------------------
    def _init_cache(self) -> DecodeCache:
        cache, self.pages = allocate_cache(self.cfg)
        self.host = None   # the host-driven fetch path, when cfg selects it
        if self.offload and engine_host.resolve_fetch_path(self.cfg) == "host_driven":
            self.host = engine_host.HostDriven(self.cfg, self.graphdef, self.state,
                                               impl=self.impl, num_pages=self.pages.num_pages,
                                               metrics=self.metrics)
        return cache

    def _shardings(self, tree):
        return jax.tree.map(lambda x: x.sharding, tree)

    def _jit(self, fn, donate: int, outs: tuple[str, ...]):
        """jit `fn`, donating the cache argument. Offloaded, every output's sharding is
        pinned ("cache" = the cache's own shardings, else the device): the host pool must
        come back in host memory (left to choose, jit declares device memory and fails)."""
        if not self.offload:
            return jax.jit(fn, donate_argnums=donate)
        dev = SingleDeviceSharding(jax.devices()[0])
        cache = self._shardings(self.cache)
        shard = tuple(cache if o == "cache" else dev for o in outs)
        return jax.jit(fn, donate_argnums=donate,
                       out_shardings=shard[0] if len(shard) == 1 else shard)

    def _compile_step(self):
        if self.host is not None:
            return self.host.decode_step
        return self._jit(functools.partial(engine_steps.decode_step, impl=self.impl), 2,
                         ("dev", "dev", "cache"))

    @functools.cached_property
    def _jit_forward(self):
        if self.host is not None:
            return self.host.forward
        return self._jit(functools.partial(engine_steps.forward, impl=self.impl), 2,
                         ("dev", "cache"))

    @functools.cached_property
    def _jit_install(self):
        if self.host is not None:
            return self.host.install
        return self._jit(engine_steps.install, 0, ("cache",))

    @functools.cached_property
    def _jit_warm_up(self):
        if self.host is not None:
            return self.host.warm_up
        return self._jit(engine_steps.warm_up, 0, ("cache", "dev"))

    # ---- requests -----------------------------------------------------------------
    def submit(self, prompt, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0) -> Request:
        """Queue a request; invalid fields raise RequestError naming the field."""
        vocab = self.cfg.model.vocab_size
        prompt = list(prompt)
        if not prompt or not all(isinstance(t, (int, np.integer)) and 0 <= t < vocab
                                 for t in prompt):
            raise RequestError(f"prompt: must be a non-empty list of token ids in 0..{vocab - 1}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens={max_new_tokens!r}: allowed an integer >= 1")
        if len(prompt) + max_new_tokens > self.max_len:
            raise RequestError(f"len(prompt) + max_new_tokens = {len(prompt) + max_new_tokens} "
                               f"exceeds engine.max_context_len={self.max_len}")
        if not (isinstance(temperature, (int, float)) and 0.0 <= temperature <= 100.0):
            raise RequestError(f"temperature={temperature!r}: allowed 0 (greedy) .. 100")
        req = Request(next(self._ids), [int(t) for t in prompt], max_new_tokens,
                      float(temperature), int(seed))
        self.requests[req.id] = req
        self.waiting.append(req)
        return req

    def abort(self, request_id: int) -> None:
        req = self.requests[request_id]
        if req.done:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req, "aborted")

    def _release(self, req: Request, status: str) -> None:
        req.status = status
        if req.slot is not None:
            self.slots[req.slot] = None
            req.slot = None
        if self.pages is not None and req.id in self.pages.requests:
            self.pages.release(req.id)

    # ---- admission ----------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            req = self.waiting[0]
            if self.pages is not None:
                need = len(req.prompt) + req.max_new_tokens
                if self.pages.pages_needed(need) > self.pages.free_pages:
                    return   # waits until pages come back
                self.pages.reserve(req.id, need)
            self.waiting.pop(0)
            slot = self.slots.index(None)
            req.slot, req.status = slot, "running"
            self.slots[slot] = req
            self._prefill_into(req, slot)

    def _prefill_into(self, req: Request, slot: int) -> None:
        cfg, n = self.cfg, len(req.prompt)
        temp = init_cache(cfg, batch=1, max_len=self.max_len)
        # The same prefill split with offload on and off: chunk shapes change float
        # reduction order, and offload on must equal offload off bit for bit.
        w = min(self.warmup_queries, n)
        if w and self.offload:
            temp = dataclasses.replace(temp, record=jnp.full(
                (cache_layers(cfg), 1, w, cfg.model.index_topk), -1, jnp.int32))
        toks = np.asarray([req.prompt], np.int32)
        # The last w queries run as one chunk so their top-k sets are recorded.
        pieces = [(0, n - w, cfg.engine.prefill_chunk), (n - w, n, w)] if w else \
            [(0, n, cfg.engine.prefill_chunk)]
        for lo, hi, chunk in pieces:
            if hi > lo:
                logits, _, temp = self._prefill_piece(req, temp, toks, lo, hi, chunk)
        page_row = None
        if self.offload:
            page_row = jnp.asarray(self.pages.page_table([req.id], self.cache.latent.page_table
                                                         .shape[1])[0])
        self.cache = self._jit_install(self.cache, temp, jnp.int32(slot), jnp.int32(n), page_row)
        if w and self.offload:
            self.cache, fetched = self._jit_warm_up(self.cache, jnp.int32(slot), temp.record[:, 0])
            self.warmup_rows += int(fetched)
        self._emit(req, logits[0])

    def _prefill_piece(self, req: Request, temp: DecodeCache, toks, lo: int, hi: int,
                       chunk: int):
        """Prompt positions lo..hi-1 into `temp` → (logits at hi-1, hidden, temp);
        speculative decoding also fills the MTP layer's rows."""
        if self.spec is not None:
            return self.spec.prefill(req, temp, toks, lo, hi, chunk)
        return prefill((self.graphdef, self.state), temp, toks[:, lo:hi], chunk=chunk,
                       impl=self.impl)

    def _emit(self, req: Request, logits) -> None:
        """First token from the prefill logits (same sampler as the decode step)."""
        key = jax.random.fold_in(jax.random.PRNGKey(req.seed), 0)
        tok, logp = engine_steps._sample_rows(logits[None].astype(jnp.float32),
                                              jnp.asarray([req.temperature], jnp.float32),
                                              key[None])
        self._append(req, int(tok[0]), float(logp[0]))

    def _append(self, req: Request, tok: int, logp: float) -> None:
        req.tokens.append(tok)
        req.logprobs.append(logp)
        if len(req.tokens) >= req.max_new_tokens:
            self._release(req, "finished")

    # ---- decoding -----------------------------------------------------------------
    def step(self) -> bool:
        """Admit what fits, then decode one token for every running request.
        Returns False when nothing is left to do. With engine.num_draft_tokens > 0,
        a speculative step (`jlco.speculative`) that may emit up to 1 + drafts."""
        if self.spec is not None:
            return self.spec.step()
        self._admit()
        running = [r for r in self.slots if r is not None]
        if not running:
            return bool(self.waiting)
        tokens = np.zeros((self.batch, 1), np.int32)
        active = np.zeros((self.batch,), bool)
        temps = np.zeros((self.batch,), np.float32)
        keys = np.zeros((self.batch, 2), np.uint32)
        for r in running:
            tokens[r.slot, 0], active[r.slot], temps[r.slot] = r.tokens[-1], True, r.temperature
            keys[r.slot] = np.asarray(jax.random.fold_in(jax.random.PRNGKey(r.seed),
                                                         len(r.tokens)))
        t0 = time.perf_counter()
        tok, logp, self.cache = self._jit_step(self.graphdef, self.state, self.cache,
                                               tokens, active, temps, keys)
        stats = self.cache.latent.stats if self.offload else None
        tok, logp, stats, rec = jax.device_get((tok, logp, stats, self.cache.record))  # one sync
        self.step_seconds.append(time.perf_counter() - t0)
        self.step_count += 1
        if stats is not None:
            self._record_stats(stats)
        if self.trace is not None:
            for r in running:
                for layer in range(rec.shape[0]):
                    ids = rec[layer, r.slot, 0]
                    self.trace.record(r.id, len(r.tokens) - 1, layer, ids[ids >= 0])
        for r in running:
            self._append(r, int(tok[r.slot]), float(logp[r.slot]))
        return True

    def _record_stats(self, stats: np.ndarray) -> None:
        for layer, row in enumerate(stats):
            c = dict(zip(STAT_NAMES, (int(v) for v in row)))
            self.metrics.update(layer, lookups=c["lookups"], hits=c["hits"], misses=c["misses"],
                                h2d_rows=c["misses"], h2d_moved_rows=c["h2d_moved_rows"],
                                d2h_rows=c["d2h_rows"])

    def run(self) -> None:
        while self.step():
            pass
        if self.trace is not None:
            self.trace.close()

    def forward(self, tokens) -> np.ndarray:
        """Append tokens [batch, s] to every running request's cache and return the
        logits [batch, s, V]: the verification pass of speculative decoding (s = 1 +
        drafts). Request token lists are the caller's to keep consistent."""
        self._admit()
        active = np.array([r is not None for r in self.slots])
        logits, self.cache = self._jit_forward(self.graphdef, self.state, self.cache,
                                               np.asarray(tokens, np.int32), active)
        return np.asarray(logits)

    def generate(self, prompts, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> list[Request]:
        reqs = [self.submit(p, max_new_tokens, temperature, seed) for p in prompts]
        self.run()
        return reqs

    # ---- accounting ---------------------------------------------------------------
    def check_no_leaks(self) -> None:
        """Every slot and page is owned by a running request (and nothing else)."""
        running = {r.id for r in self.slots if r is not None}
        if self.pages is not None:
            self.pages.check(expect_requests=running)
        owners = [r.id for r in self.slots if r is not None]
        if len(owners) != len(set(owners)):
            raise AssertionError(f"a request holds two batch slots: {owners}")
