"""The engine: continuous batching over `cfg.engine.max_batch_size` request slots with the
MLA latent cache on device (offload off) or in host memory behind a device hot buffer
(offload on). It joins the `Scheduler` (what runs: requests, slots, pages, admission,
stop conditions) and the `ModelRunner` (how: model, caches, jitted steps), and is the
API that `jlco.generate`, the tools and the server use: submit / step / abort / run.
"""

from __future__ import annotations

import collections
import time
from typing import Iterable

from jlco.config import Config
from jlco.engine.prefill import WARMUP_QUERIES, next_job
from jlco.engine.overlap import StepQueue
from jlco.engine.runner import ModelRunner
from jlco.engine.scheduler import (AdmissionStatus, Request, RequestError, RequestFields,
                                   Scheduler, check_request)
from jlco.engine.transfer import PrefilledRequest

__all__ = ["Engine", "Request", "RequestError"]

WARMUP_PROMPT = 48   # tokens of the warm-up request (longer than tiny's index_topk)


class Engine:
    """Continuous batching (s_q = 1 per step, or 1 + engine.num_draft_tokens with
    speculative decoding). Constructor arguments are the runner's (`ModelRunner`)."""

    def __init__(self, cfg: Config, model, *, impl: str | None = None,
                 trace_path: str | None = None, warmup_queries: int = WARMUP_QUERIES,
                 drafter=None):
        self.cfg = cfg
        self.runner = ModelRunner(cfg, model, impl=impl, trace_path=trace_path,
                                  warmup_queries=warmup_queries, drafter=drafter)
        sv = cfg.serve
        self.scheduler = Scheduler(
            cfg.engine.max_batch_size, cfg.engine.max_context_len, cfg.model.vocab_size,
            pages=self.runner.pages,
            host_watermarks=(sv.host_high_watermark, sv.host_low_watermark),
            device_watermarks=(sv.device_high_watermark, sv.device_low_watermark),
            ranks=cfg.mesh.data)
        self.step_count = 0
        self.step_seconds: list[float] = []   # wall time of each engine step that decoded
        # Host time of each step not overlapping the device (wall minus device wait; an
        # upper bound with async scheduling, whose host work overlaps the step in flight).
        self.host_seconds: list[float] = []
        self._jobs: collections.deque = collections.deque()   # prefill.PrefillJob, oldest first
        self.queue = StepQueue(self, _emit)   # the decode step in flight (async scheduling)
        self._imports: dict[int, float] = {}   # unclaimed imported prefills: import time
        self.orphans_swept = 0

    @property
    def metrics(self):
        """Offload counters (`jlco.offload.metrics.OffloadMetrics`), None when offload is off."""
        return self.runner.metrics

    @property
    def spec_metrics(self):   # speculative-decoding counters, None without drafts
        return None if self.runner.spec is None else self.runner.spec.metrics

    # ---- requests -----------------------------------------------------------------
    def submit(self, prompt, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
               stop_token_ids: Iterable[int] = (), top_p: float = 1.0, top_k: int = 0,
               **logprobs) -> Request:
        """Queue a request (`Scheduler.add`); a bad field raises RequestError naming it."""
        return self.scheduler.add(prompt, max_new_tokens, temperature, seed, stop_token_ids,
                                  top_p=top_p, top_k=top_k, **logprobs)

    def check_request(self, prompt, max_new_tokens: int, temperature: float = 0.0,
                      seed: int = 0, stop_token_ids: Iterable[int] = (), *, top_p: float = 1.0,
                      top_k: int = 0, **logprobs) -> RequestFields:
        """The fields `submit` would accept, normalised, or RequestError naming the bad one
        (`jlco.engine.scheduler.check_request` against this engine's vocabulary and
        context). Pure Python, so the server calls it on its own thread too."""
        return check_request(prompt, max_new_tokens, temperature, seed, stop_token_ids,
                             top_p=top_p, top_k=top_k, vocab_size=self.cfg.model.vocab_size,
                             max_context_len=self.cfg.engine.max_context_len, **logprobs)

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

    # ---- PD disaggregation ----------------------------------------------------------
    def export_prefill(self, prompt, max_new_tokens: int) -> PrefilledRequest:
        """Prefill `prompt` here (a prefill node: no slot, no pages, nothing kept) and
        return it for a decode node's `import_prefill`, which reserves room for
        `max_new_tokens`. Invalid fields raise RequestError naming them."""
        f = self.check_request(prompt, max_new_tokens)
        req = Request(-1, f.prompt, f.max_new_tokens)   # never queued: no id of its own
        job = self.runner.start_prefill(req, None, record=True)
        while not job.finished:
            self.runner.prefill_piece(job)
        return self.runner.export_prefill(job, max_new_tokens)

    def import_prefill(self, p: PrefilledRequest) -> Request:
        """Take a request prefilled elsewhere into a free slot (its pages reserved for
        prompt + max_new_tokens, rows installed, hot buffer warmed). It decodes once a
        request `claim`s it; unclaimed it is freed by `sweep`. A payload that does not fit
        this engine is a ValueError naming the tensor; no free slot or pages: RequestError
        of kind "no_slot" / "no_pages"."""
        p.check(self.cfg)
        req = self.scheduler.add_running(len(p.prompt), p.max_new_tokens)
        req.prompt = list(p.prompt)
        try:
            self.runner.import_prefill(req, p, self._page_row(req))
        except Exception:
            self.finish(req.id, "abort")
            raise
        self._imports[req.id] = time.monotonic()
        return req

    def claim(self, request_id: int, prompt, max_new_tokens: int, temperature: float = 0.0,
              seed: int = 0, stop_token_ids: Iterable[int] = (), top_p: float = 1.0,
              top_k: int = 0, top_logprobs: int = 0, prompt_logprobs=None, penalties=None,
              min_p: float = 0.0, constraint=None) -> Request:
        """Start decoding an imported prefill with these sampling fields: its first token
        comes from the imported hidden state, then it decodes like any request. The
        prompt must be the imported one and max_new_tokens within the reserved room."""
        req = self.scheduler.requests.get(request_id)
        if req is None or request_id not in self._imports:
            raise RequestError(f"prefill_id: no unclaimed imported prefill {request_id!r}",
                               "prefill_id", "not_found")
        if list(prompt) != req.prompt:
            raise RequestError("prompt: differs from the imported prefill's prompt", "prompt")
        if max_new_tokens > req.max_new_tokens:
            raise RequestError(f"max_new_tokens={max_new_tokens}: the import reserved room for "
                               f"{req.max_new_tokens}", "max_new_tokens")
        checked = self.check_request(prompt, max_new_tokens, temperature, seed, stop_token_ids,
                                     top_p=top_p, top_k=top_k, top_logprobs=top_logprobs,
                                     penalties=penalties, min_p=min_p, constraint=constraint)
        for f in ("max_new_tokens", "temperature", "seed", "stop_token_ids", "top_p", "top_k",
                  "top_logprobs", "penalties", "min_p", "constraint"):   # prompt_logprobs: an import has no prompt rows to score
            setattr(req, f, getattr(checked, f))
        del self._imports[request_id]
        self._append(req, *self.runner.first_token(req))
        return req

    def sweep(self, ttl_s: float) -> int:
        """Free imported prefills nobody claimed within `ttl_s` seconds → how many (also
        added to `orphans_swept`)."""
        now = time.monotonic()
        stale = [rid for rid, t in self._imports.items() if now - t > ttl_s]
        for rid in stale:
            del self._imports[rid]
            self.finish(rid, "abort")
        self.orphans_swept += len(stale)
        return len(stale)

    @property
    def has_work(self) -> bool:
        """A step would do something: requests waiting, prefills in progress or requests
        decoding (an imported prefill waiting for its claim is not work)."""
        sched = self.scheduler
        return bool(sched.waiting) or bool(self._jobs) or self.queue.inflight is not None or any(
            r is not None and r.tokens for r in sched.slots)

    @property
    def num_imports(self) -> int:
        """Imported prefills waiting to be claimed."""
        return len(self._imports)

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

    def generate(self, prompts, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> list[Request]:
        reqs = [self.submit(p, max_new_tokens, temperature, seed) for p in prompts]
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


def _emit(engine: Engine, decoding, out) -> None:
    """A decode step's tokens to their requests (with their drafts' counts and, when a
    request asks, each token's alternatives); a finished request stops taking them."""
    n = len(decoding)
    for req, toks, logps, d, a, top in zip(decoding, out.tokens, out.logprobs,
                                           out.drafted or (0,) * n, out.accepted or (0,) * n,
                                           out.top or ((),) * n):
        req.num_drafted += d
        req.num_accepted += a
        for j, (tok, logp) in enumerate(zip(toks, logps)):
            if req.top_logprobs:
                req.top_out.append(top[j])
            if engine._append(req, tok, logp):
                break
