"""One server over several processes: process 0 serves HTTP and decides, every process
runs the same engine steps in lockstep (`python -m jlco.serve --num_processes N`).

A jit over a mesh that spans processes needs every process to call the same program
with the same host inputs, in the same order. So every process holds an `Engine` built
from the same config and weights, and process 0 (the leader) tells the others what to
do to theirs: each iteration of its engine loop that changes the engine becomes a
`Turn` — the engine operations it applied (submit a request, finish one, drop the prefix
cache), in order, and whether an engine step follows. The leader publishes turn k
before it runs it; every other process (a follower) reads turn k, applies the same
operations to its engine and runs the same step. Each process's scheduler then makes
the same decisions from the same inputs; what could differ between processes (clocks,
HTTP, tokenization, grammar compilation, the 429 queue bound, stop strings) stays on
process 0, and followers receive its results: token ids, grammar texts, request ends.
A follower checks that every request it queues gets the id the leader's got: a
divergence stops the job with an error instead of decoding different batches.

The transport is jax's own distributed key-value store — the coordination service that
`jax.distributed.initialize` runs inside process 0 — so there is no new port, no new
dependency and no hand-made protocol: turns are JSON values under `jlco/serve/turn/<k>`,
read with a bounded blocking get; a device collective would need fixed-size payloads
and a sync on the compute stream for every turn.

Liveness: each follower writes a heartbeat (`jlco/serve/beat/<p>`: a counter, the turns
it has done, its step time and host-pool use) every HEARTBEAT_S; process 0's watchdog
(`Watchdog`) fails the job when a beat is older than --peer_timeout_s or a follower
reports a failure. Process 0 then refuses new requests, answers every open one with an
error, turns /health 503, and every process exits non-zero with one line naming the
process that failed. Followers see process 0's end in its last turn (a stop), or in the
key-value store going away with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Callable

from jlco.sampling.params import SamplingParams
from jlco.sampling.penalties import Penalties

HEARTBEAT_S = 0.5          # a follower's beat period
DEFAULT_PEER_TIMEOUT_S = 10.0
FAILURE_LINGER_S = 3.0     # process 0 answers 503 this long after a failure, then exits
_PREFIX = "jlco/serve"


class PeerFailed(RuntimeError):
    """A process of the job failed or stopped answering; `process` names it."""

    def __init__(self, process: int, why: str):
        super().__init__(f"process {process} failed: {why}")
        self.process, self.why = process, why


# ----------------------------------------------------------------------------- transport


class KeyValueChannel:
    """jax's distributed key-value store (the coordination service process 0 runs) as
    bytes under string keys: `set`, a bounded blocking `get`, `try_get`, `delete`."""

    def __init__(self, client=None):
        if client is None:
            from jax._src import distributed as jax_distributed
            client = jax_distributed.global_state.client
            if client is None:
                raise RuntimeError("jax.distributed is not initialised: no key-value store")
        self.client = client

    def set(self, key: str, value: bytes) -> None:
        self.client.key_value_set_bytes(key, value, allow_overwrite=True)

    def get(self, key: str, timeout_s: float) -> bytes:
        """The value, waiting up to timeout_s: TimeoutError if none came, ConnectionError
        if the store is gone (process 0 ended)."""
        try:
            return self.client.blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1e3)))
        except Exception as err:   # noqa: BLE001 - jax's runtime errors carry the status
            if "DEADLINE_EXCEEDED" in str(err):
                raise TimeoutError(key) from None
            raise ConnectionError(f"the coordination service is unreachable: "
                                  f"{str(err).splitlines()[0][:200]}") from None

    def try_get(self, key: str) -> bytes | None:
        try:
            return self.client.key_value_try_get_bytes(key)
        except Exception as err:   # noqa: BLE001
            if "NOT_FOUND" in str(err):
                return None
            raise ConnectionError(f"the coordination service is unreachable: "
                                  f"{str(err).splitlines()[0][:200]}") from None

    def delete(self, key: str) -> None:
        try:
            self.client.key_value_delete(key)
        except Exception:   # noqa: BLE001 - a key already gone is fine
            pass


class MemoryChannel:
    """The same interface over a dict, for several engines in one process (tests)."""

    def __init__(self):
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._data, timeout_s):
                raise TimeoutError(key)
            return self._data[key]

    def try_get(self, key: str) -> bytes | None:
        with self._cond:
            return self._data.get(key)

    def delete(self, key: str) -> None:
        with self._cond:
            self._data.pop(key, None)


def turn_key(k: int) -> str:
    return f"{_PREFIX}/turn/{k}"


def beat_key(process: int) -> str:
    return f"{_PREFIX}/beat/{process}"


def failure_key(process: int) -> str:
    return f"{_PREFIX}/failed/{process}"


# ----------------------------------------------------------------------------- turns


def params_to_json(params: SamplingParams) -> dict:
    """A request's sampling as JSON: every field, the constraint as its grammar text (each
    process builds its own matcher from it)."""
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
           if f.name not in ("penalties", "constraint")}
    out["stop_token_ids"] = list(params.stop_token_ids)
    out["penalties"] = dataclasses.asdict(params.penalties)
    c = params.constraint
    if c is not None:
        text = getattr(c, "text", None)
        if text is None:
            raise ValueError(f"constraint={c!r}: only grammar constraints "
                             "(jlco.structured.grammar.Grammar) run on several processes")
        out["constraint"] = text
    return out


def params_from_json(data: dict, grammar: Callable[[str], object] | None) -> SamplingParams:
    """`params_to_json`'s inverse; `grammar(text)` makes a constraint's matcher."""
    data = dict(data)
    pen = dict(data.pop("penalties"))
    pen["logit_bias"] = tuple((int(t), float(v)) for t, v in pen["logit_bias"])
    text = data.pop("constraint", None)
    if text is not None and grammar is None:
        raise ValueError("a request with a grammar constraint reached a process without "
                         "a tokenizer")
    stops = tuple(data.pop("stop_token_ids"))
    return SamplingParams(**data, stop_token_ids=stops, penalties=Penalties(**pen),
                          constraint=None if text is None else grammar(text))


@dataclasses.dataclass(frozen=True)
class Turn:
    """What every process does next, in order: `ops` (each a JSON list: ["submit", id,
    prompt, max_new_tokens, params], ["finish", id, reason], ["reset_prefix"]), then one
    engine step if `step`; `stop` ends the job ("" none, "drain" a clean end, else why
    it failed)."""
    k: int
    ops: tuple = ()
    step: bool = False
    stop: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps({"k": self.k, "ops": list(self.ops), "step": self.step,
                           "stop": self.stop}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Turn":
        d = json.loads(data)
        return cls(d["k"], tuple(d["ops"]), d["step"], d["stop"])


def submit_op(req_id: int, prompt, max_new_tokens: int, params: SamplingParams) -> list:
    return ["submit", req_id, [int(t) for t in prompt], max_new_tokens,
            params_to_json(params)]


def apply_op(engine, op: list, grammar: Callable[[str], object] | None = None) -> None:
    """One leader operation on this process's engine (a follower's side)."""
    kind = op[0]
    if kind == "submit":
        _, want, prompt, max_new, params = op
        req = engine.submit(prompt, max_new, params_from_json(params, grammar))
        if req.id != want:
            raise RuntimeError(f"lockstep diverged: a request got id {req.id} here and "
                               f"{want} on process 0")
    elif kind == "finish":
        _, req_id, reason = op
        engine.finish(req_id, reason)
    elif kind == "reset_prefix":
        engine.reset_prefix_cache()
    else:
        raise ValueError(f"unknown lockstep operation {kind!r}")


# ----------------------------------------------------------------------------- leader


class Leader:
    """Process 0's side: numbers and publishes each turn; drops the turns every follower
    has done (their beats say how far they are)."""

    def __init__(self, channel, followers: tuple[int, ...]):
        self.channel = channel
        self.followers = followers
        self.k = 0
        self._lock = threading.Lock()
        self._kept = 0               # the oldest turn still in the store
        self.stopped = False

    def publish(self, ops: list, step: bool) -> None:
        with self._lock:
            if self.stopped:
                raise RuntimeError("the job has stopped: no more turns")
            self.channel.set(turn_key(self.k), Turn(self.k, tuple(ops), step).to_bytes())
            self.k += 1

    def stop(self, why: str) -> None:
        """The last turn: followers end ("drain": cleanly, else with `why` as the error)."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            try:
                self.channel.set(turn_key(self.k), Turn(self.k, stop=why).to_bytes())
            except ConnectionError:
                pass

    def forget_done(self, done: int) -> None:
        """Delete the turns below `done` (every follower has applied them)."""
        with self._lock:
            while self._kept < min(done, self.k):
                self.channel.delete(turn_key(self._kept))
                self._kept += 1


