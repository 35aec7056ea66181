"""The design's three troubleshooting questions, answered from /metrics read over an
interval (behind `python -m jlco.diagnose`). Every number is a delta between the first
and the last reading (gauges: first / last / max and the least-squares slope over the
readings taken every second in between).

(a) Throughput does not go up with offload on.
    hit rate        jlco_cache_hits_total / jlco_cache_lookups_total over the interval.
                    Below HIT_RATE_LOW (0.80; vLLM's RFC reports 80-90 % with a 2 x top-k
                    buffer, ECHO 97-99 % with a large pool: docs/facts.md §4) the hot
                    buffer does not hold the working set and every step fetches the rest
                    → `cache.hot_buffer_rows` up (rows per request and layer; device
                    memory per slot grows with it), then `cache.eviction` (lru / fifo:
                    `tools/cache_study.py` replays a trace with both).
    fetch share     jlco_fetch_wait_seconds_sum / jlco_engine_step_seconds_sum. Only the
                    host-driven path (`cache.storage=file`, or `cache.fetch_path=
                    host_driven`) waits visibly; the in-jit path reports 0 and its fetch
                    is inside the step. Above FETCH_SHARE_HIGH (0.20) the step waits for
                    rows; which knob depends on why:
                      - hit rate low → misses: `cache.hot_buffer_rows`;
                      - achieved H2D (h2d bytes / fetch wait) ≥ LINK_BOUND (0.5) of the
                        hardware's host link (--hardware) → bytes: `cache.hot_buffer_rows`,
                        `cache.kv_format=fp8`, or a smaller batch;
                      - ≥ 2 x MIN_ROWS_PER_THREAD missed rows per layer and step (the
                        host-driven gather splits a fetch into parts of at least that
                        many rows) → host gather: `cache.prefetch_threads` up,
                        `cache.fetch_chunk_rows` (chunk rows: later chunks gather while
                        earlier ones transfer);
                      - else the wait is per-fetch overhead (the per-layer sync of the
                        host-driven path: selection must finish before the host knows
                        the misses), which threads and window do not shorten →
                        `cache.fetch_path=in_jit` where the storage allows (not "file").
    H2D             achieved GB/s during fetch waits and averaged over the interval,
                    against the --hardware profile's host link (jlco/planning/hardware.py).
    batch           requests waiting while every slot runs (jlco_requests_waiting > 0 in
                    any reading) → `engine.max_batch_size` up (the serve banner's
                    "largest batch with offload on" is what the device budget allows).
    drafts          MTP acceptance (accepted / drafted) below ACCEPT_LOW (0.5) →
                    `engine.num_draft_tokens` down (each draft costs verify compute and
                    top-k rows of hot buffer).
(b) Latency jitter.
    fetch wait p99 (from the histogram's bucket deltas, linearly interpolated) against
    the step p50: above JITTER_FETCH (0.5 x step p50) fetches make the slow steps → the
    fetch knob as in (a). Step p99 above JITTER_STEP (3 x step p50) with quiet fetches →
    `engine.prefill_chunk` (prompt chunks interleave with decode steps; smaller chunks,
    smoother ITL) or a host shared with other work.
(c) Memory growth.
    jlco_leaked_pages > 0 at the end → host pages owned by no running request (a
    lifecycle bug to report); jlco_orphans_swept_total going up → clients that went away
    were freed by the sweep (fine unless it keeps growing); process RSS growing faster
    than RSS_SLOPE_HIGH (1 MB/s) and by more than RSS_GROWTH (2 %) beyond what the host
    pool grew → memory outside the pool (new compiled shapes early in a server's life,
    else a leak); host pool above HOST_POOL_HIGH (0.9) of capacity → /health turns 503
    at serve.high_watermark and admissions wait: `engine.max_batch_size` or
    `engine.max_context_len` down, or more host memory.

No traffic during the interval (no engine step, no token) is said as such; `probe`
sends a small streamed load during the interval so the deltas are not zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

import numpy as np

from jlco.ops import loadgen
from jlco.ops.loadgen import LoadError, Scrape

HIT_RATE_LOW = 0.80
FETCH_SHARE_HIGH = 0.20
LINK_BOUND = 0.5
MIN_ROWS_PER_THREAD = 1024   # as jlco.offload.host_fetch's (that module imports jax)
ACCEPT_LOW = 0.5
JITTER_FETCH = 0.5
JITTER_STEP = 3.0
RSS_SLOPE_HIGH = 1e6
RSS_GROWTH = 0.02
HOST_POOL_HIGH = 0.9
SAMPLE_EVERY_S = 0.5


# ---- reading ----------------------------------------------------------------------------

async def observe(url: str, interval_s: float, *, api_key: str | None = None,
                  probe: loadgen.LoadSpec | None = None, timeout_s: float = 600.0) -> dict:
    """Readings over `interval_s` (and until the probe load, if any, is done) →
    {url, models, scrapes, probe}."""
    async with loadgen.client(url, (probe.num_clients if probe else 1), api_key,
                              timeout_s) as c:
        models = await loadgen.wait_ready(c, timeout_s)
        ctx = int(models["data"][0].get("max_model_len") or 0)
        if probe is not None:
            _fits(probe, ctx)
            if probe.warmup:   # the probe's shapes compile outside the interval
                rng = np.random.default_rng(probe.seed + 1)
                await asyncio.gather(*(loadgen.stream_one(c, loadgen.make_body(
                    ids, probe.max_tokens, 0), loadgen.Result())
                    for ids in loadgen.prompts(rng, probe.num_clients, probe.prompt_len)))
                await loadgen.wait_idle(c)
        async with loadgen.Scraper(c, min(SAMPLE_EVERY_S, interval_s / 4)) as scr:
            t_end = time.monotonic() + interval_s
            rep = None
            if probe is not None:
                rep, _ = await loadgen.run_load(c, dataclasses.replace(probe, warmup=False),
                                                ctx, "probe")
            await asyncio.sleep(max(0.0, t_end - time.monotonic()))
    return dict(url=url, models=models, scrapes=scr.scrapes,
                probe=None if rep is None else {k: v for k, v in rep.items() if k != "requests"})


def _fits(probe: loadgen.LoadSpec, ctx: int) -> None:
    if probe.prompt_len + probe.max_tokens > ctx:
        raise LoadError(f"--probe_prompt_len={probe.prompt_len} + --probe_max_tokens="
                        f"{probe.max_tokens} exceed the server's context ({ctx} tokens)")


def hist_quantile(b0: list, b1: list, q: float) -> float | None:
    """Quantile `q` of a histogram's observations between two readings (cumulative
    buckets [(le, count)]), linearly interpolated inside the bucket, as Prometheus'
    histogram_quantile; the largest finite bound when it falls in +Inf."""
    before = dict(b0)
    d = [(le, c - before.get(le, 0.0)) for le, c in b1]
    if not d or d[-1][1] <= 0:
        return None
    rank, prev_le, prev_c = q * d[-1][1], 0.0, 0.0
    for le, c in d:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c) if c > prev_c \
                else le
        prev_le, prev_c = le, c
    return prev_le


def _gauge(scrapes: list[Scrape], name: str) -> dict | None:
    pts = [(s.t - scrapes[0].t, s.get(name)) for s in scrapes if s.get(name) is not None]
    if not pts:
        return None
    ts, ys = zip(*pts)
    return dict(first=ys[0], last=ys[-1], max=max(ys), mean=float(np.mean(ys)),
                slope_per_s=loadgen.slope(ts, ys))


def measure(scrapes: list[Scrape]) -> dict:
    """The interval's numbers from its readings (the first and last for counters)."""
    s0, s1 = scrapes[0], scrapes[-1]
    dt = s1.t - s0.t

    def d(name: str) -> float:
        return s1.total(name) - s0.total(name)

    look0, look1 = (s.by_label("jlco_cache_lookups_total", "layer") for s in (s0, s1))
    layers = sum(1 for k, v in look1.items() if v - look0.get(k, 0.0) > 0)
    steps, step_s = d("jlco_engine_step_seconds_count"), d("jlco_engine_step_seconds_sum")
    lookups, hits, misses = (d(f"jlco_cache_{k}_total") for k in ("lookups", "hits", "misses"))
    wait_s, h2d = d("jlco_fetch_wait_seconds_sum"), d("jlco_h2d_bytes_total")
    q = {f"{name}_p{p}": hist_quantile(s0.buckets(f"jlco_{metric}_seconds"),
                                      s1.buckets(f"jlco_{metric}_seconds"), p / 100)
         for name, metric in (("step", "engine_step"), ("fetch_wait", "fetch_wait"))
         for p in (50, 99)}
    if wait_s <= 0:   # zero waits land in the first bucket: do not read 1 ms into them
        q["fetch_wait_p50"] = q["fetch_wait_p99"] = 0.0 if steps else None
    drafted = d("jlco_mtp_draft_tokens_total")
    prefetch = {k: d(f"jlco_prefetch_{k}_total") for k in (
        "rows_needed", "rows_hit", "rows_prefetched_used", "rows_prefetched_unused",
        "rows_on_demand")}
    return dict(
        interval_s=dt, readings=len(scrapes), offload=s1.has("jlco_cache_lookups_total"),
        steps=int(steps), step_s=step_s, step_mean_s=step_s / steps if steps else None,
        generated_tokens=d("jlco_generated_tokens_total"),
        prompt_tokens=d("jlco_prompt_tokens_total"),
        finished_requests=d("jlco_request_success_total"),
        tokens_per_s=d("jlco_generated_tokens_total") / dt if dt else None,
        lookups=lookups, hits=hits, misses=misses, active_layers=layers,
        hit_rate=hits / lookups if lookups else None,
        misses_per_layer_step=misses / (steps * layers) if steps and layers else None,
        fetch_wait_s=wait_s, fetch_share=wait_s / step_s if step_s else None,
        h2d_bytes=h2d, d2h_bytes=d("jlco_d2h_bytes_total"),
        h2d_gbps_waiting=h2d / wait_s / 1e9 if wait_s > 0 else None,
        h2d_gbps_interval=h2d / dt / 1e9 if dt else None,
        mtp_drafted=drafted, mtp_accepted=d("jlco_mtp_accepted_tokens_total"),
        mtp_acceptance=d("jlco_mtp_accepted_tokens_total") / drafted if drafted else None,
        orphans_swept=d("jlco_orphans_swept_total"), prefetch=prefetch,
        on_demand_share=(prefetch["rows_on_demand"] / prefetch["rows_needed"]
                         if prefetch["rows_needed"] else None), **q,
        gauges={name: _gauge(scrapes, name) for name in (
            "jlco_requests_running", "jlco_requests_waiting", "jlco_host_pool_bytes_used",
            "jlco_host_pool_bytes_capacity", "jlco_device_pool_bytes_used",
            "jlco_device_pool_bytes_capacity", "jlco_leaked_pages",
            "process_resident_memory_bytes")})


