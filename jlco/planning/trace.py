"""Top-k traces: a streaming file format, an ESS-shaped synthetic generator, cache replay.

A trace is the sequence of indexer top-k id sets an engine needs: one record per
(request, decode step, layer) holding the int32 ids that step reads (with MTP, the union
over the step's s_q query tokens). The hot-buffer (staging) policies are judged by
replaying traces, so the engine records while decoding (`TraceWriter`) and
`tools/cache_study.py` / `jlco.planning.throughput` replay recorded or synthetic ones.

File layout (little endian), written append-only so a crash loses at most the last record:
  b"JLCOTRC1" | u32 header_len | header JSON (utf-8) |
  records: i32 request, i32 step, i32 layer, u32 n, n x i32 ids
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import struct

import numpy as np

MAGIC = b"JLCOTRC1"
_REC = struct.Struct("<iiiI")
# Share of the synthetic score variance that is static per token (see `_init_state`).
DEFAULT_STATIC = 0.5


class TraceWriter:
    """Append records to a trace file as they are produced (the engine calls `record` per
    layer per step; nothing is buffered beyond the OS file buffer)."""

    def __init__(self, path: str | pathlib.Path, meta: dict | None = None):
        self.path = pathlib.Path(path)
        header = json.dumps(meta or {}).encode()
        self._f = open(self.path, "wb")
        self._f.write(MAGIC + struct.pack("<I", len(header)) + header)

    def record(self, request: int, step: int, layer: int, ids) -> None:
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"ids must be a 1-D integer array, got shape {ids.shape} "
                             f"dtype {ids.dtype}")
        for name, v in (("request", request), ("step", step), ("layer", layer)):
            if not 0 <= int(v) < 2**31:
                raise ValueError(f"{name}={v!r} is invalid: allowed 0..2**31-1")
        self._f.write(_REC.pack(int(request), int(step), int(layer), ids.size))
        self._f.write(ids.astype("<i4").tobytes())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass
class Trace:
    """All records of a trace, ids concatenated; record i owns ids[offsets[i]:offsets[i+1]]."""
    meta: dict
    request: np.ndarray
    step: np.ndarray
    layer: np.ndarray
    offsets: np.ndarray
    ids: np.ndarray

    def __len__(self) -> int:
        return len(self.request)

    def sets(self, request: int, layer: int) -> list[np.ndarray]:
        """The id sets of one request at one layer, ordered by step."""
        sel = np.flatnonzero((self.request == request) & (self.layer == layer))
        sel = sel[np.argsort(self.step[sel], kind="stable")]
        return [self.ids[self.offsets[i]:self.offsets[i + 1]] for i in sel]

    def keys(self) -> list[tuple[int, int]]:
        """Distinct (request, layer) pairs, sorted."""
        pairs = set(zip(self.request.tolist(), self.layer.tolist()))
        return sorted(pairs)

    def write(self, path: str | pathlib.Path) -> None:
        with TraceWriter(path, self.meta) as w:
            for i in range(len(self)):
                w.record(self.request[i], self.step[i], self.layer[i],
                         self.ids[self.offsets[i]:self.offsets[i + 1]])


def read_trace(path: str | pathlib.Path) -> Trace:
    """Read a whole trace file; a truncated last record (writer killed) is dropped."""
    buf = pathlib.Path(path).read_bytes()
    if buf[:8] != MAGIC:
        raise ValueError(f"{path}: not a jlco trace (magic {buf[:8]!r}, expected {MAGIC!r})")
    (hlen,) = struct.unpack_from("<I", buf, 8)
    meta = json.loads(buf[12:12 + hlen].decode())
    pos, heads, chunks, offsets = 12 + hlen, [], [], [0]
    while pos + _REC.size <= len(buf):
        r, s, l, n = _REC.unpack_from(buf, pos)
        if pos + _REC.size + 4 * n > len(buf):
            break
        chunks.append(np.frombuffer(buf, "<i4", n, pos + _REC.size))
        heads.append((r, s, l))
        offsets.append(offsets[-1] + n)
        pos += _REC.size + 4 * n
    h = np.array(heads, np.int64).reshape(-1, 3)
    ids = np.concatenate(chunks).astype(np.int32) if chunks else np.zeros(0, np.int32)
    return Trace(meta, h[:, 0], h[:, 1], h[:, 2], np.array(offsets, np.int64), ids)


def from_sets(sets: dict[tuple[int, int], list[np.ndarray]], meta: dict | None = None) -> Trace:
    """Build a Trace from {(request, layer): [ids of step 0, step 1, ...]}."""
    heads, chunks = [], []
    for (r, l), seq in sorted(sets.items()):
        for s, ids in enumerate(seq):
            heads.append((r, s, l))
            chunks.append(np.asarray(ids, np.int32))
    h = np.array(heads, np.int64).reshape(-1, 3)
    offsets = np.concatenate([[0], np.cumsum([c.size for c in chunks])]).astype(np.int64)
    ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
    return Trace(meta or {}, h[:, 0], h[:, 1], h[:, 2], offsets, ids)


# ---------------------------------------------------------------- synthetic generator

def ess_overlap_profile(num_layers: int) -> np.ndarray:
    """Per-layer overlap |S_t ∩ S_t-1| / topk of consecutive tokens' top-k sets, after ESS
    (docs/facts.md §3): ≈0 at layer 0, 0.7–0.9 in layers 1–16 and 48–60 (0.8 used), 0.3–0.6 in
    17–44 (a ramp 0.3 → 0.6: ESS's miss peak is layer 17), 45–47 interpolated (not stated).
    Other depths map layer l to l·60/(num_layers-1) of the 61-layer profile."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} is invalid: allowed >= 1")
    ref = np.empty(61)
    ref[0], ref[1:17], ref[48:] = 0.0, 0.8, 0.8
    ref[17:45] = np.linspace(0.3, 0.6, 28)
    ref[45:48] = np.linspace(0.6, 0.8, 5)[1:4]
    if num_layers == 61:
        return ref
    return np.interp(np.linspace(0, 60, num_layers), np.arange(61), ref)


