"""The scheduler alone, without a model or jax: admission by slots and pages, abort of
waiting and running requests, finish on max tokens and on stop tokens, and no page or
slot left behind."""

import subprocess
import sys

import pytest

from jlco.engine.scheduler import RequestError, Scheduler, check_request
from jlco.offload.pages import PageAllocator
from jlco.sampling.params import SamplingParams

VOCAB = 100


def make(slots=2, pages=None, page_size=4, max_len=32):
    alloc = None if pages is None else PageAllocator(pages, page_size)
    return Scheduler(slots, max_len, VOCAB, pages=alloc)


def drive(sched, token=lambda req: 7):
    """Run the plan the way the engine does: a prefill emits one token, then one token
    per decoded request. → list of plans."""
    plans = []
    while sched.has_work:
        plan = sched.schedule()
        plans.append(plan)
        for r in plan.prefills:
            sched.append(r, token(r), -0.5)
        for r in plan.decodes:
            if not r.done:
                sched.append(r, token(r), -0.25)
        sched.check_no_leaks()
        assert len(plans) < 100
    return plans


def assert_empty(sched):
    assert sched.slots == [None] * len(sched.slots) and not sched.waiting
    if sched.pages is not None:
        assert sched.pages.used_pages == 0 and sched.pages.requests == ()
    sched.check_no_leaks()


def test_scheduler_imports_no_jax():
    code = ("import sys, jlco.engine.scheduler, jlco.engine; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_slots_limit_admission_and_finish_on_max_tokens():
    s = make(slots=2)
    reqs = [s.add([1, 2, 3], n) for n in (1, 3, 2)]
    first = s.schedule()
    assert first.prefills == (reqs[0], reqs[1]) and s.waiting == [reqs[2]]
    # nothing decodes before its prefill's first token
    assert first.decodes == ()
    for r in first.prefills:
        s.append(r, 5, -1.0)
    # a one-token request finishes on its prefill token and is never decoded
    assert reqs[0].status == "finished" and reqs[0].finish_reason == "length"
    assert reqs[0].slot is None and s.slots.count(None) == 1
    second = s.schedule()
    assert second.decodes == (reqs[1],) and second.prefills == (reqs[2],)
    for r in second.prefills + second.decodes:
        s.append(r, 5, -1.0)
    drive(s)
    for r in reqs:
        assert r.status == "finished" and len(r.tokens) == r.max_new_tokens == len(r.logprobs)
        assert r.finish_reason == "length"
    assert_empty(s)


def test_pages_limit_admission_fifo():
    # 4 pages of 4 tokens: a 10-position request needs 3 pages, a 5-position one 2.
    s = make(slots=4, pages=4)
    big = s.add(list(range(8)), 2)     # 3 pages
    small = s.add([1, 2, 3], 2)        # 2 pages: does not fit beside big
    tiny = s.add([1], 1)               # 1 page: would fit, but must not overtake `small`
    plan = s.schedule()
    assert plan.prefills == (big,) and s.waiting == [small, tiny]
    assert s.pages.free_pages == 1
    s.append(big, 1, 0.0)
    assert s.schedule().prefills == ()          # still no room for `small`
    s.append(big, 1, 0.0)                       # big finishes: its pages return
    assert big.done and s.pages.free_pages == 4
    plan = s.schedule()
    assert plan.prefills == (small, tiny)
    for r in plan.prefills:
        s.append(r, 1, 0.0)
    drive(s)
    assert_empty(s)


def test_finish_on_stop_token():
    s = make(slots=1)
    r = s.add([1, 2], 10, SamplingParams(stop_token_ids=[9]))
    toks = iter([3, 4, 9, 5])
    drive(s, token=lambda req: next(toks))
    assert r.tokens == [3, 4, 9] and r.finish_reason == "stop" and r.status == "finished"
    assert_empty(s)


def test_stop_token_on_prefill_token_skips_decode():
    s = make(slots=1)
    r = s.add([1], 5, SamplingParams(stop_token_ids=[7]))
    plan = s.schedule()
    s.append(r, 7, 0.0)
    assert r.done and r.finish_reason == "stop"
    assert [d for d in plan.decodes if not d.done] == []
    assert_empty(s)


def test_abort_waiting_and_running_frees_everything():
    s = make(slots=1, pages=8)
    running = s.add([1, 2, 3], 4)
    waiting = s.add([4, 5], 4)
    s.schedule()
    assert running.status == "running" and waiting.status == "waiting"
    assert s.pages.used_pages > 0
    s.abort(waiting.id)
    assert waiting.status == "aborted" and waiting.finish_reason == "abort"
    assert s.waiting == []
    s.abort(running.id)
    assert running.status == "aborted" and running.slot is None
    assert_empty(s)
    s.abort(running.id)   # aborting a finished request changes nothing
    assert running.status == "aborted"
    with pytest.raises(RequestError, match="request_id"):
        s.abort(12345)
    with pytest.raises(RequestError, match="aborted"):
        s.append(running, 1, 0.0)
    assert s.schedule().empty and not s.has_work


def test_abort_mid_run_then_others_complete():
    s = make(slots=2, pages=6)
    reqs = [s.add([1] * 5, 3) for _ in range(4)]
    plan = s.schedule()
    s.abort(reqs[0].id)                 # aborted while its prefill runs
    s.append(reqs[1], 1, 0.0)           # the other prefill's first token
    drive(s)
    assert [r.status for r in reqs] == ["aborted", "finished", "finished", "finished"]
    assert_empty(s)


def test_add_running_for_imported_prefills():
    s = make(slots=1, pages=4)
    r = s.add_running(context_len=10, max_new_tokens=2)
    assert r.status == "running" and r.slot == 0 and s.pages.used_pages == 3
    with pytest.raises(RequestError, match="no free batch slot"):
        s.add_running(1, 1)
    s.append(r, 1, 0.0)
    s.append(r, 1, 0.0)
    assert_empty(s)


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=[]), "prompt"), (dict(prompt=[VOCAB]), "prompt"),
    (dict(prompt=[-1]), "prompt"), (dict(prompt=[True]), "prompt"),
    (dict(prompt=["1"]), "prompt"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(max_new_tokens=40), "max_context_len"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature="0"), "temperature"),
    (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"),
    (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
])
def test_bad_fields_name_the_field(kwargs, field):
    s = make()
    args = dict(prompt=[1, 2], max_new_tokens=2) | kwargs
    with pytest.raises(RequestError, match=field):
        s.add(args.pop("prompt"), args.pop("max_new_tokens"), SamplingParams(**args))
    assert not s.has_work and s.requests == {}


