"""Speculative steps score only a scan bucket of the context, as plain decode steps do:
at max_context_len 2048 (bucket 1024 for these requests) the speculative engine, offload
on, emits exactly the tokens of plain greedy decoding at a context that needs no bucket,
its jitted step is called with `DecodeCache.scan_len` set, and the runner's host mirror
of each slot's length (`ModelRunner.slot_len`, what picks the bucket) stays equal to the
cache's lengths after every step."""

import pytest
from tests.support.engine_workload import BASE, NEW_TOKENS, run_workload

from jlco.engine.core import Engine
from jlco.engine.speculative import ListDrafter


# The slow tier (pyproject.toml): a 2048-position cache. The default tier keeps the
# speculative engine's exactness tests (test_speculative.py) and runs drafts with offload
# at a 2048-token context in the server app (test_messages.py).
@pytest.mark.slow
def test_spec_steps_scan_a_bucket_and_match_greedy(model, prompts):
    _, want = run_workload(BASE, model, prompts)
    truth = [toks for toks, _ in want]

    def half_right(req, n):   # the second draft is wrong: lengths move by 1 or 2
        out = truth[req.id][len(req.tokens):len(req.tokens) + n]
        return [(t + 1) % BASE.model.vocab_size if j == 1 else t for j, t in enumerate(out)]

    cfg = BASE.replace(engine__max_context_len=2048, engine__num_draft_tokens=2,
                       cache__offload=True)
    scans, mirrors = [], []
    eng = Engine(cfg, model, drafter=ListDrafter(half_right))
    spec = eng.runner.spec

    def watch(rec):   # the host mirror against the lengths the step left on the device
        scans.append(rec.scan)
        mirrors.append([(m, int(rec.lengths[r.slot])) for r, m in zip(rec.running, rec.mirror)])

    eng.add_step_observer(watch)
    reqs = [eng.submit(p, n) for p, n in zip(prompts, NEW_TOKENS)]
    eng.run()
    assert [r.tokens for r in reqs] == truth
    eng.check_no_leaks()
    assert scans and set(scans) == {1024}
    assert all(a == b for step_pairs in mirrors for a, b in step_pairs), mirrors
    assert spec.metrics.accepted > 0 and spec.metrics.accepted < spec.metrics.drafted
