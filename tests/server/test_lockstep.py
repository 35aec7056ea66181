"""Several processes in lockstep (`jlco.server.lockstep`), in one process: process 0's
engine loop publishes its turns over an in-memory channel and a follower repeats them on
a second engine built from the same weights; the turns' encoding; the watchdog and the
job's end. Two real processes serving over gloo: tests/parallel/test_serve_processes.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from jlco.sampling.params import SamplingParams
from jlco.sampling.penalties import Penalties
from jlco.server import lockstep
from jlco.server.loop import EngineLoop, Stream
from jlco.server.protocol import ApiError
from tests.support.engine_workload import BASE, make_model, make_prompts


class _Grammar:
    """A constraint as the server's `Grammar` looks to the transport: its text."""
    def __init__(self, text):
        self.text = text

    def fill(self, row):
        pass

    def consume(self, token):
        pass

    stopped = False


def test_sampling_params_cross_as_json():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=11,
                       stop_token_ids=(3, 4), top_logprobs=2, prompt_logprobs=1,
                       penalties=Penalties(presence=0.5, frequency=0.25, repetition=1.1,
                                           min_tokens=2, logit_bias=((7, -1.5), (9, 2.0))))
    import json
    wire = json.loads(json.dumps(lockstep.params_to_json(p)))
    assert lockstep.params_from_json(wire, None) == p
    made = []
    c = lockstep.params_to_json(SamplingParams(constraint=_Grammar("start: \"a\"")))
    back = lockstep.params_from_json(c, lambda text: made.append(text) or _Grammar(text))
    assert made == ['start: "a"'] and back.constraint.text == 'start: "a"'
    with pytest.raises(ValueError, match="without a tokenizer"):
        lockstep.params_from_json(c, None)


def test_a_constraint_without_grammar_text_cannot_cross():
    class Opaque(_Grammar):
        text = None
    with pytest.raises(ValueError, match="only grammar constraints"):
        lockstep.params_to_json(SamplingParams(constraint=Opaque(None)))


def test_turns_round_trip():
    t = lockstep.Turn(3, (["finish", 2, "abort"], ["reset_prefix"]), True, "")
    assert lockstep.Turn.from_bytes(t.to_bytes()) == t


class _Recording:
    """An engine whose submitted requests are kept (to compare the follower's)."""
    def __init__(self, engine):
        self._engine, self.requests = engine, []

    def submit(self, *args, **kw):
        req = self._engine.submit(*args, **kw)
        self.requests.append(req)
        return req

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _engine(cfg):
    from jlco.engine.core import Engine
    return Engine(cfg, make_model(cfg))