# ---- findings ---------------------------------------------------------------------------

def finding(question: str, severity: str, title: str, why: str, knobs=()) -> dict:
    """One answer: question (throughput / jitter / memory / traffic), severity (ok /
    info / warn / error), what was seen, why, and the knobs to turn."""
    return dict(question=question, severity=severity, title=title, why=why, knobs=list(knobs))


def fetch_cause(m: dict, link_gbps: float | None) -> tuple[str, list[str]]:
    """Why fetches take time, and the knobs for it (see the module docstring)."""
    rows = m["misses_per_layer_step"] or 0.0
    if m["hit_rate"] is not None and m["hit_rate"] < HIT_RATE_LOW:
        why = (f"the hot buffer keeps only {m['hit_rate']:.0%} of the selected rows; "
               f"{rows:.0f} rows per layer and step come from the host pool: raise "
               "cache.hot_buffer_rows (rows per request and layer) toward the working "
               "set; cache.eviction (lru/fifo) second")
        return why, ["cache.hot_buffer_rows", "cache.eviction"]
    gbps = m["h2d_gbps_waiting"]
    if link_gbps and gbps is not None and gbps >= LINK_BOUND * link_gbps:
        why = (f"fetches run at {gbps:.1f} GB/s, >= {LINK_BOUND:.0%} of the {link_gbps:g} "
               "GB/s host link: move fewer bytes (cache.hot_buffer_rows up, "
               "cache.kv_format=fp8) or decode a smaller batch")
        return why, ["cache.hot_buffer_rows", "cache.kv_format", "engine.max_batch_size"]
    if rows >= 2 * MIN_ROWS_PER_THREAD:
        why = (f"{rows:.0f} missed rows per layer and step: the host gather is the work; "
               f"more gather threads (cache.prefetch_threads; each takes >= "
               f"{MIN_ROWS_PER_THREAD} rows) and transfer chunks that overlap the gather "
               "(cache.fetch_chunk_rows)")
        return why, ["cache.prefetch_threads", "cache.fetch_chunk_rows"]
    why = (f"only {rows:.1f} missed rows per layer and step: the wait is per-fetch "
           "overhead (the host-driven path syncs once per layer: selection must finish "
           "before the host knows the misses), which threads and window do not shorten; "
           "cache.fetch_path=in_jit where the storage allows (not cache.storage=file)")
    return why, ["cache.fetch_path"]


