"""Serving benchmark: concurrent streaming clients against `python -m jlco.serve`.

Each request is a POST /v1/completions with `"stream": true` (SSE), a prompt of random
token ids (0..249, seeded: valid for the byte-level random model) and `ignore_eos`, so
every request generates exactly its max_tokens. Per request, as the client sees it:
TTFT (send -> first chunk carrying tokens), ITL (gaps between token-bearing chunks; a
chunk of k tokens counts k gaps of gap/k), TPOT ((e2e - TTFT) / (tokens - 1)) and e2e
(send -> end of stream); aggregated as p50/p99, output tokens/s, requests/s and errors.
The server's mean engine step time over the run (`jlco_engine_step_seconds` from
/metrics) is reported beside them.

Scenarios (--scenario):
  load         --num_requests requests from --num_clients concurrent clients; with a
               finite --request_rate they arrive as a Poisson process (--seed), at most
               --num_clients in flight.
  long_prompt  --num_clients streams decode (long --max_tokens); their ITL is measured
               over a quiet window (--quiet_s), then one prompt of --long_prompt_len
               tokens is sent (--long_prompts times, one after another) and the streams'
               ITL during its prefill (its send -> its first token) is compared with the
               quiet ITL, beside the engine step time in both windows: the engine runs
               at most engine.prefill_chunk prompt tokens per step, so the increase should
               be about one chunk's prefill time, whatever the prompt's length.

Servers: --url talks to a running one; --config [--checkpoint] [--override ...] starts
one here (`--port 0`, ready on its `ready: http://HOST:PORT/v1` line, stopped with
SIGTERM); --compare_offload starts two in turn (never at once: they would share the
CPU), same config and device budget, --offload and --nooffload, and reports both side by
side with the ratio offload on / off. Both run at the config's engine.max_batch_size
unless --batch_from_budget, which restarts each at the largest batch its banner's device
budget allows (offload on fits more requests in the same budget).

  python tools/bench_serve.py --url http://127.0.0.1:8000 --num_clients 8
  python tools/bench_serve.py --config configs/tiny.py --compare_offload \\
      --num_clients 8 --num_requests 32 --prompt_len 200 --max_tokens 32
  python tools/bench_serve.py --config configs/tiny.py --compare_offload \\
      --batch_from_budget --num_clients 16 --num_requests 64 --max_tokens 32
  python tools/bench_serve.py --config configs/tiny.py --offload --scenario long_prompt \\
      --override engine.max_batch_size=8 --override engine.max_context_len=2048 \\
      --num_clients 4 --prompt_len 20 --quiet_s 1 --long_prompt_len 400

Results go to --out (a directory, default out/ in the repository): bench_serve.json,
bench_serve.png and each started server's stderr (server_offload_on.log, ...); the table
goes to stdout (--json: the JSON on stdout, the table on stderr). A local server shares
the machine with the client: on a small CPU box the client's event loop competes with
the engine for cores. The client, timing and server-starting code is
jlco/ops/loadgen.py (shared with `python -m jlco.validate` and `jlco.diagnose`).
"""

from __future__ import annotations

import asyncio
import logging as pylog
import math
import pathlib
import sys
import time

import numpy as np
from absl import flags, logging

from jlco.ops import loadgen
from jlco.ops.loadgen import (  # Result etc. are this tool's API too
    LoadSpec,
    Result,
    hist_delta,
    normalize_url,
    prompts,
    resolve_config,
    scrape,
    stats,
    stream_one,
    wait_ready,
)
from jlco.util import atomic, cli

REPO = pathlib.Path(__file__).resolve().parents[1]
PROG = "bench_serve"
FLAGS = flags.FLAGS
SCENARIO_MAX_TOKENS = {"load": 32}   # long_prompt: what fits the context
BenchError = loadgen.LoadError