def _refusal(fn, *args):
    with pytest.raises(RequestError) as info:
        fn(*args)
    return info.value.field, info.value.kind


def test_refusals_carry_their_field_and_kind():
    """Callers (the server's HTTP status) decide on `field` and `kind`, not the text."""
    s = make(slots=2, pages=4)
    assert _refusal(s.add, [VOCAB], 2) == ("prompt", "invalid")
    assert _refusal(s.add, [1, 2], 0) == ("max_new_tokens", "invalid")
    assert _refusal(s.add, [1, 2], 40) == ("max_new_tokens", "too_long")
    assert _refusal(s.abort, 99) == ("request_id", "not_found")
    assert _refusal(s.add_running, 10, 10) == (None, "no_pages")     # 5 pages of 4
    assert s.pages.used_pages == 0 and s.requests == {}
    r = s.add_running(10, 2)
    s.add_running(2, 2)
    assert _refusal(s.add_running, 1, 1) == (None, "no_slot")
    for req in (r, s.slots[1]):
        s.append(req, 1, 0.0)
        s.append(req, 1, 0.0)
    assert_empty(s)


def test_check_request_is_the_check_add_applies():
    params = SamplingParams(temperature=1, seed=5, stop_token_ids=[VOCAB - 1], top_p=1,
                            top_k=10 * VOCAB)
    f = check_request([1, 2], 3, params, vocab_size=VOCAB, max_context_len=32)
    p = f.params
    assert (f.prompt, f.max_new_tokens, p.temperature, p.seed, p.stop_token_ids, p.top_p,
            p.top_k) == ([1, 2], 3, 1.0, 5, (VOCAB - 1,), 1.0, VOCAB)
    assert type(p.temperature) is float and type(p.top_p) is float
    req = make().add([1, 2], 3, params)
    assert (req.prompt, req.params.temperature, req.params.stop_token_ids, req.params.top_k) == \
        (f.prompt, p.temperature, p.stop_token_ids, p.top_k)


def test_status_copies_the_admission_counts():
    s = Scheduler(4, 64, VOCAB, pages=PageAllocator(8, 4), host_watermarks=(0.7, 0.3))
    reqs = [s.add(list(range(6)), 2) for _ in range(4)]              # 2 pages each
    s.schedule()
    st = s.status()
    assert (st.waiting, st.running, st.slots, st.free_slots) == (1, 3, 4, 1)
    assert st.pool_usage == {"device": 0.75, "host": 0.75} and st.paused["host"]
    assert st.holding_pool() == "host" and st.watermarks["device"] is None
    assert st.host_pool.used_pages == 6 and st.host_pool.leaked_pages == 0
    assert [(r.running, r.admitted, r.host_usage) for r in st.ranks] == [(3, 3, 0.75)]
    s.append(reqs[0], 1, 0.0)
    assert s.status().waiting == 1 and st.running == 3      # a copy: `st` did not move
    for r in reqs:
        s.abort(r.id)
    assert s.status().holding_pool() == "host"     # paused until admission looks again
    assert s.admission_paused() is None and s.status().holding_pool() is None


def test_host_watermark_pauses_admission_until_low():
    # 8 pages of 4 tokens; high 0.7 (> 5.6 pages reserved), low 0.3 (<= 2.4 pages).
    s = Scheduler(4, 64, VOCAB, pages=PageAllocator(8, 4), host_watermarks=(0.7, 0.3))
    a, b, c = (s.add(list(range(6)), 2) for _ in range(3))   # 2 pages each
    d = s.add([1], 1)                                          # 1 page
    plan = s.schedule()
    assert plan.prefills == (a, b, c) and s.admission_paused() == "host"  # 6/8 > 0.7
    for r in plan.prefills:
        s.append(r, 1, 0.0)
    s.append(a, 1, 0.0)                      # a done: 4/8 reserved, still above low
    assert s.schedule().prefills == () and s.waiting == [d]
    s.append(b, 1, 0.0)                      # b done: 2/8 <= low: resumes
    assert s.schedule().prefills == (d,) and s.admission_paused() is None
    s.append(d, 1, 0.0)
    s.append(c, 1, 0.0)
    assert_empty(s)


def test_device_watermark_counts_slots():
    s = Scheduler(4, 64, VOCAB, device_watermarks=(0.5, 0.25))
    reqs = [s.add([1, 2], 2) for _ in range(4)]
    plan = s.schedule()                      # 3 slots: 3/4 > 0.5 pauses the 4th
    assert plan.prefills == tuple(reqs[:3]) and s.admission_paused() == "device"
    with pytest.raises(ValueError, match="device_watermarks"):
        Scheduler(4, 64, VOCAB, device_watermarks=(0.2, 0.5))
