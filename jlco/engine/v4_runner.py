"""DeepSeek-V4 through the engine: the runner `jlco.engine.core.Engine` builds for a
deepseek_v4 model (`Config.is_v4`), with the part of `ModelRunner`'s interface the
engine uses (prefill jobs, dispatch / collect of decode steps, forget, close).

The state is `jlco.model.deepseek_v4.state`'s: per request a sliding window, the
compressors' buffers and entries and `pos`, one batch state of engine.max_batch_size
slots with room for engine.max_context_len tokens (rounded up to a whole window of
every compress rate). A request is prefilled alone on a one-request state, in pieces
fixed by position: whole `engine.prefill_chunk` chunks, the tail padded to a power of two
(at most the chunk), so a few programs serve every prompt length. The pad is exact:
`forward_chunk(valid=...)` takes a row's real tokens alone into the state (pos, the
window, the compressors; a real query never sees a pad key). The finished state is
`install`ed whole into the request's slot and its first token sampled from the last
real logits (`jlco.engine.prefill.first_of`: the MLA engine's first-token sampling).

A decode step is one jitted program over every slot: `forward_chunk` with s = 1 and
valid = the slot is running (an idle slot's state stays as it was; a slot is replaced
whole at install), then the MLA engine's sampling (`jlco.sampling.sample.sample` with the
slots' penalty tables, `penalize.count`). Async scheduling is the MLA engine's: a step
queued behind the one in flight takes its requests' tokens, limits and PRNG counts from
that step's outputs on the device (`jlco.engine.decode.follow_inputs`).

With `cache.offload` the CSA layers' compressed entries live in host pools behind device
hot buffers (`jlco.model.deepseek_v4.offload`: misses fetched inside the jitted step,
offload on equals off bit for bit); the prefill still runs on device. Each step also
returns its counters, recorded at collect into `metrics` (an `OffloadMetrics` over every
model layer, as the MLA engine's: lookups = hits + misses = the running requests'
picks, h2d rows = misses; sliding and HCA layers keep no entries offloaded and stay 0).
The admission warm-up is the MLA engine's (ESS): the prefill state records the CSA picks
of its last `warmup_queries` queries and `install` loads them into the slot's hot buffer.

On a mesh (expert and tensor axes; the engine runs under `jax.set_mesh`) the parameters
are placed by their logical axes (`jlco.parallel.mesh.shard_model`, the routed experts
through V4's expert-parallel dispatch) and the state is replicated.

Not run here yet, refused by `Config` (MTP drafts, data-parallel attention, offload on a
mesh, the prefix cache, the host-driven fetch path) or here (PD export / import, top-k
traces).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.config import Config
from jlco.engine import prefill as engine_prefill
from jlco.engine.decode import PendingDecode, StepKind, StepRecord, follow_inputs
from jlco.engine.inputs import DecodeOutput, StepInputs, alternatives
from jlco.engine.prefill import WARMUP_QUERIES
from jlco.engine.scheduler import Request
from jlco.model.deepseek_v4 import offload as v4_offload
from jlco.model.deepseek_v4 import state as v4_state
from jlco.offload.metrics import OffloadMetrics
from jlco.parallel import mesh as parallel_mesh
from jlco.sampling import penalize
from jlco.sampling.sample import position_logprobs, sample
from jlco.util.buckets import MIN_PIECE, pow2_bucket


def state_len(cfg) -> int:
    """Positions the batch state holds: max_context_len rounded up to a whole window of
    every compress rate (a compressed layer holds max_len // rate entries)."""
    rates = [cfg.model.compress_rate(i) for i in range(cfg.model.num_hidden_layers)]
    step = math.lcm(*[r for r in rates if r] or [1])
    return -(-cfg.engine.max_context_len // step) * step


def replicated(tree):
    """`tree` placed whole on every device of the mesh in use (one device without)."""
    return jax.device_put(tree, parallel_mesh.replicated())


def v4_pieces(n: int, chunk: int) -> list[tuple[int, int, int]]:
    """(lo, hi, compiled width) of an n-token prompt: whole chunks, then the tail padded
    to a power of two (at least MIN_PIECE, at most the chunk)."""
    out = [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
    return [(lo, hi, chunk if hi - lo == chunk else pow2_bucket(hi - lo, MIN_PIECE, chunk))
            for lo, hi in out]


def _piece(graphdef, params, state, tokens, n, *, full: bool):
    """One prefill piece on a one-request state: tokens [1, w] (the first n [1] real) →
    (the last real position's logits [V], or with `full` every position's [w, V];
    state)."""
    logits, state = v4_state.forward_chunk(nnx.merge(graphdef, params), state, tokens, n)
    return (logits[0] if full else logits[0, n[0] - 1]), state


def _decode(graphdef, params, state, seen, inputs: StepInputs):
    """One decode step over every slot: inputs.tokens [b, 1] at each slot's own position
    (idle slots change nothing) → (tokens [b], (log-probs, alternatives), state, seen)."""
    n = inputs.active.astype(jnp.int32)
    logits, state = v4_state.forward_chunk(nnx.merge(graphdef, params), state,
                                           inputs.tokens, n)
    tok, logp = sample(logits[:, -1], inputs.sampling, seen)
    return tok, logp, state, penalize.count(seen, tok[:, None], n)


def _decode_counted(graphdef, params, state, seen, inputs: StepInputs):
    """`_decode` with offloaded CSA entries, plus the step's counters int32 [layers,
    STAT_NAMES] (`jlco.model.deepseek_v4.offload.layer_stats` after − before)."""
    before = v4_offload.layer_stats(state)
    tok, logp, state, seen = _decode(graphdef, params, state, seen, inputs)
    return tok, logp, state, seen, v4_offload.layer_stats(state) - before


def record_stats(metrics: OffloadMetrics, stats: np.ndarray) -> None:
    """One step's counters [layers, STAT_NAMES] into `metrics`: every miss is one entry
    fetched host → device (h2d_rows); a layer without CSA adds zeros."""
    for layer, row in enumerate(stats):
        c = dict(zip(v4_offload.STAT_NAMES, (int(v) for v in row)))
        metrics.update(layer, lookups=c["lookups"], hits=c["hits"], misses=c["misses"],
                       h2d_rows=c["misses"], h2d_moved_rows=c["h2d_moved_rows"])


def _install(state, seen, one, slot, row):
    return v4_state.install(state, slot, one), penalize.seat(seen, slot, row)


def _install_offloaded(state, seen, one, slot, row):
    return v4_offload.install(state, slot, one), penalize.seat(seen, slot, row)


# Module-level, so engines built alike (tests, a server's warm-up) share compiled programs.
_jit_piece = jax.jit(_piece, donate_argnums=(2,), static_argnames=("full",))
_jit_decode = jax.jit(_decode, donate_argnums=(2, 3))
_jit_install = jax.jit(_install, donate_argnums=(0, 1))




@dataclasses.dataclass(eq=False)
class V4PrefillJob:
    """A request's prefill in progress: its one-request state (None until its first
    piece runs) and the pieces (lo, hi, width) still to run."""
    req: Request
    tokens: np.ndarray                        # int32 [n]
    pieces: list[tuple[int, int, int]]
    cache: dict | None = None
    done_pieces: int = 0
    logits: jax.Array | None = None           # [V] after the last real position so far
    prompt_lp: list = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.done_pieces == len(self.pieces)

    @property
    def pending_cost(self) -> int:
        return sum(w for _, _, w in self.pieces[self.done_pieces:])

    def prompt_result(self) -> list | None:
        """As `jlco.engine.prefill.PrefillJob.prompt_result`: per prompt position 1 ..
        n-1, (log-prob, alternatives), None when the request did not ask."""
        k = self.req.params.prompt_logprobs
        if k is None:
            return None
        out = []
        for (lo, hi, _), (lp, ids, lps) in zip(self.pieces, jax.device_get(self.prompt_lp)):
            for r in range(min(hi, len(self.tokens) - 1) - lo):
                out.append((float(lp[r]), alternatives(ids[r], lps[r], k)))
        return out


class V4Stepper:
    """Dispatches and collects the decode steps (what `Engine` reads of a stepper:
    `kind`, `metrics` (None: no drafts), `observers`)."""

    def __init__(self, cfg: Config, graphdef, params, slot_len: np.ndarray):
        follow, m = bool(cfg.engine.async_scheduling), cfg.mesh
        fetch = "in_jit" if cfg.cache.offload else "device"   # offloaded CSA entries
        self.kind = StepKind(0, fetch, (m.data, m.expert, m.tensor), follow,
                             "" if follow else "engine.async_scheduling=false")
        self.metrics = None           # speculative decoding's (no drafts)
        self.offload_metrics: OffloadMetrics | None = None   # set with offloaded entries
        self.drafter = None
        self.observers: list[Callable[[StepRecord], None]] = []
        self.graphdef, self.params, self.slot_len = graphdef, params, slot_len
        self.batch, self.vocab = len(slot_len), cfg.model.vocab_size
        # Replicated over the mesh, if any (where the step's outputs live).
        self._step = _jit_decode
        self._merge = jax.jit(follow_inputs, out_shardings=parallel_mesh.replicated())
        z = functools.partial(jnp.zeros, dtype=jnp.int32)
        b = self.batch
        self._idle = replicated((z((b,)), None, z((b,)), z((b,))))

    @property
    def width(self) -> int:
        return 1

    def forget(self, request_id: int) -> None:
        """Nothing is kept per request between steps."""

    def inputs(self, running: Sequence, follow: PendingDecode | None = None) -> StepInputs:
        """The step's inputs for `running`; requests `follow` (the step in flight)
        decodes take their tokens, limits and PRNG counts from its outputs."""
        b = self.batch
        inflight = set() if follow is None else {id(r) for r in follow.running}
        ahead = np.zeros((b,), bool)
        for r in running:
            ahead[r.slot] = id(r) in inflight
        if ahead.any() and not self.kind.follow:
            raise ValueError("dispatch(follow=...): this engine's steps do not follow "
                             f"({self.kind.why_not})")
        inputs = StepInputs.from_requests(running, b, self.vocab, 1, width=1)
        if self.kind.follow:
            prev = (follow.arrays[0], None, follow.limit, follow.counts) \
                if ahead.any() else self._idle
            inputs, _ = self._merge(*prev, inputs, np.ones((b,), np.int32), ahead)
        return inputs

    def dispatch(self, state, seen, running: Sequence, follow: PendingDecode | None = None):
        """Queue one step for `running` → (the pending step, state, seen)."""
        t0 = time.perf_counter()
        inputs = self.inputs(running, follow)
        tok, logp, state, seen, *stats = self._step(self.graphdef, self.params, state, seen,
                                                    inputs)
        for r in running:
            self.slot_len[r.slot] += 1
        pending = PendingDecode(tuple(running), t0, (tok, logp, *stats), inputs.limit,
                                inputs.sampling.counts)
        return pending, state, seen

    def collect(self, pending: PendingDecode, live: Sequence) -> DecodeOutput:
        """Wait for a dispatched step → the tokens of `live` (its requests still running)."""
        t_wait = time.perf_counter()
        jax.block_until_ready(pending.arrays)
        waited = time.perf_counter() - t_wait
        tok, (lp, ids, lps), *stats = jax.device_get(pending.arrays)
        if stats and self.offload_metrics is not None:
            record_stats(self.offload_metrics, stats[0])
        toks, lps_out, tops = [], [], []
        for r in live:
            s, k = r.slot, r.params.top_logprobs
            toks.append((int(tok[s]),))
            lps_out.append((float(lp[s]),))
            tops.append((alternatives(ids[s], lps[s], k),) if k else ([],))
        out = DecodeOutput(tuple(toks), tuple(lps_out), time.perf_counter() - pending.t0,
                           wait_seconds=waited, top=tuple(tops))
        if self.observers:
            lengths = self.slot_len.copy()
            record = StepRecord(tuple(live), out, None, ((),) * len(live), lengths,
                                tuple(int(lengths[r.slot]) for r in live))
            for observe in self.observers:
                observe(record)
        return out


class V4Runner:
    """The device side of the engine for a deepseek_v4 model (see the module docstring)."""

    metrics = None        # offload counters (OffloadMetrics) with cache.offload
    pages = None          # no host pages
    trace = None          # no top-k traces
    prefix = None         # no prefix cache
    spec = None           # no speculative decoding

    def __init__(self, cfg: Config, model, warmup_queries: int = WARMUP_QUERIES):
        """warmup_queries (offloaded): how many final prefill queries' CSA picks warm a
        new request's hot buffer (0 = none), as the MLA engine's admission warm-up."""
        if not cfg.is_v4:
            raise ValueError(f"V4Runner: model.model_type={cfg.model.model_type!r}; allowed "
                             "'deepseek_v4' (the MLA families run on ModelRunner)")
        if isinstance(warmup_queries, bool) or not isinstance(warmup_queries, int) \
                or warmup_queries < 0:
            raise ValueError(f"warmup_queries={warmup_queries!r}: allowed an integer >= 0")
        self.cfg = cfg
        self.graphdef, self.params = nnx.split(model)
        self.batch, self.max_len = cfg.engine.max_batch_size, state_len(cfg)
        self.state = replicated(v4_state.init_state(cfg.model, self.batch, self.max_len))
        self.seen = replicated(penalize.SeenTokens.zeros(self.batch, cfg.model.vocab_size))
        self.slot_len = np.zeros((self.batch,), np.int64)
        self.stepper = V4Stepper(cfg, self.graphdef, self.params, self.slot_len)
        self._piece, self._install = _jit_piece, _jit_install
        self.piece_observers: list = []   # fn(job, start time) after each prefill piece
        self.offload = cfg.cache.offload
        self.record = warmup_queries if self.offload else 0   # prefill picks kept
        if self.offload:
            self._offload()

    def _offload(self) -> None:
        """CSA entries to host pools behind hot buffers (`jlco.model.deepseek_v4.offload`);
        the steps that carry them pin every output's sharding (the pools must come back
        in host memory)."""
        c = self.cfg.cache
        self.state = v4_offload.offload_state(self.cfg.model, self.state, self.cfg.hot_buffer_rows,
                                              c.storage, c.eviction)
        shard = jax.tree.map(lambda x: x.sharding, self.state)
        dev = parallel_mesh.replicated()
        self.stepper._step = jax.jit(_decode_counted, donate_argnums=(2, 3),
                                     out_shardings=(dev, dev, shard, dev, dev))
        m = self.cfg.model
        self.metrics = OffloadMetrics(m.num_hidden_layers,
                                      m.head_dim * jnp.dtype(m.dtype).itemsize)
        self.stepper.offload_metrics = self.metrics
        self._install = jax.jit(_install_offloaded, donate_argnums=(0, 1),
                                out_shardings=(shard, dev))

    def entry_stats(self) -> dict[str, int] | None:
        """Offloaded CSA entries: STAT_NAMES so far, all layers (None: offload off); per
        layer, as the MLA engine's, in `metrics`."""
        return v4_offload.entry_stats(self.state) if self.offload else None

    @property
    def warmup_rows(self) -> int:
        """Rows the admission warm-ups fetched, all CSA layers (reads the state: a sync)."""
        return self.entry_stats()["warmup_rows"] if self.offload else 0

    # ---- prefill ------------------------------------------------------------------
    def start_prefill(self, req: Request, page_row=None, *, record: bool = False
                      ) -> V4PrefillJob:
        """A chunked prefill of `req.prompt` on a one-request state of its own."""
        if record:
            raise NotImplementedError("exporting a deepseek_v4 prefill (PD disaggregation) "
                                      "is not implemented")
        return V4PrefillJob(req, np.asarray(req.prompt, np.int32),
                            v4_pieces(len(req.prompt), self.cfg.engine.prefill_chunk))

    def prefill_piece(self, job: V4PrefillJob) -> int:
        """Run the job's next piece (queued, no sync) → its cost (its padded width)."""
        t0 = time.perf_counter()
        if job.cache is None:
            job.cache = replicated(v4_state.init_state(self.cfg.model, 1, self.max_len,
                                                       self.record))
        lo, hi, width = job.pieces[job.done_pieces]
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :hi - lo] = job.tokens[lo:hi]
        n = np.asarray([hi - lo], np.int32)
        echo = job.req.params.prompt_logprobs is not None
        out, job.cache = self._piece(self.graphdef, self.params, job.cache, tokens, n,
                                     full=echo)
        if echo:
            nxt = np.zeros((width,), np.int32)
            follow = job.tokens[lo + 1:hi + 1]
            nxt[:len(follow)] = follow
            job.prompt_lp.append(position_logprobs(out, nxt))
            out = out[hi - lo - 1]
        job.logits = out
        job.done_pieces += 1
        for observe in self.piece_observers:
            observe(job, t0)
        return width

    def finish_prefill(self, job: V4PrefillJob) -> tuple[int, float]:
        """Install a finished prefill in its slot and sample its first token → (token,
        log-prob), with the MLA engine's first-token sampling."""
        assert job.finished, "finish_prefill: pieces left"
        req = job.req
        req.prompt_logprob_out = job.prompt_result()
        first = engine_prefill.first_of(job.logits[None], req)
        vocab = self.cfg.model.vocab_size
        row = penalize.SeenTokens.of_request(vocab, req, [first[0]])
        self.state, self.seen = self._install(
            self.state, self.seen, job.cache, jnp.int32(req.slot),
            penalize.no_penalties(vocab) if row is None else row)
        self.slot_len[req.slot] = len(req.prompt)
        job.cache = None
        return first

    # ---- PD disaggregation: not for V4 yet ----------------------------------------
    def export_prefill(self, job, max_new_tokens: int):
        raise NotImplementedError("exporting a deepseek_v4 prefill is not implemented")

    def import_prefill(self, req: Request, p, page_row) -> None:
        raise NotImplementedError("importing a deepseek_v4 prefill is not implemented")

    # ---- decode -------------------------------------------------------------------
    def decode(self, running: Sequence[Request]) -> DecodeOutput:
        """One decode step for the running requests (every other slot idles)."""
        return self.collect(self.dispatch(running))

    def dispatch(self, running: Sequence[Request],
                 follow: PendingDecode | None = None) -> PendingDecode:
        """Queue one decode step and return at once (`collect` waits)."""
        pending, self.state, self.seen = self.stepper.dispatch(self.state, self.seen,
                                                               running, follow)
        return pending

    def collect(self, pending: PendingDecode, running: Sequence[Request] | None = None
                ) -> DecodeOutput:
        running = tuple(r for r in pending.running if not r.done) if running is None \
            else running
        return self.stepper.collect(pending, running)

    def forget(self, request_id: int) -> None:
        """A request left its slot: nothing to drop (its slot is replaced at install)."""

    def close(self) -> None:
        """Nothing to close (no host pool, no trace file)."""

    # ---- warm-up ------------------------------------------------------------------
    def compile_all(self, progress=None) -> dict:
        """Run every prefill piece width and the decode step once (each compiles, or loads
        from the persistent compilation cache) → {"prefill_shapes", "decode_shapes"}."""
        chunk = self.cfg.engine.prefill_chunk
        widths = sorted({w for n in range(1, min(chunk, self.cfg.engine.max_context_len) + 1)
                         for _, _, w in v4_pieces(n, chunk)} | {chunk})
        total, done = len(widths) + 1, 0
        for w in widths:
            one = replicated(v4_state.init_state(self.cfg.model, 1, self.max_len, self.record))
            out, _ = self._piece(self.graphdef, self.params, one, np.zeros((1, w), np.int32),
                                 np.ones((1,), np.int32), full=False)
            jax.block_until_ready(out)
            done += 1
            if progress is not None:
                progress(done, total, f"prefill piece of {w}")
        self.collect(self.dispatch([]), [])
        done += 1
        if progress is not None:
            progress(done, total, "decode step")
        return {"prefill_shapes": len(widths), "decode_shapes": 1}