def define_flags() -> None:
    """Flags exist only when this runs as a program (importing tools side by side must
    not collide)."""
    flags.DEFINE_string("url", None, "a running server, http://HOST:PORT (a /v1 suffix is "
                        "dropped); instead of --config")
    flags.DEFINE_string("config", None, "start servers here with this config (a relative "
                        "path not found from the current directory is looked up in the "
                        "repository)")
    flags.DEFINE_string("checkpoint", None, "checkpoint directory for the started servers "
                        "(none: the random-weight model)")
    flags.DEFINE_multi_string("override", [], "section.field=value for the started servers, "
                              "e.g. engine.max_batch_size=8; repeatable")
    flags.DEFINE_bool("offload", None, "started server: --offload / --nooffload (default: "
                      "the config's)")
    flags.DEFINE_bool("compare_offload", False, "start two servers in turn, offload on and "
                      "off, same config and device budget; report both and the ratio")
    flags.DEFINE_float("device_budget_gb", None, "device budget the started servers plan "
                       "for (their banner; default: the server's own)")
    flags.DEFINE_bool("batch_from_budget", False, "run each started server at the largest "
                      "batch its banner's device budget allows (offload on fits more), "
                      "not the config's engine.max_batch_size")
    flags.DEFINE_float("server_timeout_s", 900.0, "seconds a server gets to become ready")
    flags.DEFINE_enum("scenario", "load", ["load", "long_prompt"], "what to measure (see "
                      "the module docstring)")
    flags.DEFINE_integer("num_clients", 8, "concurrent streams (long_prompt: decoding "
                         "streams besides the long prompt)")
    flags.DEFINE_integer("num_requests", 32, "requests in the load scenario")
    flags.DEFINE_integer("prompt_len", 200, "prompt tokens per request")
    flags.DEFINE_integer("max_tokens", 0, "tokens per request (0: load 32; long_prompt: as "
                         "many as fit the context)")
    flags.DEFINE_float("request_rate", float("inf"), "requests/s, Poisson arrivals (inf: "
                       "all at once)")
    flags.DEFINE_integer("seed", 0, "prompts, arrivals and sampling seed")
    flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy)")
    flags.DEFINE_string("api_key", None, "sent as 'Authorization: Bearer KEY' (and given to "
                        "started servers)")
    flags.DEFINE_bool("warmup", True, "first send untimed requests of the same shapes "
                      "(compiles outside the measurement)")
    flags.DEFINE_integer("long_prompt_len", 1024, "long_prompt: tokens of the long prompt")
    flags.DEFINE_integer("long_prompts", 3, "long_prompt: long prompts sent one after "
                         "another (their windows pooled)")
    flags.DEFINE_float("quiet_s", 2.0, "long_prompt: quiet window before the long prompts")
    flags.DEFINE_float("request_timeout_s", 600.0, "per-request HTTP timeout")
    flags.DEFINE_string("out", None, "output directory (default: out/ in the repository)")
    flags.DEFINE_bool("json", False, "print the JSON report on stdout (the table goes to "
                      "stderr)")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- flags ------------------------------------------------------------------------------

def check_flags() -> pathlib.Path:
    """Every flag checked before a server starts; returns the output directory."""
    for name, low in (("num_clients", 1), ("num_requests", 1), ("prompt_len", 1),
                      ("max_tokens", 0), ("long_prompt_len", 1), ("long_prompts", 1),
                      ("seed", 0)):
        if getattr(FLAGS, name) < low:
            raise ValueError(f"--{name}={getattr(FLAGS, name)}: allowed an integer >= {low}")
    for name in ("request_rate", "quiet_s", "server_timeout_s", "request_timeout_s"):
        v = getattr(FLAGS, name)
        if not v > 0 or math.isnan(v):
            raise ValueError(f"--{name}={v}: allowed a number > 0")
    if not 0.0 <= FLAGS.temperature <= 100.0:
        raise ValueError(f"--temperature={FLAGS.temperature}: allowed 0..100 (0 = greedy)")
    if FLAGS.device_budget_gb is not None and FLAGS.device_budget_gb <= 0:
        raise ValueError(f"--device_budget_gb={FLAGS.device_budget_gb}: allowed a number > 0")
    starts = [n for n in ("config", "checkpoint", "offload", "device_budget_gb")
              if FLAGS[n].value is not None] + [n for n in ("override", "compare_offload",
                                                            "batch_from_budget")
                                                if FLAGS[n].value]
    if FLAGS.url is not None:
        normalize_url(FLAGS.url)
        if starts:
            raise ValueError(f"--url talks to a running server, --{starts[0]} starts one: "
                             "give one or the other")
    elif FLAGS.config is None and FLAGS.checkpoint is None:
        raise ValueError("give --url (a running server) or --config (start servers here)")
    if FLAGS.compare_offload and FLAGS.offload is not None:
        raise ValueError("--compare_offload runs --offload and --nooffload: drop --offload")
    if FLAGS.config is not None and not resolve_config(FLAGS.config).is_file():
        raise ValueError(f"--config={FLAGS.config}: no such file")
    out = pathlib.Path(FLAGS.out).expanduser() if FLAGS.out else REPO / "out"
    if out.suffix == ".json":
        raise ValueError(f"--out={FLAGS.out}: takes a directory (the JSON and PNG are written "
                         "into it)")
    atomic.check_writable(out / "bench_serve.json", "--out")
    out.mkdir(parents=True, exist_ok=True)
    return out


