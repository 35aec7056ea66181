"""Async scheduling (`engine.async_scheduling`, vLLM's async scheduling, SGLang's overlap
scheduler): each decode step is queued behind the one still computing, the requests it
decodes taking their inputs from that step's outputs on the device
(`jlco.engine.decode.follow_inputs`), and the earlier step's tokens are emitted while the
device works. So the host's work per step (scheduling, building inputs, dispatch,
reading tokens back) leaves the critical path, and the tokens are those of synchronous
steps. Every step kind follows (plain or speculative, either fetch path, any mesh); a
batch with a structured-output request does not (its next token mask is built on the
host from its last token).

`StepQueue` is the engine's half: the step in flight, what the next one may follow,
emitting a step's tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable


def live(pending) -> tuple:
    """The requests of a dispatched step still running: their tokens are emitted (one
    that finished or was aborted while the step was in flight keeps no slot)."""
    return tuple(r for r in pending.running if not r.done)


@dataclasses.dataclass
class StepTimes:
    """Per engine step that decoded: wall time, and host time not overlapping the device
    (wall minus device wait; an upper bound with async scheduling)."""
    count: int = 0
    wall: list = dataclasses.field(default_factory=list)
    host: list = dataclasses.field(default_factory=list)


class StepQueue:
    """The decode step queued and not yet emitted (`inflight`), what the next step may
    follow, and emitting a step's tokens (`finish`)."""

    def __init__(self, follows: bool, collect: Callable, emit: Callable, times: StepTimes):
        """follows: steps may be queued behind the one in flight; collect(pending,
        requests still running) → DecodeOutput;
        emit(requests, DecodeOutput)."""
        self.follows = follows
        self.collect, self.emit, self.times = collect, emit, times
        self.inflight = None

    def take(self, decoding: list, t0: float):
        """Before queueing a step for `decoding` (started at t0) → (the step in flight
        it follows or None, the requests to decode, its start time). A batch with a
        structured-output request follows nothing: the step in flight is emitted first.
        A request the step in flight surely finishes (it emits at least one token) is
        not decoded again; one it may finish (a speculative step emits up to 1 + drafts)
        is, its token limit merged on the device, and its extra tokens are dropped:
        leaving a running request out of a step would reset its slot
        (`steps.open_step`)."""
        prev, self.inflight = self.inflight, None
        if prev is not None and any(r.params.constraint is not None for r in decoding):
            self.finish(prev, t0)
            prev, t0 = None, time.perf_counter()
            decoding = [r for r in decoding if not r.done]
        if prev is not None:
            inflight = {id(r) for r in prev.running}
            decoding = [r for r in decoding if id(r) not in inflight
                        or len(r.tokens) + 1 < r.max_new_tokens]
        return prev, decoding, t0

    def hold(self, pending, t0: float) -> None:
        """A step just queued: left in flight when it may be followed, else emitted."""
        if self.follows:
            self.inflight = pending
        else:
            self.finish(pending, t0)

    def finish(self, pending, t0: float) -> None:
        """Wait for a queued step and emit its tokens; the engine step that did so
        (from t0) is timed: wall and host time over the same interval, scheduling
        included, so a step's host time never exceeds its wall time."""
        running = live(pending)
        out = self.collect(pending, running)
        t_end = time.perf_counter()
        self.times.wall.append(t_end - t0)
        self.times.host.append(t_end - t0 - out.wait_seconds)
        self.times.count += 1
        self.emit(running, out)

    def drain(self) -> None:
        """Emit the step in flight, if any."""
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self.finish(prev, time.perf_counter())
