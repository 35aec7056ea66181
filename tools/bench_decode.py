"""Decode benchmark: latent cache offloaded (host pool + device hot buffer) vs on device,
each step against its roofline.

Contexts are filled synthetically, as a PD-disaggregated decode node receives them
(`jlco.engine.synthetic`: latent rows + indexer keys written straight into each request's
caches and host pages), then the engine decodes. Every speed figure comes with two ratios:
against the machine's limit (`roofline_fraction` = roofline time / measured step time,
the roofline being max(bytes the step must touch / memory bandwidth, FLOPs / peak) from
`jlco.planning.roofline`) and against the engine a user would otherwise run (offload vs
the on-device baseline). Per run it also records `xla_bytes` / `xla_flops`, XLA's own
cost analysis of the compiled decode step.

Default mode, per context in --contexts:
  (a) offload vs baseline at the same batch: step-time ratio (target <= 1.10 when the
      hot buffer holds the working set);
  (b) at one device-memory budget, each side's largest batch (baseline: latent +
      indexer cache per request; offload: indexer cache + hot buffer) and its tokens/s;
plus hot-buffer hit rate and H2D bytes per generated token.
--sweep_contexts mode: step time of both sides against context at one batch (--batch,
default 1) and fixed top-k, beside the roofline (PNG: ms vs context, log x).

  python tools/bench_decode.py --small                      # CPU, < 1 minute
  python tools/bench_decode.py --contexts=32768,131072      # out/bench_decode.{json,png}
  python tools/bench_decode.py --small --sweep_contexts=1024,2048,4096,8192
  python tools/bench_decode.py --sweep_contexts=1024,2048,4096,8192,16384,32768 --batch=4

Results go to --out (a directory, default out/ in the repository): bench_decode.json and
.png (sweep: bench_decode_sweep.*); --json prints the JSON on stdout (table on stderr).
Roofline limits: on CPU --mem_gbps / --peak_gflops (default: measured on this machine,
`jlco.planning.probe`, cached per machine);
on an accelerator the `jlco.planning.hardware` profile of its device kind (--hardware).

Queries are made to correlate step to step (as a trained model's do) by giving every
token embedding a shared component (--embed_common); with 0 the random-weight model's
consecutive top-k sets are unrelated and the hit rate is the capacity/context floor.
On CPU "host" and "device" are the same RAM: the timings show the mechanics (resolve,
fetch, scatter) against the model's compute, not a PCIe link.
"""

from __future__ import annotations

import ast
import gc
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx
from tqdm import tqdm

from jlco.config import Config, load_config
from jlco.engine import synthetic
from jlco.engine.core import Engine
from jlco.model.decoder import DeepseekV32
from jlco.planning import memory as plan
from jlco.planning import roofline
from jlco.planning.hardware import HARDWARE
from jlco.util import atomic, cli, compile_cache

REPO = pathlib.Path(__file__).resolve().parents[1]
PROG = "bench_decode"
FLAGS = flags.FLAGS

# --small: a quick CPU setting (flags given explicitly still win).
SMALL = dict(contexts=["1024", "2048"], batch=2, layers=2, topk=64, steps=2, warmup=1,
             max_batch_cap=2)


