"""Prometheus metrics of one server (`GET /metrics`), vLLM's names with a `jlco_` prefix.

Request latencies are histograms observed by the handlers as tokens reach them;
engine-side values (queue lengths, offload counters, pool usage, speculative counts,
the prefix cache) are read from the engine at scrape time by a collector, so a scrape
always sees one consistent set: `jlco_cache_hits_total + misses ==
jlco_cache_lookups_total` per layer, `jlco_prefix_cache_hits_total <= queries`.
`jlco_request_success{finished_reason}` counts every queued request once when it ends
(stop, length, abort: the client left or the drain's grace ran out, error).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class ServerMetrics:
    """The registry and the handler-side instruments."""

    def __init__(self, state):
        """state: the server's `ServerState` (its `engine` may be None while loading)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("jlco_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=r)
        self.generated_tokens = Counter("jlco_generated_tokens", "Tokens generated", registry=r)
        self.requests = Counter("jlco_request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("jlco_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jlco_inter_token_latency_seconds", "Between tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jlco_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("jlco_request_queue_time_seconds",
                                    "Arrival to admission (prefill start)",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("jlco_engine_step_seconds", "Wall time of an engine step",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.fetch_wait = Histogram("jlco_fetch_wait_seconds",
                                    "Time an engine step waited for latent rows from the host "
                                    "pool (host-driven fetch path; the in-jit path's fetches "
                                    "are inside the step and not separable)",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self._wait_seen = 0.0
        ProcessCollector(registry=r)    # process_resident_memory_bytes etc.
        r.register(_EngineCollector(state))

    def observe_step(self, engine, seconds: float) -> None:
        """After each engine step (engine thread): step time and the step's fetch wait."""
        self.step_time.observe(seconds)
        m = engine.metrics
        if m is not None:
            total = m.total_fetch_wait_s()
            self.fetch_wait.observe(max(0.0, total - self._wait_seen))
            self._wait_seen = total


class _EngineCollector:
    """Engine state at scrape time, read from the asyncio thread: admission through the
    engine's `admission_status()` (counts copied out of the scheduler), the offload
    counters as one snapshot."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        eng = self.state.engine
        running = GaugeMetricFamily("jlco_requests_running", "Requests in batch slots")
        waiting = GaugeMetricFamily("jlco_requests_waiting", "Requests queued for admission")
        if eng is None:
            yield from (running, waiting)
            return
        status = eng.admission_status()
        running.add_metric([], status.running)
        waiting.add_metric([], status.waiting)
        yield from (running, waiting)
        yield from _rank_metrics(status)
        m = eng.metrics
        if m is not None:
            lookups = CounterMetricFamily("jlco_cache_lookups", "Hot-buffer lookups (rows)",
                                          labels=["layer"])
            hits = CounterMetricFamily("jlco_cache_hits", "Hot-buffer hits (rows)",
                                       labels=["layer"])
            misses = CounterMetricFamily("jlco_cache_misses", "Hot-buffer misses (rows "
                                         "fetched from the host pool)", labels=["layer"])
            snap = m.snapshot()    # one consistent copy (taken under the metrics' lock)
            per, tot = snap["per_layer"], snap["total"]
            for layer, (n, h, x) in enumerate(zip(per["lookups"], per["hits"], per["misses"])):
                lookups.add_metric([str(layer)], n)
                hits.add_metric([str(layer)], h)
                misses.add_metric([str(layer)], x)
            yield lookups
            yield hits
            yield misses
            yield from _prefetch_metrics(m.health())
            yield CounterMetricFamily("jlco_h2d_bytes", "Host-to-device latent bytes",
                                      value=tot["h2d_bytes"])
            yield CounterMetricFamily("jlco_d2h_bytes", "Device-to-host latent bytes",
                                      value=tot["d2h_bytes"])
        pool = status.host_pool
        if pool is not None:
            row = eng.cfg.row_bytes * _cache_layers(eng.cfg)
            page_bytes = pool.page_size * row
            yield GaugeMetricFamily("jlco_host_pool_bytes_used", "Host pool bytes reserved",
                                    value=pool.used_pages * page_bytes)
            yield GaugeMetricFamily("jlco_host_pool_bytes_capacity", "Host pool bytes",
                                    value=pool.num_pages * page_bytes)
            yield GaugeMetricFamily("jlco_leaked_pages", "Host pages owned by no running "
                                    "request (should stay 0)", value=pool.leaked_pages)
            cfg = eng.cfg
            slot_bytes = cfg.hot_buffer_rows * cfg.row_bytes * _cache_layers(cfg)
            yield GaugeMetricFamily("jlco_device_pool_bytes_used", "Hot-buffer bytes of the "
                                    "slots in use", value=status.running * slot_bytes)
            yield GaugeMetricFamily("jlco_device_pool_bytes_capacity", "Hot-buffer bytes",
                                    value=status.slots * slot_bytes)
        yield CounterMetricFamily("jlco_orphans_swept", "Orphaned requests freed by the "
                                  "lifecycle sweep", value=getattr(eng, "orphans_swept", 0))
        yield from _prefix_metrics(self.state.loop)
        yield from _process_metrics(self.state)
        spec = eng.spec_metrics
        if spec is not None:
            yield CounterMetricFamily("jlco_mtp_draft_tokens", "Draft tokens proposed",
                                      value=spec.drafted)
            yield CounterMetricFamily("jlco_mtp_accepted_tokens", "Draft tokens accepted",
                                      value=spec.accepted)


def _prefix_metrics(loop):
    """The prefix cache's counters (vLLM's prefix_cache_queries / _hits, in prompt
    tokens) and its size; nothing with cache.prefix_cache off. Read from the copy the
    engine thread leaves after each step (`EngineLoop.prefix_stats`): the cache itself
    changes under that thread, and one copy keeps hits <= queries within a scrape."""
    stats = None if loop is None else loop.prefix_stats
    if stats is None:
        return
    yield CounterMetricFamily("jlco_prefix_cache_queries", "Prompt tokens looked up in the "
                              "prefix cache", value=stats["queries"])
    yield CounterMetricFamily("jlco_prefix_cache_hits", "Prompt tokens the prefix cache gave "
                              "(not prefilled)", value=stats["hits"])
    yield GaugeMetricFamily("jlco_prefix_cache_pages", "Pages in the prefix cache",
                            value=stats["pages"])
    yield GaugeMetricFamily("jlco_prefix_cache_bytes", "Host bytes of the prefix cache",
                            value=stats["bytes"])


def _prefetch_metrics(health: dict):
    """The prefetch scheduler's health per layer (`OffloadMetrics.health`):
    jlco_prefetch_rows_needed = _hit + _prefetched_used + _on_demand, the seconds
    steps waited on fetches, and the layer-ahead prediction's rows and right ones."""
    per = health["per_layer"]
    families = (
        (CounterMetricFamily("jlco_prefetch_rows_needed", "Latent rows attention read",
                             labels=["layer"]), "rows_needed"),
        (CounterMetricFamily("jlco_prefetch_rows_hit", "Rows read from the hot buffer, "
                             "resident from an earlier step", labels=["layer"]), "rows_hit"),
        (CounterMetricFamily("jlco_prefetch_rows_prefetched_used", "Rows loaded ahead of "
                             "need (admission warm-up), then read", labels=["layer"]),
         "rows_prefetched_used"),
        (CounterMetricFamily("jlco_prefetch_rows_prefetched_unused", "Rows loaded ahead of "
                             "need, evicted or left unread", labels=["layer"]),
         "rows_prefetched_unused"),
        (CounterMetricFamily("jlco_prefetch_rows_on_demand", "Rows fetched by the step that "
                             "read them (the critical path)", labels=["layer"]),
         "rows_on_demand"),
        (CounterMetricFamily("jlco_prefetch_fetch_wait_seconds", "Seconds steps waited on "
                             "fetches (host-driven path)", labels=["layer"]), "fetch_wait_s"),
        (CounterMetricFamily("jlco_prefetch_rows_predicted", "Rows the layer-ahead "
                             "prediction chose (cache.prefetch_ahead)", labels=["layer"]),
         "rows_predicted"),
        (CounterMetricFamily("jlco_prefetch_rows_predicted_correct", "Predicted rows the "
                             "layer's real top-k then read", labels=["layer"]),
         "rows_predicted_correct"))
    for fam, key in families:
        for layer, v in enumerate(per[key]):
            fam.add_metric([str(layer)], v)
        yield fam


def _process_metrics(state):
    """Several processes in lockstep: each one's step count and last step time, its
    host-pool bytes (the rows of its own data ranks) and resident memory, and the age
    of its last heartbeat; process 0's from here, the others' from their beats."""
    job = state.job
    if job is None:
        return
    from jlco.server.lockstep import local_host_pool_bytes, rss_bytes
    loop, eng = state.loop, state.engine
    steps = CounterMetricFamily("jlco_process_steps", "Engine steps run by a process",
                                labels=["process"])
    last = GaugeMetricFamily("jlco_process_step_seconds", "Wall time of a process's last "
                             "engine step", labels=["process"])
    pool = GaugeMetricFamily("jlco_process_host_pool_bytes", "Host-pool bytes in use by the "
                             "data ranks a process holds", labels=["process"])
    rss = GaugeMetricFamily("jlco_process_resident_bytes", "Resident memory of a process",
                            labels=["process"])
    age = GaugeMetricFamily("jlco_process_heartbeat_age_seconds", "Seconds since a "
                            "process's last heartbeat (0 for process 0)", labels=["process"])
    if loop is not None and eng is not None:
        steps.add_metric(["0"], loop.steps)
        last.add_metric(["0"], loop.last_step_s)
        pool.add_metric(["0"], local_host_pool_bytes(eng, loop.mesh))
    rss.add_metric(["0"], rss_bytes())
    age.add_metric(["0"], 0.0)
    for p, info in sorted(job.processes().items()):
        if "steps" in info:
            steps.add_metric([str(p)], info["steps"])
            last.add_metric([str(p)], info["last_step_s"])
            pool.add_metric([str(p)], info["host_pool_bytes"])
            rss.add_metric([str(p)], info["rss_bytes"])
        age.add_metric([str(p)], info["age_s"])
    yield from (steps, last, pool, rss, age)


def _rank_metrics(status):
    """Per data rank (`jlco.parallel.data`; one rank without it): running requests,
    requests pinned to it so far, and the fraction of its host pool in use."""
    running = GaugeMetricFamily("jlco_data_rank_requests_running",
                                "Requests in the batch slots of a data rank", labels=["rank"])
    admitted = CounterMetricFamily("jlco_data_rank_requests_admitted",
                                   "Requests pinned to a data rank at admission",
                                   labels=["rank"])
    pool = GaugeMetricFamily("jlco_data_rank_host_pool_usage",
                             "Fraction of a data rank's host pool pages in use", labels=["rank"])
    for rank, r in enumerate(status.ranks):
        running.add_metric([str(rank)], r.running)
        admitted.add_metric([str(rank)], r.admitted)
        if r.host_usage is not None:
            pool.add_metric([str(rank)], r.host_usage)
    yield from (running, admitted)
    if status.host_pool is not None:
        yield pool


def _cache_layers(cfg) -> int:
    from jlco.model.kv_cache import cache_layers
    return cache_layers(cfg)