def _advance(x: np.ndarray, n: int, rho: float, topk: int, rng, base: np.ndarray,
             sd: float) -> tuple[np.ndarray, np.ndarray]:
    """One new token: every context score takes an AR(1) step (stationary N(0, sd²)) around
    a static per-token importance `base`; the new token enters 1.5 sigma above the current
    top-k threshold (new tokens tend to be selected, then drift back); the new query's
    top-k over the n+1 tokens is returned with the updated dynamic scores."""
    y = np.empty_like(x)
    y[:n] = rho * x[:n] + np.float32(sd * np.sqrt(1.0 - rho * rho)) * rng.standard_normal(
        n, dtype=np.float32)
    score = base[:n + 1].copy()     # score[n] is set below (y[n] is not yet)
    score[:n] += y[:n]
    k = min(topk, n)
    thr = np.partition(score[:n], n - k)[n - k]
    y[n] = thr + 1.5 - base[n]
    score[n] = thr + 1.5
    kk = min(topk, n + 1)
    sel = np.argpartition(-score, kk - 1)[:kk]
    return y, np.sort(sel).astype(np.int32)


def _init_state(context: int, extra: int, static: float, rng):
    """Dynamic scores x ~ N(0, 1-static) and static importance ~ N(0, static); the sum is
    N(0, 1). `static` is the share of score variance that never changes: the larger, the
    more a layer's churn stays inside a persistent working set (LRU-friendly)."""
    size = context + extra
    base = (np.sqrt(static) * rng.standard_normal(size, dtype=np.float32)).astype(np.float32)
    x = np.empty(size, np.float32)
    x[:context] = np.sqrt(1.0 - static) * rng.standard_normal(context, dtype=np.float32)
    return x, base


@functools.lru_cache(maxsize=256)
def calibrate(context: int, topk: int, overlap: float, static: float) -> tuple[float, float]:
    """(rho, static share) whose consecutive-token top-k overlap is `overlap` at this
    context. Bisection on rho with common random numbers (monotone); when even rho = 0
    overlaps too much (a persistent static part keeps rows selected), the static share is
    lowered by bisection instead (layer 0: overlap ≈ 0 needs no static part)."""
    def measure(rho: float, w: float) -> float:
        rng = np.random.default_rng(1234)
        x, base = _init_state(context, 8, w, rng)
        prev, vals = None, []
        for i in range(7):
            x, sel = _advance(x, context + i, rho, topk, rng, base, np.sqrt(1.0 - w))
            if prev is not None and i >= 3:
                vals.append(np.intersect1d(prev, sel).size / sel.size)
            prev = sel
        return float(np.mean(vals))

    if measure(0.0, static) >= overlap:
        lo, hi = 0.0, static
        for _ in range(14):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if measure(0.0, mid) < overlap else (lo, mid)
        return 0.0, 0.5 * (lo + hi)
    lo, hi = 0.0, 0.99999
    for _ in range(18):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if measure(mid, static) < overlap else (lo, mid)
    return 0.5 * (lo + hi), static


