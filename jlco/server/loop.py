"""The engine thread of the server: one thread owns the `Engine` (scheduler, runner, every
device array) and steps it; asyncio handlers talk to it only through a command queue
(submit, abort, finish) and read tokens from a per-request `Stream`.

Each loop iteration: apply every queued command, run one `Engine.step()` (admission,
one decode step queued on the device, prefill chunks while it computes, then the
tokens), and hand each request's new tokens to its stream with
`loop.call_soon_threadsafe`. With nothing to do the thread sleeps on the command queue.
A step that raises fails the requests in flight with a 500 and marks the loop broken
(health 503) rather than dying silently: nothing waits forever.

On several processes (`jlco.server.lockstep`) the loop is process 0's: every engine
operation a command applies is recorded, and before each iteration's step the
operations and the step are published as one turn for the other processes to repeat.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import traceback
from typing import Callable

from jlco.engine.scheduler import Request, RequestError
from jlco.sampling.params import SamplingParams
from jlco.server import lockstep
from jlco.server.protocol import ApiError

log = logging.getLogger("jlco.serve")
SWEEP_S = 1.0    # how often the lifecycle sweep runs
# The HTTP status of each way the engine refuses a request (`RequestError.kind`): a bad
# field is the client's to fix (400); no slot or pages now is a retry later (503).
REFUSAL_STATUS = {"invalid": 400, "too_long": 400, "not_found": 400, "no_slot": 503,
                  "no_pages": 503}


def refusal(err: RequestError) -> ApiError:
    """The engine's refusal as the client sees it: status from its kind, param its field."""
    return ApiError(REFUSAL_STATUS[err.kind], str(err), err.field)


@dataclasses.dataclass
class Delta:
    """New tokens of one request since the last delta; `finish_reason` once it ended
    ("length", "stop", "abort"; "error" with `error` set when the engine failed)."""
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    stop_token: int | None = None
    error: str | None = None


class Stream:
    """A request's output as the handler sees it: an asyncio queue of `Delta`s filled
    from the engine thread. Times are `time.monotonic()`."""

    def __init__(self, aloop: asyncio.AbstractEventLoop, prompt_len: int):
        self.aloop = aloop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.prompt_len = prompt_len
        self.request: Request | None = None      # set by the engine thread
        self.sent = 0                             # tokens handed over so far
        self.t_arrival = time.monotonic()
        self.t_scheduled: float | None = None     # admitted (prefill started)
        self.t_first: float | None = None
        self.closed = False

    def put(self, delta: Delta) -> None:
        try:
            self.aloop.call_soon_threadsafe(self.queue.put_nowait, delta)
        except RuntimeError:    # the event loop is closed (shutdown): nobody reads this
            self.closed = True


@dataclasses.dataclass(frozen=True)
class DrainReport:
    """What a drain did: requests in flight when it began, how many of them were still
    running at the grace's end (aborted), the grace, the seconds it took."""
    running: int
    aborted: int
    grace_s: float
    seconds: float

    def line(self) -> str:
        if not self.running:
            return "drained: no request was left running"
        done = self.running - self.aborted
        if not self.aborted:
            return (f"drained: {done} running request(s) finished in {self.seconds:.1f} s "
                    f"(within the {self.grace_s:g} s grace)")
        return (f"drained: {self.aborted} of {self.running} running request(s) still ran "
                f"after the {self.grace_s:g} s grace and were aborted ({done} finished)")


def _prefix_stats(engine) -> dict | None:
    stats = getattr(engine, "prefix_stats", None)
    return None if stats is None else stats()


# ---- what the asyncio side asks of the engine thread (typed commands) --------------------
@dataclasses.dataclass(frozen=True)
class Submit:
    """Queue a request; `fut` gets the Request or an ApiError."""
    fut: concurrent.futures.Future
    stream: "Stream"
    prompt: list
    max_new_tokens: int
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Call:
    """Run fn(engine) between steps; `fut` gets its result or an ApiError. `op`: the
    same change as a lockstep operation (`jlco.server.lockstep.apply_op`) for the other
    processes; a call without one is refused when there are several."""
    fut: concurrent.futures.Future
    fn: Callable
    op: list | None = None


@dataclasses.dataclass(frozen=True)
class Finish:
    """End a stream's request early ("abort" or "stop")."""
    stream: "Stream"
    reason: str


@dataclasses.dataclass(frozen=True)
class AbortAll:
    """Abort every open stream's request (the drain's last word)."""


@dataclasses.dataclass(frozen=True)
class Wake:
    """Nothing to do: wakes an idle engine thread so it sees the stop."""