def define_flags() -> None:
    """Flags exist only when this runs as a program (importing tools side by side must
    not collide)."""
    flags.DEFINE_string("config", "configs/bench_small.py", "model/cache config to start "
                        "from (a relative path not found from the current directory is "
                        "looked up in the repository)")
    flags.DEFINE_list("set", [], "config overrides section__field=value, e.g. "
                      "model__num_attention_heads=128,cache__kv_format=fp8")
    flags.DEFINE_list("contexts", ["32768", "131072"], "context lengths (tokens per request)")
    flags.DEFINE_list("sweep_contexts", [], "sweep mode: these contexts at one batch "
                      "(--batch, 0 = 1), baseline and offload, against the roofline")
    flags.DEFINE_integer("batch", 0, "batch for the same-batch comparison (0 = baseline's "
                         "largest batch under --device_budget_gb; sweep: 1)")
    flags.DEFINE_integer("steps", 8, "timed decode steps per run (median reported)")
    flags.DEFINE_integer("warmup", 3, "untimed steps first (compile, hot-buffer fill)")
    flags.DEFINE_integer("layers", 0, "override model.num_hidden_layers (0 = config)")
    flags.DEFINE_integer("topk", 0, "override model.index_topk (0 = config)")
    flags.DEFINE_integer("staging", 0, "hot-buffer rows per request per layer (0 = 2 x topk)")
    flags.DEFINE_float("device_budget_gb", 0.85, "device memory budget for the max-batch runs")
    flags.DEFINE_float("embed_common", 0.9, "shared fraction of every token embedding (query "
                       "locality; 0 = unrelated consecutive queries)")
    flags.DEFINE_integer("max_batch_cap", 256, "never run a batch above this")
    flags.DEFINE_float("ram_fraction", 0.7, "cap batches so a run needs at most this fraction "
                       "of MemAvailable")
    flags.DEFINE_enum("impl", "xla", ["xla", "auto", "pallas", "interpret"],
                      "attention/indexer impl (pallas needs a GPU/TPU; interpret = Pallas "
                      "interpret mode, slow)")
    flags.DEFINE_integer("seed", 0, "model and context seed")
    flags.DEFINE_bool("small", False, "quick CPU setting: contexts 1024,2048, batch 2, 2 "
                      "layers, top-k 64, 2 steps, 1 warm-up, no max-batch runs")
    flags.DEFINE_string("out", None, "output directory for the JSON and PNG (default: out/ "
                        "in the repository)")
    flags.DEFINE_bool("json", False, "print the JSON report on stdout (the table goes to "
                      "stderr)")
    flags.DEFINE_string("hardware", "auto", "roofline limits: auto (cpu, or the profile of "
                        "the accelerator's device kind), cpu (--mem_gbps/--peak_gflops), or "
                        "a jlco.planning.hardware key: " + ", ".join(HARDWARE))
    flags.DEFINE_float("mem_gbps", None, "CPU memory bandwidth, GB/s "
                       "(roofline on cpu; default: measured on this machine)")
    flags.DEFINE_float("peak_gflops", None, "CPU peak GFLOP/s "
                       "(roofline on cpu; default: measured on this machine)")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _bar(it, desc: str):
    """tqdm on a terminal only (logs and pipes get no progress-bar noise)."""
    return tqdm(it, desc=desc, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())


def resolve_config(path: str) -> pathlib.Path:
    """--config as given when it exists (or is absolute), else relative to the repository."""
    p = pathlib.Path(path).expanduser()
    if p.is_absolute() or p.is_file():
        return p
    alt = REPO / p
    return alt if alt.is_file() else p


