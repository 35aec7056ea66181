"""The decode step, once. Its options are independent and compose:

  drafts   0 = plain decoding (one token per request), n = MTP speculative decoding
           (`jlco.engine.speculative`: draft n, verify 1 + n, accept greedily-exact);
  fetch    where a step's latent rows come from: "device" (offload off), "in_jit" (the
           host pool read inside the one jitted step) or "host_driven"
           (`jlco.engine.host_driven`: the layers run as phases, the host fetches misses
           in between). Chosen by the config (`Config.resolved_fetch_path`), not here;
  mesh     expert-parallel MoE and data-parallel attention: every variant is bound to
           the mesh the same way (`steps.jit_on_cache`: per data rank, pinned outputs);
  follow   async scheduling (`jlco.engine.overlap`): a step is queued behind the one in
           flight, its requests' input tokens, pending counts, token limits and PRNG
           counts merged on the device from that step's outputs (`follow_inputs`).

`DecodeStepper` dispatches a step (returns at once, JAX's async dispatch) and collects it
(one sync for tokens, log-probs, accepted counts and the offload counters). It holds
only what the step carries from one step to the next (speculation's pending hidden
states per slot, per request how many of them are real); the batch cache is the
runner's, passed in and handed back.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.config import Config
from jlco.engine import steps
from jlco.engine.inputs import DecodeOutput, StepInputs, alternatives
from jlco.engine.speculative import Drafter, MTPDrafter, SpecMetrics, spec_step
from jlco.model.kv_cache import DecodeCache, scan_bucket
from jlco.parallel import mesh as parallel_mesh


@dataclasses.dataclass(frozen=True)
class StepKind:
    """Which decode step an engine runs (its startup banner prints `describe()`)."""
    drafts: int                 # draft tokens per step (0: plain decoding)
    fetch: str                  # "device" | "in_jit" | "host_driven"
    mesh: tuple[int, int, int]  # (data, expert, tensor)
    follow: bool                # async scheduling: the next step queued behind this one
    why_not: str = ""           # why a step does not follow (empty when it does)

    def describe(self) -> str:
        kind = f"MTP speculative, {self.drafts} draft(s)" if self.drafts else "plain"
        data, expert, tensor = self.mesh
        mesh = "one device" if data * expert * tensor == 1 else \
            f"mesh data={data} expert={expert} tensor={tensor}"
        overlap = "async (next step queued behind the one computing)" if self.follow \
            else f"synchronous ({self.why_not})"
        return f"decode step: {kind}; fetch {self.fetch}; {mesh}; {overlap}"


def step_kind(cfg: Config) -> StepKind:
    """The decode step `cfg` runs. Every kind follows when `engine.async_scheduling` is
    on; a batch with a structured-output request waits for the step in flight (its next
    token mask is built on the host from its last token)."""
    fetch = cfg.resolved_fetch_path() if cfg.cache.offload else "device"
    m = cfg.mesh
    follow = bool(cfg.engine.async_scheduling)
    return StepKind(cfg.engine.num_draft_tokens, fetch, (m.data, m.expert, m.tensor), follow,
                    "" if follow else "engine.async_scheduling=false")


@dataclasses.dataclass(frozen=True)
class PendingDecode:
    """A dispatched decode step: its requests, start time, the device arrays to read, and
    the inputs a step following it extends (token limits, PRNG counts)."""
    running: tuple
    t0: float
    arrays: tuple
    limit: object = None
    counts: object = None
    scan: int | None = None


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What a step observer sees for each collected step: its requests (in order), its
    output, the scan bucket it ran at, per request the drafts proposed (empty without
    drafts), the cache lengths the step left on the device (int [b]) and, per request,
    the length the host's mirror gives it after the step (`ModelRunner.slot_len` less
    any step queued since)."""
    running: tuple
    output: DecodeOutput
    scan: int | None
    drafts: tuple
    lengths: np.ndarray
    mirror: tuple


def follow_inputs(prev_tok, prev_acc, prev_limit, prev_counts, inputs: StepInputs, pend_n,
                  ahead):
    """A step's inputs where `ahead` [b] (the request's last tokens are still being
    computed by the step in flight): its tokens are that step's emitted ones (prev_tok
    [b, s], the first prev_acc + 1 real), pend_n the same count, its limit and PRNG count
    that many further on. Elsewhere the host's. A plain step's prev_tok is [b] and its
    prev_acc None (one token each). → (inputs, pend_n)."""
    if prev_acc is None:
        prev_tok, prev_acc = prev_tok[:, None], jnp.zeros(prev_tok.shape, jnp.int32)
    grown = prev_acc + 1
    tokens = jnp.where(ahead[:, None], prev_tok.astype(jnp.int32), inputs.tokens)
    sampling = dataclasses.replace(inputs.sampling, counts=jnp.where(
        ahead, prev_counts + grown, inputs.sampling.counts))
    inputs = dataclasses.replace(inputs, tokens=tokens, sampling=sampling,
                                 limit=jnp.where(ahead, prev_limit - grown, inputs.limit))
    return inputs, jnp.where(ahead, grown, pend_n)