class EngineLoop:
    """Runs `engine` on its own thread. `max_waiting`: requests allowed in the waiting
    queue before submissions are refused with 429. `on_step(engine, seconds)`: called on
    the engine thread after every step (metrics)."""

    def __init__(self, engine, *, max_waiting: int, on_step: Callable | None = None,
                 import_ttl_s: float = 60.0, mesh=None, leader=None,
                 on_broken: Callable[[str], None] | None = None):
        """mesh: a jax mesh the engine's model is sharded over; the engine thread runs
        under it (`jax.set_mesh`). leader: a `jlco.server.lockstep.Leader` when other
        processes run the same steps. on_broken(why): called once if a step fails."""
        self.engine = engine
        self.leader = leader
        self.on_broken = on_broken
        self._ops: list = []     # this iteration's engine operations (for the leader)
        self.mesh = mesh
        self.max_waiting = max_waiting
        self.import_ttl_s = import_ttl_s
        self._last_sweep = time.monotonic()
        self.on_step = on_step
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, Stream] = {}
        self.draining = False
        self._drain_lock = threading.Lock()
        self._drained: DrainReport | None = None     # what the drain did, once done
        # The prefix cache's counters as the engine thread last saw them (after a step or
        # a command): the metrics read this copy, never the cache the thread is changing.
        self.prefix_stats: dict | None = _prefix_stats(engine)
        self.broken: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jlco-engine", daemon=True)
        self.steps = 0
        self.last_step_s = 0.0

    def start(self) -> None:
        self._thread.start()

    # ---- called from the asyncio side -----------------------------------------------
    def submit(self, stream: Stream, prompt: list[int], max_new_tokens: int,
               params: SamplingParams) -> concurrent.futures.Future:
        """Queue a request for the engine thread → a future resolved with the Request once
        it is queued, or with an ApiError (400 bad field, 429 queue full, 503 draining or
        broken)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.broken:
            fut.set_exception(ApiError(503, f"the engine failed and serves no more requests: "
                                            f"{self.broken}"))
        elif self.draining:
            fut.set_exception(ApiError(503, "the server is shutting down"))
        else:
            self._cmds.put(Submit(fut, stream, prompt, max_new_tokens, params))
        return fut

    def call(self, fn: Callable, op: list | None = None) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps → a future of its result;
        RequestError becomes its `refusal`, ValueError a 400 ApiError, anything else
        a 500. With other processes in lockstep `op` must say what fn changes (the
        lockstep operation they repeat); a call without one gets a 501."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.broken or self.draining:
            fut.set_exception(ApiError(503, self.broken or "the server is shutting down"))
        elif self.leader is not None and op is None:
            fut.set_exception(ApiError(501, "not served with several processes "
                                            "(--num_processes > 1): this route changes the "
                                            "engine in a way the other processes cannot "
                                            "repeat"))
        else:
            self._cmds.put(Call(fut, fn, op))
        return fut

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        """Drop every cached prefix page (on every process) → a future of how many."""
        return self.call(lambda engine: engine.reset_prefix_cache(), op=["reset_prefix"])

    def attach(self, stream: Stream, req: Request) -> None:
        """Publish `req`'s tokens to `stream` (engine thread; from a `call`)."""
        stream.request = req
        self._streams[req.id] = stream
        self._publish_one(req.id, stream)

    def abort(self, stream: Stream, reason: str = "abort") -> None:
        """End a request early ("abort": client gone; "stop": a stop string matched)."""
        self._cmds.put(Finish(stream, reason))

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def drain(self, grace_s: float) -> DrainReport:
        """Stop admitting, let running requests finish for up to `grace_s` seconds, abort
        what is left, stop the thread → what happened. Idempotent (the server starts it
        when the signal arrives and calls it again on the way out)."""
        self.draining = True
        with self._drain_lock:
            if self._drained is not None:
                return self._drained
            t0 = time.monotonic()
            running = len(self._streams)
            while self._streams and time.monotonic() < t0 + grace_s and not self.broken \
                    and self._thread.is_alive():
                time.sleep(0.05)
            left = len(self._streams)
            self._cmds.put(AbortAll())
            self._stop.set()
            self._cmds.put(Wake())
            self._thread.join(timeout=max(5.0, grace_s))
            self._drained = DrainReport(running, left, grace_s, time.monotonic() - t0)
            return self._drained

    # ---- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        if self.mesh is None:
            return self._serve()
        import jax
        with jax.set_mesh(self.mesh):
            return self._serve()

    def _serve(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            idle = not engine.has_work or self.broken
            try:   # idle: sleep until a command comes (or the next sweep); busy: take
                   # what is queued
                cmd = self._cmds.get(timeout=SWEEP_S) if idle else self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._apply(cmd)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            now = time.monotonic()
            if now - self._last_sweep >= SWEEP_S and not self.broken:
                self._last_sweep = now
                self._sweep()
            stepping = not (self._stop.is_set() or not engine.has_work or self.broken)
            if self.leader is not None and (self._ops or stepping) and not self.broken:
                try:
                    self.leader.publish(self._ops, stepping)
                except Exception as err:   # noqa: BLE001 - the store is gone: fail loudly
                    self._fail(err)
                    continue
                finally:
                    self._ops = []
            if not stepping:
                continue
            t0 = time.perf_counter()
            try:
                engine.step()
            except Exception as err:   # noqa: BLE001 - the engine must not die silently
                self._fail(err)
                continue
            self.steps += 1
            self.last_step_s = time.perf_counter() - t0
            self.prefix_stats = _prefix_stats(engine)
            self._publish()
            if self.on_step is not None:
                self.on_step(engine, time.perf_counter() - t0)
        # Stopped: commands queued with the stop (the drain's abort_all) still apply, so
        # every open stream gets its last event.
        while True:
            try:
                self._apply(self._cmds.get_nowait())
            except queue.Empty:
                break

    def _sweep(self) -> None:
        """The lifecycle sweep: imported prefills nobody claimed within import_ttl_s go."""
        try:
            self.engine.sweep(self.import_ttl_s)
        except Exception as err:   # noqa: BLE001
            self._fail(err)

    def _apply(self, cmd) -> None:
        if isinstance(cmd, Call):     # run fn(engine) here → its result (or exception)
            _run_call(self, cmd)
        elif isinstance(cmd, Submit):
            _submit(self, cmd)
        elif isinstance(cmd, Finish):
            req = cmd.stream.request
            if req is not None and not req.done:
                self._finish(req.id, cmd.reason)
                self._publish_one(req.id, cmd.stream)
        elif isinstance(cmd, AbortAll):
            for rid, stream in list(self._streams.items()):
                if not stream.request.done:
                    self._finish(rid, "abort")
                self._publish_one(rid, stream)

    def _finish(self, rid: int, reason: str) -> None:
        self.engine.finish(rid, reason)
        if self.leader is not None:
            self._ops.append(["finish", rid, reason])

    def _publish(self) -> None:
        for rid, stream in list(self._streams.items()):
            self._publish_one(rid, stream)

    def _publish_one(self, rid: int, stream: Stream) -> None:
        req = stream.request
        if stream.t_scheduled is None and req.status != "waiting":
            stream.t_scheduled = time.monotonic()
        n = len(req.tokens)
        if n > stream.sent or req.done:
            if stream.t_first is None and n:
                stream.t_first = time.monotonic()
            last = req.tokens[-1] if req.tokens else None
            stops = req.params.stop_token_ids
            stop_tok = last if req.finish_reason == "stop" and last in stops else None
            stream.put(Delta(req.tokens[stream.sent:n], req.logprobs[stream.sent:n],
                             req.finish_reason if req.done else None, stop_tok))
            stream.sent = n
        if req.done:
            self._streams.pop(rid, None)

    def _fail(self, err: Exception) -> None:
        log.error("engine step failed; failing %d request(s):\n%s", len(self._streams),
                  traceback.format_exc())
        self.fail(f"{type(err).__name__}: {err}")

    def fail(self, why: str) -> None:
        """Serve no more: every open request ends with an error, queued submissions and
        new ones get 503 (health too). Idempotent; safe from another thread once the
        engine thread is stuck (a peer process died inside a step's collective)."""
        first = self.broken is None
        if first:
            self.broken = why
        for rid, stream in list(self._streams.items()):
            stream.put(Delta([], [], "error", error=self.broken))
            self._streams.pop(rid, None)
        while True:     # submissions not yet applied: refused, not left waiting
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, (Submit, Call)):
                cmd.fut.set_exception(ApiError(503, f"the engine failed: {self.broken}"))
        if first and self.on_broken is not None:
            self.on_broken(self.broken)