def parse_overrides(items) -> dict:
    """--set items section__field=value → replace() kwargs (values as Python literals,
    else strings)."""
    over = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or "__" not in key or not raw:
            raise ValueError(f"--set={item!r}: allowed section__field=value, e.g. "
                             "model__num_attention_heads=128")
        try:
            over[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            over[key] = raw
    return over


def apply_overrides(base: Config, over: dict) -> Config:
    if not over:
        return base
    try:
        return base.replace(**over)
    except (TypeError, AttributeError) as err:
        raise ValueError(f"--set: {err}") from None


def bench_config(base, context: int, gen: int, batch: int, offload: bool):
    """The run's Config: base with the flag overrides, room for context + gen tokens."""
    cfg = base
    if FLAGS.layers:
        cfg = cfg.replace(model__num_hidden_layers=FLAGS.layers,
                          model__first_k_dense_replace=min(
                              cfg.model.first_k_dense_replace, FLAGS.layers, 1))
    if FLAGS.topk:
        cfg = cfg.replace(model__index_topk=FLAGS.topk)
    staging = FLAGS.staging or 2 * cfg.model.index_topk
    return cfg.replace(cache__offload=offload, cache__hot_buffer_rows=staging,
                       engine__max_batch_size=batch, engine__max_context_len=context + gen,
                       engine__attention_impl=FLAGS.impl)


def shape_model(model: DeepseekV32, common: float, seed: int) -> None:
    """Give every token embedding a shared component (fraction `common`), so consecutive
    queries correlate and the indexer's top-k sets overlap step to step (see
    jlco.engine.synthetic's docstring for why keys alone cannot do this)."""
    e = model.embed_tokens[...]
    shared = jax.random.normal(jax.random.PRNGKey(seed + 1), (e.shape[1],), jnp.float32)
    shared = shared * jnp.std(e.astype(jnp.float32))
    mixed = common * shared[None] + (1.0 - common) * e.astype(jnp.float32)
    model.embed_tokens[...] = mixed.astype(e.dtype)


def device_and_host_bytes(eng: Engine) -> tuple[int, int]:
    """Bytes the engine's cache really holds on device and in host memory."""
    c = eng.runner.cache
    dev = sum(x.nbytes for x in c.index_k + (c.index_scale or ()))
    if not eng.runner.offload:
        return dev + sum(x.nbytes for x in c.latent), 0
    lat = c.latent
    dev += lat.rows.nbytes + lat.slot_pos.nbytes + lat.slot_stamp.nbytes + lat.page_table.nbytes
    return dev, sum(h.nbytes for h in lat.host)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable missing from /proc/meminfo")


def ram_cap(cfg, context: int, offload: bool) -> int:
    """Largest batch whose caches (device + host, all RAM on CPU) fit in ram_fraction of
    MemAvailable, keeping room for one synthetic prefill cache."""
    pr = plan.per_request_bytes(cfg, cfg.engine.max_context_len, offload)
    per = pr["indexer"] + pr["latent_device"] + pr["host"]
    temp = plan.per_request_bytes(cfg, cfg.engine.max_context_len, False)
    room = FLAGS.ram_fraction * mem_available() - 2 * (temp["indexer"] + temp["latent_device"])
    return max(0, int(room // per))


# ---- the machine and XLA's view of a step ---------------------------------------------

def pick_machine() -> roofline.Machine:
    """The roofline's limits (--hardware)."""
    hw = FLAGS.hardware.lower()
    if hw == "cpu":
        return roofline.cpu_machine(FLAGS.mem_gbps, FLAGS.peak_gflops)
    if hw != "auto":
        return roofline.hardware_machine(hw)
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return roofline.cpu_machine(FLAGS.mem_gbps, FLAGS.peak_gflops)
    key = roofline.profile_for_device_kind(dev.device_kind)
    if key is None:
        cli.warn(PROG, f"no hardware profile for device kind {dev.device_kind!r}: the "
                 "roofline uses this host's CPU figures (--mem_gbps / --peak_gflops, else "
                 "measured; pass --hardware=KEY)")
        return roofline.cpu_machine(FLAGS.mem_gbps, FLAGS.peak_gflops)
    return roofline.hardware_machine(key)


def _cost_number(ca: dict, key: str) -> float | None:
    v = ca.get(key)
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if v >= 0 else None


def step_cost(lowered) -> dict:
    """XLA's cost analysis of the compiled decode step (`DecodeStepper.lower`: the
    arguments the engine passes, so compile() is a cache hit). cost_analysis() may be a
    dict, a list of dicts (one per program) or None, and may lack keys."""
    if lowered is None:
        return dict(xla_bytes=None, xla_flops=None,
                    xla_note="the step is not one jitted function (host-driven fetch path)")
    ca = lowered.compile().cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    ca = dict(ca) if ca else {}
    return dict(xla_bytes=_cost_number(ca, "bytes accessed"),
                xla_flops=_cost_number(ca, "flops"))


def step_with_cost(eng: Engine) -> dict:
    """Run one (untimed) engine step and return XLA's cost of its jitted decode step,
    lowered for the requests it decodes."""
    running = [r for r in eng.scheduler.slots if r is not None and r.tokens]
    try:
        box = step_cost(eng.runner.stepper.lower(eng.runner.cache, running)) if running \
            else dict(xla_bytes=None, xla_flops=None, xla_note="no decode step ran")
    except Exception as err:  # noqa: BLE001 - the cost is a report, not the benchmark
        box = dict(xla_bytes=None, xla_flops=None,
                   xla_note=f"cost analysis failed: {type(err).__name__}: {err}"[:300])
    eng.step()
    return box


# ---- runs -------------------------------------------------------------------------------

def run_one(model, cfg, context: int, label: str, machine: roofline.Machine) -> dict:
    """Admit cfg.engine.max_batch_size synthetic requests, warm up, time FLAGS.steps."""
    batch, steps = cfg.engine.max_batch_size, FLAGS.steps
    gen = cfg.engine.max_context_len - context
    t0 = time.perf_counter()
    eng = Engine(cfg, model, impl=FLAGS.impl)
    # One synthetic-cache shape per context for both sides (its jit keys on the config).
    syn_cfg = cfg.replace(cache__offload=False, cache__hot_buffer_rows=0,
                          engine__max_batch_size=1)
    for i in _bar(range(batch), f"{label}: fill {context} x {batch}"):
        temp = synthetic.synthetic_cache(syn_cfg, jax.random.PRNGKey(FLAGS.seed * 100003 + i),
                                         n=context, max_len=eng.runner.max_len)
        synthetic.admit_prefilled(eng, temp, gen, first_token=i % cfg.model.vocab_size)
        del temp
    fill_s = time.perf_counter() - t0
    for _ in _bar(range(FLAGS.warmup - 1), f"{label}: warm-up"):
        eng.step()
    xla = step_with_cost(eng)   # the last warm-up step
    if eng.metrics is not None:
        eng.metrics.reset()
    n0 = len(eng.step_seconds)
    for _ in _bar(range(steps), f"{label}: decode"):
        if not eng.step():
            raise RuntimeError(f"{label}: engine ran out of work before {steps} timed steps")
    times = np.asarray(eng.step_seconds[n0:])
    if len(times) != steps or any(r is None for r in eng.scheduler.slots):
        raise RuntimeError(f"{label}: a request finished early; raise max_context_len")
    dev_b, host_b = device_and_host_bytes(eng)
    tokens = batch * steps
    med = float(np.median(times))
    # Positions cached before the first timed step: the context + the warm-up tokens.
    roof = roofline.decode_step_cost(cfg, batch, context + FLAGS.warmup,
                                     s_q=1 + cfg.engine.num_draft_tokens)
    roof_s = roof.time_s(machine)
    rec = dict(label=label, offload=eng.runner.offload, context=context, batch=batch,
               staging_rows=cfg.hot_buffer_rows if eng.runner.offload else 0,
               step_s_median=med, step_s_mean=float(times.mean()),
               step_s=times.tolist(), first_step_s=float(eng.step_seconds[0]),
               tokens_per_s=float(batch / med), fill_s=fill_s,
               device_bytes=dev_b, device_bytes_per_request=dev_b / batch, host_bytes=host_b,
               roofline=roof.as_dict(machine), roofline_bytes=roof.total_bytes,
               roofline_flops=roof.total_flops, roofline_s=roof_s,
               roofline_fraction=roof_s / med,
               achieved_gbps=roof.total_bytes / med / 1e9, **xla)
    rec["xla_bytes_over_roofline"] = (rec["xla_bytes"] / roof.total_bytes
                                      if rec.get("xla_bytes") else None)
    if eng.metrics is not None:
        snap = eng.metrics.snapshot()
        tot = snap["total"]
        rec.update(hit_rate=tot["hit_rate"], hit_rate_per_layer=snap["per_layer"]["hit_rate"],
                   h2d_bytes_per_token=tot["h2d_bytes"] / tokens,
                   h2d_moved_bytes_per_token=tot["h2d_moved_bytes"] / tokens,
                   d2h_bytes_per_token=tot["d2h_bytes"] / tokens,
                   misses_per_token=tot["misses"] / tokens)
        if machine.host_bw:   # an accelerator: the misses must also cross the host link
            rec["roofline_link_s"] = tot["h2d_moved_bytes"] / steps / machine.host_bw
    eng.check_no_leaks()
    del eng
    gc.collect()
    return rec


def _gen() -> int:
    return FLAGS.warmup + FLAGS.steps + 2


def bench_context(model, base, context: int, machine) -> dict:
    """Baseline and offload at the same batch, then each side at its largest batch."""
    gen = _gen()
    budget = FLAGS.device_budget_gb * 1e9
    probe = {o: bench_config(base, context, gen, 1, o) for o in (False, True)}
    wfmt = "f32" if base.model.dtype == "float32" else "bf16"
    per_req = {}
    max_b, capped = {}, {}
    for name, off in (("baseline", False), ("offload", True)):
        pr = plan.per_request_bytes(probe[off], probe[off].engine.max_context_len, off)
        per_req[name] = pr["indexer"] + pr["latent_device"]
        by_budget = plan.max_batch(probe[off], budget, offload=off, weight_format=wfmt)
        max_b[name] = min(by_budget, FLAGS.max_batch_cap, max(1, ram_cap(probe[off], context,
                                                                         off)))
        capped[name] = max_b[name] < by_budget
    same_b = FLAGS.batch or max_b["baseline"]
    runs = [run_one(model, bench_config(base, context, gen, same_b, False), context,
                    f"baseline b={same_b}", machine),
            run_one(model, bench_config(base, context, gen, same_b, True), context,
                    f"offload b={same_b}", machine)]
    if max_b["baseline"] != same_b:
        runs.append(run_one(model, bench_config(base, context, gen, max_b["baseline"], False),
                            context, f"baseline b={max_b['baseline']}", machine))
    if max_b["offload"] != same_b:
        runs.append(run_one(model, bench_config(base, context, gen, max_b["offload"], True),
                            context, f"offload b={max_b['offload']}", machine))
    pick = lambda off, b: next(r for r in runs if r["offload"] == off and r["batch"] == b)  # noqa: E731
    top_base, top_off = pick(False, max_b["baseline"]), pick(True, max_b["offload"])
    return dict(
        context=context, budget_bytes=budget, device_bytes_per_request=per_req,
        max_batch=max_b, max_batch_capped_by_ram_or_flag=capped,
        batch_ratio=max_b["offload"] / max_b["baseline"],
        same_batch=same_b,
        same_batch_step_ratio=pick(True, same_b)["step_s_median"] /
        pick(False, same_b)["step_s_median"],
        tokens_per_s_ratio=top_off["tokens_per_s"] / top_base["tokens_per_s"],
        runs=runs)


def sweep_context(model, base, context: int, batch: int, machine) -> dict:
    """Baseline and offload at `batch` for one context of the sweep."""
    gen = _gen()
    base_run, off_run = (run_one(model, bench_config(base, context, gen, batch, off), context,
                                 f"{'offload' if off else 'baseline'} b={batch}", machine)
                         for off in (False, True))
    # The fetch stall: predicted from the step's measured missed bytes over the hardware
    # profile's host link (no overlap: the on-demand bound; None on CPU, no link), beside
    # the one seen (offload step - on-device step at the same batch).
    predicted = off_run.get("roofline_link_s")
    return dict(context=context, batch=batch, roofline_s=base_run["roofline_s"],
                roofline_bytes=base_run["roofline_bytes"],
                offload_over_baseline=off_run["step_s_median"] / base_run["step_s_median"],
                predicted_fetch_stall_s=predicted,
                seen_fetch_stall_s=off_run["step_s_median"] - base_run["step_s_median"],
                runs=[base_run, off_run])


# ---- report -----------------------------------------------------------------------------

def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}"


def _run_line(r: dict) -> str:
    hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "-"
    h2d = f"{r['h2d_bytes_per_token']:.0f}" if "h2d_bytes_per_token" in r else "-"
    return (f"  {r['label']:<16} {r['batch']:5d} {r['step_s_median'] * 1e3:9.2f} "
            f"{r['roofline_s'] * 1e3:8.3f} {r['roofline_fraction']:6.3f} "
            f"{r['tokens_per_s']:8.2f} {hit:>6} {h2d:>10} {_mb(r['roofline_bytes']):>8} "
            f"{_mb(r.get('xla_bytes')):>8} {r['device_bytes_per_request'] / 1e6:10.1f}")


_HEAD = (f"  {'run':<16} {'batch':>5} {'step ms':>9} {'roof ms':>8} {'frac':>6} {'tok/s':>8} "
         f"{'hit':>6} {'H2D B/tok':>10} {'roof MB':>8} {'XLA MB':>8} {'dev MB/req':>10}")


def table(report: dict) -> str:
    m = report["roofline_machine"]
    lines = [f"roofline: {m['name']}, {m['mem_gbps']:.1f} GB/s, {m['peak_tflops'] * 1e3:.0f} "
             f"GFLOP/s; frac = roofline time / measured step time"]
    if report["mode"] == "sweep":
        lines.append(f"sweep at batch {report['sweep'][0]['batch']}, top-k "
                     f"{report['topk']}")
        for c in report["sweep"]:
            pred = c.get("predicted_fetch_stall_s")
            lines.append(f"context {c['context']}: offload/baseline step time "
                         f"{c['offload_over_baseline']:.3f}; fetch stall seen "
                         f"{c['seen_fetch_stall_s'] * 1e3:.2f} ms, predicted (missed bytes / "
                         "host link, no overlap) "
                         + ("-" if pred is None else f"{pred * 1e3:.2f} ms"))
            lines.append(_HEAD)
            lines += [_run_line(r) for r in c["runs"]]
        return "\n".join(lines)
    for c in report["contexts"]:
        lines.append(f"context {c['context']}: budget {c['budget_bytes'] / 1e9:.2f} GB; device "
                     f"MB/request baseline {c['device_bytes_per_request']['baseline'] / 1e6:.1f}"
                     f", offload {c['device_bytes_per_request']['offload'] / 1e6:.1f}")
        lines.append(_HEAD)
        lines += [_run_line(r) for r in c["runs"]]
        cap = " (capped by RAM/--max_batch_cap)" if any(
            c["max_batch_capped_by_ram_or_flag"].values()) else ""
        lines.append(f"  (a) same batch {c['same_batch']}: offload/baseline step time "
                     f"{c['same_batch_step_ratio']:.3f} (target <= 1.10)")
        lines.append(f"  (b) max batch baseline {c['max_batch']['baseline']}, offload "
                     f"{c['max_batch']['offload']}{cap}: batch x{c['batch_ratio']:.2f}, "
                     f"tokens/s x{c['tokens_per_s_ratio']:.2f}")
    return "\n".join(lines)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(report: dict, path: pathlib.Path) -> None:
    """Left: step time at the same batch (roofline as black ticks); right: tokens/s
    against batch per side."""
    plt = _pyplot()
    ctxs = report["contexts"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(ctxs))
    for j, (off, name) in enumerate(((False, "baseline"), (True, "offload"))):
        ms = [next(r for r in c["runs"] if r["offload"] == off and r["batch"] == c["same_batch"])
              ["step_s_median"] * 1e3 for c in ctxs]
        ax1.bar(x + (j - 0.5) * 0.4, ms, 0.4, label=name)
    roof = [next(r for r in c["runs"] if r["batch"] == c["same_batch"])["roofline_s"] * 1e3
            for c in ctxs]
    ax1.plot(x, roof, "k_", markersize=30, mew=2, label="roofline")
    ax1.set_xticks(x, [f"{c['context'] // 1024}K, b={c['same_batch']}" for c in ctxs])
    ax1.set_ylabel("median step time (ms)")
    ax1.set_title("(a) same batch")
    ax1.legend()
    for c in ctxs:
        for off, mark in ((False, "o--"), (True, "s-")):
            rs = sorted((r for r in c["runs"] if r["offload"] == off), key=lambda r: r["batch"])
            ax2.plot([r["batch"] for r in rs], [r["tokens_per_s"] for r in rs], mark,
                     label=f"{c['context'] // 1024}K {'offload' if off else 'baseline'}")
    ax2.set_xlabel("batch")
    ax2.set_ylabel("tokens/s")
    ax2.set_title(f"(b) budget {report['flags']['device_budget_gb']} GB")
    ax2.legend(fontsize=8)
    fig.suptitle(f"jlco decode, {report['model']}, {report['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(report: dict, path: pathlib.Path) -> None:
    """Left: step ms of both sides and roofline ms against context (log x, log y);
    right: roofline fraction against context."""
    plt = _pyplot()
    rows = report["sweep"]
    ctx = [c["context"] for c in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, mark) in enumerate((("baseline", "o-"), ("offload", "s-"))):
        ax1.plot(ctx, [c["runs"][i]["step_s_median"] * 1e3 for c in rows], mark, label=name)
        ax2.plot(ctx, [c["runs"][i]["roofline_fraction"] for c in rows], mark, label=name)
    ax1.plot(ctx, [c["roofline_s"] * 1e3 for c in rows], "k--", label="roofline")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [f"{c // 1024}K" if c >= 1024 else str(c) for c in ctx])
        ax.set_xlabel("context (tokens per request)")
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("step time (ms)")
    ax1.set_title(f"batch {rows[0]['batch']}, top-k {report['topk']}")
    ax2.set_ylabel("roofline time / step time")
    ax2.set_title(f"fraction of the roofline ({report['roofline_machine']['name']})")
    fig.suptitle(f"jlco decode sweep, {report['model']}, {report['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- flags ------------------------------------------------------------------------------

def _apply_small() -> None:
    """--small fills in the flags the user did not give."""
    if not FLAGS.small:
        return
    for name, value in SMALL.items():
        if not FLAGS[name].present:
            setattr(FLAGS, name, value)


def _positive_ints(name: str, values) -> list[int]:
    try:
        out = [int(v) for v in values]
    except ValueError:
        out = []
    if not out or any(v < 1 for v in out):
        raise ValueError(f"--{name}={','.join(values)}: allowed positive integers, comma "
                         "separated")
    return out


def check_flags():
    """Every flag and the config checked before anything compiles; returns
    (contexts, sweep, base config, machine, out dir). Errors are ValueError/OSError with
    a one-line message."""
    _apply_small()
    sweep = bool(FLAGS.sweep_contexts)
    contexts = _positive_ints("sweep_contexts" if sweep else "contexts",
                              FLAGS.sweep_contexts if sweep else FLAGS.contexts)
    for name, low in (("steps", 1), ("warmup", 1), ("max_batch_cap", 1), ("batch", 0),
                      ("layers", 0), ("topk", 0), ("staging", 0)):
        if getattr(FLAGS, name) < low:
            raise ValueError(f"--{name}={getattr(FLAGS, name)}: allowed an integer >= {low}")
    for name, lo, hi in (("device_budget_gb", 0.0, float("inf")), ("ram_fraction", 0.0, 1.0),
                         ("mem_gbps", 0.0, float("inf")), ("peak_gflops", 0.0, float("inf"))):
        v = getattr(FLAGS, name)
        if v is None and name in ("mem_gbps", "peak_gflops"):
            continue     # measured on this machine
        if not lo < v <= hi:
            raise ValueError(f"--{name}={v}: allowed a number in ({lo}, {hi}]")
    if not 0.0 <= FLAGS.embed_common <= 1.0:
        raise ValueError(f"--embed_common={FLAGS.embed_common}: allowed 0..1")
    backend = jax.default_backend()
    if FLAGS.impl == "pallas" and backend == "cpu":
        raise ValueError("--impl=pallas needs a GPU or TPU (this backend is cpu): use "
                         "--impl=interpret (Pallas interpret mode, slow) or --impl=xla")
    hw = FLAGS.hardware.lower()
    if hw not in ("auto", "cpu") and hw not in HARDWARE:
        raise ValueError(f"--hardware={FLAGS.hardware}: allowed auto, cpu, "
                         + ", ".join(HARDWARE))
    out = pathlib.Path(FLAGS.out).expanduser() if FLAGS.out else REPO / "out"
    if out.suffix == ".json":
        raise ValueError(f"--out={FLAGS.out}: takes a directory (the JSON and PNG are written "
                         "into it)")
    atomic.check_writable(out / "bench_decode.json", "--out")
    base = apply_overrides(load_config(resolve_config(FLAGS.config)),
                           parse_overrides(FLAGS.set))
    gen = _gen()
    for c in contexts:   # every run's config is valid (context vs max_position_embeddings...)
        for off in (False, True):
            probe = bench_config(base, c, gen, max(1, FLAGS.batch), off)
            if not sweep and not off:
                wfmt = "f32" if base.model.dtype == "float32" else "bf16"
                if plan.max_batch(probe, FLAGS.device_budget_gb * 1e9, offload=False,
                                  weight_format=wfmt) < 1:
                    raise ValueError(f"--device_budget_gb={FLAGS.device_budget_gb} fits no "
                                     f"baseline request at context {c}")
            if FLAGS.batch or sweep:
                b = FLAGS.batch or 1
                cap = ram_cap(probe, c, off)
                if b > cap:
                    raise ValueError(f"--batch={b} at context {c} needs more than "
                                     f"--ram_fraction={FLAGS.ram_fraction} of the available "
                                     f"RAM (at most {cap} fit{'s' if cap == 1 else ''})")
    machine = pick_machine()
    out.mkdir(parents=True, exist_ok=True)
    return contexts, sweep, base, machine, out


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)   # no jax backend-probe INFO lines
    compile_cache.enable()
    with cli.errors_exit(PROG, ValueError, OSError):
        contexts, sweep, base, machine, out = check_flags()
    cfg0 = bench_config(base, max(contexts), 1, 1, True)
    model = DeepseekV32(cfg0.model, rngs=nnx.Rngs(FLAGS.seed))
    shape_model(model, FLAGS.embed_common, FLAGS.seed)
    m = cfg0.model
    desc = (f"{m.num_hidden_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
            f"heads, kv_lora {m.kv_lora_rank}, index {m.index_n_heads}x{m.index_head_dim}, "
            f"topk {m.index_topk}, {cfg0.cache.kv_format} rows ({cfg0.row_bytes} B), "
            f"{cfg0.cache.indexer_key_format} keys ({cfg0.indexer_key_bytes} B), "
            f"hot {cfg0.hot_buffer_rows} rows")
    dev = jax.devices()[0]
    machine_desc = (f"{platform.machine()} {os.cpu_count()} cores, {dev.platform}"
                    f"{'' if dev.platform == 'cpu' else ' ' + dev.device_kind}, "
                    f"jax {jax.__version__}")
    t0 = time.perf_counter()
    report = dict(mode="sweep" if sweep else "contexts", machine=machine_desc, model=desc,
                  topk=m.index_topk, config=str(resolve_config(FLAGS.config)),
                  command=" ".join(sys.argv), roofline_machine=machine.as_dict(),
                  flags={k: FLAGS[k].value for k in (
                      "contexts", "sweep_contexts", "batch", "steps", "warmup", "layers",
                      "topk", "staging", "device_budget_gb", "embed_common", "max_batch_cap",
                      "impl", "seed", "small", "set", "hardware", "mem_gbps", "peak_gflops")})
    if sweep:
        b = FLAGS.batch or 1
        report["sweep"] = [sweep_context(model, base, c, b, machine) for c in contexts]
    else:
        report["contexts"] = [bench_context(model, base, c, machine) for c in contexts]
    report["wall_s"] = time.perf_counter() - t0
    stem = "bench_decode_sweep" if sweep else "bench_decode"
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    (plot_sweep if sweep else plot)(report, png_path)
    summary = table(report) + (f"\n{desc}; {machine_desc}; wall {report['wall_s']:.0f} s; "
                               f"JSON {json_path}; plot {png_path}")
    cli.write_report(json_path, report, summary, FLAGS.json)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.flags_parser(PROG))