# ---- client glue (the measuring code is jlco/ops/loadgen.py) --------------------------

def server_args(offload: bool | None, batch: int | None = None,
                budget_gb: str | None = None) -> list[str]:
    return loadgen.serve_args(config=FLAGS.config, checkpoint=FLAGS.checkpoint,
                              overrides=FLAGS.override, offload=offload, batch=batch,
                              budget_gb=budget_gb or FLAGS.device_budget_gb,
                              api_key=FLAGS.api_key)


def make_body(ids: list[int], max_tokens: int, seed: int) -> dict:
    return loadgen.make_body(ids, max_tokens, seed, FLAGS.temperature)


def _client(url: str, n: int):
    return loadgen.client(url, n, FLAGS.api_key, FLAGS.request_timeout_s)


# ---- scenarios --------------------------------------------------------------------------

async def run_load(client, ctx: int, desc: str) -> tuple[dict, dict]:
    """--num_requests from --num_clients clients → (report, raw lists for the plot)."""
    spec = LoadSpec(num_requests=FLAGS.num_requests, num_clients=FLAGS.num_clients,
                    prompt_len=FLAGS.prompt_len,
                    max_tokens=FLAGS.max_tokens or SCENARIO_MAX_TOKENS["load"],
                    request_rate=FLAGS.request_rate, seed=FLAGS.seed,
                    temperature=FLAGS.temperature, warmup=FLAGS.warmup)
    return await loadgen.run_load(client, spec, ctx, desc)


async def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise BenchError(f"{what} after {timeout:g} s", cli.FAILURE_EXIT)
        await asyncio.sleep(0.005)


async def _long_warmup(client, rng: np.random.Generator) -> None:
    """Streams and one long prompt at once, untimed (their shapes compile here)."""
    jobs = [stream_one(client, make_body(p, 4, 0), Result())
            for p in prompts(rng, FLAGS.num_clients, FLAGS.prompt_len)]
    jobs.append(stream_one(client, make_body(prompts(rng, 1, FLAGS.long_prompt_len)[0], 1, 0),
                           Result()))
    await asyncio.gather(*jobs)