@dataclasses.dataclass
class PeerState:
    """What process 0 knows of a follower from its beats."""
    process: int
    beat: int = -1
    seen: float = dataclasses.field(default_factory=time.monotonic)
    info: dict = dataclasses.field(default_factory=dict)


class Watchdog:
    """Process 0's thread reading the followers' beats: `on_failure(PeerFailed)` once,
    when a beat is older than `timeout_s` or a follower reported a failure."""

    def __init__(self, channel, leader: Leader, timeout_s: float,
                 on_failure: Callable[[PeerFailed], None]):
        self.channel, self.leader, self.timeout_s = channel, leader, timeout_s
        self.on_failure = on_failure
        self.peers = {p: PeerState(p) for p in leader.followers}
        self.failed: PeerFailed | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jlco-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> dict[int, dict]:
        """Each follower's last beat (step time, host pool, turns done) and its age."""
        now = time.monotonic()
        return {p: dict(s.info, age_s=now - s.seen) for p, s in self.peers.items()}

    def check(self) -> PeerFailed | None:
        """One look at every follower (the thread's body; tests call it)."""
        now = time.monotonic()
        for p, peer in self.peers.items():
            try:
                failed = self.channel.try_get(failure_key(p))
                raw = self.channel.try_get(beat_key(p))
            except ConnectionError as err:
                return PeerFailed(0, str(err))
            if failed is not None:
                return PeerFailed(p, failed.decode(errors="replace"))
            if raw is not None:
                info = json.loads(raw)
                if info["beat"] != peer.beat:
                    peer.beat, peer.seen, peer.info = info["beat"], now, info
            if now - peer.seen > self.timeout_s:
                return PeerFailed(p, f"no heartbeat for {now - peer.seen:.1f} s "
                                     f"(--peer_timeout_s={self.timeout_s:g})")
        if self.peers:
            self.leader.forget_done(min(s.info.get("done", 0) for s in self.peers.values()))
        return None

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S / 2):
            failed = self.check()
            if failed is not None and not self._stop.is_set():
                self.failed = failed
                self.on_failure(failed)
                return


