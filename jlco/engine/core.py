"""The engine: continuous batching over `cfg.engine.max_batch_size` request slots with the
MLA latent cache on device (offload off) or in host memory behind a device hot buffer
(offload on). It joins the `Scheduler` (what runs: requests, slots, pages, admission,
stop conditions) and the `ModelRunner` (how: model, caches, jitted steps), and is the
API that `jlco.generate`, the tools and the server use: submit / step / abort / run.
"""

from __future__ import annotations

from typing import Iterable

from jlco.config import Config
from jlco.engine.runner import WARMUP_QUERIES, ModelRunner
from jlco.engine.scheduler import Request, RequestError, Scheduler

__all__ = ["Engine", "Request", "RequestError"]


class Engine:
    """Continuous batching (s_q = 1 per step, or 1 + engine.num_draft_tokens with
    speculative decoding). Constructor arguments are the runner's (`ModelRunner`)."""

    def __init__(self, cfg: Config, model, *, impl: str | None = None,
                 trace_path: str | None = None, warmup_queries: int = WARMUP_QUERIES,
                 drafter=None):
        self.cfg = cfg
        self.runner = ModelRunner(cfg, model, impl=impl, trace_path=trace_path,
                                  warmup_queries=warmup_queries, drafter=drafter)
        self.scheduler = Scheduler(cfg.engine.max_batch_size, cfg.engine.max_context_len,
                                   cfg.model.vocab_size, pages=self.runner.pages)
        self.step_count = 0
        self.step_seconds: list[float] = []   # wall time of each decode step (one sync)

    @property
    def metrics(self):
        """Offload counters (`jlco.offload.metrics.OffloadMetrics`), None when offload is off."""
        return self.runner.metrics

    @property
    def spec_metrics(self):
        """Speculative-decoding counters, None without drafts."""
        return None if self.runner.spec is None else self.runner.spec.metrics

    # ---- requests -----------------------------------------------------------------
    def submit(self, prompt, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
               stop_token_ids: Iterable[int] = ()) -> Request:
        """Queue a request; invalid fields raise RequestError naming the field."""
        return self.scheduler.add(prompt, max_new_tokens, temperature, seed, stop_token_ids)

    def abort(self, request_id: int) -> None:
        self.scheduler.abort(request_id)
        self.runner.forget(request_id)

    # ---- decoding -----------------------------------------------------------------
    def step(self) -> bool:
        """Admit what fits (prefilling each admitted request, which emits its first
        token), then decode one step for every running request. Returns False when
        nothing is left to do."""
        sched = self.scheduler
        plan = sched.schedule()
        self._prefill(plan.prefills)
        running = [r for r in plan.decodes if not r.done]
        if not running:
            return sched.has_work
        out = self.runner.decode(running)
        self.step_seconds.append(out.seconds)
        self.step_count += 1
        for req, toks, logps in zip(running, out.tokens, out.logprobs):
            for tok, logp in zip(toks, logps):
                if self._append(req, tok, logp):
                    break
        return True

    def _append(self, req: Request, tok: int, logp: float) -> bool:
        done = self.scheduler.append(req, tok, logp)
        if done:
            self.runner.forget(req.id)
        return done

    def admit(self) -> list[Request]:
        """Only the admission half of `step`: admit and prefill what fits, no decode."""
        admitted = list(self.scheduler.schedule().prefills)
        self._prefill(admitted)
        return admitted

    def _prefill(self, reqs) -> None:
        sched = self.scheduler
        for req in reqs:
            page_row = None
            if sched.pages is not None:
                page_row = sched.pages.page_table([req.id], self.runner.pages_per_request)[0]
            self._append(req, *self.runner.prefill(req, page_row))

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

    def check_no_leaks(self) -> None:
        """Every slot and page is owned by a running request (and nothing else)."""
        self.scheduler.check_no_leaks()

    def close(self) -> None:
        self.runner.close()
