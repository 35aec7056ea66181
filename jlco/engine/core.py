"""The engine: continuous batching over `cfg.engine.max_batch_size` request slots with the
MLA latent cache on device (offload off) or in host memory behind a device hot buffer
(offload on). It joins the `Scheduler` (what runs: requests, slots, pages, admission,
stop conditions) and the `ModelRunner` (how: model, caches, jitted steps), and is the
API that `jlco.generate`, the tools and the server use: submit / step / abort / run.
"""

from __future__ import annotations

import collections
import functools
import time

from jlco.config import Config
from jlco.engine.disagg import PrefillTransfer
from jlco.engine.overlap import StepQueue, StepTimes
from jlco.engine.prefill import WARMUP_QUERIES, next_job
from jlco.engine.runner import ModelRunner
from jlco.engine.scheduler import (
    AdmissionStatus,
    Request,
    RequestError,
    RequestFields,
    Scheduler,
    check_request,
)
from jlco.sampling.params import SamplingParams, sampling_params

__all__ = ["Engine", "Request", "RequestError"]

WARMUP_PROMPT = 48   # tokens of the warm-up request (longer than tiny's index_topk)


class Engine(PrefillTransfer):
    """Continuous batching (s_q = 1 per step, or 1 + engine.num_draft_tokens with
    speculative decoding). Constructor arguments are the runner's (`ModelRunner`)."""

    def __init__(self, cfg: Config, model, *, impl: str | None = None,
                 trace_path: str | None = None, warmup_queries: int = WARMUP_QUERIES,
                 drafter=None):
        self.cfg = cfg
        if cfg.is_v4:
            self.runner = v4_runner(cfg, model, trace_path=trace_path, drafter=drafter,
                                    warmup_queries=warmup_queries)
        else:
            self.runner = ModelRunner(cfg, model, impl=impl, trace_path=trace_path,
                                      warmup_queries=warmup_queries, drafter=drafter)
        sv = cfg.serve
        self.scheduler = Scheduler(
            cfg.engine.max_batch_size, cfg.engine.max_context_len, cfg.model.vocab_size,
            pages=self.runner.pages,
            host_watermarks=(sv.host_high_watermark, sv.host_low_watermark),
            device_watermarks=(sv.device_high_watermark, sv.device_low_watermark),
            ranks=cfg.mesh.data)
        self.times = StepTimes()
        # Per decoding step: wall time, and host time not overlapping the device.
        self.step_seconds, self.host_seconds = self.times.wall, self.times.host
        self._jobs: collections.deque = collections.deque()   # prefill.PrefillJob, oldest first
        kind = self.runner.stepper.kind
        # The decode step in flight (async scheduling).
        self.queue = StepQueue(kind.follow, self.runner.collect,
                               functools.partial(emit_tokens, self._append), self.times)
        self._imports: dict[int, float] = {}   # unclaimed imported prefills: import time
        self.orphans_swept = 0

    @property
    def metrics(self):
        """Offload counters (`jlco.offload.metrics.OffloadMetrics`), None when offload is off."""
        return self.runner.metrics

    @property
    def spec_metrics(self):   # speculative-decoding counters, None without drafts
        return self.runner.stepper.metrics

    @property
    def step_kind(self):
        """Which decode step runs (`jlco.engine.decode.StepKind`: drafts, fetch path, mesh,
        whether steps overlap)."""
        return self.runner.stepper.kind

    @property
    def step_count(self) -> int:
        """Engine steps that decoded."""
        return self.times.count

    def add_step_observer(self, observe) -> None:
        """Call observe(`jlco.engine.decode.StepRecord`) for every decode step collected
        (tools and tests watch steps through this, they do not patch methods)."""
        self.runner.stepper.observers.append(observe)

    # ---- requests -----------------------------------------------------------------
    def submit(self, prompt, max_new_tokens: int, params: SamplingParams | None = None,
               **fields) -> Request:
        """Queue a request (`Scheduler.add`) sampling with `params`, or with a
        SamplingParams made of the sampling `fields` given by keyword (default: greedy);
        a bad field raises RequestError naming it."""
        return self.scheduler.add(prompt, max_new_tokens, sampling_params(params, **fields))

    def check_request(self, prompt, max_new_tokens: int,
                      params: SamplingParams | None = None) -> RequestFields:
        """The request `submit` would accept, normalised, or RequestError naming the bad
        field (`jlco.engine.scheduler.check_request` against this engine's vocabulary and
        context). Pure Python, so a caller may run it on its own thread."""
        return check_request(prompt, max_new_tokens, params,
                             vocab_size=self.cfg.model.vocab_size,
                             max_context_len=self.cfg.engine.max_context_len)

    def admission_status(self) -> AdmissionStatus:
        """What the server reports (`jlco.engine.scheduler.AdmissionStatus`)."""
        return self.scheduler.status()

    def abort(self, request_id: int) -> None:
        """Abort a waiting, prefilling or running request: its slot and pages come back."""
        self.finish(request_id, "abort")

    def finish(self, request_id: int, reason: str) -> None:
        """End a request early ("abort", or "stop": a stop string); its state comes back."""
        self.scheduler.finish(request_id, reason)
        self._jobs = collections.deque(j for j in self._jobs if j.req.id != request_id)
        self._imports.pop(request_id, None)
        self.runner.forget(request_id)

    @property
    def has_work(self) -> bool:
        """A step would do something: requests waiting, prefills in progress or requests
        decoding (an imported prefill waiting for its claim is not work)."""
        sched = self.scheduler
        return bool(sched.waiting) or bool(self._jobs) or self.queue.inflight is not None or any(
            r is not None and r.tokens for r in sched.slots)

    @property
    def num_prefilling(self) -> int:
        """Requests admitted whose prefill has not finished."""
        return len(self._jobs)

    # ---- decoding -----------------------------------------------------------------
    def step(self) -> bool:
        """One engine step: admit what fits, queue one decode step for every running
        request whose prefill is done and, while the device computes it, spend at most
        `engine.prefill_chunk` prompt positions on prefills (oldest first; a prefill that
        completes emits its request's first token). So a long prompt arriving never stalls
        the running requests for more than one chunk per step. Returns False when nothing
        is left to do.

        With `engine.async_scheduling` (`jlco.engine.overlap`) a step's tokens are emitted
        by the next call, behind which it queues its own; `run` ends with none left."""
        t0 = time.perf_counter()
        sched, run = self.scheduler, self.runner
        plan = sched.schedule()
        for req in plan.prefills:
            self._jobs.append(run.start_prefill(req, self._page_row(req)))
        decoding = [r for r in plan.decodes if not r.done and r.tokens]
        prev, decoding, t0 = self.queue.take(decoding, t0)
        pending = run.dispatch(decoding, follow=prev) if decoding else None
        self._advance_prefills(self.cfg.engine.prefill_chunk)
        if prev is not None:
            self.queue.finish(prev, t0)
        if pending is None:
            return self.has_work
        self.queue.hold(pending, t0)
        return True

    def drain(self) -> None:
        """Emit the tokens of the step still in flight, if any (async scheduling)."""
        self.queue.drain()

    def _advance_prefills(self, budget: int | None) -> None:
        """Run prefill pieces, oldest request first, until `budget` prompt positions are
        spent (the first piece always runs; None = run every prefill to its end)."""
        while self._jobs and (budget is None or budget > 0):
            job = next_job(self._jobs, self.cfg.engine.prefill_chunk)
            cost = self.runner.prefill_piece(job)
            budget = None if budget is None else budget - cost
            if job.finished:
                self._jobs.remove(job)
                self._append(job.req, *self.runner.finish_prefill(job))

    def _page_row(self, req: Request):
        pages = self.scheduler.pages
        return None if pages is None else pages.page_table([req.id], self.runner.pages_per_request)[0]

    def _append(self, req: Request, tok: int, logp: float) -> bool:
        done = self.scheduler.append(req, tok, logp)
        if done:
            self.runner.forget(req.id)
        return done

    def admit(self) -> list[Request]:
        """Only the admission half of `step`: admit what fits and prefill it (and any
        prefill in progress) to the end, no decode."""
        admitted = list(self.scheduler.schedule().prefills)
        for req in admitted:
            self._jobs.append(self.runner.start_prefill(req, self._page_row(req)))
        self._advance_prefills(None)
        return admitted

    def run(self) -> None:
        while self.step():
            pass
        if self.runner.trace is not None:
            self.runner.trace.close()

    def generate(self, prompts, max_new_tokens: int, params: SamplingParams | None = None,
                 **fields) -> list[Request]:
        """Submit every prompt with one sampling (as `submit`) and run them to the end."""
        params = sampling_params(params, **fields)
        reqs = [self.submit(p, max_new_tokens, params) for p in prompts]
        self.run()
        return reqs

    def warm_up(self, progress=None) -> dict:
        """Compile every shape, so no request compiles (`jlco.engine.warmup.warm_up`)."""
        from jlco.engine import warmup
        return warmup.warm_up(self, progress, WARMUP_PROMPT)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix page (vLLM's /reset_prefix_cache) → how many."""
        return self.runner.prefix.reset() if self.runner.prefix else 0

    def prefix_stats(self) -> dict | None:
        """{"queries", "hits" (prompt tokens), "pages", "bytes"}; None with it off."""
        return self.runner.prefix.stats() if self.runner.prefix else None

    def check_no_leaks(self) -> None:
        """Every slot and page is owned by a running request (and nothing else), and every
        prefill in progress belongs to one."""
        self.scheduler.check_no_leaks()
        for job in self._jobs:
            if job.req.status != "running":
                raise AssertionError(f"a prefill is left for request {job.req.id} "
                                     f"({job.req.status})")

    def close(self) -> None:
        self.runner.close()


def v4_runner(cfg: Config, model, *, trace_path, drafter, warmup_queries: int):
    """The runner of a deepseek_v4 model (`jlco.engine.v4_runner.V4Runner`); what it does
    not run yet is refused naming the argument."""
    from jlco.engine.v4_runner import V4Runner
    if trace_path is not None:
        raise ValueError(f"trace_path={trace_path!r}: top-k traces record the MLA indexer; "
                         "allowed None with a deepseek_v4 model")
    if drafter is not None:
        raise ValueError("drafter: speculative decoding is not implemented for deepseek_v4 "
                         "(allowed None)")
    return V4Runner(cfg, model, warmup_queries)


def emit_tokens(append, decoding, out) -> None:
    """A decode step's tokens to their requests (with their drafts' counts and, when a
    request asks, each token's alternatives) through `append(request, token, logprob)`
    (True: the request finished and takes no more)."""
    n = len(decoding)
    for req, toks, logps, d, a, top in zip(decoding, out.tokens, out.logprobs,
                                           out.drafted or (0,) * n, out.accepted or (0,) * n,
                                           out.top or ((),) * n):
        req.num_drafted += d
        req.num_accepted += a
        for j, (tok, logp) in enumerate(zip(toks, logps)):
            if req.params.top_logprobs:
                req.top_out.append(top[j])
            if append(req, tok, logp):
                break