async def run_long_prompt(client, ctx: int) -> tuple[dict, dict]:
    """Decoding streams: quiet ITL, then ITL while each long prompt prefills."""
    max_tokens = FLAGS.max_tokens or ctx - FLAGS.prompt_len
    if FLAGS.prompt_len + max_tokens > ctx or FLAGS.long_prompt_len + 1 > ctx:
        raise BenchError(f"--prompt_len={FLAGS.prompt_len} + max tokens {max_tokens} or "
                         f"--long_prompt_len={FLAGS.long_prompt_len} + 1 exceed the server's "
                         f"context ({ctx} tokens)")
    rng = np.random.default_rng(FLAGS.seed)
    if FLAGS.warmup:
        await _long_warmup(client, rng)
    running = [Result() for _ in range(FLAGS.num_clients)]
    tasks = [asyncio.create_task(stream_one(client, make_body(p, max_tokens, FLAGS.seed + i),
                                            running[i]))
             for i, p in enumerate(prompts(rng, FLAGS.num_clients, FLAGS.prompt_len))]
    try:
        await _until(lambda: all(r.chunk_t or r.error for r in running),
                     FLAGS.request_timeout_s, "the streams got no first token")
        if any(r.error for r in running):
            raise BenchError(f"a stream failed: {next(r.error for r in running if r.error)}",
                             cli.FAILURE_EXIT)
        t_q0, m_q0 = time.perf_counter(), await scrape(client)
        await asyncio.sleep(FLAGS.quiet_s)
        t_q1, m_q1 = time.perf_counter(), await scrape(client)
        windows = []
        for j in range(FLAGS.long_prompts):
            ids = prompts(rng, 1, FLAGS.long_prompt_len)[0]
            m_a, res = await scrape(client), Result()
            await stream_one(client, make_body(ids, 1, FLAGS.seed + 1000 + j), res)
            m_b = await scrape(client)
            if res.error or res.ttft is None:
                raise BenchError(f"long prompt {j}: {res.error}", cli.FAILURE_EXIT)
            windows.append(dict(
                t0=res.t_send, t1=res.chunk_t[0], ttft_s=res.ttft,
                step=hist_delta(m_a, m_b, "jlco_engine_step_seconds"),
                queue=hist_delta(m_a, m_b, "jlco_request_queue_time_seconds")))
        t_end = time.perf_counter()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    ended = [r for r in running if r.error or (r.done and r.t_end < t_end)]
    if ended:
        r = ended[0]
        why = r.error or (f"{r.tokens} tokens in {r.t_end - r.t_send:.1f} s; the measurement "
                          f"took {t_end - r.t_send:.1f} s")
        queued = max(w["queue"]["mean_s"] or 0.0 for w in windows) if windows else 0.0
        if queued > 0.5 * windows[0]["ttft_s"]:
            raise BenchError(f"the long prompt waited {queued:.1f} s for a free slot ({why}): "
                             "the streams fill the server's batch; use fewer --num_clients",
                             cli.FAILURE_EXIT)
        raise BenchError(f"{len(ended)} stream(s) ended before the measurement did ({why}): "
                         "raise --max_tokens (and the context: engine.max_context_len) or "
                         "lower --quiet_s / --long_prompts", cli.FAILURE_EXIT)
    return long_report(running, (t_q0, t_q1), windows,
                       hist_delta(m_q0, m_q1, "jlco_engine_step_seconds"), max_tokens,
                       FLAGS.long_prompt_len)


def long_report(running: list[Result], quiet: tuple, windows: list[dict], quiet_step: dict,
                max_tokens: int, long_prompt_len: int) -> tuple[dict, dict]:
    """The streams' gaps split into the quiet window and the long prompts' prefill
    windows (a gap counts where it ends) → (report, raw points for the plot)."""
    gaps = sorted(g for r in running for g in r.gaps())
    q_gaps = [g for t, g in gaps if quiet[0] < t <= quiet[1]]
    w_gaps = [g for t, g in gaps if any(w["t0"] < t <= w["t1"] for w in windows)]
    q, w = stats(q_gaps), stats(w_gaps)
    w_steps = sum(x["step"]["count"] for x in windows)
    w_step_mean = sum(x["step"]["sum_s"] for x in windows) / w_steps if w_steps else None
    inc = w["p99"] - q["p99"] if w["n"] and q["n"] else None
    step_inc = w_step_mean - quiet_step["mean_s"] if w_step_mean and quiet_step["mean_s"] \
        else None
    rep = dict(
        max_tokens=max_tokens, long_prompt_len=long_prompt_len,
        long_prompts=len(windows), quiet_window_s=quiet[1] - quiet[0],
        quiet_itl_s=q, prefill_itl_s=w, itl_p99_increase_s=inc,
        itl_p99_ratio=w["p99"] / q["p99"] if inc is not None and q["p99"] else None,
        long_prompt_ttft_s=stats([x["ttft_s"] for x in windows]),
        long_prompt_queue_s=stats([x["queue"]["mean_s"] or 0.0 for x in windows]),
        quiet_step=quiet_step,
        prefill_step=dict(count=w_steps, mean_s=w_step_mean),
        step_increase_s=step_inc,
        windows=[dict(send_s=x["t0"] - quiet[0], ttft_s=x["ttft_s"], steps=x["step"]["count"],
                      step_mean_s=x["step"]["mean_s"]) for x in windows],
        stream_tokens=[r.tokens for r in running])
    raw = dict(gaps=[(t - quiet[0], g) for t, g in gaps],
               windows=[(x["t0"] - quiet[0], x["t1"] - quiet[0]) for x in windows],
               quiet=(0.0, quiet[1] - quiet[0]))
    return rep, raw


# ---- one target -------------------------------------------------------------------------