def synthetic_layer(context: int, topk: int, steps: int, overlap: float,
                    queries_per_step: int = 1, accept: float = 1.0, seed: int = 0,
                    static: float = DEFAULT_STATIC) -> list[np.ndarray]:
    """Top-k id sets of one request at one layer for `steps` decode steps.

    Scores = static importance + AR(1) drift, calibrated so consecutive tokens' top-k sets
    overlap by `overlap`; each step appends the committed tokens to the context. A step
    evaluates `queries_per_step` (s_q) query tokens and needs the union of their top-k
    sets; `accept` tokens (mean; floor/ceil at random) are committed and the draft states
    beyond them are discarded, as with MTP verification."""
    if not 1 <= accept <= queries_per_step:
        raise ValueError(f"accept={accept} is invalid: allowed 1..queries_per_step "
                         f"({queries_per_step})")
    if topk < 1 or context < 1:
        raise ValueError(f"topk={topk}, context={context} are invalid: allowed >= 1")
    if not 0.0 <= static < 1.0:
        raise ValueError(f"static={static} is invalid: allowed 0 <= static < 1")
    rho, w = calibrate(context, topk, round(float(overlap), 3), float(static))
    rng = np.random.default_rng(seed)
    x, base = _init_state(context, steps * queries_per_step + 1, w, rng)
    sd = float(np.sqrt(1.0 - w))
    n, out = context, []
    for _ in range(steps):
        a = int(np.floor(accept)) + int(rng.random() < accept - np.floor(accept))
        y, sets, committed = x, [], None
        for j in range(queries_per_step):
            y, sel = _advance(y, n + j, rho, topk, rng, base, sd)
            sets.append(sel)
            if j + 1 == a:
                committed = y
        x, n = committed, n + a
        out.append(np.unique(np.concatenate(sets)).astype(np.int32))
    return out


def synthetic_trace(context: int, topk: int, num_layers: int, steps: int, requests: int = 1,
                    overlap=None, queries_per_step: int = 1, accept: float = 1.0,
                    seed: int = 0, layers=None, static: float = DEFAULT_STATIC) -> Trace:
    """A whole trace following `overlap` per layer (default: `ess_overlap_profile`).
    `layers` restricts generation to some layer indices (others are not recorded)."""
    prof = ess_overlap_profile(num_layers) if overlap is None else np.asarray(overlap, float)
    if prof.shape != (num_layers,):
        raise ValueError(f"overlap has shape {prof.shape}: expected ({num_layers},)")
    layers = range(num_layers) if layers is None else layers
    sets = {}
    for r in range(requests):
        for l in layers:
            sets[(r, l)] = synthetic_layer(context, topk, steps, prof[l], queries_per_step,
                                           accept, seed * 1_000_003 + r * 1009 + l, static)
    meta = dict(source="synthetic", context=context, topk=topk, num_layers=num_layers,
                steps=steps, requests=requests, queries_per_step=queries_per_step,
                accept=accept, static=static, overlap=[float(v) for v in prof])
    return from_sets(sets, meta)


# ---------------------------------------------------------------- cache replay

POLICIES = ("lru", "fifo", "belady")
_NEVER = np.iinfo(np.int64).max


@dataclasses.dataclass
class ReplayStats:
    """Counts of one replay. Lookups/hits exclude the first `warmup` steps."""
    capacity: int
    policy: str
    lookups: int
    hits: int
    misses_per_step: np.ndarray

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else float("nan")


def _unique_in_order(ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids, np.int64)
    ids = ids[ids >= 0]
    _, first = np.unique(ids, return_index=True)
    return ids[np.sort(first)]


def _next_uses(steps: list[np.ndarray], size: int) -> list[np.ndarray]:
    """For each step's ids, the next step that uses each id again (_NEVER if none)."""
    nxt = np.full(size, _NEVER, np.int64)
    out = [None] * len(steps)
    for t in range(len(steps) - 1, -1, -1):
        out[t] = nxt[steps[t]].copy()
        nxt[steps[t]] = t
    return out


