"""The model runner: owns the model state, the batch cache (device, or host pool + device
hot buffer when offloaded), the jitted steps and the offload counters; executes what the
scheduler planned and returns tokens and log-probs. No request bookkeeping: it reads a
request's prompt, slot, sampling fields and tokens so far, and never changes them
(it reports one thing back: `cached_tokens`, the prompt positions the prefix cache gave).

A new request is prefilled alone on a one-request device cache (`jlco.engine.prefill`,
as a PD-disaggregated decode node receives a finished prefill, `jlco.engine.transfer`),
then installed in its slot: with offload its latent rows go to its host pages and the
hot buffer is warmed with the top-k of the last prefill queries (ESS, the offload design
this engine follows). Then `dispatch` / `collect` run one decode step for all slots
through `jlco.engine.decode.DecodeStepper`, whose options compose: drafts
(`engine.num_draft_tokens`), the fetch strategy (in-jit, or the host-driven phases of
`jlco.engine.host_driven`, which owns its host pool), the mesh and async scheduling.
Sizing and allocation of the cache live in `jlco.engine.allocation`.
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

from jlco import native
from jlco.config import Config
from jlco.engine import host_driven, overlap, prefix, steps, transfer
from jlco.engine import prefill as engine_prefill
from jlco.engine.allocation import allocate_cache
from jlco.engine.decode import DecodeStepper, PendingDecode
from jlco.engine.inputs import DecodeOutput
from jlco.engine.prefill import WARMUP_QUERIES, PrefillJob
from jlco.engine.scheduler import Request
from jlco.model.decoder import fuse_projections, use_native_matmuls
from jlco.model.kv_cache import DecodeCache, cache_layers
from jlco.model.moe import unstack_experts
from jlco.model.prefill import final_logits, prefill
from jlco.offload.latent import STAT_NAMES
from jlco.offload.metrics import OffloadMetrics
from jlco.pallas import dispatch
from jlco.sampling import penalize
from jlco.util.memory import release_free_memory


def _for_backend(cfg: Config, model):
    """`model`, on one XLA:CPU device its routed experts' weights unstacked in place
    (`jlco.model.moe.unstack_experts`: XLA:CPU copies any slice a matmul reads), the
    projections that read one input fused into one matmul each
    (`jlco.model.decoder.fuse_projections`: small matvecs run on one core there) and,
    per `engine.cpu_matmul`, decode-sized products on the small-M kernel
    (`jlco.model.decoder.use_native_matmuls`: XLA:CPU runs M = 2..8 at a third of its
    matvec speed)."""
    if jax.default_backend() == "cpu" and cfg.mesh.num_devices == 1:
        unstack_experts(model)
        fuse_projections(model)
        if native_matmul(cfg.engine.cpu_matmul):
            use_native_matmuls(model)
    return model


def native_matmul(choice: str) -> bool:
    """Whether `engine.cpu_matmul` = choice runs the small-M kernel on this machine:
    "auto" when it builds here, "native" always (an error naming why it cannot), "xla"
    never."""
    if choice == "xla":
        return False
    if choice == "native":
        try:
            native.load()
        except native.NativeUnavailable as e:
            raise ValueError(f"engine.cpu_matmul='native': {e} (allowed: 'auto' falls back "
                             "to XLA's dot, 'xla' never uses the kernel)") from e
        return True
    return native.available()


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
        self.cfg, self.warmup_queries = cfg, warmup_queries
        self.impl = dispatch.resolve(impl or cfg.engine.attention_impl)
        self.graphdef, self.state = nnx.split(_for_backend(cfg, model))
        self.batch, self.max_len = cfg.engine.max_batch_size, cfg.engine.max_context_len
        self.offload = cfg.cache.offload
        n_cache = cache_layers(cfg)
        self.metrics = OffloadMetrics(n_cache, cfg.row_bytes, tuple(
            cfg.model.shares_topk(i) for i in range(n_cache))) if self.offload else None
        self.warmup_rows = 0   # rows fetched by admission warm-ups (all layers)
        self._imported: dict[int, tuple] = {}   # unclaimed imports: (payload, page row)
        self.cache, self.pages = allocate_cache(cfg)
        # Positions cached per slot, mirrored on the host so choosing a step's indexer
        # scan bucket (`kv_cache.scan_bucket`) needs no device read.
        self.slot_len = np.zeros((self.batch,), np.int64)
        self.host = None       # the host-driven fetch path, when cfg selects it
        if self.offload and cfg.resolved_fetch_path() == "host_driven":
            self.host = host_driven.HostDriven(cfg, self.graphdef, self.state, impl=self.impl,
                                               num_pages=self.pages.num_pages,
                                               metrics=self.metrics)
        self.trace = self._open_trace(trace_path)
        if self.trace is not None and cfg.engine.num_draft_tokens:
            raise ValueError("trace_path: top-k traces record s_q = 1 steps; set "
                             "engine.num_draft_tokens=0 to record one")
        self.prefix = prefix.open_prefix(cfg)   # None with cache.prefix_cache off
        self.piece_observers: list = []   # fn(job, start time) after each prefill piece
        self.stepper = DecodeStepper(cfg, self.graphdef, self.state, self.cache, self.slot_len,
                                     impl=self.impl, host=self.host, drafter=drafter)

    @property
    def spec(self) -> DecodeStepper | None:
        """The stepper when its steps speculate (engine.num_draft_tokens > 0), else None."""
        return self.stepper if self.stepper.n else None

    def _open_trace(self, path: str | None):
        """The top-k trace writer (and the cache's per-step record buffer), or None."""
        if path is None:
            return None
        from jlco.planning.trace import TraceWriter
        cfg = self.cfg
        self.cache = dataclasses.replace(self.cache, record=jnp.full(
            (cache_layers(cfg), self.batch, 1, cfg.model.index_topk), -1, jnp.int32))
        return TraceWriter(path, {"source": "engine", "config": cfg.name,
                                  "topk": cfg.model.index_topk, "num_layers": cache_layers(cfg)})

    @property
    def pages_per_request(self) -> int:
        """Width of a slot's page-table row (offload only)."""
        return self.cache.latent.page_table.shape[1]

    # ---- jitted functions ---------------------------------------------------------
    def jit(self, fn, donate: int, outs: tuple[str, ...], roles: tuple[str, ...] = ()):
        """`steps.jit_on_cache` over this runner's cache."""
        return steps.jit_on_cache(fn, self.cache, self.offload, donate, outs, roles)

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
        return self.jit(steps.install_on_rank, 0, ("cache",),
                        ("cache", "rep", "rep", "rep", "rep", "rep"))

    @functools.cached_property
    def _jit_warm_up(self):
        if self.host is not None:
            return self.host.warm_up
        return self.jit(steps.warm_up_on_rank, 0, ("cache", "sum"), ("cache", "rep", "rep"))

    # ---- prefill ------------------------------------------------------------------
    def start_prefill(self, req: Request, page_row: np.ndarray | None, *,
                      record: bool = False) -> PrefillJob:
        """A chunked prefill of `req.prompt` for slot `req.slot` (offloaded: into the host
        pages `page_row`); advance it with `prefill_piece`, end with `finish_prefill`."""
        return engine_prefill.start(self.cfg, req, page_row, self.max_len, self.warmup_queries,
                                    record=self.offload or record)

    def prefill_piece(self, job: PrefillJob) -> int:
        """Run the job's next piece (queued on the device, no sync) → its cost in prompt
        positions computed (its padded width); with MTP also the MTP layer's rows. Each
        of `piece_observers` is called with (job, the piece's start time) after it."""
        t0 = time.perf_counter()
        if job.cache is None:
            job.cache = prefix.open_job_cache(self.prefix, self.cfg, job,
                                              (self.graphdef, self.state), self.impl)
        lo, hi, chunk = job.pieces[job.done_pieces]
        job.cache = job.recording(self.cfg, job.cache)
        job.logits, job.hidden, job.cache, h_all = self.run_piece(job.req, job.cache,
                                                                  job.tokens, lo, hi, chunk)
        job.piece_done(h_all, final_logits, (self.graphdef, self.state))
        for observe in self.piece_observers:
            observe(job, t0)
        return chunk

    def run_piece(self, req, cache, tokens, lo, hi, chunk, scan_len="auto"):
        """Prompt positions lo..hi-1 of tokens [1, n] as one piece of width `chunk` →
        (logits, hidden, cache, every position's hidden [1, chunk, d]); with MTP rows."""
        drafter = self.stepper.drafter
        after = tokens[:, lo + 1:hi + 1] if drafter is not None and drafter.needs_mtp_cache \
            else None
        out = prefill((self.graphdef, self.state), cache, tokens[:, lo:hi], chunk=chunk,
                      impl=self.impl, scan_len=scan_len, keep_hidden=True, mtp_next=after)
        if req is not None:   # None: a warm-up compile
            self.stepper.admit(req.id, out[1])
        return out

    def finish_prefill(self, job: PrefillJob) -> tuple[int, float]:
        """Install a finished prefill in its slot (offloaded: warm its hot buffer) and
        sample its first token → (token, log-prob); its pages go to the prefix cache."""
        assert job.finished, "finish_prefill: pieces left"
        prefix.cache_job(self.prefix, self.cfg, job)
        first = engine_prefill.first_token_of(job)
        self._admit(job.cache, job.req, job.page_row, job.warmup_record(), first[0])
        job.cache = None
        if len(job.req.prompt) >= self.cfg.engine.prefill_chunk:
            release_free_memory()   # a long prefill's buffers, back to the OS (util.memory)
        return first

    def install(self, temp: DecodeCache, slot: int, n: int, page_row, seen_row=None) -> None:
        """A finished one-request prefill `temp` (n positions) into batch slot `slot`,
        its latent rows into the host pages `page_row` when offloaded, and the penalty
        tables `seen_row` (`penalize.SeenTokens.row`; None: a request without any)."""
        page_row = None if page_row is None else jnp.asarray(page_row, jnp.int32)
        row = penalize.no_penalties(self.cfg.model.vocab_size) if seen_row is None else seen_row
        self.cache = self._jit_install(self.cache, temp, jnp.int32(slot), jnp.int32(n),
                                       page_row, row)
        self.slot_len[slot] = n

    def _admit(self, one: DecodeCache, req: Request, page_row, record, first: int) -> None:
        """`install` (with the request's penalty tables, its first token counted), then
        (offloaded, with a record [L, w, k]) the hot-buffer warm-up."""
        self.install(one, req.slot, len(req.prompt), page_row, penalize.SeenTokens.of_request(
            self.cfg.model.vocab_size, req, [first]))
        if record is not None and self.offload:
            self.cache, fetched = self._jit_warm_up(self.cache, jnp.int32(req.slot),
                                                    jnp.asarray(record))
            self.warmup_rows += int(fetched)

    # ---- PD disaggregation: a prefill leaves one engine and enters another ----------
    def export_prefill(self, job: PrefillJob, max_new_tokens: int):
        """A finished prefill (started with record=True) as a `PrefilledRequest`."""
        return transfer.export_job(job, max_new_tokens)

    def import_prefill(self, req: Request, p, page_row) -> None:
        """Hold an imported prefill (checked with `p.check(cfg)`) for slot `req.slot`
        until a request claims it (`first_token`). It is installed only then: while the
        slot idles, decode steps write their dummy token into idle slots."""
        self._imported[req.id] = (p, page_row)
        prefix.cache_import(self.prefix, self.cfg, p)

    def first_token(self, req: Request) -> tuple[int, float]:
        """Install a claimed import in its slot as `finish_prefill` installs a local
        prefill and sample its first token with `req`'s fields from the logits of the
        imported final hidden state."""
        p, page_row = self._imported.pop(req.id)
        h = jnp.asarray(p.hidden[None]).astype(jnp.dtype(self.cfg.model.dtype))
        first = engine_prefill.first_of(final_logits(self.graphdef, self.state, h)[None, 0], req)
        self._admit(transfer.import_cache(self.cfg, p, self.max_len), req, page_row, p.record,
                    first[0])
        self.stepper.admit(req.id, h)
        return first

    # ---- decode -------------------------------------------------------------------
    def decode(self, running: Sequence[Request]) -> DecodeOutput:
        """One decode step for the running requests (every other slot idles)."""
        return self.collect(self.dispatch(running))

    def dispatch(self, running: Sequence[Request],
                 follow: PendingDecode | None = None) -> PendingDecode:
        """Queue one decode step on the device and return at once (JAX's async dispatch;
        `collect` waits); follow: the step in flight, whose output tokens the requests it
        decodes take on the device (`jlco.engine.decode`)."""
        pending, self.cache = self.stepper.dispatch(self.cache, running, follow)
        return pending

    def collect(self, pending: PendingDecode, running: Sequence[Request] | None = None
                ) -> DecodeOutput:
        """Wait for a dispatched step → the tokens of `running` (default: its requests
        still running, `overlap.live`), one sync for tokens, log-probs and the offload
        counters."""
        running = overlap.live(pending) if running is None else running
        out, stats, rec = self.stepper.collect(pending, running)
        if stats is not None:
            record_stats(self.metrics, stats)
        if self.trace is not None:
            for r in running:
                for layer in range(rec.shape[0]):
                    ids = rec[layer, r.slot, 0]
                    self.trace.record(r.id, len(r.tokens) - 1, layer, ids[ids >= 0])
        return out

    def forward(self, tokens, active) -> np.ndarray:
        """Append tokens [batch, s] to the active slots' caches → logits [batch, s, V]:
        the verification pass of speculative decoding (s = 1 + drafts)."""
        logits, self.cache = self._jit_forward(self.graphdef, self.state, self.cache,
                                               np.asarray(tokens, np.int32),
                                               np.asarray(active, bool))
        return np.asarray(logits)

    def forget(self, request_id: int) -> None:
        """A request left its slot (finished or aborted): drop what the runner keeps for
        it (speculative decoding's pending hidden states)."""
        self._imported.pop(request_id, None)
        self.stepper.forget(request_id)

    def close(self) -> None:
        """Close the trace file and the host-driven pool (its file, if any)."""
        if self.trace is not None:
            self.trace.close()
        if self.host is not None:
            self.host.close()


def record_stats(metrics: OffloadMetrics, stats: np.ndarray) -> None:
    """One step's offload counters [layers, STAT_NAMES] into `metrics`."""
    for layer, row in enumerate(stats):
        c = dict(zip(STAT_NAMES, (int(v) for v in row)))
        metrics.update(layer, lookups=c["lookups"], hits=c["hits"], misses=c["misses"],
                       h2d_rows=c["misses"], h2d_moved_rows=c["h2d_moved_rows"],
                       d2h_rows=c["d2h_rows"], prefetch_used=c["prefetch_used"],
                       prefetch_unused=c["prefetch_unused"], predicted=c["predicted"],
                       predicted_correct=c["predicted_correct"])
