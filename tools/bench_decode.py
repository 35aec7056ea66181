"""Decode benchmark: latent cache offloaded (host pool + device hot buffer) vs on device.

Contexts are filled synthetically, as a PD-disaggregated decode node receives them
(`jlco.engine.synthetic`: latent rows + indexer keys written straight into each request's
caches and host pages), then the engine decodes. Per context it measures
  (a) offload vs baseline at the same batch: step-time ratio (target <= 1.10 when the
      hot buffer holds the working set);
  (b) at one device-memory budget, each side's largest batch (baseline: latent +
      indexer cache per request; offload: indexer cache + hot buffer) and its tokens/s;
plus hot-buffer hit rate and H2D bytes per generated token.

  python tools/bench_decode.py --contexts=32768,131072 --out=/tmp/bench_decode.json

Queries are made to correlate step to step (as a trained model's do) by giving every
token embedding a shared component (--embed_common); with 0 the random-weight model's
consecutive top-k sets are unrelated and the hit rate is the capacity/context floor.
On CPU "host" and "device" are the same RAM: the timings show the mechanics (resolve,
fetch, scatter) against the model's compute, not a PCIe link.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from tqdm import tqdm

from jlco.config import load_config
from jlco.engine import synthetic
from jlco.engine.core import Engine
from jlco.model.decoder import DeepseekV32
from jlco.planning import memory as plan

FLAGS = flags.FLAGS
def define_flags() -> None:
    """Flags exist only when this runs as a program (importing tools side by side must
    not collide)."""
    flags.DEFINE_string("config", "configs/bench_small.py", "model/cache config to start from")
    flags.DEFINE_list("contexts", ["32768", "131072"], "context lengths (tokens per request)")
    flags.DEFINE_integer("batch", 0, "batch for the same-batch comparison (0 = baseline's "
                         "largest batch under --device_budget_gb)")
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
                      "attention/indexer impl")
    flags.DEFINE_integer("seed", 0, "model and context seed")
    flags.DEFINE_string("out", "bench_decode.json", "JSON output path")
    flags.DEFINE_string("plot", "", "PNG plot path ('' = beside --out, 'none' = no plot)")


def bench_config(base, context: int, gen: int, batch: int, offload: bool):
    """The run's Config: base with the flag overrides, room for context + gen tokens."""
    cfg = base
    if FLAGS.layers:
        cfg = cfg.replace(model__num_hidden_layers=FLAGS.layers,
                          model__first_k_dense_replace=min(1, FLAGS.layers))
    if FLAGS.topk:
        cfg = cfg.replace(model__index_topk=FLAGS.topk)
    staging = FLAGS.staging or 2 * cfg.model.index_topk
    return cfg.replace(cache__offload=offload, cache__staging_capacity=staging,
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
    return max(1, int(room // per))


def run_one(model, cfg, context: int, label: str) -> dict:
    """Admit cfg.engine.max_batch_size synthetic requests, warm up, time FLAGS.steps."""
    batch, steps = cfg.engine.max_batch_size, FLAGS.steps
    gen = cfg.engine.max_context_len - context
    t0 = time.perf_counter()
    eng = Engine(cfg, model, impl=FLAGS.impl)
    for i in tqdm(range(batch), desc=f"{label}: fill {context} x {batch}", file=sys.stderr,
                  leave=False):
        temp = synthetic.synthetic_cache(cfg, jax.random.PRNGKey(FLAGS.seed * 100003 + i),
                                         n=context, max_len=eng.runner.max_len)
        synthetic.admit_prefilled(eng, temp, gen, first_token=i % cfg.model.vocab_size)
        del temp
    fill_s = time.perf_counter() - t0
    for _ in tqdm(range(FLAGS.warmup), desc=f"{label}: warm-up", file=sys.stderr, leave=False):
        eng.step()
    if eng.metrics is not None:
        eng.metrics.reset()
    n0 = len(eng.step_seconds)
    for _ in tqdm(range(steps), desc=f"{label}: decode", file=sys.stderr, leave=False):
        if not eng.step():
            raise RuntimeError(f"{label}: engine ran out of work before {steps} timed steps")
    times = np.asarray(eng.step_seconds[n0:])
    if len(times) != steps or any(r is None for r in eng.scheduler.slots):
        raise RuntimeError(f"{label}: a request finished early; raise max_context_len")
    dev_b, host_b = device_and_host_bytes(eng)
    tokens = batch * steps
    rec = dict(label=label, offload=eng.runner.offload, context=context, batch=batch,
               staging_rows=cfg.staging_capacity if eng.runner.offload else 0,
               step_s_median=float(np.median(times)), step_s_mean=float(times.mean()),
               step_s=times.tolist(), first_step_s=float(eng.step_seconds[0]),
               tokens_per_s=float(batch / np.median(times)), fill_s=fill_s,
               device_bytes=dev_b, device_bytes_per_request=dev_b / batch, host_bytes=host_b)
    if eng.metrics is not None:
        snap = eng.metrics.snapshot()
        tot = snap["total"]
        rec.update(hit_rate=tot["hit_rate"], hit_rate_per_layer=snap["per_layer"]["hit_rate"],
                   h2d_bytes_per_token=tot["h2d_bytes"] / tokens,
                   h2d_moved_bytes_per_token=tot["h2d_moved_bytes"] / tokens,
                   d2h_bytes_per_token=tot["d2h_bytes"] / tokens,
                   misses_per_token=tot["misses"] / tokens)
    eng.check_no_leaks()
    del eng
    gc.collect()
    return rec


def bench_context(model, base, context: int) -> dict:
    """Baseline and offload at the same batch, then offload at its largest batch."""
    gen = FLAGS.warmup + FLAGS.steps + 2
    budget = FLAGS.device_budget_gb * 1e9
    probe = {o: bench_config(base, context, gen, 1, o) for o in (False, True)}
    wfmt = "f32" if base.model.dtype == "float32" else "bf16"
    per_req = {}
    max_b, capped = {}, {}
    for name, off in (("baseline", False), ("offload", True)):
        pr = plan.per_request_bytes(probe[off], probe[off].engine.max_context_len, off)
        per_req[name] = pr["indexer"] + pr["latent_device"]
        by_budget = plan.max_batch(probe[off], budget, offload=off, weight_format=wfmt)
        max_b[name] = min(by_budget, FLAGS.max_batch_cap, ram_cap(probe[off], context, off))
        capped[name] = max_b[name] < by_budget
    if max_b["baseline"] < 1:
        raise app.UsageError(f"--device_budget_gb={FLAGS.device_budget_gb} fits no baseline "
                             f"request at context {context}")
    same_b = FLAGS.batch or max_b["baseline"]
    runs = [run_one(model, bench_config(base, context, gen, same_b, False), context,
                    f"baseline b={same_b}"),
            run_one(model, bench_config(base, context, gen, same_b, True), context,
                    f"offload b={same_b}")]
    if max_b["baseline"] != same_b:
        runs.append(run_one(model, bench_config(base, context, gen, max_b["baseline"], False),
                            context, f"baseline b={max_b['baseline']}"))
    if max_b["offload"] != same_b:
        runs.append(run_one(model, bench_config(base, context, gen, max_b["offload"], True),
                            context, f"offload b={max_b['offload']}"))
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


def table(report: dict) -> str:
    lines = []
    for c in report["contexts"]:
        lines.append(f"context {c['context']}: budget {c['budget_bytes'] / 1e9:.2f} GB; device "
                     f"MB/request baseline {c['device_bytes_per_request']['baseline'] / 1e6:.1f}"
                     f", offload {c['device_bytes_per_request']['offload'] / 1e6:.1f}")
        lines.append(f"  {'run':<16} {'batch':>5} {'step ms':>9} {'tok/s':>8} {'hit':>6} "
                     f"{'H2D B/tok':>10} {'dev MB/req':>10}")
        for r in c["runs"]:
            hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "-"
            h2d = f"{r['h2d_bytes_per_token']:.0f}" if "h2d_bytes_per_token" in r else "-"
            lines.append(f"  {r['label']:<16} {r['batch']:5d} {r['step_s_median'] * 1e3:9.1f} "
                         f"{r['tokens_per_s']:8.2f} {hit:>6} {h2d:>10} "
                         f"{r['device_bytes_per_request'] / 1e6:10.1f}")
        cap = " (capped by RAM/--max_batch_cap)" if any(
            c["max_batch_capped_by_ram_or_flag"].values()) else ""
        lines.append(f"  (a) same batch {c['same_batch']}: offload/baseline step time "
                     f"{c['same_batch_step_ratio']:.3f} (target <= 1.10)")
        lines.append(f"  (b) max batch baseline {c['max_batch']['baseline']}, offload "
                     f"{c['max_batch']['offload']}{cap}: batch x{c['batch_ratio']:.2f}, "
                     f"tokens/s x{c['tokens_per_s_ratio']:.2f}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Left: step time at the same batch; right: tokens/s against batch per side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ctxs = report["contexts"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(ctxs))
    for j, (off, name) in enumerate(((False, "baseline"), (True, "offload"))):
        ms = [next(r for r in c["runs"] if r["offload"] == off and r["batch"] == c["same_batch"])
              ["step_s_median"] * 1e3 for c in ctxs]
        ax1.bar(x + (j - 0.5) * 0.4, ms, 0.4, label=name)
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


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    contexts = [int(c) for c in FLAGS.contexts]
    if any(c < 1 for c in contexts):
        raise app.UsageError(f"--contexts={FLAGS.contexts}: allowed positive integers")
    for name in ("steps", "warmup"):
        if getattr(FLAGS, name) < 1:
            raise app.UsageError(f"--{name}={getattr(FLAGS, name)}: allowed an integer >= 1")
    base = load_config(FLAGS.config)
    cfg0 = bench_config(base, max(contexts), 1, 1, True)
    model = DeepseekV32(cfg0.model, rngs=nnx.Rngs(FLAGS.seed))
    shape_model(model, FLAGS.embed_common, FLAGS.seed)
    m = cfg0.model
    desc = (f"{m.num_hidden_layers} layers, hidden {m.hidden_size}, kv_lora {m.kv_lora_rank}, "
            f"topk {m.index_topk}, {cfg0.cache.kv_format} rows ({cfg0.row_bytes} B), "
            f"{cfg0.cache.indexer_key_format} keys ({cfg0.indexer_key_bytes} B), "
            f"hot {cfg0.staging_capacity} rows")
    machine = (f"{platform.machine()} {os.cpu_count()} cores, {jax.devices()[0].platform}, "
               f"jax {jax.__version__}")
    t0 = time.perf_counter()
    report = dict(machine=machine, model=desc, config=FLAGS.config,
                  command=" ".join(sys.argv),
                  flags={k: FLAGS[k].value for k in (
                      "contexts", "batch", "steps", "warmup", "layers", "topk", "staging",
                      "device_budget_gb", "embed_common", "impl", "seed")},
                  contexts=[bench_context(model, base, c) for c in contexts])
    report["wall_s"] = time.perf_counter() - t0
    out = FLAGS.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(report))
    print(f"{desc}; {machine}; wall {report['wall_s']:.0f} s; JSON {out}")
    if FLAGS.plot != "none":
        png = FLAGS.plot or os.path.splitext(out)[0] + ".png"
        plot(report, png)
        print(f"plot {png}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