def throughput(m: dict, link_gbps: float | None, hardware: str | None) -> list[dict]:
    out = []
    if not m["offload"]:
        return [finding("throughput", "info", "no offload counters: this server keeps the "
                        "latent cache on device", "hit rate, fetch wait and H2D apply to "
                        "offload servers only (--offload)")]
    hr = m["hit_rate"]
    if hr is not None and hr < HIT_RATE_LOW:
        out.append(finding("throughput", "warn", f"hot-buffer hit rate {hr:.1%} < "
                           f"{HIT_RATE_LOW:.0%}", fetch_cause(m, link_gbps)[0],
                           ["cache.hot_buffer_rows", "cache.eviction"]))
    share = m["fetch_share"]
    if share is not None and share > FETCH_SHARE_HIGH:
        why, knobs = fetch_cause(m, link_gbps)
        if out:   # the hit rate above is the cause: say so once
            why = (f"steps waited {m['fetch_wait_s']:.3f} s of {m['step_s']:.3f} s for "
                   f"{m['misses_per_layer_step'] or 0:.0f} missed rows per layer and step: "
                   "the misses above")
        out.append(finding("throughput", "warn", f"fetch wait is {share:.0%} of step time "
                           f"(> {FETCH_SHARE_HIGH:.0%})", why, knobs))
    elif m["fetch_wait_s"] == 0 and m["steps"]:
        out.append(finding("throughput", "info", "fetch wait not separable: 0 s observed",
                           "the in-jit fetch path moves rows inside the step (its cost is in "
                           "the step time); judge it by the hit rate and H2D bytes"))
    pf = m.get("prefetch") or {}
    if pf.get("rows_needed"):
        loaded = pf["rows_prefetched_used"] + pf["rows_prefetched_unused"]
        out.append(finding(
            "throughput", "info", f"{m['on_demand_share']:.1%} of the rows attention read "
            "were fetched on demand (the critical path)",
            f"of {pf['rows_needed']:.0f} rows read: {pf['rows_hit']:.0f} resident from an "
            f"earlier step, {pf['rows_prefetched_used']:.0f} loaded ahead of need (admission "
            f"warm-up), {pf['rows_on_demand']:.0f} fetched when needed; of the rows loaded "
            f"ahead, {pf['rows_prefetched_unused']:.0f} of {loaded:.0f} went unread"
            + (" (the prefetch's accuracy)" if loaded else "")))
    gbps = m["h2d_gbps_waiting"] or m["h2d_gbps_interval"]
    if link_gbps and gbps is not None:
        sev = "warn" if gbps >= LINK_BOUND * link_gbps else "info"
        out.append(finding("throughput", sev, f"H2D {gbps:.3g} GB/s = {gbps / link_gbps:.1%} "
                           f"of {hardware}'s {link_gbps:g} GB/s host link",
                           "at or above half the link, bytes limit the step: fewer misses or "
                           "smaller rows" if sev == "warn" else "the link is not the limit",
                           ["cache.hot_buffer_rows", "cache.kv_format"] if sev == "warn" else ()))
    return out + _batch_and_drafts(m)