async def bench_url(url: str, desc: str, batch: int | None) -> tuple[dict, dict]:
    async with _client(url, FLAGS.num_clients + 1) as client:
        models = await wait_ready(client, FLAGS.server_timeout_s)
        ctx = int(models["data"][0].get("max_model_len") or 0)
        if FLAGS.scenario == "long_prompt":
            if batch is not None and FLAGS.num_clients >= batch:
                raise BenchError(f"--num_clients={FLAGS.num_clients} streams fill the "
                                 f"server's {batch} slots: the long prompt would wait for one; "
                                 "use fewer clients or --override engine.max_batch_size=N")
            rep, raw = await run_long_prompt(client, ctx)
        else:
            rep, raw = await run_load(client, ctx, desc)
    return dict(url=url, models=models, **rep), raw


def start_server(label: str, offload: bool | None, log: pathlib.Path) -> loadgen.ServeProcess:
    """A ready server; with --batch_from_budget restarted at the largest batch its
    banner's device budget allows (when that is not the config's)."""
    return loadgen.start_serve(label, lambda *plan: server_args(offload, *plan), log,
                               FLAGS.server_timeout_s, batch_from_budget=FLAGS.batch_from_budget,
                               prog=PROG)



def run_target(label: str, offload: bool | None, out: pathlib.Path) -> tuple[dict, dict]:
    """Start a server when asked (and stop it), run the scenario against it."""
    if FLAGS.url is not None:
        rep, raw = asyncio.run(bench_url(normalize_url(FLAGS.url), label, None))
        return dict(label=label, offload=None, started_here=False, **rep), raw
    log = out / ("server.log" if label == "server" else f"server_{label.replace(' ', '_')}.log")
    srv = start_server(label, offload, log)
    try:
        rep, raw = asyncio.run(bench_url(srv.url, label, srv.batch))
    finally:
        code = srv.stop()
    return dict(label=label, offload=offload, started_here=True, server_memory=srv.memory,
                server_batch=srv.batch, server_exit=code, server_log=str(log), **rep), raw


# ---- report -----------------------------------------------------------------------------

_BATCH_ROW = ("server batch", ("server_batch",), 1, "{:.0f}")
_LOAD_ROWS = (   # (row, path in a run's report, scale, format)
    _BATCH_ROW, ("requests ok", ("completed",), 1, "{:.0f}"), ("errors", ("errors",), 1, "{:.0f}"),
    ("duration s", ("duration_s",), 1, "{:.2f}"),
    ("output tok/s", ("output_tokens_per_s",), 1, "{:.1f}"),
    ("requests/s", ("requests_per_s",), 1, "{:.2f}"),
    ("TTFT p50 ms", ("ttft_s", "p50"), 1e3, "{:.1f}"),
    ("TTFT p99 ms", ("ttft_s", "p99"), 1e3, "{:.1f}"),
    ("TPOT p50 ms", ("tpot_s", "p50"), 1e3, "{:.1f}"),
    ("TPOT p99 ms", ("tpot_s", "p99"), 1e3, "{:.1f}"),
    ("ITL p50 ms", ("itl_s", "p50"), 1e3, "{:.1f}"),
    ("ITL p99 ms", ("itl_s", "p99"), 1e3, "{:.1f}"),
    ("e2e p50 ms", ("e2e_s", "p50"), 1e3, "{:.1f}"),
    ("e2e p99 ms", ("e2e_s", "p99"), 1e3, "{:.1f}"),
    ("server steps", ("server_step", "count"), 1, "{:.0f}"),
    ("server step mean ms", ("server_step", "mean_s"), 1e3, "{:.2f}"),
)
_LONG_ROWS = (
    _BATCH_ROW,
    ("quiet ITL p50 ms", ("quiet_itl_s", "p50"), 1e3, "{:.1f}"),
    ("quiet ITL p99 ms", ("quiet_itl_s", "p99"), 1e3, "{:.1f}"),
    ("quiet ITL gaps", ("quiet_itl_s", "n"), 1, "{:.0f}"),
    ("prefill ITL p50 ms", ("prefill_itl_s", "p50"), 1e3, "{:.1f}"),
    ("prefill ITL p99 ms", ("prefill_itl_s", "p99"), 1e3, "{:.1f}"),
    ("prefill ITL max ms", ("prefill_itl_s", "max"), 1e3, "{:.1f}"),
    ("prefill ITL gaps", ("prefill_itl_s", "n"), 1, "{:.0f}"),
    ("ITL p99 increase ms", ("itl_p99_increase_s",), 1e3, "{:.1f}"),
    ("ITL p99 ratio", ("itl_p99_ratio",), 1, "{:.2f}"),
    ("long prompt TTFT p50 ms", ("long_prompt_ttft_s", "p50"), 1e3, "{:.1f}"),
    ("long prompt queued max ms", ("long_prompt_queue_s", "max"), 1e3, "{:.1f}"),
    ("step mean quiet ms", ("quiet_step", "mean_s"), 1e3, "{:.2f}"),
    ("step mean prefill ms", ("prefill_step", "mean_s"), 1e3, "{:.2f}"),
    ("steps per long prompt", ("prefill_step", "count"), None, "{:.1f}"),
    ("step increase ms", ("step_increase_s",), 1e3, "{:.2f}"),
)
_RATIO = {"load": ("output_tokens_per_s", "requests_per_s", "ttft_s.p50", "ttft_s.p99",
                   "tpot_s.p50", "tpot_s.p99", "itl_s.p50", "itl_s.p99", "e2e_s.p50",
                   "server_step.mean_s"),
          "long_prompt": ("quiet_itl_s.p99", "prefill_itl_s.p99", "itl_p99_increase_s",
                          "long_prompt_ttft_s.p50", "quiet_step.mean_s", "prefill_step.mean_s")}


