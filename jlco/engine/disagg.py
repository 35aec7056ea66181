"""PD disaggregation in the engine: a prefill node exports a finished prefill, a decode
node imports it into a free slot (pages reserved, rows installed, hot buffer warmed) and
decodes it once a request claims it; unclaimed imports are swept after a TTL. The wire
format is `jlco.engine.transfer`. `PrefillTransfer` is `Engine`'s half that does this,
kept apart so the engine class stays about stepping."""

from __future__ import annotations

import dataclasses
import time

from jlco.engine.scheduler import Request, RequestError
from jlco.engine.transfer import PrefilledRequest
from jlco.sampling.params import SamplingParams, sampling_params


class PrefillTransfer:
    """Export, import, claim and sweep of prefills (mixed into `jlco.engine.core.Engine`,
    whose scheduler, runner, `check_request`, `finish` and `_append` it uses)."""
    _imports: dict   # unclaimed imported prefills: request id → import time
    orphans_swept: int

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

    def claim(self, request_id: int, prompt, max_new_tokens: int,
              params: SamplingParams | None = None, **fields) -> Request:
        """Start decoding an imported prefill sampling with `params` (or the sampling
        `fields` by keyword, as `submit`): its first token comes from the imported hidden
        state, then it decodes like any request. The prompt must be the imported one and
        max_new_tokens within the reserved room."""
        params = sampling_params(params, **fields)
        req = self.scheduler.requests.get(request_id)
        if req is None or request_id not in self._imports:
            raise RequestError(f"prefill_id: no unclaimed imported prefill {request_id!r}",
                               "prefill_id", "not_found")
        if list(prompt) != req.prompt:
            raise RequestError("prompt: differs from the imported prefill's prompt", "prompt")
        if max_new_tokens > req.max_new_tokens:
            raise RequestError(f"max_new_tokens={max_new_tokens}: the import reserved room for "
                               f"{req.max_new_tokens}", "max_new_tokens")
        checked = self.check_request(prompt, max_new_tokens, params)
        req.max_new_tokens = checked.max_new_tokens
        # An import has no prompt rows to score: prompt_logprobs does not apply.
        req.params = dataclasses.replace(checked.params, prompt_logprobs=None)
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
    def num_imports(self) -> int:
        """Imported prefills waiting to be claimed."""
        return len(self._imports)