def _batch_and_drafts(m: dict) -> list[dict]:
    out = []
    waiting = m["gauges"]["jlco_requests_waiting"]
    if waiting and waiting["max"] > 0:
        running = m["gauges"]["jlco_requests_running"]
        out.append(finding("throughput", "warn", f"requests queued (up to {waiting['max']:g}) "
                           f"while {running['max'] if running else '?':g} ran",
                           "every slot is busy: a larger batch serves them (with offload the "
                           "serve banner's 'largest batch with offload on' is what the "
                           "device budget allows)", ["engine.max_batch_size"]))
    acc = m["mtp_acceptance"]
    if acc is not None and acc < ACCEPT_LOW:
        out.append(finding("throughput", "warn", f"MTP acceptance {acc:.0%} < {ACCEPT_LOW:.0%}",
                           "most drafts are rejected, yet each costs verify compute and top-k "
                           "rows of hot buffer", ["engine.num_draft_tokens"]))
    return out


def jitter(m: dict, link_gbps: float | None) -> list[dict]:
    f99, s50, s99 = m["fetch_wait_p99"], m["step_p50"], m["step_p99"]
    if not s50:
        return []
    out = []
    if f99 is not None and f99 > JITTER_FETCH * s50:
        why, knobs = fetch_cause(m, link_gbps)
        if m["steps"] < 100:
            why += (f" (only {m['steps']} steps: the p99 is about the slowest one, and a "
                    "first fetch of a new size compiling looks the same; a longer "
                    "--interval_s tells them apart)")
        out.append(finding("jitter", "warn", f"fetch wait p99 {f99 * 1e3:.1f} ms > "
                           f"{JITTER_FETCH:g} x step p50 {s50 * 1e3:.1f} ms",
                           "slow steps are fetch waits: " + why, knobs))
    elif s99 is not None and s99 > JITTER_STEP * s50:
        out.append(finding("jitter", "warn", f"step p99 {s99 * 1e3:.1f} ms > {JITTER_STEP:g} x "
                           f"step p50 {s50 * 1e3:.1f} ms, fetches quiet",
                           "prompt chunks interleave with decode steps (a smaller "
                           "engine.prefill_chunk smooths ITL), or the host is shared "
                           "(new shapes compiling early in a server's life look the same)",
                           ["engine.prefill_chunk"]))
    else:
        out.append(finding("jitter", "ok", f"step p99 {_ms(s99)} vs p50 {_ms(s50)}, fetch wait "
                           f"p99 {_ms(f99)}", "within the thresholds"))
    return out