class Job:
    """Process 0's view of the job: the `Leader` publishing turns, the `Watchdog` reading
    beats, and the job's end. `end(process, why)` runs once, whoever calls it first (the
    watchdog, or a failed engine step): the loop (once `attach`ed) fails every open
    request, `mark(line)` turns health 503, the followers get a stop with the error, and
    after FAILURE_LINGER_S `exit_fn(line)` ends process 0."""

    def __init__(self, channel, num_processes: int, timeout_s: float, *,
                 mark: Callable[[str], None], exit_fn: Callable[[str], None],
                 linger_s: float = FAILURE_LINGER_S):
        self.num_processes = num_processes
        self.timeout_s = timeout_s
        self.leader = Leader(channel, tuple(range(1, num_processes)))
        self.watchdog = Watchdog(channel, self.leader, timeout_s,
                                 lambda f: self.end(f.process, f.why))
        self.mark, self.exit_fn, self.linger_s = mark, exit_fn, linger_s
        self.loop = None
        self._lock = threading.Lock()
        self.ended: str | None = None

    def start(self) -> None:
        self.watchdog.start()

    def attach(self, loop) -> None:
        """The engine loop, once built: its failures end the job, its requests end with
        the job's failure."""
        self.loop = loop
        loop.on_broken = self.engine_broken
        if self.ended:
            loop.fail(self.ended)

    def engine_broken(self, why: str) -> None:
        """Process 0's step failed: most often a peer died inside the step's collective,
        so the watchdog is given its timeout to name that peer before process 0 is
        blamed."""
        def attribute():
            deadline = time.monotonic() + self.timeout_s + 4 * HEARTBEAT_S
            while time.monotonic() < deadline and self.watchdog.failed is None \
                    and self.ended is None:
                time.sleep(HEARTBEAT_S / 2)
            self.end(0, f"its engine step failed: {why}")
        threading.Thread(target=attribute, name="jlco-attribute", daemon=True).start()

    def end(self, process: int, why: str) -> None:
        with self._lock:
            if self.ended is not None:
                return
            self.ended = line = f"process {process} of {self.num_processes} failed: {why}"
        self.watchdog.stop()
        self.mark(line)
        if self.loop is not None:
            self.loop.fail(line)
        self.leader.stop(line)
        time.sleep(self.linger_s)
        self.exit_fn(line)

    def finish(self) -> None:
        """A clean end (after the drain): the followers stop, nothing is failed."""
        self.watchdog.stop()
        if self.ended is None:
            self.leader.stop("drain")

    def processes(self) -> dict[int, dict]:
        """Per follower: its last beat's figures and the beat's age (for /metrics)."""
        return self.watchdog.snapshot()


# ----------------------------------------------------------------------------- follower


