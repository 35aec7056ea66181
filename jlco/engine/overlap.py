"""Async scheduling (`engine.async_scheduling`, vLLM's async scheduling, SGLang's overlap
scheduler): each plain decode step is queued behind the one still computing, the
requests it decodes taking their input token from that step's output on the device, and
the earlier step's tokens are emitted while the device works. So the host's work per
step (scheduling, building inputs, dispatch, reading tokens back) leaves the critical
path, and the tokens are those of synchronous steps.

`Follower` is the runner's half (which steps may follow, the inputs of one that does),
`StepQueue` the engine's (the step in flight, what the next one may follow, emitting).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import numpy as np

from jlco.engine.inputs import StepInputs, follow_tokens
from jlco.parallel import mesh as parallel_mesh


class Follower:
    """Which of `runner`'s decode steps may follow one in flight, and their inputs."""

    def __init__(self, runner):
        self.runner = runner

    @functools.cached_property
    def can_follow(self) -> bool:
        """`engine.async_scheduling` on, no speculative or host-driven step (their host
        work sits between device phases), one device (a mesh's step outputs carry the
        mesh's shardings, which a step's host inputs do not)."""
        run = self.runner
        return (run.cfg.engine.async_scheduling and run.spec is None and run.host is None
                and run.cfg.mesh.num_devices == 1)

    @functools.cached_property
    def _tokens_sharding(self):
        """Where a plain step's input tokens live: where its output tokens do (offloaded,
        the step's outputs are pinned to the device; else jit leaves them uncommitted,
        as host arrays are), so a step following another and a step taking host tokens
        run one compiled program."""
        return parallel_mesh.replicated() if self.runner.offload and self.can_follow else None

    @functools.cached_property
    def _merge(self):
        return jax.jit(follow_tokens, out_shardings=self._tokens_sharding)

    def inputs(self, running: Sequence, follow=None) -> StepInputs:
        """A plain decode step's inputs for `running`; the requests `follow` (a plain
        step in flight, `runner.PendingDecode`) decodes take their token from its
        output on the device."""
        run = self.runner
        inflight = set() if follow is None else {id(r) for r in follow.running}
        ahead = [id(r) in inflight for r in running]
        inputs = StepInputs.from_requests(running, run.batch, run.cfg.model.vocab_size,
                                          ahead=ahead)
        if not any(ahead):
            if self._tokens_sharding is None:
                return inputs
            return dataclasses.replace(inputs, tokens=jax.device_put(inputs.tokens,
                                                                     self._tokens_sharding))
        if not self.can_follow or follow.arrays is None:
            raise ValueError("dispatch(follow=...): needs a plain step in flight and a "
                             "runner that can follow one (can_follow)")
        mask = np.zeros((run.batch,), bool)
        mask[[r.slot for r, a in zip(running, ahead) if a]] = True
        return dataclasses.replace(inputs, tokens=self._merge(follow.arrays[0], inputs.tokens,
                                                              mask))

    def warm_up(self, tok: jax.Array) -> None:
        """Compile the token merge on a step's output tokens `tok` (so no request does)."""
        if self.can_follow:
            b = self.runner.batch
            jax.block_until_ready(self._merge(tok, np.zeros((b, 1), np.int32),
                                              np.zeros((b,), bool)))


def live(pending) -> tuple:
    """The requests of a dispatched step still running: their tokens are emitted (one
    that finished or was aborted while the step was in flight keeps no slot)."""
    return tuple(r for r in pending.running if not r.done)


class StepQueue:
    """The engine's decode step queued and not yet emitted (`inflight`), what the next
    step may follow, and emitting a step's tokens (`finish`)."""

    def __init__(self, engine, emit):
        self.engine, self.emit = engine, emit   # emit(engine, requests, DecodeOutput)
        self.inflight = None

    def take(self, decoding: list, t0: float):
        """Before queueing a step for `decoding` (started at t0) → (the step in flight
        it follows or None, the requests to decode, its start time). A batch with a
        structured-output request follows nothing (its next mask is built on the host
        from its last token): the step in flight is emitted first. A request whose last
        token is in flight is not decoded again."""
        prev, self.inflight = self.inflight, None
        if prev is not None and any(r.constraint is not None for r in decoding):
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
        if self.engine.runner.follower.can_follow and pending.done is None:
            self.inflight = pending
        else:
            self.finish(pending, t0)

    def finish(self, pending, t0: float) -> None:
        """Wait for a queued step and emit its tokens; the engine step that did so
        (from t0) is timed: wall and host time over the same interval, scheduling
        included, so a step's host time never exceeds its wall time."""
        eng = self.engine
        out = eng.runner.collect(pending)
        t_end = time.perf_counter()
        eng.step_seconds.append(t_end - t0)
        eng.host_seconds.append(t_end - t0 - out.wait_seconds)
        eng.step_count += 1
        self.emit(eng, live(pending), out)

    def drain(self) -> None:
        """Emit the step in flight, if any."""
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self.finish(prev, time.perf_counter())