def replay(sets: list[np.ndarray], capacity: int, policy: str, warmup: int = 0) -> ReplayStats:
    """Replay one request's per-step id sets at one layer against a hot buffer.

    Semantics: step t needs U_t, the distinct ids >= 0 of its record, all at once. Each id
    of U_t is one lookup; it hits if resident when step t starts. Misses are inserted;
    when residents exceed `capacity`, victims are chosen among residents NOT in U_t (rows
    of the step being served are pinned), so capacity must be >= max |U_t|. Order:
    LRU evicts the smallest last-use key and FIFO the smallest insertion key, where a key
    is (step, position of the id in U_t); Belady (MIN) evicts the row whose next use is
    farthest (never = infinitely far), ties by LRU key. Belady is optimal for this
    set-at-once model (the usual exchange argument only swaps rows outside U_t)."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is invalid: allowed one of {POLICIES}")
    steps = [_unique_in_order(s) for s in sets]
    need = max((s.size for s in steps), default=0)
    if capacity < need:
        raise ValueError(f"capacity={capacity} is invalid: allowed >= the largest step set "
                         f"({need}); rows of the current step cannot be evicted")
    size = 1 + max((int(s.max()) for s in steps if s.size), default=0)
    width = need + 1
    resident = np.zeros(size, bool)
    key = np.full(size, -1, np.int64)
    nxt = np.full(size, _NEVER, np.int64)
    nexts = _next_uses(steps, size) if policy == "belady" else None
    cur = np.zeros(size, bool)
    count, lookups, hits, per_step = 0, 0, 0, []
    for t, u in enumerate(steps):
        hit = resident[u]
        miss = u[~hit]
        if t >= warmup:
            lookups, hits = lookups + u.size, hits + int(hit.sum())
            per_step.append(miss.size)
        over = count + miss.size - capacity
        if over > 0:
            cur[u] = True
            cand = np.flatnonzero(resident & ~cur)
            cur[u] = False
            if policy == "belady":
                order = np.lexsort((key[cand], -nxt[cand]))
                victims = cand[order[:over]]
            else:
                victims = cand[np.argpartition(key[cand], over - 1)[:over]]
            resident[victims] = False
            count -= over
        resident[miss] = True
        count += miss.size
        stamps = t * width + np.arange(u.size)
        if policy == "fifo":
            key[miss] = stamps[~hit]
        else:
            key[u] = stamps
        if nexts is not None:
            nxt[u] = nexts[t]
    return ReplayStats(capacity, policy, lookups, hits, np.array(per_step, np.int64))


def lru_stack_ranks(sets: list[np.ndarray], warmup: int = 0) -> tuple[np.ndarray, int]:
    """LRU stack distance of every lookup (rank of the id in recency order when its step
    starts; _NEVER if unseen). Under the `replay` semantics the LRU buffer after each step
    holds exactly the `capacity` most recent ids, so a lookup hits at capacity C iff its
    rank < C: one pass yields the miss curve for every capacity. Returns (ranks, steps)."""
    steps = [_unique_in_order(s) for s in sets]
    size = 1 + max((int(s.max()) for s in steps if s.size), default=0)
    width = max((s.size for s in steps), default=0) + 1
    key = np.full(size, -1, np.int64)
    ranks = []
    for t, u in enumerate(steps):
        if t >= warmup:
            seen = np.sort(key[key >= 0])
            k = key[u]
            r = seen.size - np.searchsorted(seen, k, side="right")
            ranks.append(np.where(k >= 0, r, _NEVER))
        key[u] = t * width + np.arange(u.size)
    return (np.concatenate(ranks) if ranks else np.zeros(0, np.int64)), len(ranks)


# ---------------------------------------------------------------- MTP union sizing

def union_ratios(tr: Trace, window: int = 1, topk: int | None = None,
                 queries_per_step: int | None = None, warmup: int = 0) -> dict:
    """How much the top-k sets of one step's s_q query tokens overlap: per record t, the
    distinct ids of records t..t+window-1 (same request and layer) over
    window × queries_per_step × topk, i.e. the union's share of top-k × s_q.

    Engine traces record s_q = 1 steps (`queries_per_step` 1): a window of s_q
    consecutive steps is what an MTP step with s_q query tokens reads when its drafts are
    accepted (the queries sit at consecutive positions). Synthetic MTP traces already
    record each step's union (`queries_per_step` = s_q, window 1). Empty records (layers
    that select nothing, e.g. an idle MTP layer) are skipped. Returns per-layer mean / p99
    / max and `mean_of_layer_max`, the hot rows per layer (× top-k × s_q) a buffer sized
    per layer to its largest union needs on average."""
    topk = int(tr.meta.get("topk", 0)) if topk is None else topk
    q = int(tr.meta.get("queries_per_step", 1)) if queries_per_step is None else queries_per_step
    if topk < 1 or window < 1 or q < 1:
        raise ValueError(f"topk={topk}, window={window}, queries_per_step={q} are invalid: "
                         "allowed positive integers (topk from the trace header by default)")
    per_layer: dict[int, list[float]] = {}
    for r, l in tr.keys():
        sets = [s[s >= 0] for s in tr.sets(r, l)][warmup:]
        for t in range(len(sets) - window + 1):
            win = sets[t:t + window]
            if any(s.size == 0 for s in win):
                continue
            per_layer.setdefault(l, []).append(
                np.unique(np.concatenate(win)).size / (window * q * topk))
    if not per_layer:
        raise ValueError(f"no window of {window} non-empty records in the trace")
    layers = {l: dict(mean=float(np.mean(v)), p99=float(np.percentile(v, 99)),
                      max=float(np.max(v)), n=len(v)) for l, v in sorted(per_layer.items())}
    return dict(window=window, queries_per_step=q, topk=topk, layers=layers,
                mean=float(np.mean(np.concatenate([np.array(v) for v in per_layer.values()]))),
                mean_of_layer_max=float(np.mean([d["max"] for d in layers.values()])),
                max=float(max(d["max"] for d in layers.values())))