class Follower:
    """A process other than 0: applies process 0's turns to its engine and steps it, and
    beats. `run` returns the stop's reason ("drain") or raises PeerFailed."""

    def __init__(self, channel, process: int, engine=None, *,
                 grammar: Callable[[str], object] | None = None,
                 host_pool_bytes: Callable[[], int] | None = None,
                 leader_timeout_s: float = DEFAULT_PEER_TIMEOUT_S):
        self.channel, self.process, self.engine = channel, process, engine
        self.grammar = grammar
        self.host_pool_bytes = host_pool_bytes
        self.leader_timeout_s = leader_timeout_s
        self.done = 0              # turns applied
        self.steps = 0
        self.last_step_s = 0.0
        self.total_step_s = 0.0
        self._beat = 0
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat_loop, name="jlco-beat", daemon=True)

    def start_beating(self) -> None:
        """Beat from now on (before the model loads: loading and warm-up count as alive)."""
        self._beats.start()

    def beat(self) -> None:
        info = {"beat": self._beat, "done": self.done, "steps": self.steps,
                "last_step_s": self.last_step_s, "total_step_s": self.total_step_s,
                "host_pool_bytes": self.host_pool_bytes() if self.host_pool_bytes else 0,
                "rss_bytes": rss_bytes()}
        self._beat += 1
        self.channel.set(beat_key(self.process), json.dumps(info).encode())

    def _beat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.beat()
            except (ConnectionError, Exception):   # noqa: BLE001 - the run loop reports it
                return

    def report_failure(self, why: str) -> None:
        """Tell process 0 this process failed (best effort: the store may be gone)."""
        try:
            self.channel.set(failure_key(self.process), why.encode())
        except Exception:   # noqa: BLE001
            pass

    def run(self, ready: threading.Event | None = None) -> str:
        """Apply turns until the stop turn → its reason ("drain"); PeerFailed when process 0
        stopped with an error or went away."""
        try:
            while True:
                turn = self._next()
                for op in turn.ops:
                    apply_op(self.engine, op, self.grammar)
                if turn.stop:
                    if turn.stop != "drain":
                        raise PeerFailed(0, turn.stop)
                    return turn.stop
                if turn.step:
                    t0 = time.perf_counter()
                    self.engine.step()
                    self.last_step_s = time.perf_counter() - t0
                    self.total_step_s += self.last_step_s
                    self.steps += 1
                self.done = turn.k + 1
        finally:
            self._stop.set()

    def _next(self) -> Turn:
        """Turn `done`: waits as long as process 0 is idle, and no longer once the store is
        gone (process 0 ended)."""
        while True:
            try:
                return Turn.from_bytes(self.channel.get(turn_key(self.done), HEARTBEAT_S * 4))
            except TimeoutError:
                continue
            except ConnectionError as err:
                raise PeerFailed(0, f"process 0 ended without a stop ({err})") from None


def rss_bytes() -> int:
    """This process's resident memory (0 where /proc is missing)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def local_host_pool_bytes(engine, mesh) -> int:
    """Bytes of the host pool in use by the data ranks whose devices this process holds
    (the rows it keeps in its own memory)."""
    status = engine.admission_status()
    pool = status.host_pool
    if pool is None:
        return 0
    from jlco.model.kv_cache import cache_layers
    cfg = engine.cfg
    page_bytes = pool.page_size * cfg.row_bytes * cache_layers(cfg)
    ranks = local_data_ranks(mesh, len(status.ranks))
    per_rank = pool.num_pages * page_bytes / max(1, len(status.ranks))
    return int(sum((status.ranks[r].host_usage or 0.0) * per_rank for r in ranks))


def local_data_ranks(mesh, nranks: int) -> list[int]:
    """The data ranks with a device in this process (every rank without a mesh)."""
    if mesh is None or "data" not in mesh.axis_names:
        return list(range(nranks))
    import jax
    me = jax.process_index()
    devs = mesh.devices
    axis = mesh.axis_names.index("data")
    import numpy as np
    moved = np.moveaxis(devs, axis, 0)
    return [r for r in range(moved.shape[0])
            if any(d.process_index == me for d in moved[r].flat)]


def grammar_maker(checkpoint: str | None, vocab_size: int) -> Callable[[str], object]:
    """text → a structured-output matcher over the tokenizer process 0 serves (the
    checkpoint's, or the random model's byte-level one), built on first use: most jobs
    never need it."""
    made = []

    def grammar(text):
        if not made:
            from jlco.server.text import TextCodec
            from jlco.structured.grammar import Grammars
            codec = (TextCodec.byte_level(vocab_size) if checkpoint is None
                     else TextCodec.from_checkpoint(checkpoint))
            made.append(Grammars(codec.tokenizer, vocab_size, codec.eos_token_id))
        return made[0].from_text(text)
    return grammar