def memory(m: dict) -> list[dict]:
    g, out = m["gauges"], []
    leaked = (g["jlco_leaked_pages"] or {}).get("last")
    if leaked:
        out.append(finding("memory", "error", f"{leaked:g} leaked host pages at the end",
                           "pages owned by no running request: a lifecycle bug (the sweep "
                           "frees orphans; what stays is a leak): report it with /metrics"))
    if m["orphans_swept"] > 0:
        out.append(finding("memory", "info", f"{m['orphans_swept']:g} orphaned requests swept",
                           "clients went away mid-request and the sweep freed them; fine "
                           "unless it keeps growing"))
    rss, pool = g["process_resident_memory_bytes"], g["jlco_host_pool_bytes_used"]
    if rss and rss["slope_per_s"] is not None:
        grew = rss["last"] - rss["first"] - (pool["last"] - pool["first"] if pool else 0.0)
        if rss["slope_per_s"] > RSS_SLOPE_HIGH and grew > RSS_GROWTH * rss["first"]:
            out.append(finding("memory", "warn", f"process RSS grows {rss['slope_per_s'] / 1e6:.1f} "
                               f"MB/s ({grew / 1e6:.0f} MB beyond the host pool)",
                               "memory outside the host pool: compiles of new shapes early in "
                               "a server's life, else a leak; rerun with a longer --interval_s "
                               "under steady load"))
    cap = (g["jlco_host_pool_bytes_capacity"] or {}).get("last")
    if pool and cap and pool["max"] > HOST_POOL_HIGH * cap:
        out.append(finding("memory", "warn", f"host pool {pool['max'] / cap:.0%} full",
                           "/health turns 503 above serve.high_watermark and admissions wait",
                           ["engine.max_batch_size", "engine.max_context_len"]))
    if not out:
        out.append(finding("memory", "ok", "no leaked pages, no growth beyond the thresholds",
                           f"RSS slope {_mb(rss and rss['slope_per_s'])}/s, host pool slope "
                           f"{_mb(pool and pool['slope_per_s'])}/s"))
    return out


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def _mb(v) -> str:
    return "-" if v is None else f"{v / 1e6:.2f} MB"