@functools.lru_cache(maxsize=None)
def _jitted_spec(drafter: Drafter, n: int, impl: str, rule: str, offload: bool, shard_key):
    """`spec_step` bound to the mesh (per data rank, pinned outputs), once per (drafter
    class, n, impl, spec_sampling, offload, cache shardings): engines built alike share
    one compiled step."""
    fn = functools.partial(spec_step, drafter=drafter, n=n, impl=impl, sampling=rule)
    leaves, tree = shard_key
    template = jax.tree.unflatten(tree, leaves)
    return steps.jit_on_cache(
        fn, template, offload, 2, ("batch",) * 5 + ("cache",),
        ("rep", "rep", "cache", "batch", "batch", "batch", "batch"), shardings=template)


class DecodeStepper:
    """Dispatches and collects one engine's decode steps (see the module docstring)."""

    def __init__(self, cfg: Config, graphdef, state, cache: DecodeCache, slot_len: np.ndarray,
                 *, impl: str, host=None, drafter: Drafter | None = None):
        """slot_len: the runner's per-slot mirror of the cache lengths (int [b]); a step
        advances it by 1 + drafts per request at dispatch (an upper bound while the step
        is in flight, so a step following it scans far enough) and takes back the
        rejected drafts at collect. host: the host-driven fetch strategy
        (`host_driven.HostDriven`) or None (the fetch runs inside the jitted step).
        drafter: with engine.num_draft_tokens > 0 (default the MTP layer)."""
        self.kind = step_kind(cfg)
        self.slot_len, self.max_len = slot_len, cfg.engine.max_context_len
        self.n, self.batch = cfg.engine.num_draft_tokens, len(slot_len)
        self.vocab = cfg.model.vocab_size
        self.graphdef, self.state, self.offload = graphdef, state, cfg.cache.offload
        self.observers: list[Callable[[StepRecord], None]] = []
        self.pend_n: dict[int, int] = {}     # per request: real pending tokens (n > 0)
        self._fresh: dict[int, jax.Array] = {}
        self.draft_log: list | None = None   # a list: (request id, slot, count, drafts)
        self._queued: list[PendingDecode] = []   # dispatched, not collected
        self.metrics = SpecMetrics() if self.n else None
        # With async scheduling every step's inputs pass through the merge (a step that
        # follows nothing merges with `_idle`, all slots from the host), so a step
        # following another and a step taking host inputs see inputs committed alike and
        # run one compiled program; one small jit per step, no device_put of host arrays.
        self._merge = jax.jit(follow_inputs, out_shardings=parallel_mesh.replicated())
        if not self.n:
            if drafter is not None:
                raise ValueError("drafter: needs engine.num_draft_tokens >= 1 (it is 0)")
            self.drafter = None
            self._idle = self._zeros((self.batch,), None)
            self._fn = host.decode_step if host is not None else steps.BoundStep(
                functools.partial(steps.decode_step, impl=impl), graphdef, state,
                lambda fn: steps.jit_on_cache(fn, cache, self.offload, 1,
                                              ("batch", "batch", "cache"),
                                              ("rep", "cache", "batch")))
            return
        self.drafter = MTPDrafter() if drafter is None else drafter
        if not isinstance(self.drafter, Drafter):
            raise ValueError(f"drafter={drafter!r}: allowed a jlco.engine.speculative.Drafter")
        if type(self.drafter).host_drafts is not Drafter.host_drafts and self.kind.follow:
            self.kind = dataclasses.replace(self.kind, follow=False, why_not=(
                "the drafter proposes on the host from each request's last tokens"))
        self._idle = self._zeros((self.batch, self.n + 1), (self.batch,))
        if self.drafter.needs_mtp_cache and nnx.merge(graphdef, state).mtp is None:
            raise ValueError(f"engine.num_draft_tokens={self.n} with MTP drafts needs a model "
                             "with an MTP layer (model.num_nextn_predict_layers=1)")
        # Where the step's outputs live, so its second call runs its first program.
        self.pend_h = jax.device_put(
            jnp.zeros((self.batch, self.n + 1, cfg.model.hidden_size), jnp.dtype(cfg.model.dtype)),
            parallel_mesh.replicated())
        if host is not None:
            self._fn = functools.partial(host.spec_step, drafter=self.drafter, n=self.n,
                                         rule=cfg.engine.spec_sampling)
        else:
            leaves, tree = jax.tree.flatten(steps.cache_shardings(cache))
            self._fn = _jitted_spec(self.drafter, self.n, impl, cfg.engine.spec_sampling,
                                    self.offload, (tuple(leaves), tree))

    def _zeros(self, tok_shape, acc_shape):
        """A step's (tokens, accepted, limit, counts) where no step ran: what `_merge`
        reads for a step that follows nothing (placed as step outputs are)."""
        b, at = self.batch, parallel_mesh.replicated()
        z = functools.partial(jnp.zeros, dtype=jnp.int32)
        return jax.device_put((z(tok_shape), None if acc_shape is None else z(acc_shape),
                               z((b,)), z((b,))), at)

    @property
    def width(self) -> int:
        """Tokens a step computes per request (1 + drafts)."""
        return self.n + 1

    # ---- per-request state ----------------------------------------------------------
    def admit(self, request_id: int, hidden: jax.Array) -> None:
        """A request's final prompt hidden state [1, d] (speculative steps: its first
        step's MTP catch-up starts from it)."""
        if self.n:
            self._fresh[request_id] = hidden

    def forget(self, request_id: int) -> None:
        """Drop one request's state (it finished or was aborted)."""
        for d in (self.pend_n, self._fresh):
            d.pop(request_id, None)

    # ---- one step -------------------------------------------------------------------
    def inputs(self, running: Sequence, follow: PendingDecode | None = None):
        """The step's inputs for `running` → (StepInputs, pend_n [b], host drafts [b, n]);
        requests `follow` (the step in flight) decodes take theirs from its outputs."""
        b, n = self.batch, self.n
        inflight = set() if follow is None else {id(r) for r in follow.running}
        ahead = np.array([id(r) in inflight for r in running], bool)
        if ahead.any() and not self.kind.follow:
            raise ValueError("dispatch(follow=...): this engine's steps do not follow "
                             f"({self.kind.why_not})")
        for r in running:
            if r.id in self._fresh:
                self.pend_h = self.pend_h.at[r.slot, 0].set(self._fresh.pop(r.id)[0])
                self.pend_n[r.id] = 1
        counts = [1 if a else self.pend_n.get(r.id, 1) for r, a in zip(running, ahead)]
        inputs = StepInputs.from_requests(running, b, self.vocab, counts, width=n + 1)
        pend_n = np.ones((b,), np.int32)
        slots = [None] * b
        mask = np.zeros((b,), bool)
        for r, k, a in zip(running, counts, ahead):
            pend_n[r.slot], slots[r.slot], mask[r.slot] = k, r, a
        drafts = self._host_drafts(slots) if n else None
        if self.kind.follow:
            prev = (follow.arrays[0], follow.arrays[2], follow.limit, follow.counts) \
                if ahead.any() else self._idle
            inputs, pend_n = self._merge(*prev, inputs, pend_n, mask)
        return inputs, pend_n, drafts

    def lower(self, cache: DecodeCache, running: Sequence, scan="auto"):
        """The jitted step lowered with the arguments `dispatch` would pass for `running`
        (every slot active when `running` is empty), for cost analysis and HLO dumps; None
        for the host-driven path (its step is many programs). scan: the indexer scan
        bucket ("auto": the one `dispatch` picks)."""
        if not hasattr(self._fn, "lower"):
            return None
        inputs, pend_n, host = self.inputs(running)
        if not running:
            inputs = dataclasses.replace(inputs, active=np.ones((self.batch,), bool))
        scan = self.scan_for(running) if scan == "auto" else scan
        return self._fn.lower(*self._args(cache, scan, inputs, pend_n, host))

    def _args(self, cache: DecodeCache, scan, inputs, pend_n, host) -> tuple:
        """The step function's arguments (speculative steps also take the pending hidden
        states, pending counts and host drafts)."""
        cache = dataclasses.replace(cache, scan_len=scan)
        if self.n:
            return self.graphdef, self.state, cache, self.pend_h, inputs, pend_n, host
        return self.graphdef, self.state, cache, inputs

    def warm_up_follow(self, pending: PendingDecode) -> None:
        """Compile the merge of a following step's inputs on `pending`'s outputs (so no
        request does)."""
        if self.kind.follow:
            b = self.batch
            inputs = StepInputs.from_requests([], b, self.vocab, width=self.width)
            jax.block_until_ready(self._merge(pending.arrays[0], pending.arrays[2],
                                              pending.limit, pending.counts, inputs,
                                              np.ones((b,), np.int32), np.zeros((b,), bool)))

    def _host_drafts(self, slots) -> np.ndarray:
        b, n, vocab = self.batch, self.n, self.vocab
        drafts = np.asarray(self.drafter.host_drafts(slots, n), np.int32)
        if drafts.shape != (b, n) or (drafts < -1).any() or (drafts >= vocab).any():
            raise ValueError(f"drafter.host_drafts: must be int32 [{b}, {n}] in -1..{vocab - 1} "
                             f"(-1 = none); got shape {drafts.shape}, range "
                             f"{drafts.min()}..{drafts.max()}")
        return drafts

    def scan_for(self, running: Sequence) -> int | None:
        """The indexers' scan bucket of a step for `running` (none: every slot): above
        every request's last position it computes (L + drafts)."""
        furthest = max((int(self.slot_len[r.slot]) for r in running),
                       default=int(self.slot_len.max()))
        return scan_bucket(furthest + self.width, self.max_len)

    def dispatch(self, cache: DecodeCache, running: Sequence,
                 follow: PendingDecode | None = None, scan="auto"
                 ) -> tuple[PendingDecode, DecodeCache]:
        """Queue one step for `running` over `cache` (donated) and return at once →
        (the pending step, the new cache). scan: the indexer scan bucket ("auto":
        `scan_for(running)`; the warm-up gives each bucket with no request)."""
        t0 = time.perf_counter()
        scan = self.scan_for(running) if scan == "auto" else scan
        inputs, pend_n, host = self.inputs(running, follow)
        args = self._args(cache, scan, inputs, pend_n, host)
        if self.n:
            tok, logp, acc, self.pend_h, drafts, cache = self._fn(*args)
        else:
            tok, logp, cache = self._fn(*args)
            acc = drafts = None   # one token per request: tok [b]
        cache = dataclasses.replace(cache, scan_len=None)
        # Copies: a prefill installed before `collect` donates the cache these live in.
        stats = jnp.copy(cache.latent.stats) if self.offload else None
        rec = None if cache.record is None else jnp.copy(cache.record)
        lengths = jnp.copy(cache.lengths) if self.observers else None
        arrays = (tok, logp, acc, drafts, stats, rec, lengths)
        for r in running:
            self.slot_len[r.slot] += self.width
        pending = PendingDecode(tuple(running), t0, arrays, inputs.limit,
                                inputs.sampling.counts, scan)
        if running:
            self._queued.append(pending)
        return pending, cache

    def collect(self, pending: PendingDecode, live: Sequence):
        """Wait for a dispatched step → (DecodeOutput of the requests in `live` (those of
        `pending` still running), offload counters or None, top-k record or None)."""
        t_wait = time.perf_counter()
        jax.block_until_ready(pending.arrays)
        waited = time.perf_counter() - t_wait
        tok, (lp, ids, lps), acc, drafts, stats, rec, lengths = jax.device_get(pending.arrays)
        seconds = time.perf_counter() - pending.t0
        if acc is None:   # a plain step: one position per request
            tok, lp, ids, lps = tok[:, None], lp[:, None], ids[:, None], lps[:, None]
            acc = np.zeros((self.batch,), np.int32)
        out_tok, out_lp, out_top, out_drafted, out_acc = [], [], [], [], []
        tok_l, lp_l, acc_l = tok.tolist(), lp.tolist(), acc.tolist()
        for r in live:
            s, k = r.slot, r.params.top_logprobs
            a = acc_l[s]
            out_tok.append(tuple(tok_l[s][:a + 1]))
            out_lp.append(tuple(lp_l[s][:a + 1]))
            out_top.append(tuple(alternatives(ids[s, j], lps[s, j], k) for j in range(a + 1))
                           if k else ([],) * (a + 1))
            if self.n:
                self.slot_len[s] -= self.n - a
                usable = min(self.n, r.max_new_tokens - len(r.tokens) - 1)
                self._count(a, usable)
                out_drafted.append(usable)
                out_acc.append(a)
                self.pend_n[r.id] = a + 1
                if self.draft_log is not None:
                    self.draft_log.append((r.id, s, len(r.tokens), drafts[s].tolist()))
        if self.n:
            self.metrics.steps += 1
        out = DecodeOutput(tuple(out_tok), tuple(out_lp), seconds, drafted=tuple(out_drafted),
                           accepted=tuple(out_acc), wait_seconds=waited, top=tuple(out_top))
        self._queued = [p for p in self._queued if p is not pending]
        if self.observers:
            later = [id(r) for p in self._queued for r in p.running]
            record = StepRecord(tuple(live), out, pending.scan, tuple(
                tuple(drafts[r.slot].tolist()) if self.n else () for r in live),
                lengths, tuple(int(self.slot_len[r.slot]) - self.width * later.count(id(r))
                               for r in live))
            for observe in self.observers:
                observe(record)
        return out, stats, rec

    def _count(self, accepted: int, usable: int) -> None:
        m = self.metrics
        m.request_steps += 1
        m.drafted += usable
        m.accepted += accepted
        m.emitted += accepted + 1