def _run_call(loop: EngineLoop, cmd: Call) -> None:
    """A Call on the engine thread: fn(engine) → its future (RequestError as its refusal,
    ValueError a 400, anything else a 500); its lockstep operation recorded."""
    fut = cmd.fut
    try:
        result = cmd.fn(loop.engine)
        if cmd.op is not None:
            loop._ops.append(cmd.op)
        # before the caller hears back: a scrape after it sees what fn changed
        # (reset_prefix_cache, an import's prefix)
        loop.prefix_stats = _prefix_stats(loop.engine)
        fut.set_result(result)
    except ApiError as err:
        fut.set_exception(err)
    except RequestError as err:
        fut.set_exception(refusal(err))
    except ValueError as err:
        fut.set_exception(ApiError(400, str(err)))
    except Exception as err:   # noqa: BLE001 - the caller gets a 500, the loop goes on
        log.error("engine call failed:\n%s", traceback.format_exc())
        fut.set_exception(ApiError(500, f"{type(err).__name__}: {err}"))


def _submit(loop: EngineLoop, cmd: Submit) -> None:
    """A Submit on the engine thread: 429 past the queue bound, the engine's refusal, or
    the request queued (its stream attached, its lockstep operation recorded)."""
    if loop.engine.admission_status().waiting >= loop.max_waiting:
        cmd.fut.set_exception(ApiError(429, f"the waiting queue is full "
                                            f"(serve.max_queue={loop.max_waiting}); "
                                            "retry later"))
        return
    try:
        op = None if loop.leader is None else lockstep.submit_op(
            -1, cmd.prompt, cmd.max_new_tokens, cmd.params)
    except ValueError as err:
        cmd.fut.set_exception(ApiError(400, str(err)))
        return
    try:
        req = loop.engine.submit(cmd.prompt, cmd.max_new_tokens, cmd.params)
    except RequestError as err:
        cmd.fut.set_exception(refusal(err))
        return
    if op is not None:
        op[1] = req.id
        loop._ops.append(op)
    cmd.stream.request = req
    loop._streams[req.id] = cmd.stream
    cmd.fut.set_result(req)