def _get(run: dict, path) -> float | None:
    v = run
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def comparison(runs: list[dict], scenario: str) -> dict:
    """Offload on vs off: each key metric of both and the ratio on / off."""
    on, off = runs
    out = {}
    for key in _RATIO[scenario]:
        a, b = _get(on, key.split(".")), _get(off, key.split("."))
        out[key] = dict(offload_on=a, offload_off=b,
                        ratio=a / b if a is not None and b not in (None, 0) else None)
    return out


def _cell(run: dict, path, scale, fmt) -> str:
    v = _get(run, path)
    if scale is None:   # per long prompt
        v = v / run["long_prompts"] if v is not None else None
        scale = 1
    return "-" if v is None else fmt.format(v * scale)


def table(report: dict) -> str:
    runs, scen = report["runs"], report["scenario"]
    f = report["flags"]
    head = (f"{scen}: {f['num_clients']} clients, prompt {f['prompt_len']} tokens, max_tokens "
            f"{runs[0]['max_tokens']}")
    head += (f", {f['num_requests']} requests, rate {f['request_rate']}" if scen == "load" else
             f", long prompt {f['long_prompt_len']} tokens x {f['long_prompts']}, quiet "
             f"{f['quiet_s']} s")
    rows = _LOAD_ROWS if scen == "load" else _LONG_ROWS
    cols = [r["label"] for r in runs] + (["on/off"] if len(runs) == 2 else [])
    lines = [head, f"  {'':<24}" + "".join(f"{c:>13}" for c in cols)]
    for name, path, scale, fmt in rows:
        cells = [_cell(r, path, scale, fmt) for r in runs]
        if len(runs) == 2:
            a, b = _get(runs[0], path), _get(runs[1], path)
            cells.append(f"{a / b:.3f}" if a is not None and b else "-")
        lines.append(f"  {name:<24}" + "".join(f"{c:>13}" for c in cells))
    for r in runs:
        for msg in r.get("error_messages", []):
            lines.append(f"  error ({r['label']}): {msg}")
    return "\n".join(lines)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, xs, label: str) -> None:
    if xs:
        a = np.sort(np.asarray(xs) * 1e3)
        ax.plot(a, np.arange(1, a.size + 1) / a.size, label=label)