def diagnose(obs: dict, link_gbps: float | None = None, hardware: str | None = None) -> dict:
    """The report: measurements and findings (traffic first when there was none)."""
    m = measure(obs["scrapes"])
    found = []
    if not m["steps"] and not m["generated_tokens"]:
        found.append(finding("traffic", "info", f"no traffic during the {m['interval_s']:.1f} s "
                             "interval: no engine step, no token",
                             "throughput and jitter need load: rerun while clients send "
                             "requests, or with --probe_requests N"))
    else:
        found += throughput(m, link_gbps, hardware) + jitter(m, link_gbps)
    found += memory(m)
    return dict(url=obs["url"], model=obs["models"]["data"][0]["id"], hardware=hardware,
                host_link_gbps=link_gbps, probe=obs["probe"], measurements=m,
                findings=found, knobs=sorted({k for f in found for k in f["knobs"]}))


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _g(v, fmt="{:.3g}") -> str:
    return "-" if v is None else fmt.format(v)


def text(rep: dict) -> str:
    """The readable report: the numbers per question, then the findings."""
    m, g, probe = rep["measurements"], rep["measurements"]["gauges"], rep["probe"]
    head = (f"jlco.diagnose: {rep['model']} at {rep['url']}, {m['interval_s']:.1f} s "
            f"interval, {m['readings']} readings")
    if probe:
        head += f" (probe: {probe['completed']}/{probe['num_requests']} requests)"
    link = (f"; host link {rep['host_link_gbps']:g} GB/s ({rep['hardware']})"
            if rep["host_link_gbps"] else "")
    lines = [head,
             (f"traffic: {m['generated_tokens']:g} tokens ({_g(m['tokens_per_s'], '{:.1f}')} "
              f"tok/s), {m['steps']} engine steps (mean {_ms(m['step_mean_s'])}, p50 "
              f"{_ms(m['step_p50'])}, p99 {_ms(m['step_p99'])}), "
              f"{m['finished_requests']:g} requests finished"),
             "(a) throughput",
             (f"  hit rate          {_pct(m['hit_rate'])} ({m['lookups']:g} lookups, "
              f"{m['misses']:g} misses: {_g(m['misses_per_layer_step'], '{:.1f}')} rows per "
              "layer and step)"),
             (f"  fetch wait share  {_pct(m['fetch_share'])} ({m['fetch_wait_s']:.3f} s of "
              f"{m['step_s']:.3f} s step time)"),
             (f"  H2D               {_g(m['h2d_gbps_waiting'])} GB/s while waiting, "
              f"{_g(m['h2d_gbps_interval'])} GB/s over the interval "
              f"({m['h2d_bytes'] / 1e6:.2f} MB){link}"),
             "(b) latency jitter",
             (f"  fetch wait p99 {_ms(m['fetch_wait_p99'])}, step p50 {_ms(m['step_p50'])}, "
              f"step p99 {_ms(m['step_p99'])}"),
             "(c) memory growth"]
    for name, key, scale in (("process RSS MB", "process_resident_memory_bytes", 1e-6),
                             ("host pool used MB", "jlco_host_pool_bytes_used", 1e-6),
                             ("device pool used MB", "jlco_device_pool_bytes_used", 1e-6),
                             ("leaked pages", "jlco_leaked_pages", 1),
                             ("running", "jlco_requests_running", 1),
                             ("waiting", "jlco_requests_waiting", 1)):
        v = g.get(key)
        if v:
            s = v["slope_per_s"]
            lines.append(f"  {name:<20} {v['first'] * scale:.4g} -> {v['last'] * scale:.4g} "
                         f"(max {v['max'] * scale:.4g}, slope "
                         f"{_g(None if s is None else s * scale)}/s)")
    lines.append(f"  orphans swept        +{m['orphans_swept']:g}")
    lines.append("findings:")
    for f in rep["findings"]:
        lines.append(f"  {f['severity'].upper():<5} [{f['question']}] {f['title']}")
        lines.append(f"        why: {f['why']}")
        if f["knobs"]:
            lines.append(f"        knobs: {', '.join(f['knobs'])}")
    return "\n".join(lines)