@pytest.mark.parametrize("drafts", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_a_follower_repeats_process_0s_turns(drafts):
    """Requests queued, one aborted mid-run, the prefix cache dropped between: the
    follower's engine gets the same requests (ids, tokens, ends) as process 0's."""
    cfg = BASE.replace(cache__offload=True, engine__num_draft_tokens=drafts)
    channel = lockstep.MemoryChannel()
    leader = lockstep.Leader(channel, (1,))
    lead = _engine(cfg)
    follower = lockstep.Follower(channel, 1, _Recording(_engine(cfg)))
    ended: list = []
    t = threading.Thread(target=lambda: ended.append(follower.run()), daemon=True)
    t.start()
    loop = EngineLoop(lead, max_waiting=16, leader=leader)
    loop.start()
    aloop = asyncio.new_event_loop()
    try:
        prompts = make_prompts()
        streams = [Stream(aloop, len(p)) for p in prompts]
        params = [SamplingParams(), SamplingParams(temperature=1.0, seed=5),
                  SamplingParams(penalties=Penalties(presence=0.5)), SamplingParams()]
        futs = [loop.submit(s, p, 40 if i == 3 else n, params[i])
                for i, (s, p, n) in enumerate(zip(streams, prompts, (9, 4, 7, 6)))]
        reqs = [f.result(timeout=60) for f in futs]
        deadline = time.monotonic() + 120
        while len(reqs[3].tokens) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        loop.abort(streams[3])
        while not all(r.done for r in reqs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.reset_prefix_cache().result(timeout=60) >= 0
        assert all(r.done for r in reqs)
    finally:
        loop.drain(5.0)
        leader.stop("drain")
        t.join(60)
        aloop.close()
    assert ended == ["drain"]
    got = follower.engine.requests
    assert [r.id for r in got] == [r.id for r in reqs]
    for mine, theirs in zip(reqs, got):
        assert theirs.tokens == mine.tokens and theirs.finish_reason == mine.finish_reason
    assert reqs[3].finish_reason == "abort"
    assert follower.engine.prefix_stats()["pages"] == 0
    assert follower.steps == loop.steps and follower.done == leader.k


def test_the_leader_refuses_calls_no_follower_can_repeat():
    loop = EngineLoop(object(), max_waiting=1, leader=lockstep.Leader(
        lockstep.MemoryChannel(), (1,)))
    fut = loop.call(lambda engine: engine)
    with pytest.raises(ApiError) as err:
        fut.result(0)
    assert err.value.status == 501 and "--num_processes > 1" in str(err.value)


def test_a_diverging_follower_stops():
    channel = lockstep.MemoryChannel()
    leader = lockstep.Leader(channel, (1,))

    class Engine:
        def submit(self, prompt, n, params):
            return type("R", (), {"id": 7})()
    leader.publish([lockstep.submit_op(3, [1, 2], 4, SamplingParams())], False)
    with pytest.raises(RuntimeError, match="diverged: a request got id 7 here and 3"):
        lockstep.Follower(channel, 1, Engine()).run()


def test_watchdog_names_a_silent_follower_and_a_failed_one():
    channel = lockstep.MemoryChannel()
    leader = lockstep.Leader(channel, (1, 2))
    dog = lockstep.Watchdog(channel, leader, timeout_s=0.3, on_failure=lambda f: None)
    ones = [lockstep.Follower(channel, p) for p in (1, 2)]
    for f in ones:
        f.beat()
    assert dog.check() is None
    time.sleep(0.2)
    ones[0].beat()
    time.sleep(0.2)
    failed = dog.check()          # process 2 beat 0.4 s ago, process 1 0.2 s ago
    assert failed.process == 2 and failed.why.startswith("no heartbeat for 0.4")
    ones[1].beat()
    ones[0].report_failure("ValueError: boom")
    failed = dog.check()
    assert (failed.process, failed.why) == (1, "ValueError: boom")


def test_the_watchdog_drops_the_turns_every_follower_has_done():
    channel = lockstep.MemoryChannel()
    leader = lockstep.Leader(channel, (1,))
    dog = lockstep.Watchdog(channel, leader, timeout_s=5, on_failure=lambda f: None)
    for _ in range(3):
        leader.publish([], False)
    follower = lockstep.Follower(channel, 1, object())
    follower.done = 2
    follower.beat()
    dog.check()
    assert [channel.try_get(lockstep.turn_key(k)) is None for k in range(3)] == \
        [True, True, False]


def test_the_jobs_end_fails_requests_stops_followers_and_exits_once():
    channel = lockstep.MemoryChannel()
    marked, exits, failed = [], [], []

    class Loop:
        on_broken = None

        def fail(self, why):
            failed.append(why)
    job = lockstep.Job(channel, 2, 5.0, mark=marked.append, exit_fn=exits.append,
                       linger_s=0.0)
    job.attach(Loop())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:   # two reporters at once
        list(pool.map(lambda why: job.end(1, why), ["no heartbeat", "again"]))
    line = exits[0]
    assert len(exits) == 1 and line.startswith("process 1 of 2 failed: ")
    assert marked == [line] and failed == [line]
    with pytest.raises(lockstep.PeerFailed, match="process 0 failed: process 1 of 2"):
        lockstep.Follower(channel, 1, object()).run()


def test_a_follower_leaves_when_the_store_goes_away():
    class Gone(lockstep.MemoryChannel):
        def get(self, key, timeout_s):
            raise ConnectionError("the coordination service is unreachable: UNAVAILABLE")
    with pytest.raises(lockstep.PeerFailed, match="process 0 failed: process 0 ended "
                                                  "without a stop"):
        lockstep.Follower(Gone(), 1, object()).run()