def plot(report: dict, raws: list[dict], path: pathlib.Path) -> None:
    """load: CDFs of TTFT and ITL per run, and p50/p99 bars; long_prompt: the streams'
    gaps over time (long-prompt windows shaded) and ITL/step bars."""
    plt = _pyplot()
    runs = report["runs"]
    fig, axes = plt.subplots(1, 3 if report["scenario"] == "load" else 2, figsize=(14, 4))
    if report["scenario"] == "load":
        for r, raw in zip(runs, raws):
            _cdf(axes[0], raw["ttft"], r["label"])
            _cdf(axes[1], raw["itl"], r["label"])
        for ax, what in zip(axes[:2], ("TTFT", "ITL")):
            ax.set_xlabel(f"{what} (ms)")
            ax.set_ylabel("fraction of " + ("requests" if what == "TTFT" else "tokens"))
            ax.set_title(f"{what} CDF")
            ax.legend(fontsize=8)
        keys = [("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p99"),
                ("itl_s", "p50"), ("itl_s", "p99")]
        bar_ax, title = axes[2], "latency percentiles"
    else:
        for r, raw in zip(runs, raws):
            if raw["gaps"]:
                t, g = zip(*raw["gaps"])
                axes[0].plot(t, np.asarray(g) * 1e3, ".", ms=3, label=r["label"])
            for a, b in raw["windows"]:
                axes[0].axvspan(a, b, color="orange", alpha=0.15)
        axes[0].set_xlabel("time since the quiet window began (s); shaded: long prompt prefill")
        axes[0].set_ylabel("stream ITL (ms)")
        axes[0].legend(fontsize=8)
        keys = [("quiet_itl_s", "p99"), ("prefill_itl_s", "p99"), ("quiet_step", "mean_s"),
                ("prefill_step", "mean_s")]
        bar_ax, title = axes[1], "ITL p99 and engine step mean"
    x = np.arange(len(keys))
    for j, r in enumerate(runs):
        vals = [(_get(r, k) or 0.0) * 1e3 for k in keys]
        bar_ax.bar(x + (j - (len(runs) - 1) / 2) * 0.8 / len(runs), vals, 0.8 / len(runs),
                   label=r["label"])
    bar_ax.set_xticks(x, [".".join(k).replace("_s.", " ").replace(".mean_s", " mean")
                          for k in keys], rotation=20, fontsize=8)
    bar_ax.set_ylabel("ms")
    bar_ax.set_title(title)
    bar_ax.legend(fontsize=8)
    fig.suptitle(f"jlco serve, {report['scenario']}, {runs[0]['models']['data'][0]['id']}, "
                 f"{report['machine']['summary']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------

def targets() -> list[tuple[str, bool | None]]:
    if FLAGS.compare_offload:
        return [("offload on", True), ("offload off", False)]
    if FLAGS.offload is not None:
        return [(f"offload {'on' if FLAGS.offload else 'off'}", FLAGS.offload)]
    return [("server", None)]


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    pylog.getLogger("httpx").setLevel(pylog.WARNING)   # no line per request
    with cli.errors_exit(PROG, ValueError, OSError):
        out = check_flags()
    t0 = time.perf_counter()
    runs, raws = [], []
    with cli.interruptible(PROG):
        try:
            for label, offload in targets():
                run, raw = run_target(label, offload, out)
                runs.append(run)
                raws.append(raw)
        except BenchError as err:
            cli.fail(PROG, str(err), err.code)
    report = dict(tool=PROG, scenario=FLAGS.scenario, command=" ".join(sys.argv),
                  machine=loadgen.machine(), flags={k: FLAGS[k].value for k in (
                      "url", "config", "checkpoint", "override", "offload", "compare_offload",
                      "device_budget_gb", "batch_from_budget", "scenario", "num_clients", "num_requests",
                      "prompt_len", "max_tokens", "request_rate", "seed", "temperature",
                      "warmup", "long_prompt_len", "long_prompts", "quiet_s")},
                  runs=runs)
    if len(runs) == 2:
        report["comparison"] = comparison(runs, FLAGS.scenario)
    report["wall_s"] = time.perf_counter() - t0
    json_path, png_path = out / "bench_serve.json", out / "bench_serve.png"
    plot(report, raws, png_path)
    summary = table(report) + f"\n{report['machine']['summary']}; JSON {json_path}; plot {png_path}"
    cli.write_report(json_path, report, summary, FLAGS.json)
    if any(r.get("errors") for r in runs):
        cli.warn(PROG, "some requests failed (see error lines and the JSON's requests)")
    for r in runs:
        queued, ttft = _get(r, ("long_prompt_queue_s", "max")), _get(r, ("long_prompt_ttft_s",
                                                                          "p50"))
        if queued and ttft and queued > 0.5 * ttft:
            cli.warn(PROG, f"{r['label']}: a long prompt waited {queued * 1e3:.0f} ms for a "
                     "free slot (the streams fill the server's batch): use fewer --num_clients")
    if all(r.get("completed", 1) == 0 for r in runs):
        cli.fail(PROG, "no request completed", cli.FAILURE_EXIT)


if __name__ == "__main__":
    define_flags()
    cli.run_main(main, flags_parser=cli.flags_parser(PROG))
